"""Usage in streams: ask for it when the client did not, read it, and hide what the client did not ask for.

The gateway needs every turn's usage (prompt, cached and completion tokens); where each API puts it in a stream
is its dialect's (:meth:`kvgate.http.dialect.Api.event_usage`): Responses in its ``response.completed`` event,
Messages in ``message_start`` and ``message_delta`` (merged), always. A streamed completion or chat completion
carries it only with ``stream_options.include_usage``, in one extra chunk before ``data: [DONE]``::

    data: {"id":..., "choices":[{"delta":{"content":"Hi"}, ...}]}      <- relayed as they arrive
    ...
    data: {"id":..., "choices":[], "usage":{"prompt_tokens":..., ...}}  <- usage-only chunk
    data: [DONE]

When the client did not ask for usage, :func:`with_include_usage` adds the option to the request body and
:class:`UsageScanner` removes the usage-only chunk (the one with empty ``choices`` and a usage object) before the
client sees it; when the client asked, the chunk is relayed and only read.

Cost: chunks are relayed as they arrive, unparsed, except that an event cut by a chunk boundary is held until
its end arrives (the client could not use half an event anyway), and an event that mentions ``"usage"`` with a
value other than null is parsed (once per stream in practice).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import orjson

from kvgate.http.dialect import CHAT, Api

loads: Callable[[bytes | str], Any] = orjson.loads
dumps: Callable[[Any], bytes] = orjson.dumps


_INCLUDE = b'"stream_options":{"include_usage":true},'
_USAGE = b'"usage"'
_NULL_USAGE = (b'"usage":null', b'"usage": null')


def with_include_usage(raw: bytes, body: dict[str, Any]) -> bytes:
    """The request body ``raw`` (parsed: ``body``) with ``stream_options.include_usage`` set.

    Without a ``stream_options`` key the option is spliced in after the opening brace (the body is not
    re-serialised); otherwise the body is re-encoded with the option added to the client's options.
    """
    if "stream_options" not in body:
        out = _splice(raw, _INCLUDE)
        if out is not None:
            return out
    so = body.get("stream_options")
    options = dict(so) if type(so) is dict else {}
    options["include_usage"] = True
    return dumps({**body, "stream_options": options})


def with_cache_salt(raw: bytes, body: dict[str, Any], salt: str) -> tuple[bytes, dict[str, Any]]:
    """The request body ``raw`` (parsed: ``body``) and ``body`` with ``cache_salt`` set to ``salt`` (the client
    key's, replacing any the client sent): spliced in after the opening brace when the body has none."""
    out = None if "cache_salt" in body else _splice(raw, b'"cache_salt":' + dumps(salt) + b",")
    body = {**body, "cache_salt": salt}
    return (out if out is not None else dumps(body)), body


def _splice(raw: bytes, member: bytes) -> bytes | None:
    """``raw`` (a JSON object with members) with ``member`` (ending in a comma) put after its opening brace;
    None for an object without members."""
    i = raw.find(b"{")
    j = i + 1
    n = len(raw)
    while j < n and raw[j] in b" \t\r\n":
        j += 1
    if i >= 0 and j < n and raw[j] != 0x7D:  # not "}": the object has members to put a comma before
        return raw[: i + 1] + member + raw[i + 1 :]
    return None


class UsageScanner:
    """Frames an SSE byte stream into whole events, picks up usage, and drops the usage-only chunk if asked.

    Feed each chunk to :meth:`feed`; relay what it returns; call :meth:`flush` at the end of the stream.
    """

    __slots__ = ("drop_usage_only", "api", "usage", "event", "_pending")

    def __init__(self, drop_usage_only: bool, api: Api = CHAT) -> None:
        self.drop_usage_only = drop_usage_only
        self.api = api
        self.usage: dict[str, Any] | None = None
        """The stream's usage: the usage objects seen, merged (later fields win)."""
        self.event: Any = None
        """The last event that carried usage (Responses' names the response)."""
        self._pending = b""

    def feed(self, chunk: bytes) -> bytes:
        """The whole events completed by ``chunk``, usage-only chunk removed if asked (may be empty)."""
        if self._pending:
            chunk = self._pending + chunk
            self._pending = b""
        n = len(chunk)
        if not chunk.endswith(b"\n\n"):
            # NOTE: keep an event cut by the chunk boundary until its end arrives, so a usage chunk is never
            # split between two reads (and never half-relayed before it is recognised).
            end = max(chunk.rfind(b"\n\n") + 2, chunk.rfind(b"\n\r\n") + 3)
            if end < 3:
                self._pending = chunk
                return b""
            if end < n:
                self._pending = chunk[end:]
                chunk = chunk[:end]
        return self._scan(chunk)

    def flush(self) -> bytes:
        """What is left at the end of the stream (an unterminated last event), scanned like the rest."""
        rest, self._pending = self._pending, b""
        return self._scan(rest) if rest else rest

    def _scan(self, chunk: bytes) -> bytes:
        """``chunk`` (whole events) with the usage read and the usage-only event dropped if asked.

        Only the events around an occurrence of ``"usage"`` are cut out and looked at (``find`` / ``rfind``
        run in C; a regex split of every event would cost more than the rest of the relay)."""
        i = chunk.find(_USAGE)
        if i < 0:
            return chunk
        parts: list[bytes] = []
        kept = 0  # chunk[:kept] is decided
        while i >= 0:
            a, b = chunk.rfind(b"\n\n", 0, i), chunk.rfind(b"\n\r\n", 0, i)
            start = max(a + 2 if a >= 0 else 0, b + 3 if b >= 0 else 0)
            a, b = chunk.find(b"\n\n", i), chunk.find(b"\r\n\r\n", i)
            ends = [x for x in (a + 2 if a >= 0 else -1, b + 4 if b >= 0 else -1) if x >= 0]
            end = min(ends) if ends else len(chunk)
            if self._take(chunk[start:end]):
                parts.append(chunk[kept:start])
                kept = end
            i = chunk.find(_USAGE, end)
        if not kept:
            return chunk
        parts.append(chunk[kept:])
        return b"".join(parts)

    def _take(self, event: bytes) -> bool:
        """Read usage from ``event``; True if the event is to be dropped."""
        if _USAGE not in event or _NULL_USAGE[0] in event or _NULL_USAGE[1] in event:
            return False
        if event.startswith(b"data:") and b"\ndata:" not in event:
            data = event[5:]  # one data line (the usual): JSON allows the surrounding whitespace
        else:
            data = b"".join(line[5:].strip() for line in event.splitlines() if line.startswith(b"data:"))
        try:
            obj = loads(data)
        except ValueError:
            return False
        usage = self.api.event_usage(obj)
        if usage is None:
            return False
        self.usage = usage if self.usage is None else {**self.usage, **usage}
        self.event = obj
        return self.drop_usage_only and self.api.usage_only(obj)
