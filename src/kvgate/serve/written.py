"""Answers written in the format a request asks for where it offers no tools: a code agent's code blocks, an
edit in an editor's edit format.

A code agent offers no tools: its system prompt asks for Python in code blocks of a format it shows — a pair of
tags (``<code>`` … ``</code>``) or a Markdown fence (```` ```py ```` / ```` ```python ```` … ```` ``` ````) — and
says that a call of ``final_answer(...)`` in such a block ends its run (smolagents' ``CodeAgent``). Such a request
(:func:`code_ask`: the head's text holds a block of one of these formats that calls ``final_answer``) is a turn of an
agent session as one offering tools is (:mod:`kvgate.serve.agent`): before its last turn the answer is a thought of
the shape's output length and a block that only prints; the last turn's block calls ``final_answer("...")``.

An editor asks for edits of the files it shows in a format its system prompt names (:func:`edit_ask`; aider's
``whole``: a *file listing*, the path then the whole file fenced; ``diff``: *SEARCH/REPLACE* blocks). Its request is
answered with an edit that changes nothing, of the last file its user items show (:func:`shown_file`): the editor
applies it, finds nothing to lint and ends, as a tool call of harmless arguments runs nothing of consequence.

The answer's tokens are its text's pieces (:func:`kvgate.serve.tokenizer.split_pieces`), so an agent sending it
back hits its KV as with filler. A ``stop`` string the request sets (chat, completions; Messages'
``stop_sequences``) ends the answer where it first occurs, left out as vLLM leaves it out (smolagents stops at its
closing tag and adds it back itself); an answer longer than a budget the request set is cut there (``length``).
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
    when ``final``, else only prints (see :func:`compose` for the budget and ``stops``)."""
    code = f'{FINAL_CALL}("done")' if final else 'print("looked")'
    return compose("Thought:", f"\n{ask.opening}\n{code}\n{ask.closing}", wanted, budget, binds, stops)


def edit_ask(head_text: str) -> str | None:
    """The edit format a request's head asks for: ``"whole"`` (a *file listing*: a file's path, then its whole
    content fenced), ``"diff"`` (*SEARCH/REPLACE* blocks: ``<<<<<<< SEARCH``, ``=======``, ``>>>>>>> REPLACE``;
    aider's two), or None."""
    if "<<<<<<< SEARCH" in head_text and ">>>>>>> REPLACE" in head_text:
        return "diff"
    return "whole" if "*file listing*" in head_text else None


_FILE_RE = re.compile(r"^([^\s`<>][^\n]*)\n(```+)[^\n]*\n(.*?)^\2[ \t]*$", re.MULTILINE | re.DOTALL)


def shown_file(texts: list[str], head_text: str) -> tuple[str, str] | None:
    """The last file the conversation's user items show as its path on a line of its own, then its content
    fenced, leaving out the format's example (a path the head names): ``(path, content)``; None if they show
    none."""
    for text in reversed(texts):
        for path, _, content in reversed(_FILE_RE.findall(text)):
            if path.strip() not in head_text:
                return path.strip(), content
    return None


def edit_answer(kind: str, file: tuple[str, str], wanted: int, budget: int, binds: bool,
                stops: list[str]) -> Written:
    """An edit that changes nothing, in the format asked (:func:`edit_ask`), of ``file`` (:func:`shown_file`):
    the whole file as it is (``whole``), or a block replacing its first line by itself (``diff``); after a
    thought of about ``wanted`` tokens in all (see :func:`compose`)."""
    path, content = file
    if kind == "diff":
        line = next((ln for ln in content.splitlines() if ln.strip()), "")
        content = f"<<<<<<< SEARCH\n{line}\n=======\n{line}\n>>>>>>> REPLACE\n"
    return compose("", f"\n\n{path}\n```\n{content}```\n", wanted, budget, binds, stops)


def compose(lead: str, fixed: str, wanted: int, budget: int, binds: bool, stops: list[str]) -> Written:
    """``lead``, filler, then ``fixed``: about ``wanted`` tokens, ended at the first of ``stops`` in it. A
    ``budget`` that ``binds`` (the request set it, or the context's remainder) cuts a longer answer; one that does
    not (the default of a request that sets none) shortens the filler instead, as a model that stops by itself."""
    size = len(split_pieces(lead + fixed))
    text = lead + filler_text(0, max(0, (wanted if binds else min(wanted, budget)) - size), not lead) + fixed
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
