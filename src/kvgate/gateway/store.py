"""The session books on disk: a gateway restarted on its ``--state-dir`` goes on where it stopped.

Theory of operation. Every engine's cache outlives a gateway restart, and the engines cannot tell a new gateway
what its sessions demand (KV-event replay covers recent steps only; blocks cached earlier are never announced
again). So the gateway keeps its books in an embedded store, ``STATE_DIR/gateway.sqlite`` (SQLite in WAL mode):

* **What is kept**: every named or lineage session (its id, client, source, parent, state in the policy, demand,
  context and output budget, turns, the estimator's carry, its lineage trail, prefix breaks, its last answer id),
  and the gateway's own: its clock, the think times (the release bound), lineage's counts, the control in force
  and a scheduled switch. One-turn sessions are not kept.
* **When**: a session's row is written after each change of it that matters (its turn started, its boundary was
  asked, its turn ended, it was released or ended): the session layer marks it, and a flush task writes what was
  marked every ``--state-flush`` real seconds (default 0.1) in one transaction, in a thread, off the request path.
  A clean stop flushes last.
* **Restart**: the gateway reads the store before it listens. Its clock continues from the stored gateway time
  plus the time it was down. Admitted sessions (running or thinking at the kill) are admitted again, thinking, with
  their demand d_s, so D is back at once; sessions held by the policy at the kill (their requests died with the
  process) and released ones come back as released: out of D, their turn asked anew when their client retries.
  Lineage's index is rebuilt from the trails, so a conversation that names nothing is found again.

What a crash can lose: the changes of the last ``--state-flush`` seconds (a session that arrived or ended then is
missing or comes back; a demand is one turn old), and every turn in flight or held at the kill (their clients see
the connection drop: 5xx or a reset, and retry). It cannot lose the admitted sessions of D, their lineage, or what
made the release bound. An engine restarted meanwhile is not the gateway's to know: its sessions pay a miss.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sqlite3
import time
from pathlib import Path
from typing import Any

import orjson

from kvgate.errors import UsageError
from kvgate.gateway.bookstore import VERSION, BookStore, Rows
from kvgate.http.openai import one_line

log = logging.getLogger("kvgate.gateway")

FILE = "gateway.sqlite"
_TABLES = {"sessions": ["sid", "row"], "meta": ["key", "value"]}


def open_store(url: str) -> BookStore:
    """The store a URL names: ``redis://HOST:PORT/DB`` (:mod:`kvgate.gateway.store_redis`), ``sqlite:///DIR``
    or a plain directory (the embedded SQLite store of ``--state-dir``)."""
    if url.startswith(("redis://", "rediss://", "unix://")):
        from kvgate.gateway.store_redis import RedisStore

        return RedisStore(url)
    if url.startswith("sqlite://"):
        url = url.removeprefix("sqlite://")
    elif "://" in url:
        raise UsageError(f"--store {url}: not a store URL (redis://HOST:PORT/DB, sqlite:///DIR or a directory)")
    return SqliteStore(Path(url))


class SqliteStore:
    """The SQLite file of the books: ``sessions(sid, row)`` and ``meta(key, value)``, rows as JSON."""

    errors: tuple[type[BaseException], ...] = (sqlite3.Error, OSError)

    def __init__(self, directory: Path) -> None:
        self.path = directory / FILE
        self.url = str(self.path)
        try:
            directory.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(directory / FILE, check_same_thread=False, isolation_level=None)
        except (OSError, sqlite3.Error) as e:
            raise UsageError(f"--state-dir {directory}: {one_line(e, 300)}") from None
        try:
            self._check()
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute("PRAGMA synchronous=NORMAL")  # a killed process loses nothing committed
            self.db.execute("CREATE TABLE IF NOT EXISTS sessions (sid TEXT PRIMARY KEY, row BLOB NOT NULL)")
            self.db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value BLOB NOT NULL)")
        except sqlite3.Error as e:
            self.db.close()
            raise self._corrupt(one_line(e, 200)) from None
        except UsageError:
            self.db.close()
            raise

    def _check(self) -> None:
        """Refuse a file that is not kvgate's books: a foreign schema, or pages SQLite finds damaged."""
        tables = {name: [c[1] for c in self.db.execute(f"PRAGMA table_info('{name}')")]
                  for (name,) in self.db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
        foreign = sorted(n for n, cols in tables.items() if _TABLES.get(n, cols) != cols or n not in _TABLES)
        if foreign:
            raise self._corrupt(f"not kvgate's books: table {', '.join(foreign)}")
        if tables:
            bad = [r[0] for r in self.db.execute("PRAGMA quick_check")]
            if bad != ["ok"]:
                raise self._corrupt(one_line("; ".join(map(str, bad)), 200))

    def _corrupt(self, detail: str) -> UsageError:
        return UsageError(f"--state-dir: {self.path} is not readable as kvgate's books ({detail}); move it aside "
                          f"(mv {self.path} {self.path}.bad, with its -wal and -shm files) to start with empty books")

    def load(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        """The meta and every session row (empty for a new store)."""
        try:
            meta = {k: orjson.loads(v) for k, v in self.db.execute("SELECT key, value FROM meta")}
            rows = [orjson.loads(r) for (r,) in self.db.execute("SELECT row FROM sessions")]
        except (sqlite3.Error, orjson.JSONDecodeError) as e:
            raise self._corrupt(one_line(e, 200)) from None
        if meta and meta.get("version") != VERSION:
            raise UsageError(f"--state-dir: {self.path} was written by another version of kvgate's books "
                             f"({meta.get('version')}, this one reads {VERSION}); give another directory")
        if any(type(r) is not dict or "sid" not in r for r in rows):
            raise self._corrupt("a session row that is not one")
        return meta, rows

    def write(self, meta: dict[str, Any], rows: Rows, gone: list[str]) -> None:
        """One transaction: the meta, the changed rows, the ended sessions out."""
        db = self.db
        db.execute("BEGIN")
        try:
            db.executemany("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)",
                           [(k, orjson.dumps(v)) for k, v in meta.items()])
            if rows:
                db.executemany("INSERT OR REPLACE INTO sessions (sid, row) VALUES (?, ?)", rows)
            if gone:
                db.executemany("DELETE FROM sessions WHERE sid = ?", [(g,) for g in gone])
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def close(self) -> None:
        self.db.close()


Store = SqliteStore
"""(The name the embedded store had before :func:`open_store`.)"""


class Keeper:
    """Writes the marked sessions' rows every ``interval_s`` (real seconds) from a task, in a thread; ``rows`` and
    ``meta`` are callables that snapshot them in the loop (:mod:`kvgate.gateway.books`)."""

    def __init__(self, store: BookStore, interval_s: float) -> None:
        self.store = store
        self.interval_s = interval_s
        self.flushes = 0
        self.written = 0
        self.errors = 0
        self.last_flush_s = 0.0
        """Real seconds the last flush took (its write, in the thread)."""
        self._task: asyncio.Task[None] | None = None
        self._snapshot: Any = None

    def start(self, snapshot: Any) -> None:
        """Flush ``snapshot()`` -> ``(meta, rows, gone)`` every interval from now on."""
        self._snapshot = snapshot
        self._task = asyncio.get_running_loop().create_task(self._run(), name="kvgate-gateway-store")

    async def _run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            await self.flush()

    async def flush(self) -> None:
        if self._snapshot is None:
            return
        meta, rows, gone = self._snapshot()
        t0 = time.perf_counter()
        try:
            await asyncio.to_thread(self.store.write, meta, rows, gone)
        except self.store.errors as e:
            self.errors += 1
            log.warning("state store write failed", extra={"event": "store_error", "detail": one_line(e, 300)})
            return
        self.last_flush_s = time.perf_counter() - t0
        self.flushes += 1
        self.written += len(rows) + len(gone)

    async def stop(self) -> None:
        """Stop the task, flush what is left, close the store."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        await self.flush()
        self.store.close()

    def stats(self) -> dict[str, Any]:
        return {"path": self.store.url, "flushes": self.flushes, "rows_written": self.written,
                "errors": self.errors, "last_flush_ms": round(self.last_flush_s * 1000, 3),
                "interval_s": self.interval_s}
