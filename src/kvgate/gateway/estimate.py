"""The context estimator: L_s at a turn boundary, from the request body and the session's last usage.

The policy core needs, at each turn boundary, the session's context L_s (prompt tokens of the turn) and its output
budget o_s. The gateway sees request bodies, not tokens, so L_s is:

* **exact** for token-id prompts (``/v1/completions`` with ``"prompt": [ids]``): the length of the id list
  (a batch of id lists: the sum of their lengths);
* **estimated** otherwise, from what the previous turn's usage says plus what was appended since::

      previous turn:   | prompt_tokens (usage)                  | completion_tokens (usage) |
      this turn:       | previous prompt                        | previous reply            | appended |
                       '------------- known: counted exactly by the previous usage ---------'- chars/4 -'

  - chat: the appended part is the messages beyond the count sent last time; its size is the characters of
    their text (content strings or text parts, tool-call names and arguments) / 4, plus 4 tokens of chat-template
    overhead per message. The first assistant message among them is the previous reply: its text is already in
    ``completion_tokens``, so only its overhead is added.
  - text prompts: the appended part is the characters beyond the previous prompt's length, less the previous
    reply's text estimated at 4 characters per completion token, / 4.
  - when the previous turn gave no usage (the upstream did not report it, or the turn failed), ``known`` is the
    previous estimate of L_s and the reply's text counts as appended text;
  - a first turn, a conversation that shrank (fewer messages or a shorter prompt than last time: the client
    rewrote its history) or a change of API starts over: all text / 4, plus 4 tokens per message.

  The estimate is corrected from usage when the response arrives: the next boundary starts from the reported
  ``prompt_tokens + completion_tokens`` (the policy core updates D at boundaries only, as in the paper, §5).

The output budget o_s is the request's ``max_tokens`` (else ``max_completion_tokens``), else the gateway's default.

Nothing here does I/O; every function is O(size of the new part of the request) and never raises on odd input
(a field of the wrong type counts as empty: the upstream answers the client's mistake).
"""

from __future__ import annotations

from typing import Any

from kvgate.gateway.sessions import GwSession

CHARS_PER_TOKEN = 4
"""Characters per token of the estimator (English text and code average about 4 in BPE vocabularies)."""
MESSAGE_OVERHEAD_TOKENS = 4
"""Chat-template tokens per message (role markers and separators)."""

TEXT, CHAT, IDS = 1, 2, 3
"""What kind of prompt a session sent last (the estimator only carries a text or chat history forward)."""


def estimate_context(s: GwSession, body: dict[str, Any], chat: bool) -> tuple[int, int, int]:
    """``(L_s, kind, sent_len)`` for the request ``body`` of session ``s`` (see the module docstring).

    ``kind`` and ``sent_len`` are stored on the session by :func:`record_turn` when the turn completes.
    """
    if chat:
        msgs = body.get("messages")
        if type(msgs) is not list:
            return 0, CHAT, 0
        m = len(msgs)
        if s.kind == CHAT and s.turns and m >= s.sent_len:
            new = msgs[s.sent_len :] if s.sent_len else msgs
            skip_reply = s.reply_tokens >= 0
            chars = 0
            for msg in new:
                if skip_reply and type(msg) is dict and msg.get("role") == "assistant":
                    skip_reply = False
                    continue
                chars += message_chars(msg)
            base = s.known_tokens
        else:
            chars = 0
            for msg in msgs:
                chars += message_chars(msg)
            new = msgs
            base = 0
        return base + _tokens(chars) + MESSAGE_OVERHEAD_TOKENS * len(new), CHAT, m
    prompt = body.get("prompt")
    if type(prompt) is str:
        n = len(prompt)
        if s.kind == TEXT and s.turns and n >= s.sent_len:
            delta = n - s.sent_len
            if s.reply_tokens > 0:
                delta = max(0, delta - CHARS_PER_TOKEN * s.reply_tokens)
            return s.known_tokens + _tokens(delta), TEXT, n
        return _tokens(n), TEXT, n
    if type(prompt) is list and prompt:
        first = prompt[0]
        if type(first) is int:
            return len(prompt), IDS, len(prompt)
        total = 0
        if type(first) is list:
            for p in prompt:
                if type(p) is list:
                    total += len(p)
            return total, IDS, total
        for p in prompt:
            if type(p) is str:
                total += _tokens(len(p))
        return total, TEXT, 0
    return 0, TEXT, 0


def record_turn(s: GwSession, context: int, kind: int, sent_len: int, usage: dict[str, Any] | None) -> None:
    """Carry the finished (or failed) turn into the session's history for the next estimate."""
    s.turns += 1
    s.kind = kind
    s.sent_len = sent_len
    prompt = completion = -1
    if usage is not None:
        prompt = _int(usage.get("prompt_tokens"))
        completion = _int(usage.get("completion_tokens"))
    if prompt >= 0:
        s.prompt_tokens = prompt
        s.known_tokens = prompt + max(completion, 0)
        s.reply_tokens = max(completion, 0)
    else:
        s.known_tokens = context
        s.reply_tokens = -1


def output_budget(body: dict[str, Any], default: int) -> int:
    """o_s: ``max_tokens``, else ``max_completion_tokens``, else ``default`` (non-integers count as absent)."""
    v = body.get("max_tokens")
    if type(v) is int and v >= 0:
        return v
    v = body.get("max_completion_tokens")
    if type(v) is int and v >= 0:
        return v
    return default


def message_chars(msg: Any) -> int:
    """Characters of a chat message's text: content (a string or text parts) and tool calls."""
    if type(msg) is not dict:
        return 0
    content = msg.get("content")
    n = 0
    if type(content) is str:
        n = len(content)
    elif type(content) is list:
        for part in content:
            if type(part) is dict:
                text = part.get("text")
                if type(text) is str:
                    n += len(text)
    calls = msg.get("tool_calls")
    if type(calls) is list:
        for call in calls:
            fn = call.get("function") if type(call) is dict else None
            if type(fn) is dict:
                for key in ("name", "arguments"):
                    v = fn.get(key)
                    if type(v) is str:
                        n += len(v)
    return n


def _tokens(chars: int) -> int:
    return -(-chars // CHARS_PER_TOKEN)


def _int(v: Any) -> int:
    return v if type(v) is int else -1
