"""A retried turn (an agent that timed out and sent the same request again) replaces its earlier attempt in the
gateway: the earlier one is cancelled upstream, and demand D counts the turn once."""

from __future__ import annotations

import asyncio

from kvgate.gateway import Gateway
from kvgate.policy import SessionState
from support.aio import timed
from support.fake_upstream import post, settle, stack


def state(gw: Gateway, sid: str) -> SessionState | None:
    s = gw.sessions.get(sid)
    return gw.policy.state_of(sid) if s is not None and s.known_to_policy else None


@timed(15)
async def test_a_retry_of_a_turn_in_flight_cancels_the_earlier_upstream_and_d_counts_it_once() -> None:
    async with stack(kv_pool=1_000_000) as (up, gw, client, base):
        url = base + "/v1/completions"
        body = {"model": "m", "prompt": list(range(300)), "max_tokens": 200}  # d = 500
        up.delay_s = 0.6
        first = asyncio.create_task(post(client, url, body, "S"))
        await settle(lambda: state(gw, "S") is SessionState.RUNNING and gw.in_flight == 1)
        d_first = gw.policy.demand
        assert d_first == 500
        retry = asyncio.create_task(post(client, url, body, "S"))
        await settle(lambda: gw.replaced_attempts == 1 and up.cancelled == 1)  # the earlier upstream is cancelled
        await settle(lambda: gw.in_flight == 1)  # the retry is in flight in its place
        assert gw.policy.demand == d_first  # ...and D holds the turn once, not twice
        assert gw.policy.counts()["in_system"] == 1
        status, _, _ = await retry
        assert status == 200
        assert first.done() and (await first)[0] == 409  # the replaced attempt is told why
        assert gw.turns["finished"] == 1 and gw.turns["cancelled"] == 1
        assert gw.sessions["S"].est.turns == 1  # one turn of the session, not two
        assert gw.policy.demand == 500
        # a different request of the same session while one is in flight is the next turn: it waits, no replace
        up.delay_s = 0.2
        nxt = {**body, "prompt": list(range(600))}
        a = asyncio.create_task(post(client, url, nxt, "S"))
        await settle(lambda: gw.in_flight == 1)
        b = await post(client, url, {**nxt, "prompt": list(range(700))}, "S")
        assert b[0] == 200 and (await a)[0] == 200
        assert gw.replaced_attempts == 1 and gw.turns["finished"] == 3


@timed(15)
async def test_a_retry_of_a_held_turn_keeps_its_place() -> None:
    # C = 1000: the budgeter admits while D + d <= 750
    async with stack(kv_pool=1000) as (up, gw, client, base):
        url = base + "/v1/completions"
        a = {"model": "m", "prompt": list(range(200)), "max_tokens": 400}  # d = 600
        assert (await post(client, url, a, "A"))[0] == 200
        b = {"model": "m", "prompt": [1] * 100, "max_tokens": 100}
        first = asyncio.create_task(post(client, url, b, "B"))
        await settle(lambda: gw.policy.counts()["waiting"] == 1)
        retry = asyncio.create_task(post(client, url, b, "B"))
        await settle(lambda: gw.replaced_attempts == 1 and first.done())
        await asyncio.sleep(0.05)
        assert gw.policy.state_of("B") is SessionState.WAITING  # still in its place, not ended and re-queued
        assert gw.policy.counts()["in_system"] == 2 and gw.session_ends["disconnect"] == 0
        assert gw.policy.demand == 600
        status, _, _ = await post(client, url, {**a, "prompt": list(range(250))}, "A", **{"X-Session-End": "true"})
        assert status == 200
        status, _, _ = await retry
        assert status == 200
        assert gw.policy.state_of("B") is SessionState.THINKING and gw.policy.demand == 200
        assert gw.policy.waits == 1  # one wait for B's turn, not two
