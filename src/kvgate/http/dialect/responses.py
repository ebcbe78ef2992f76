"""``/v1/responses``: ``instructions`` and ``input`` (a string, or input items: messages, ``function_call``,
``function_call_output``, ``reasoning``), ``max_output_tokens``, tools as ``{"type": "function", name,
parameters}``, answers as ``output`` items, usage with ``input_tokens`` and ``input_tokens_details.cached_tokens``.
A client sends ``store: false`` and the whole input each turn (as Codex does); one naming ``previous_response_id``
carries only what is new.

Streams are ``event:``/``data:`` pairs; the usage is in the ``response.completed`` (or ``.incomplete``, ``.failed``)
event's ``response``. An engine's answer, as vLLM 0.32 shapes it (``vllm/entrypoints/openai/responses``): an
``output`` of one ``message`` item (an ``output_text`` part), then a ``function_call`` item when the request offered
tools; ``status`` ``completed`` (``incomplete`` when the budget cut it); usage with its cached tokens always. A
stream::

    response.created, response.in_progress, response.output_item.added, response.content_part.added,
    response.output_text.delta (one per token), response.output_text.done, response.content_part.done,
    response.output_item.done, [function_call: output_item.added, function_call_arguments.delta / .done,
    output_item.done], response.completed with the usage
"""

from __future__ import annotations

import json
from typing import Any

from kvgate.http.dialect.base import (
    Answer,
    AnswerWriter,
    Api,
    Fold,
    Parts,
    TextOf,
    Tool,
    Usage,
    chat_parts,
    fold_items,
    lead,
    named_tool,
    openai_usage,
    read_items,
    sse_event,
    str_of,
    text_of,
)

DONE_EVENTS = frozenset({"response.completed", "response.incomplete", "response.failed"})


class ResponsesApi(Api):
    name = "responses"
    path = "/v1/responses"
    budget_fields = ("max_output_tokens",)
    usage_option = False
    chat_like = True
    sampling_params = False
    prompt_field = "input"
    missing_prompt = "'input' must be a string or a list of input items"
    stored_field = "previous_response_id"
    stream_end = "its last event"

    def usage(self, u: Any) -> Usage | None:
        return openai_usage(u, "input_tokens", "output_tokens")

    def event_usage(self, event: Any) -> dict[str, Any] | None:
        if type(event) is not dict or event.get("type") not in DONE_EVENTS:
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
        return "".join(text_of(it.get("content")) for it in out if type(it) is dict and it.get("type") == "message")

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
        k = lead(inp)
        return head + inp[:k], inp[k:]

    def parts(self, item: Any) -> Parts:
        if type(item) is not dict:
            return "", "", ()
        kind = item.get("type")
        if kind is None or kind == "message":
            return chat_parts(item)
        if kind == "function_call":
            call = (str_of(item.get("call_id")), str_of(item.get("name")), str_of(item.get("arguments")))
            return "assistant", "", (call,)
        if kind == "function_call_output":
            out = item.get("output")
            return "tool", out if type(out) is str else text_of(out), ()
        if kind == "reasoning":
            return "assistant", text_of(item.get("summary")) + text_of(item.get("content")), ()
        text = text_of(item.get("content")) or str_of(item.get("output")) or str_of(item.get("arguments"))
        return str_of(kind), text, ()

    def tool_of(self, t: Any) -> tuple[str, dict[str, Any]] | None:
        if type(t) is not dict or t.get("type", "function") != "function":
            return None
        return named_tool(t.get("name"), t.get("parameters"))

    def template_tools(self, body: dict[str, Any]) -> list[Any] | None:
        """Its function tools in chat's form (built-in tools, which no template renders, left out)."""
        tools = body.get("tools")
        if type(tools) is not list or not tools:
            return None
        out = [{"type": "function", "function": {k: t[k] for k in ("name", "description", "parameters") if k in t}}
               for t in tools if type(t) is dict and t.get("type", "function") == "function"]
        return out or None

    # -- a client -----------------------------------------------------------------------------------------------
    def request_fields(self, token_ids: bool) -> dict[str, Any]:
        return {"store": False}  # the whole input every turn, as Codex sends it

    def request_body(self, system: str, items: list[dict[str, Any]], budget: int) -> dict[str, Any]:
        return {"instructions": system, "input": items, "max_output_tokens": budget, "store": False}

    def tools_field(self, tool: dict[str, Any]) -> list[dict[str, Any]]:
        return [{"type": "function", **tool}]

    def convo_body(self, head: str, system: str, nonce: bool, tools: str, items: str) -> bytes:
        sys = f',"instructions":{json.dumps(system)}' if system else ""
        return f'{head}{sys}{tools},"input":[{items}]}}'.encode()

    def answer_items(self, answer: Answer) -> list[str]:
        items = answer.items or [{"type": "message", "role": "assistant", "content": [
            {"type": "output_text", "text": answer.text}]}]
        return [json.dumps(it) for it in items]

    def append_item(self, call: str | None, text: str, role: str, k: int) -> str:
        if call is not None:
            return json.dumps({"type": "function_call_output", "call_id": call, "output": text})
        return json.dumps({"role": "user", "content": text})

    def read_answer(self, obj: dict[str, Any]) -> Answer:
        return read_items(obj, "output")

    def fold(self) -> Fold:
        return ResponsesFold(self)

    # -- the engine ---------------------------------------------------------------------------------------------
    def make_usage(self, prompt: int, cached: int, completion: int, *, details: bool | None = True,
                   created: int | None = None) -> dict[str, Any]:
        """vLLM's: cached tokens are always reported (``input_tokens_details``)."""
        return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": cached,
                                                                  "cache_write_tokens": created or 0},
                "output_tokens": completion, "output_tokens_details": {"reasoning_tokens": 0},
                "total_tokens": prompt + completion}

    def writer(self, rid: str, created: int, model: str, tool: Tool | None, budget: int, finish: str,
               text: TextOf) -> AnswerWriter | None:
        return ResponsesWriter(rid, created, model, tool, budget, finish, text)


class ResponsesFold(Fold):
    def event(self, ev: dict[str, Any], kind: Any) -> bool:
        a = self.answer
        if kind == "response.output_text.delta" and isinstance(ev.get("delta"), str):
            a.text += ev["delta"]
            return bool(ev["delta"])
        if kind in DONE_EVENTS:
            self.done = True
            out = ev.get("response", {}).get("output") if isinstance(ev.get("response"), dict) else None
            if isinstance(out, list):
                text = a.text
                a.text = ""
                fold_items(a, out)
                a.text = a.text or text
        return False


class ResponsesWriter(AnswerWriter):
    """One answer of a Responses request (see the module docstring)."""

    def _ev(self, name: str, obj: dict[str, Any]) -> bytes:
        obj = {"type": name, **obj, "sequence_number": self.seq}
        self.seq += 1
        return sse_event(name, obj)

    def whole(self, generated: int, usage: dict[str, Any]) -> dict[str, Any]:
        return self._response(self._output(self.text(0, generated)), usage)

    def _output(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = [{"type": "message", "id": self.item_id, "role": "assistant", "status":
                                      "completed", "content": [{"type": "output_text", "text": text,
                                                                "annotations": [], "logprobs": []}]}]
        if self.tool is not None:
            out.append(self._call("completed"))
        return out

    def _call(self, status: str) -> dict[str, Any]:
        assert self.tool is not None
        return {"type": "function_call", "id": f"fc_{self.call_id[5:]}", "call_id": self.call_id,
                "name": self.tool[0], "arguments": self.tool[1], "status": status}

    def _status(self) -> str:
        return "incomplete" if self.finish == "length" and self.tool is None else "completed"

    def _response(self, output: list[dict[str, Any]], usage: dict[str, Any] | None,
                  status: str | None = None) -> dict[str, Any]:
        status = status or self._status()
        return {"id": self.rid, "object": "response", "created_at": self.created, "status": status,
                "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
                "model": self.model, "output": output, "parallel_tool_calls": True, "tool_choice": "auto",
                "tools": [], "temperature": 1.0, "top_p": 1.0, "max_output_tokens": self.budget, "store": False,
                "background": False, "service_tier": "auto", "truncation": "disabled", "usage": usage}

    def opening(self, usage: dict[str, Any]) -> bytes:
        r = self._response([], None, "in_progress")
        item = {"type": "message", "id": self.item_id, "role": "assistant", "status": "in_progress", "content": []}
        part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
        return (self._ev("response.created", {"response": r}) + self._ev("response.in_progress", {"response": r})
                + self._ev("response.output_item.added", {"output_index": 0, "item": item})
                + self._ev("response.content_part.added", {"item_id": self.item_id, "output_index": 0,
                                                           "content_index": 0, "part": part}))

    def tokens(self, start: int, stop: int) -> bytes:
        return b"".join(self._ev("response.output_text.delta", {"item_id": self.item_id, "output_index": 0,
                                                                "content_index": 0, "delta": self.text(j, j + 1),
                                                                "logprobs": []}) for j in range(start, stop))

    def closing(self, generated: int, usage: dict[str, Any]) -> bytes:
        text = self.text(0, generated)
        part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
        ids = {"item_id": self.item_id, "output_index": 0, "content_index": 0}
        output = self._output(text)
        out = [self._ev("response.output_text.done", {**ids, "text": text, "logprobs": []}),
               self._ev("response.content_part.done", {**ids, "part": part}),
               self._ev("response.output_item.done", {"output_index": 0, "item": output[0]})]
        if self.tool is not None:
            call = {**self._call("in_progress"), "arguments": ""}
            fc = {"item_id": call["id"], "output_index": 1}
            out += [self._ev("response.output_item.added", {"output_index": 1, "item": call}),
                    self._ev("response.function_call_arguments.delta", {**fc, "delta": self.tool[1]}),
                    self._ev("response.function_call_arguments.done", {**fc, "arguments": self.tool[1]}),
                    self._ev("response.output_item.done", {"output_index": 1, "item": output[1]})]
        status = self._status()
        out.append(self._ev(f"response.{status}", {"response": self._response(output, usage, status)}))
        return b"".join(out)
