"""What a request's head must say before the server reads its body (RFC 9110 and RFC 9112), beyond what llhttp
checks itself (the request line's syntax, ``Content-Length`` values and duplicates, ``Content-Length`` with
``Transfer-Encoding``, chunk syntax), and where a head ends.

:func:`head_error` names the first thing wrong, as the status the server answers with and closes:

* a version other than HTTP/1.0 or HTTP/1.1 (``GET /`` with no version reads as HTTP/0.9; ``HTTP/2.0``): 505
  (RFC 9110 §15.6.6). A higher HTTP/1 minor version (``HTTP/1.2``) is read as HTTP/1.1 (RFC 9112 §2.3: "SHOULD
  process the message as if it were in the highest minor version"), by :func:`http_version`;
* a ``Transfer-Encoding`` whose last coding is not ``chunked``, or with ``chunked`` twice: 400 (RFC 9112 §6.3:
  the body's length cannot be known, "MUST respond with the 400"; §6.1: chunked at most once); any other coding
  before a final ``chunked``: 501 (§6.1: a server that does not understand a coding answers 501);
  ``Transfer-Encoding`` in an HTTP/1.0 request: 400 (§6.1: faulty framing);
* an HTTP/1.1 request without ``Host``, or any request with more than one, or a ``Host`` that is not one
  authority: 400 (§3.2: "MUST respond with a 400").

A request to upgrade the protocol (``Upgrade``: WebSocket, h2c) is not refused: the server declines upgrades by
ignoring the field (RFC 9110 §7.8: "A server MAY ignore a received Upgrade header field"), serves the request as it
is, body and all, in HTTP/1.1, and then closes the connection.

:func:`head_end` and :class:`ChunkedEnd` find where a head and a chunked body end in what a client sent, so that
the server counts every byte of a head against its limit (its parser reports only the target, names and values:
not the whitespace around them), a head pipelined after a body too.
"""

from __future__ import annotations

from multidict import CIMultiDict

HeadError = tuple[int, str, str]
"""``(status, message, error type)``."""

_BAD_HOST = frozenset(" \t,/\\@?#")
BLANK_LINE = b"\r\n\r\n"
"""The end of a head (the parser takes no bare LF)."""


def transfer_codings(value: str) -> list[str]:
    """The codings of one ``Transfer-Encoding`` field value, lower-cased, parameters dropped."""
    return [c.partition(";")[0].strip().lower() for c in value.split(",") if c.strip()]


def http_version(parsed: str) -> str:
    """The version a request is served in: ``1.x`` for any x >= 1 is 1.1; others as parsed."""
    major, _, minor = parsed.partition(".")
    return "1.1" if major == "1" and minor not in ("0", "1") else parsed


def _coding_error(version: str, codings: list[str]) -> HeadError | None:
    if version == "1.0":
        return 400, "Transfer-Encoding in an HTTP/1.0 request", "ClientError"
    if not codings or codings[-1] != "chunked" or codings.count("chunked") > 1:
        return 400, "Transfer-Encoding must end with chunked, once (the body's length is unknown)", "ClientError"
    other = [c for c in codings if c != "chunked"]
    if other:
        return 501, f"transfer coding {other[0]!r} is not implemented (only chunked)", "NotImplemented"
    return None


def head_error(version: str, headers: CIMultiDict[str]) -> HeadError | None:
    """What is wrong with a request head (see the module docstring), or None."""
    if version not in ("1.1", "1.0"):
        return 505, f"HTTP/{version} is not supported (HTTP/1.1 or HTTP/1.0)", "HTTPVersionNotSupported"
    te = headers.getall("Transfer-Encoding", None)
    if te is not None:
        bad = _coding_error(version, [c for value in te for c in transfer_codings(value)])
        if bad is not None:
            return bad
    hosts = headers.getall("Host", ())
    if len(hosts) > 1:
        return 400, "more than one Host header", "ClientError"
    if not hosts:
        return (400, "an HTTP/1.1 request must have a Host header", "ClientError") if version == "1.1" else None
    if not _BAD_HOST.isdisjoint(hosts[0]):
        return 400, "the Host header is not one host[:port]", "ClientError"
    return None


def head_end(data: bytes, pos: int, carry: bytes) -> int:
    """The index in ``data`` just past the first blank line from ``pos`` on (``carry``: up to 3 bytes before
    ``pos`` of the same head, so that a blank line cut between two reads is found), or -1."""
    if carry:
        k = (carry + data[pos:pos + 3]).find(BLANK_LINE)
        if k >= 0:
            return pos + k + 4 - len(carry)
    k = data.find(BLANK_LINE, pos)
    return -1 if k < 0 else k + 4


def skip_empty_lines(data: bytes, pos: int) -> int:
    """Past the empty lines a request may follow (RFC 9112 §2.2: not part of its head)."""
    while data.startswith(b"\r\n", pos):
        pos += 2
    return pos


_HEX = frozenset(b"0123456789abcdefABCDEF")
_SIZE, _DATA, _TRAILER = 0, 1, 2


class ChunkedEnd:
    """Where a chunked body ends, found as its bytes arrive (RFC 9112 §7.1: size lines, data and its CRLF, the
    last chunk, trailer fields, the empty line), jumping over each chunk's data: the server cuts a read there, so
    that a head pipelined after the body is counted from its first byte. The parser stays the judge of the
    syntax: on a size line it cannot read this gives up (:meth:`end` is -1 from then on, the parser refuses it)."""

    __slots__ = ("mode", "left", "line")

    def __init__(self) -> None:
        self.mode = _SIZE
        self.left = 0  # (data bytes of the chunk being read, with its CRLF)
        self.line = b""  # (the start of a line cut between reads)

    def end(self, data: bytes, pos: int) -> int:
        """The index in ``data`` just past the body's end, or -1 if it does not end in ``data[pos:]``."""
        n = len(data)
        i = pos
        while i < n:
            if self.mode == _DATA:
                take = min(self.left, n - i)
                i += take
                self.left -= take
                if not self.left:
                    self.mode = _SIZE
                continue
            k = data.find(b"\n", i)
            if k < 0:
                self.line = (self.line + data[i:i + 32])[:32]
                return -1
            line = (self.line + data[i:min(k + 1, i + 32)])[:32] if self.line else data[i:min(k + 1, i + 32)]
            self.line = b""
            i = k + 1
            if self.mode == _TRAILER:
                if line in (b"\r\n", b"\n"):
                    return i
                continue
            digits = 0
            while digits < len(line) and line[digits] in _HEX:
                digits += 1
            if not digits or digits > 16:
                self.mode, self.left = _DATA, 1 << 62  # (unreadable: the parser will say so)
                return -1
            size = int(line[:digits], 16)
            self.mode, self.left = (_DATA, size + 2) if size else (_TRAILER, 0)
        return -1
