"""The fast KV pool: vLLM v1's prefix cache (vLLM 0.32) with a session's cached blocks kept as key ranges.

Theory of operation. In an agent workload a session has at most one request at a time and its tokens are
append-only, so its blocks behave as a unit: a request frees them tail first in one call, which puts them at
the back of the free queue as one contiguous stretch in *descending* block order; allocation pops from the
front, so it eats that stretch from the session's *last* block towards its first; and the session's next
request touches whatever prefix survived. So a session's cached blocks are a few *ranges* of its
(session-relative) block indices, each one contiguous stretch of the free queue or held by its running
request, and every operation on them is O(1) per range::

    free queue (front = reused first)
    [ 40 empty blocks ][ sess 7: blocks 9..0 ][ g0 #124 ][ g0 #123 ] ... [ sess 3: blocks 31..0 ]
      '-- no content --''-- eaten from 9 down --'

Blocks that hold no cached content (a request's partial last block, every block with caching off, blocks
never filled) are interchangeable and always sit at the front (vLLM frees them to the front, reused first),
so they are one counter. Cached blocks join the back in LRU order.

A session normally has one range, [0, n). It has more when a request recomputes blocks whose older copies
are still cached (the group prefix in front of them was evicted, or the hit was capped at ``num_tokens - 1``):
like vLLM, both copies stay indexed, and a later hit touches the *oldest* copy of each block
(``get_one_block``). Copies made by one request are all newer than copies made by earlier requests of the
same session (one request at a time), so each range carries the stamp of the request that made it, and a
touch takes each block from the range with the smallest stamp that has it, possibly splitting a range.

Blocks of a shared group prefix are referenced by many requests at once, so they are kept per block (each
is its own entry in the queue when free), with vLLM's multi-copy index: a key may have several indexed
copies and lookup returns the oldest. Group prefixes are small (125 blocks for a 2K-token system prompt).

Removals from the middle of the queue are lazy: an emptied entry is marked dead and skipped when it reaches
the front. An optional ``on_evict(session, lo, hi)`` hook hears every evicted session range (the offload
tier moves them to host memory); an optional observer (``observe``, a ``PoolObserver``) hears what vLLM
publishes as KV cache events: blocks cached, every evicted copy (group blocks too), forgotten content, resets
(``kvgate engine --kv-events-config``); ``cached_blocks`` lists what is cached. The records and the free
queue are ``kvgate.engine.runs``; this module is the pool's lookup, allocation and release over them.
``tests/support/reference_cache.py`` is the per-block reference; property-based tests hold both to each other
and to vLLM's own ``KVCacheManager`` (``tests/engine/test_vllm_pool_oracle.py``).
"""

from __future__ import annotations

from kvgate.engine.blocks import SeqKey, blocks_for
from kvgate.engine.runs import (
    BlockRange,
    EvictHook,
    FreeQueue,
    GroupBlock,
    GroupBlocks,
    Holding,
    PoolObserver,
    QueueEntry,
    SessionBlocks,
    eviction_tier,
    length_tier,
)


class PoolQueries:
    """The fast pool's queries and hooks, over the state ``RunKVPool.__init__`` sets up."""

    _free: int
    _groups: dict[tuple[int, int], GroupBlocks]
    _reqs: dict[int, Holding]
    _fq: FreeQueue

    loaded_tokens = 0
    """One tier: no hit is ever loaded (see ``kvgate.engine.offload``)."""

    def load_seconds(self, tokens: int) -> float:
        return 0.0

    @property
    def evictions(self) -> int:
        """Cached blocks evicted by allocation so far."""
        return self._fq.evictions

    @property
    def on_evict(self) -> EvictHook | None:
        """The eviction hook: ``on_evict(session, lo, hi)`` hears every evicted session range."""
        return self._fq.on_evict

    @on_evict.setter
    def on_evict(self, hook: EvictHook | None) -> None:
        self._fq.on_evict = hook

    def observe(self, observer: PoolObserver | None) -> None:
        """Report stores, evictions, forgotten content and resets to ``observer`` (None: stop)."""
        self._fq.observer = observer

    def num_free_blocks(self) -> int:
        return self._free

    def holds(self, rid: int) -> bool:
        return rid in self._reqs

    def cached_blocks(self) -> tuple[list[tuple[tuple[int, int], int, int]], list[tuple[int, int, int]]]:
        """Read-only: every cached block copy, held or free (what the observer has heard of). Group blocks as
        ``((group, blocks), idx, copies)``; session blocks as ``(sid, lo, hi)``, one copy of session blocks
        ``[lo, hi)`` each (a session below 0 holds blocks the pool orphaned, see ``RunKVPool.forget``)."""
        groups = [(g.key, i, len(c)) for g in self._groups.values() for i, c in enumerate(g.copies) if c]
        sessions = [(r.sess.sid, 0, r.s_full) for r in self._reqs.values() if r.s_full]
        fq = self._fq
        for q in (fq.lru, *fq.tiers):
            for node in q:
                if not node.dead and node.ranges:
                    sessions.extend((rg.sess.sid, rg.lo, rg.hi) for rg in node.ranges if rg.hi > rg.lo)
        return groups, sessions


class RunKVPool(PoolQueries):
    """vLLM v1 prefix-caching KV pool, run-length encoded per session. See ``kvgate.engine.blocks``."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_caching: bool = True,
        on_evict: EvictHook | None = None,
        *,
        session_aware: bool = False,
        retention: bool = False,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self._free = num_blocks
        self._groups: dict[tuple[int, int], GroupBlocks] = {}
        self._sessions: dict[int, SessionBlocks] = {}
        self._reqs: dict[int, Holding] = {}
        self._stamp = 0
        self._orphans = 0  # sessions made up for cached blocks no session can hit (see forget)
        # Engine-side eviction orders (off by default: one LRU queue, exactly vLLM's). With either on, cached
        # free blocks sit in tiers (see eviction_tier), each a FIFO queue; allocation evicts from the lowest.
        self.session_aware = session_aware
        self.retention = retention
        self._tiered = session_aware or retention
        self._fq = FreeQueue(num_blocks, tiered=self._tiered, on_evict=on_evict)

    def _group(self, seq: SeqKey) -> GroupBlocks | None:
        if seq.group_blocks == 0:
            return None
        key = (seq.group, seq.group_blocks)
        g = self._groups.get(key)
        if g is None:
            g = self._groups[key] = GroupBlocks(seq.group_blocks, key)
        return g

    def _session(self, seq: SeqKey) -> SessionBlocks:
        s = self._sessions.get(seq.session)
        if s is None:
            s = self._sessions[seq.session] = SessionBlocks(seq.session)
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
        sc = 0 if s is None else s.prefix()
        return min(gb + sc, cap) * self.block_size

    # -- free queue -------------------------------------------------------------------------------------
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
        whole = False  # the hit takes the whole group prefix: held with the group's shared holders
        if g is not None and g_hit:
            firsts = g.firsts()
            if g_hit > len(firsts):
                raise ValueError("hit exceeds the cached prefix")
            whole = g_hit == gb
            if g.nfree and not (whole and g.shared):  # (while shared, none of the prefix is free)
                for i in range(g_hit):
                    b = firsts[i]
                    if b.ref == 0 and not b.shared:
                        free_hit += 1
        if s_hit:
            if s_hit > sess.prefix():
                raise ValueError("hit exceeds the cached prefix")
            free_hit += s_hit
        need = blocks_for(upto_tokens, bs) - hit
        if max(need, blocks_for(fit_tokens, bs) - hit) + free_hit > self._free:
            return False
        self._stamp += 1
        r = Holding(seq, sess, self._stamp)
        if s_hit:
            r.pieces = self._fq.take_session(sess, s_hit)
        if g is not None and g_hit:
            if whole and g.shared:
                g.shared += 1
                r.gblocks = g.shared_blocks
            else:
                blocks = g.firsts()[:g_hit]
                if g.nfree:
                    for b in blocks:
                        if b.ref == 0 and not b.shared:
                            b.node.dead = True  # type: ignore[union-attr]
                            b.node = None
                            g.nfree -= 1
                if whole:
                    for b in blocks:
                        b.shared = True
                    g.shared = 1
                    g.shared_blocks = blocks
                else:
                    for b in blocks:
                        b.ref += 1
                r.gblocks = blocks
            r.shared = whole
        r.s_hit = r.s_alloc = r.s_full = s_hit
        sess.holder = r
        sess.memo = -1
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
        tok = r.tokens
        want = -(-upto_tokens // bs)
        need = want + (tok // -bs)  # want - blocks_for(tok)
        if need > self._free:
            return False
        gb = r.seq.group_blocks
        if tok < gb * bs:
            self._allocate(r, upto_tokens)
            return True
        # the common case, inside the session region: _allocate without its group part
        if need:
            self._fq.pop(need)
            self._free -= need
        if want > gb:
            r.s_alloc = want - gb
        if self.enable_caching:
            full = upto_tokens // bs - gb
            if full > r.s_full:
                if self._fq.observer is not None:
                    self._fq.observer.stored(r.seq, gb + r.s_full, gb + full)
                r.s_full = full
                r.sess.memo = -1
        r.tokens = upto_tokens
        return True

    def _allocate(self, r: Holding, upto_tokens: int) -> None:
        bs = self.block_size
        have = blocks_for(r.tokens, bs)
        want = blocks_for(upto_tokens, bs)
        need = want - have
        if need:
            self._fq.pop(need)
            self._free -= need
        gb = r.seq.group_blocks
        if have < gb:
            g = self._group(r.seq)
            for i in range(have, min(want, gb)):
                r.gblocks.append(GroupBlock(g, i))  # type: ignore[arg-type]
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
            if new_full > gb and new_full - gb > r.s_full:
                r.s_full = new_full - gb
                r.sess.memo = -1
            if self._fq.observer is not None and new_full > old_full:
                self._fq.observer.stored(r.seq, old_full, new_full)
        r.tokens = upto_tokens

    def free(self, rid: int) -> None:
        r = self._reqs.pop(rid, None)
        if r is None:
            raise KeyError(f"request {rid} holds no blocks")
        sess = r.sess
        sess.holder = None
        sess.memo = -1
        fq = self._fq
        q = fq.lru
        # Tail first: the session region (partial block to the front, then the full blocks as one stretch to
        # the back), then group blocks descending.
        if r.s_alloc:
            self._free += r.s_alloc
            fq.empty += r.s_alloc - r.s_full
            if r.s_full:
                node = QueueEntry(None, None)
                if self._tiered:
                    node.lp = length_tier(r.tokens // self.block_size) if self.retention else 0
                if not sess.ranges:  # no other copies: one range, whatever stamps its pieces had
                    rgs = [BlockRange(sess, 0, r.s_full, r.stamp, node)]
                else:
                    rgs = []
                    if r.s_full > r.s_hit:
                        rgs.append(BlockRange(sess, r.s_hit, r.s_full, r.stamp, node))
                    for lo, hi, stamp in reversed(r.pieces):
                        last = rgs[-1] if rgs else None
                        if last is not None and last.stamp == stamp and last.lo == hi:
                            last.lo = lo
                        else:
                            rgs.append(BlockRange(sess, lo, hi, stamp, node))
                node.ranges = rgs
                sess.ranges.extend(rgs)
                if self._tiered:
                    fq.enter(node, eviction_tier(sess.low and self.session_aware, node.lp))
                else:
                    q.append(node)
        gblocks = r.gblocks
        if r.shared:  # one of the group's shared holders of its whole prefix
            g = gblocks[0].group
            g.shared -= 1
            if g.shared:
                return
            g.shared_blocks = []
            for b in gblocks:
                b.shared = False
            for b in reversed(gblocks):
                if not b.ref:
                    self._free += 1
                    fq.release_group_block(b)
            return
        for b in reversed(gblocks):
            ref = b.ref - 1
            b.ref = ref
            if not ref and not b.shared:
                self._free += 1
                fq.release_group_block(b)

    def set_session_low(self, sid: int, low: bool) -> None:
        """Session-aware eviction: the session is parked or ended (``low``), or admitted. Its free cached
        blocks move, in their queue order, to the back of their new tier; blocks it frees later enter it."""
        sess = self._sessions.get(sid)
        if sess is None:
            if not low:
                return
            sess = self._sessions[sid] = SessionBlocks(sid)
        if sess.low == low:
            return
        sess.low = low
        if self.session_aware and sess.ranges:
            self._fq.requeue(sess, low)

    def forget(self, seq: SeqKey, from_tokens: int) -> None:
        """The session's content from token ``from_tokens`` on is no longer the content its cached blocks
        hold (a client rewrote the conversation): its free cached blocks from there on stay where they are in
        the free queue, cached and evictable as in vLLM (whose hashes simply stop matching), but no lookup of
        the session finds them any more. Blocks a running request holds are not affected."""
        sess = self._sessions.get(seq.session)
        rel = max(0, from_tokens // self.block_size - seq.group_blocks)
        orphan = None
        if sess is not None and any(rg.hi > rel for rg in sess.ranges):
            self._orphans += 1
            orphan = -self._orphans
            sess.hand_over(rel, SessionBlocks(orphan))
            sess.memo = -1
        if self._fq.observer is not None:
            self._fq.observer.forgot(seq.session, rel, orphan)

    def reset(self) -> bool:
        if self._reqs:
            return False
        self._fq.clear(self._free)
        for g in self._groups.values():
            g.clear()
        for sess in self._sessions.values():
            sess.clear()
        if self._fq.observer is not None:
            self._fq.observer.cleared()
        return True
