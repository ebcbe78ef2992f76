"""Pinned behaviour of the per-block reference pool (``tests/support/reference_cache.py``) on tiny pools.

The reference is what ``test_cache_equivalence.py`` holds the fast pool to, so its own behaviour is pinned
here against vLLM v1's: eviction order, the chained and capped lookup, touch at admission, reset.
"""

from __future__ import annotations

import pytest

from kvgate.engine.blocks import SeqKey
from support.reference_cache import BlockKVPool, content_key


def admit_all(pool: BlockKVPool, rid: int, seq: SeqKey, num_tokens: int) -> int:
    """Admit a request with whatever the cache has, allocating its whole prompt; return the hit."""
    hit = pool.lookup(seq, num_tokens)
    assert pool.admit(rid, seq, num_tokens, hit, num_tokens)
    pool.check()
    return hit


def test_content_keys() -> None:
    seq = SeqKey(group=7, group_blocks=2, session=3)
    assert [content_key(seq, i) for i in range(4)] == [("g", 7, 0), ("g", 7, 1), ("s", 3, 2), ("s", 3, 3)]
    assert content_key(SeqKey(7, 0, 3), 0) == ("s", 3, 0)


def test_evict_like_vllm() -> None:
    """vLLM's ``tests/v1/core/test_prefix_caching.py::test_evict``, then the eviction it sets up.

    vLLM's pool there has 11 blocks, one of which is the reserved null block: 10 usable blocks, ids 1..10.
    kvgate does not model the null block, so the same pool is ``num_blocks=10`` with ids 0..9 (vLLM id - 1).
    """
    pool = BlockKVPool(10, block_size=16)
    # req0 and req2 share their first two blocks (vLLM: the same token ids), req1 shares nothing.
    s0 = SeqKey(group=0, group_blocks=2, session=0)
    s1 = SeqKey(group=1, group_blocks=0, session=1)
    s2 = SeqKey(group=0, group_blocks=2, session=2)

    assert admit_all(pool, 0, s0, 5 * 16 + 7) == 0
    assert pool.request_block_ids(0) == [0, 1, 2, 3, 4, 5]  # 5 full + 1 partial
    assert admit_all(pool, 1, s1, 3 * 16) == 0
    assert pool.request_block_ids(1) == [6, 7, 8]  # 3 full blocks
    assert pool.num_free_blocks() == 1

    pool.free(0)
    pool.free(1)
    pool.check()
    assert pool.num_free_blocks() == 10
    # vLLM 0.32: [6, 10, 5, 4, 3, 2, 1, 9, 8, 7]: req0's partial block holds no cached content, so it goes to
    # the front (reused first); the cached blocks go to the back, each request's tail first.
    assert pool.free_queue_ids() == [5, 9, 4, 3, 2, 1, 0, 8, 7, 6]

    # Touch the first 2 blocks.
    assert pool.lookup(s2, 2 * 16 + 3) == 2 * 16
    assert pool.admit(2, s2, 2 * 16 + 3, 2 * 16, 2 * 16 + 3)
    pool.check()
    assert pool.request_block_ids(2) == [0, 1, 5]  # vLLM: [1, 2] hit + [6], the uncached block in front
    assert pool.num_free_blocks() == 7
    assert pool.evictions == 0

    # Now evict everything evictable: the empty block 9 first (no eviction), then req0's cached tail from its
    # last block down, then req1's; the shared blocks are held by req2, not evicted.
    s3 = SeqKey(group=3, group_blocks=0, session=3)
    assert admit_all(pool, 3, s3, 7 * 16) == 0
    assert pool.request_block_ids(3) == [9, 4, 3, 2, 8, 7, 6]
    assert pool.eviction_log == [("s", 0, 4), ("s", 0, 3), ("s", 0, 2), ("s", 1, 2), ("s", 1, 1), ("s", 1, 0)]
    assert pool.evictions == 6
    assert pool.num_free_blocks() == 0
    assert {("g", 0, 0), ("g", 0, 1)} <= pool.cached_keys()
    assert pool.lookup(s0, 5 * 16 + 8) == 2 * 16


def test_group_blocks_released_last() -> None:
    """A request frees tail first, so its shared group blocks come last; while another request still
    references them they are not released at all."""
    bs = 4
    pool = BlockKVPool(11, block_size=bs)
    a = SeqKey(group=0, group_blocks=2, session=1)
    b = SeqKey(group=0, group_blocks=2, session=2)
    assert admit_all(pool, 1, a, 17) == 0  # g0 g1 s2 s3 + partial
    assert pool.request_block_ids(1) == [0, 1, 2, 3, 4]
    assert admit_all(pool, 2, b, 14) == 2 * bs  # hits g0 g1, then s2 + partial
    assert pool.request_block_ids(2) == [0, 1, 5, 6]

    pool.free(1)  # g0, g1 still referenced by request 2; the partial block 4 goes to the front
    pool.check()
    assert pool.free_queue_ids() == [4, 7, 8, 9, 10, 3, 2]
    pool.free(2)
    pool.check()
    assert pool.free_queue_ids() == [6, 4, 7, 8, 9, 10, 3, 2, 5, 1, 0]
    assert pool.lookup(SeqKey(0, 2, 9), 100) == 2 * bs

    c = SeqKey(group=1, group_blocks=0, session=3)
    assert admit_all(pool, 3, c, 11 * bs) == 0
    assert pool.eviction_log == [("s", 1, 3), ("s", 1, 2), ("s", 2, 2), ("g", 0, 1), ("g", 0, 0)]
    assert pool.cached_keys() == {("s", 3, i) for i in range(11)}


def test_hit_capped_at_num_tokens_minus_one() -> None:
    bs = 4
    pool = BlockKVPool(8, block_size=bs)
    seq = SeqKey(0, 0, 0)
    admit_all(pool, 0, seq, 8)
    pool.free(0)
    assert pool.cached_keys() == {("s", 0, 0), ("s", 0, 1)}
    assert pool.lookup(seq, 8) == 4  # the last token is always computed: at most (8 - 1) // 4 blocks
    assert pool.lookup(seq, 9) == 8
    assert pool.lookup(seq, 100) == 8
    assert pool.lookup(seq, 4) == 0
    assert pool.lookup(seq, 5) == 4
    with pytest.raises(ValueError):
        pool.admit(1, seq, 8, 8, 8)


def test_lookup_stops_at_first_missing_block() -> None:
    bs = 4
    pool = BlockKVPool(4, block_size=bs)
    seq = SeqKey(group=0, group_blocks=1, session=1)
    admit_all(pool, 1, seq, 12)  # g0, s1, s2
    pool.free(1)
    assert pool.cached_keys() == {("g", 0, 0), ("s", 1, 1), ("s", 1, 2)}
    assert pool.lookup(seq, 100) == 12
    # Same session blocks behind another group's block 0, which is not cached: nothing is hit.
    assert pool.lookup(SeqKey(group=1, group_blocks=1, session=1), 100) == 0
    # Evicting from the front eats the tail first: the chain shrinks from its end.
    other = SeqKey(group=2, group_blocks=0, session=2)
    admit_all(pool, 2, other, 2 * bs)  # the empty block, then s2 of session 1
    assert pool.eviction_log == [("s", 1, 2)]
    assert pool.lookup(seq, 100) == 8
    pool.grow(2, 3 * bs)
    assert pool.eviction_log == [("s", 1, 2), ("s", 1, 1)]
    assert pool.lookup(seq, 100) == 4
    pool.check()


def test_lookup_is_pure_touch_only_at_admit() -> None:
    """Lookups change nothing; admission takes the hit blocks out of the free queue, so allocation evicts
    something else (vLLM's ``test_computed_blocks_not_evicted``)."""
    bs = 4
    pool = BlockKVPool(3, block_size=bs)
    s0, s1 = SeqKey(0, 0, 0), SeqKey(1, 0, 1)
    admit_all(pool, 0, s0, bs)
    admit_all(pool, 1, s1, bs)
    pool.free(0)
    pool.free(1)
    queue = pool.free_queue_ids()
    assert queue == [2, 0, 1]
    for _ in range(3):
        assert pool.lookup(s0, 2 * bs) == bs
    assert pool.free_queue_ids() == queue
    assert pool.num_free_blocks() == 3

    # A request extending s0 hits its block 0 (the least recently used one); the allocation then takes the
    # empty block and s1's block, not the hit.
    assert pool.admit(2, s0, 3 * bs, bs, 3 * bs)
    pool.check()
    assert pool.request_block_ids(2) == [0, 2, 1]
    assert pool.eviction_log == [("s", 1, 0)]


def test_admit_counts_hit_blocks_it_takes_from_the_free_queue() -> None:
    bs = 4
    pool = BlockKVPool(4, block_size=bs)
    seq = SeqKey(0, 0, 0)
    admit_all(pool, 0, seq, 3 * bs)
    pool.free(0)
    before = (pool.free_queue_ids(), pool.cached_keys(), pool.evictions)
    assert pool.lookup(seq, 5 * bs) == 3 * bs
    # 2 new blocks + 3 evictable hit blocks > 4 free blocks: refused, nothing changed.
    assert not pool.admit(1, seq, 5 * bs, 3 * bs, 5 * bs)
    assert not pool.holds(1)
    assert (pool.free_queue_ids(), pool.cached_keys(), pool.evictions) == before
    pool.check()
    # 1 new block + 3 hit blocks fit.
    assert pool.admit(1, seq, 5 * bs, 3 * bs, 4 * bs)
    assert pool.num_free_blocks() == 0
    assert not pool.grow(1, 5 * bs)
    assert pool.request_block_ids(1) == [0, 1, 2, 3]
    pool.check()


def test_admit_fit_tokens_gate() -> None:
    """With ``fit_tokens`` (vLLM's ``scheduler_reserve_full_isl``) the whole prompt less the hit must fit in
    the free blocks, not just the first chunk; the chunk alone is still what gets allocated."""
    bs = 4
    pool = BlockKVPool(4, block_size=bs)
    seq = SeqKey(0, 0, 0)
    assert not pool.admit(0, seq, 5 * bs, 0, bs, 5 * bs)  # 5 blocks for the prompt > 4 free
    assert not pool.holds(0) and pool.num_free_blocks() == 4
    assert pool.admit(0, seq, 4 * bs, 0, bs, 4 * bs)  # 4 blocks fit; only the first chunk's block is taken
    assert pool.request_block_ids(0) == [0]
    assert pool.num_free_blocks() == 3
    pool.free(0)
    # The hit is subtracted: block 0 is cached, so a 5-block prompt needs 4 more blocks, plus the hit block
    # it takes out of the free queue.
    assert pool.lookup(seq, 5 * bs) == bs
    assert not pool.admit(1, seq, 5 * bs, bs, 2 * bs, 5 * bs)
    assert pool.admit(1, seq, 5 * bs, bs, 2 * bs)  # without the gate the chunk fits
    pool.check()


def test_grow_caches_blocks_it_fills() -> None:
    bs = 4
    pool = BlockKVPool(4, block_size=bs)
    seq = SeqKey(0, 0, 0)
    assert pool.admit(0, seq, 6, 0, 6)
    assert pool.cached_keys() == {("s", 0, 0)}  # block 1 is partial
    assert pool.grow(0, 7)
    assert pool.cached_keys() == {("s", 0, 0)}
    assert pool.grow(0, 8)  # no new block, but block 1 is now full
    assert pool.cached_keys() == {("s", 0, 0), ("s", 0, 1)}
    assert pool.request_block_ids(0) == [0, 1]
    assert pool.grow(0, 9)
    assert pool.request_block_ids(0) == [0, 1, 2]
    assert pool.grow(0, 16)  # a decode run filling two more blocks at once
    assert pool.cached_keys() == {("s", 0, i) for i in range(4)}
    assert pool.num_free_blocks() == 0
    assert not pool.grow(0, 17)
    pool.check()
    pool.free(0)
    assert pool.lookup(seq, 17) == 16


def test_recomputed_blocks_keep_their_old_copy() -> None:
    """A request that recomputes a cached block of its own session (here the last prompt block, beyond the
    capped hit) makes a second copy; like vLLM the old one stays indexed until it is evicted."""
    bs = 4
    pool = BlockKVPool(2, block_size=bs)
    seq = SeqKey(0, 0, 0)
    admit_all(pool, 0, seq, 2 * bs)
    pool.free(0)
    assert pool.free_queue_ids() == [1, 0]
    # Recompute after preemption: the same 8 tokens. The hit is capped at 1 block; block 1 is recomputed.
    assert pool.lookup(seq, 2 * bs) == bs
    assert pool.admit(1, seq, 2 * bs, bs, 2 * bs)
    pool.check()
    assert pool.request_block_ids(1) == [0, 1]
    assert pool.eviction_log == [("s", 0, 1)]  # the only free block held the old copy
    assert pool.cached_keys() == {("s", 0, 0), ("s", 0, 1)}


def test_old_copy_hit_after_preemption_mid_prefill() -> None:
    """The old copy of a block being recomputed can still be hit when the request is preempted (or aborted)
    before it refills that block: the case kvgate's pool once simplified away."""
    bs = 4
    pool = BlockKVPool(4, block_size=bs)
    seq = SeqKey(0, 0, 0)
    admit_all(pool, 0, seq, 2 * bs)
    pool.free(0)
    assert pool.free_queue_ids() == [2, 3, 1, 0]
    assert pool.admit(1, seq, 2 * bs, bs, bs + 1)  # chunked: only part of the recomputed block so far
    pool.check()
    assert pool.request_block_ids(1) == [0, 2]
    assert pool.cached_keys() == {("s", 0, 0), ("s", 0, 1)}  # block 1 is still cached, in the free queue
    assert pool.free_queue_ids() == [3, 1]
    pool.free(1)  # preempted before it filled block 2
    pool.check()
    assert pool.free_queue_ids() == [2, 3, 1, 0]
    assert pool.lookup(seq, 3 * bs) == 2 * bs  # the old copy of block 1 is hit
    assert pool.admit(2, seq, 3 * bs, 2 * bs, 3 * bs)
    assert pool.request_block_ids(2) == [0, 1, 2]
    assert pool.evictions == 0


def test_oldest_copy_is_touched() -> None:
    """Two copies of a session block: a hit touches the older one, the newer one stays free and cached."""
    bs = 4
    pool = BlockKVPool(4, block_size=bs)
    seq = SeqKey(0, 0, 0)
    admit_all(pool, 0, seq, 2 * bs)
    pool.free(0)
    assert pool.admit(1, seq, 2 * bs, bs, 2 * bs)  # recompute block 1 into block 2
    assert pool.request_block_ids(1) == [0, 2]
    pool.free(1)
    pool.check()
    assert pool.free_queue_ids() == [3, 1, 2, 0]
    assert pool.admit(2, seq, 3 * bs, 2 * bs, 3 * bs)
    assert pool.request_block_ids(2) == [0, 1, 3]  # block 1 is the older copy of block index 1
    assert pool.free_queue_ids() == [2]
    assert pool.cached_keys() == {("s", 0, 0), ("s", 0, 1), ("s", 0, 2)}


def test_group_copies_oldest_is_hit() -> None:
    """Concurrent partial prefills of one group compute the same group block twice; like vLLM both copies
    stay indexed and a hit takes the oldest."""
    bs = 4
    pool = BlockKVPool(12, block_size=bs)
    a = SeqKey(group=0, group_blocks=2, session=1)
    b = SeqKey(group=0, group_blocks=2, session=2)
    assert pool.admit(1, a, 12, 0, bs)  # a computes g0 only, so far
    assert pool.lookup(b, 12) == bs
    assert pool.admit(2, b, 12, bs, 12)  # b hits g0, computes g1 (first copy) and s2
    assert pool.grow(1, 12)  # a computes g1 again (second copy)
    pool.check()
    assert pool.request_block_ids(2) == [0, 1, 2]  # g0 (hit), g1 (first copy), s2
    assert pool.request_block_ids(1) == [0, 3, 4]  # g0, g1 (second copy), s2
    pool.free(2)  # releases s2 and the first g1 copy; g0 is still referenced by a
    pool.check()
    assert pool.free_queue_ids()[-2:] == [2, 1]
    free_before = pool.num_free_blocks()
    c = SeqKey(group=0, group_blocks=2, session=3)
    assert pool.lookup(c, 9) == 2 * bs
    assert pool.admit(3, c, 9, 2 * bs, 9)
    pool.check()
    assert pool.request_block_ids(3)[:2] == [0, 1]  # the oldest copy of g1, although it was free
    assert pool.num_free_blocks() == free_before - 2  # it left the free queue, plus one new block


def test_reset_refused_while_blocks_are_held() -> None:
    bs = 4
    pool = BlockKVPool(6, block_size=bs)
    seq = SeqKey(0, 1, 0)
    admit_all(pool, 0, seq, 3 * bs)
    admit_all(pool, 1, SeqKey(1, 0, 1), bs + 1)
    pool.free(1)
    keys = pool.cached_keys()
    assert not pool.reset()
    assert pool.cached_keys() == keys
    pool.free(0)
    queue = pool.free_queue_ids()
    assert pool.reset()
    pool.check()
    assert pool.cached_keys() == set()
    assert pool.free_queue_ids() == queue  # order unchanged, blocks now empty
    assert pool.num_free_blocks() == 6
    assert pool.lookup(seq, 100) == 0
    admit_all(pool, 2, SeqKey(2, 0, 2), 6 * bs)
    assert pool.evictions == 0
    assert pool.reset() is False


def test_caching_disabled() -> None:
    bs = 4
    pool = BlockKVPool(4, block_size=bs, enable_caching=False)
    seq = SeqKey(0, 1, 0)
    admit_all(pool, 0, seq, 3 * bs)
    pool.free(0)
    assert pool.cached_keys() == set()
    assert pool.lookup(seq, 100) == 0
    admit_all(pool, 1, seq, 4 * bs)
    assert pool.evictions == 0
    with pytest.raises(ValueError):
        pool.admit(2, seq, 8, 4, 8)  # nothing is cached


def test_misuse_raises() -> None:
    bs = 4
    pool = BlockKVPool(8, block_size=bs)
    seq = SeqKey(0, 0, 0)
    admit_all(pool, 0, seq, 2 * bs)
    with pytest.raises(ValueError):
        pool.admit(0, SeqKey(1, 0, 1), 4, 0, 4)  # rid already holds blocks
    with pytest.raises(KeyError):
        pool.grow(9, 4)
    with pytest.raises(KeyError):
        pool.free(9)
    with pytest.raises(ValueError):
        pool.grow(0, bs)  # shrinking
    with pytest.raises(ValueError):
        pool.admit(1, SeqKey(1, 0, 1), 4, 0, 5)  # upto > num_tokens
    with pytest.raises(ValueError):
        pool.admit(1, SeqKey(1, 0, 1), 4, 0, 0)  # upto must exceed the hit
    with pytest.raises(ValueError):
        pool.admit(1, SeqKey(1, 0, 1), 12, 4, 12)  # block 0 of session 1 is not cached
    with pytest.raises(ValueError):
        pool.admit(1, seq, 12, 2, 12)  # hit not block-aligned
    with pytest.raises(ValueError):
        pool.admit(1, SeqKey(1, 0, 1), 4, 0, 4, 5)  # fit_tokens > num_tokens
    pool.free(0)
    with pytest.raises(KeyError):
        pool.free(0)
    pool.check()
