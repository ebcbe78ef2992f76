"""The messages of the gateway's HTTP/1.1 server (:mod:`kvgate.http.server`): a parsed :class:`Request`, and a
:class:`Response` (whole body) or :class:`StreamResponse` (written as it comes) for it."""

from __future__ import annotations

import asyncio
import http
import time
from collections.abc import Iterable, Mapping
from email.utils import formatdate
from typing import Any
from urllib.parse import unquote

import orjson
from multidict import CIMultiDict

from kvgate.errors import KvgateError
from kvgate.http.openai import error_body

Headers = Mapping[str, str] | Iterable[tuple[str, str]] | None

REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}
"""Reason phrases by status."""
_OWN = frozenset({"content-length", "transfer-encoding", "connection"})
"""Headers the server writes itself; a handler's are dropped."""
_SPLIT_WRITE = 1 << 16
"""A whole body at least this long is written after its head, not joined to it (no second copy of it)."""


class Request:
    """One parsed request with its whole body."""

    __slots__ = ("method", "raw_path", "path", "headers", "body", "version", "keep_alive", "_conn", "_held")

    def __init__(self, method: str, raw_path: str, headers: CIMultiDict[str], version: str, conn: Any) -> None:
        self.method = method
        self.raw_path = raw_path
        """The target's path and query as sent (an absolute-form target reduced to them)."""
        path = raw_path.partition("?")[0]
        self.path = unquote(path) if "%" in path else path
        """The path, percent-decoded."""
        self.headers = headers
        self.body = b""
        self.version = version
        self.keep_alive = True
        self._conn = conn
        self._held = 0  # body bytes counted against the server's budget of bodies in flight

    @property
    def remote(self) -> str | None:
        """The client's address."""
        peer = self._conn.peer
        return str(peer[0]) if peer else None

    def serving_task(self) -> asyncio.Task[Any] | None:
        """The task the request's handler runs in: its connection's (the server serves a connection's requests in
        one task, in turn), without ``asyncio.current_task()`` (a ``getpid`` on every call in Python 3.11)."""
        task = getattr(self._conn, "task", None)
        return task if task is not None else asyncio.current_task()

    def close_connection(self) -> None:
        """Close the client's connection now (a response that has begun can no longer say what went wrong)."""
        self._conn.transport.close()


class Response:
    """A response with its whole body."""

    __slots__ = ("status", "body", "headers")

    def __init__(
        self, *, body: bytes = b"", status: int = 200, headers: Headers = None, content_type: str | None = None
    ) -> None:
        self.status = status
        self.body = body
        items = list(headers.items() if isinstance(headers, Mapping) else headers or ())
        if content_type is not None:
            items.append(("Content-Type", content_type))
        self.headers = items

    def _head(self, request: Request, extra: bytes) -> bytes:
        fields = "".join([f"{k}: {v}\r\n" for k, v in self.headers if k.lower() not in _OWN])
        low = fields.lower()
        date = b"" if low.startswith("date:") or "\ndate:" in low else date_line()  # (unless the handler gave one)
        return b"HTTP/1.1 %d %s\r\n%b%b%b%b\r\n" % (
            self.status, REASONS.get(self.status, b""), fields.encode("latin-1", "replace"), date,
            b"" if request.keep_alive else b"Connection: close\r\n", extra)

    def _serialize(self, request: Request) -> tuple[bytes, bytes]:
        """``(head, body)``; a short body joined to its head (one write), a long one apart."""
        if request.method == "HEAD" or self.status in (204, 304):
            return self._head(request, b""), b""
        body = self.body
        head = self._head(request, b"Content-Length: %d\r\n" % len(body))
        if len(body) >= _SPLIT_WRITE:
            return head, body
        return head + body, b""


def json_response(obj: Any, status: int = 200, headers: Headers = None) -> Response:
    """``obj`` as a JSON body."""
    return Response(status=status, body=orjson.dumps(obj), content_type="application/json", headers=headers)


def error_response(status: int, message: str, kind: str, headers: Headers = None) -> Response:
    """An error as OpenAI-compatible servers answer them: ``{"error": {"message", "type", "param", "code"}}``."""
    return Response(status=status, body=error_body(status, message, kind), content_type="application/json",
                    headers=headers)


def exc_response(e: KvgateError, headers: Headers = None) -> Response:
    """One of kvgate's errors as an error response: its status, message and class name."""
    return error_response(e.http_status, str(e), type(e).__name__, headers)


class StreamResponse(Response):
    """A response whose body is written as it comes: :meth:`prepare`, then :meth:`write`, then
    :meth:`write_eof`. Writes raise ``ConnectionResetError`` once the client is gone."""

    __slots__ = ("_conn", "_chunked", "_done")

    def __init__(self, *, status: int = 200, headers: Headers = None) -> None:
        super().__init__(status=status, headers=headers)
        self._conn: Any | None = None
        self._chunked = True
        self._done = False

    @property
    def prepared(self) -> bool:
        return self._conn is not None

    async def prepare(self, request: Request) -> None:
        conn = request._conn
        if conn.closed:
            raise ConnectionResetError("the client went away")
        if request.version == "1.0":  # no chunked encoding: the end of the connection ends the body
            self._chunked = False
            request.keep_alive = False
        self._conn = conn
        head = self._head(request, b"Transfer-Encoding: chunked\r\n" if self._chunked else b"")
        conn.write(head)

    async def write(self, data: bytes) -> None:
        conn = self._conn
        assert conn is not None, "write before prepare"
        if conn.closed:
            raise ConnectionResetError("the client went away")
        if not data:
            return
        conn.write(b"%x\r\n%s\r\n" % (len(data), data) if self._chunked else data)
        if conn.paused_writing:
            await conn.drain()

    async def write_eof(self, data: bytes = b"") -> None:
        conn = self._conn
        assert conn is not None, "write_eof before prepare"
        if self._done:
            return
        self._done = True
        if conn.closed:
            raise ConnectionResetError("the client went away")
        if self._chunked:
            conn.write(b"%x\r\n%s\r\n0\r\n\r\n" % (len(data), data) if data else b"0\r\n\r\n")
        elif data:
            conn.write(data)


_date_cache: list[Any] = [0, b""]


def date_line() -> bytes:
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache[0] = now
        _date_cache[1] = f"Date: {formatdate(now, usegmt=True)}\r\n".encode()
    return _date_cache[1]  # type: ignore[no-any-return]


