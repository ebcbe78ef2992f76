"""kvgate's simulated vLLM scheduler held to vLLM's own v1 ``Scheduler`` (vLLM 0.32.0), step by step.

Every stream runs on vLLM's Scheduler (synthetic model outputs, ``tests/support/vllm_sched_oracle.py``), on kvgate's
``VllmEngine`` one step per call, and on ``VllmEngine`` with its decode jumps (each jump compared as the single
steps it stands for). Per step they must schedule the same requests in the same order with the same new
tokens, preempt the same requests, admit the same requests with the same prefix-cache hit, finish the same
requests, report the same cached tokens, reset the prefix cache alike, and end with the same free blocks and
prefix-cache metrics. kvgate's engines run on kvgate's own pool (the whole simulated engine against vLLM's) and
on vLLM's own KVCacheManager behind kvgate's pool protocol (``tests/support/vllm_pool_oracle.py``: the scheduler
alone). On a failure hypothesis shrinks the stream and the message shows the first divergent step and the
events before it.
"""

from __future__ import annotations

import math
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, note, settings
from hypothesis import strategies as st

from kvgate.engine.base import StepResult
from kvgate.engine.vllm import VllmEngine
from support.vllm_sched_oracle import (
    Divergence,
    KvgateEngine,
    Outcome,
    Session,
    Stream,
    Turn,
    VllmSchedulerEngine,
    run_lockstep,
    vllm_missing,
)

_missing = vllm_missing()
pytestmark = [pytest.mark.skipif(_missing is not None, reason=_missing or ""), pytest.mark.slow]


def engines(s: Stream, pool: str = "kvgate") -> list:
    """vLLM's Scheduler, kvgate's engine one step per call, and kvgate's engine with decode jumps; kvgate's
    engines on kvgate's pool or (``pool="vllm"``) on vLLM's own KVCacheManager."""
    kw = s.engine_kwargs()

    def p() -> object | None:
        if pool == "kvgate":
            return None
        from support.vllm_pool_oracle import VllmKVPool  # imports vLLM

        return VllmKVPool(s.num_blocks, s.block_size, s.prefix_caching)

    return [
        VllmSchedulerEngine(s.num_blocks, s.block_size, **kw),
        KvgateEngine(s.num_blocks, s.block_size, pool=p(), **kw),
        KvgateEngine(s.num_blocks, s.block_size, jumps=True, name="kvgate-jumps", pool=p(), **kw),
    ]


@st.composite
def streams(draw: st.DrawFn) -> Stream:
    bs = draw(st.sampled_from([16, 16, 128, 32, 48]))
    num_blocks = draw(st.integers(4, 160))
    max_seqs = draw(st.sampled_from([1, 2, 3, 4, 8, 16, 1024]))
    budget = draw(st.sampled_from([bs, 2 * bs + 5, 300, 1024, 8192]))
    budget = max(budget, max_seqs if max_seqs < 1024 else budget)
    if max_seqs > budget:
        max_seqs = budget
    caching = draw(st.booleans() | st.just(True))
    pool = num_blocks * bs
    n_groups = draw(st.integers(1, 3))
    group_blocks = [draw(st.integers(0, max(0, num_blocks // 3))) for _ in range(n_groups)]
    sessions = []
    for sid in range(draw(st.integers(1, 8))):
        g = draw(st.integers(0, n_groups - 1))
        turns = []
        for _ in range(draw(st.integers(1, 4))):
            append = draw(st.integers(1, max(1, pool // 3)))
            turns.append(
                Turn(
                    append=append,
                    max_tokens=draw(st.integers(1, 3 * bs)),
                    think=draw(st.integers(0, 12)),
                    abort_after=draw(st.none() | st.none() | st.integers(1, 40)),
                )
            )
        sessions.append(Session(sid, g, group_blocks[g], draw(st.integers(0, 40)), tuple(turns)))
    flushes = draw(st.lists(st.tuples(st.integers(1, 100), st.booleans()), max_size=2))
    reserve = draw(st.sampled_from([True, False]))
    return Stream(num_blocks, bs, budget, max_seqs, caching, tuple(sessions), tuple(flushes), reserve)


COVER: Counter[str] = Counter()


def _check(s: Stream, pool: str = "kvgate") -> Outcome:
    engs = engines(s, pool)
    try:
        out = run_lockstep(s, engs, max_steps=4000)
    except Divergence as e:
        raise AssertionError(f"{e}\n  stream: {s!r}") from None
    COVER["jumps"] += engs[2].jumps_taken
    COVER["streams"] += 1
    COVER["steps"] += out.steps
    COVER["preemptions"] += out.preemptions
    COVER["aborted"] += out.aborted
    COVER["hit_tokens"] += out.hit_tokens
    COVER["streams_with_preemption"] += out.preemptions > 0
    COVER["streams_with_hits"] += out.hit_tokens > 0
    COVER["streams_batch_gt1"] += out.max_batch > 1
    COVER["streams_later_turns"] += out.requests > len(s.sessions)
    COVER["block_128"] += s.block_size == 128
    COVER["stuck"] += out.stuck
    COVER["flushes"] += out.flushes
    COVER["no_full_isl_with_preemption"] += not s.reserve_full_isl and out.preemptions > 0
    COVER["chunked"] += s.max_num_batched_tokens < max(
        s.block_size * sess.group_blocks + sess.turns[0].append for sess in s.sessions
    )
    return out


_SETTINGS = settings(
    max_examples=500,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)


@_SETTINGS
@given(streams())
def _scheduler_property(s: Stream) -> None:
    note(repr(s))
    _check(s, pool="vllm")


@_SETTINGS
@given(streams())
def _engine_property(s: Stream) -> None:
    note(repr(s))
    _check(s, pool="kvgate")


def _assert_coverage() -> None:
    # the streams exercised what they are meant to
    assert COVER["streams"] >= 500
    assert COVER["streams_with_preemption"] >= 25, COVER
    assert COVER["streams_with_hits"] >= 100, COVER
    assert COVER["streams_later_turns"] >= 200, COVER
    assert COVER["aborted"] >= 50, COVER
    assert COVER["chunked"] >= 100, COVER
    assert COVER["block_128"] >= 50, COVER
    assert COVER["streams_batch_gt1"] >= 200, COVER
    assert COVER["flushes"] >= 50, COVER
    assert COVER["jumps"] >= 200, COVER
    assert COVER["no_full_isl_with_preemption"] >= 25, COVER


def test_scheduler_matches_vllm_on_random_streams() -> None:
    """kvgate's scheduler on vLLM's own KVCacheManager: any difference is the scheduler's."""
    COVER.clear()
    _scheduler_property()
    _assert_coverage()


def test_engine_matches_vllm_on_random_streams() -> None:
    """kvgate's scheduler on kvgate's pool: the whole simulated engine against vLLM's."""
    COVER.clear()
    _engine_property()
    _assert_coverage()


def _agent(
    block_size: int, num_blocks: int, sessions: int, shared: int, unique: int, turns: int, output: int = 16
) -> Stream:
    """The issue's agent shape, scaled: sessions of one group prefix + unique tokens, several turns each."""
    gb = shared // block_size
    ss = tuple(
        Session(
            i, 0, gb, 3 * i, tuple(Turn(unique if t == 0 else unique // 4, output, 2 + i % 3) for t in range(turns))
        )
        for i in range(sessions)
    )
    return Stream(num_blocks, block_size, 8192, 1024, True, ss)


@pytest.mark.parametrize("pool", ["vllm", "kvgate"])
@pytest.mark.parametrize("block_size", [16, 128])
def test_agent_sessions_under_pool_pressure(block_size: int, pool: str) -> None:
    s = _agent(block_size, num_blocks=12_000 // block_size, sessions=6, shared=2048, unique=1024, turns=5, output=200)
    out = _check(s, pool)
    assert out.finished == 30
    assert out.preemptions > 0  # the pool is small enough to preempt
    assert out.hit_tokens > 0


@pytest.mark.parametrize("pool", ["vllm", "kvgate"])
@pytest.mark.parametrize("block_size", [16, 128])
def test_chunked_prefill_at_the_8192_budget(block_size: int, pool: str) -> None:
    s = _agent(block_size, num_blocks=200_000 // block_size, sessions=4, shared=4096, unique=12_000, turns=2)
    out = _check(s, pool)
    assert out.finished == 8 and out.preemptions == 0 and out.hit_tokens > 0


def test_oracle_catches_a_different_scheduler() -> None:
    # The check can fail: the same stream on an engine with a different max_num_seqs diverges.
    s = _agent(16, num_blocks=4000, sessions=4, shared=256, unique=300, turns=2)
    kw = s.engine_kwargs()
    wrong = dict(kw, max_num_seqs=2)
    with pytest.raises(Divergence, match="step"):
        run_lockstep(s, [VllmSchedulerEngine(4000, 16, **kw), KvgateEngine(4000, 16, **wrong)])


class _PreemptToBack(VllmEngine):
    """A scheduler that differs from vLLM in one place: preempted requests rejoin the back of the queue."""

    def step(self, now: float, horizon: float = math.inf) -> StepResult:
        res = super().step(now, horizon)
        for req in res.preempted:  # vLLM puts them back at the front
            self.waiting.remove(req)
            self.waiting.append(req)
        return res


def test_oracle_catches_preempted_requests_queued_at_the_back() -> None:
    s = _agent(16, num_blocks=12_000 // 16, sessions=6, shared=2048, unique=1024, turns=5, output=200)
    kw = s.engine_kwargs()
    with pytest.raises(Divergence, match=r"step \d+"):
        run_lockstep(
            s,
            [
                VllmSchedulerEngine(s.num_blocks, 16, **kw),
                KvgateEngine(s.num_blocks, 16, engine_cls=_PreemptToBack, **kw),
            ],
        )
