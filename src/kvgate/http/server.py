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
* Errors it answers itself with an OpenAI-style JSON body: 400 (malformed request, or a head RFC 9112 says to
  refuse: :mod:`kvgate.http.framing`), 408 (a head or a body too slow), 413 (body too large, or too many JSON
  nodes), 431 (request line and headers over 64 KiB, every byte counted: :mod:`kvgate.http.reading`), 501 (a
  transfer coding but chunked), 503 (over the connection cap, or over the budget of bodies in flight, with
  ``Retry-After``), 505 (a version but HTTP/1.x), 500 (the handler raised). A pipelined request refused while
  earlier ones are in hand is answered after their responses, then the connection closes. A request to upgrade
  the protocol (WebSocket, h2c) is served as plain HTTP/1.1, its body read, and the connection then closes, as
  RFC 9110 §7.8 lets a server decline an upgrade by ignoring it.
* Field values lose the whitespace around them (RFC 9112 §5.1; llhttp keeps what trails a value).
* Its bounds (:class:`kvgate.http.limits.ServerLimits`): a deadline for a request's head, a floor on a body's
  progress, a cap on connections, on a body's size and JSON nodes, and on body bytes in flight across
  connections; what each refused is counted (:attr:`HttpServer.refused`). Idle keep-alive connections close
  after ``keepalive_s``. One sweep a second, no timer per request.
* ``100 Continue`` is written only when its request is the connection's current one: while an earlier
  pipelined response is still going out it waits for that response's end (RFC 9110 §10.1.1: it is an interim
  response to its own request).
* :meth:`HttpServer.shutdown`: stop listening, close idle connections, let requests being handled finish within
  a grace period, then cancel them and close everything.

It trusts httptools for parsing (what a client sends never reaches the handler unparsed) and writes no header a
handler did not give it except ``Content-Length`` / ``Transfer-Encoding``, ``Connection: close`` when closing,
and ``Date``.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
from collections import deque
from collections.abc import Awaitable, Callable
from typing import Any

import httptools
from multidict import CIMultiDict

from kvgate.http.framing import ChunkedEnd, head_error, http_version
from kvgate.http.guard import BODY, HEAD, IDLE, Guard
from kvgate.http.limits import MAX_HEAD_BYTES, YIELD_BODY_BYTES, NodeCounter, ServerLimits, refusal_counter
from kvgate.http.messages import (
    Headers,
    Request,
    Response,
    StreamResponse,
    error_response,
    exc_response,
    json_response,
)
from kvgate.http.openai import error_body
from kvgate.http.reading import LINE_BYTES, Reader

__all__ = ["Handler", "Headers", "HttpServer", "Request", "Response", "StreamResponse", "error_response",
           "exc_response", "json_response"]

log = logging.getLogger("kvgate.server")

Handler = Callable[[Request], Awaitable[Response]]

class Conn(Reader, Guard, asyncio.Protocol):
    """One client connection."""

    def __init__(self, server: HttpServer) -> None:
        self.server = server
        self.loop = server.loop
        self.transport: Any = None
        self.peer: Any = None
        self.parser = httptools.HttpRequestParser(self)
        self.parser.set_dangerous_leniencies(lenient_version=True)  # (any digits: HTTP/1.2 is read as 1.1, 2.0 is 505)
        self.url = b""
        self.raw_headers: list[tuple[str, str]] = []
        self.head_size = 0  # the head's bytes as its fields count them
        self.raw_head = 0  # the head's bytes as the reads bring them, every one (see _cut)
        self.tail = b""  # the last bytes of the head being read (a blank line cut between reads)
        self.chunks = ChunkedEnd()  # where the chunked body being read ends
        self.upgrading = False  # the request being read asks to upgrade the protocol
        self.reframe: bytes | None = None  # a head of its framing alone, for its body (see _read_upgrade_body)
        self.ended = False  # no further request is read on this connection
        self.refusal = b""  # the answer to a pipelined request refused, due after the responses before it
        self.req: Request | None = None  # being parsed
        self.body: list[bytes] = []
        self.body_size = 0
        self.queue: deque[Request] = deque()
        self.task: asyncio.Task[None] | None = None
        self.closed = False
        self.paused_reading = False
        self.yielding = False  # (reading paused until the loop's next step: a large body, see on_body)
        self.paused_writing = False
        self.drain_waiter: asyncio.Future[None] | None = None
        self.last_active = self.since = self.loop.time()
        self.rejected = False
        self.state = HEAD  # (a new connection waits for its first head: the head deadline runs from now)
        self.begun = False  # the current head's first byte came
        self.messages = 0
        self.held = 0  # body bytes of the request being read, counted against the server's budget
        self.expected = -1  # its Content-Length (-1: chunked)
        self.mark = (0.0, 0)  # body progress: (when, bytes read then)
        self.nodes: NodeCounter | None = None
        self.continue_due = False  # a 100 Continue to write once the responses before it are out

    # -- asyncio.Protocol --------------------------------------------------------------------------------------
    def connection_made(self, transport: Any) -> None:
        self.transport = transport
        self.peer = transport.get_extra_info("peername")
        server = self.server
        if len(server._conns) >= server.connection_cap:
            server.refused["connections"] += 1
            self.rejected = self.closed = True
            body = error_body(503, "too many connections; try again shortly", "ServiceUnavailable")
            transport.write(self.error_head(503, len(body), b"Retry-After: 1\r\n") + body)
            transport.close()
            return
        server._conns.add(self)

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self.release()
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
        self.head_size = LINE_BYTES
        self.body = []
        self.body_size = 0
        if self.state == IDLE:
            self.since = self.loop.time()
        self.state = HEAD
        self.begun = True
        self.messages += 1

    def on_url(self, url: bytes) -> None:
        self.url += url
        self._count_head(len(url))  # (once a request: on_header, called per field, counts inline)

    def on_header(self, name: bytes, value: bytes) -> None:
        self.head_size = n = self.head_size + len(name) + len(value) + 3  # (":" and CRLF: an empty field counts)
        if n > MAX_HEAD_BYTES or self.raw_head > MAX_HEAD_BYTES:
            self._count_head(0)  # (431)
        if self.state == HEAD and not self.rejected:  # (a chunked body's trailer fields count, and are dropped)
            self.raw_headers.append((name.decode("latin-1"), value.rstrip(b" \t").decode("latin-1")))

    def on_headers_complete(self) -> None:
        self.state = BODY
        self.begun = False
        self.raw_head = 0
        if self.rejected:
            return
        parser = self.parser
        server = self.server
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
        version = http_version(parser.get_http_version())
        req = Request(parser.get_method().decode("latin-1"), raw_path, headers, version, self)
        req.keep_alive = parser.should_keep_alive()
        self.req = req
        bad = head_error(version, headers)
        if bad is not None:
            self._reject(*bad)
            return
        size = headers.get("Content-Length")
        chunked = "Transfer-Encoding" in headers
        limits = server.limits
        expected = int(size) if size is not None and size.strip().isdigit() else -1
        if expected > limits.max_body:
            server.refused["body_size"] += 1
            self._reject(413, f"the body ({expected} bytes) is over the limit of {limits.max_body} bytes",
                         "BodyTooLarge")
            return
        self.expected = expected
        if expected < 0 and chunked:
            self.chunks = ChunkedEnd()
        if expected > 0 and not self.hold(expected):
            return
        self.mark = (self.loop.time(), 0)
        self.upgrading = parser.should_upgrade()
        if self.upgrading:  # WebSocket, h2c: declined by answering in HTTP/1.1, then closing (RFC 9110 §7.8)
            req.keep_alive = False
            if chunked or expected > 0:  # (the parser would skip the body: it is read on, see _read_upgrade_body)
                self.reframe = b"POST / HTTP/1.1\r\n%s\r\n\r\n" % (
                    b"Transfer-Encoding: chunked" if chunked else b"Content-Length: %d" % expected)
        if headers.get("Expect", "").lower() == "100-continue" and version == "1.1" and self.transport is not None:
            if self.task is None:
                self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")
            else:  # an earlier response is going out on this connection: after it
                self.continue_due = True

    def on_body(self, body: bytes) -> None:
        if self.rejected:
            return
        self.continue_due = False  # (the body comes anyway: no 100 needed)
        n = len(body)
        self.body_size += n
        server = self.server
        limits = server.limits
        if self.body_size > limits.max_body:
            server.refused["body_size"] += 1
            self._reject(413, f"the body is over the limit of {limits.max_body} bytes", "BodyTooLarge")
            return
        if self.body_size > self.held and not self.hold(self.body_size - self.held):  # (chunked: as it comes)
            return
        self.body.append(body)
        nodes = self.nodes
        if nodes is None and self.body_size >= 2 * limits.max_body_nodes:  # (shorter: too few bytes to pass it)
            self.nodes = nodes = NodeCounter(limits.max_body_nodes)
            body = b"".join(self.body)
        if nodes is not None and not nodes.feed(body):
            server.refused["body_nodes"] += 1
            self._reject(413, f"the body has over {limits.max_body_nodes} JSON objects and arrays (strings, "
                         "numbers and literals count 1/8 each)", "BodyTooLarge")
        elif self.body_size >= YIELD_BODY_BYTES and not self.yielding:  # (one chunk a loop step: see limits)
            self.yielding = True
            self.transport.pause_reading()
            self.loop.call_soon(self._read_on)

    def _read_on(self) -> None:
        self.yielding = False
        t = self.transport
        if not (self.closed or self.paused_reading or self.refusal) and t is not None and not t.is_closing():
            t.resume_reading()

    def on_message_complete(self) -> None:
        if self.reframe is not None:  # (an upgrade's head: its body follows, see _read_upgrade_body)
            return
        self.ended = self.upgrading  # (after an upgrade's request, nothing more is read)
        self.state = IDLE
        self.since = self.loop.time()
        self.nodes = None
        req = self.req
        if req is None or self.rejected:
            return
        self.req = None
        body = self.body
        req.body = body[0] if len(body) == 1 else b"".join(body)
        req._held, self.held = self.held, 0
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
                self.release(req)
                raise
            except Exception:
                log.exception("request handler failed", extra={"event": "handler_error", "path": req.path})
                resp = Response(body=error_body(500, "internal error", "InternalError"), status=500,
                                content_type="application/json")
            finally:
                server._busy -= 1
            self.release(req)
            if self.closed:
                break
            if server.stopping or (self.rejected and not self.refusal):
                req.keep_alive = False
            if isinstance(resp, StreamResponse) and resp.prepared:
                if not resp._done:
                    with contextlib.suppress(ConnectionError):
                        await resp.write_eof()
            else:
                head, body = resp._serialize(req)
                self.write(head)
                if body:
                    self.write(body)
            self.last_active = self.loop.time()
            if not req.keep_alive or (self.refusal and not self.queue):
                if req.keep_alive:  # (the answer to a pipelined request refused meanwhile)
                    self.write(self.refusal)
                    self.linger()
                self.close()
                break
            if not self.queue:
                break
            req = self.queue.popleft()
            if self.paused_reading and len(self.queue) < 4:
                self.paused_reading = False
                self.transport.resume_reading()
        self.task = None
        if self.continue_due and not self.closed:  # every response before it is out: now the 100
            self.continue_due = False
            self.mark = (self.loop.time(), self.body_size)
            self.transport.write(b"HTTP/1.1 100 Continue\r\n\r\n")

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
            self.close_quietly()
            if self.transport is not None:
                self.transport.close()

    def _reject(self, status: int, message: str, kind: str, extra: bytes = b"") -> None:
        """Answer an error the request never reaches a handler for, and close the connection (after the
        responses to the requests before it, when some are in hand)."""
        self.rejected = True
        self.continue_due = False
        body = error_body(status, message, kind)
        answer = self.error_head(status, len(body), extra) + body
        if self.task is None and self.transport is not None and not self.closed:
            self.transport.write(answer)
            self.linger()
        elif self.task is not None:  # a pipelined request went wrong: the ones before it first, then this answer
            self.server.body_bytes -= self.held
            self.held = 0
            self.refusal = answer
            self.transport.pause_reading()

    @property
    def idle(self) -> bool:
        return self.task is None and self.req is None

class HttpServer:
    """Serve ``handler`` on a TCP port (see the module's docstring) within ``limits`` (or the defaults with
    ``overrides``: :class:`ServerLimits` fields)."""

    def __init__(self, handler: Handler, *, limits: ServerLimits | None = None, **overrides: Any) -> None:
        self.handler = handler
        self.limits = dataclasses.replace(limits or ServerLimits(), **overrides)
        self.connection_cap = self.limits.connection_cap()
        """Connections served at once (``max_connections``, lowered to fit the file-descriptor limit)."""
        self.loop = asyncio.get_running_loop()
        self.stopping = False
        self.refused = refusal_counter()
        """Connections and requests the server refused itself, by reason (:data:`kvgate.http.limits.REFUSALS`)."""
        self.body_bytes = 0
        """Request body bytes held now (being received, or whole and being handled)."""
        self._conns: set[Conn] = set()
        self._busy = 0
        self._server: asyncio.AbstractServer | None = None
        self._sweeper: asyncio.TimerHandle | None = None

    @property
    def max_body(self) -> int:
        return self.limits.max_body

    def load(self) -> dict[str, int]:
        """``connections`` open now, requests being ``handled`` and request ``body_bytes`` held."""
        return {"connections": len(self._conns), "handled": self._busy, "body_bytes": self.body_bytes}

    async def start(self, host: str, port: int, backlog: int = 1024) -> int:
        """Listen; returns the bound port (useful with port 0)."""
        self._server = await self.loop.create_server(
            lambda: Conn(self), host, port, backlog=backlog, reuse_address=True
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
        for conn in list(self._conns):
            conn.check_deadlines(now)
        self._sweeper = self.loop.call_later(1.0, self._sweep)
