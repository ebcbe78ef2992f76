"""The answers of ``/v1/responses`` and ``/v1/messages``, whole and streamed, as vLLM 0.32 shapes them.

Responses (``vllm/entrypoints/openai/responses``): an ``output`` of one ``message`` item (an ``output_text`` part),
then a ``function_call`` item when the request offered tools; ``status`` ``completed``; usage with
``input_tokens_details.cached_tokens`` always. A stream is ``event: NAME`` / ``data: {...}`` pairs::

    response.created, response.in_progress, response.output_item.added, response.content_part.added,
    response.output_text.delta (one per token), response.output_text.done, response.content_part.done,
    response.output_item.done, [function_call: output_item.added, function_call_arguments.delta / .done,
    output_item.done], response.completed with the usage

Messages (``vllm/entrypoints/anthropic``): ``content`` of one ``text`` block, then a ``tool_use`` block when tools
were offered; ``stop_reason`` ``tool_use``, else ``end_turn``; usage with ``input_tokens`` the uncached part and
``cache_read_input_tokens`` (with cached-token details on). A stream::

    message_start (the message, its usage's input), content_block_start, ping, content_block_delta (text_delta,
    one per token), content_block_stop, [tool_use: content_block_start, content_block_delta (input_json_delta),
    content_block_stop], message_delta (stop_reason, the usage), message_stop

The text is the filler output (:func:`kvgate.serve.tokenizer.filler_text`, as chat's), so a harness that sends it
back reuses the output's KV exactly as a chat client does. A request that offers tools gets the length and the end
:mod:`kvgate.serve.agent` decides: a tool call, an answer that ends (``completed``, ``end_turn``), or one its budget
cut (``incomplete`` with ``max_output_tokens``, ``max_tokens``). One that offers none has exactly its budget of
tokens (the simulated model has no EOS) and says it ended there (``completed``, ``end_turn``).
"""

from __future__ import annotations

import json
import os
from typing import Any

from kvgate.http.dialect import RESPONSES, Api
from kvgate.serve.tokenizer import filler_text

Tool = tuple[str, str]
"""The call an answer makes: ``(tool name, arguments as JSON text)``."""


def _event(name: str, obj: dict[str, Any]) -> bytes:
    return b"event: " + name.encode() + b"\ndata: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class AgentWriter:
    """One answer of a Responses or Messages request: its whole body, or its stream's events in order."""

    def __init__(self, api: Api, rid: str, created: int, model: str, total: int, tool: Tool | None,
                 budget_field: int, finish: str = "stop") -> None:
        self.api = api
        self.rid = rid
        self.created = created
        self.model = model
        self.total = total
        self.tool = tool
        self.budget = budget_field
        self.finish = finish
        """``tool``, ``stop`` or ``length`` (:data:`kvgate.serve.agent.Finish`): only ``length`` says the budget cut
        the answer (Responses ``incomplete``, Messages ``max_tokens``)."""
        self.seq = 0
        tag = os.urandom(6).hex()
        self.item_id, self.call_id = f"msg_{tag}", ("call_" if api is RESPONSES else "toolu_") + tag

    # -- whole ----------------------------------------------------------------------------------------------
    def whole(self, generated: int, usage: dict[str, Any]) -> dict[str, Any]:
        text = filler_text(0, generated, True)
        if self.api is RESPONSES:
            return self._response(self._output(text), usage)
        blocks: list[dict[str, Any]] = [{"type": "text", "text": text}]
        if self.tool is not None:
            blocks.append(self._tool_use(json.loads(self.tool[1])))
        return self._message(blocks, usage, self._stop_reason())

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

    # -- streamed -------------------------------------------------------------------------------------------
    def _ev(self, name: str, obj: dict[str, Any]) -> bytes:
        if self.api is RESPONSES:
            obj = {"type": name, **obj, "sequence_number": self.seq}
            self.seq += 1
        else:
            obj = {"type": name, **obj}
        return _event(name, obj)

    def opening(self, usage: dict[str, Any]) -> bytes:
        """The events before the first token (``usage``: the usage known at the start, Messages' input)."""
        if self.api is RESPONSES:
            r = self._response([], None, "in_progress")
            item = {"type": "message", "id": self.item_id, "role": "assistant", "status": "in_progress",
                    "content": []}
            part = {"type": "output_text", "text": "", "annotations": [], "logprobs": []}
            return (self._ev("response.created", {"response": r}) + self._ev("response.in_progress", {"response": r})
                    + self._ev("response.output_item.added", {"output_index": 0, "item": item})
                    + self._ev("response.content_part.added", {"item_id": self.item_id, "output_index": 0,
                                                               "content_index": 0, "part": part}))
        start = self._message([], {**usage, "output_tokens": 1}, None)
        return (self._ev("message_start", {"message": start})
                + self._ev("content_block_start", {"index": 0, "content_block": {"type": "text", "text": ""}})
                + self._ev("ping", {}))

    def tokens(self, start: int, stop: int) -> bytes:
        """Events for output tokens ``start .. stop - 1``."""
        out = []
        for j in range(start, stop):
            piece = filler_text(j, j + 1, True)
            if self.api is RESPONSES:
                out.append(self._ev("response.output_text.delta", {"item_id": self.item_id, "output_index": 0,
                                                                   "content_index": 0, "delta": piece,
                                                                   "logprobs": []}))
            else:
                out.append(self._ev("content_block_delta", {"index": 0, "delta": {"type": "text_delta",
                                                                                  "text": piece}}))
        return b"".join(out)

    def closing(self, generated: int, usage: dict[str, Any]) -> bytes:
        """The events after the last token: the text done, the tool call, the usage."""
        text = filler_text(0, generated, True)
        if self.api is RESPONSES:
            return self._closing_responses(text, usage)
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

    def _closing_responses(self, text: str, usage: dict[str, Any]) -> bytes:
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
