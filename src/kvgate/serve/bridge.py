"""The content bridge: requests' token sequences onto the engines' SeqKeys (token identity).

The engines name cached content by :class:`~kvgate.engine.blocks.SeqKey`
(a group prefix shared by sessions, then tokens unique to one session, append-only), not by token hashes. The
bridge maps every request's token sequence (prompt + the deterministic filler output it will produce) onto a
SeqKey so that equal keys always mean equal tokens. It hashes full 16-token blocks chained, as vLLM does, and
remembers which session key holds which content::

    prompt blocks:  | b0 | b1 | ... | b124 | b125 | ... | b400 | b401 ... |
                    '--- group g (seen in two sessions) ---'
                                          '-- session s: its previous prompt + output --'-- new --'

* If the prompt extends the whole previous content of an idle session s (prompt + output of its last
  request), the request continues s: its hit is exactly the simulator's.
* If it covers s's previous prompt but diverges inside s's content (a retry, an edited output), or names the
  same ``X-Session-ID`` as s's last request, it continues s with its lookup capped at the common blocks
  (vLLM engine; the cap makes the pool drop the stale tail). The SGLang engine cannot cap, so it forks.
* Otherwise it is a new session key. Its group is the longest known group prefix it starts with; if it shares
  more blocks with another session's content than that, the common block-aligned prefix becomes a new group.
* The header ``X-Session-ID`` (or body ``session_id``) is only a hint; correctness never depends on it.

Approximations (docs/engine-server.md): the first session to carry a shared prefix keeps it in its own
session region (the group forms when a second session arrives, so that second session misses the shared
prefix once); groups do not nest; a session key keeps only its newest branch; a request forked off a session
that is busy, or (SGLang) that diverges inside it, hits only its group prefix.
"""

from __future__ import annotations

from collections import OrderedDict

import numpy as np

from kvgate.engine.blocks import SeqKey
from kvgate.serve.tokenizer import BLOCK, block_hashes

BRIDGE_MEMORY = 4
"""The bridge remembers the content of idle sessions up to this many times the pool's blocks (LRU)."""
MAX_GROUPS = 4096


class Content:
    """What one SeqKey session holds: the chained block hashes and tail of its newest content."""

    __slots__ = ("key", "gb", "hashes", "tail", "length", "prompt_blocks", "busy", "hint", "alive")

    def __init__(self, key: SeqKey, gb: int) -> None:
        self.key = key
        self.gb = gb  # group prefix in bridge blocks
        self.hashes: list[int] = []  # full blocks of prompt + output of its newest request
        self.tail: tuple[int, ...] = ()  # tokens after the last full block
        self.length = 0
        self.prompt_blocks = 0  # full blocks of the newest request's prompt
        self.busy = False  # a request of this key is in the engine
        self.hint: str | None = None
        self.alive = True


class ContentBridge:
    """Maps requests' token sequences onto SeqKeys so that a key's content is always one token sequence.

    ``caps``: the engine pool's per-session hit caps (:class:`~kvgate.engine.capped.CappedKVPool`), or None when
    the engine cannot cap; with caps a session key can continue with a request that diverges inside its content.
    The bridge remembers idle sessions' content up to ``max_blocks`` blocks, least recently used forgotten first
    (a forgotten session's next request gets a new key). See the module docstring."""

    def __init__(self, engine_block: int, *, caching: bool, caps: dict[int, int] | None, max_blocks: int) -> None:
        self.block = bridge_block(engine_block)
        """Tokens per bridge block: the engine's block when it is a multiple of 16, else 16."""
        self.per_block = self.block // engine_block  # engine blocks per bridge block
        self.caching = caching
        self.caps = caps
        self.max_blocks = max_blocks
        self._index: dict[int, Content] = {}  # hash of block i -> a session whose content has it at block i
        self._groups: dict[int, tuple[int, int]] = {}  # hash of a group's last block -> (group id, blocks)
        self._group_lens: list[int] = []  # distinct group lengths, longest first
        self._hints: dict[str, Content] = {}
        self._idle: OrderedDict[int, Content] = OrderedDict()  # LRU of idle sessions
        self._blocks = 0  # blocks held by live Content entries
        self._next_sid = 0
        self._next_gid = 0
        self.counts = {"continued": 0, "capped": 0, "new": 0, "forked": 0, "groups": 0, "forgotten": 0}

    def assign(self, tokens: np.ndarray, prompt_len: int, hint: str | None, salt: int = 0) -> tuple[SeqKey, Content]:
        """The key for a request whose full token sequence (prompt + output, int64) is ``tokens``, with its
        ``cache_salt`` (0: none; another salt shares no block). Marks it busy."""
        if not self.caching:
            self._next_sid += 1
            c = Content(SeqKey(0, 0, self._next_sid), 0)
            c.busy = True
            self.counts["new"] += 1
            return c.key, c
        B = self.block
        hashes = block_hashes(tokens, B, salt)
        p = prompt_len // B
        s, m = self._deepest(hashes, p)
        if hint is not None:
            hs = self._hints.get(hint)
            if hs is not None and hs is not s and hs.alive:
                mh = _common(hs.hashes, hashes, p)
                if mh > hs.gb and mh >= m:
                    s, m = hs, mh
        cont: Content | None = None
        cap: int | None = None
        group = self._best_group(hashes, p)
        if s is not None:
            full = m == len(s.hashes) and s.length <= prompt_len and tuple(tokens[m * B : s.length].tolist()) == s.tail
            same = full or m >= s.prompt_blocks or (hint is not None and hint == s.hint)
            if same and m > s.gb:
                if not s.busy and (full or self.caps is not None):
                    cont = s
                    cap = None if full else m * B
                else:
                    self.counts["forked"] += 1
            elif m > (group[1] if group else 0) and len(self._groups) < MAX_GROUPS:
                group = self._new_group(hashes[m - 1], m)
        if cont is None:
            self._next_sid += 1
            gid, gb = group if group else (0, 0)
            cont = Content(SeqKey(gid, gb * self.per_block, self._next_sid), gb)
            start = 0
            self.counts["new"] += 1
        else:
            self._idle.pop(cont.key.session, None)
            start = m
            self.counts["capped" if cap is not None else "continued"] += 1
        if self.caps is not None:
            if cap is None:
                self.caps.pop(cont.key.session, None)
            else:
                self.caps[cont.key.session] = cap
        self._blocks += len(hashes) - len(cont.hashes)
        cont.hashes = hashes
        cont.tail = tuple(tokens[len(hashes) * B :].tolist())
        cont.length = len(tokens)
        cont.prompt_blocks = p
        cont.busy = True
        if hint is not None:
            cont.hint = hint
            self._hints[hint] = cont
        index = self._index
        for i in range(start, len(hashes)):
            index[hashes[i]] = cont
        return cont.key, cont

    def release(self, c: Content) -> None:
        """The request of ``c`` left the engine (finished or aborted)."""
        if not c.busy:
            return
        c.busy = False
        if not self.caching or not c.alive:
            return
        self._idle[c.key.session] = c
        while self._blocks > self.max_blocks and self._idle:
            _, old = self._idle.popitem(last=False)
            self._forget(old)

    def _forget(self, c: Content) -> None:
        index = self._index
        for h in c.hashes:
            if index.get(h) is c:
                del index[h]
        self._blocks -= len(c.hashes)
        c.alive = False
        c.hashes = []
        if c.hint is not None and self._hints.get(c.hint) is c:
            del self._hints[c.hint]
        if self.caps is not None:
            self.caps.pop(c.key.session, None)
        self.counts["forgotten"] += 1

    def _deepest(self, hashes: list[int], p: int) -> tuple[Content | None, int]:
        """The live session whose content shares the most full prompt blocks with ``hashes``, and how many."""
        index = self._index
        get = index.get
        for i in range(p - 1, -1, -1):
            c = get(hashes[i])
            if c is not None and i < len(c.hashes) and c.hashes[i] == hashes[i]:  # NOTE: stale entries fail this
                return c, i + 1
        return None, 0

    def _best_group(self, hashes: list[int], p: int) -> tuple[int, int] | None:
        groups = self._groups
        for n in self._group_lens:
            if n <= p:
                g = groups.get(hashes[n - 1])
                if g is not None and g[1] == n:
                    return g
        return None

    def _new_group(self, last_hash: int, n: int) -> tuple[int, int]:
        self._next_gid += 1
        g = (self._next_gid, n)
        self._groups[last_hash] = g
        if n not in self._group_lens:
            self._group_lens.append(n)
            self._group_lens.sort(reverse=True)
        self.counts["groups"] += 1
        return g

    def stats(self) -> dict[str, int]:
        """The counts of :attr:`counts` (continued, capped, new, forked, groups, forgotten) and the index's size."""
        return {**self.counts, "indexed_blocks": len(self._index), "idle_sessions": len(self._idle)}


def bridge_block(engine_block: int) -> int:
    """The bridge's hash block for an engine block size: the engine's own when it is a multiple of 16 (vLLM's
    16, its CPU build's 128), else 16 when the engine block divides it (SGLang's page of 1 token)."""
    if engine_block > 0 and engine_block % BLOCK == 0:
        return engine_block
    if engine_block > 0 and BLOCK % engine_block == 0:
        return BLOCK
    raise ValueError(f"engine block size {engine_block} must divide {BLOCK} or be a multiple of it")


def _common(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of two chained-hash lists (binary search: chained means prefix-closed)."""
    lo, hi = 0, min(len(a), len(b), limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo
