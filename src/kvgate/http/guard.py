"""A client connection's bounds, as :class:`kvgate.http.server.Conn` keeps them (:mod:`kvgate.http.limits`): its
share of the budget of bodies in flight, and the sweep's look at its deadlines."""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from kvgate.http.messages import REASONS, Request, date_line

if TYPE_CHECKING:
    from collections import deque

LINGER_S = 2.0
"""How long a connection closed on a refusal keeps reading (and dropping) what its client still sends."""

HEAD, BODY, IDLE = 0, 1, 2
"""Where a connection is: waiting for (or reading) a head, reading a body, between requests."""


class Guard:
    """The bounds' half of a connection (its protocol half: :class:`kvgate.http.server.Conn`)."""

    server: Any  # (kvgate.http.server.HttpServer)
    held: int
    queue: deque[Request]
    closed: bool
    rejected: bool
    paused_reading: bool
    state: int
    since: float
    last_active: float
    mark: tuple[float, int]
    body_size: int
    continue_due: bool
    task: Any
    transport: Any
    paused_writing: bool
    send_mark: tuple[float, int] | None = None
    """While the client's socket is full: (since when, the bytes waiting to go out then)."""

    def _reject(self, status: int, message: str, kind: str, extra: bytes = b"") -> None:  # pragma: no cover
        raise NotImplementedError

    def close(self) -> None:  # pragma: no cover
        raise NotImplementedError

    # -- the budget of bodies in flight ------------------------------------------------------------------------
    def hold(self, n: int) -> bool:
        """Count ``n`` more body bytes against the server's budget; False (and 503) if they do not fit."""
        server = self.server
        if server.body_bytes + n > server.limits.bodies_in_flight:
            server.refused["body_budget"] += 1
            self._reject(503, "the gateway holds too many request bodies now; try again shortly",
                         "ServiceUnavailable", b"Retry-After: 1\r\n")
            return False
        server.body_bytes += n
        self.held += n
        return True

    def release(self, req: Request | None = None) -> None:
        """Return a handled request's body bytes to the budget (None: the connection's, all of them)."""
        server = self.server
        if req is not None:
            server.body_bytes -= req._held
            req._held = 0
            return
        server.body_bytes -= self.held
        self.held = 0
        for r in self.queue:
            server.body_bytes -= r._held
            r._held = 0

    def linger(self) -> None:
        """Close once the answer is out, reading and dropping what the client still sends for up to
        :data:`LINGER_S` (RFC 9112 §9.6): closing with a body still arriving makes the kernel reset the
        connection, and the reset can discard the answer (a 413, a 503) before the client reads it."""
        transport = self.transport
        if self.closed or transport is None:
            return
        self.close_quietly()
        with contextlib.suppress(Exception):  # (a transport that cannot half-close just closes, below)
            transport.resume_reading()  # (the bytes still coming are read, and dropped: the request is refused)
            if transport.can_write_eof():
                transport.write_eof()
                self.server.loop.call_later(LINGER_S, transport.close)
                return
        transport.close()

    def close_quietly(self) -> None:
        """The connection's books closed (its budget back, out of the server's count), its transport left."""
        self.closed = True
        self.release()
        self.server._conns.discard(self)

    @staticmethod
    def error_head(status: int, length: int, extra: bytes = b"") -> bytes:
        return (b"HTTP/1.1 %d %s\r\nContent-Type: application/json\r\nContent-Length: %d\r\nConnection: close\r\n"
                b"%s%s\r\n" % (status, REASONS.get(status, b""), length, extra, date_line()))

    def _send_stalled(self, now: float, timeout: float) -> bool:
        """Whether the client read nothing of what waits to go out for ``timeout`` seconds (then the connection
        is aborted: a close would wait for the client, and a handler writing to it is cancelled)."""
        waiting = self.transport.get_write_buffer_size() if self.transport is not None else 0
        mark = self.send_mark
        if mark is None or waiting < mark[1]:  # (the client read some since: a new mark)
            self.send_mark = (now, waiting)
            return False
        if now - mark[0] <= timeout:
            return False
        self.server.refused["send_timeout"] += 1
        self.transport.abort()
        self.close()
        return True

    def check_deadlines(self, now: float) -> None:
        """The sweep's look at this connection: a head or a body too slow is 408, a client that reads nothing of
        its answer for ``send_timeout_s`` is cut off, an idle one past keep-alive closes."""
        if self.closed:
            return
        limits = self.server.limits
        if self.paused_writing and self._send_stalled(now, limits.send_timeout_s):
            return
        if self.rejected or self.paused_reading:
            return
        state = self.state
        if state == IDLE:
            if self.task is None and self.last_active < now - limits.keepalive_s:
                if self.transport is not None and self.transport.get_write_buffer_size():
                    self.transport.abort()  # (a close would wait for the client to read the rest)
                self.close()
        elif state == HEAD:
            if now - self.since > limits.head_timeout_s:
                self.server.refused["head_timeout"] += 1
                self._reject(408, f"the request's head did not arrive within {limits.head_timeout_s:g} s",
                             "RequestTimeout")
        elif not self.continue_due:
            when, done = self.mark
            window = limits.body_timeout_s
            if now - when >= window:
                if self.body_size - done < limits.min_body_rate * window:
                    self.server.refused["body_timeout"] += 1
                    self._reject(408, f"the body came slower than {limits.min_body_rate} bytes/s over "
                                 f"{window:g} s", "RequestTimeout")
                else:
                    self.mark = (now, self.body_size)
