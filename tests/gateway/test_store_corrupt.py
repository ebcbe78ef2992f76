"""A state DB that SQLite opens but that is not kvgate's books, or whose pages are damaged: ``kvgate gateway`` says
so in one line naming the file and what to do (move it aside), exit 2, never a traceback."""

from __future__ import annotations

import os
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import orjson
import pytest

from kvgate.gateway.store import FILE, SqliteStore
from support.ports import free_port


def books(path: Path) -> Path:
    """A real store of 400 sessions (many pages), closed."""
    st = SqliteStore(path)
    st.write({"version": 1, "now_s": 1.0},
             [(f"s{i}", orjson.dumps({"sid": f"s{i}", "pad": "x" * 300})) for i in range(400)], [])
    st.close()
    return path / FILE


def flipped_page(d: Path) -> None:
    db = books(d)
    data = bytearray(db.read_bytes())
    page = 4096
    assert len(data) > 8 * page
    for i in range(3 * page, 4 * page):  # one page in the middle, every byte flipped
        data[i] ^= 0xFF
    db.write_bytes(bytes(data))


def foreign_schema(d: Path) -> None:
    d.mkdir(parents=True)
    with sqlite3.connect(d / FILE) as db:
        db.execute("CREATE TABLE users (id INTEGER PRIMARY KEY, name TEXT)")
        db.execute("INSERT INTO users (name) VALUES ('ann')")


def wrong_columns(d: Path) -> None:
    d.mkdir(parents=True)
    with sqlite3.connect(d / FILE) as db:
        db.execute("CREATE TABLE sessions (id INTEGER PRIMARY KEY, data TEXT)")
        db.execute("INSERT INTO sessions (data) VALUES ('{}')")


def not_json(d: Path) -> None:
    books(d)
    with sqlite3.connect(d / FILE) as db:
        db.execute("UPDATE sessions SET row = x'00ff' WHERE sid = 's7'")


CASES: dict[str, Callable[[Path], None]] = {"flipped-page": flipped_page, "foreign-schema": foreign_schema,
                                            "wrong-columns": wrong_columns, "not-json": not_json}


@pytest.mark.parametrize("case", list(CASES))
def test_a_corrupt_state_db_is_one_line_and_exit_2(tmp_path: Path, case: str) -> None:
    state = tmp_path / "state"
    CASES[case](state)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), "src") if p)}
    r = subprocess.run([sys.executable, "-m", "kvgate.cli", "gateway", "--upstream", "http://127.0.0.1:9",
                        "--kv-pool", "100000", "--port", str(free_port()), "--state-dir", str(state),
                        "--log-level", "error"], env=env, capture_output=True, text=True, timeout=60)
    err = r.stderr.strip()
    assert r.returncode == 2, err[-2000:]
    assert "Traceback" not in err and len(err.splitlines()) == 1, err[-2000:]
    assert str(state / FILE) in err and "move it aside" in err, err
