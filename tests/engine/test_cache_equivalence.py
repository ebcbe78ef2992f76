"""The fast run-based pool (``RunKVPool``) behaves exactly like the per-block reference (``BlockKVPool``).

Both are driven with the same random operation sequences, generated the way the engine uses a pool (the fast
pool relies on it): every session is bound to one group and has at most one request at a time; its tokens
are append-only, so a new request of a session has at least one token more than its previous request
computed; a request is admitted with the hit ``lookup`` found and a first chunk (all of it, a random part, or
a small token budget), grows by prefill chunks up to its prompt, then decodes, one ``grow`` per token or one
for several (the engine's jump over identical decode steps); it may be freed at any point (finished,
preempted or aborted, also in the middle of its prefill) and a preempted request may come back with the same
tokens (recompute). After every call the pools must agree on the call's result, the free block count, the
eviction count (and, for pools that log it, the order of evictions; the fast pool's ``on_evict`` hook must
report the evicted session blocks in that order), which requests hold blocks, and the hit of the plausible
next requests of every session.

``test_vllm_pool_oracle.py`` runs the same generators with vLLM's own ``KVCacheManager`` as a third pool.
On a failure hypothesis prints the calls of the shrunk example as runnable lines (``pool.admit(...)``), each
with the reference's answer.
"""

from __future__ import annotations

from hypothesis import HealthCheck, given, settings

from kvgate.engine.blocks import SeqKey
from kvgate.engine.cache import RunKVPool
from kvgate.engine.costmodel import profile
from kvgate.engine.offload import OffloadKVPool
from support.pool_ops import (  # noqa: F401
    ADMIT,
    CONTENDED_OP_CODES,
    DECODE,
    FREE,
    LOOKUP,
    NOP,
    OP_CODES,
    PREFILL,
    RECOMPUTE_OP_CODES,
    RESET,
    Driver,
    EvictionLog,
    FastPool,
    Scenario,
    Session,
    block_size_scenarios,
    contended_scenarios,
    op_lists,
    recompute_scenarios,
    run,  # noqa: F401
    scenarios,
)
from support.reference_cache import BlockKVPool


@settings(max_examples=500, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios())
def test_run_pool_matches_block_reference(sc: Scenario) -> None:
    run(sc)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(contended_scenarios())
def test_run_pool_matches_block_reference_under_group_contention(sc: Scenario) -> None:
    run(sc)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recompute_scenarios())
def test_run_pool_matches_block_reference_with_recomputed_copies(sc: Scenario) -> None:
    run(sc)


class OffloadWithoutHost(OffloadKVPool):
    """The offload tier with no host memory: must be exactly the GPU pool."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_caching: bool = True) -> None:
        super().__init__(num_blocks, block_size, 0, profile("qwen3-8b-mi300x"), enable_caching=enable_caching)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(recompute_scenarios())
def test_offload_pool_without_host_is_the_gpu_pool(sc: Scenario) -> None:
    run(sc, (OffloadWithoutHost,))


def test_offload_tier_takes_evicted_session_ranges_through_the_hook() -> None:
    bs = 4
    pool = OffloadKVPool(6, bs, 8, profile("qwen3-8b-mi300x"), policy="on-evict")
    a, b = SeqKey(0, 0, 0), SeqKey(1, 0, 1)
    assert pool.admit(0, a, 4 * bs, 0, 4 * bs)
    pool.free(0)
    assert pool.lookup(a, 5 * bs) == 4 * bs  # all on the GPU
    assert pool.admit(1, b, 6 * bs, 0, 6 * bs)  # 2 empty blocks, then a's 4 cached ones evicted
    assert pool.evictions == 4
    pool.free(1)
    assert RunKVPool.lookup(pool, a, 5 * bs) == 0  # gone from the GPU ...
    assert pool.lookup(a, 5 * bs) == 4 * bs  # ... but in host memory
    assert pool.admit(2, a, 5 * bs, 4 * bs, 5 * bs)
    assert pool.loaded_tokens == 4 * bs and pool.host_hits == 4 * bs
    assert pool.load_seconds(pool.loaded_tokens) > 0


def test_write_through_tier_holds_what_was_computed_and_ages_what_the_gpu_keeps_hitting() -> None:
    """vLLM's connector: every computed block is stored as it is computed; a GPU hit does not refresh the host copy,
    so the head of a session that keeps hitting in the GPU ages out of the host first, and its host tail is then
    past a gap no lookup crosses."""
    bs = 4
    pool = OffloadKVPool(6, bs, 8, profile("qwen3-8b-mi300x"))
    a, b = SeqKey(0, 0, 0), SeqKey(1, 0, 1)
    assert pool.admit(0, a, 2 * bs, 0, 2 * bs)  # a's turn 0: blocks 0-1 stored
    pool.free(0)
    assert pool.admit(1, a, 4 * bs, 2 * bs, 4 * bs)  # a's turn 1 hits blocks 0-1 in the GPU, stores 2-3 only
    pool.free(1)
    assert pool.admit(2, b, 6 * bs, 0, 6 * bs)  # b evicts a from the GPU; its 6 stored blocks push a's 0-1 out
    pool.free(2)
    assert RunKVPool.lookup(pool, a, 5 * bs) == 0
    assert pool.lookup(a, 5 * bs) == 0  # a's blocks 2-3 are in the host, block 0 is not: no hit
    assert pool.lookup(b, 7 * bs) == 6 * bs
    on_evict = OffloadKVPool(6, bs, 8, profile("qwen3-8b-mi300x"), policy="on-evict")
    for rid, (seq, n, hit) in enumerate([(a, 2, 0), (a, 4, 2), (b, 6, 0)]):
        assert on_evict.admit(rid, seq, n * bs, hit * bs, n * bs)
        on_evict.free(rid)
    assert on_evict.lookup(a, 5 * bs) == 4 * bs  # what the GPU evicted, whole


def test_write_through_host_evicts_the_oldest_segment_tail_first() -> None:
    from kvgate.engine.offload import WriteThroughHost

    h = WriteThroughHost(10)
    h.put(1, 0, 4)
    h.put(2, 0, 4)
    h.put(1, 4, 8)  # 12 blocks: session 1's oldest segment loses 2 from its tail
    assert h.used == 10 and h.extent(1, 0) == 2 and h.extent(1, 4) == 8 and h.extent(2, 0) == 4
    h.put(1, 0, 2)  # touched (a load): now the newest
    h.put(3, 0, 2)  # 12 again: session 2's segment is the oldest now
    assert h.extent(2, 0) == 2 and h.extent(1, 0) == 2
    h.forget(1, 1)
    assert h.extent(1, 0) == 1 and h.extent(1, 4) == 4


def test_forget_hides_a_diverged_tail_but_keeps_it_cached() -> None:
    """``RunKVPool.forget``: the session's blocks past the point its content diverged stay in the free queue
    as cached blocks (evicted, and counted, when reused, as vLLM does with blocks whose hashes no request
    matches any more) but are never hit again."""
    bs = 4
    pool = RunKVPool(8, bs)
    seq = SeqKey(0, 1, 0)
    assert pool.admit(0, seq, 6 * bs, 0, 6 * bs)
    pool.free(0)
    assert pool.lookup(seq, 7 * bs) == 6 * bs
    pool.forget(seq, 3 * bs + 2)  # content diverges inside block 3: blocks 3..5 are stale
    assert pool.lookup(seq, 7 * bs) == 3 * bs
    assert pool.num_free_blocks() == 8
    assert pool.admit(1, seq, 7 * bs, 3 * bs, 7 * bs)  # 2 empty blocks, then the stale ones 5, 4 (evicted)
    assert pool.evictions == 2
    pool.free(1)
    assert pool.lookup(seq, 8 * bs) == 7 * bs
    # the stale block 3 goes next (it was released before the session's new copy), then the session's last block
    assert pool.admit(2, SeqKey(1, 0, 1), 2 * bs, 0, 2 * bs)
    assert pool.evictions == 4
    assert pool.lookup(seq, 8 * bs) == 6 * bs


def test_a_group_prefix_held_whole_by_several_requests_is_released_as_one_by_one_holders_would() -> None:
    """Requests hitting a whole group prefix hold it together (O(1) per request); the last one out must free its
    blocks in the order, and at the time, that per-block references would: tail first, after the last holder,
    whether the others held the whole prefix or a part of it."""
    bs, gb = 4, 3
    ref = BlockKVPool(12, block_size=bs)
    fast = RunKVPool(12, block_size=bs)
    seqs = {s: SeqKey(0, gb, s) for s in range(4)}
    obs = EvictionLog({s: gb for s in seqs} | {9: 0})
    fast.observe(obs)

    def both(name: str, *args: object) -> object:
        want = getattr(ref, name)(*args)
        assert getattr(fast, name)(*args) == want, (name, args)
        assert fast.num_free_blocks() == ref.num_free_blocks()
        return want

    assert both("admit", 0, seqs[0], 4 * bs, 0, 4 * bs)  # caches the 3 group blocks and one of its own
    both("free", 0)
    for rid in (1, 2):  # two whole-prefix hits: held together
        assert both("lookup", seqs[rid], 4 * bs) == gb * bs
        assert both("admit", rid, seqs[rid], 4 * bs, gb * bs, 4 * bs)
    # a partial holder beside them: session 3's request stops inside the prefix (a preempted prefill)
    assert both("admit", 3, seqs[3], 4 * bs, 2 * bs, 2 * bs + 1)
    both("free", 1)
    both("free", 3)  # its blocks are still held by request 2
    both("free", 2)  # the last holder: the prefix goes back to the free queue, tail first
    assert both("admit", 4, SeqKey(1, 0, 9), 12 * bs, 0, 12 * bs)  # every block, evicting every cached one
    assert fast.evictions == ref.evictions > gb
    assert obs.log == ref.eviction_log
    assert [k for k in obs.log if k[0] == "g"] == [("g", 0, 2), ("g", 0, 1), ("g", 0, 0)]
