"""The engine server's stand-in tokenizer, chat template, filler output and block hashes. No model files.

Text to token ids, deterministic and prefix-stable::

    "<|im_start|>user\\nRun ls -la, please<|im_end|>"
     '-- special --''-----------------------------' '-- special --'
                   "user" "\\n" "Run" " ls" " -" "la" "," " please"

* The three ChatML special tokens are split out first and get Qwen's ids (151643-151645).
* The text between them is cut by a GPT-2-like pre-tokenizer: an optional space plus up to 10 letters, an
  optional space plus up to 3 digits, an optional space plus up to 4 other symbols, a whitespace run (which
  leaves its last space to the word after it, as GPT-2 does).
* A piece's id is ``crc32(utf-8 of the piece) % 151643``: stable across processes and versions, no vocabulary
  file. Distinct pieces may share an id (rarely); that only ever matters if all 16 tokens of a block collide.

Prefix stability: the pieces of ``a + b`` begin with all pieces of ``a`` but its last (the last piece may
grow into ``b``); a special token cut in half is the one exception. So equal text prefixes give equal token
prefixes, as with a real BPE tokenizer. About one token per English word (~5 characters a token).

Chat template (ChatML, as Qwen's without tools or thinking)::

    [tools]      <|im_start|>system\\n# Tools\\n<tools>\\n{json per tool}\\n</tools><|im_end|>\\n
    per message  <|im_start|>{role}\\n{content}[\\n<tool_call>\\n{json}\\n</tool_call> per tool call]<|im_end|>\\n
    generation   <|im_start|>assistant\\n

Content may be a string, null, or a list of parts whose ``text`` fields are joined. Each message is tokenized
on its own (and cached), so an agent that resends its history only pays for the new messages.

Filler output: output token ``j`` is the piece ``" " + WORDS[j % 32]`` (" lorem", " ipsum", ...), one token
each; in chat the first token has no leading space ("lorem ipsum dolor ..."), so stripping the content changes
nothing. Appending the output to its prompt tokenizes to prompt + output: the leading space never merges with
what comes before it (completions) and the chat template puts it after "\\n".

Block hashes are chained, as vLLM's are: the hash of block ``i`` depends on every token up to the end of block
``i``, so equal hashes mean equal token prefixes (:func:`block_hashes`, vectorized with numpy).
"""

from __future__ import annotations

import json
import re
import zlib
from collections.abc import Sequence
from typing import Any

import numpy as np

VOCAB_SIZE = 151_936
"""Qwen3's vocabulary size; prompt token ids must be below it."""
ENDOFTEXT, IM_START, IM_END = 151_643, 151_644, 151_645
SPECIAL_TOKENS = {"<|endoftext|>": ENDOFTEXT, "<|im_start|>": IM_START, "<|im_end|>": IM_END}
SPECIAL_TEXT = {v: k for k, v in SPECIAL_TOKENS.items()}
_PIECE_IDS = ENDOFTEXT  # ordinary pieces get ids in [0, 151643)

_SPECIAL_RE = re.compile("(" + "|".join(re.escape(s) for s in SPECIAL_TOKENS) + ")")
_PIECE_RE = re.compile(r" ?[^\W\d_]{1,10}| ?\d{1,3}| ?(?:[^\s\w]|_){1,4}|\s+(?!\S)|\s+")

WORDS = (
    "lorem", "ipsum", "dolor", "sit", "amet", "culpa", "adipiscing", "elit", "sed", "do", "eiusmod",
    "tempor", "incididunt", "ut", "labore", "et", "dolore", "magna", "aliqua", "enim", "ad", "minim", "veniam",
    "quis", "nostrud", "officia", "ullamco", "laboris", "nisi", "aliquip", "ex", "ea",
)
assert len(WORDS) == 32 and all(w.isalpha() and len(w) <= 10 for w in WORDS)

BLOCK = 16
"""Block size of the content hashes (vLLM's default block size)."""

_MAX_VOCAB_CACHE = 1 << 21
_MAX_SEGMENT_CACHE = 1 << 15


def piece_id(piece: str) -> int:
    """The id of one ordinary piece (not a special token)."""
    return zlib.crc32(piece.encode("utf-8", "surrogatepass")) % _PIECE_IDS


_FILL_PIECES = tuple(" " + w for w in WORDS)
_FILL_IDS = tuple(piece_id(p) for p in _FILL_PIECES)
_CHAT_FIRST_ID = piece_id(WORDS[0])
_FILL_JSON = tuple(json.dumps(p).encode() for p in _FILL_PIECES)
_CHAT_FIRST_JSON = json.dumps(WORDS[0]).encode()


def split_pieces(text: str) -> list[str]:
    """``text`` (no special tokens) cut into its pieces, one token each; they join to ``text``."""
    return _PIECE_RE.findall(text)


def filler_piece_json(j: int, chat: bool) -> bytes:
    """Output token ``j``'s text as a JSON string literal (for SSE events)."""
    if chat and j == 0:
        return _CHAT_FIRST_JSON
    return _FILL_JSON[j & 31]


def filler_ids(n: int, chat: bool) -> list[int]:
    """Token ids of the first ``n`` output tokens."""
    ids = list(_FILL_IDS) * (n // 32 + 1)
    del ids[n:]
    if chat and n:
        ids[0] = _CHAT_FIRST_ID
    return ids


def filler_text(start: int, stop: int, chat: bool) -> str:
    """Text of output tokens ``start .. stop - 1``."""
    if stop <= start:
        return ""
    s = "".join(_FILL_PIECES[j & 31] for j in range(start, stop))
    if chat and start == 0:
        s = s[1:]
    return s


def _hash_constants(nblocks: int) -> tuple[np.ndarray, int, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0x6B76676174)  # fixed: hashes are the same in every process
    w = rng.integers(0, 2**63, size=BLOCK, dtype=np.uint64) * np.uint64(2) + np.uint64(1)
    r = int(rng.integers(0, 2**63)) * 2 + 1
    rinv = pow(r, -1, 1 << 64)
    rp, rip = [1] * nblocks, [1] * nblocks
    for i in range(1, nblocks):
        rp[i] = rp[i - 1] * r & _M64
        rip[i] = rip[i - 1] * rinv & _M64
    return w, r, np.array(rp, dtype=np.uint64), np.array(rip, dtype=np.uint64)


_M64 = (1 << 64) - 1
_MAX_BLOCKS = 1 << 13  # 131K tokens, over any max_model_len here
_W, _R, _RP, _RIP = _hash_constants(_MAX_BLOCKS)
_MIX = np.uint64(0xBF58476D1CE4E5B9)
_S31, _S29 = np.uint64(31), np.uint64(29)


def block_hashes(tokens: np.ndarray, block_size: int = BLOCK, salt: int = 0) -> list[int]:
    """Chained hashes of the full blocks of ``tokens`` (int64 array; a trailing partial block has none).

    ``h[i] = sum over j <= i of b[j] * R**(i - j)`` mod 2**64 over 16-token blocks, ``b[j]`` a mixed random-weight
    sum of block j's ids: equal ``h[i]`` means equal tokens up to the end of block ``i`` (64-bit hashes: collisions
    negligible for non-adversarial input). A ``block_size`` that is a multiple of 16 takes the chained hash at the
    end of each of its blocks (still prefix-closed). Vectorized: ~0.3 ms for a 40K-token sequence.

    ``salt`` (a request's ``cache_salt``, :func:`kvgate.serve.parse.cache_salt`) is folded into the first block's
    hash as vLLM folds it, so every chained hash differs: two salts never share a cached block."""
    if block_size <= 0 or block_size % BLOCK:
        raise ValueError(f"block size {block_size} is not a multiple of {BLOCK}")
    per = block_size // BLOCK
    nb = len(tokens) // block_size * per
    if nb == 0:
        return []
    if nb > _MAX_BLOCKS:
        raise ValueError(f"sequence of {len(tokens)} tokens is too long to hash")
    x = tokens[: nb * BLOCK].astype(np.uint64).reshape(nb, BLOCK)
    b = (x * _W).sum(axis=1, dtype=np.uint64)
    b ^= b >> _S31
    b *= _MIX
    b ^= b >> _S29
    if salt:
        b[0] ^= np.uint64(salt & _M64)
    h = np.cumsum(b * _RIP[:nb], dtype=np.uint64) * _RP[:nb]
    if per > 1:
        h = h[per - 1 :: per]
    return h.tolist()  # type: ignore[no-any-return]


_FILL_ARR = np.array(list(_FILL_IDS) * (_MAX_BLOCKS * BLOCK // 32), dtype=np.int64)
_FILL_ARR_CHAT = _FILL_ARR.copy()
_FILL_ARR_CHAT[0] = _CHAT_FIRST_ID


def filler_array(n: int, chat: bool) -> np.ndarray:
    """:func:`filler_ids` as a read-only int64 array (a view)."""
    return (_FILL_ARR_CHAT if chat else _FILL_ARR)[:n]


class TokenizeError(ValueError):
    """A prompt or message list the tokenizer cannot take (the message is for the client)."""


class Tokenizer:
    """Text and chat messages to token ids (see the module docstring). Keeps two bounded caches."""

    def __init__(self) -> None:
        self._vocab: dict[str, int] = {}
        self._segments: dict[str, list[int]] = {}
        self.newline = piece_id("\n")

    def _ids(self, text: str) -> list[int]:
        vocab = self._vocab
        if len(vocab) > _MAX_VOCAB_CACHE:
            vocab.clear()
        get = vocab.get
        out = []
        for p in _PIECE_RE.findall(text):
            i = get(p)
            if i is None:
                i = vocab[p] = zlib.crc32(p.encode("utf-8", "surrogatepass")) % _PIECE_IDS
            out.append(i)
        return out

    def encode(self, text: str) -> list[int]:
        """Token ids of ``text``; the special tokens in it are recognised."""
        if "<|" not in text:
            return self._ids(text)
        out: list[int] = []
        for k, part in enumerate(_SPECIAL_RE.split(text)):
            if k % 2:
                out.append(SPECIAL_TOKENS[part])
            elif part:
                out.extend(self._ids(part))
        return out

    def decode(self, ids: Sequence[int]) -> str:
        """Text of special tokens and filler output tokens; other ids (hashes of pieces) cannot be inverted."""
        inv = {i: p for i, p in zip(_FILL_IDS, _FILL_PIECES, strict=True)}
        inv[_CHAT_FIRST_ID] = WORDS[0]
        out = []
        for i in ids:
            t = SPECIAL_TEXT.get(i) or inv.get(i)
            if t is None:
                raise TokenizeError(f"token id {i} is not a special or filler token; it cannot be decoded")
            out.append(t)
        return "".join(out)

    def _segment(self, text: str) -> list[int]:
        """Cached :meth:`encode` for chat segments (a session resends the same messages every turn)."""
        seg = self._segments.get(text)
        if seg is None:
            if len(self._segments) > _MAX_SEGMENT_CACHE:
                self._segments.clear()
            seg = self._segments[text] = self.encode(text)
        return seg

    def encode_chat(self, messages: Any, *, add_generation_prompt: bool = True, tools: Any = None) -> list[int]:
        """Token ids of ``messages`` rendered by the ChatML template of the module docstring."""
        if not isinstance(messages, list) or not messages:
            raise TokenizeError("'messages' must be a non-empty list of messages")
        nl = self.newline
        out: list[int] = []
        if tools:
            if not isinstance(tools, list):
                raise TokenizeError("'tools' must be a list")
            body = "\n".join(json.dumps(t, sort_keys=True, separators=(", ", ": ")) for t in tools)
            out.append(IM_START)
            out.extend(self._segment(f"system\n# Tools\n<tools>\n{body}\n</tools>"))
            out.append(IM_END)
            out.append(nl)
        for k, m in enumerate(messages):
            if not isinstance(m, dict):
                raise TokenizeError(f"messages[{k}] must be an object")
            role = m.get("role")
            if not isinstance(role, str) or not role:
                raise TokenizeError(f"messages[{k}].role must be a non-empty string")
            text = role + "\n" + _content_text(m.get("content"), k)
            calls = m.get("tool_calls")
            if calls:
                for c in calls if isinstance(calls, list) else [calls]:
                    call = json.dumps(c, sort_keys=True, separators=(", ", ": "))
                    text += f"\n<tool_call>\n{call}\n</tool_call>"
            out.append(IM_START)
            out.extend(self._segment(text))
            out.append(IM_END)
            out.append(nl)
        if add_generation_prompt:
            out.append(IM_START)
            out.extend(self._segment("assistant\n"))
        return out


def _content_text(content: Any, k: int) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        parts = []
        for p in content:
            if isinstance(p, str):
                parts.append(p)
            elif isinstance(p, dict) and isinstance(p.get("text"), str):
                parts.append(p["text"])
            else:
                raise TokenizeError(f"messages[{k}].content: only text parts are supported")
        return "".join(parts)
    raise TokenizeError(f"messages[{k}].content must be a string, null or a list of text parts")
