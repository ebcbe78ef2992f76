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

from kvgate.http.dialect import CHAT, Answer, Api, Fold, Usage, WireError

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
    calls: list[tuple[str, str, str]] = field(default_factory=list)
    """Tool calls of the answer: ``(id, name, arguments as JSON text)``."""
    items: list[dict[str, Any]] | None = None
    """Responses' output items or Messages' content blocks, as they came (sent back verbatim)."""
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
    """A non-streamed answer of ``api``: its text, tool calls (and the output items or blocks to send back), usage."""
    if not isinstance(obj, dict):
        raise AttemptError("response is not a JSON object", kind="protocol")
    if "error" in obj and "choices" not in obj and "output" not in obj and "content" not in obj:
        raise AttemptError(f"error in response: {one_line(json.dumps(obj['error']))}", kind="protocol")
    try:
        a = api.read_answer(obj)
    except WireError as e:
        raise AttemptError(str(e), kind="protocol") from None
    return _answer_into(Reply(ok=True), a, api)


def _answer_into(r: Reply, a: Answer, api: Api) -> Reply:
    """What the dialect read of the answer, into the reply."""
    r.text, r.calls, r.items, r.token_ids = a.text, a.calls, a.items, a.token_ids
    if a.usage is not None:
        _usage_into(r, a.usage, api)
    return r


def copy_gateway(src: Reply | None, dst: Reply) -> None:
    if src is not None:
        dst.park_wait_s, dst.hold, dst.control = src.park_wait_s, src.hold, src.control


async def read_stream(resp: aiohttp.ClientResponse, api: Api = CHAT) -> Reply:
    """Fold an SSE stream of ``api`` into a Reply: ``data: {...}`` events ended by ``data: [DONE]`` (completions,
    chat), ``event:``/``data:`` pairs ended by ``response.completed`` (Responses) or ``message_stop`` (Messages).

    NOTE: events are split by hand rather than with ``resp.content.readline()``: with ``return_token_ids`` vLLM
    puts the whole prompt's ids into the first event, which can exceed aiohttp's line limit.
    """
    loop = asyncio.get_running_loop()
    r = Reply(ok=True)
    st = api.fold()
    buf = b""
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
                st.done = True
                continue
            try:
                ev = json.loads(payload)
            except ValueError:
                raise AttemptError("malformed SSE event", http_status=200, kind="protocol") from None
            if isinstance(ev, dict) and _feed(st, ev) and r.first_token_at is None:
                r.first_token_at = loop.time()
    _answer_into(r, st.finish(), api)
    if not st.done:
        raise AttemptError(f"stream ended without {api.stream_end}", http_status=200, retryable=True, kind="connect")
    return r


def _feed(st: Fold, ev: dict[str, Any]) -> bool:
    """One event of a stream; True if it carried output."""
    kind = ev.get("type")
    if ("error" in ev and not ev.get("choices") and kind is None) or kind == "error":
        err = ev.get("error", ev)
        raise AttemptError(f"error event in stream: {one_line(json.dumps(err))}", http_status=200,
                           retryable=True, kind="http")
    try:
        return st.feed(ev)
    except WireError as e:
        raise AttemptError(str(e), kind="protocol") from None

