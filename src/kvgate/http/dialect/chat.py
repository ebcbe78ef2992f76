"""``/v1/chat/completions``: a conversation of ``messages`` (the head: its leading system and developer messages),
``max_completion_tokens`` else ``max_tokens``, tools as ``{"type": "function", "function": {...}}``, answers as
``choices`` with a ``message`` (its text and ``tool_calls``), usage in OpenAI's shape. An agent's history is the
assistant message as it came back and a ``tool`` message answering its call."""

from __future__ import annotations

import json
from typing import Any

from kvgate.http.dialect.base import Answer, Api, lead, named_tool


class ChatApi(Api):
    name = "chat"
    path = "/v1/chat/completions"
    budget_fields = ("max_completion_tokens", "max_tokens")
    chat_like = True
    prompt_field = "messages"
    missing_prompt = "'messages' is required"

    def conversation(self, body: dict[str, Any]) -> tuple[list[Any], list[Any]] | None:
        msgs = body.get("messages")
        if type(msgs) is not list:
            return None
        k = lead(msgs)
        return msgs[:k], msgs[k:]

    def template_messages(self, body: dict[str, Any]) -> Any:
        return body.get("messages")

    def generation_prompt(self, body: dict[str, Any]) -> bool:
        return bool(body.get("add_generation_prompt", True))

    def template_tools(self, body: dict[str, Any]) -> list[Any] | None:
        tools = body.get("tools")
        return tools if type(tools) is list and tools else None

    def tool_of(self, t: Any) -> tuple[str, dict[str, Any]] | None:
        fn = t.get("function") if type(t) is dict else None
        if type(fn) is not dict:
            return None
        return named_tool(fn.get("name"), fn.get("parameters"))

    def request_body(self, system: str, items: list[dict[str, Any]], budget: int) -> dict[str, Any]:
        """A conversation's request: a system prompt, then chat-shaped user ``items``, answered in ``budget``."""
        return {"messages": [{"role": "system", "content": system}, *items], self.budget_fields[-1]: budget}

    def tools_field(self, tool: dict[str, Any]) -> list[dict[str, Any]]:
        """The ``tools`` offering ``tool`` (``{name, description, parameters}``), in this API's form."""
        return [{"type": "function", "function": tool}]

    def convo_body(self, head: str, system: str, nonce: bool, tools: str, items: str) -> bytes:
        """A conversation's body: ``head`` (a JSON object without its closing brace), the system prompt (opening
        with a nonce line when ``nonce``), ``tools`` (``,"tools":[...]`` or "") and ``items`` (comma-joined JSON)."""
        sys = json.dumps({"role": "system", "content": system}) + "," if system else ""
        return f'{head}{tools},"messages":[{sys}{items}]}}'.encode()

    def answer_items(self, answer: Answer) -> list[str]:
        """The model's answer as the agent sends it back (JSON texts of items)."""
        msg: dict[str, Any] = {"role": "assistant", "content": answer.text}
        if answer.calls:
            msg["tool_calls"] = [{"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
                                 for cid, name, args in answer.calls]
        return [json.dumps(msg)]

    def append_item(self, call: str | None, text: str, role: str, k: int) -> str:
        """What an agent appends after turn ``k``: the result of the model's ``call``, else a ``role`` message."""
        if call is not None:
            return json.dumps({"role": "tool", "tool_call_id": call, "content": text})
        app: dict[str, str] = {"role": role, "content": text}
        if role == "tool":
            app["tool_call_id"] = f"call_{k}"
        return json.dumps(app)

