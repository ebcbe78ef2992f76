"""What the driver sends: the run's prompt vocabulary, the growing prompts of a session and the request head.

Turn k+1 sends exactly turn k's prompt, then the model's output, then the appended (tool) tokens::

    | shared prefix | unique task | out_0 | app_0 | out_1 | app_1 | ... |
    '- same ids in every session  '- the session's own random stream, keyed by (seed, session, part)

With ``--api completions`` prompts are token-id lists (:class:`TokenPrompt`); with ``--api chat``, ``responses`` or
``messages`` a conversation (:class:`kvgate.drive.conversation.ConvoPrompt`): a shared system prompt, the task,
then each answer as it came back and the appended text; lengths are approximate (one word of :data:`WORDS` is about
one token).
"""

from __future__ import annotations

import json
import random
from typing import Any

from kvgate.http.dialect import APIS

TOKEN_ID_RANGE = (1000, 30000)
"""Random prompt token ids are drawn from this range: inside every common vocabulary (Llama, Qwen, Mistral) and
clear of the special tokens at both ends."""

# Common English words that are one token in the usual BPE vocabularies (with their leading space).
_WORD_TEXT = """the of and to in is it that for on was with as be at by this had not are but from or have an they which
    one you were her all she there would their we him been has when who will more no if out so said what up its
    about into than them can only other new some could time these two may then do first any my now such like our
    over man me even most made after also did many before must through back years where much your way well down
    should because each just those people how too little state good very make world still own see men work long
    get here between both life being under never day same another know while last might us great old year off
    come since against go came right used take three states himself few house use during without again place
    around however home small found thought went say part once general high upon school every does got united left
    number course war until always away something fact though water less public put think almost hand enough far
    took head yet government system better set told nothing night end why called didn find going look asked later
    knew point next program city business give group toward young days let room president side social given
    present several order national second possible rather per face among form important often things looked early
    white case john become large big need four within felt along children saw best church ever least power
    development light thing seemed family interest want members mind country area others done turned although open
    file code test line value error list data function return class type name path check run build change"""
WORDS: tuple[str, ...] = tuple(_WORD_TEXT.split())
"""The words chat prompts are made of (the real-vLLM test model's vocabulary includes each as one token)."""


def _joined(*parts: str) -> str:
    return ",".join(p for p in parts if p)


class Vocab:
    """The run's prompt material: the shared prefix (identical in every session) and per-session random streams.

    Every random part comes from its own ``random.Random`` seeded by a string key ``kvgate/<seed>/<session>/<part>``
    (string seeds hash with SHA-512, so streams are the same in every process and independent of the call order).
    """

    SHARED_KEY = "kvgate/shared-prefix"

    def __init__(self, seed: int) -> None:
        self.seed = seed
        lo, hi = TOKEN_ID_RANGE
        self.id_strs = [str(i) for i in range(lo, hi)]
        self._shared_ids: list[str] = []
        self._shared_words: list[str] = []
        self._shared_cache: dict[tuple[str, int], str] = {}

    def key(self, sid: int) -> str:
        return f"kvgate/{self.seed}/{sid}"

    def ids(self, key: str, n: int) -> str:
        """``n`` random token ids from the stream ``key``, comma-joined."""
        if n <= 0:
            return ""
        return ",".join(random.Random(key).choices(self.id_strs, k=n))

    def words(self, key: str, n: int) -> str:
        if n <= 0:
            return ""
        return " ".join(random.Random(key).choices(WORDS, k=n))

    def shared_ids(self, n: int) -> str:
        """The first ``n`` ids of the run's shared prefix (the same for every session and every seed)."""
        hit = self._shared_cache.get(("ids", n))
        if hit is None:
            if len(self._shared_ids) < n:
                self._shared_ids = random.Random(self.SHARED_KEY).choices(self.id_strs, k=max(n, 4096))
            hit = self._shared_cache[("ids", n)] = ",".join(self._shared_ids[:n])
        return hit

    def shared_words(self, n: int) -> str:
        hit = self._shared_cache.get(("words", n))
        if hit is None:
            if len(self._shared_words) < n:
                self._shared_words = random.Random(self.SHARED_KEY).choices(WORDS, k=max(n, 4096))
            hit = self._shared_cache[("words", n)] = " ".join(self._shared_words[:n])
        return hit


class TokenPrompt:
    """A growing token-id prompt, kept as the text of its JSON array (one string concat per turn, no re-encoding).

    ::

        | shared (n_shared) | task (initial - n_shared) | out_0 | app_0 | ... | out_{k-1} | app_{k-1} |
    """

    __slots__ = ("ids", "n")

    def __init__(self, vocab: Vocab, key: str, n_shared: int, n_unique: int) -> None:
        self.ids = _joined(vocab.shared_ids(n_shared), vocab.ids(f"{key}/task", n_unique))
        self.n = n_shared + n_unique

    def body(self, head: str) -> bytes:
        """``head`` is a JSON object without its closing brace."""
        return f'{head},"prompt":[{self.ids}]}}'.encode()

    def extend(self, out: str, n_out: int, app: str, n_app: int) -> None:
        self.ids = _joined(self.ids, out, app)
        self.n += n_out + n_app


class RequestHead:
    """The fields every turn's request body shares (model, streaming, token ids); :meth:`text` adds the output
    budget. Rendered as a JSON object without its closing brace, which the prompt's ``body`` completes."""

    def __init__(
        self, model: str | None, *, api: str, stream: bool, ignore_eos: bool, token_ids: bool = True,
        session_field: str | None = None,
    ) -> None:
        dialect = APIS[api]
        head: dict[str, Any] = {}
        if model is not None:
            head["model"] = model
        head["stream"] = stream
        if stream and dialect.usage_option:
            head["stream_options"] = {"include_usage": True}
        head.update(dialect.request_fields(token_ids))
        self.fields = head
        self.budget = dialect.budget_fields[-1]  # (chat: max_tokens, as every OpenAI-compatible server reads it)
        self.ignore_eos = ignore_eos and dialect.sampling_params
        self.session_path = session_field.split(".") if session_field else []

    def text(self, n_out: int, sid: int | None = None) -> str:
        """The head for a turn of ``n_out`` tokens; ``sid`` goes to the session field, when there is one."""
        h = dict(self.fields)
        h[self.budget] = n_out
        if self.ignore_eos:
            h["ignore_eos"] = True
            h["min_tokens"] = n_out
        if self.session_path and sid is not None:
            node = h
            for key in self.session_path[:-1]:
                node = node.setdefault(key, {})
            node[self.session_path[-1]] = str(sid)
        return json.dumps(h, separators=(",", ":"))[:-1]
