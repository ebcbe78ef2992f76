"""The gateway's HTTP/1.1 server: asyncio protocols and httptools' request parser (llhttp, as in uvicorn).

Why not aiohttp's server: on the gateway's request path its per-request object graph (request, payload stream,
writer, response, their futures and timers) cost about as much CPU as everything else the gateway does, and
that cost grew with the number of requests in flight (cache pressure: 256 in-flight requests' objects do not
fit where 64 did). A proxy needs little of it: here a request is parsed into one small object with its whole
body, handled by one task, and its response goes out in one write (a whole body) or chunk by chunk (a stream).

What it does:

* HTTP/1.1 keep-alive and HTTP/1.0; pipelined requests are answered in order, one at a time per connection;
  ``Expect: 100-continue`` is answered; bodies by ``Content-Length`` or chunked, up to ``max_body`` bytes (else
  413 and the connection closes: the rest of the body is not read).
* One task per request runs ``handler(request)``; if the client goes away meanwhile, the task is cancelled (the
  cancellation lands wherever the handler waits), as aiohttp's ``handler_cancellation`` does.
* :class:`Response` (whole body, ``Content-Length``) or :class:`StreamResponse` (``prepare``, ``write``,
  ``write_eof``; chunked, or close-delimited for HTTP/1.0; writes wait while the client's socket buffer is full).
* Errors it answers itself with an OpenAI-style JSON body: 400 (malformed request), 413 (body too large), 431
  (request line and headers over 64 KiB), 500 (the handler raised). A request to upgrade the protocol
  (WebSocket, h2c) is answered as plain HTTP/1.1 and the connection then closes, as RFC 9110 lets a server
  decline an upgrade.
* Idle keep-alive connections close after ``keepalive_s``; a connection that sends half a request and stalls
  closes after the same time. One sweep a second, no timer per request.
* :meth:`HttpServer.shutdown`: stop listening, close idle connections, let requests being handled finish within
  a grace period, then cancel them and close everything.

It trusts httptools for parsing (what a client sends never reaches the handler unparsed) and writes no header a
handler did not give it except ``Content-Length`` / ``Transfer-Encoding``, ``Connection: close`` when closing,
and ``Date``.
"""

from __future__ import annotations

import asyncio
import contextlib
import http
import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Mapping
from email.utils import formatdate
from typing import Any
from urllib.parse import unquote

import httptools
import orjson
from multidict import CIMultiDict

from kvgate.errors import KvgateError
from kvgate.http.openai import error_body

log = logging.getLogger("kvgate.server")

Headers = Mapping[str, str] | Iterable[tuple[str, str]] | None
Handler = Callable[["Request"], Awaitable["Response"]]

_REASONS = {s.value: s.phrase.encode() for s in http.HTTPStatus}
_OWN = frozenset({"content-length", "transfer-encoding", "connection"})
MAX_HEAD_BYTES = 64 << 10
"""Request line and headers together, at most (else 431 and the connection closes)."""
"""Headers the server writes itself; a handler's are dropped."""


class Request:
    """One parsed request with its whole body."""

    __slots__ = ("method", "raw_path", "path", "headers", "body", "version", "keep_alive", "_conn")

    def __init__(self, method: str, raw_path: str, headers: CIMultiDict[str], version: str, conn: _Conn) -> None:
        self.method = method
        self.raw_path = raw_path
        """The target's path and query as sent (an absolute-form target reduced to them)."""
        self.path = unquote(raw_path.partition("?")[0])
        """The path, percent-decoded."""
        self.headers = headers
        self.body = b""
        self.version = version
        self.keep_alive = True
        self._conn = conn

    @property
    def remote(self) -> str | None:
        """The client's address."""
        peer = self._conn.peer
        return str(peer[0]) if peer else None

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
        lines = [b"HTTP/1.1 %d %s\r\n" % (self.status, _REASONS.get(self.status, b""))]
        date = False
        for k, v in self.headers:
            lk = k.lower()
            if lk in _OWN:
                continue
            date = date or lk == "date"
            lines.append(f"{k}: {v}\r\n".encode("latin-1", "replace"))
        if not date:
            lines.append(_date_line())
        if not request.keep_alive:
            lines.append(b"Connection: close\r\n")
        lines.append(extra)
        lines.append(b"\r\n")
        return b"".join(lines)

    def _serialize(self, request: Request) -> bytes:
        if request.method == "HEAD" or self.status in (204, 304):
            return self._head(request, b"")
        return self._head(request, b"Content-Length: %d\r\n" % len(self.body)) + self.body


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
        self._conn: _Conn | None = None
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


def _date_line() -> bytes:
    now = int(time.time())
    if _date_cache[0] != now:
        _date_cache[0] = now
        _date_cache[1] = f"Date: {formatdate(now, usegmt=True)}\r\n".encode()
    return _date_cache[1]  # type: ignore[no-any-return]


class _Conn(asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: Any = None
        self.peer: Any = None
        self.parser = httptools.HttpRequestParser(self)
        self.url = b""
        self.raw_headers: list[tuple[str, str]] = []
        self.head_size = 0
        self.req: Request | None = None  # being parsed
        self.body: list[bytes] = []
        self.body_size = 0
        self.queue: deque[Request] = deque()
        self.task: asyncio.Task[None] | None = None
        self.closed = False
        self.paused_reading = False
        self.paused_writing = False
        self.drain_waiter: asyncio.Future[None] | None = None
        self.last_active = self.loop.time()
        self.rejected = False

    # -- asyncio.Protocol --------------------------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.peer = transport.get_extra_info("peername")
        self.server._conns.add(self)

    def data_received(self, data: bytes) -> None:
        self.last_active = self.loop.time()
        if self.rejected:
            return
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserUpgrade:
            pass  # the request was answered as plain HTTP/1.1 (below); what follows it is not read
        except httptools.HttpParserError as e:
            if not self.rejected:
                self._reject(400, f"malformed HTTP request: {e}", "ClientError")

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self.server._conns.discard(self)
        if self.task is not None and not self.task.done():
            self.task.cancel()  # the client went away: wherever the handler waits, it stops
        w = self.drain_waiter
        if w is not None and not w.done():
            w.set_exception(ConnectionResetError("the client went away"))

    def pause_writing(self) -> None:
        self.paused_writing = True

    def resume_writing(self) -> None:
        self.paused_writing = False
        w = self.drain_waiter
        if w is not None and not w.done():
            w.set_result(None)

    # -- httptools callbacks -----------------------------------------------------------------------------------
    def on_message_begin(self) -> None:
        self.url = b""
        self.raw_headers = []
        self.head_size = 0
        self.body = []
        self.body_size = 0

    def on_url(self, url: bytes) -> None:
        self.url += url
        self._count_head(len(url))

    def on_header(self, name: bytes, value: bytes) -> None:
        if not self.rejected:
            self.raw_headers.append((name.decode("latin-1"), value.decode("latin-1")))
            self._count_head(len(name) + len(value))

    def _count_head(self, n: int) -> None:
        self.head_size += n
        if self.head_size > MAX_HEAD_BYTES and not self.rejected:
            self._reject(431, f"the request line and headers are over {MAX_HEAD_BYTES} bytes", "HeadersTooLarge")

    def on_headers_complete(self) -> None:
        if self.rejected:
            return
        parser = self.parser
        target = self.url.decode("latin-1")
        if not target.startswith("/"):
            if target == "*" or not target:
                raw_path = "/"
            else:  # absolute form: only its path and query count (where a request goes is not the client's call)
                parsed = httptools.parse_url(self.url)
                raw_path = (parsed.path or b"/").decode("latin-1")
                if parsed.query:
                    raw_path += "?" + parsed.query.decode("latin-1")
        else:
            raw_path = target
        headers: CIMultiDict[str] = CIMultiDict(self.raw_headers)
        req = Request(parser.get_method().decode("latin-1"), raw_path, headers, parser.get_http_version(), self)
        req.keep_alive = parser.should_keep_alive()
        self.req = req
        if parser.should_upgrade():  # WebSocket, h2c: declined by answering in HTTP/1.1, then closing
            req.keep_alive = False
        size = headers.get("Content-Length")
        limit = self.server.max_body
        if size is not None and size.isdigit() and int(size) > limit:
            self._reject(413, f"the body ({size} bytes) is over the limit of {limit} bytes", "BodyTooLarge")
            return
        if headers.get("Expect", "").lower() == "100-continue" and self.transport is not None:
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

    def on_body(self, body: bytes) -> None:
        if self.rejected:
            return
        self.body_size += len(body)
        if self.body_size > self.server.max_body:
            self._reject(413, f"the body is over the limit of {self.server.max_body} bytes", "BodyTooLarge")
            return
        self.body.append(body)

    def on_message_complete(self) -> None:
        req = self.req
        if req is None or self.rejected:
            return
        self.req = None
        body = self.body
        req.body = body[0] if len(body) == 1 else b"".join(body)
        self.body = []
        if self.task is None:
            self.task = self.loop.create_task(self._serve(req))
        else:
            self.queue.append(req)
            if len(self.queue) >= 8 and not self.paused_reading:  # a client pipelining far ahead: wait for it
                self.paused_reading = True
                self.transport.pause_reading()

    # -- serving -----------------------------------------------------------------------------------------------
    async def _serve(self, req: Request) -> None:
        server = self.server
        while True:
            server._busy += 1
            try:
                resp = await server.handler(req)
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("request handler failed", extra={"event": "handler_error", "path": req.path})
                resp = Response(body=error_body(500, "internal error", "InternalError"), status=500,
                                content_type="application/json")
            finally:
                server._busy -= 1
            if self.closed:
                break
            if server.stopping or self.rejected:
                req.keep_alive = False
            if isinstance(resp, StreamResponse) and resp.prepared:
                if not resp._done:
                    with contextlib.suppress(ConnectionError):
                        await resp.write_eof()
            else:
                self.write(resp._serialize(req))
            self.last_active = self.loop.time()
            if not req.keep_alive:
                self.close()
                break
            if not self.queue:
                break
            req = self.queue.popleft()
            if self.paused_reading and len(self.queue) < 4:
                self.paused_reading = False
                self.transport.resume_reading()
        self.task = None

    def write(self, data: bytes) -> None:
        if not self.closed:
            self.transport.write(data)

    async def drain(self) -> None:
        if self.closed:
            raise ConnectionResetError("the client went away")
        if not self.paused_writing:
            return
        self.drain_waiter = fut = self.loop.create_future()
        try:
            await fut
        finally:
            self.drain_waiter = None

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.server._conns.discard(self)
            if self.transport is not None:
                self.transport.close()

    def _reject(self, status: int, message: str, kind: str) -> None:
        """Answer an error the request never reaches a handler for, and close the connection."""
        self.rejected = True
        if self.task is None and self.transport is not None and not self.closed:
            body = error_body(status, message, kind)
            self.transport.write(
                b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n"
                b"%s\r\n%s" % (status, _REASONS.get(status, b""), len(body), _date_line(), body)
            )
            self.close()
        elif self.task is not None:  # a pipelined request went wrong: finish the one in hand, then close
            self.queue.clear()
            self.transport.pause_reading()

    @property
    def idle(self) -> bool:
        return self.task is None and self.req is None


class HttpServer:
    """Serve ``handler`` on a TCP port (see the module's docstring)."""

    def __init__(self, handler: Handler, *, max_body: int = 32 << 20, keepalive_s: float = 75.0) -> None:
        self.handler = handler
        self.max_body = max_body
        self.keepalive_s = keepalive_s
        self.loop = asyncio.get_running_loop()
        self.stopping = False
        self._conns: set[_Conn] = set()
        self._busy = 0
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    def load(self) -> dict[str, int]:
        """``connections`` open now and requests being ``handled``."""
        return {"connections": len(self._conns), "handled": self._busy}

    async def start(self, host: str, port: int, backlog: int = 1024) -> int:
        """Listen; returns the bound port (useful with port 0)."""
        self._server = await self.loop.create_server(
            lambda: _Conn(self), host, port, backlog=backlog, reuse_address=True
        )
        self._sweeper = self.loop.call_later(1.0, self._sweep)
        return int(self._server.sockets[0].getsockname()[1])

    async def shutdown(self, grace_s: float) -> None:
        """Stop accepting; close idle connections; requests being handled get ``grace_s`` seconds, then are
        cancelled; every connection is closed."""
        self.stopping = True
        if self._server is not None:
            self._server.close()
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in list(self._conns):
            if conn.idle:
                conn.close()
        tasks = [c.task for c in self._conns if c.task is not None]
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=grace_s)
            for t in pending:
                t.cancel()
            if pending:
                await asyncio.wait(pending, timeout=1.0)
        for conn in list(self._conns):
            conn.close()
        if self._server is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(self._server.wait_closed(), 1.0)
            self._server = None

    def _sweep(self) -> None:
        now = self.loop.time()
        limit = now - self.keepalive_s
        for conn in list(self._conns):
            if conn.task is None and conn.last_active < limit:
                conn.close()
        self._sweeper = self.loop.call_later(1.0, self._sweep)
