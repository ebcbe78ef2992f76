"""Server-sent events of the OpenAI streaming protocol, built from byte templates (no JSON encoding per token).

A streamed completion is ``data: {chunk}\\n\\n`` events, one per output token, then (with
``stream_options.include_usage``) a chunk with ``"choices": []`` and the usage, then ``data: [DONE]\\n\\n``.
Chat streams open with a chunk whose delta is ``{"role": "assistant", "content": ""}``, sent with the first
token as vLLM does. The chunk carrying the last token has ``finish_reason`` ``"length"``.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from kvgate.http.openai import error_object
from kvgate.serve.tokenizer import filler_piece_json

DONE = b"data: [DONE]\n\n"


def event(obj: Any) -> bytes:
    """One SSE event holding ``obj`` as JSON."""
    return b"data: " + json.dumps(obj, separators=(",", ":")).encode() + b"\n\n"


class ChunkWriter:
    """The events of one streamed completion (``chat`` picks the chat-completion chunk shape)."""

    __slots__ = ("chat", "token_ids", "call", "rid", "pieces", "_head", "_mid", "_tail", "_last")

    def __init__(self, rid: str, created: int, model: str, *, chat: bool, token_ids: list[int] | None,
                 call: tuple[str, str] | None = None, finish: str = "length",
                 pieces: Callable[[int], bytes] | None = None) -> None:
        self.chat = chat
        self.pieces = pieces
        """Output token ``j``'s text as JSON, where the answer is written (None: filler)."""
        self._last = b"null" if call is not None else b'"stop"' if finish == "stop" else b'"length"'
        """The last token's ``finish_reason``: none before a tool call's chunk, else ``stop`` or ``length``."""
        self.token_ids = token_ids  # with vLLM's return_token_ids: the output ids, else None
        self.call = call
        """A tool call (name, arguments) sent after the tokens, in a chunk of its own."""
        self.rid = rid
        obj = "chat.completion.chunk" if chat else "text_completion"
        self._head = (
            f'data: {{"id":{json.dumps(rid)},"object":"{obj}","created":{created},"model":{json.dumps(model)},'
        ).encode()
        # per token: head + mid + "piece" + tail % (finish_reason, token_ids field)
        if chat:
            self._mid = b'"choices":[{"index":0,"delta":{"content":'
            self._tail = b'},"logprobs":null,"finish_reason":%s,"stop_reason":null%s}]}\n\n'
        else:
            self._mid = b'"choices":[{"index":0,"text":'
            self._tail = b',"logprobs":null,"finish_reason":%s,"stop_reason":null%s}]}\n\n'

    def role(self) -> bytes:
        """The opening chat chunk (nothing for completions)."""
        if not self.chat:
            return b""
        return self._head + (
            b'"choices":[{"index":0,"delta":{"role":"assistant","content":""},"logprobs":null,"finish_reason":null}]}'
            b"\n\n"
        )

    def tokens(self, start: int, stop: int, total: int) -> bytes:
        """Events for output tokens ``start .. stop - 1`` of ``total``; the last token's says how it ended."""
        parts = []
        head = self._head + self._mid
        tail = self._tail
        chat = self.chat
        ids = self.token_ids
        last = self._last
        piece = self.pieces
        for j in range(start, stop):
            fin = last if j == total - 1 else b"null"
            extra = b',"token_ids":[%d]' % ids[j] if ids is not None else b""
            text = filler_piece_json(j, chat) if piece is None else piece(j)
            parts.append(head + text + tail % (fin, extra))
        return b"".join(parts)

    def usage(self, usage: dict[str, Any]) -> bytes:
        """The final usage chunk (``stream_options.include_usage``)."""
        return self._head + b'"choices":[],"usage":' + json.dumps(usage, separators=(",", ":")).encode() + b"}\n\n"

    def end(self, usage: dict[str, Any] | None) -> bytes:
        """What follows the last token: the tool call's chunk, the usage chunk (when asked for), ``[DONE]``."""
        out = b""
        if self.call is not None:
            name, args = self.call
            tc = {"index": 0, "id": "call_" + self.rid.partition("-")[2], "type": "function",
                  "function": {"name": name, "arguments": args}}
            out += self._head + b'"choices":[{"index":0,"delta":{"tool_calls":' + json.dumps(
                [tc], separators=(",", ":")).encode() + b'},"logprobs":null,"finish_reason":"tool_calls"}]}\n\n'
        if usage is not None:
            out += self.usage(usage)
        return out + DONE


def error_event(message: str, code: int = 500, kind: str = "InternalServerError") -> bytes:
    """An error inside a stream, shaped like vLLM's."""
    return event(error_object(code, message, kind))
