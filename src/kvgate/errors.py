"""Error types that say who is at fault.

``UsageError``: the user's input is wrong (bad flag, unreadable file). The CLI prints its message on one line
and exits with status 2. HTTP servers map ``ClientError`` to 4xx, ``PolicyRefusal`` to 503 and
``UpstreamError`` to 502/504.
"""

from __future__ import annotations


class KvgateError(Exception):
    """Base of kvgate's own errors."""

    http_status = 500


class UsageError(KvgateError):
    """Bad input from the user: a flag, a file, a config value."""

    http_status = 400


class ClientError(KvgateError):
    """A client sent something kvgate cannot accept."""

    http_status = 400


class PolicyRefusal(KvgateError):
    """The policy declined to serve a request (e.g. max park time exceeded)."""

    http_status = 503


class UpstreamError(KvgateError):
    """The engine behind kvgate failed or timed out."""

    http_status = 502
