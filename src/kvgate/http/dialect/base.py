"""What every wire API shares: :class:`Usage`, the :class:`Api` base (OpenAI's shapes where an API does not say
otherwise), the answer a client reads (:class:`Answer`, folded from a whole body or a stream by :class:`Fold`), the
writer of an engine's agent answers (:class:`AnswerWriter`) and the readers of odd JSON every API uses.

Nothing here does I/O; readers never raise on odd input (a field of the wrong type reads as absent), except
:meth:`Api.read_answer` and :meth:`Fold.feed`, which raise :class:`WireError` on an answer that is not one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import orjson


@dataclass(slots=True)
class Usage:
    """A turn's usage, whatever the API: every prompt token (cached ones included), the cached prefix (None when
    the server did not report it) and the output tokens."""

    prompt: int
    cached: int | None
    completion: int


Call = tuple[str, str, str]
"""A tool call of an item: ``(id, name, arguments as text)``."""
Parts = tuple[str, str, tuple[Call, ...]]
"""An item read as ``(role, text, tool calls)``."""
Tool = tuple[str, str]
"""The call an engine's answer makes: ``(tool name, arguments as JSON text)``."""
TextOf = Callable[[int, int], str]
"""The text of an engine's output tokens ``start .. stop - 1``."""


class WireError(ValueError):
    """An answer that is not one of its API (the client counts it a protocol error)."""


@dataclass(slots=True)
class Answer:
    """What a client reads of an answer: its text, tool calls, the items to send back, token ids and usage."""

    text: str = ""
    calls: list[Call] = field(default_factory=list)
    items: list[dict[str, Any]] | None = None
    """Responses' output items or Messages' content blocks, as they came (sent back verbatim)."""
    token_ids: list[int] | None = None
    """Completion token ids, when the server returned them."""
    usage: Any = None
    """The usage object as it came (None: none)."""


class Api:
    """One HTTP API (the instances :data:`kvgate.http.dialect.COMPLETIONS`, ``CHAT``, ``RESPONSES``,
    ``MESSAGES``); the defaults are OpenAI's."""

    name = ""
    path = ""
    budget_fields: tuple[str, ...] = ("max_tokens",)
    budget_required = False
    """A request without its budget is refused (Messages' ``max_tokens``)."""
    default_budget = 256
    """An engine's budget for a request that sets none (the simulated model has no EOS)."""
    usage_option = True
    """A stream carries usage only when the request asks for it (``stream_options.include_usage``)."""
    chat_like = False
    """Its prompt is a conversation (a head and items), not a prompt string or token ids."""
    sampling_params = True
    """vLLM reads its sampling extras from the body (``ignore_eos``, ``min_tokens``, ``return_token_ids``, ``n``)."""
    prompt_field = "prompt"
    missing_prompt = "'prompt' is required"
    """An engine's refusal of a body without a prompt it can read."""
    stored_field: str | None = None
    """The field naming an answer the server kept (Responses' ``previous_response_id``): the body then carries
    only what is new."""
    stream_end = "[DONE]"

    # -- reading usage ---------------------------------------------------------------------------------------
    def usage(self, u: Any) -> Usage | None:
        """The usage object of an answer (None when it is not one: not an object, or without its prompt count)."""
        return openai_usage(u, "prompt_tokens", "completion_tokens")

    def event_usage(self, event: Any) -> dict[str, Any] | None:
        """The usage object an SSE event's data carries (None: none)."""
        u = event.get("usage") if type(event) is dict else None
        return u if type(u) is dict else None

    def usage_only(self, event: dict[str, Any]) -> bool:
        """An event that carries nothing but the usage (dropped when the gateway asked for usage on its own)."""
        return event.get("choices") == []

    def answer_id(self, obj: Any) -> str | None:
        """The id of an answer (a whole body, or the stream event that carried its usage)."""
        if type(obj) is not dict:
            return None
        for key in ("response", "message"):  # (Responses' and Messages' stream events wrap it)
            inner = obj.get(key)
            if type(inner) is dict and "id" in inner:
                obj = inner
                break
        rid = obj.get("id")
        return rid if type(rid) is str else None

    def answer_text(self, obj: Any) -> str:
        """The text of a whole answer (its first choice's)."""
        choices = obj.get("choices") if type(obj) is dict else None
        if type(choices) is not list or not choices or type(choices[0]) is not dict:
            return ""
        c = choices[0]
        msg = c.get("message")
        return str_of(c.get("text")) or (text_of(msg.get("content")) if type(msg) is dict else "")

    def budget(self, body: dict[str, Any], default: int) -> int:
        """o_s: the first of :attr:`budget_fields` that is a non-negative integer, else ``default``."""
        for key in self.budget_fields:
            v = body.get(key)
            if type(v) is int and v >= 0:
                return v
        return default

    def continues(self, body: dict[str, Any]) -> bool:
        """The body names an answer the server kept (:attr:`stored_field`): it carries only what is new."""
        return self.stored_field is not None and type(body.get(self.stored_field)) is str

    # -- conversations ----------------------------------------------------------------------------------------
    def conversation(self, body: dict[str, Any]) -> tuple[list[Any], list[Any]] | None:
        """``(head, items)`` of a conversation API's body; None for a body that is not one (or a prompt API)."""
        return None

    def parts(self, item: Any) -> Parts:
        """An item as ``(role, text, calls)``."""
        return chat_parts(item)

    def tool_of(self, t: Any) -> tuple[str, dict[str, Any]] | None:
        """A tool the request offers as ``(name, parameters schema)`` (None: not one that can be called)."""
        return None

    def template_tools(self, body: dict[str, Any]) -> list[Any] | None:
        """The request's callable tools in chat's form, as vLLM hands them to the chat template (None: none)."""
        return None

    def template_messages(self, body: dict[str, Any]) -> Any:
        """The chat messages the engine's template renders (None: the body has no conversation to render): each
        item as its role, text and tool calls."""
        conv = self.conversation(body)
        if conv is None or not (conv[0] or conv[1]):
            return None
        return [chat_message(self.parts(it)) for it in conv[0] + conv[1]]

    def generation_prompt(self, body: dict[str, Any]) -> bool:
        """Whether the template ends with the assistant's turn opening."""
        return True

    def image_tokens(self, part: dict[str, Any], size: tuple[int, int] | None) -> int:
        """Tokens of an image part of ``size`` (None: unknown), as OpenAI counts them: 85 plus 170 a 512-pixel tile
        of the image scaled into 2048 x 2048 and its short side to 768; 85 at ``detail: low``."""
        url = part.get("image_url")
        detail = (url.get("detail") if type(url) is dict else None) or part.get("detail")
        if detail == "low":
            return 85
        if size is None:
            return OPENAI_IMAGE_DEFAULT
        w, h = size
        f = min(1.0, 2048 / max(w, h))
        w, h = w * f, h * f
        f = min(1.0, 768 / max(1.0, min(w, h)))
        w, h = w * f, h * f
        return 85 + 170 * (-(-int(w) // 512)) * (-(-int(h) // 512))

    # -- sending (a client) -----------------------------------------------------------------------------------
    def request_fields(self, token_ids: bool) -> dict[str, Any]:
        """The fields a client adds to every request of this API (``token_ids``: ask for vLLM's token ids)."""
        return {}

    def request_body(self, system: str, items: list[dict[str, Any]], budget: int) -> dict[str, Any]:
        """A conversation's request: a system prompt, then chat-shaped user ``items``, answered in ``budget``."""
        raise NotImplementedError(self.name)

    def tools_field(self, tool: dict[str, Any]) -> list[dict[str, Any]]:
        """The ``tools`` offering ``tool`` (``{name, description, parameters}``), in this API's form."""
        raise NotImplementedError(self.name)

    def convo_body(self, head: str, system: str, nonce: bool, tools: str, items: str) -> bytes:
        """A conversation's body: ``head`` (a JSON object without its closing brace), the system prompt (opening
        with a nonce line when ``nonce``), ``tools`` (``,"tools":[...]`` or "") and ``items`` (comma-joined JSON)."""
        raise NotImplementedError(self.name)

    def answer_items(self, answer: Answer) -> list[str]:
        """The model's answer as the agent sends it back (JSON texts of items)."""
        raise NotImplementedError(self.name)

    def append_item(self, call: str | None, text: str, role: str, k: int) -> str:
        """What an agent appends after turn ``k``: the result of the model's ``call``, else a ``role`` message."""
        raise NotImplementedError(self.name)

    # -- reading answers (a client) ---------------------------------------------------------------------------
    def read_answer(self, obj: dict[str, Any]) -> Answer:
        """A whole answer: its text, calls, items to send back, token ids and usage."""
        choices = obj.get("choices")
        if not isinstance(choices, list) or not choices:
            raise WireError("response has no choices")
        a = Answer(usage=obj.get("usage"))
        fold_choice(a, choices[0], delta=False)
        return a

    def fold(self) -> Fold:
        """A fold of this API's stream."""
        return Fold(self)

    # -- answering (the engine server) -----------------------------------------------------------------------
    def make_usage(self, prompt: int, cached: int, completion: int, *, details: bool | None = True,
                   created: int | None = None) -> dict[str, Any]:
        """The usage object as vLLM answers it. ``details``: True (cached tokens reported), None (reported as
        null: vLLM without --enable-prompt-tokens-details), False (absent: SGLang without --enable-cache-report).
        ``created``: vLLM 0.32's ``created_cache_tokens`` (prompt tokens computed into cached blocks), if known."""
        out: dict[str, Any] = {"prompt_tokens": prompt, "total_tokens": prompt + completion,
                               "completion_tokens": completion}
        if details:
            d: dict[str, int] = {"cached_tokens": cached}
            if created is not None:
                d["created_cache_tokens"] = created
            out["prompt_tokens_details"] = d
        elif details is None:
            out["prompt_tokens_details"] = None
        return out

    def writer(self, rid: str, created: int, model: str, tool: Tool | None, budget: int, finish: str,
               text: TextOf) -> AnswerWriter | None:
        """The writer of an agent answer in this API's events (None: the API's answers are choices)."""
        return None


OPENAI_IMAGE_DEFAULT = 765
"""OpenAI's high-detail image of unknown size counted as 1024 x 1024: 85 + 170 x 4 tiles."""


class Fold:
    """What a stream of one API folds into (OpenAI's: ``choices`` deltas, then ``data: [DONE]``)."""

    def __init__(self, api: Api) -> None:
        self.api = api
        self.answer = Answer()
        self.done = False

    def feed(self, ev: dict[str, Any]) -> bool:
        """One event; True if it carried output."""
        u = self.api.event_usage(ev)
        if u is not None:
            got = self.answer.usage
            self.answer.usage = u if got is None else {**got, **u}
        return self.event(ev, ev.get("type"))

    def event(self, ev: dict[str, Any], kind: Any) -> bool:
        choices = ev.get("choices")
        return isinstance(choices, list) and bool(choices) and fold_choice(self.answer, choices[0], delta=True)

    def finish(self) -> Answer:
        return self.answer


class AnswerWriter:
    """One agent answer of an engine (Responses, Messages): its whole body, or its stream's events in order. An
    answer ``finish`` es ``tool``, ``stop`` or ``length`` (:data:`kvgate.serve.agent.Finish`): only ``length`` says
    the budget cut it."""

    call_prefix = "call_"

    def __init__(self, rid: str, created: int, model: str, tool: Tool | None, budget: int, finish: str,
                 text: TextOf) -> None:
        self.rid = rid
        self.created = created
        self.model = model
        self.tool = tool
        self.budget = budget
        self.finish = finish
        self.text = text
        self.seq = 0
        tag = os.urandom(6).hex()
        self.item_id, self.call_id = f"msg_{tag}", self.call_prefix + tag

    def whole(self, generated: int, usage: dict[str, Any]) -> dict[str, Any]:
        """The whole answer of ``generated`` tokens."""
        raise NotImplementedError

    def opening(self, usage: dict[str, Any]) -> bytes:
        """The events before the first token (``usage``: the usage known at the start, Messages' input)."""
        raise NotImplementedError

    def tokens(self, start: int, stop: int) -> bytes:
        """Events for output tokens ``start .. stop - 1``."""
        raise NotImplementedError

    def closing(self, generated: int, usage: dict[str, Any]) -> bytes:
        """The events after the last token: the text done, the tool call, the usage."""
        raise NotImplementedError


def sse_event(name: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


# -- readers -----------------------------------------------------------------------------------------------------


def openai_usage(u: Any, prompt_key: str, output_key: str) -> Usage | None:
    """OpenAI's usage shape: ``prompt_key``, its ``*_details.cached_tokens``, ``output_key``."""
    if type(u) is not dict or type(u.get(prompt_key)) is not int:
        return None
    details = u.get(prompt_key.replace("_tokens", "_tokens_details"))
    cached: int | None = None
    if type(details) is dict:  # (SGLang with --enable-cache-report omits cached_tokens when it is 0)
        c = int_of(details.get("cached_tokens", 0))
        cached = c if c >= 0 else None
    return Usage(max(int_of(u.get(prompt_key)), 0), cached, max(int_of(u.get(output_key)), 0))


def fold_choice(a: Answer, choice: Any, *, delta: bool) -> bool:
    """Fold one choice (or streamed delta) into ``a``; True if it carried output."""
    if not isinstance(choice, dict):
        raise WireError("malformed choice in response")
    text = choice.get("text")
    msg = choice.get("delta" if delta else "message")
    if text is None:
        text = msg.get("content") if isinstance(msg, dict) else None
    got = False
    if isinstance(text, str) and text:
        a.text += text
        got = True
    calls = msg.get("tool_calls") if isinstance(msg, dict) else None
    if isinstance(calls, list) and calls:
        _fold_calls(a, calls, delta)
    ids = choice.get("token_ids")
    if isinstance(ids, list) and ids:
        if not all(type(i) is int for i in ids):
            raise WireError("malformed token_ids in response")
        if a.token_ids is None:
            a.token_ids = []
        a.token_ids.extend(ids)
        got = True
    elif isinstance(ids, list) and a.token_ids is None:
        a.token_ids = []
    return got


def _fold_calls(a: Answer, calls: list[Any], delta: bool) -> None:
    """Chat's tool calls: whole, or streamed pieces by index (the id and name once, the arguments in parts)."""
    for c in calls:
        if not isinstance(c, dict):
            continue
        fn = c.get("function") if isinstance(c.get("function"), dict) else {}
        i = c.get("index", len(a.calls)) if delta else len(a.calls)
        while len(a.calls) <= (i if isinstance(i, int) and 0 <= i < 64 else len(a.calls)):
            a.calls.append(("", "", ""))
        j = i if isinstance(i, int) and 0 <= i < len(a.calls) else len(a.calls) - 1
        cid, name, args = a.calls[j]
        a.calls[j] = (cid or str(c.get("id") or ""), name or str(fn.get("name") or ""),
                      args + str(fn.get("arguments") or ""))


def read_items(obj: dict[str, Any], field: str) -> Answer:
    """A whole answer whose ``field`` is a list of items (Responses' output, Messages' content blocks)."""
    items = obj.get(field)
    if not isinstance(items, list):
        raise WireError(f"response has no {field}")
    a = Answer(usage=obj.get("usage"))
    fold_items(a, items)
    return a


def fold_items(a: Answer, items: list[Any]) -> None:
    """Responses' output items or Messages' content blocks: the text, the calls, and the items to send back."""
    a.items = [it for it in items if isinstance(it, dict)]
    for it in a.items:
        kind = it.get("type")
        if kind == "message":
            a.text += "".join(p.get("text", "") for p in it.get("content") or () if isinstance(p, dict)
                              and isinstance(p.get("text"), str))
        elif kind == "text" and isinstance(it.get("text"), str):
            a.text += it["text"]
        elif kind == "function_call":
            a.calls.append((str(it.get("call_id", "")), str(it.get("name", "")), str(it.get("arguments", ""))))
        elif kind == "tool_use":
            a.calls.append((str(it.get("id", "")), str(it.get("name", "")), json.dumps(it.get("input", {}))))


def chat_message(parts: Parts) -> dict[str, Any]:
    """An item's ``(role, text, calls)`` as the chat message a template renders."""
    role, text, calls = parts
    m: dict[str, Any] = {"role": role or "user", "content": text}
    if calls:
        m["tool_calls"] = [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                           for cid, name, args in calls]
    return m


def named_tool(name: Any, schema: Any) -> tuple[str, dict[str, Any]] | None:
    if type(name) is not str or not name:
        return None
    return name, schema if type(schema) is dict else {}


HEAD_ROLES = ("system", "developer")


def lead(items: list[Any]) -> int:
    """How many leading items are system or developer messages (the head)."""
    k = 0
    for m in items:
        if type(m) is not dict or m.get("role") not in HEAD_ROLES:
            break
        k += 1
    return k


def chat_parts(msg: Any) -> Parts:
    if type(msg) is not dict:
        return "", "", ()
    calls: tuple[Call, ...] = ()
    tc = msg.get("tool_calls")
    if type(tc) is list and tc:
        out = []
        for c in tc:
            fn = c.get("function") if type(c) is dict else None
            if type(fn) is dict:
                out.append((str_of(c.get("id")), str_of(fn.get("name")), str_of(fn.get("arguments"))))
        calls = tuple(out)
    role = msg.get("role")
    content = msg.get("content")
    return (role if type(role) is str else "", content if type(content) is str else text_of(content), calls)


def text_of(content: Any) -> str:
    """The text of a content field: a string, or the ``text`` of its parts (any API's part shapes)."""
    if type(content) is str:
        return content
    if type(content) is not list:
        return ""
    out = []
    for part in content:
        if type(part) is str:
            out.append(part)
        elif type(part) is dict:
            t = part.get("text")
            if type(t) is str:
                out.append(t)
    return "".join(out)


def json_text(v: Any) -> str:
    try:
        return orjson.dumps(v, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:
        return ""


def str_of(v: Any) -> str:
    return v if type(v) is str else ""


def int_of(v: Any) -> int:
    return v if type(v) is int else -1
