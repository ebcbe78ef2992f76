"""The simulated vLLM engine: costs, decode jumps, admission gate, preemption; the Engine protocol."""

from __future__ import annotations

import math

import pytest

from kvgate.engine.base import Engine, Request
from kvgate.engine.blocks import SeqKey
from kvgate.engine.costmodel import QWEN3_8B_MI300X as P
from kvgate.engine.factory import EngineConfig, build_engine
from kvgate.engine.vllm import VllmEngine


def _drive(eng: VllmEngine, reqs: list[tuple[float, Request]], single_steps: bool) -> dict[int, tuple]:
    """Feed requests at their times; step until all finish. Returns rid -> (t_first, t_end, cached, preempt)."""
    pending = sorted(reqs, key=lambda x: x[0])
    now = 0.0
    done: dict[int, tuple] = {}
    while pending or eng.has_work():
        while pending and pending[0][0] <= now:
            eng.add(pending.pop(0)[1])
        if not eng.has_work():
            now = pending[0][0]
            continue
        horizon = now if single_steps else (pending[0][0] if pending else math.inf)
        res = eng.step(now, horizon)
        now += res.duration
        for r in res.finished:
            done[r.rid] = (r.t_first, r.t_end, r.cached, r.preemptions)
    return done


def _workload(n: int = 12) -> list[tuple[float, Request]]:
    out = []
    for i in range(n):
        out.append((i * 0.7, Request(i, SeqKey(0, 125, i), 6000 + 900 * (i % 5), 50 + 7 * i, i * 0.7, None)))
    return out


@pytest.mark.parametrize("kv_pool", [400_000, 40_000])
def test_decode_jumps_equal_single_steps(kv_pool: int) -> None:
    a = _drive(VllmEngine(P, kv_pool), _workload(), single_steps=False)
    b = _drive(VllmEngine(P, kv_pool), _workload(), single_steps=True)
    assert a.keys() == b.keys()
    for rid in a:
        assert a[rid][2:] == b[rid][2:]
        assert a[rid][0] == pytest.approx(b[rid][0], rel=1e-9)
        assert a[rid][1] == pytest.approx(b[rid][1], rel=1e-9)


def test_jump_is_fewer_steps() -> None:
    e1, e2 = VllmEngine(P), VllmEngine(P)
    _drive(e1, _workload(), single_steps=False)
    _drive(e2, _workload(), single_steps=True)
    assert e1.stats.steps == e2.stats.steps  # jumps count every step they stand for
    assert e1.stats.busy_s == pytest.approx(e2.stats.busy_s, rel=1e-9)


def test_cold_prefill_and_hit_costs() -> None:
    eng = VllmEngine(P)
    eng.add(Request(1, SeqKey(0, 125, 1), 21_600, 1, 0.0, None))
    t = 0.0
    while eng.has_work():
        t += eng.step(t).duration
    cold = t
    # next turn of the same session: 21.6K + 1 output + 1000 appended; it hits the cached prefix
    eng.add(Request(2, SeqKey(0, 125, 1), 22_601, 1, t, None))
    t0 = t
    while eng.has_work():
        t += eng.step(t).duration
    assert 1.5 < cold < 2.5  # paper: ~2 s of prefill for a 21.6K-context miss
    assert 0.05 < t - t0 < 0.3  # paper: ~0.15 s on a hit


def test_second_turn_reports_its_cached_prefix() -> None:
    eng = VllmEngine(P)
    r1 = Request(1, SeqKey(0, 125, 1), 6000, 300, 0.0, None)
    eng.add(r1)
    t = 0.0
    while eng.has_work():
        t += eng.step(t).duration
    r2 = Request(2, SeqKey(0, 125, 1), 6000 + 300 + 1000, 300, t, None)
    eng.add(r2)
    while eng.has_work():
        t += eng.step(t).duration
    assert r1.cached == 0
    # previous prompt + output - 1 computed tokens, whole blocks
    assert r2.cached == (6000 + 300 - 1) // 16 * 16


def test_no_prefix_cache_never_hits() -> None:
    eng = VllmEngine(P, prefix_caching=False)
    done = _drive(eng, _workload(6), single_steps=False)
    assert all(v[2] == 0 for v in done.values())


def test_full_prompt_admission_gate_limits_preemption() -> None:
    # prompts longer than one chunk: without the gate a request is admitted on its first chunk and runs out
    # of blocks mid-prefill
    reqs = [(0.0, Request(i, SeqKey(0, 0, i), 12_000, 100, 0.0, None)) for i in range(6)]
    gated = VllmEngine(P, 30_000, max_num_batched_tokens=2048)
    _drive(gated, reqs, single_steps=False)
    reqs = [(0.0, Request(i, SeqKey(0, 0, i), 12_000, 100, 0.0, None)) for i in range(6)]
    ungated = VllmEngine(P, 30_000, max_num_batched_tokens=2048, reserve_full_prompt=False)
    _drive(ungated, reqs, single_steps=False)
    assert gated.stats.preemptions < ungated.stats.preemptions


def test_flush_preempts_and_clears() -> None:
    eng = VllmEngine(P)
    eng.add(Request(1, SeqKey(0, 125, 1), 6000, 300, 0.0, None))
    eng.step(0.0)
    assert eng.running
    assert eng.flush(preempt=True)
    assert not eng.running and len(eng.waiting) == 1
    assert eng.pool.lookup(SeqKey(0, 125, 1), 6000) == 0


def test_request_over_max_model_len_rejected() -> None:
    with pytest.raises(ValueError):
        VllmEngine(P).add(Request(1, SeqKey(0, 0, 1), 40_900, 300, 0.0, None))


# -- the Engine protocol, as both engines implement it -----------------------------------------------------


def _engines() -> list[Engine]:
    return [
        build_engine(EngineConfig(engine="vllm", kv_pool=64_000)),
        build_engine(EngineConfig(engine="sglang", kv_pool=64_000)),
        build_engine(EngineConfig(engine="vllm", kv_pool=64_000), capped=True),
        build_engine(EngineConfig(engine="vllm", kv_pool=64_000, pin_ttl_s=1.0)),
    ]


def test_both_engines_have_every_member_of_the_protocol() -> None:
    members = [n for n in vars(Engine) if not n.startswith("_")]
    assert {"step", "queue_lengths", "session_status", "tracks_sessions", "hit_caps", "num_blocks"} <= set(members)
    for eng in _engines():
        missing = [n for n in members if not hasattr(eng, n)]
        assert missing == [], type(eng).__name__
        assert eng.num_blocks * eng.block_size == eng.kv_pool == 64_000


def test_session_reports_and_hit_caps_as_the_protocol_says() -> None:
    vllm, sglang, capped, pinned = _engines()
    assert (vllm.tracks_sessions, sglang.tracks_sessions, pinned.tracks_sessions) == (False, False, True)
    assert vllm.hit_caps is None and sglang.hit_caps is None and capped.hit_caps == {}
    for eng in (vllm, sglang, pinned):
        eng.session_status(1, "parked")
        eng.session_status(1, "ended")
        with pytest.raises(ValueError, match="unknown session status"):
            eng.session_status(1, "gone")  # type: ignore[arg-type]


def test_queue_lengths_count_a_chunked_prefill_as_running() -> None:
    for eng in _engines()[:2]:
        a = Request(0, SeqKey(0, 0, 0), 20_000, 10, 0.0, None)  # more than one 8192-token chunk
        b = Request(1, SeqKey(0, 0, 1), 100, 10, 0.0, None)
        eng.add(a)
        eng.add(b)
        assert eng.queue_lengths() == (0, 2)
        eng.step(0.0, 0.0)  # a's first chunk
        running, waiting = eng.queue_lengths()
        assert running == 1 and waiting == 1, type(eng).__name__
