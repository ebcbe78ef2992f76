"""A jump left pending (``step(..., defer=True)``) and settled at ``until`` is exactly the jump whose horizon was
``until``: the same steps, duration, finished requests, request state and pool, bit for bit.

Two engines are driven in lockstep with the same random requests: one is given each step's horizon up front
(``step(now, horizon)``), the other steps with no horizon, leaves its jumps pending and learns the horizon only
afterwards (``settle(horizon)``), as the simulator learns that work was sent to a replica mid-jump. Nothing may
be asked of an engine while its jump is pending.
"""

from __future__ import annotations

import math
import random

import pytest

from kvgate.engine.base import Request, StepResult
from kvgate.engine.blocks import SeqKey
from kvgate.engine.costmodel import QWEN3_8B_MI300X as P
from kvgate.engine.vllm import VllmEngine


def _state(eng: VllmEngine, reqs: list[Request]) -> tuple:
    per_req = tuple((r.rid, r.computed, r.num_tokens, r.generated, r.grow_at, r.t_first, r.t_end) for r in reqs)
    return (
        per_req,
        [r.rid for r in eng.running],
        [r.rid for r in eng.waiting],
        eng.pool.num_free_blocks(),
        eng.pool.cached_blocks(),  # type: ignore[attr-defined]
        eng.stats,
    )


def _result(res: StepResult) -> tuple:
    return (res.steps, res.duration, [r.rid for r in res.finished], [r.rid for r in res.first_token])


def _lockstep(seed: int, kv_pool: int) -> tuple[int, int]:
    """Drive both engines to the end; returns (jumps left pending, of them cut short)."""
    rng = random.Random(seed)
    told, late = VllmEngine(P, kv_pool), VllmEngine(P, kv_pool)
    reqs: dict[str, list[Request]] = {"told": [], "late": []}
    context = dict.fromkeys(range(12), 0)  # an idle session's tokens so far; busy ones are not in it
    busy: dict[int, int] = {}  # rid -> session
    next_rid = 0
    next_key = len(context)
    now = 0.0
    pending = cut = 0
    for _ in range(3000):
        if context and (rng.random() < 0.15 or not told.has_work()):  # an idle session's next turn
            sess = rng.choice(sorted(context))
            prompt = context.pop(sess) + rng.randrange(200, 8_000)
            out = rng.randrange(2, 400)
            if prompt + out > P.max_model_len:  # the session ends; a new one takes its place
                sess, prompt = next_key, rng.randrange(200, 8_000)
                next_key += 1
            next_rid += 1
            busy[next_rid] = sess
            for name, eng in (("told", told), ("late", late)):
                r = Request(next_rid, SeqKey(0, 125, sess), prompt, out, now, None)
                reqs[name].append(r)
                eng.add(r)
        horizon = now + rng.expovariate(1 / rng.choice((0.05, 0.5, 5.0))) if rng.random() < 0.8 else math.inf
        a = told.step(now, horizon)
        b = late.step(now, math.inf, defer=True)
        if b.deferred:
            pending += 1
            planned = b.steps
            b = late.settle(None if math.isinf(horizon) else horizon)
            cut += b.steps < planned
        assert not b.deferred
        assert _result(a) == _result(b)
        assert _state(told, reqs["told"]) == _state(late, reqs["late"])
        for r in a.finished:
            context[busy.pop(r.rid)] = r.num_tokens
        now += a.duration if a.duration > 0 else 0.01
    return pending, cut


@pytest.mark.parametrize("kv_pool", [400_000, 60_000])
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_a_settled_jump_is_the_jump_with_that_horizon(seed: int, kv_pool: int) -> None:
    pending, cut = _lockstep(seed, kv_pool)
    assert pending > 50 and cut > 20  # the runs do leave jumps pending, and cut many of them short


def test_a_jump_cut_short_ends_with_the_step_containing_until() -> None:
    eng = VllmEngine(P)
    for i in range(6):
        eng.add(Request(i, SeqKey(0, 125, i), 8_000 + 100 * i, 500, 0.0, None))
    now = 0.0
    while True:  # prefill, then the first tokens: single steps
        res = eng.step(now, math.inf, defer=True)
        if res.deferred:
            break
        now += res.duration
    planned, start = res.steps, now
    assert planned > 10
    until = start + res.duration / 3
    res = eng.settle(until)
    assert 1 < res.steps < planned
    assert start + res.duration >= until  # the step containing ``until`` is the jump's last
    assert not res.finished


def test_nothing_may_be_asked_while_a_jump_is_pending() -> None:
    eng = VllmEngine(P)
    req = Request(1, SeqKey(0, 125, 1), 4_000, 200, 0.0, None)
    eng.add(req)
    with pytest.raises(RuntimeError, match="no deferred jump"):
        eng.settle()
    now = 0.0
    while not (res := eng.step(now, math.inf, defer=True)).deferred:
        now += res.duration
    other = Request(2, SeqKey(0, 125, 2), 4_000, 200, now, None)
    for call in (lambda: eng.step(now), lambda: eng.add(other), lambda: eng.abort(req), lambda: eng.flush()):
        with pytest.raises(RuntimeError, match="settle it first"):
            call()
    done = eng.settle()
    assert done.finished == [req] and req.generated == 200
