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

from kvgate.http.dialect import CHAT, MESSAGES, RESPONSES, Api, Usage

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
    msg = choice.get("delta" if delta else "message")
    calls = msg.get("tool_calls") if isinstance(msg, dict) else None
    if isinstance(calls, list) and calls:
        _calls_into(r, calls, delta)
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


def _calls_into(r: Reply, calls: list[Any], delta: bool) -> None:
    """Chat's tool calls: whole, or streamed pieces by index (the id and name once, the arguments in parts)."""
    for c in calls:
        if not isinstance(c, dict):
            continue
        fn = c.get("function") if isinstance(c.get("function"), dict) else {}
        i = c.get("index", len(r.calls)) if delta else len(r.calls)
        while len(r.calls) <= (i if isinstance(i, int) and 0 <= i < 64 else len(r.calls)):
            r.calls.append(("", "", ""))
        j = i if isinstance(i, int) and 0 <= i < len(r.calls) else len(r.calls) - 1
        cid, name, args = r.calls[j]
        r.calls[j] = (cid or str(c.get("id") or ""), name or str(fn.get("name") or ""),
                      args + str(fn.get("arguments") or ""))


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
    r = Reply(ok=True)
    if api is RESPONSES or api is MESSAGES:
        items = obj.get("output" if api is RESPONSES else "content")
        if not isinstance(items, list):
            raise AttemptError(f"response has no {'output' if api is RESPONSES else 'content'}", kind="protocol")
        _items_into(r, items, api)
    else:
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices:
            raise AttemptError("response has no choices", kind="protocol")
        _choice_into(r, choices[0], delta=False)
    _usage_into(r, obj.get("usage"), api)
    return r


def _items_into(r: Reply, items: list[Any], api: Api) -> None:
    """Responses' output items or Messages' content blocks: the text, the calls, and the items to send back."""
    r.items = [it for it in items if isinstance(it, dict)]
    for it in r.items:
        kind = it.get("type")
        if kind == "message":
            r.text += "".join(p.get("text", "") for p in it.get("content") or () if isinstance(p, dict)
                              and isinstance(p.get("text"), str))
        elif kind == "text" and isinstance(it.get("text"), str):
            r.text += it["text"]
        elif kind == "function_call":
            r.calls.append((str(it.get("call_id", "")), str(it.get("name", "")), str(it.get("arguments", ""))))
        elif kind == "tool_use":
            r.calls.append((str(it.get("id", "")), str(it.get("name", "")), json.dumps(it.get("input", {}))))


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
    st = _Stream(r, api)
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
            if isinstance(ev, dict) and st.feed(ev) and r.first_token_at is None:
                r.first_token_at = loop.time()
    return st.finish()


class _Stream:
    """What a stream of one API folds into: the text, the tool calls, the items to send back, the usage."""

    def __init__(self, r: Reply, api: Api) -> None:
        self.r = r
        self.api = api
        self.done = False
        self.usage: dict[str, Any] | None = None
        self.blocks: dict[int, dict[str, Any]] = {}
        """Messages' content blocks by index (a tool_use block's input as its JSON text while it streams)."""

    def feed(self, ev: dict[str, Any]) -> bool:
        """One event; True if it carried output."""
        kind = ev.get("type")
        if ("error" in ev and not ev.get("choices") and kind is None) or kind == "error":
            err = ev.get("error", ev)
            raise AttemptError(f"error event in stream: {one_line(json.dumps(err))}", http_status=200,
                               retryable=True, kind="http")
        u = self.api.event_usage(ev)
        if u is not None:
            self.usage = u if self.usage is None else {**self.usage, **u}
        if self.api is RESPONSES:
            return self._responses(ev, kind)
        if self.api is MESSAGES:
            return self._messages(ev, kind)
        choices = ev.get("choices")
        return isinstance(choices, list) and bool(choices) and _choice_into(self.r, choices[0], delta=True)

    def _responses(self, ev: dict[str, Any], kind: Any) -> bool:
        if kind == "response.output_text.delta" and isinstance(ev.get("delta"), str):
            self.r.text += ev["delta"]
            return bool(ev["delta"])
        if kind in ("response.completed", "response.incomplete", "response.failed"):
            self.done = True
            out = ev.get("response", {}).get("output") if isinstance(ev.get("response"), dict) else None
            if isinstance(out, list):
                text = self.r.text
                self.r.text = ""
                _items_into(self.r, out, RESPONSES)
                self.r.text = self.r.text or text
        return False

    def _messages(self, ev: dict[str, Any], kind: Any) -> bool:
        i = ev.get("index")
        if kind == "content_block_start" and isinstance(ev.get("content_block"), dict) and isinstance(i, int):
            block = dict(ev["content_block"])
            if block.get("type") == "tool_use":
                block["input"] = ""
            self.blocks[i] = block
        elif kind == "content_block_delta" and isinstance(ev.get("delta"), dict) and i in self.blocks:
            d, block = ev["delta"], self.blocks[i]
            if d.get("type") == "text_delta" and isinstance(d.get("text"), str):
                block["text"] = block.get("text", "") + d["text"]
                return bool(d["text"])
            if d.get("type") == "input_json_delta" and isinstance(d.get("partial_json"), str):
                block["input"] += d["partial_json"]
        elif kind == "message_stop":
            self.done = True
        return False

    def finish(self) -> Reply:
        r = self.r
        if self.blocks:
            blocks = [self.blocks[i] for i in sorted(self.blocks)]
            for b in blocks:
                if b.get("type") == "tool_use":
                    try:
                        b["input"] = json.loads(b["input"] or "{}")
                    except ValueError:
                        b["input"] = {}
            _items_into(r, blocks, MESSAGES)
        if self.usage is not None:
            _usage_into(r, self.usage, self.api)
        if not self.done:
            end = "[DONE]" if not (self.api is RESPONSES or self.api is MESSAGES) else "its last event"
            raise AttemptError(f"stream ended without {end}", http_status=200, retryable=True, kind="connect")
        return r
