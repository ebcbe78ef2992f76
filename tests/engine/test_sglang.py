"""The simulated SGLang engine: radix LRU eviction, prefix reuse, flush, lpm, retraction, decode jumps."""

from __future__ import annotations

import heapq
import math
from typing import cast

import pytest

from kvgate.engine.base import Request, StepResult
from kvgate.engine.blocks import SeqKey
from kvgate.engine.costmodel import QWEN3_8B_MI300X as P
from kvgate.engine.sglang import SglangEngine
from kvgate.sim.config import SimConfig
from kvgate.sim.runner import simulate


def _run(eng: SglangEngine, t: float = 0.0, check: bool = True) -> float:
    """Step until idle; returns the time."""
    while eng.has_work():
        res = eng.step(t)
        assert res.duration > 0
        t += res.duration
        if check:
            eng.check_invariants()
    return t


def _turn(eng: SglangEngine, rid: int, seq: SeqKey, prompt: int, out: int, t: float = 0.0) -> tuple[Request, float]:
    req = Request(rid, seq, prompt, out, t, None)
    eng.add(req)
    return req, _run(eng, t)


def test_page_size_one() -> None:
    eng = SglangEngine(P)
    assert eng.block_size == 1
    assert eng.kv_pool == P.kv_pool


def _three_cached_sessions() -> SglangEngine:
    """Pool of 2000 tokens, a 50-token group prefix; sessions 1, 2, 3 each ran one turn of 250 + 11 tokens, in
    that order, so each caches 260 tokens: the group node, then a 200-token prompt node and a 10-token output node."""
    eng = SglangEngine(P, 2000)
    t = 0.0
    for sid in (1, 2, 3):
        _, t = _turn(eng, sid, SeqKey(0, 50, sid), 250, 11, t)
    for sid in (1, 2, 3):
        assert eng.cache.cached_tokens(SeqKey(0, 50, sid)) == 260
    assert eng.usage() == 0.0  # everything cached is evictable
    return eng


def _cached(eng: SglangEngine) -> list[int]:
    return [eng.cache.cached_tokens(SeqKey(0, 50, sid)) for sid in (1, 2, 3)]


def test_radix_lru_eviction_order() -> None:
    eng = _three_cached_sessions()
    # evict() pops whole leaves, least recently used first: session 1's output node, then its prompt node ...
    assert eng.cache.evict(1) == 10
    assert _cached(eng) == [250, 260, 260]
    assert eng.cache.evict(11) == 200
    assert _cached(eng) == [50, 260, 260]  # the group node is not a leaf while sessions 2, 3 hang under it
    # ... then session 2, tail first, whole nodes even when fewer tokens are asked for
    assert eng.cache.evict(205) == 210
    assert _cached(eng) == [50, 50, 260]
    assert eng.cache.evict(1) == 10
    # the group node goes last, once no chain is left under it
    assert eng.cache.evict(10_000) == 250
    assert _cached(eng) == [0, 0, 0]
    eng.check_invariants()


def test_allocation_evicts_the_least_recently_used_session() -> None:
    eng = _three_cached_sessions()
    # a 1500-token request of a new session: 1450 new tokens, 1320 free, so 130 are evicted: all of session 1
    big = Request(9, SeqKey(0, 50, 9), 1500, 5, 1.0, None)
    eng.add(big)
    eng.step(1.0)
    eng.check_invariants()
    assert big.cached == 50
    assert _cached(eng) == [50, 260, 260]


def test_lookup_refreshes_access_time() -> None:
    eng = _three_cached_sessions()
    # the scheduler's match for session 1's next turn (SGLang's match_prefix) stamps its path as just used ...
    nxt = Request(4, SeqKey(0, 50, 1), 300, 5, 1.0, None)
    assert eng.cache.match(nxt) == 260
    # ... so the next eviction takes session 2 instead
    big = Request(9, SeqKey(0, 50, 9), 1500, 5, 1.0, None)
    eng.add(big)
    eng.step(1.0)
    eng.check_invariants()
    assert _cached(eng) == [260, 50, 260]


def test_finished_request_output_is_cached_for_the_next_turn() -> None:
    # SGLang's cache_finished_req inserts the committed KV: prompt + output - 1 tokens (the last sampled token
    # has no KV); the next turn's match is capped at its input - 1 tokens (max_prefix_len), which is larger.
    eng = SglangEngine(P)
    seq = SeqKey(0, 2000, 1)
    r1, t = _turn(eng, 1, seq, 6000, 300)
    assert r1.cached == 0 and r1.generated == 300
    assert eng.cache.cached_tokens(seq) == 6000 + 300 - 1
    r2, t = _turn(eng, 2, seq, 6000 + 300 + 1000, 300, t)
    assert r2.cached == 6000 + 300 - 1
    # another session shares only the group prefix
    r3, _ = _turn(eng, 3, SeqKey(0, 2000, 2), 6000, 300, t)
    assert r3.cached == 2000
    assert eng.stats.hits == r2.cached + r3.cached


def test_cold_prefill_and_hit_costs() -> None:
    eng = SglangEngine(P)
    r1, cold = _turn(eng, 1, SeqKey(0, 2000, 1), 21_600, 1)
    r2, t = _turn(eng, 2, SeqKey(0, 2000, 1), 22_601, 1, cold)
    assert r2.cached == 21_600
    assert 1.5 < cold < 2.5  # paper: ~2 s of prefill for a 21.6K-context miss
    assert 0.05 < t - cold < 0.3  # paper: ~0.15 s on a hit


def test_flush_refused_while_requests_run() -> None:
    eng = SglangEngine(P)
    seq = SeqKey(0, 2000, 1)
    r1 = Request(1, seq, 6000, 50, 0.0, None)
    eng.add(r1)
    assert not eng.flush()  # waiting
    t = eng.step(0.0).duration
    assert eng.running == [r1]
    assert not eng.flush(preempt=True)  # running; SGLang cannot preempt for a flush
    assert eng.running == [r1] and eng.cache.cached_tokens(seq) == 6000
    t = _run(eng, t)
    assert eng.cache.cached_tokens(seq) == 6049
    assert eng.flush()
    assert eng.cache.cached_tokens(seq) == 0 and eng.usage() == 0.0
    eng.check_invariants()
    r2, _ = _turn(eng, 2, seq, 7050, 50, t)
    assert r2.cached == 0


def _admission_order(policy: str) -> list[int]:
    """Sessions 1 and 2 cached with 3299 and 6299 tokens; then a new session 3 and the next turns of 1 and 2
    arrive together in the order 3, 1, 2. A 1001-token prefill budget admits one request per step."""
    eng = SglangEngine(P, policy=policy, max_num_batched_tokens=1001)
    t = 0.0
    _, t = _turn(eng, 1, SeqKey(0, 2000, 1), 3000, 300, t)
    _, t = _turn(eng, 2, SeqKey(0, 2000, 2), 6000, 300, t)
    reqs = [
        Request(3, SeqKey(0, 2000, 3), 4000, 10, t, None),
        Request(4, SeqKey(0, 2000, 1), 3000 + 300 + 1000, 10, t, None),
        Request(5, SeqKey(0, 2000, 2), 6000 + 300 + 1000, 10, t, None),
    ]
    for r in reqs:
        eng.add(r)
    _run(eng, t)
    assert [r.cached for r in reqs] == [2000, 3299, 6299]
    return [r.rid for r in sorted(reqs, key=lambda r: r.t_sched)]


def test_lpm_orders_by_prefix_match() -> None:
    assert _admission_order("lpm") == [5, 4, 3]  # longest cached prefix first
    assert _admission_order("fcfs") == [3, 4, 5]  # arrival order


def test_unknown_policy_is_refused() -> None:
    with pytest.raises(ValueError):
        SglangEngine(P, policy="lof")


def test_retraction_counts_preemptions() -> None:
    # A is admitted, then B while A decodes: each reserves its whole output, minus what new_token_ratio (0.7)
    # expects of running requests, so both fit at admission but not by the end of their decode
    eng = SglangEngine(P, 2900)
    a = Request(1, SeqKey(0, 0, 1), 500, 1000, 0.0, None)
    b = Request(2, SeqKey(0, 0, 2), 500, 1000, 0.0, None)
    eng.add(a)
    t = eng.step(0.0).duration
    eng.add(b)
    t = _run(eng, t)
    assert a.generated == a.max_tokens and b.generated == b.max_tokens
    # the request with fewer output tokens is retracted; a retracted request is re-prefilled (prompt + output)
    assert a.preemptions == 0 and b.preemptions >= 1
    assert eng.stats.preemptions == a.preemptions + b.preemptions == eng.retractions
    assert b.cached == 0  # cached_tokens is the hit at first scheduling
    assert eng.new_token_ratio() < 1.0


def _drive(eng: SglangEngine, single_steps: bool, long_outputs: bool) -> dict[int, tuple]:
    """Closed-loop sessions (a turn follows 0.5 s after the previous one finished, 800 tokens longer); returns
    rid -> (t_first, t_end, cached, preemptions, generated). ``long_outputs``: 8 sessions with short prompts and
    500-1000-token outputs, for a small pool to retract decoding requests."""
    n = 8 if long_outputs else 12
    pending: list[tuple[float, int, Request]] = []
    seqs = {}
    for i in range(n):
        seqs[i] = SeqKey(0, 125, i)
        if long_outputs:
            req = Request(i * 100, seqs[i], 1500 + 300 * (i % 5), 600 + 50 * i, i * 0.3, (i, 0))
        else:
            req = Request(i * 100, seqs[i], 6000 + 900 * (i % 5), 50 + 7 * i, i * 0.7, (i, 0))
        heapq.heappush(pending, (req.t_submit, req.rid, req))
    now = 0.0
    done: dict[int, tuple] = {}
    while pending or eng.has_work():
        while pending and pending[0][0] <= now:
            eng.add(heapq.heappop(pending)[2])
        if not eng.has_work():
            now = pending[0][0]
            continue
        horizon = now if single_steps else (pending[0][0] if pending else math.inf)
        res = eng.step(now, horizon)
        now += res.duration
        eng.check_invariants()
        for r in res.finished:
            done[r.rid] = (r.t_first, r.t_end, r.cached, r.preemptions, r.generated)
            i, k = cast(tuple[int, int], r.tag)
            if k < 2:
                out = 500 + 30 * i if long_outputs else 40 + 3 * i
                nxt = Request(r.rid + 1, seqs[i], r.num_tokens + 800, out, now + 0.5, (i, k + 1))
                heapq.heappush(pending, (now + 0.5, nxt.rid, nxt))
    return done


@pytest.mark.parametrize("policy", ["fcfs", "lpm"])
@pytest.mark.parametrize(("kv_pool", "long_outputs"), [(400_000, False), (40_000, False), (10_000, True)])
def test_decode_jumps_equal_single_steps(kv_pool: int, long_outputs: bool, policy: str) -> None:
    e1 = SglangEngine(P, kv_pool, policy=policy)
    e2 = SglangEngine(P, kv_pool, policy=policy)
    a = _drive(e1, single_steps=False, long_outputs=long_outputs)
    b = _drive(e2, single_steps=True, long_outputs=long_outputs)
    assert a.keys() == b.keys() and len(a) == (24 if long_outputs else 36)
    for rid in a:
        assert a[rid][2:] == b[rid][2:]
        assert a[rid][0] == pytest.approx(b[rid][0], rel=1e-9)
        assert a[rid][1] == pytest.approx(b[rid][1], rel=1e-9)
    assert e1.stats.steps == e2.stats.steps  # a jump counts every step it stands for
    assert e1.stats.busy_s == pytest.approx(e2.stats.busy_s, rel=1e-9)
    assert e1.cache.evicted_tokens == e2.cache.evicted_tokens
    assert e1.stats.preemptions == e2.stats.preemptions
    assert sum(v[2] for v in a.values()) > 0
    if kv_pool == 40_000:
        assert e1.cache.evicted_tokens > 0  # the small pool exercises eviction
    if long_outputs:
        assert e1.stats.preemptions > 0  # and this one retraction


def test_jump_is_fewer_engine_calls() -> None:
    calls = 0
    eng = SglangEngine(P)
    step = eng.step

    def counting(now: float, horizon: float = math.inf) -> StepResult:
        nonlocal calls
        calls += 1
        return step(now, horizon)

    eng.step = counting  # type: ignore[method-assign]
    _drive(eng, single_steps=False, long_outputs=False)
    assert calls * 4 < eng.stats.steps


def test_no_prefix_cache_never_hits() -> None:
    eng = SglangEngine(P, prefix_caching=False)
    seq = SeqKey(0, 2000, 1)
    r1, t = _turn(eng, 1, seq, 6000, 30)
    r2, _ = _turn(eng, 2, seq, 7030, 30, t)
    assert r1.cached == r2.cached == 0
    assert eng.usage() == 0.0


def test_simulated_run_is_healthy_at_low_load() -> None:
    s = simulate(SimConfig(engine="sglang", minutes=30, lam=0.035)).meta["summary"]
    assert s["hit_ratio_all"] > 0.9
    assert s["hit_ratio_last10"] > 0.9
    assert not s["persistently_degraded"]
