"""Per-block reference implementation of :class:`kvgate.engine.blocks.KVPool`, structured like vLLM v1.

This is deliberately naive and slow: one object per physical block (id, ref count, content key), one free
queue holding eviction order only (front = reused first), an index from content key to the cached blocks, and
per-request block lists, following vLLM 0.32's ``vllm/v1/core/block_pool.py`` and ``kv_cache_manager.py``
step by step:

* ``lookup``: walk the request's content keys from block 0 while they are indexed (chained prefix), capped at
  ``num_tokens - 1`` tokens rounded down to whole blocks (``find_longest_cache_hit``);
* ``admit``: refuse when ``new blocks + evictable hit blocks > free blocks`` (``allocate_slots``), or when the
  blocks for ``fit_tokens`` would not fit either (``full_sequence_must_fit``); touch the hit blocks, pop new
  blocks from the front of the free queue (evicting their content), cache the ones the allocation fills;
* ``grow``: allocate more blocks the same way and cache every block that became full, including a previously
  partial last block;
* ``free``: release the request's blocks tail first; a block that reaches ref count 0 goes to the *front* of
  the free queue when it holds no cached content (a partial last block, or any block with caching off), to
  the back (MRU end) when it is cached (``BlockPool.free_blocks``);
* ``reset``: un-index everything while no block is held (``reset_prefix_cache``).

Like vLLM, the index keeps every copy of a content key (vLLM never de-duplicates): ``content key -> {block
id: block}`` in insertion order, and a hit uses the oldest indexed copy (``get_one_block``). A request that
recomputes blocks whose older copies are still cached (its prefix in front of them was evicted) indexes a
second copy; the old one stays indexed and can still be hit, e.g. after the request is preempted.

vLLM's null block is not a block here: ``num_blocks`` counts the blocks requests can hold (vLLM's
``num_gpu_blocks - 1``). The fast implementation (``kvgate.engine.cache.RunKVPool``) is tested against this
one, and both against vLLM's own ``KVCacheManager`` (``tests/support/vllm_pool_oracle.py``).

The engine-side eviction orders (off by default; ``session_aware``, ``retention``, see
``kvgate.engine.cache.eviction_tier``) are modelled here naively too: every cached free block carries a tier,
allocation takes the first block of the free queue with the lowest tier (blocks without content first), and a
session's status change moves its free cached blocks, in queue order, to the back with their new tier.
"""

from __future__ import annotations

from collections import OrderedDict

from kvgate.engine.blocks import SeqKey, blocks_for
from kvgate.engine.runs import GROUP_TIER, eviction_tier, length_tier

ContentKey = tuple[str, int, int]


def content_key(seq: SeqKey, i: int) -> ContentKey:
    """Content key of block ``i`` of a request: ``('g', group, i)`` in the shared group prefix, else
    ``('s', session, i)``."""
    if i < seq.group_blocks:
        return ("g", seq.group, i)
    return ("s", seq.session, i)


class Block:
    """One physical KV block (vLLM's ``KVCacheBlock``)."""

    __slots__ = ("block_id", "ref_cnt", "key")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.ref_cnt = 0
        self.key: ContentKey | None = None  # set while the block is indexed (vLLM's block_hash)

    def __repr__(self) -> str:
        return f"Block({self.block_id}, ref={self.ref_cnt}, key={self.key})"


class _Request:
    __slots__ = ("seq", "num_tokens", "blocks", "tokens", "num_cached")

    def __init__(self, seq: SeqKey, num_tokens: int) -> None:
        self.seq = seq
        self.num_tokens = num_tokens  # prompt length at admission (grow does not tell us more)
        self.blocks: list[Block] = []
        self.tokens = 0  # tokens the allocation covers
        self.num_cached = 0  # blocks [0, num_cached) are full and were cached (vLLM's num_cached_block)


class BlockKVPool:
    """Per-block reference KV pool; same constructor and protocol as ``RunKVPool``."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_caching: bool = True,
        *,
        session_aware: bool = False,
        retention: bool = False,
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.session_aware = session_aware
        self.retention = retention
        self._tier: dict[int, int] = {}  # block id -> tier, for cached free blocks
        self._lp: dict[int, int] = {}  # block id -> retention part of its tier
        self._low: dict[int, bool] = {}  # session -> parked or ended
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.evictions = 0
        self.eviction_log: list[ContentKey] = []
        """Content keys evicted by allocation, in order (for pinned tests)."""
        self.blocks = [Block(i) for i in range(num_blocks)]
        # free queue: block id -> None, front (first) = least recently used = evicted first
        self._free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        # index: content key -> {block id: block}, oldest copy first
        self._index: dict[ContentKey, dict[int, Block]] = {}
        self._reqs: dict[int, _Request] = {}

    # -- queries -------------------------------------------------------------------------------------------
    def num_free_blocks(self) -> int:
        return len(self._free_queue)

    def holds(self, rid: int) -> bool:
        return rid in self._reqs

    loaded_tokens = 0
    """One tier: no hit is ever loaded."""

    def load_seconds(self, tokens: int) -> float:
        return 0.0

    def usage(self) -> float:
        return 1.0 - self.num_free_blocks() / self.num_blocks

    def cached_keys(self) -> set[ContentKey]:
        """Content keys with at least one indexed copy."""
        return set(self._index)

    def free_queue_ids(self) -> list[int]:
        """Block ids of the free queue, front (evicted first) to back."""
        return list(self._free_queue)

    def request_block_ids(self, rid: int) -> list[int]:
        return [b.block_id for b in self._reqs[rid].blocks]

    def _cached_block(self, key: ContentKey) -> Block | None:
        copies = self._index.get(key)
        if not copies:
            return None
        return next(iter(copies.values()))  # oldest copy, as vLLM's get_one_block

    def lookup(self, seq: SeqKey, num_tokens: int) -> int:
        if num_tokens < 1:
            raise ValueError("a request has at least one token")
        if not self.enable_caching:
            return 0
        cap = (num_tokens - 1) // self.block_size
        n = 0
        while n < cap and content_key(seq, n) in self._index:
            n += 1
        return n * self.block_size

    # -- block pool primitives -------------------------------------------------------------------------
    def _index_block(self, block: Block, key: ContentKey) -> None:
        assert block.key is None, f"{block} is already indexed"
        block.key = key
        self._index.setdefault(key, {})[block.block_id] = block

    def _unindex_block(self, block: Block) -> None:
        key = block.key
        assert key is not None
        copies = self._index[key]
        del copies[block.block_id]
        if not copies:
            del self._index[key]
        block.key = None

    def _touch(self, blocks: list[Block]) -> None:
        for b in blocks:
            if b.ref_cnt == 0:
                del self._free_queue[b.block_id]
            b.ref_cnt += 1

    def _get_new_blocks(self, n: int) -> list[Block]:
        assert n <= len(self._free_queue)
        out = []
        for _ in range(n):
            if self.session_aware or self.retention:
                block_id = min(
                    self._free_queue,
                    key=lambda i: -1 if self.blocks[i].key is None else self._tier[i],
                )  # the first of the lowest tier (min keeps the first of equals)
                del self._free_queue[block_id]
            else:
                block_id, _ = self._free_queue.popitem(last=False)
            b = self.blocks[block_id]
            assert b.ref_cnt == 0
            if b.key is not None:  # evict its cached content
                self.eviction_log.append(b.key)
                self.evictions += 1
                self._unindex_block(b)
            b.ref_cnt = 1
            out.append(b)
        return out

    def _cache_full_blocks(self, r: _Request) -> None:
        full = r.tokens // self.block_size
        if self.enable_caching:
            for j in range(r.num_cached, full):
                self._index_block(r.blocks[j], content_key(r.seq, j))
        r.num_cached = max(r.num_cached, full)

    # -- protocol ------------------------------------------------------------------------------------------
    def admit(
        self, rid: int, seq: SeqKey, num_tokens: int, hit_tokens: int, upto_tokens: int, fit_tokens: int = 0
    ) -> bool:
        if rid in self._reqs:
            raise ValueError(f"request {rid} already holds blocks")
        bs = self.block_size
        if not 0 <= hit_tokens < upto_tokens <= num_tokens:
            raise ValueError("need 0 <= hit_tokens < upto_tokens <= num_tokens")
        if not 0 <= fit_tokens <= num_tokens:
            raise ValueError("need 0 <= fit_tokens <= num_tokens")
        if hit_tokens % bs:
            raise ValueError("hit_tokens must be a whole number of blocks")
        hit_blocks = hit_tokens // bs
        if hit_blocks > (num_tokens - 1) // bs:
            raise ValueError("the hit must leave at least one token to compute")
        hit: list[Block] = []
        for i in range(hit_blocks):
            b = self._cached_block(content_key(seq, i))
            if b is None:
                raise ValueError(f"hit block {i} is not cached")
            hit.append(b)
        need_new = blocks_for(upto_tokens, bs) - hit_blocks
        need_fit = blocks_for(fit_tokens, bs) - hit_blocks  # the whole prompt must fit, not just the chunk
        free_hit = sum(1 for b in hit if b.ref_cnt == 0)
        if max(need_new, need_fit) + free_hit > self.num_free_blocks():
            return False
        self._touch(hit)
        r = _Request(seq, num_tokens)
        r.blocks = hit + self._get_new_blocks(need_new)
        r.tokens = upto_tokens
        r.num_cached = hit_blocks
        self._cache_full_blocks(r)
        self._reqs[rid] = r
        return True

    def grow(self, rid: int, upto_tokens: int) -> bool:
        r = self._reqs.get(rid)
        if r is None:
            raise KeyError(f"request {rid} holds no blocks")
        if upto_tokens < r.tokens:
            raise ValueError("an allocation never shrinks")
        need = blocks_for(upto_tokens, self.block_size) - len(r.blocks)
        if need > self.num_free_blocks():
            return False
        if need > 0:
            r.blocks.extend(self._get_new_blocks(need))
        r.tokens = upto_tokens
        self._cache_full_blocks(r)
        return True

    def free(self, rid: int) -> None:
        r = self._reqs.pop(rid, None)
        if r is None:
            raise KeyError(f"request {rid} holds no blocks")
        # Tail first. A block that holds no cached content goes to the front of the free queue (reused first,
        # vLLM's LIFO reuse of uncached blocks), a cached one to the back (LRU); each group keeps the order.
        front: list[Block] = []
        for b in reversed(r.blocks):
            assert b.ref_cnt > 0
            b.ref_cnt -= 1
            if b.ref_cnt == 0:
                assert b.block_id not in self._free_queue
                if b.key is None:
                    front.append(b)
                else:
                    self._free_queue[b.block_id] = None  # append at the MRU end
                    lp = length_tier(r.tokens // self.block_size) if self.retention else 0
                    self._lp[b.block_id] = lp
                    if b.key[0] == "g":
                        self._tier[b.block_id] = GROUP_TIER
                    else:
                        low = self.session_aware and self._low.get(r.seq.session, False)
                        self._tier[b.block_id] = eviction_tier(low, lp)
        for b in reversed(front):
            self._free_queue[b.block_id] = None
            self._free_queue.move_to_end(b.block_id, last=False)

    def set_session_low(self, sid: int, low: bool) -> None:
        if self._low.get(sid, False) == low:
            return
        self._low[sid] = low
        if not self.session_aware:
            return
        for i in list(self._free_queue):
            key = self.blocks[i].key
            if key is not None and key[0] == "s" and key[1] == sid:
                self._tier[i] = eviction_tier(low, self._lp[i])
                self._free_queue.move_to_end(i)

    def reset(self) -> bool:
        if any(b.ref_cnt for b in self.blocks):
            return False
        for b in self.blocks:
            b.key = None
        self._index.clear()
        return True

    # -- self-check ----------------------------------------------------------------------------------------
    def check(self) -> None:
        """Assert the internal invariants (used by the tests after every operation)."""
        refs = [0] * self.num_blocks
        for rid, r in self._reqs.items():
            assert len(r.blocks) == blocks_for(r.tokens, self.block_size)
            assert len({b.block_id for b in r.blocks}) == len(r.blocks)
            for j, b in enumerate(r.blocks):
                refs[b.block_id] += 1
                if self.enable_caching and j < r.tokens // self.block_size:
                    # every full block a request holds is indexed under its own content key
                    assert b.key == content_key(r.seq, j), (rid, j, b)
        for b in self.blocks:
            assert b.ref_cnt == refs[b.block_id], b
            assert (b.ref_cnt == 0) == (b.block_id in self._free_queue), b
            if b.key is not None:
                assert self._index[b.key][b.block_id] is b
        for key, copies in self._index.items():
            assert copies
            for block_id, b in copies.items():
                assert b.block_id == block_id and b.key == key
        if not self.enable_caching:
            assert not self._index
