"""Answers written in the format a request asks for where it offers no tools: a code agent's code blocks.

A code agent offers no tools: its system prompt asks for Python in code blocks of a format it shows — a pair of
tags (``<code>`` … ``</code>``) or a Markdown fence (```` ```py ```` / ```` ```python ```` … ```` ``` ````) — and
says that a call of ``final_answer(...)`` in such a block ends its run (smolagents' ``CodeAgent``). Such a request
(:func:`code_ask`: the head's text holds a block of one of these formats that calls ``final_answer``) is a turn of an
agent session as one offering tools is (:mod:`kvgate.serve.agent`): before its last turn the answer is a thought of
the shape's output length and a block that only prints; the last turn's block calls ``final_answer("...")``.

The answer's tokens are its text's pieces (:func:`kvgate.serve.tokenizer.split_pieces`), so an agent sending it
back hits its KV as with filler. A ``stop`` string the request sets (chat, completions; Messages'
``stop_sequences``) ends the answer where it first occurs, left out as vLLM leaves it out (smolagents stops at its
closing tag and adds it back itself); an answer longer than the request's budget is cut there (``length``).
"""

from __future__ import annotations

import json
import re
from typing import Any, NamedTuple

import numpy as np

from kvgate.serve.tokenizer import filler_text, piece_id, split_pieces

FINAL_CALL = "final_answer"
"""The function a code agent's prompt says ends its run."""
BLOCK_FORMATS = (("<code>", "</code>"), ("```python", "```"), ("```py", "```"))
"""Code block openings and closings a code agent's prompt may show, in the order they are tried."""
_FINAL_RE = re.compile(rf"\b{FINAL_CALL}\s*\(")


class CodeAsk(NamedTuple):
    """A code agent's block format: its opening and closing."""

    opening: str
    closing: str


class Written(NamedTuple):
    """A written answer: its output pieces (one token each), their ids and how it ended."""

    pieces: tuple[str, ...]
    ids: np.ndarray
    finish: str
    """``stop``: whole or ended at a stop string; ``length``: cut by the budget."""

    @property
    def tokens(self) -> int:
        return len(self.pieces)

    def text(self, start: int, stop: int) -> str:
        """The text of output tokens ``start .. stop - 1``."""
        return "".join(self.pieces[start:stop])

    def piece_json(self, j: int) -> bytes:
        """Output token ``j``'s text as a JSON string literal (for SSE events)."""
        return json.dumps(self.pieces[j]).encode()


def code_ask(head_text: str) -> CodeAsk | None:
    """The block format a request's head (its system text) asks for: the first of :data:`BLOCK_FORMATS` holding a
    block that calls :data:`FINAL_CALL`; None when it asks for none."""
    if FINAL_CALL not in head_text:
        return None
    for opening, closing in BLOCK_FORMATS:
        pattern = re.escape(opening) + r"\s*\n(.*?)" + re.escape(closing)
        if any(_FINAL_RE.search(m) for m in re.findall(pattern, head_text, re.DOTALL)):
            return CodeAsk(opening, closing)
    return None


def code_answer(ask: CodeAsk, final: bool, wanted: int, budget: int, binds: bool, stops: list[str]) -> Written:
    """A code agent's answer of about ``wanted`` tokens: a thought and one block, which calls :data:`FINAL_CALL`
    when ``final``, else only prints; ended at the first of ``stops`` in it. A ``budget`` that ``binds`` (the
    request set it, or the context's remainder) cuts a longer answer; one that does not (the default of a request
    that sets none) shortens the thought instead, as a model that stops by itself."""
    code = f'{FINAL_CALL}("done")' if final else 'print("looked")'
    block = f"\n{ask.opening}\n{code}\n{ask.closing}"
    fixed = len(split_pieces("Thought:" + block))
    thought = filler_text(0, max(0, (wanted if binds else min(wanted, budget)) - fixed), False)
    text = "Thought:" + thought + block
    cut = [i for i in (text.find(s) for s in stops if s) if i >= 0]
    if cut:
        text = text[: min(cut)]
    pieces = split_pieces(text)
    finish = "stop"
    if len(pieces) > budget:
        pieces, finish = pieces[:budget], "length"
    return Written(tuple(pieces), np.array([piece_id(p) for p in pieces], dtype=np.int64), finish)


def stop_strings(body: dict[str, Any]) -> list[str]:
    """The stop strings a request sets (chat and completions ``stop``, Messages ``stop_sequences``)."""
    for key in ("stop", "stop_sequences"):
        v = body.get(key)
        if type(v) is str:
            return [v]
        if type(v) is list:
            return [s for s in v if type(s) is str and s]
    return []
