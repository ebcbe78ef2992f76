"""The books in Redis (``--store redis://HOST:PORT/DB``): the same contract as the embedded store
(:class:`kvgate.gateway.bookstore.BookStore`), in two hashes under the ``kvgate:`` prefix of the URL's database:
``kvgate:books:sessions`` (session id -> row) and ``kvgate:books:meta`` (key -> value), rows as JSON. A write is
one ``MULTI``/``EXEC`` transaction, so a reader sees all of a flush or none of it.

What Redis keeps across its own restart is the operator's choice (RDB snapshots, AOF, or ``--save ''``: nothing);
the gateways sharing it (:mod:`kvgate.gateway.shared`) write their books again when it comes back."""

from __future__ import annotations

from typing import Any

import orjson

from kvgate.errors import UsageError
from kvgate.gateway.bookstore import VERSION, Rows
from kvgate.http.openai import one_line

PREFIX = "kvgate:"


def redis_module() -> Any:
    """redis-py, or a one-line error saying how to get it."""
    try:
        import redis
    except ImportError:
        raise UsageError("--store redis://...: redis-py is not installed (pip install 'kvgate[redis]')") from None
    return redis


class RedisStore:
    """The books in one Redis database (see the module docstring)."""

    def __init__(self, url: str, prefix: str = PREFIX) -> None:
        redis = redis_module()
        self.url = url
        self.errors: tuple[type[BaseException], ...] = (redis.RedisError, OSError)
        self._sessions = f"{prefix}books:sessions"
        self._meta = f"{prefix}books:meta"
        try:
            self.db = redis.Redis.from_url(url, socket_timeout=5.0, socket_connect_timeout=2.0)
            self.db.ping()
        except ValueError as e:
            raise UsageError(f"--store {url}: {one_line(e, 200)}") from None
        except redis.RedisError as e:
            raise UsageError(f"--store {url}: cannot reach Redis ({one_line(e, 200)})") from None

    def load(self) -> tuple[dict[str, Any], list[dict[str, Any]]]:
        try:
            meta = {k.decode(): orjson.loads(v) for k, v in self.db.hgetall(self._meta).items()}
            rows = [orjson.loads(v) for v in self.db.hvals(self._sessions)]
        except orjson.JSONDecodeError as e:
            raise UsageError(f"--store {self.url}: {self._sessions} is not kvgate's books ({one_line(e, 200)}); "
                             f"delete its kvgate:books:* keys to start with empty books") from None
        except self.errors as e:
            raise UsageError(f"--store {self.url}: {one_line(e, 200)}") from None
        if meta and meta.get("version") != VERSION:
            raise UsageError(f"--store {self.url}: written by another version of kvgate's books "
                             f"({meta.get('version')}, this one reads {VERSION}); give another database")
        return meta, rows

    def write(self, meta: dict[str, Any], rows: Rows, gone: list[str]) -> None:
        pipe = self.db.pipeline(transaction=True)
        if meta:
            pipe.hset(self._meta, mapping={k: orjson.dumps(v) for k, v in meta.items()})
        if rows:
            pipe.hset(self._sessions, mapping=dict(rows))
        if gone:
            pipe.hdel(self._sessions, *gone)
        pipe.execute()

    def close(self) -> None:
        self.db.close()
