"""``/v1/messages`` (Anthropic's): ``system`` (text, or text blocks: a nonce may open the first) and ``messages``
of content blocks (``text``, ``tool_use``, ``tool_result``, ``thinking``, images), a required ``max_tokens``, tools
as ``{name, description, input_schema}``, answers as ``content`` blocks, usage with ``input_tokens`` the uncached
part beside ``cache_read_input_tokens`` and ``cache_creation_input_tokens``.

Streams: ``message_start``'s ``message.usage`` (the input) and ``message_delta``'s ``usage`` (the output; vLLM
repeats the input there). An engine's answer, as vLLM 0.32 shapes it (``vllm/entrypoints/anthropic``): ``content``
of one ``text`` block, then a ``tool_use`` block when tools were offered; ``stop_reason`` ``tool_use``, else
``end_turn`` (``max_tokens`` when the budget cut it). A stream::

    message_start (the message, its usage's input), content_block_start, ping, content_block_delta (text_delta,
    one per token), content_block_stop, [tool_use: content_block_start, content_block_delta (input_json_delta),
    content_block_stop], message_delta (stop_reason, the usage), message_stop
"""

from __future__ import annotations

import json
from typing import Any

from kvgate.http.dialect.base import (
    Answer,
    AnswerWriter,
    Api,
    Call,
    Fold,
    Parts,
    TextOf,
    Tool,
    Usage,
    fold_items,
    int_of,
    json_text,
    named_tool,
    read_items,
    sse_event,
    str_of,
    text_of,
)

ANTHROPIC_IMAGE_MAX = 1600
"""Anthropic's largest image in tokens (an image is scaled to about 1.15 megapixels, width x height / 750)."""


class MessagesApi(Api):
    name = "messages"
    path = "/v1/messages"
    budget_fields = ("max_tokens",)
    budget_required = True
    usage_option = False
    chat_like = True
    sampling_params = False
    prompt_field = "messages"
    missing_prompt = "'messages' must be a non-empty list of messages"
    stream_end = "its last event"

    def usage(self, u: Any) -> Usage | None:
        if type(u) is not dict or type(u.get("input_tokens")) is not int:
            return None
        read = int_of(u.get("cache_read_input_tokens"))
        made = max(int_of(u.get("cache_creation_input_tokens")), 0)
        prompt = max(int_of(u.get("input_tokens")), 0) + max(read, 0) + made
        return Usage(prompt, read if read >= 0 else None, max(int_of(u.get("output_tokens")), 0))

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
        return text_of(obj.get("content")) if type(obj) is dict else ""

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
        role = str_of(item.get("role"))
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
                calls.append((str_of(block.get("id")), str_of(block.get("name")), json_text(block.get("input"))))
            elif kind == "tool_result":
                got = block.get("content")
                texts.append(got if type(got) is str else text_of(got))
            else:  # text, thinking, and what else carries text
                texts.append(str_of(block.get("text")) or str_of(block.get("thinking")))
        return role, "".join(texts), tuple(calls)

    def tool_of(self, t: Any) -> tuple[str, dict[str, Any]] | None:
        return named_tool(t.get("name"), t.get("input_schema")) if type(t) is dict else None

    def template_tools(self, body: dict[str, Any]) -> list[Any] | None:
        """Its tools in chat's form, as vLLM hands them to the chat template."""
        tools = body.get("tools")
        if type(tools) is not list or not tools:
            return None
        out = [{"type": "function", "function": {"name": t.get("name"), "description": t.get("description", ""),
                                                 "parameters": t["input_schema"]}}
               for t in tools if type(t) is dict and "input_schema" in t]
        return out or None

    def image_tokens(self, part: dict[str, Any], size: tuple[int, int] | None) -> int:
        """Anthropic's: width x height / 750 of the image scaled to about 1.15 megapixels, at most 1,600."""
        if size is None:
            return ANTHROPIC_IMAGE_MAX
        w, h = size
        scale = min(1.0, (1_150_000 / max(1, w * h)) ** 0.5)
        return min(ANTHROPIC_IMAGE_MAX, -(-int(w * scale) * int(h * scale) // 750))

    # -- a client -----------------------------------------------------------------------------------------------
    def request_body(self, system: str, items: list[dict[str, Any]], budget: int) -> dict[str, Any]:
        return {"system": system, "messages": items, "max_tokens": budget}

    def tools_field(self, tool: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"name": tool["name"], "description": tool["description"], "input_schema": tool["parameters"]}]

    def convo_body(self, head: str, system: str, nonce: bool, tools: str, items: str) -> bytes:
        """The system prompt as text; with a nonce, the nonce line its own first block (as Claude Code sends it)."""
        blocks: Any = system
        if nonce:
            first, _, rest = system.partition("\n")
            blocks = [{"type": "text", "text": first}, {"type": "text", "text": rest}]
        sys = f',"system":{json.dumps(blocks)}' if system else ""
        return f'{head}{sys}{tools},"messages":[{items}]}}'.encode()

    def answer_items(self, answer: Answer) -> list[str]:
        blocks = answer.items or [{"type": "text", "text": answer.text}]
        return [json.dumps({"role": "assistant", "content": blocks})]

    def append_item(self, call: str | None, text: str, role: str, k: int) -> str:
        if call is not None:
            return json.dumps({"role": "user", "content": [{"type": "tool_result", "tool_use_id": call,
                                                            "content": text}]})
        return json.dumps({"role": "user", "content": text})

    def read_answer(self, obj: dict[str, Any]) -> Answer:
        return read_items(obj, "content")

    def fold(self) -> Fold:
        return MessagesFold(self)

    # -- the engine ---------------------------------------------------------------------------------------------
    def make_usage(self, prompt: int, cached: int, completion: int, *, details: bool | None = True,
                   created: int | None = None) -> dict[str, Any]:
        """vLLM's: ``input_tokens`` is the uncached part; the cache fields only with cached-token details on."""
        if not details:
            return {"input_tokens": prompt, "output_tokens": completion}
        made = created or 0
        return {"input_tokens": max(0, prompt - cached - made), "output_tokens": completion,
                "cache_read_input_tokens": cached, "cache_creation_input_tokens": made}

    def writer(self, rid: str, created: int, model: str, tool: Tool | None, budget: int, finish: str,
               text: TextOf) -> AnswerWriter | None:
        return MessagesWriter(rid, created, model, tool, budget, finish, text)


class MessagesFold(Fold):
    """Content blocks by index (a tool_use block's input as its JSON text while it streams)."""

    def __init__(self, api: Api) -> None:
        super().__init__(api)
        self.blocks: dict[int, dict[str, Any]] = {}

    def event(self, ev: dict[str, Any], kind: Any) -> bool:
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

    def finish(self) -> Answer:
        if self.blocks:
            blocks = [self.blocks[i] for i in sorted(self.blocks)]
            for b in blocks:
                if b.get("type") == "tool_use":
                    try:
                        b["input"] = json.loads(b["input"] or "{}")
                    except ValueError:
                        b["input"] = {}
            fold_items(self.answer, blocks)
        return self.answer


class MessagesWriter(AnswerWriter):
    """One answer of a Messages request (see the module docstring)."""

    call_prefix = "toolu_"

    def _ev(self, name: str, obj: dict[str, Any]) -> bytes:
        return sse_event(name, {"type": name, **obj})

    def whole(self, generated: int, usage: dict[str, Any]) -> dict[str, Any]:
        blocks: list[dict[str, Any]] = [{"type": "text", "text": self.text(0, generated)}]
        if self.tool is not None:
            blocks.append(self._tool_use(json.loads(self.tool[1])))
        return self._message(blocks, usage, self._stop_reason())

    def _stop_reason(self) -> str:
        if self.tool is not None:
            return "tool_use"
        return "max_tokens" if self.finish == "length" else "end_turn"

    def _message(self, blocks: list[dict[str, Any]], usage: dict[str, Any], stop: str | None) -> dict[str, Any]:
        return {"id": self.rid, "type": "message", "role": "assistant", "model": self.model, "content": blocks,
                "stop_reason": stop, "stop_sequence": None, "usage": usage}

    def _tool_use(self, args: Any) -> dict[str, Any]:
        assert self.tool is not None
        return {"type": "tool_use", "id": self.call_id, "name": self.tool[0], "input": args}

    def opening(self, usage: dict[str, Any]) -> bytes:
        start = self._message([], {**usage, "output_tokens": 1}, None)
        return (self._ev("message_start", {"message": start})
                + self._ev("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                + self._ev("ping", {}))

    def tokens(self, start: int, stop: int) -> bytes:
        return b"".join(self._ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta",
                                                                              "text": self.text(j, j + 1)}})
                        for j in range(start, stop))

    def closing(self, generated: int, usage: dict[str, Any]) -> bytes:
        out = [self._ev("content_block_stop", {"index": 0})]
        if self.tool is not None:
            out += [self._ev("content_block_start", {"index": 1, "content_block": self._tool_use({})}),
                    self._ev("content_block_delta", {"index": 1, "delta": {"type": "input_json_delta",
                                                                           "partial_json": self.tool[1]}}),
                    self._ev("content_block_stop", {"index": 1})]
        out += [self._ev("message_delta", {"delta": {"stop_reason": self._stop_reason(), "stop_sequence": None},
                                           "usage": usage}),
                self._ev("message_stop", {})]
        return b"".join(out)
