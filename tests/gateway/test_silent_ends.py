"""Sessions that end without saying so (``kvgate.gateway.ends``) and prefix breaks told from evictions
(``kvgate.gateway.breaks``): the learnt release bound, released sessions leaving D so parked ones are admitted, a
released session coming back, and the classification of a turn whose cached tokens fell."""

from __future__ import annotations

import asyncio
import math
import random

import pytest

from kvgate.gateway.breaks import prefix_break
from kvgate.gateway.ends import FACTOR, MIN_GAPS, ThinkTimes
from support.aio import timed
from support.fake_upstream import post, stack


def test_the_bound_is_learnt_from_the_gaps_seen() -> None:
    t = ThinkTimes()
    rng = random.Random(1)
    for _ in range(MIN_GAPS - 1):
        t.observe(rng.expovariate(1 / 5.0))
    assert t.bound(300.0) == 300.0  # too few gaps: the idle timeout
    for _ in range(5000):
        t.observe(rng.expovariate(1 / 5.0))
    p99 = -5.0 * math.log(0.01)  # 23 s for exponential think times of mean 5 s (the paper's)
    assert FACTOR * p99 * 0.8 < t.bound(300.0) < FACTOR * p99 * 1.3
    assert t.bound(10.0) == 10.0  # never past the idle timeout
    for _ in range(20000):  # the workload changes: think times of 1 s; the bound follows
        t.observe(rng.expovariate(1.0))
    assert t.bound(300.0) < 15.0
    for bad in (-1.0, math.nan, math.inf):
        t.observe(bad)
    assert t.state()["gaps"] == 25031


@pytest.mark.parametrize("prev,prompt,cached,note,pressed,hit,want", [
    (1000, 1100, 1000, "", False, 0.9, ""),  # hit as expected
    (1000, 1100, 100, "", False, 0.9, "unseen"),  # fell while the pool had room
    (1000, 1100, 100, "", True, 0.9, ""),  # D went above C: an eviction
    (1000, 1100, 100, "", False, 0.2, ""),  # the regime is degraded: an eviction
    (1000, 1100, 100, "", False, math.nan, "unseen"),  # nothing to compare with: the pool had room
    (1000, 1100, 100, "head", True, 0.2, "head"),  # the head changed: the session's own doing, whatever the pool
    (1000, 300, 0, "rewrite", False, 0.9, "rewrite"),  # a compaction
    (1000, 300, 200, "rewrite", False, 0.9, ""),  # compacted, yet most of what it sent hit
    (40, 100, 0, "", False, 0.9, ""),  # too short a previous prompt to tell
    (-1, 100, 0, "", False, 0.9, ""),  # a first turn
    (1000, 1100, None, "", False, 0.9, ""),  # no cached tokens reported
])
def test_prefix_break_classification(prev: int, prompt: int, cached: int | None, note: str, pressed: bool,
                                     hit: float, want: str) -> None:
    assert prefix_break(prev, prompt, cached, note, pressed, hit) == want


def chat(i: int, k: int) -> dict[str, object]:
    """Turn k of conversation i: a shared system prompt, its task, then a reply and a result per turn."""
    msgs = [{"role": "system", "content": "shared system prompt " * 30},
            {"role": "user", "content": f"task {i} " * 60}]
    for j in range(k):
        msgs += [{"role": "assistant", "content": f"reply {i}.{j}"}, {"role": "user", "content": f"result {i}.{j}"}]
    return {"model": "m", "messages": msgs, "max_tokens": 16}


@timed(60)
async def test_silent_sessions_leave_d_within_the_learnt_bound_and_parked_ones_are_admitted() -> None:
    scale = 50.0  # gateway seconds per real second
    # room for two sessions (cap K=2): a third waits until a silent one leaves
    async with stack(kv_pool=1_000_000, control="cap", control_opt="K=2", time_scale=scale,
                     idle_timeout_s=3000.0) as (up, gw, client, base):
        url = base + "/v1/chat/completions"
        for k in range(17):  # two agents teach the gateway their think times: ~5 gateway seconds
            for i in (0, 1):
                status, _, r = await post(client, url, chat(i, k))
                assert status == 200 and r.headers["X-Kvgate-Lineage"] == ("new" if k == 0 else "continue")
            await asyncio.sleep(0.1)
        assert gw.summary()["release_after_s"] < 3000.0  # learnt: far below the idle timeout
        bound = gw.summary()["release_after_s"]
        assert bound < 60.0
        # both stop without an end marker; a third agent arrives and must wait for a ghost to leave D
        t0 = gw.now()
        status, _, r = await post(client, url, chat(2, 0))
        assert status == 200 and r.headers["X-Kvgate-Hold"] == "waiting"
        waited = float(r.headers["X-Kvgate-Park-Wait"])
        assert waited <= bound + 0.5 * scale  # within the bound (and a timer tick of real time)
        assert gw.session_ends["released"] >= 1 and gw.summary()["released"] >= 1
        assert gw.now() - t0 >= waited
        # a released agent that comes back is the same session, asked to the policy anew
        back = next(s for s in gw.sessions.values() if s.released)
        i, turns = int(back.name.label.split("-")[1]) - 1, back.est.turns
        status, _, r = await post(client, url, chat(i, 17))
        assert status == 200 and r.headers["X-Kvgate-Session"] == back.name.label
        assert r.headers["X-Kvgate-Lineage"].startswith("continue") and back.est.turns == turns + 1
        assert gw.summary()["resumed"] == 1 and not back.released
        rows = {d["id"]: d for d in (await (await client.get(base + "/v1/sessions")).json())["data"]}
        assert rows[back.name.label]["turns"] == turns + 1
        assert all(d["state"] in ("thinking", "released") for d in rows.values())
