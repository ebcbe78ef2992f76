"""The wire dialects: what each API and each engine kind says on the wire, in one place. The gateway, the driver,
``kvgate doctor`` and ``kvgate engine`` all read them here.

APIs (:class:`Api`; :data:`APIS` by name, :func:`api_for_path` by path)::

    api          path                  prompt                      output budget
    completions  /v1/completions       prompt                      max_tokens
    chat         /v1/chat/completions  messages                    max_completion_tokens, else max_tokens
    responses    /v1/responses         instructions, input         max_output_tokens
    messages     /v1/messages          system, messages            max_tokens

    api          usage: prompt                  cached                                 output
    completions  prompt_tokens                  prompt_tokens_details.cached_tokens    completion_tokens
    chat         prompt_tokens                  prompt_tokens_details.cached_tokens    completion_tokens
    responses    input_tokens                   input_tokens_details.cached_tokens     output_tokens
    messages     input_tokens + cache_read_     cache_read_input_tokens                output_tokens
                 input_tokens + cache_creation_input_tokens

* Cached tokens are reported in vLLM with ``--enable-prompt-tokens-details`` for completions, chat and Messages (a
  Messages answer then has ``cache_read_input_tokens``; without it the field is absent and ``input_tokens`` is the
  whole prompt), always for Responses; in SGLang with ``--enable-cache-report``. Anthropic's ``input_tokens`` counts
  only the uncached part (vLLM: ``prompt - cache_read - cache_creation``), so the prompt is the sum of the three.
* Streams. Completions and chat carry usage only with ``stream_options.include_usage``, in a chunk with
  ``"choices": []`` before ``data: [DONE]``; Responses in the ``response.completed`` (or ``.incomplete``,
  ``.failed``) event's ``response.usage``; Messages in ``message_start``'s ``message.usage`` (the input) and
  ``message_delta``'s ``usage`` (the output; vLLM repeats the input there): the stream's usage is the merge of
  both, later fields winning.
* A conversation is a *head* (chat's leading system/developer messages, Responses' ``instructions`` and leading
  system/developer input items, Messages' ``system``) and *items* (the messages or input items after it). Every
  item reads as ``(role, text, calls)`` (:meth:`Api.parts`): a tool call is ``(id, name, arguments)``.

Engine kinds (:class:`EngineKind`; :data:`KINDS` by name): vLLM, SGLang, Dynamo's frontend and a kvgate gateway;
their metric names, where their KV pool is read, their flush endpoint, the flag that makes them report cached
tokens and their quirks. The discovery of an endpoint (which kind, how large its pool: reading what these name) is
:mod:`kvgate.http.openai`'s.

Nothing here does I/O; readers never raise on odd input (a field of the wrong type reads as absent).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import orjson

# -- usage -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
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


class Api:
    """One HTTP API (the instances :data:`COMPLETIONS`, :data:`CHAT`, :data:`RESPONSES`, :data:`MESSAGES`)."""

    name = "completions"
    path = "/v1/completions"
    budget_fields: tuple[str, ...] = ("max_tokens",)
    usage_option = True
    """A stream carries usage only when the request asks for it (``stream_options.include_usage``)."""
    chat_like = False
    """Its prompt is a conversation (a head and items), not a prompt string or token ids."""

    # -- reading usage ---------------------------------------------------------------------------------------
    def usage(self, u: Any) -> Usage | None:
        """The usage object of an answer (None when it is not one: not an object, or without its prompt count)."""
        if type(u) is not dict or type(u.get("prompt_tokens")) is not int:
            return None
        details = u.get("prompt_tokens_details")
        cached: int | None = None
        if type(details) is dict:  # (SGLang with --enable-cache-report omits cached_tokens when it is 0)
            c = _int(details.get("cached_tokens", 0))
            cached = c if c >= 0 else None
        return Usage(max(_int(u.get("prompt_tokens")), 0), cached, max(_int(u.get("completion_tokens")), 0))

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
        return _str(c.get("text")) or (_text(msg.get("content")) if type(msg) is dict else "")

    def budget(self, body: dict[str, Any], default: int) -> int:
        """o_s: the first of :attr:`budget_fields` that is a non-negative integer, else ``default``."""
        for key in self.budget_fields:
            v = body.get(key)
            if type(v) is int and v >= 0:
                return v
        return default

    # -- conversations ----------------------------------------------------------------------------------------
    def conversation(self, body: dict[str, Any]) -> tuple[list[Any], list[Any]] | None:
        """``(head, items)`` of a conversation API's body; None for a body that is not one (or a prompt API)."""
        return None

    def parts(self, item: Any) -> Parts:
        """An item as ``(role, text, calls)``."""
        return _chat_parts(item)

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


class ChatApi(Api):
    name = "chat"
    path = "/v1/chat/completions"
    budget_fields = ("max_completion_tokens", "max_tokens")
    chat_like = True

    def conversation(self, body: dict[str, Any]) -> tuple[list[Any], list[Any]] | None:
        msgs = body.get("messages")
        if type(msgs) is not list:
            return None
        k = _lead(msgs)
        return msgs[:k], msgs[k:]


class ResponsesApi(Api):
    name = "responses"
    path = "/v1/responses"
    budget_fields = ("max_output_tokens",)
    usage_option = False
    chat_like = True
    _DONE_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})

    def usage(self, u: Any) -> Usage | None:
        if type(u) is not dict or type(u.get("input_tokens")) is not int:
            return None
        details = u.get("input_tokens_details")
        cached: int | None = None
        if type(details) is dict:
            c = _int(details.get("cached_tokens", 0))
            cached = c if c >= 0 else None
        return Usage(max(_int(u.get("input_tokens")), 0), cached, max(_int(u.get("output_tokens")), 0))

    def event_usage(self, event: Any) -> dict[str, Any] | None:
        if type(event) is not dict or event.get("type") not in self._DONE_EVENTS:
            return None
        resp = event.get("response")
        u = resp.get("usage") if type(resp) is dict else None
        return u if type(u) is dict else None

    def usage_only(self, event: dict[str, Any]) -> bool:
        return False

    def answer_text(self, obj: Any) -> str:
        out = obj.get("output") if type(obj) is dict else None
        if type(out) is not list:
            return ""
        return "".join(_text(it.get("content")) for it in out if type(it) is dict and it.get("type") == "message")

    def conversation(self, body: dict[str, Any]) -> tuple[list[Any], list[Any]] | None:
        inp = body.get("input")
        head: list[Any] = []
        instructions = body.get("instructions")
        if type(instructions) is str and instructions:
            head.append({"role": "system", "content": instructions})
        if type(inp) is str:
            return head, [{"role": "user", "content": inp}]
        if type(inp) is not list:
            return None
        k = _lead(inp)
        return head + inp[:k], inp[k:]

    def parts(self, item: Any) -> Parts:
        if type(item) is not dict:
            return "", "", ()
        kind = item.get("type")
        if kind is None or kind == "message":
            return _chat_parts(item)
        if kind == "function_call":
            call = (_str(item.get("call_id")), _str(item.get("name")), _str(item.get("arguments")))
            return "assistant", "", (call,)
        if kind == "function_call_output":
            out = item.get("output")
            return "tool", out if type(out) is str else _text(out), ()
        if kind == "reasoning":
            return "assistant", _text(item.get("summary")) + _text(item.get("content")), ()
        return _str(kind), _text(item.get("content")) or _str(item.get("output")) or _str(item.get("arguments")), ()

    def make_usage(self, prompt: int, cached: int, completion: int, *, details: bool | None = True,
                   created: int | None = None) -> dict[str, Any]:
        """vLLM's: cached tokens are always reported (``input_tokens_details``)."""
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached,
                                                                  "cache_write_tokens": created or 0},
                "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion}


class MessagesApi(Api):
    name = "messages"
    path = "/v1/messages"
    budget_fields = ("max_tokens",)
    usage_option = False
    chat_like = True

    def usage(self, u: Any) -> Usage | None:
        if type(u) is not dict or type(u.get("input_tokens")) is not int:
            return None
        read = _int(u.get("cache_read_input_tokens"))
        made = max(_int(u.get("cache_creation_input_tokens")), 0)
        prompt = max(_int(u.get("input_tokens")), 0) + max(read, 0) + made
        return Usage(prompt, read if read >= 0 else None, max(_int(u.get("output_tokens")), 0))

    def event_usage(self, event: Any) -> dict[str, Any] | None:
        if type(event) is not dict:
            return None
        kind = event.get("type")
        if kind == "message_start":
            msg = event.get("message")
            u = msg.get("usage") if type(msg) is dict else None
        elif kind == "message_delta":
            u = event.get("usage")
        else:
            return None
        return u if type(u) is dict else None

    def usage_only(self, event: dict[str, Any]) -> bool:
        return False

    def answer_text(self, obj: Any) -> str:
        return _text(obj.get("content")) if type(obj) is dict else ""

    def conversation(self, body: dict[str, Any]) -> tuple[list[Any], list[Any]] | None:
        msgs = body.get("messages")
        if type(msgs) is not list:
            return None
        system = body.get("system")
        head: list[Any] = []
        if type(system) in (str, list) and system:  # text, or text blocks (a nonce may open the first)
            head.append({"role": "system", "content": system})
        return head, msgs

    def parts(self, item: Any) -> Parts:
        if type(item) is not dict:
            return "", "", ()
        role = _str(item.get("role"))
        content = item.get("content")
        if type(content) is str:
            return role, content, ()
        if type(content) is not list:
            return role, "", ()
        texts: list[str] = []
        calls: list[Call] = []
        for block in content:
            if type(block) is not dict:
                continue
            kind = block.get("type")
            if kind == "tool_use":
                calls.append((_str(block.get("id")), _str(block.get("name")), _json_text(block.get("input"))))
            elif kind == "tool_result":
                got = block.get("content")
                texts.append(got if type(got) is str else _text(got))
            else:  # text, thinking, and what else carries text
                texts.append(_str(block.get("text")) or _str(block.get("thinking")))
        return role, "".join(texts), tuple(calls)

    def make_usage(self, prompt: int, cached: int, completion: int, *, details: bool | None = True,
                   created: int | None = None) -> dict[str, Any]:
        """vLLM's: ``input_tokens`` is the uncached part; the cache fields only with cached-token details on."""
        if not details:
            return {"input_tokens": prompt, "output_tokens": completion}
        made = created or 0
        return {"input_tokens": max(0, prompt - cached - made), "output_tokens": completion,
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": made}


COMPLETIONS, CHAT, RESPONSES, MESSAGES = Api(), ChatApi(), ResponsesApi(), MessagesApi()
APIS: dict[str, Api] = {a.name: a for a in (COMPLETIONS, CHAT, RESPONSES, MESSAGES)}
"""The APIs by name (``--api`` values)."""
_BY_PATH = {a.path: a for a in APIS.values()}


def api_for_path(path: str) -> Api | None:
    """The API served at ``path`` (``/v1/messages/count_tokens`` is none: it is not a turn)."""
    return _BY_PATH.get(path)


_HEAD_ROLES = ("system", "developer")


def _lead(items: list[Any]) -> int:
    """How many leading items are system or developer messages (the head)."""
    k = 0
    for m in items:
        if type(m) is not dict or m.get("role") not in _HEAD_ROLES:
            break
        k += 1
    return k


def _chat_parts(msg: Any) -> Parts:
    if type(msg) is not dict:
        return "", "", ()
    calls: tuple[Call, ...] = ()
    tc = msg.get("tool_calls")
    if type(tc) is list and tc:
        out = []
        for c in tc:
            fn = c.get("function") if type(c) is dict else None
            if type(fn) is dict:
                out.append((_str(c.get("id")), _str(fn.get("name")), _str(fn.get("arguments"))))
        calls = tuple(out)
    role = msg.get("role")
    content = msg.get("content")
    return (role if type(role) is str else "", content if type(content) is str else _text(content), calls)


def _text(content: Any) -> str:
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


def _json_text(v: Any) -> str:
    try:
        return orjson.dumps(v, option=orjson.OPT_SORT_KEYS).decode()
    except TypeError:
        return ""


def _str(v: Any) -> str:
    return v if type(v) is str else ""


def _int(v: Any) -> int:
    return v if type(v) is int else -1


# -- engine kinds ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Metrics:
    """An engine kind's Prometheus names ("": it exports none)."""

    running: str = ""
    waiting: str = ""
    kv_usage: tuple[str, ...] = ()
    """The fraction of the pool in use (older names after the first)."""
    prefix_queries: str = ""
    prefix_hits: str = ""
    hit_rate: str = ""
    preemptions: str = ""
    cache_config: str = ""
    """vLLM's info gauge of its cache configuration (the pool, the block size, prefix caching)."""
    kv_blocks: str = ""
    block_size: str = ""
    """Dynamo's frontend: its model's KV blocks and their size (the pool is their product)."""
    engine_time: tuple[str, ...] = ()
    """Histograms whose sums, added, are the seconds requests spent in the engine up to their first token (its
    queue and its prefill steps, by the engine's own clock): the rest of a client's time to first token is the way
    there and back (:attr:`kvgate.engine.costmodel.Profile.request_s`)."""


@dataclass(frozen=True)
class EngineKind:
    """What one kind of engine (or front) says on the wire beyond the APIs."""

    name: str
    metrics: Metrics = field(default_factory=Metrics)
    pool_source: str = ""
    """Where the KV pool C is read, as :func:`kvgate.http.openai.discover` reads it."""
    info_paths: tuple[str, ...] = ()
    """Where it describes itself (GET, in order)."""
    flush_path: str | None = None
    """The prefix-cache flush (POST)."""
    flush_busy: int | None = None
    """The status the flush answers while requests run (then retried), None: it preempts them instead."""
    report_flag: str = ""
    """The server flag that makes usage carry cached tokens."""
    caching_flag: str = ""
    """How prefix caching is turned on."""
    omits_zero_cached: bool = False
    """With cached-token reporting on, a turn that hit nothing has no ``cached_tokens`` field (it reads as 0)."""

    def cached(self, usage: Usage, cache_report: bool | None) -> int | None:
        """A turn's cached tokens with the kind's quirks applied: an SGLang that reports cached tokens omits 0."""
        if usage.cached is None and self.omits_zero_cached and cache_report:
            return 0
        return usage.cached


VLLM = EngineKind(
    "vllm",
    Metrics(running="vllm:num_requests_running", waiting="vllm:num_requests_waiting",
            kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
            prefix_queries="vllm:prefix_cache_queries", prefix_hits="vllm:prefix_cache_hits",
            preemptions="vllm:num_preemptions", cache_config="vllm:cache_config_info",
            engine_time=("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds")),
    pool_source="/metrics: vllm:cache_config_info{num_gpu_blocks, block_size}",
    flush_path="/reset_prefix_cache?reset_running_requests=true", flush_busy=None,
    report_flag="--enable-prompt-tokens-details",
    caching_flag="--enable-prefix-caching (and without --no-enable-prefix-caching)",
)
SGLANG = EngineKind(
    "sglang",
    Metrics(running="sglang:num_running_reqs", waiting="sglang:num_queue_reqs", kv_usage=("sglang:token_usage",),
            hit_rate="sglang:cache_hit_rate"),
    pool_source="/server_info: max_total_num_tokens", info_paths=("/server_info", "/get_server_info"),
    flush_path="/flush_cache", flush_busy=400,
    report_flag="--enable-cache-report", caching_flag="without --disable-radix-cache", omits_zero_cached=True,
)
DYNAMO = EngineKind(
    "dynamo",
    Metrics(running="dynamo_frontend_inflight_requests", waiting="dynamo_frontend_queued_requests",
            kv_blocks="dynamo_frontend_model_total_kv_blocks", block_size="dynamo_frontend_model_kv_cache_block_size"),
    pool_source="/metrics: dynamo_frontend_model_total_kv_blocks x dynamo_frontend_model_kv_cache_block_size",
)
GATEWAY = EngineKind("kvgate-gateway", pool_source="/kvgate/info: its upstream's pool", info_paths=("/kvgate/info",))
UNKNOWN = EngineKind("unknown")
KINDS: dict[str, EngineKind] = {k.name: k for k in (VLLM, SGLANG, DYNAMO, GATEWAY, UNKNOWN)}
"""The engine kinds by name (:attr:`EngineInfo.kind`)."""


def kind_of(name: str) -> EngineKind:
    """The kind named ``name`` (:data:`UNKNOWN` for any other name)."""
    return KINDS.get(name, UNKNOWN)


FLUSH_PATHS = frozenset(k.flush_path.partition("?")[0] for k in KINDS.values() if k.flush_path)
"""Every kind's flush path (a gateway in front of a fleet sends a flush to every replica)."""
