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
tier moves them to host memory). ``tests/reference_cache.py`` is the per-block reference; property-based tests
hold both to each other and to vLLM's own ``KVCacheManager`` (``tests/test_vllm_pool_oracle.py``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable

from kvgate.engine.blocks import SeqKey, blocks_for

EvictHook = Callable[[int, int, int], None]
"""``on_evict(session, lo, hi)``: cached blocks ``[lo, hi)`` of ``session`` (session-relative) were evicted."""

LENGTH_TIERS = 32
"""Retention tiers by context length: a request's full blocks ``n`` give tier ``min(n.bit_length(), 31)``."""
GROUP_TIER = 2 * LENGTH_TIERS
"""Tier of free group-prefix blocks under an eviction order: above every session's (evicted last)."""


def eviction_tier(low: bool, length_part: int) -> int:
    """Tier of a session's free cached blocks under the engine-side eviction orders (off by default): blocks
    are evicted from the lowest non-empty tier first, in the order they entered it. ``low``: the session is
    parked or ended (session-aware eviction); ``length_part``: its retention tier (0 when retention is off)."""
    return (0 if low else LENGTH_TIERS) + length_part


def length_tier(full_blocks: int) -> int:
    """Retention tier of a request that holds ``full_blocks`` full blocks: longer contexts are evicted later."""
    return min(full_blocks.bit_length(), LENGTH_TIERS - 1)


class _Range:
    """Cached blocks ``[lo, hi)`` (session-relative) of one session, copies made by the request ``stamp``."""

    __slots__ = ("sess", "lo", "hi", "stamp", "node")

    def __init__(self, sess: _Session, lo: int, hi: int, stamp: int, node: _Node) -> None:
        self.sess = sess
        self.lo = lo
        self.hi = hi
        self.stamp = stamp
        self.node = node


class _Node:
    """One entry of the free queue behind the empty blocks: a stretch of one session's cached blocks (its
    ``ranges`` in queue order, each in descending block order), or one group block."""

    __slots__ = ("ranges", "gblock", "dead", "tier", "lp", "seq")

    def __init__(self, ranges: list[_Range] | None, gblock: _GBlock | None) -> None:
        self.ranges = ranges
        self.gblock = gblock
        self.dead = False
        self.tier = 0  # under an eviction order: its tier, retention part and entry number
        self.lp = 0
        self.seq = 0


class _Session:
    __slots__ = ("sid", "ranges", "holder", "_prefix", "low")

    def __init__(self, sid: int) -> None:
        self.sid = sid
        self.low = False  # parked or ended (session-aware eviction)
        self.ranges: list[_Range] = []  # cached blocks in the free queue
        self.holder: _Req | None = None
        self._prefix = 0  # cached value of prefix(), -1 when stale

    def prefix(self) -> int:
        """Session blocks indexed from block 0 on without a gap (free ranges and the holder's full blocks)."""
        p = self._prefix
        if p >= 0:
            return p
        h = self.holder
        p = h.s_full if h is not None else 0
        ranges = self.ranges
        grown = True
        while grown:
            grown = False
            for rg in ranges:
                if rg.lo <= p < rg.hi:
                    p = rg.hi
                    grown = True
        self._prefix = p
        return p


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
    __slots__ = ("seq", "gblocks", "sess", "stamp", "pieces", "s_hit", "s_alloc", "s_full", "tokens")

    def __init__(self, seq: SeqKey, sess: _Session, stamp: int) -> None:
        self.seq = seq
        self.gblocks: list[_GBlock] = []  # group-region blocks held, in block order
        self.sess = sess
        self.stamp = stamp  # copies this request makes are newer than all earlier ones of its session
        self.pieces: list[tuple[int, int, int]] = []  # the session hit: (lo, hi, stamp) in block order
        self.s_hit = 0  # session-region blocks hit: [0, s_hit)
        self.s_alloc = 0  # session-region blocks held: [0, s_alloc)
        self.s_full = 0  # of which indexed (full): [0, s_full)
        self.tokens = 0  # tokens the allocation covers


class RunKVPool:
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
        self.on_evict = on_evict
        self.evictions = 0
        self._free = num_blocks
        self._empty = num_blocks  # free blocks without content, at the front of the free queue
        self._queue: deque[_Node] = deque()  # free cached blocks behind them, LRU first
        self._groups: dict[tuple[int, int], _Group] = {}
        self._sessions: dict[int, _Session] = {}
        self._reqs: dict[int, _Req] = {}
        self._stamp = 0
        self._orphans = 0  # sessions made up for cached blocks no session can hit (see forget)
        # Engine-side eviction orders (off by default: one LRU queue, exactly vLLM's). With either on, cached
        # free blocks sit in tiers (see eviction_tier), each a FIFO queue; allocation evicts from the lowest.
        self.session_aware = session_aware
        self.retention = retention
        self._tiered = session_aware or retention
        self._tiers: list[deque[_Node]] = [deque() for _ in range(GROUP_TIER + 1)] if self._tiered else []
        self._entries = 0

    loaded_tokens = 0
    """One tier: no hit is ever loaded (see ``kvgate.engine.offload``)."""

    def load_seconds(self, tokens: int) -> float:
        return 0.0

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
            s = self._sessions[seq.session] = _Session(seq.session)
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
    def _pop_blocks(self, n: int) -> None:
        """Take ``n`` blocks from the front of the free queue: empty ones first, then cached ones (evicted)."""
        e = self._empty
        if e >= n:
            self._empty = e - n
            return
        n -= e
        self._empty = 0
        q = self._queue
        hook = self.on_evict
        tiers = self._tiers
        while n > 0:
            if tiers:
                q = next(t for t in tiers if _live_front(t))
            node = q[0]
            if node.dead:
                q.popleft()
                continue
            b = node.gblock
            if b is None:
                ranges = node.ranges
                assert ranges
                rg = ranges[0]
                take = min(n, rg.hi - rg.lo)
                rg.hi -= take
                sess = rg.sess
                sess._prefix = -1
                self.evictions += take
                if hook is not None:
                    hook(sess.sid, rg.hi, rg.hi + take)
                if rg.hi == rg.lo:
                    del ranges[0]
                    sess.ranges.remove(rg)
                    if not ranges:
                        node.dead = True
                        q.popleft()
                n -= take
            else:
                q.popleft()
                b.node = None
                b.group.nfree -= 1
                if b.indexed:
                    b.group.unindex(b)
                    self.evictions += 1
                n -= 1

    def _touch_session(self, sess: _Session, s_hit: int) -> list[tuple[int, int, int]]:
        """Take the oldest copy of each of the session's blocks ``[0, s_hit)`` out of the free queue; returns
        the pieces taken, ``(lo, hi, stamp)`` in block order."""
        sess._prefix = -1
        ranges = sess.ranges
        if len(ranges) == 1 and ranges[0].lo == 0:  # the common case: one range, no other copies
            rg = ranges[0]
            if rg.hi == s_hit:
                self._replace_range(rg, [])
            else:
                rg.lo = s_hit
            return [(0, s_hit, rg.stamp)]
        want = [(0, s_hit)]
        pieces: list[tuple[int, int, int]] = []
        for rg in sorted(ranges, key=lambda r: r.stamp):
            if not want:
                break
            taken: list[tuple[int, int]] = []
            rest: list[tuple[int, int]] = []
            for a, b in want:
                x, y = max(a, rg.lo), min(b, rg.hi)
                if x < y:
                    taken.append((x, y))
                    if a < x:
                        rest.append((a, x))
                    if y < b:
                        rest.append((y, b))
                else:
                    rest.append((a, b))
            if not taken:
                continue
            want = rest
            pieces.extend((x, y, rg.stamp) for x, y in taken)
            left: list[tuple[int, int]] = []  # what stays of rg, in queue (descending) order
            cur = rg.hi
            for x, y in sorted(taken, reverse=True):
                if y < cur:
                    left.append((y, cur))
                cur = x
            if rg.lo < cur:
                left.append((rg.lo, cur))
            self._replace_range(rg, left)
        if want:
            raise ValueError("hit exceeds the cached prefix")
        pieces.sort()
        return pieces

    def _replace_range(self, rg: _Range, left: list[tuple[int, int]]) -> None:
        """Replace ``rg`` in its queue entry by the ranges ``left`` (descending), or drop it."""
        node = rg.node
        ranges = node.ranges
        assert ranges is not None
        i = ranges.index(rg)
        sess = rg.sess
        if not left:
            del ranges[i]
            sess.ranges.remove(rg)
            if not ranges:
                node.dead = True
            return
        rg.lo, rg.hi = left[0]
        for j, (lo, hi) in enumerate(left[1:], start=1):
            extra = _Range(sess, lo, hi, rg.stamp, node)
            ranges.insert(i + j, extra)
            sess.ranges.append(extra)

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
            if s_hit > sess.prefix():
                raise ValueError("hit exceeds the cached prefix")
            free_hit += s_hit
        need = blocks_for(upto_tokens, bs) - hit
        if max(need, blocks_for(fit_tokens, bs) - hit) + free_hit > self._free:
            return False
        self._stamp += 1
        r = _Req(seq, sess, self._stamp)
        if s_hit:
            r.pieces = self._touch_session(sess, s_hit)
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
        r.s_hit = r.s_alloc = r.s_full = s_hit
        sess.holder = r
        sess._prefix = -1
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
            self._pop_blocks(need)
            self._free -= need
        if want > gb:
            r.s_alloc = want - gb
        if self.enable_caching:
            full = upto_tokens // bs - gb
            if full > r.s_full:
                r.s_full = full
                r.sess._prefix = -1
        r.tokens = upto_tokens
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
            if new_full > gb and new_full - gb > r.s_full:
                r.s_full = new_full - gb
                r.sess._prefix = -1
        r.tokens = upto_tokens

    def free(self, rid: int) -> None:
        r = self._reqs.pop(rid, None)
        if r is None:
            raise KeyError(f"request {rid} holds no blocks")
        sess = r.sess
        sess.holder = None
        sess._prefix = -1
        q = self._queue
        # Tail first: the session region (partial block to the front, then the full blocks as one stretch to
        # the back), then group blocks descending.
        if r.s_alloc:
            self._free += r.s_alloc
            self._empty += r.s_alloc - r.s_full
            if r.s_full:
                node = _Node(None, None)
                if self._tiered:
                    node.lp = length_tier(r.tokens // self.block_size) if self.retention else 0
                if not sess.ranges:  # no other copies: one range, whatever stamps its pieces had
                    rgs = [_Range(sess, 0, r.s_full, r.stamp, node)]
                else:
                    rgs = []
                    if r.s_full > r.s_hit:
                        rgs.append(_Range(sess, r.s_hit, r.s_full, r.stamp, node))
                    for lo, hi, stamp in reversed(r.pieces):
                        last = rgs[-1] if rgs else None
                        if last is not None and last.stamp == stamp and last.lo == hi:
                            last.lo = lo
                        else:
                            rgs.append(_Range(sess, lo, hi, stamp, node))
                node.ranges = rgs
                sess.ranges.extend(rgs)
                if self._tiered:
                    self._enter(node, eviction_tier(sess.low and self.session_aware, node.lp))
                else:
                    q.append(node)
        for b in reversed(r.gblocks):
            ref = b.ref - 1
            b.ref = ref
            if not ref:
                self._free += 1
                if b.indexed:
                    node = _Node(None, b)
                    b.node = node
                    b.group.nfree += 1
                    if self._tiered:
                        self._enter(node, GROUP_TIER)
                    else:
                        q.append(node)
                else:
                    self._empty += 1

    def _enter(self, node: _Node, tier: int) -> None:
        self._entries += 1
        node.tier = tier
        node.seq = self._entries
        self._tiers[tier].append(node)

    def set_session_low(self, sid: int, low: bool) -> None:
        """Session-aware eviction: the session is parked or ended (``low``), or admitted. Its free cached
        blocks move, in their queue order, to the back of their new tier; blocks it frees later enter it."""
        sess = self._sessions.get(sid)
        if sess is None:
            if not low:
                return
            sess = self._sessions[sid] = _Session(sid)
        if sess.low == low:
            return
        sess.low = low
        if not self.session_aware or not sess.ranges:
            return
        nodes = sorted({id(rg.node): rg.node for rg in sess.ranges}.values(), key=lambda nd: nd.seq)
        for old in nodes:
            new = _Node(old.ranges, None)
            new.lp = old.lp
            for rg in old.ranges or ():
                rg.node = new
            old.dead = True
            old.ranges = []
            self._enter(new, eviction_tier(low, new.lp))

    def forget(self, seq: SeqKey, from_tokens: int) -> None:
        """The session's content from token ``from_tokens`` on is no longer the content its cached blocks
        hold (a client rewrote the conversation): its free cached blocks from there on stay where they are in
        the free queue, cached and evictable as in vLLM (whose hashes simply stop matching), but no lookup of
        the session finds them any more. Blocks a running request holds are not affected."""
        sess = self._sessions.get(seq.session)
        if sess is None or not sess.ranges:
            return
        rel = max(0, from_tokens // self.block_size - seq.group_blocks)
        orphan: _Session | None = None
        for rg in list(sess.ranges):
            if rg.hi <= rel:
                continue
            if orphan is None:
                self._orphans += 1
                orphan = _Session(-self._orphans)
            if rg.lo >= rel:  # all of it
                sess.ranges.remove(rg)
                rg.sess = orphan
                orphan.ranges.append(rg)
                continue
            ranges = rg.node.ranges
            assert ranges is not None
            part = _Range(orphan, rel, rg.hi, rg.stamp, rg.node)
            ranges.insert(ranges.index(rg), part)  # the higher blocks are in front
            orphan.ranges.append(part)
            rg.hi = rel
        sess._prefix = -1

    def reset(self) -> bool:
        if self._reqs:
            return False
        self._empty = self._free
        self._queue = deque()
        for t in self._tiers:
            t.clear()
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
            s.ranges = []
            s._prefix = 0
        return True


def _live_front(q: deque[_Node]) -> bool:
    """Drop the dead entries at the front of a tier; whether a live one is left."""
    while q and q[0].dead:
        q.popleft()
    return bool(q)
