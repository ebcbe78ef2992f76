"""Replies of an OpenAI-compatible server as the driver reads them: one turn's outcome (:class:`Reply`), one failed
attempt (:class:`AttemptError`), non-streamed bodies and SSE streams, and what a kvgate gateway says in its response
headers (``X-Kvgate-Park-Wait``, ``X-Kvgate-Hold``, ``X-Kvgate-Control``).

Usage is read where the API puts it (:mod:`kvgate.http.dialect`): ``cached_tokens`` is None when the server did not
report it.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvgate.http.dialect import CHAT, Api, Usage

if TYPE_CHECKING:
    import aiohttp

RETRY_AFTER_CAP_S = 30.0


@dataclass(slots=True)
class Reply:
    """The outcome of one turn (after retries)."""

    ok: bool
    error: str = ""
    http_status: int | None = None
    """HTTP status of the last attempt (None: no response, e.g. connection refused or timeout)."""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    cached_reported: bool = False
    """Whether the usage reported cached tokens (the API's field was present)."""
    token_ids: list[int] | None = None
    """Completion token ids, when the server returned them."""
    text: str = ""
    first_token_at: float | None = None
    """Loop time of the first streamed chunk carrying output (None when not streaming)."""
    attempts: int = 0
    usage_seen: bool = False
    usage: Usage | None = None
    """The usage as the API's dialect reads it (None: none came)."""
    park_wait_s: float | None = None
    """Seconds (gateway time) a kvgate gateway held the turn (``X-Kvgate-Park-Wait``); None: no gateway said."""
    hold: str | None = None
    """``X-Kvgate-Hold``: "none", "parked" or "waiting"."""
    control: str | None = None
    """``X-Kvgate-Control``: the gateway's control when it released the turn."""


@dataclass
class AttemptError(Exception):
    """One failed attempt."""

    text: str
    http_status: int | None = None
    retryable: bool = False
    retry_after_s: float | None = None
    kind: str = "error"
    """"connect", "timeout", "http", "protocol"."""
    extra: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.text


ErrorHook = Callable[[AttemptError, int, bool], None]
"""Called for every failed attempt with (error, attempt number from 1, will retry)."""


def one_line(text: str, limit: int = 300) -> str:
    t = " ".join(text.split())
    return t if len(t) <= limit else t[: limit - 3] + "..."


def retry_after(headers: Mapping[str, str]) -> float | None:
    v = headers.get("Retry-After")
    if v is None:
        return None
    try:
        s = float(v)
    except ValueError:
        return None
    return min(max(0.0, s), RETRY_AFTER_CAP_S) if math.isfinite(s) else None


def _usage_into(r: Reply, usage: Any, api: Api) -> None:
    u = api.usage(usage)
    if u is None:
        return
    r.usage_seen = True
    r.usage = u
    r.prompt_tokens = u.prompt
    r.completion_tokens = u.completion
    if u.cached is not None:
        r.cached_tokens = u.cached
        r.cached_reported = True


def _choice_into(r: Reply, choice: Any, *, delta: bool) -> bool:
    """Fold one choice (or streamed delta) into ``r``; True if it carried output."""
    if not isinstance(choice, dict):
        raise AttemptError("malformed choice in response", kind="protocol")
    text = choice.get("text")
    if text is None:
        msg = choice.get("delta" if delta else "message")
        text = msg.get("content") if isinstance(msg, dict) else None
    got = False
    if isinstance(text, str) and text:
        r.text += text
        got = True
    ids = choice.get("token_ids")
    if isinstance(ids, list) and ids:
        if not all(type(i) is int for i in ids):
            raise AttemptError("malformed token_ids in response", kind="protocol")
        if r.token_ids is None:
            r.token_ids = []
        r.token_ids.extend(ids)
        got = True
    elif isinstance(ids, list) and r.token_ids is None:
        r.token_ids = []
    return got


def gateway_headers_into(r: Reply, headers: Mapping[str, str]) -> None:
    """What a kvgate gateway did with the turn, from its response headers (nothing when there are none)."""
    wait = headers.get("X-Kvgate-Park-Wait")
    if wait is None:
        return
    try:
        w = float(wait)
    except ValueError:
        w = math.nan
    r.park_wait_s = w if math.isfinite(w) and w >= 0 else None
    r.hold = headers.get("X-Kvgate-Hold")
    r.control = headers.get("X-Kvgate-Control")


def parse_completion(obj: Any, api: Api = CHAT) -> Reply:
    """A non-streamed ``/v1/completions`` or ``/v1/chat/completions`` response body."""
    if not isinstance(obj, dict):
        raise AttemptError("response is not a JSON object", kind="protocol")
    if "error" in obj and "choices" not in obj:
        raise AttemptError(f"error in response: {one_line(json.dumps(obj['error']))}", kind="protocol")
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices:
        raise AttemptError("response has no choices", kind="protocol")
    r = Reply(ok=True)
    _choice_into(r, choices[0], delta=False)
    _usage_into(r, obj.get("usage"), api)
    return r


def copy_gateway(src: Reply | None, dst: Reply) -> None:
    if src is not None:
        dst.park_wait_s, dst.hold, dst.control = src.park_wait_s, src.hold, src.control


async def read_stream(resp: aiohttp.ClientResponse, api: Api = CHAT) -> Reply:
    """Fold an SSE stream (``data: {...}`` events, ``data: [DONE]``) into a Reply.

    NOTE: events are split by hand rather than with ``resp.content.readline()``: with ``return_token_ids`` vLLM
    puts the whole prompt's ids into the first event, which can exceed aiohttp's line limit.
    """
    loop = asyncio.get_running_loop()
    r = Reply(ok=True)
    buf = b""
    done = False
    usage: dict[str, Any] | None = None
    async for data in resp.content.iter_any():
        buf += data
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                break
            line, buf = buf[:nl].strip(), buf[nl + 1 :]
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                continue
            try:
                ev = json.loads(payload)
            except ValueError:
                raise AttemptError("malformed SSE event", http_status=200, kind="protocol") from None
            if not isinstance(ev, dict):
                continue
            if "error" in ev and not ev.get("choices"):
                raise AttemptError(
                    f"error event in stream: {one_line(json.dumps(ev['error']))}",
                    http_status=200,
                    retryable=True,
                    kind="http",
                )
            choices = ev.get("choices")
            if isinstance(choices, list) and choices:
                got = _choice_into(r, choices[0], delta=True)
                if got and r.first_token_at is None:
                    r.first_token_at = loop.time()
            u = api.event_usage(ev)
            if u is not None:
                usage = u if usage is None else {**usage, **u}
    if usage is not None:
        _usage_into(r, usage, api)
    if not done:
        raise AttemptError("stream ended without [DONE]", http_status=200, retryable=True, kind="connect")
    return r
