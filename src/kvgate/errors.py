"""Error types that say who is at fault.

``UsageError``: the user's input is wrong (bad flag, unreadable file). The CLI prints its message on one line
and exits with status 2. HTTP servers map ``ClientError`` to 4xx, ``PolicyRefusal`` to 503 and
``UpstreamError`` to 502/504.
"""

from __future__ import annotations

import json
from typing import Any


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


def json_object(text: str, where: str) -> dict[str, Any]:
    """``text`` parsed as a JSON object; :class:`UsageError` naming ``where`` (a flag, a file) otherwise."""
    try:
        obj = json.loads(text)
    except ValueError as e:
        raise UsageError(f"{where}: not JSON ({e})") from None
    if not isinstance(obj, dict):
        raise UsageError(f"{where}: expected a JSON object")
    return obj
