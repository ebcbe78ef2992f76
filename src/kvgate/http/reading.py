"""How the server's connections read what a client sends (:class:`Reader`, a half of
:class:`kvgate.http.server.Conn`): each read is cut where a head or a body ends before it is parsed (a head at its
blank line, a body by its ``Content-Length`` or, chunked, by :class:`kvgate.http.framing.ChunkedEnd`), so that
every byte of a head counts against :data:`kvgate.http.limits.MAX_HEAD_BYTES` (the parser reports only the target,
the names and the values), and the body of a request asking to upgrade the protocol is read on (the parser would
stop at its head and drop it; the upgrade is declined, RFC 9110 §7.8)."""

from __future__ import annotations

from typing import Any

import httptools

from kvgate.http.framing import BLANK_LINE, ChunkedEnd, head_end, skip_empty_lines
from kvgate.http.guard import BODY, HEAD
from kvgate.http.limits import MAX_HEAD_BYTES

LINE_BYTES = 15
"""The request line's bytes but its target, at the least (``GET``, two spaces, ``HTTP/1.1``, CRLF)."""


class _BodyCallbacks:
    """A parser's callbacks for a body alone (:meth:`Reader._read_upgrade_body`)."""

    __slots__ = ("on_body", "on_message_complete")

    def __init__(self, conn: Reader) -> None:
        self.on_body = conn.on_body
        self.on_message_complete = conn.on_message_complete


class Reader:
    """The reading half of a connection (its callbacks and serving: :class:`kvgate.http.server.Conn`)."""

    server: Any  # (kvgate.http.server.HttpServer)
    loop: Any
    parser: Any
    last_active: float
    state: int
    messages: int
    begun: bool
    rejected: bool
    ended: bool
    chunks: ChunkedEnd
    tail: bytes
    reframe: bytes | None
    expected: int
    body_size: int
    head_size: int
    raw_head: int
    url: bytes

    def _reject(self, status: int, message: str, kind: str, extra: bytes = b"") -> None:  # pragma: no cover
        raise NotImplementedError

    def on_body(self, body: bytes) -> None:  # pragma: no cover
        raise NotImplementedError

    def on_message_complete(self) -> None:  # pragma: no cover
        raise NotImplementedError

    def data_received(self, data: bytes) -> None:
        self.last_active = self.loop.time()
        pos, n = 0, len(data)
        if not (self.state == BODY or self.begun or self.tail or self.rejected or self.ended):
            pos = self._whole(data, n)  # (a request whose head and body came in this read: the common case)
        while pos < n and not (self.rejected or self.ended):
            end, found = self._cut(data, pos)
            if self.rejected:  # (the head's bytes passed the limit: none of them is parsed)
                return
            state, messages = self.state, self.messages
            try:
                self.parser.feed_data(data if pos == 0 and end == n else memoryview(data)[pos:end])
            except httptools.HttpParserUpgrade as e:
                if self.reframe is None:
                    return  # the request was answered as plain HTTP/1.1 (below); what follows it is not read
                end = pos + int(e.args[0])
                self._read_upgrade_body()
            except httptools.HttpParserError as e:
                if not self.rejected:
                    self._refuse_version() or self._reject(400, f"malformed HTTP request: {e}", "ClientError")
                return
            if found or state != self.state or messages != self.messages:
                self.tail = b""
            else:  # (a blank line may be cut between two reads)
                self.tail = (self.tail + data[max(pos, end - 3):end])[-3:]
            if not found and self.begun and end == n and data.endswith(b"\r\n"):
                self._refuse_version()
            pos = end

    def _whole(self, data: bytes, n: int) -> int:
        """Where the generic loop of :meth:`data_received` goes on after the read's first head, parsed here, and the
        body that follows it, when that body ends this read (by its ``Content-Length``): what the loop would do
        with those two pieces, without cutting them apart. ``0`` (nothing parsed) where the read does not start
        with a whole head within the limit; the head's end where its body does not end the read, or a parse
        failed (the generic loop then sees the state the parser left)."""
        end = data.find(BLANK_LINE) + 4
        if end < 4 or data.startswith(b"\r\n") or self.raw_head + end > MAX_HEAD_BYTES:
            return 0
        self.raw_head += end
        parser = self.parser
        try:
            parser.feed_data(data if end == n else memoryview(data)[:end])
        except httptools.HttpParserUpgrade as e:
            if self.reframe is None:
                return n  # (the request was answered as plain HTTP/1.1; what follows it is not read)
            self._read_upgrade_body()
            return int(e.args[0])
        except httptools.HttpParserError as e:
            if not self.rejected:
                self._refuse_version() or self._reject(400, f"malformed HTTP request: {e}", "ClientError")
            return n
        if end == n or self.rejected or self.state != BODY or self.expected < 0 \
                or self.expected - self.body_size != n - end:
            return end
        try:
            parser.feed_data(memoryview(data)[end:])
        except httptools.HttpParserUpgrade:  # (an upgrade's parse stops at its head, above: not expected here)
            return n
        except httptools.HttpParserError as e:
            if not self.rejected:
                self._reject(400, f"malformed HTTP request: {e}", "ClientError")
            return n
        return n

    def _refuse_version(self) -> bool:
        """505 for a request line of a version but HTTP/1 (``PRI * HTTP/2.0``, which the parser stops at; ``GET /``
        and its line's end, HTTP/0.9's whole request, which it holds until more comes)."""
        version = self.parser.get_http_version()
        if self.state != HEAD or version[0] == "1" or (version == "0.0" and not self.url):
            return False
        shown = "0.9" if version == "0.0" else version
        self._reject(505, f"HTTP/{shown} is not supported (HTTP/1.1 or HTTP/1.0)", "HTTPVersionNotSupported")
        return True

    def _cut(self, data: bytes, pos: int) -> tuple[int, bool]:
        """Where the next piece of ``data`` to parse ends (a head's end, a body's end), and whether it ends at a
        blank line; a head's bytes are counted against the limit here, every one of them."""
        n = len(data)
        if self.state == BODY:
            if self.expected >= 0:
                left = self.expected - self.body_size
                return (pos + left, False) if 0 < left < n - pos else (n, False)
            end = self.chunks.end(data, pos)  # (chunked)
            return (n, False) if end < 0 else (end, True)
        start = pos
        if self.begun and self.tail:
            end = head_end(data, pos, self.tail)
        else:
            if not self.begun and data.startswith(b"\r\n", pos):
                start = skip_empty_lines(data, pos)
            end = data.find(BLANK_LINE, start)
            end = end + 4 if end >= 0 else -1
        stop = n if end < 0 else end
        self.raw_head += stop - start
        if self.raw_head > MAX_HEAD_BYTES:
            self._count_head(0)
        return stop, end >= 0

    def _read_upgrade_body(self) -> None:
        """The parser stops at the end of a head asking to upgrade; the body after it is read by a parser of its
        own, given the head's framing alone (its callbacks: the body's)."""
        body_parser = httptools.HttpRequestParser(_BodyCallbacks(self))
        body_parser.feed_data(self.reframe)
        self.parser = body_parser
        self.reframe = None

    def _count_head(self, n: int) -> None:
        """Count ``n`` more bytes of the head's fields; either count (the fields', or every byte's: ``raw_head``)
        over the limit is 431."""
        self.head_size += n
        if (self.head_size > MAX_HEAD_BYTES or self.raw_head > MAX_HEAD_BYTES) and not self.rejected:
            self.server.refused["head_size"] += 1
            self._reject(431, f"the request line and headers are over {MAX_HEAD_BYTES} bytes", "HeadersTooLarge")
