"""The gateway's upstream client: pooled HTTP/1.1 keep-alive connections to one fixed origin.

Built on asyncio protocols and httptools' response parser (llhttp) because the gateway's cost per proxied turn is
dominated by its HTTP machinery, and a general-purpose client pays per request for what a proxy to one origin
never uses (cookies, redirects, proxies, per-request timer objects, a stream reader per response, a request
object graph). Here a request is one ``transport.write`` of a prebuilt head and the body; a response is a status,
the headers, and a list of body chunks handed over as they arrive.

What it keeps from a full client: connection reuse (LIFO, so the warmest connection serves next), a retry on a
fresh connection when a reused one turns out to have been closed by the upstream before it answered a byte,
back-pressure (reading from the upstream pauses while a response holds more than ``HIGH_WATER`` unread bytes),
a connect timeout and a read timeout (the longest silence allowed while waiting for the headers or the next
body bytes: one sweep over the busy connections every ``read_timeout / 8`` seconds, at most one second, rather
than a timer per request or per read), TLS when the origin is ``https``.

Errors are ``OSError`` subclasses or ``TimeoutError``: :class:`UpstreamConnectError` (nothing answers the
connect), :class:`UpstreamDisconnected` (the connection broke before the response was complete),
:class:`UpstreamProtocolError` (the upstream sent something that is not HTTP/1.1).
"""

from __future__ import annotations

import asyncio
import ssl
from collections.abc import Iterable
from typing import Any

import httptools
from multidict import CIMultiDict, CIMultiDictProxy

HIGH_WATER = 1 << 20
"""Unread response bytes at which reading from the upstream pauses (and resumes once the reader drained them)."""
SPLIT_WRITE = 1 << 16
"""A request body at least this long is written after its head, not joined to it (no second copy of it)."""


class UpstreamConnectError(OSError):
    """The upstream could not be reached (connection refused, no route, connect timeout)."""


class UpstreamDisconnected(OSError):
    """The upstream closed the connection before the response was complete."""


class UpstreamProtocolError(OSError):
    """The upstream's answer is not valid HTTP/1.1."""


class AnswerTooLarge(Exception):
    """A body read whole (:meth:`Response.read` with a limit) is over its limit: by its ``Content-Length``
    before any byte is read, or once the bytes that came pass it."""

    def __init__(self, limit: int, size: int | None) -> None:
        what = f"{size} bytes" if size is not None else "more"
        super().__init__(f"the upstream's answer ({what}) is over the limit of {limit} bytes")
        self.limit = limit


class Response:
    """One upstream response: ``status`` and ``headers`` once it is returned, the body through :meth:`readany`."""

    __slots__ = (
        "status", "headers", "_conn", "_chunks", "_buffered", "_eof", "_exc", "_waiter", "_keep_alive", "_done",
    )

    def __init__(self, conn: _Connection) -> None:
        self.status = 0
        self.headers: CIMultiDictProxy[str] = _EMPTY
        self._conn: _Connection | None = conn
        self._chunks: list[bytes] = []
        self._buffered = 0
        self._eof = False
        self._exc: BaseException | None = None
        self._waiter: asyncio.Future[None] | None = None
        self._keep_alive = False
        self._done = False  # released or closed

    @property
    def content_type(self) -> str:
        return self.headers.get("Content-Type", "").partition(";")[0].strip().lower()

    @property
    def buffered(self) -> int:
        """Body bytes received and not yet read."""
        return self._buffered

    @property
    def reading_paused(self) -> bool:
        """Whether reading from the upstream is paused because the reader is behind (``buffered`` over the high
        water mark); reading resumes when the reader catches up."""
        return self._conn is not None and self._conn.paused

    @property
    def content_length(self) -> int | None:
        v = self.headers.get("Content-Length")
        try:
            return int(v) if v is not None else None
        except ValueError:
            return None

    async def readany(self) -> bytes:
        """The body bytes that arrived since the last call (waiting for some); ``b""`` at the end of the body."""
        while not self._chunks:
            if self._exc is not None:
                raise self._exc
            if self._eof:
                return b""
            conn = self._conn
            assert conn is not None
            self._waiter = fut = conn.loop.create_future()
            try:
                await fut
            finally:
                self._waiter = None
        chunks = self._chunks
        data = chunks[0] if len(chunks) == 1 else b"".join(chunks)
        chunks.clear()
        if self._buffered >= HIGH_WATER and self._conn is not None:
            self._conn.resume()
        self._buffered = 0
        return data

    async def read(self, limit: int | None = None) -> bytes:
        """The whole (rest of the) body, in one buffer that grows as the bytes come (the chunks are dropped once
        appended: never a second copy of the body). Past ``limit`` bytes: :class:`AnswerTooLarge` (the response
        is then to be closed, not released)."""
        size = self.content_length
        if limit is not None and size is not None and size > limit:
            raise AnswerTooLarge(limit, size)
        chunks = self._chunks
        whole = self._eof and len(chunks) == 1 and self._buffered < HIGH_WATER
        if whole and (limit is None or self._buffered <= limit):
            # (the whole body came with the head, in one piece: the common case of a short answer)
            data = chunks.pop()
            self._buffered = 0
            return data
        out = bytearray()
        while True:
            chunk = await self.readany()
            if not chunk:
                return out  # type: ignore[return-value]  # (bytes-like: written and parsed as it is)
            if limit is not None and len(out) + len(chunk) > limit:
                raise AnswerTooLarge(limit, size)
            out += chunk

    def release(self) -> None:
        """Done with the response: its connection goes back to the pool if the body was read to the end and the
        upstream keeps it alive, else it is closed."""
        if self._done:
            return
        self._done = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finish(self._eof and self._exc is None and self._keep_alive and not self._chunks)

    def close(self) -> None:
        """Done with the response, its body read or not: the connection is closed."""
        if self._done:
            return
        self._done = True
        conn, self._conn = self._conn, None
        if conn is not None:
            conn.finish(False)

    # -- fed by the connection ---------------------------------------------------------------------------------
    def _wake(self) -> None:
        w = self._waiter
        if w is not None and not w.done():
            w.set_result(None)

    def _fail(self, exc: BaseException) -> None:
        if not self._eof and self._exc is None:
            self._exc = exc
            self._wake()


_EMPTY: CIMultiDictProxy[str] = CIMultiDictProxy(CIMultiDict())


class _Connection(asyncio.Protocol):
    """One keep-alive connection; at most one request at a time (no pipelining)."""

    def __init__(self, pool: UpstreamPool) -> None:
        self.pool = pool
        self.loop = pool.loop
        self.transport: asyncio.Transport | None = None
        self.parser = httptools.HttpResponseParser(self)
        self.resp: Response | None = None
        self.head: asyncio.Future[Response] | None = None
        self.raw_headers: list[tuple[str, str]] = []
        self.closed = False
        self.paused = False
        self.got_bytes = False
        self.head_only = False
        self.last_read = 0.0

    # -- asyncio.Protocol --------------------------------------------------------------------------------------
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = transport  # type: ignore[assignment]  # (uvloop's transports are not asyncio's classes)

    def data_received(self, data: bytes) -> None:
        if self.resp is None:  # bytes on an idle connection: not a response to anything; drop the connection
            self.close()
            return
        self.got_bytes = True
        self.last_read = self.loop.time()
        try:
            self.parser.feed_data(data)
        except httptools.HttpParserError as e:
            self._error(UpstreamProtocolError(f"malformed response from the upstream: {e}"))
            self.close()

    def connection_lost(self, exc: BaseException | None) -> None:
        self.closed = True
        self.pool._forget(self)
        resp = self.resp
        if resp is not None and not resp._eof:
            if self.head is None and exc is None and not resp._keep_alive and self._unsized(resp):
                resp._eof = True  # a body delimited by the end of the connection: complete
                resp._wake()
            else:
                what = f": {exc}" if exc else ""
                self._error(UpstreamDisconnected(f"the upstream closed the connection{what}"))

    def pause_writing(self) -> None:  # request bodies are written whole; the transport buffers them
        pass

    def resume_writing(self) -> None:
        pass

    # -- httptools callbacks -----------------------------------------------------------------------------------
    def on_header(self, name: bytes, value: bytes) -> None:
        self.raw_headers.append((name.decode("latin-1"), value.decode("latin-1")))

    def on_headers_complete(self) -> None:
        status = self.parser.get_status_code()
        if status < 200:  # 1xx: informational, the real response follows
            self.raw_headers = []
            return
        resp = self.resp
        head = self.head
        if resp is None or head is None:
            return
        resp.status = status
        resp.headers = CIMultiDictProxy(CIMultiDict(self.raw_headers))
        self.raw_headers = []
        self.head = None
        if not head.done():
            head.set_result(resp)
        if self.head_only:  # a HEAD response has no body, whatever its headers say; not reused (parser state)
            resp._eof = True
            resp._keep_alive = False

    def on_body(self, body: bytes) -> None:
        resp = self.resp
        if resp is None or resp._eof:
            return
        resp._chunks.append(body)
        resp._buffered += len(body)
        if resp._buffered >= HIGH_WATER and not self.paused and self.transport is not None:
            self.paused = True
            self.transport.pause_reading()
        if resp._waiter is not None:
            resp._wake()

    def on_message_complete(self) -> None:
        resp = self.resp
        if resp is None or self.head is not None:  # (the end of a 1xx)
            return
        resp._keep_alive = self.parser.should_keep_alive()
        resp._eof = True
        if resp._waiter is not None:
            resp._wake()

    # -- used by the pool and the response ---------------------------------------------------------------------
    def send(self, data: tuple[bytes, ...], head_only: bool) -> asyncio.Future[Response]:
        transport = self.transport
        assert transport is not None
        self.resp = Response(self)
        self.head = fut = self.loop.create_future()
        self.raw_headers = []
        self.got_bytes = False
        self.head_only = head_only
        self.last_read = self.loop.time()
        if len(data) == 1:
            transport.write(data[0])
        else:  # (one writev on uvloop; asyncio's loop joins them)
            transport.writelines(data)
        return fut

    def resume(self) -> None:
        if self.paused and self.transport is not None and not self.closed:
            self.paused = False
            self.last_read = self.loop.time()
            self.transport.resume_reading()

    def finish(self, reusable: bool) -> None:
        """The response is done with: back to the pool when ``reusable``, else closed."""
        self.resp = None
        self.head = None
        if reusable and not self.closed and not self.paused:
            self.pool._put_back(self)
        else:
            self.close()

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.pool._forget(self)
            if self.transport is not None:
                self.transport.close()

    # -- internals ---------------------------------------------------------------------------------------------
    def _error(self, exc: BaseException) -> None:
        head = self.head
        if head is not None:
            self.head = None
            if not head.done():
                head.set_exception(exc)
        if self.resp is not None:
            self.resp._fail(exc)

    def check_timeout(self, now: float, timeout: float) -> None:
        """Fail the response if the upstream has been silent for ``timeout`` seconds while it is awaited."""
        resp = self.resp
        if resp is None or resp._eof or self.closed or self.paused or now - self.last_read < timeout:
            return
        what = "headers" if self.head is not None else "the rest of the body"
        self._error(TimeoutError(f"no response bytes for {timeout:g} s while waiting for {what}"))
        self.close()

    @staticmethod
    def _unsized(resp: Response) -> bool:
        h = resp.headers
        return "Content-Length" not in h and "chunked" not in h.get("Transfer-Encoding", "").lower()


class UpstreamPool:
    """Keep-alive connections to one origin (``http://host:port`` or ``https://...``), unbounded in number.

    ``await pool.request(method, target, headers, body)`` returns a :class:`Response` once its status line and
    headers are in; the caller must :meth:`Response.release` or :meth:`Response.close` it.
    """

    def __init__(
        self, host: str, port: int, *, tls: bool = False, connect_timeout: float = 10.0,
        read_timeout: float | None = 600.0, max_idle: int = 1024,
    ) -> None:
        self.loop = asyncio.get_running_loop()
        self.host = host
        self.port = port
        self.ssl: ssl.SSLContext | None = ssl.create_default_context() if tls else None
        self.connect_timeout = connect_timeout
        self.read_timeout = read_timeout
        self.max_idle = max_idle
        default_port = 443 if tls else 80
        authority = host if port == default_port else f"{host}:{port}"
        if ":" in host and not host.startswith("["):  # an IPv6 literal
            authority = f"[{host}]" if port == default_port else f"[{host}]:{port}"
        self._host_line = f"Host: {authority}\r\n".encode("latin-1")
        self._idle: list[_Connection] = []
        self._busy: set[_Connection] = set()
        self._closed = False
        self._sweeper: asyncio.TimerHandle | None = None

    @property
    def acquired(self) -> int:
        """Connections serving a request now."""
        return len(self._busy)

    @property
    def idle(self) -> int:
        """Connections kept alive for the next request."""
        return len(self._idle)

    async def request(
        self, method: str, target: str, headers: Iterable[tuple[str, str]], body: bytes = b""
    ) -> Response:
        """Send one request (``target``: path and query, already encoded) and return its response head."""
        if self._closed:
            raise UpstreamConnectError("the upstream client is closed")
        lines = [f"{method} {target} HTTP/1.1\r\n".encode("latin-1"), self._host_line,
                 "".join([f"{k}: {v}\r\n" for k, v in headers]).encode("latin-1", "replace")]
        if body or method not in ("GET", "HEAD", "DELETE", "OPTIONS"):
            lines.append(b"Content-Length: %d\r\n\r\n" % len(body))
        else:
            lines.append(b"\r\n")
        if len(body) < SPLIT_WRITE:  # a short body joined to its head: one write
            lines.append(body)
            data: tuple[bytes, ...] = (b"".join(lines),)
        else:  # a long one written after it, not copied once more
            data = (b"".join(lines), body)
        head_only = method == "HEAD"
        idle = self._idle
        for attempt in (0, 1):
            conn = idle.pop() if idle else None  # (the common case, without a coroutine)
            if conn is not None and not conn.closed:
                self._busy.add(conn)
                reused = True
            else:
                conn, reused = await self._acquire()
            try:
                if self._sweeper is None and self.read_timeout is not None:
                    self._sweeper = self.loop.call_later(self._sweep_every(), self._sweep)
                return await conn.send(data, head_only)
            except UpstreamDisconnected:
                if reused and not conn.got_bytes and attempt == 0:
                    conn.close()  # closed by the upstream while idle: once more on a new connection
                    continue
                conn.finish(False)
                raise
            except BaseException:
                conn.finish(False)
                raise
        raise AssertionError("unreachable")

    async def close(self) -> None:
        """Close every connection (responses still being read fail)."""
        self._closed = True
        if self._sweeper is not None:
            self._sweeper.cancel()
            self._sweeper = None
        for conn in [*self._idle, *self._busy]:
            conn.close()
        self._idle.clear()
        self._busy.clear()
        await asyncio.sleep(0)  # let the transports' close callbacks run

    # -- internals ---------------------------------------------------------------------------------------------
    async def _acquire(self) -> tuple[_Connection, bool]:
        idle = self._idle
        while idle:
            conn = idle.pop()
            if not conn.closed:
                self._busy.add(conn)
                return conn, True
        try:
            _, conn = await asyncio.wait_for(
                self.loop.create_connection(lambda: _Connection(self), self.host, self.port, ssl=self.ssl),
                self.connect_timeout,
            )
        except TimeoutError:
            raise UpstreamConnectError(
                f"connect to {self.host}:{self.port} timed out after {self.connect_timeout:g} s"
            ) from None
        except OSError as e:
            raise UpstreamConnectError(f"cannot connect to {self.host}:{self.port}: {e.strerror or e}") from None
        if self._closed:
            conn.close()
            raise UpstreamConnectError("the upstream client is closed")
        self._busy.add(conn)
        return conn, False

    def _sweep_every(self) -> float:
        return min(1.0, (self.read_timeout or 8.0) / 8)

    def _sweep(self) -> None:
        self._sweeper = None
        timeout = self.read_timeout
        if timeout is None or self._closed or not self._busy:
            return  # (the next request starts the sweeps again)
        now = self.loop.time()
        for conn in list(self._busy):
            conn.check_timeout(now, timeout)
        self._sweeper = self.loop.call_later(self._sweep_every(), self._sweep)

    def _put_back(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        if self._closed or len(self._idle) >= self.max_idle:
            conn.close()
        else:
            self._idle.append(conn)

    def _forget(self, conn: _Connection) -> None:
        self._busy.discard(conn)
        if conn in self._idle:
            self._idle.remove(conn)


def pool_for(url: Any, **kwargs: Any) -> UpstreamPool:
    """An :class:`UpstreamPool` for the origin of a ``yarl.URL`` (scheme http or https)."""
    scheme = url.scheme
    if scheme not in ("http", "https"):
        raise ValueError(f"unsupported upstream scheme {scheme!r} (http or https)")
    port = url.port or (443 if scheme == "https" else 80)
    return UpstreamPool(url.host, port, tls=scheme == "https", **kwargs)
