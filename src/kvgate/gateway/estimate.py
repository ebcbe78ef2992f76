"""The context estimator: L_s at a turn boundary, from the request body and the session's last usage.

The policy core needs, at each turn boundary, the session's context L_s (prompt tokens of the turn) and its output
budget o_s. The gateway sees request bodies, not tokens, so L_s is:

* **exact** for token-id prompts (``/v1/completions`` with ``"prompt": [ids]``): the length of the id list
  (a batch of id lists: the sum of their lengths);
* **estimated** otherwise, from what the previous turn's usage says plus what was appended since::

      previous turn:   | prompt_tokens (usage)                  | completion_tokens (usage) |
      this turn:       | previous prompt                        | previous reply            | appended |
                       '------------- known: counted exactly by the previous usage ---------'- chars/4 -'

  - a conversation (chat ``messages``; Responses ``instructions`` and ``input``; Messages ``system`` and
    ``messages``: :meth:`kvgate.http.dialect.Api.conversation`): the appended part is the items beyond the count
    sent last time; its size is the characters of their text (content strings or text parts, tool calls' names and
    arguments, tool results: :meth:`~kvgate.http.dialect.Api.parts`) / 4, plus 4 tokens of chat-template overhead
    per item. The first assistant item among them is the previous reply: its text is already in
    ``completion_tokens``, so only its overhead is added. A Responses request naming ``previous_response_id``
    carries only what is new: all of its input is appended;
  - text prompts: the appended part is the characters beyond the previous prompt's length, less the previous
    reply's text estimated at 4 characters per completion token, / 4.
  - when the previous turn gave no usage (the upstream did not report it, or the turn failed), ``known`` is the
    previous estimate of L_s and the reply's text counts as appended text;
  - a first turn, a conversation that shrank (fewer items or a shorter prompt than last time: the client
    rewrote its history), a rewrite the session's lineage saw (``fresh``) or a change of API starts over: all
    text / 4, plus 4 tokens per item.

  The estimate is corrected from usage when the response arrives: the next boundary starts from the reported
  ``prompt_tokens + completion_tokens`` (the policy core updates D at boundaries only, as in the paper, §5).

The output budget o_s is the API's (:meth:`kvgate.http.dialect.Api.budget`: chat's ``max_completion_tokens`` else
``max_tokens``, Responses' ``max_output_tokens``, ``max_tokens`` otherwise), else the gateway's default.

Nothing here does I/O; every function is O(size of the new part of the request) and never raises on odd input
(a field of the wrong type counts as empty: the upstream answers the client's mistake).
"""

from __future__ import annotations

from typing import Any

from kvgate.gateway.sessions import GwSession
from kvgate.http.dialect import RESPONSES, Api, Usage

CHARS_PER_TOKEN = 4
"""Characters per token of the estimator (English text and code average about 4 in BPE vocabularies)."""
MESSAGE_OVERHEAD_TOKENS = 4
"""Chat-template tokens per message (role markers and separators)."""

TEXT, IDS = "text", "ids"
"""What a session sent last when it was not a conversation (else the API's name): the estimator carries a text
prompt or a conversation of the same API forward, and starts over on any change."""


def estimate_context(s: GwSession, body: dict[str, Any], api: Api, fresh: bool = False) -> tuple[int, str, int]:
    """``(L_s, kind, sent_len)`` for the request ``body`` of session ``s`` (see the module docstring); ``fresh``:
    the session's history was rewritten (count it all again).

    ``kind`` and ``sent_len`` are stored on the session by :func:`record_turn` when the turn completes.
    """
    if not api.chat_like:
        return _prompt(s, body)
    conv = api.conversation(body)
    if conv is None:
        return 0, api.name, 0
    head, items = conv
    m = len(head) + len(items)
    carry = s.kind == api.name and s.turns > 0 and not fresh
    if carry and api is RESPONSES and type(body.get("previous_response_id")) is str:
        chars = sum(item_chars(api, it) for it in items)  # the server holds the rest
        return s.known_tokens + _tokens(chars) + MESSAGE_OVERHEAD_TOKENS * len(items), api.name, s.sent_len + m
    if carry and m >= s.sent_len:
        start = s.sent_len
        skip_reply = s.reply_tokens >= 0
        chars = 0
        nh = len(head)
        for i in range(start, m):
            it = head[i] if i < nh else items[i - nh]
            if skip_reply and api.parts(it)[0] == "assistant":
                skip_reply = False
                continue
            chars += item_chars(api, it)
        return s.known_tokens + _tokens(chars) + MESSAGE_OVERHEAD_TOKENS * (m - start), api.name, m
    chars = sum(item_chars(api, it) for it in head) + sum(item_chars(api, it) for it in items)
    return _tokens(chars) + MESSAGE_OVERHEAD_TOKENS * m, api.name, m


def _prompt(s: GwSession, body: dict[str, Any]) -> tuple[int, str, int]:
    """A completion's prompt: token ids exactly, text by its new characters."""
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


def record_turn(s: GwSession, context: int, kind: str, sent_len: int, usage: Usage | None) -> None:
    """Carry the finished (or failed) turn into the session's history for the next estimate."""
    s.turns += 1
    s.kind = kind
    s.sent_len = sent_len
    if usage is not None:
        s.prompt_tokens = usage.prompt
        s.known_tokens = usage.prompt + usage.completion
        s.reply_tokens = usage.completion
    else:
        s.known_tokens = context
        s.reply_tokens = -1


def item_chars(api: Api, item: Any) -> int:
    """Characters of an item's text: its content (a string or text parts), tool calls and tool results."""
    _, text, calls = api.parts(item)
    n = len(text)
    for _, name, args in calls:
        n += len(name) + len(args)
    return n


def _tokens(chars: int) -> int:
    return -(-chars // CHARS_PER_TOKEN)
