"""The contract every store of the books keeps (:class:`kvgate.gateway.bookstore.BookStore`), for each backend
:func:`kvgate.gateway.store.open_store` chooses: what a store opened again restores (every session's last row, no
ended one, the meta), that a write is all or nothing even when its process is SIGKILLed inside it, and what a crash
may lose (only what was never written). The Redis backend runs against a real redis-server (skipped without)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import orjson
import pytest

from kvgate.errors import UsageError
from kvgate.gateway.store import SqliteStore, open_store
from support.redis_server import RedisServer, redis_server

BACKENDS = ("sqlite", "redis")


@pytest.fixture(scope="module")
def redis_srv() -> Iterator[RedisServer]:
    with redis_server() as srv:
        yield srv


@pytest.fixture(params=BACKENDS)
def url(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "sqlite":
        return str(tmp_path / "state")
    srv: RedisServer = request.getfixturevalue("redis_srv")
    import redis

    redis.Redis.from_url(srv.url).flushdb()
    return srv.url


def row(sid: str, **kw: object) -> tuple[str, bytes]:
    return sid, orjson.dumps({"sid": sid, **kw})


def test_the_url_chooses_the_backend(tmp_path: Path) -> None:
    assert isinstance(open_store(str(tmp_path / "a")), SqliteStore)
    assert isinstance(open_store(f"sqlite://{tmp_path / 'b'}"), SqliteStore)
    with pytest.raises(UsageError, match="not a store URL"):
        open_store("memcached://127.0.0.1:1")


def test_a_store_opened_again_restores_what_was_written(url: str) -> None:
    st = open_store(url)
    assert st.load() == ({}, [])  # a new store
    st.write({"version": 1, "now_s": 1.5}, [row("a", turns=1), row("b", turns=1), row("c", turns=1)], [])
    st.write({"now_s": 2.5, "lineage_n": 3}, [row("a", turns=2)], ["b"])
    st.write({}, [], ["never-written"])  # (an ended session that was never written: nothing to remove)
    st.close()
    meta, rows = open_store(url).load()
    assert meta == {"version": 1, "now_s": 2.5, "lineage_n": 3}  # each key's last value
    assert sorted(rows, key=lambda r: r["sid"]) == [{"sid": "a", "turns": 2}, {"sid": "c", "turns": 1}]


def test_another_version_of_the_books_is_refused(url: str) -> None:
    st = open_store(url)
    st.write({"version": 99}, [], [])
    st.close()
    with pytest.raises(UsageError, match="another version"):
        open_store(url).load()


CHILD = """
import sys, orjson
from kvgate.gateway.store import open_store
st = open_store(sys.argv[1])
n = 0
while True:
    n += 1
    rows = [(f"s{i}", orjson.dumps({"sid": f"s{i}", "batch": n, "pad": "x" * 2000})) for i in range(300)]
    st.write({"version": 1, "batch": n}, rows, [f"s{300 + n - 1}"] if n > 1 else [])
    st.write({}, [(f"s{300 + n}", orjson.dumps({"sid": f"s{300 + n}", "batch": n}))], [])
    print(n, flush=True)
"""


def test_a_write_killed_inside_is_all_or_nothing_and_loses_only_what_was_unwritten(url: str) -> None:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), "src") if p)}
    proc = subprocess.Popen([sys.executable, "-c", CHILD, url], stdout=subprocess.PIPE, env=env)
    assert proc.stdout is not None
    done = 0
    try:
        for line in proc.stdout:
            done = int(line)
            if done >= 25:
                break
    finally:
        proc.send_signal(signal.SIGKILL)  # (mid-write, most likely: the child writes without pause)
        proc.wait(10)
    assert done >= 25, "the writer did not get going"
    meta, rows = open_store(url).load()
    batch = meta["batch"]
    assert batch >= done  # nothing written is lost
    by_sid = {r["sid"]: r for r in rows}
    assert len(by_sid) == len(rows)
    main = [r for r in rows if int(r["sid"][1:]) < 300]
    assert len(main) == 300 and {r["batch"] for r in main} == {batch}  # one whole write, never a part of one
    extra = sorted(int(s[1:]) for s in by_sid if int(s[1:]) >= 300)
    # the batch-th write removed s(300 + batch - 1); the one after it (if it landed) added s(300 + batch)
    assert extra in ([], [300 + batch]) or extra == [300 + batch - 1] and batch == 1, extra
