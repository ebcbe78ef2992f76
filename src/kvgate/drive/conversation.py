"""A driven session's conversation as an agent sends it, in chat, Responses or Messages form.

The history is the agent's: a shared system prompt (chat's system message, Responses' ``instructions``, Messages'
``system``), the task as a user message, then per turn the model's answer *as it came back* and what the agent
appends::

    system  ▸ task ▸ answer_0 ▸ append_0 ▸ answer_1 ▸ append_1 ▸ ...

* **Answers** are sent back verbatim: chat's assistant message (its text and tool calls), Responses' output items,
  Messages' content blocks, so the engine's cache sees the reuse a real agent gives it.
* **Appends** (``appends[k]`` words of the shape) are a ``user`` message; with ``tools`` on (the request offers one
  tool, and an engine such as ``kvgate engine`` answers with a call of it) they are the call's result: chat's
  ``tool`` message, Responses' ``function_call_output``, Messages' ``tool_result`` block, answering the call.
* **System nonces** (``nonce``): the system prompt opens with a per-request nonce, as Claude Code's first system
  block does: every request's prefix differs from the first token (Messages: a block of its own before the rest).
* **Compaction** (``compact_every`` K): after every K-th turn the history is rewritten to the task and a summary
  (the last answer's text), as a harness compacts a long conversation; it grows again from there.

Kept as the JSON text of each item, so a turn costs a few string joins, not a re-encoding of the history.
"""

from __future__ import annotations

import json
import random
from typing import Any

from kvgate.drive.prompts import Vocab
from kvgate.drive.replies import Reply
from kvgate.http.dialect import APIS, Answer

TOOL = {"name": "bash", "description": "Run a shell command in the repository and return its output.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}
"""The one tool offered with ``tools`` on."""


def tools_field(api: str) -> list[dict[str, Any]]:
    """The ``tools`` a request offers, in ``api``'s form."""
    return APIS[api].tools_field(TOOL)


class ConvoPrompt:
    """A growing conversation of one session (see the module docstring)."""

    __slots__ = ("api", "dialect", "system", "task", "items", "n", "role", "tools", "nonce", "key", "compact_every",
                 "turn", "compactions")

    def __init__(self, api: str, vocab: Vocab, key: str, n_shared: int, n_unique: int, *, role: str = "user",
                 tools: bool = False, nonce: bool = False, compact_every: int = 0) -> None:
        self.api = api
        self.dialect = APIS[api]
        self.system = vocab.shared_words(n_shared) if n_shared > 0 else ""
        self.task = json.dumps({"role": "user", "content": vocab.words(f"{key}/task", max(1, n_unique))})
        self.items = self.task
        """The JSON text of the items after the system prompt, comma-joined."""
        self.n = n_shared + max(1, n_unique)
        self.role = "tool" if role == "tool" and not tools else role
        self.tools = tools
        self.nonce = nonce
        self.key = key
        self.compact_every = compact_every
        self.turn = 0
        self.compactions = 0

    def body(self, head: str) -> bytes:
        """The request body: ``head`` (a JSON object without its closing brace), the system prompt and the items."""
        tools = f',"tools":{json.dumps(tools_field(self.api))}' if self.tools else ""
        return self.dialect.convo_body(head, self._system(), self.nonce, tools, self.items)

    def _system(self) -> str:
        if not self.nonce or not self.system:
            return self.system
        return f"x-kvgate-nonce: {self._nonce()};\n{self.system}"

    def _nonce(self) -> str:
        return format(random.Random(f"{self.key}/nonce/{self.turn}").getrandbits(64), "016x")

    def extend(self, k: int, reply: Reply, n_out: int, app_text: str, n_app: int) -> None:
        """Turn ``k`` came back as ``reply``: append the answer as it came and the agent's append (or compact)."""
        self.turn = k + 1
        if self.compact_every and (k + 1) % self.compact_every == 0:
            summary = json.dumps({"role": "user", "content": "Summary of the conversation so far: " + reply.text})
            self.items = ",".join((self.task, summary, self._append(reply, k, app_text)))
            self.compactions += 1
        else:
            self.items = ",".join((self.items, *self._answer(reply), self._append(reply, k, app_text)))
        self.n += n_out + n_app

    def _answer(self, reply: Reply) -> list[str]:
        """The model's answer as the agent sends it back."""
        return self.dialect.answer_items(Answer(reply.text, reply.calls, reply.items))

    def _append(self, reply: Reply, k: int, text: str) -> str:
        """What the agent appends: a tool result answering the model's call, else a user (or tool) message."""
        call = reply.calls[0][0] if self.tools and reply.calls else None
        return self.dialect.append_item(call, text, self.role, k)
