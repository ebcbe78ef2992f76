"""The fast KV pool: vLLM v1's prefix cache with a session's cached blocks kept as one run.

Theory of operation. In an agent workload a session has at most one request at a time and its tokens are
append-only, so its blocks behave as a unit: a request frees them tail first in one call, which puts them in
the free queue as one contiguous stretch in *descending* block order; allocation pops from the front, so it
eats that stretch from the session's *last* block towards its first; and the session's next request touches
whatever prefix survived. So the cached part of a session is always a prefix of its blocks, held either by
its running request or by one run in the free queue, and every operation on it is O(1)::

    free queue (front = evicted first)
    [ empty x 40 ][ sess 7: blocks 9..0 ][ g0 #124 ][ g0 #123 ] ... [ sess 3: blocks 31..0 ]
                   '-- eaten from 9 down --'

Blocks of a shared group prefix are referenced by many requests at once, so they are kept per block (each
is its own entry in the queue when free), with vLLM's multi-copy index: a key may have several indexed
copies and lookup returns the oldest. Group prefixes are small (125 blocks for a 2K-token system prompt).

Removals from the middle of the queue are lazy: a touched run is marked dead and skipped when it reaches the
front. ``tests/reference_cache.py`` is the per-block reference; a property-based test proves both equal.
"""

from __future__ import annotations

from collections import deque

from kvgate.engine.blocks import SeqKey, blocks_for


class _Node:
    """One entry of the free queue: an empty stretch, a session run, or one group block."""

    __slots__ = ("kind", "owner", "lo", "hi", "dead")

    EMPTY = 0
    SESSION = 1
    GROUP = 2

    def __init__(self, kind: int, owner: object, lo: int, hi: int) -> None:
        self.kind = kind
        self.owner = owner  # _Session for SESSION, _GBlock for GROUP, None for EMPTY
        self.lo = lo  # SESSION: session-relative block range [lo, hi); EMPTY: count = hi
        self.hi = hi
        self.dead = False


class _Session:
    __slots__ = ("cached", "node", "holder")

    def __init__(self) -> None:
        self.cached = 0  # session-relative blocks indexed: [0, cached)
        self.node: _Node | None = None  # the free run holding them, when not held by a request
        self.holder: _Req | None = None


class _GBlock:
    """A physical block holding group-prefix content (key index ``idx``)."""

    __slots__ = ("group", "idx", "ref", "indexed", "node")

    def __init__(self, group: _Group, idx: int) -> None:
        self.group = group
        self.idx = idx
        self.ref = 1
        self.indexed = False
        self.node: _Node | None = None


class _Group:
    __slots__ = ("nblocks", "copies", "keys_present", "nfree", "_firsts")

    def __init__(self, nblocks: int) -> None:
        self.nblocks = nblocks
        self.copies: list[list[_GBlock]] = [[] for _ in range(nblocks)]  # oldest indexed copy first
        self.keys_present = 0  # keys with at least one indexed copy
        self.nfree = 0  # blocks of this group waiting in the free queue
        self._firsts: list[_GBlock] | None = None

    def firsts(self) -> list[_GBlock]:
        """The block lookup returns for each key of the indexed prefix (cached until the index changes)."""
        f = self._firsts
        if f is None:
            f = []
            for c in self.copies:
                if not c:
                    break
                f.append(c[0])
            self._firsts = f
        return f

    def prefix(self) -> int:
        """Length of the indexed prefix of the group's keys."""
        if self.keys_present == self.nblocks:
            return self.nblocks
        for i, c in enumerate(self.copies):
            if not c:
                return i
        return self.nblocks

    def index(self, b: _GBlock) -> None:
        c = self.copies[b.idx]
        if not c:
            self.keys_present += 1
            self._firsts = None
        c.append(b)
        b.indexed = True

    def unindex(self, b: _GBlock) -> None:
        c = self.copies[b.idx]
        if c[0] is b:
            self._firsts = None
        c.remove(b)
        if not c:
            self.keys_present -= 1
        b.indexed = False


class _Req:
    __slots__ = ("seq", "gblocks", "sess", "s_alloc", "s_full", "tokens")

    def __init__(self, seq: SeqKey, sess: _Session) -> None:
        self.seq = seq
        self.gblocks: list[_GBlock] = []  # group-region blocks held, in block order
        self.sess = sess
        self.s_alloc = 0  # session-region blocks held: [0, s_alloc)
        self.s_full = 0  # of which indexed (full): [0, s_full)
        self.tokens = 0  # tokens the allocation covers


class RunKVPool:
    """vLLM v1 prefix-caching KV pool, run-length encoded per session. See ``kvgate.engine.blocks``."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_caching: bool = True) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.evictions = 0
        self._free = num_blocks
        self._queue: deque[_Node] = deque([_Node(_Node.EMPTY, None, 0, num_blocks)])
        self._groups: dict[tuple[int, int], _Group] = {}
        self._sessions: dict[int, _Session] = {}
        self._reqs: dict[int, _Req] = {}

    # -- queries ----------------------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return self._free

    def holds(self, rid: int) -> bool:
        return rid in self._reqs

    def usage(self) -> float:
        """Fraction of blocks held by requests (vLLM's ``kv_cache_usage_perc``)."""
        return 1.0 - self._free / self.num_blocks

    def _group(self, seq: SeqKey) -> _Group | None:
        if seq.group_blocks == 0:
            return None
        key = (seq.group, seq.group_blocks)
        g = self._groups.get(key)
        if g is None:
            g = self._groups[key] = _Group(seq.group_blocks)
        return g

    def _session(self, seq: SeqKey) -> _Session:
        s = self._sessions.get(seq.session)
        if s is None:
            s = self._sessions[seq.session] = _Session()
        return s

    def lookup(self, seq: SeqKey, num_tokens: int) -> int:
        if not self.enable_caching:
            return 0
        cap = (num_tokens - 1) // self.block_size
        g = self._group(seq)
        gb = seq.group_blocks
        if g is not None:
            gp = g.prefix()
            if gp < gb:
                return min(gp, cap) * self.block_size
        s = self._sessions.get(seq.session)
        sc = 0 if s is None or s.holder is not None else s.cached
        return min(gb + sc, cap) * self.block_size

    # -- free queue -------------------------------------------------------------------------------------
    def _append_empty(self, n: int) -> None:
        q = self._queue
        if q:
            last = q[-1]
            if last.kind == _Node.EMPTY and not last.dead:
                last.hi += n
                return
        q.append(_Node(_Node.EMPTY, None, 0, n))

    def _pop_blocks(self, n: int) -> None:
        """Take ``n`` blocks from the front of the free queue, evicting cached content."""
        q = self._queue
        while n > 0:
            node = q[0]
            if node.dead:
                q.popleft()
                continue
            kind = node.kind
            if kind == _Node.EMPTY:
                take = min(n, node.hi)
                node.hi -= take
                if node.hi == 0:
                    q.popleft()
            elif kind == _Node.SESSION:
                take = min(n, node.hi - node.lo)
                node.hi -= take
                sess: _Session = node.owner  # type: ignore[assignment]
                sess.cached = node.hi
                self.evictions += take
                if node.hi == node.lo:
                    q.popleft()
                    sess.node = None
                    sess.cached = 0
            else:
                take = 1
                b: _GBlock = node.owner  # type: ignore[assignment]
                q.popleft()
                b.node = None
                b.group.nfree -= 1
                if b.indexed:
                    b.group.unindex(b)
                    self.evictions += 1
            n -= take

    # -- allocation -------------------------------------------------------------------------------------
    def admit(
        self, rid: int, seq: SeqKey, num_tokens: int, hit_tokens: int, upto_tokens: int, fit_tokens: int = 0
    ) -> bool:
        if rid in self._reqs:
            raise ValueError(f"request {rid} already holds blocks")
        bs = self.block_size
        if not 0 <= hit_tokens < upto_tokens <= num_tokens or hit_tokens % bs:
            raise ValueError("need 0 <= hit < upto <= num_tokens with a block-aligned hit")
        hit = hit_tokens // bs
        gb = seq.group_blocks
        g = self._group(seq)
        sess = self._session(seq)
        if sess.holder is not None:
            raise ValueError(f"session {seq.session} already has a request holding blocks")
        g_hit = min(hit, gb)
        s_hit = hit - g_hit
        # Blocks the hit takes out of the free queue.
        free_hit = 0
        if g is not None and g_hit:
            firsts = g.firsts()
            if g_hit > len(firsts):
                raise ValueError("hit exceeds the cached prefix")
            if g.nfree:
                for i in range(g_hit):
                    if firsts[i].ref == 0:
                        free_hit += 1
        if s_hit:
            if s_hit > sess.cached:
                raise ValueError("hit exceeds the cached prefix")
            free_hit += s_hit
        need = blocks_for(upto_tokens, bs) - hit
        if max(need, blocks_for(fit_tokens, bs) - hit) + free_hit > self._free:
            return False
        # Take the session's free run out of the queue: the hit part is touched below; cached blocks beyond
        # the hit (the request is about to recompute them) are dropped from the index and stay free, in place.
        node = sess.node
        if node is not None:
            rest = sess.cached - s_hit
            if rest:
                node.kind = _Node.EMPTY
                node.owner = None
                node.lo, node.hi = 0, rest
            else:
                node.dead = True
            sess.node = None
        r = _Req(seq, sess)
        if g is not None and g_hit:
            blocks = g.firsts()[:g_hit]
            if g.nfree:
                for b in blocks:
                    if b.ref == 0:
                        b.node.dead = True  # type: ignore[union-attr]
                        b.node = None
                        g.nfree -= 1
                    b.ref += 1
            else:
                for b in blocks:
                    b.ref += 1
            r.gblocks = blocks
        r.s_alloc = r.s_full = s_hit
        sess.cached = s_hit
        sess.holder = r
        self._free -= free_hit
        self._reqs[rid] = r
        r.tokens = hit_tokens
        self._allocate(r, upto_tokens)
        return True

    def grow(self, rid: int, upto_tokens: int) -> bool:
        r = self._reqs.get(rid)
        if r is None:
            raise KeyError(f"request {rid} holds no blocks")
        if upto_tokens < r.tokens:
            raise ValueError("an allocation never shrinks")
        bs = self.block_size
        need = blocks_for(upto_tokens, bs) - blocks_for(r.tokens, bs)
        if need > self._free:
            return False
        self._allocate(r, upto_tokens)
        return True

    def _allocate(self, r: _Req, upto_tokens: int) -> None:
        bs = self.block_size
        have = blocks_for(r.tokens, bs)
        want = blocks_for(upto_tokens, bs)
        need = want - have
        if need:
            self._pop_blocks(need)
            self._free -= need
        gb = r.seq.group_blocks
        if have < gb:
            g = self._group(r.seq)
            for i in range(have, min(want, gb)):
                r.gblocks.append(_GBlock(g, i))  # type: ignore[arg-type]
        if want > gb:
            r.s_alloc = want - gb
        if self.enable_caching:
            # blocks that this allocation fills become cached (vLLM caches at allocate_slots time)
            old_full = r.tokens // bs
            new_full = upto_tokens // bs
            if old_full < gb:
                g = self._group(r.seq)
                assert g is not None
                for i in range(old_full, min(new_full, gb)):
                    g.index(r.gblocks[i])
            if new_full > gb:
                r.s_full = new_full - gb
                r.sess.cached = r.s_full
        r.tokens = upto_tokens

    def free(self, rid: int) -> None:
        r = self._reqs.pop(rid, None)
        if r is None:
            raise KeyError(f"request {rid} holds no blocks")
        sess = r.sess
        sess.holder = None
        q = self._queue
        # tail first: the session region (partial block, then the full run), then group blocks descending
        if r.s_alloc:
            partial = r.s_alloc - r.s_full
            if partial:
                self._append_empty(partial)
            if r.s_full:
                node = _Node(_Node.SESSION, sess, 0, r.s_full)
                q.append(node)
                sess.node = node
                sess.cached = r.s_full
            else:
                sess.cached = 0
            self._free += r.s_alloc
        else:
            sess.cached = 0
        for b in reversed(r.gblocks):
            b.ref -= 1
            if b.ref == 0:
                self._free += 1
                if b.indexed:
                    node = _Node(_Node.GROUP, b, 0, 1)
                    b.node = node
                    b.group.nfree += 1
                    q.append(node)
                else:
                    self._append_empty(1)

    def reset(self) -> bool:
        if self._reqs:
            return False
        self._queue = deque([_Node(_Node.EMPTY, None, 0, self._free)]) if self._free else deque()
        for g in self._groups.values():
            for c in g.copies:
                for b in c:
                    b.indexed = False
                    b.node = None
                c.clear()
            g.keys_present = 0
            g.nfree = 0
            g._firsts = None
        for s in self._sessions.values():
            s.cached = 0
            s.node = None
        return True
