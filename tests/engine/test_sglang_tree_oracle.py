"""kvgate's radix cache held to SGLang's own, call for call (``tests/support/sglang_tree_oracle.py``).

SGLang 0.5.23's ``UnifiedRadixCache`` — with its Rust tree core (the default) and its Python one — runs in
SGLang's venv behind a pipe; kvgate's :class:`RadixCache` and it get the same calls, the ones SGLang's scheduler
makes, and must agree after every call on the result (the hit; whether tokens fit), the free, evictable and
protected tokens and the content evicted, in order:

* random operation sequences (hypothesis, derandomized so CI plays the same ones every time; 2,000 on the Rust
  tree core, SGLang's default, and 1,000 on the Python one): matches, refused admissions, chunked prefill,
  decode, finishes, aborts at any point, retraction and re-prefill, flushes, retries and shorter prompts, over
  group prefixes and pools under pressure;
* agent scenarios run by kvgate's SGLang engine with the tee behind it: sessions of a shared system prompt
  growing turn by turn, forks of one prompt into many sessions, pool pressure with retraction, aborts, flushes,
  fcfs and lpm, chunked prefill.

Where SGLang's venv is missing (``.ci/install-sglang.sh``), these tests skip with the reason.
"""

from __future__ import annotations

import random
from collections.abc import Iterator

import pytest

from kvgate.realsglang.env import sglang_unavailable

_why = sglang_unavailable()
if _why is not None:
    pytest.skip(_why, allow_module_level=True)
pytestmark = pytest.mark.slow

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvgate.engine.base import Request  # noqa: E402
from kvgate.engine.blocks import SeqKey  # noqa: E402
from kvgate.engine.costmodel import QWEN3_8B_MI300X as P  # noqa: E402
from kvgate.engine.sglang import SglangEngine  # noqa: E402
from support.sglang_tree_ops import OpsConfig, run_ops  # noqa: E402
from support.sglang_tree_oracle import SglangTree, TeeRadix  # noqa: E402

CORES = ("rust", "python")


@pytest.fixture(scope="module")
def sglang() -> Iterator[SglangTree]:
    tree = SglangTree()
    yield tree
    tree.close()


def oracle_settings(n: int) -> settings:
    return settings(
        max_examples=n, deadline=None, derandomize=True, database=None,
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
    )


configs = st.builds(
    OpsConfig,
    kv_pool=st.sampled_from([24, 48, 96, 200, 400]),
    sessions=st.integers(1, 6),
    groups=st.integers(0, 2),
    group_tokens=st.integers(1, 30),
)
draws = st.lists(st.integers(0, 1 << 16), min_size=20, max_size=240)


# -- random operation sequences: 2,000 on the Rust core (the server's), 1,000 more on the Python one --------
@oracle_settings(2000)
@given(cfg=configs, draws=draws, steps=st.integers(5, 60))
def test_random_operations_match_sglangs_rust_core(
    sglang: SglangTree, cfg: OpsConfig, draws: list[int], steps: int
) -> None:
    run_ops(TeeRadix(cfg.kv_pool, sglang, "rust"), cfg, draws, steps)


@oracle_settings(1000)
@given(cfg=configs, draws=draws, steps=st.integers(5, 60))
def test_random_operations_match_sglangs_python_core(
    sglang: SglangTree, cfg: OpsConfig, draws: list[int], steps: int
) -> None:
    run_ops(TeeRadix(cfg.kv_pool, sglang, "python"), cfg, draws, steps)


def test_the_oracle_sees_a_wrong_split_stamp(sglang: SglangTree) -> None:
    """The comparison can fail: a tree that does not restamp the tail of a split node (kvgate's tree before it
    was held to SGLang's) diverges from SGLang's within a few hundred random sequences."""

    class NoTailStamp(TeeRadix):
        def _split(self, child, at):  # type: ignore[no-untyped-def]
            stamp = child.stamp
            new = super()._split(child, at)
            child.stamp = stamp
            return new

    with pytest.raises(AssertionError, match="kvgate vs SGLang"):
        for seed in range(300):
            rng = random.Random(seed)
            cfg = OpsConfig(rng.choice([48, 96, 200]), rng.randint(2, 6), rng.randint(1, 2), rng.randint(1, 30))
            run_ops(NoTailStamp(cfg.kv_pool, sglang, "rust"), cfg, [rng.randrange(1 << 16) for _ in range(300)], 80)


# -- agent scenarios through kvgate's SGLang engine ----------------------------------------------------------
def _agents(
    sglang: SglangTree, core: str, seed: int, *, pool: int, sessions: int, groups: int = 2, group_tokens: int = 40,
    turns: int = 6, policy: str = "fcfs", chunk: int = 8192, abort_p: float = 0.0, fork: bool = False,
    flush_p: float = 0.0,
) -> SglangEngine:
    """Closed-loop agent sessions on kvgate's SGLang engine with the tee as its cache: each session's next
    turn is its previous prompt + output + new tokens; ``fork`` starts every session from one shared prompt
    (the group prefix) at the same moment; aborts hit waiting, prefilling or decoding requests at random."""
    rng = random.Random(seed)
    eng = SglangEngine(P, pool, policy=policy, max_num_batched_tokens=chunk)
    eng.cache = TeeRadix(pool, sglang, core)
    history = dict.fromkeys(range(sessions), 0)
    done = dict.fromkeys(range(sessions), 0)
    live: dict[int, Request] = {}
    rid = 0
    t = 0.0
    for _ in range(4000):
        for s in range(sessions):
            if s in live or done[s] >= turns or (not fork and rng.random() < 0.5):
                continue
            g = s % groups if groups else 0
            prompt = history[s] + (group_tokens if history[s] == 0 and groups else 0) + rng.randrange(2, pool // 8)
            out = rng.randrange(1, pool // 12 + 2)
            if prompt + out >= pool // 2:
                done[s] = turns
                continue
            rid += 1
            live[s] = Request(rid, SeqKey(g, group_tokens if groups else 0, 1000 + s), prompt, out, t, None)
            eng.add(live[s])
        if not eng.has_work():
            if not live and all(d >= turns for d in done.values()):
                break
            if rng.random() < flush_p:
                assert eng.flush()
            continue
        res = eng.step(t)
        t += res.duration
        for r in res.finished:
            s = r.seq.session - 1000
            history[s] = r.num_tokens
            done[s] += 1
            del live[s]
        if abort_p and live and rng.random() < abort_p:
            s = rng.choice(sorted(live))
            eng.abort(live.pop(s))
            done[s] += 1
        eng.check_invariants()
    return eng


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("seed", range(6))
def test_agent_sessions_under_pool_pressure_match_sglang(sglang: SglangTree, core: str, seed: int) -> None:
    eng = _agents(sglang, core, seed, pool=400 + 200 * (seed % 3), sessions=8)
    assert eng.cache.evicted_tokens > 0  # the pool was under pressure


def _long_outputs(sglang: SglangTree, core: str, seed: int) -> SglangEngine:
    """Two to four sessions of long outputs arriving while the others decode, on a pool that holds them at
    admission (new_token_ratio discounts what running requests will still write) but not by the end: decoding
    requests are retracted, re-prefilled later with their output so far, and run up to three turns."""
    rng = random.Random(seed)
    pool = 2900
    eng = SglangEngine(P, pool)
    eng.cache = TeeRadix(pool, sglang, core)
    n = rng.randint(2, 4)
    pending = [(rng.randrange(0, 40), i) for i in range(n)]
    turns = dict.fromkeys(range(n), 0)
    history = dict.fromkeys(range(n), 0)
    t = 0.0
    step = rid = 0
    while pending or eng.has_work():
        for a, i in [x for x in pending if x[0] <= step]:
            pending.remove((a, i))
            rid += 1
            prompt, out = history[i] + rng.randrange(400, 600), rng.randrange(900, 1100)
            if prompt + out < pool - 100:
                eng.add(Request(rid, SeqKey(0, 50, i), prompt, out, t, None))
        if eng.has_work():
            res = eng.step(t, t)  # single steps: arrivals are counted in steps
            t += res.duration
            for r in res.finished:
                i = r.seq.session
                history[i] = r.num_tokens
                turns[i] += 1
                if turns[i] < 3:
                    pending.append((step + rng.randrange(1, 30), i))
            eng.check_invariants()
        step += 1
    return eng


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("seed", [0, 3, 4, 5])
def test_retraction_matches_sglang(sglang: SglangTree, core: str, seed: int) -> None:
    eng = _long_outputs(sglang, core, seed)
    assert eng.retractions > 0


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("seed", range(4))
def test_forks_of_one_prompt_match_sglang(sglang: SglangTree, core: str, seed: int) -> None:
    _agents(sglang, core, seed, pool=800, sessions=8, groups=1, group_tokens=120, fork=True, chunk=64)


@pytest.mark.parametrize("core", CORES)
@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
@pytest.mark.parametrize("seed", range(3))
def test_aborts_flushes_and_policies_match_sglang(sglang: SglangTree, core: str, policy: str, seed: int) -> None:
    _agents(sglang, core, seed, pool=500, sessions=7, policy=policy, chunk=48, abort_p=0.15, flush_p=0.5)


@pytest.mark.parametrize("core", CORES)
def test_simulated_paper_workload_matches_sglang(
    sglang: SglangTree, core: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The simulator's own workload (paper-8b sessions: groups of shared system prompts, growing unique contexts)
    on kvgate's SGLang engine with a burst, a pool small enough to evict and a flush attempt at minute 3; every
    radix-cache call of the run goes to SGLang's tree too."""
    from kvgate.engine.factory import EngineConfig
    from kvgate.sim import engines as runner
    from kvgate.sim.config import SimConfig
    from kvgate.sim.runner import simulate

    tees: list[TeeRadix] = []
    build = runner.build_engine

    def build_tee(cfg: EngineConfig) -> SglangEngine:
        eng = build(cfg)
        assert isinstance(eng, SglangEngine)
        eng.cache = TeeRadix(eng.kv_pool, sglang, core)
        tees.append(eng.cache)
        return eng

    monkeypatch.setattr(runner, "build_engine", build_tee)
    cfg = SimConfig(preset="paper-8b", minutes=4, seed=501, bursts=("1.5@1+2",), kv_pool=40_000, flush_at=3.0,
                    engine="sglang")
    simulate(cfg)
    (tee,) = tees
    assert tee.ops > 500 and tee.evicted_tokens > 0
