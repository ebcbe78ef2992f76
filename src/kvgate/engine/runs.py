"""The records of the fast KV pool (``kvgate.engine.cache``) and the free queue they sit in.

A session's cached blocks are a few *ranges* of its session-relative block indices (:class:`BlockRange`), each
one contiguous stretch of the free queue (a :class:`QueueEntry`) or held by its running request (a
:class:`Holding`); group-prefix blocks are kept per block (:class:`GroupBlock`, indexed per group by
:class:`GroupBlocks`). :class:`FreeQueue` is the free queue behind the empty blocks: cached blocks in LRU order
or, under an engine-side eviction order, in tiers. Allocation takes blocks from its front (:meth:`FreeQueue.pop`),
evicting what they cache, and the queue's eviction hook hears every evicted session range (the offload tier,
``kvgate.engine.offload``, moves them to host memory). See ``kvgate.engine.cache`` for the theory of operation.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Protocol

from kvgate.engine.blocks import SeqKey

EvictHook = Callable[[int, int, int], None]
"""``on_evict(session, lo, hi)``: cached blocks ``[lo, hi)`` of ``session`` (session-relative) were evicted."""


class PoolObserver(Protocol):
    """Hears what vLLM reports as KV cache events (``kvgate engine --kv-events-config``); optional, off by default.

    Block indices of :meth:`stored` are the request's own (from block 0 of its group prefix); those of
    :meth:`evicted` are session-relative (block ``gb + i`` of a request is session block ``i``), as the pool keeps
    them. A session ``sid`` below 0 names blocks the pool orphaned (:meth:`forgot`)."""

    def stored(self, seq: SeqKey, first: int, last: int) -> None:
        """Blocks ``[first, last)`` of the request with content ``seq`` became cached (vLLM's ``BlockStored``)."""
        ...

    def evicted(self, sid: int, lo: int, hi: int) -> None:
        """Cached blocks ``[lo, hi)`` of session ``sid`` were evicted, block ``hi - 1`` first (``BlockRemoved``)."""
        ...

    def evicted_group(self, key: tuple[int, int], idx: int) -> None:
        """A cached copy of block ``idx`` of the group prefix ``key`` (group, blocks) was evicted."""
        ...

    def forgot(self, sid: int, rel: int, orphan: int | None) -> None:
        """Session ``sid``'s free cached blocks from session block ``rel`` on now belong to ``orphan`` (None: it had
        none): the session's content from there on changes (``RunKVPool.forget``)."""
        ...

    def cleared(self) -> None:
        """Every cached block was dropped (vLLM's ``AllBlocksCleared``)."""
        ...


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


class BlockRange:
    """Cached blocks ``[lo, hi)`` (session-relative) of one session, copies made by the request ``stamp``."""

    __slots__ = ("sess", "lo", "hi", "stamp", "node")

    def __init__(self, sess: SessionBlocks, lo: int, hi: int, stamp: int, node: QueueEntry) -> None:
        self.sess = sess
        self.lo = lo
        self.hi = hi
        self.stamp = stamp
        self.node = node


class QueueEntry:
    """One entry of the free queue behind the empty blocks: a stretch of one session's cached blocks (its
    ``ranges`` in queue order, each in descending block order), or one group block."""

    __slots__ = ("ranges", "gblock", "dead", "tier", "lp", "seq")

    def __init__(self, ranges: list[BlockRange] | None, gblock: GroupBlock | None) -> None:
        self.ranges = ranges
        self.gblock = gblock
        self.dead = False
        self.tier = 0  # under an eviction order: its tier, retention part and entry number
        self.lp = 0
        self.seq = 0


class SessionBlocks:
    __slots__ = ("sid", "ranges", "holder", "memo", "low")

    def __init__(self, sid: int) -> None:
        self.sid = sid
        self.low = False  # parked or ended (session-aware eviction)
        self.ranges: list[BlockRange] = []  # cached blocks in the free queue
        self.holder: Holding | None = None
        self.memo = 0  # cached value of prefix(), -1 when stale

    def prefix(self) -> int:
        """Session blocks indexed from block 0 on without a gap (free ranges and the holder's full blocks)."""
        p = self.memo
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
        self.memo = p
        return p

    def clear(self) -> None:
        """Forget every cached block (the pool's reset; no request holds blocks)."""
        self.ranges = []
        self.memo = 0

    def hand_over(self, rel: int, orphan: SessionBlocks) -> None:
        """Give ``orphan`` the free cached blocks from session block ``rel`` on, splitting a range that
        straddles it; they keep their place in the free queue (see ``RunKVPool.forget``)."""
        for rg in list(self.ranges):
            if rg.hi <= rel:
                continue
            if rg.lo >= rel:  # all of it
                self.ranges.remove(rg)
                rg.sess = orphan
                orphan.ranges.append(rg)
                continue
            ranges = rg.node.ranges
            assert ranges is not None
            part = BlockRange(orphan, rel, rg.hi, rg.stamp, rg.node)
            ranges.insert(ranges.index(rg), part)  # the higher blocks are in front
            orphan.ranges.append(part)
            rg.hi = rel


class GroupBlock:
    """A physical block holding group-prefix content (key index ``idx``). Its holders are ``ref`` requests one by
    one, plus the group's shared holders when ``shared`` (see :class:`GroupBlocks`): it is free when neither."""

    __slots__ = ("group", "idx", "ref", "indexed", "node", "shared")

    def __init__(self, group: GroupBlocks, idx: int) -> None:
        self.group = group
        self.idx = idx
        self.ref = 1
        self.indexed = False
        self.node: QueueEntry | None = None
        self.shared = False


class GroupBlocks:
    """A group prefix's blocks: every indexed copy of each of its ``nblocks`` keys.

    The common hit is the whole prefix, by every request of the group: those requests hold the prefix's first
    copies *together* (``shared`` holders of ``shared_blocks``) instead of one reference per block each, so
    admitting and releasing one costs O(1), not O(prefix). While anyone holds them the first copies cannot change
    (a held block is never evicted, a new copy is indexed behind the old), so every shared holder holds the same
    blocks; the blocks are marked ``shared`` from the first shared holder to the last, whose release frees those
    no request holds one by one, in the order a per-block release would have."""

    __slots__ = ("nblocks", "copies", "keys_present", "nfree", "firsts_memo", "key", "shared", "shared_blocks")

    def __init__(self, nblocks: int, key: tuple[int, int] = (0, 0)) -> None:
        self.nblocks = nblocks
        self.key = key  # (group, blocks): the pool's name for it
        self.copies: list[list[GroupBlock]] = [[] for _ in range(nblocks)]  # oldest indexed copy first
        self.keys_present = 0  # keys with at least one indexed copy
        self.nfree = 0  # blocks of this group waiting in the free queue
        self.firsts_memo: list[GroupBlock] | None = None
        self.shared = 0  # requests holding the whole prefix together
        self.shared_blocks: list[GroupBlock] = []  # what they hold: the first copies of all nblocks keys

    def firsts(self) -> list[GroupBlock]:
        """The block lookup returns for each key of the indexed prefix (cached until the index changes)."""
        f = self.firsts_memo
        if f is None:
            f = []
            for c in self.copies:
                if not c:
                    break
                f.append(c[0])
            self.firsts_memo = f
        return f

    def prefix(self) -> int:
        """Length of the indexed prefix of the group's keys."""
        if self.keys_present == self.nblocks:
            return self.nblocks
        for i, c in enumerate(self.copies):
            if not c:
                return i
        return self.nblocks

    def clear(self) -> None:
        """Forget every cached block (the pool's reset; no request holds blocks)."""
        for c in self.copies:
            for b in c:
                b.indexed = False
                b.node = None
            c.clear()
        self.keys_present = 0
        self.nfree = 0
        self.firsts_memo = None

    def index(self, b: GroupBlock) -> None:
        c = self.copies[b.idx]
        if not c:
            self.keys_present += 1
            self.firsts_memo = None
        c.append(b)
        b.indexed = True

    def unindex(self, b: GroupBlock) -> None:
        c = self.copies[b.idx]
        if c[0] is b:
            self.firsts_memo = None
        c.remove(b)
        if not c:
            self.keys_present -= 1
        b.indexed = False


class Holding:
    __slots__ = ("seq", "gblocks", "sess", "stamp", "pieces", "s_hit", "s_alloc", "s_full", "tokens", "shared")

    def __init__(self, seq: SeqKey, sess: SessionBlocks, stamp: int) -> None:
        self.seq = seq
        self.gblocks: list[GroupBlock] = []  # group-region blocks held, in block order
        self.shared = False  # gblocks is the group's whole prefix, held together (GroupBlocks.shared_blocks)
        self.sess = sess
        self.stamp = stamp  # copies this request makes are newer than all earlier ones of its session
        self.pieces: list[tuple[int, int, int]] = []  # the session hit: (lo, hi, stamp) in block order
        self.s_hit = 0  # session-region blocks hit: [0, s_hit)
        self.s_alloc = 0  # session-region blocks held: [0, s_alloc)
        self.s_full = 0  # of which indexed (full): [0, s_full)
        self.tokens = 0  # tokens the allocation covers


class FreeQueue:
    """The free cached blocks, LRU first, behind ``empty`` interchangeable blocks without content; entries
    removed from the middle are marked dead and skipped when they reach the front. With ``tiered`` (an
    engine-side eviction order) entries sit in tiers (see ``eviction_tier``), each a FIFO queue, and allocation
    evicts from the lowest non-empty one."""

    __slots__ = ("empty", "lru", "tiers", "entries", "evictions", "on_evict", "observer")

    def __init__(self, num_blocks: int, *, tiered: bool = False, on_evict: EvictHook | None = None) -> None:
        self.empty = num_blocks
        """Free blocks without content, at the front (reused first)."""
        self.lru: deque[QueueEntry] = deque()
        """Free cached blocks, LRU first (unused under an eviction order)."""
        self.tiers: list[deque[QueueEntry]] = [deque() for _ in range(GROUP_TIER + 1)] if tiered else []
        self.entries = 0
        self.evictions = 0
        """Cached blocks evicted so far."""
        self.on_evict = on_evict
        self.observer: PoolObserver | None = None

    def pop(self, n: int) -> None:
        """Take ``n`` blocks from the front of the free queue: empty ones first, then cached ones (evicted)."""
        e = self.empty
        if e >= n:
            self.empty = e - n
            return
        n -= e
        self.empty = 0
        q = self.lru
        hook = self.on_evict
        obs = self.observer
        tiers = self.tiers
        while n > 0:
            if tiers:
                q = next(t for t in tiers if live_front(t))
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
                sess.memo = -1
                self.evictions += take
                if hook is not None:
                    hook(sess.sid, rg.hi, rg.hi + take)
                if obs is not None:
                    obs.evicted(sess.sid, rg.hi, rg.hi + take)
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
                    if obs is not None:
                        obs.evicted_group(b.group.key, b.idx)
                n -= 1

    def take_session(self, sess: SessionBlocks, s_hit: int) -> list[tuple[int, int, int]]:
        """Take the oldest copy of each of the session's blocks ``[0, s_hit)`` out of the free queue; returns
        the pieces taken, ``(lo, hi, stamp)`` in block order."""
        sess.memo = -1
        ranges = sess.ranges
        if len(ranges) == 1 and ranges[0].lo == 0:  # the common case: one range, no other copies
            rg = ranges[0]
            if rg.hi == s_hit:
                self._replace(rg, [])
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
            self._replace(rg, left)
        if want:
            raise ValueError("hit exceeds the cached prefix")
        pieces.sort()
        return pieces

    def _replace(self, rg: BlockRange, left: list[tuple[int, int]]) -> None:
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
            extra = BlockRange(sess, lo, hi, rg.stamp, node)
            ranges.insert(i + j, extra)
            sess.ranges.append(extra)

    def release_group_block(self, b: GroupBlock) -> None:
        """``b`` has no holder left: to the back of the queue if cached, else one more empty free block."""
        if b.indexed:
            node = QueueEntry(None, b)
            b.node = node
            b.group.nfree += 1
            if self.tiers:
                self.enter(node, GROUP_TIER)
            else:
                self.lru.append(node)
        else:
            self.empty += 1

    def enter(self, node: QueueEntry, tier: int) -> None:
        self.entries += 1
        node.tier = tier
        node.seq = self.entries
        self.tiers[tier].append(node)

    def requeue(self, sess: SessionBlocks, low: bool) -> None:
        """Move the session's free cached blocks, in their queue order, to the back of their tier for ``low``."""
        nodes = sorted({id(rg.node): rg.node for rg in sess.ranges}.values(), key=lambda nd: nd.seq)
        for old in nodes:
            new = QueueEntry(old.ranges, None)
            new.lp = old.lp
            for rg in old.ranges or ():
                rg.node = new
            old.dead = True
            old.ranges = []
            self.enter(new, eviction_tier(low, new.lp))

    def clear(self, free: int) -> None:
        """Forget every cached block: the ``free`` free blocks are all empty now."""
        self.empty = free
        self.lru = deque()
        for t in self.tiers:
            t.clear()


def live_front(q: deque[QueueEntry]) -> bool:
    """Drop the dead entries at the front of a tier; whether a live one is left."""
    while q and q[0].dead:
        q.popleft()
    return bool(q)
