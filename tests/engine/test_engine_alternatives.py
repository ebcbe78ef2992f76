"""The engine-side alternatives of the simulated vLLM (all off by default): session-aware eviction, retention by
context length, TTL pinning of a finished turn's blocks, and admission ordered by cached fraction. Each test
shows the alternative changes what it says at the pool or engine level (and that vLLM's default does not);
the fast pool's tiers are held to the per-block reference under random operation sequences."""

from __future__ import annotations

import functools

from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from kvgate.engine.base import Request
from kvgate.engine.blocks import SeqKey
from kvgate.engine.cache import RunKVPool
from kvgate.engine.costmodel import profile
from kvgate.engine.vllm import VllmEngine
from kvgate.sim.config import SimConfig
from kvgate.sim.runner import simulate
from support.pool_ops import LOOKUP, Driver, Scenario, scenarios
from support.reference_cache import BlockKVPool

BS = 4


def seq(session: int, group_blocks: int = 0) -> SeqKey:
    return SeqKey(0, group_blocks, session)


def fill(pool: RunKVPool | BlockKVPool, rid: int, s: SeqKey, tokens: int) -> None:
    assert pool.admit(rid, s, tokens, 0, tokens)
    pool.free(rid)


# -- the tiers against the reference --------------------------------------------------------------------------
class TieredDriver(Driver):
    """The equivalence driver with both pools in an eviction order; LOOKUP ops with an odd ``z`` change a
    session's status instead (admitted / parked or ended)."""

    def __init__(self, sc: Scenario, session_aware: bool, retention: bool) -> None:
        kw = {"session_aware": session_aware, "retention": retention}
        super().__init__(sc, others=(functools.partial(RunKVPool, **kw),))  # type: ignore[arg-type]
        self.ref = BlockKVPool(sc.num_blocks, block_size=sc.block_size, enable_caching=sc.enable_caching, **kw)
        note(f"tiers: {kw}")

    def step(self, op: int, x: int, y: int, z: int) -> None:
        if op == LOOKUP and z % 2:
            s = self.sessions[x % len(self.sessions)]
            self.call("set_session_low", s.seq.session, bool(y % 2))
            self.check()
            return
        super().step(op, x, y, z)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(scenarios(), st.sampled_from([(True, False), (False, True), (True, True)]))
def test_tiered_run_pool_matches_tiered_block_reference(sc: Scenario, tiers: tuple[bool, bool]) -> None:
    d = TieredDriver(sc, *tiers)
    d.check()
    for op in sc.ops:
        d.step(*op)


# -- session-aware eviction -----------------------------------------------------------------------------------
def evicted_first(pool: RunKVPool | BlockKVPool, low_session: int | None) -> list[tuple[str, int, int]]:
    """Sessions 1 (freed first, LRU) and 2 (freed last) cache 3 blocks each in a 6-block pool; session 2 may be
    marked parked; a new session then needs 3 blocks. Returns what was evicted (reference pool: its log)."""
    fill(pool, 1, seq(1), 3 * BS)
    fill(pool, 2, seq(2), 3 * BS)
    if low_session is not None:
        pool.set_session_low(low_session, True)
    assert pool.admit(3, seq(3), 3 * BS, 0, 3 * BS)
    assert isinstance(pool, BlockKVPool)
    return pool.eviction_log


def test_session_aware_eviction_takes_a_parked_sessions_blocks_before_an_admitted_ones() -> None:
    vanilla = evicted_first(BlockKVPool(6, BS), low_session=2)
    assert {k[1] for k in vanilla} == {1}  # vLLM: LRU, whatever the status
    aware = evicted_first(BlockKVPool(6, BS, session_aware=True), low_session=2)
    assert {k[1] for k in aware} == {2}
    fast = RunKVPool(6, BS, session_aware=True)
    fill(fast, 1, seq(1), 3 * BS)
    fill(fast, 2, seq(2), 3 * BS)
    fast.set_session_low(2, True)
    assert fast.admit(3, seq(3), 3 * BS, 0, 3 * BS)
    assert fast.lookup(seq(1), 4 * BS) == 3 * BS and fast.lookup(seq(2), 4 * BS) == 0
    # back to admitted: its blocks (re-cached) are ordinary LRU again
    fast.set_session_low(2, False)
    fast.free(3)
    assert fast.admit(4, seq(4), 3 * BS, 0, 3 * BS)
    assert fast.lookup(seq(1), 4 * BS) == 0 and fast.lookup(seq(3), 4 * BS) == 3 * BS


# -- retention ------------------------------------------------------------------------------------------------
def test_retention_evicts_the_shorter_context_first() -> None:
    def run(**kw: bool) -> tuple[int, int]:
        pool = RunKVPool(12, BS, **kw)
        fill(pool, 1, seq(1), 8 * BS)  # long context, least recently used
        fill(pool, 2, seq(2), 2 * BS)  # short context, most recently used
        assert pool.admit(3, seq(3), 4 * BS, 0, 4 * BS)  # 2 empty blocks, then 2 evicted
        return pool.lookup(seq(1), 9 * BS) // BS, pool.lookup(seq(2), 3 * BS) // BS

    assert run() == (6, 2)  # vLLM: the long one's last blocks go first (LRU)
    assert run(retention=True) == (8, 0)


# -- TTL pinning ----------------------------------------------------------------------------------------------
def engine(**kw: object) -> VllmEngine:
    return VllmEngine(profile("qwen3-8b-mi300x"), 64 * 16, block_size=16, **kw)  # type: ignore[arg-type]


def run_until_done(eng: VllmEngine, now: float) -> float:
    for _ in range(100_000):
        if not eng.has_work():
            return now
        dt = eng.step(now).duration
        now += dt if dt > 0 else 0.01  # nothing could run: time passes (pins expire)
    raise AssertionError("the engine did not finish its work")


def test_pinned_blocks_survive_pressure_during_the_tool_call_and_the_next_turn_takes_them_over() -> None:
    def scenario(ttl: float) -> tuple[int, int, int]:
        eng = engine(pin_ttl_s=ttl)
        a = Request(1, seq(1), 40 * 16, 4, 0.0, None)
        eng.add(a)
        now = run_until_done(eng, 0.0)
        pinned_free = eng.pool.num_free_blocks()  # type: ignore[attr-defined]
        # during A's tool call two other sessions need the pool, one after the other (B ends at once)
        b = Request(2, seq(2), 20 * 16, 4, now, None)
        eng.add(b)
        now = run_until_done(eng, now + 0.1)
        eng.session_status(2, "ended")
        c = Request(4, seq(3), 20 * 16, 4, now, None)
        eng.add(c)
        now = run_until_done(eng, now + 0.1)
        nxt = Request(3, seq(1), a.num_tokens + 16, 4, now, None)
        eng.add(nxt)
        run_until_done(eng, now + 0.1)
        return pinned_free, b.cached, nxt.cached

    free_plain, _, hit_plain = scenario(0.0)
    free_pinned, _, hit_pinned = scenario(60.0)
    assert free_plain == 64 and free_pinned < 64 - 39  # pinned blocks are not free
    assert hit_plain < 40 * 16  # vLLM: B evicted part of A's prefix
    assert hit_pinned >= 40 * 16  # pinned: A's next turn finds its whole context


def test_pins_expire_lazily_and_end_with_the_session() -> None:
    eng = engine(pin_ttl_s=5.0)
    eng.add(Request(1, seq(1), 10 * 16, 2, 0.0, None))
    eng.add(Request(2, seq(2), 10 * 16, 2, 0.0, None))
    now = run_until_done(eng, 0.0)
    assert sorted(eng.pinned_sessions()) == [1, 2]
    eng.session_status(2, "ended")
    assert eng.pinned_sessions() == [1]
    eng.add(Request(3, seq(3), 16, 1, now, None))
    eng.step(now + 1.0)
    assert sorted(eng.pinned_sessions()) == [1, 3]  # 1 not expired yet; 3 just finished
    eng.session_status(3, "ended")
    eng.add(Request(4, seq(4), 16, 3, now + 6.0, None))
    eng.step(now + 6.0)  # expiries are seen by the first step past them
    assert eng.pinned_sessions() == []
    assert not any(eng.pool.holds(rid) for rid in (1, 2, 3))  # type: ignore[attr-defined]


# -- admission by cached fraction -----------------------------------------------------------------------------
def test_prefix_first_admits_the_request_with_a_resident_prefix_first() -> None:
    def first_admitted(k: int) -> int:
        eng = VllmEngine(profile("qwen3-8b-mi300x"), 64 * 16, block_size=16, max_num_batched_tokens=256, prefix_first=k)
        eng.add(Request(1, seq(1), 20 * 16, 1, 0.0, None))
        now = run_until_done(eng, 0.0)
        eng.add(Request(2, seq(2), 20 * 16, 1, now, None))  # cold, first in line
        eng.add(Request(3, seq(1), 21 * 16, 1, now, None))  # warm: 20 blocks resident
        res = eng.step(now)
        return res.scheduled[0][0].rid

    assert first_admitted(0) == 2  # vLLM: FCFS
    assert first_admitted(8) == 3


# -- through the simulator ------------------------------------------------------------------------------------
def test_each_alternative_changes_a_pressured_run() -> None:
    # a 2x burst: with the fitted mixed step a 1.5x one no longer pressures the pool enough for evict_sessions
    base = SimConfig(lam=0.035, minutes=25, seed=501, bursts=("2@5+5",))
    ref = simulate(base).tables["turns"]
    for over in ({"evict_sessions": True}, {"retention": True}, {"pin_ttl_s": 30.0}, {"prefix_first": 16}):
        got = simulate(base.with_(**over)).tables["turns"]
        assert not got.equals(ref), f"{over} changed no turn"


def test_the_pages_sign_test_needs_enough_discordant_seeds() -> None:
    from kvgate.analysis.phase import sign_test

    assert sign_test(0, 0) == 1.0
    assert sign_test(3, 3) == 1.0
    assert sign_test(0, 5) > 0.05  # 5 of 5 is not enough at 0.05
    assert abs(sign_test(6, 0) - 1 / 32) < 1e-12
    assert sign_test(1, 9) == sign_test(9, 1) < 0.05


def test_the_page_runs_every_alternative_on_vanillas_seeds_and_cells() -> None:
    from kvgate.analysis.phase import ALTERNATIVES
    from kvgate.experiments.phase_map import plan_alternatives

    runs, seeds = plan_alternatives(quick=True)
    cells: dict[str, set[tuple[str, float, float, int]]] = {}
    for _, cell, cfg in runs:
        cells.setdefault(cell["alt"], set()).add((cell["control"], cell["lam"], cell["burst"], cell["seed"]))
        for field, value in ALTERNATIVES[cell["alt"]].items():
            assert getattr(cfg, field) == value
        assert cfg.control == cell["control"] and cfg.seed == cell["seed"] and cfg.lam == cell["lam"]
    assert set(cells) == set(ALTERNATIVES)
    assert all(c == cells["vanilla"] for c in cells.values())
    assert {c[3] for c in cells["vanilla"]} == set(seeds)
    assert ("budgeter", 0.035, 1.5, seeds[0]) in cells["vanilla"]
