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

  A start-over counts the whole prompt as the engine sees it: the tool definitions the chat template renders
  (:func:`tool_tokens`: their JSON's characters / 4) and images as the API sizes them (:func:`image_tokens`:
  Anthropic's width x height / 750, at most 1,600; OpenAI's 85 plus 170 per 512-pixel tile, 85 at
  ``detail: low``), beside the conversation's text. Where the engine tokenizes (vLLM's ``/tokenize``, which
  ``kvgate engine`` answers too), the gateway asks it for a start-over's count instead
  (:func:`tokenize_body` builds the request; :mod:`kvgate.gateway.turns` sends it).

  The estimate is corrected from usage when the response arrives: the next boundary starts from the reported
  ``prompt_tokens + completion_tokens`` (the policy core updates D at boundaries only, as in the paper, §5).

The output budget o_s is the API's (:meth:`kvgate.http.dialect.Api.budget`: chat's ``max_completion_tokens`` else
``max_tokens``, Responses' ``max_output_tokens``, ``max_tokens`` otherwise), else the gateway's default.

Nothing here does I/O (the ``/tokenize`` ask is the caller's); every function is O(size of the new part of the
request) and never raises on odd input (a field of the wrong type counts as empty: the upstream answers the
client's mistake).
"""

from __future__ import annotations

import base64
from typing import Any

import orjson

from kvgate.http.dialect import Api, Usage

CHARS_PER_TOKEN = 4
"""Characters per token of the estimator (English text and code average about 4 in BPE vocabularies)."""
MESSAGE_OVERHEAD_TOKENS = 4
"""Chat-template tokens per message (role markers and separators)."""

TEXT, IDS = "text", "ids"
"""What a session sent last when it was not a conversation (else the API's name): the estimator carries a text
prompt or a conversation of the same API forward, and starts over on any change."""


class Estimate:
    """The estimator's part of a session record (owner: this module; the request path tells it the turn's
    boundary and its usage through the functions and methods here)."""

    __slots__ = ("turns", "kind", "known_tokens", "reply_tokens", "sent_len", "context", "output", "prompt_tokens",
                 "cached_tokens")

    def __init__(self) -> None:
        self.turns = 0
        """Turns that reached the upstream and came back (finished or failed)."""
        self.kind = ""
        """What the last turn sent: "text", "ids" or a conversation API's name (the estimator's carry)."""
        self.known_tokens = 0
        """Tokens known to be in the conversation after the last turn (see the module docstring)."""
        self.reply_tokens = -1
        """completion_tokens of the last turn's usage; -1 when the last turn gave no usage."""
        self.sent_len = 0
        """Messages (chat) or characters (text) sent in the last turn."""
        self.context = 0
        """L_s at the last boundary (the estimate the policy got)."""
        self.output = 0
        """o_s at the last boundary."""
        self.prompt_tokens = -1
        """usage.prompt_tokens of the last finished turn (-1: none yet)."""
        self.cached_tokens = -1
        """usage cached_tokens of the last finished turn (-1: not reported)."""

    def told(self, context: int, output: int) -> None:
        """The turn's boundary: the policy is told L_s = ``context`` and o_s = ``output``."""
        self.context, self.output = context, output

    def recounted(self, context: int) -> None:
        """The turn's L_s as counted again (the shared budget's estimate)."""
        self.context = context

    def cached(self, cached: int | None) -> None:
        """The last turn's usage reported ``cached`` tokens (None: not reported)."""
        self.cached_tokens = -1 if cached is None else cached

    def restart(self) -> None:
        """Forget the history: the next turn is the session's first."""
        self.turns = 0
        self.kind = ""
        self.sent_len = 0
        self.known_tokens = 0
        self.reply_tokens = -1
        self.prompt_tokens = -1
        self.cached_tokens = -1



def estimate_context(s: Estimate, body: dict[str, Any], api: Api, fresh: bool = False) -> tuple[int, str, int]:
    """``(L_s, kind, sent_len)`` for the request ``body`` of session ``s`` (see the module docstring); ``fresh``:
    the session's history was rewritten (count it all again).

    ``kind`` and ``sent_len`` are stored on the session by :func:`record_turn` when the turn completes.
    """
    return estimate_turn(s, body, api, fresh)[:3]  # type: ignore[return-value]


def estimate_turn(s: Estimate, body: dict[str, Any], api: Api, fresh: bool = False) -> tuple[int, str, int, bool]:
    """:func:`estimate_context` and whether the turn starts over (:func:`starts_over`), in one reading."""
    if not api.chat_like:
        return (*_prompt(s, body), False)
    conv = api.conversation(body)
    if conv is None:
        return 0, api.name, 0, False
    head, items = conv
    m = len(head) + len(items)
    carry = s.kind == api.name and s.turns > 0 and not fresh
    if carry and api.continues(body):
        chars = sum(item_chars(api, it) for it in items)  # the server holds the rest
        return (s.known_tokens + _tokens(chars) + MESSAGE_OVERHEAD_TOKENS * len(items), api.name, s.sent_len + m,
                False)
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
        return s.known_tokens + _tokens(chars) + MESSAGE_OVERHEAD_TOKENS * (m - start), api.name, m, False
    chars = sum(item_chars(api, it) for it in head) + sum(item_chars(api, it) for it in items)
    extra = tool_tokens(api, body) + sum(image_tokens(api, it) for it in items)
    return _tokens(chars) + MESSAGE_OVERHEAD_TOKENS * m + extra, api.name, m, True


def starts_over(s: Estimate, body: dict[str, Any], api: Api, fresh: bool = False) -> bool:
    """Whether :func:`estimate_context` counts this conversation turn from nothing (a first turn, a rewrite, a
    change of API, a conversation that shrank): the turns whose count the engine's tokenizer is asked for."""
    if not api.chat_like:
        return False
    conv = api.conversation(body)
    if conv is None:
        return False
    if not (s.kind == api.name and s.turns > 0 and not fresh):
        return True
    if api.continues(body):
        return False
    return len(conv[0]) + len(conv[1]) < s.sent_len


def tool_tokens(api: Api, body: dict[str, Any]) -> int:
    """Tokens of the tool definitions a request offers, as a chat template renders them (their JSON in chat's form:
    :meth:`~kvgate.http.dialect.Api.template_tools`)."""
    tools = api.template_tools(body)
    if not tools:
        return 0
    try:
        chars = len(orjson.dumps(tools))
    except TypeError:
        return 0
    return _tokens(chars) + MESSAGE_OVERHEAD_TOKENS


_IMAGE_PARTS = frozenset({"image", "image_url", "input_image"})


def image_tokens(api: Api, item: Any) -> int:
    """Tokens of the images an item carries (its content parts, Messages' tool results' too)."""
    content = item.get("content") if type(item) is dict else None
    if type(content) is not list:
        return 0
    n = 0
    for part in content:
        if type(part) is not dict:
            continue
        kind = part.get("type")
        if kind == "tool_result":
            n += image_tokens(api, part)
        elif kind in _IMAGE_PARTS:
            n += api.image_tokens(part, _png_size(part))
    return n


def _png_size(part: dict[str, Any]) -> tuple[int, int] | None:
    """A base64 PNG's width and height from its header (None for any other image)."""
    src = part.get("source")
    data = src.get("data") if type(src) is dict else None
    if data is None:
        url = part.get("image_url")
        url = url.get("url") if type(url) is dict else url
        if type(url) is str and url.startswith("data:image/png;base64,"):
            data = url[len("data:image/png;base64,"):]
    if type(data) is not str or len(data) < 32:
        return None
    try:
        head = base64.b64decode(data[:32])
    except ValueError:
        return None
    if head[:8] != b"\x89PNG\r\n\x1a\n":
        return None
    return int.from_bytes(head[16:20], "big"), int.from_bytes(head[20:24], "big")


def tokenize_body(api: Api, body: dict[str, Any]) -> dict[str, Any] | None:
    """The vLLM ``/tokenize`` request counting this conversation's prompt as the engine's chat template renders it:
    its items as chat messages (role, text, tool calls) and its tools in chat's form; None for a prompt API or a
    body that is not a conversation."""
    if not api.chat_like:
        return None
    conv = api.conversation(body)
    if conv is None or not (conv[0] or conv[1]):
        return None
    msgs: list[dict[str, Any]] = []
    for it in conv[0] + conv[1]:
        role, text, calls = api.parts(it)
        m: dict[str, Any] = {"role": role if role in _ROLES else "user", "content": text}
        if calls:
            m["tool_calls"] = [{"id": cid or "call", "type": "function", "function": {"name": name, "arguments": args}}
                               for cid, name, args in calls]
        msgs.append(m)
    out: dict[str, Any] = {"messages": msgs, "add_generation_prompt": True}
    model = body.get("model")
    if type(model) is str:
        out["model"] = model
    tools = api.template_tools(body)
    if tools:
        out["tools"] = tools
    return out


_ROLES = frozenset({"system", "developer", "user", "assistant", "tool"})


def _prompt(s: Estimate, body: dict[str, Any]) -> tuple[int, str, int]:
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


def record_turn(s: Estimate, context: int, kind: str, sent_len: int, usage: Usage | None) -> None:
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
