"""kvgate's pools held to vLLM's own ``KVCacheManager``, call for call (``tests/support/vllm_pool_oracle.py``).

vLLM 0.32's manager, kvgate's fast pool (``RunKVPool``) and its per-block reference (``BlockKVPool``) are driven
with the same operations and must agree after every call: its result (hit tokens, admitted or not), free
blocks, evictions, and the order in which cached blocks were evicted.

* random operation sequences (hypothesis, derandomized so CI runs the same 2,100 sequences every time), from
  ``test_cache_equivalence.py``'s generators: any mix, group contention, preemption mid-prefill with
  recomputed copies, and block sizes 16 (vLLM on GPUs) and 128 (vLLM's CPU build);
* agent scenarios run by kvgate's simulated vLLM engine with the three pools behind it (``TeePool``):
  sessions of a shared prefix plus unique tokens growing turn by turn, chunked prefill, pool pressure and
  preemption, aborts mid-prefill, a reset; and the simulator's own paper-8b workload with a burst, pool
  pressure and a reset, at block sizes 16 and 128;
* vLLM's eviction-order example (``tests/v1/core/test_prefix_caching.py::test_evict``) and the pinned
  examples of ``test_cache_reference.py``, with vLLM's block ids.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

pytest.importorskip("vllm", reason="vLLM (the CPU build, .ci/install-vllm.sh) is the oracle of these tests")
pytestmark = pytest.mark.slow

from hypothesis import HealthCheck, given, settings  # noqa: E402

from kvgate.engine.base import Request  # noqa: E402
from kvgate.engine.blocks import SeqKey  # noqa: E402
from kvgate.engine.cache import RunKVPool  # noqa: E402
from kvgate.engine.costmodel import profile  # noqa: E402
from kvgate.engine.vllm import VllmEngine  # noqa: E402
from support.pool_ops import (  # noqa: E402
    Scenario,
    block_size_scenarios,
    contended_scenarios,
    recompute_scenarios,
    run,
    scenarios,
)
from support.reference_cache import BlockKVPool  # noqa: E402
from support.vllm_pool_oracle import VllmKVPool, group_token, session_token, tokens  # noqa: E402

POOLS = (RunKVPool, VllmKVPool)


def oracle_settings(n: int) -> settings:
    return settings(
        max_examples=n, deadline=None, derandomize=True, database=None, suppress_health_check=[HealthCheck.too_slow]
    )


# -- random operation sequences: 700 + 400 + 500 + 250 + 250 = 2,100 ----------------------------------------
@oracle_settings(700)
@given(scenarios())
def test_random_operations_match_vllm(sc: Scenario) -> None:
    run(sc, POOLS)


@oracle_settings(400)
@given(contended_scenarios())
def test_random_operations_under_group_contention_match_vllm(sc: Scenario) -> None:
    run(sc, POOLS)


@oracle_settings(500)
@given(recompute_scenarios())
def test_preemption_mid_prefill_and_recomputed_copies_match_vllm(sc: Scenario) -> None:
    run(sc, POOLS)


@oracle_settings(250)
@given(block_size_scenarios(16))
def test_block_size_16_matches_vllm(sc: Scenario) -> None:
    run(sc, POOLS)


@oracle_settings(250)
@given(block_size_scenarios(128))
def test_block_size_128_matches_vllm(sc: Scenario) -> None:
    run(sc, POOLS)


# -- agent scenarios through the simulated engine ----------------------------------------------------------
class TeePool:
    """The reference, the fast pool and vLLM's manager behind one ``KVPool``: every call goes to all three,
    which must give the same answer and then agree on free blocks, evictions and the eviction order."""

    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.ref = BlockKVPool(num_blocks, block_size, enable_caching)
        self.fast = RunKVPool(num_blocks, block_size, enable_caching)
        self.vllm = VllmKVPool(num_blocks, block_size, enable_caching)
        self.calls = 0
        self.hit_tokens = 0  # hits of admitted requests
        self.resets = 0

    @property
    def evictions(self) -> int:
        return self.ref.evictions

    def _all(self, name: str, *args: object) -> object:
        self.calls += 1
        want = getattr(self.ref, name)(*args)
        for pool in (self.fast, self.vllm):
            got = getattr(pool, name)(*args)
            assert got == want, f"call {self.calls}: {name}{args}: reference {want}, {type(pool).__name__} {got}"
        if name != "lookup":
            if self.num_blocks <= 1000:  # the reference's own invariants, O(blocks) a call
                self.ref.check()
            free = self.ref.num_free_blocks()
            assert self.fast.num_free_blocks() == free == self.vllm.num_free_blocks(), f"call {self.calls}"
            assert self.fast.evictions == self.ref.evictions == self.vllm.evictions, f"call {self.calls}"
            assert self.vllm.eviction_log == self.ref.eviction_log, f"call {self.calls}: eviction order"
        return want

    def num_free_blocks(self) -> int:
        return self.ref.num_free_blocks()

    def holds(self, rid: int) -> bool:
        return self.ref.holds(rid)

    loaded_tokens = 0
    """One tier: no hit is ever loaded."""

    def load_seconds(self, tokens: int) -> float:
        return 0.0

    def set_session_low(self, sid: int, low: bool) -> None:
        self._all("set_session_low", sid, low)

    def lookup(self, seq: SeqKey, num_tokens: int) -> int:
        return self._all("lookup", seq, num_tokens)  # type: ignore[return-value]

    def admit(self, rid: int, seq: SeqKey, num_tokens: int, hit: int, upto: int, fit: int = 0) -> bool:
        ok = bool(self._all("admit", rid, seq, num_tokens, hit, upto, fit))
        if ok:
            self.hit_tokens += hit
        return ok

    def grow(self, rid: int, upto: int) -> bool:
        return bool(self._all("grow", rid, upto))

    def free(self, rid: int) -> None:
        self._all("free", rid)

    def reset(self) -> bool:
        ok = bool(self._all("reset"))
        self.resets += ok
        return ok


@dataclass
class Agent:
    """A closed-loop agent scenario: ``sessions`` sessions of one group, ``shared`` prefix tokens then
    ``unique`` tokens of their own, ``turns`` turns each of ``out`` output tokens, then ``append`` new tokens
    per turn; the next turn is sent as soon as one finishes."""

    sessions: int
    shared: int
    unique: int
    num_blocks: int
    block_size: int = 16
    turns: int = 6
    out: int = 16
    append: int = 300
    chunk: int = 2048
    abort_every: int = 0
    """Abort a request in the middle of its prefill every ``abort_every`` engine steps (0: never); the
    session sends the same turn again."""
    reset_at: int = 0
    """Engine step of a ``reset_prefix_cache`` with every request preempted (0: none)."""
    preempts: bool = False
    """The scenario is meant to run out of blocks and preempt (asserted, so that it keeps doing so)."""
    done: list[int] = field(default_factory=list)
    aborted: int = 0


def play(a: Agent) -> tuple[TeePool, VllmEngine]:
    bs = a.block_size
    pool = TeePool(a.num_blocks, bs)
    eng = VllmEngine(
        profile("qwen3-8b-mi300x"), a.num_blocks * bs, block_size=bs, pool=pool, max_num_batched_tokens=a.chunk
    )
    group_blocks = a.shared // bs
    prompts = [a.shared + a.unique] * a.sessions
    turn = [0] * a.sessions
    rid = 0
    live: dict[int, tuple[int, Request]] = {}

    def send(i: int, now: float) -> None:
        nonlocal rid
        req = Request(rid, SeqKey(0, group_blocks, i), prompts[i], a.out, now, i)
        live[rid] = (i, req)
        rid += 1
        eng.add(req)

    for i in range(a.sessions):
        send(i, 0.0)
    now = 0.0
    steps = 0
    while eng.has_work():
        res = eng.step(now)
        assert res.duration > 0, "nothing could be scheduled: a prompt larger than the pool?"
        now += res.duration
        steps += 1
        for req in res.finished:
            i, _ = live.pop(req.rid)
            turn[i] += 1
            prompts[i] = req.num_tokens + a.append
            if turn[i] < a.turns:
                send(i, now)
            else:
                a.done.append(i)
        if a.abort_every and steps % a.abort_every == 0:
            prefilling = [r for r in eng.running if r.computed < r.prompt]
            if prefilling:
                victim = prefilling[-1]
                eng.abort(victim)
                a.aborted += 1
                i, _ = live.pop(victim.rid)
                send(i, now)  # the client retries the same turn
        if a.reset_at and steps == a.reset_at:
            eng.flush(preempt=True)
        assert steps < 20_000
    return pool, eng


@pytest.mark.parametrize(
    "agent",
    [
        # the case: 6 sessions, 2,000 shared + 1,000 unique tokens, 1,000 blocks
        Agent(6, 2000, 1000, 1000, turns=12),
        # pool pressure: contexts outgrow the pool, preemptions by recompute
        Agent(10, 1000, 500, 400, turns=5, out=300, append=200, chunk=1024, preempts=True),
        Agent(12, 2000, 500, 500, turns=5, out=200, append=200, chunk=512, preempts=True),
        # aborts in the middle of prefill, small chunks
        Agent(6, 1000, 1500, 600, turns=4, append=400, chunk=512, abort_every=7),
        # a reset of the prefix cache (a restart) in the middle
        Agent(5, 2000, 800, 450, turns=5, reset_at=10),
        # vLLM's CPU block size
        Agent(6, 2048, 1000, 120, block_size=128, turns=5, append=500, chunk=1024, abort_every=11),
    ],
    ids=[
        "issue-6x(2000+1000)-1000blocks",
        "pressure",
        "pressure-small-chunks",
        "abort-mid-prefill",
        "reset",
        "block-128",
    ],
)
def test_agent_scenarios_match_vllm(agent: Agent) -> None:
    pool, eng = play(agent)
    assert sorted(agent.done) == list(range(agent.sessions))
    assert pool.calls > 100
    assert pool.hit_tokens > 0 and pool.ref.evictions > 0  # the scenario exercised the cache and evicted
    if agent.preempts:
        assert eng.stats.preemptions > 0
    assert pool.resets == (1 if agent.reset_at else 0)
    assert (agent.aborted > 0) == (agent.abort_every > 0)


# -- pinned examples with vLLM's block ids ------------------------------------------------------------------
def admit_all(pool: object, rid: int, seq: SeqKey, num_tokens: int) -> int:
    hit = pool.lookup(seq, num_tokens)  # type: ignore[attr-defined]
    assert pool.admit(rid, seq, num_tokens, hit, num_tokens)  # type: ignore[attr-defined]
    return hit


def ids(pool: object, block_ids: list[int]) -> list[int]:
    """kvgate's block ids: vLLM's minus one (vLLM's block 0 is its null block)."""
    return [b - 1 for b in block_ids] if isinstance(pool, VllmKVPool) else block_ids


@pytest.mark.parametrize("cls", [BlockKVPool, VllmKVPool])
def test_vllm_evict_example(cls: type) -> None:
    """vLLM's ``test_evict`` (11 blocks, one the null block), then the eviction it sets up: the same ids and
    eviction order from vLLM's manager and the reference."""
    pool = cls(10, block_size=16)
    s0, s1, s2 = SeqKey(0, 2, 0), SeqKey(1, 0, 1), SeqKey(0, 2, 2)
    assert admit_all(pool, 0, s0, 5 * 16 + 7) == 0
    assert ids(pool, pool.request_block_ids(0)) == [0, 1, 2, 3, 4, 5]
    assert admit_all(pool, 1, s1, 3 * 16) == 0
    assert ids(pool, pool.request_block_ids(1)) == [6, 7, 8]
    pool.free(0)
    pool.free(1)
    assert pool.num_free_blocks() == 10
    assert ids(pool, pool.free_queue_ids()) == [5, 9, 4, 3, 2, 1, 0, 8, 7, 6]
    assert pool.lookup(s2, 2 * 16 + 3) == 2 * 16
    assert pool.admit(2, s2, 2 * 16 + 3, 2 * 16, 2 * 16 + 3)
    assert ids(pool, pool.request_block_ids(2)) == [0, 1, 5]
    assert admit_all(pool, 3, SeqKey(3, 0, 3), 7 * 16) == 0
    assert ids(pool, pool.request_block_ids(3)) == [9, 4, 3, 2, 8, 7, 6]
    assert pool.eviction_log == [("s", 0, 4), ("s", 0, 3), ("s", 0, 2), ("s", 1, 2), ("s", 1, 1), ("s", 1, 0)]
    assert pool.evictions == 6 and pool.num_free_blocks() == 0


@pytest.mark.parametrize("cls", [BlockKVPool, VllmKVPool])
def test_old_copies_stay_hittable_like_vllm(cls: type) -> None:
    """``test_cache_reference.py``'s recompute examples, with vLLM's ids: the old copy of a recomputed block
    stays cached, is hit after a preemption mid-prefill, and a hit touches the oldest copy."""
    bs = 4
    pool = cls(4, block_size=bs)
    seq = SeqKey(0, 0, 0)
    admit_all(pool, 0, seq, 2 * bs)
    pool.free(0)
    assert ids(pool, pool.free_queue_ids()) == [2, 3, 1, 0]
    assert pool.admit(1, seq, 2 * bs, bs, bs + 1)
    assert ids(pool, pool.request_block_ids(1)) == [0, 2]
    pool.free(1)
    assert ids(pool, pool.free_queue_ids()) == [2, 3, 1, 0]
    assert pool.lookup(seq, 3 * bs) == 2 * bs
    assert pool.admit(2, seq, 2 * bs, bs, 2 * bs)
    assert ids(pool, pool.request_block_ids(2)) == [0, 2]
    pool.free(2)
    assert ids(pool, pool.free_queue_ids()) == [3, 1, 2, 0]
    assert pool.admit(3, seq, 3 * bs, 2 * bs, 3 * bs)
    assert ids(pool, pool.request_block_ids(3)) == [0, 1, 3]
    assert ids(pool, pool.free_queue_ids()) == [2]
    assert pool.evictions == 0


# -- hash blocks -------------------------------------------------------------------------------------------
def test_vllm_hashes_one_kv_cache_group_at_its_block_size() -> None:
    """vLLM 0.32 hashes at a finer ``hash_block_size`` only for several KV-cache groups; with the one
    full-attention group of the models kvgate simulates it insists on the block size, so hits are whole
    blocks and kvgate's pools need no finer unit (``kvgate.engine.blocks``). Fails if vLLM starts allowing it."""
    import torch
    from vllm.v1.core.kv_cache_manager import KVCacheManager
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec

    spec = FullAttentionSpec(block_size=128, num_kv_heads=1, head_size=1, dtype=torch.float32)
    config = KVCacheConfig(num_blocks=11, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)])
    with pytest.raises(AssertionError, match="hash_block_size == block_size"):
        KVCacheManager(config, max_model_len=4096, scheduler_block_size=128, hash_block_size=16)
    KVCacheManager(config, max_model_len=4096, scheduler_block_size=128, hash_block_size=128)


@pytest.mark.parametrize("block_size", [16, 128])
def test_simulated_paper_workload_matches_vllm(block_size: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """The simulator's own workload (paper-8b sessions: groups of shared system prompts, growing unique
    contexts) with a burst, on a pool small enough to preempt, and a prefix-cache reset at minute 3; every
    pool call of the run goes to the three pools."""
    from kvgate.engine.factory import EngineConfig
    from kvgate.sim import engines as runner
    from kvgate.sim.config import SimConfig
    from kvgate.sim.runner import simulate

    tees: list[TeePool] = []
    build = runner.build_engine

    def build_tee(cfg: EngineConfig) -> VllmEngine:
        eng = build(cfg)
        eng.pool = TeePool(eng.num_blocks, eng.block_size, cfg.prefix_caching)
        tees.append(eng.pool)
        return eng

    monkeypatch.setattr(runner, "build_engine", build_tee)
    cfg = SimConfig(
        preset="paper-8b", minutes=4, seed=501, bursts=("1.5@1+2",), kv_pool=40_000, flush_at=3.0, block_size=block_size
    )
    summary = simulate(cfg).meta["summary"]
    (pool,) = tees
    assert pool.calls > 500 and pool.hit_tokens > 0 and pool.ref.evictions > 0
    assert pool.resets == 1
    assert summary["preemptions"] > 0


def test_token_ids_are_the_per_position_definitions() -> None:
    """The oracle's token lists (built as ranges) are group_token / session_token position by position."""
    import random

    rng = random.Random(0)
    for _ in range(2000):
        bs = rng.choice([1, 16, 128])
        seq = SeqKey(rng.randrange(5), rng.randrange(6), rng.randrange(100))
        a, b = rng.randrange(0, 1000), rng.randrange(0, 1200)
        g_end = seq.group_blocks * bs
        want = [group_token(seq.group, p) if p < g_end else session_token(seq.session, p) for p in range(a, b)]
        assert tokens(seq, a, b, bs) == want, (seq, a, b, bs)
