"""What a request's head must say before the server reads its body (RFC 9110 and RFC 9112), beyond what llhttp
checks itself (the request line's syntax, ``Content-Length`` values and duplicates, ``Content-Length`` with
``Transfer-Encoding``, chunk syntax).

:func:`head_error` names the first thing wrong, as the status the server answers with and closes:

* a version other than HTTP/1.0 or HTTP/1.1 (``GET /`` with no version reads as HTTP/0.9; ``HTTP/2.0``): 505;
* a ``Transfer-Encoding`` with any coding but ``chunked``: 501 (RFC 9112 §6.1: a server that does not
  understand a coding answers 501); ``Transfer-Encoding`` in an HTTP/1.0 request: 400 (§6.1: faulty framing);
* an HTTP/1.1 request without ``Host``, or any request with more than one, or a ``Host`` that is not one
  authority: 400 (§3.2: "MUST respond with a 400");
* a request to upgrade the protocol that carries a body: 400. The server declines upgrades (it answers in
  HTTP/1.1, then closes) and its parser stops at the end of such a head, so the body would be dropped unread;
  it is refused instead, saying so.
"""

from __future__ import annotations

from collections.abc import Sequence

HeadError = tuple[int, str, str]
"""``(status, message, error type)``."""

_BAD_HOST = frozenset(" \t,/\\@?#")


def transfer_codings(value: str) -> list[str]:
    """The codings of one ``Transfer-Encoding`` field value, lower-cased, parameters dropped."""
    return [c.partition(";")[0].strip().lower() for c in value.split(",") if c.strip()]


def head_error(version: str, headers: Sequence[tuple[str, str]], upgrade: bool, has_body: bool) -> HeadError | None:
    """What is wrong with a request head (see the module docstring), or None."""
    if version not in ("1.1", "1.0"):
        return 505, f"HTTP/{version} is not supported (HTTP/1.1 or HTTP/1.0)", "HTTPVersionNotSupported"
    hosts = 0
    host = ""
    for name, value in headers:
        lname = name.lower()
        if lname == "host":
            hosts += 1
            host = value
        elif lname == "transfer-encoding":
            if version == "1.0":
                return 400, "Transfer-Encoding in an HTTP/1.0 request", "ClientError"
            other = [c for c in transfer_codings(value) if c != "chunked"]
            if other:
                return 501, f"transfer coding {other[0]!r} is not implemented (only chunked)", "NotImplemented"
    if hosts > 1:
        return 400, "more than one Host header", "ClientError"
    if hosts == 0 and version == "1.1":
        return 400, "an HTTP/1.1 request must have a Host header", "ClientError"
    if any(c in _BAD_HOST for c in host):
        return 400, "the Host header is not one host[:port]", "ClientError"
    if upgrade and has_body:
        return 400, "a request to upgrade the protocol may not carry a body here (upgrades are declined); send it " \
            "without Upgrade", "ClientError"
    return None
