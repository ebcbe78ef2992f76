"""``kvgate epp`` behind a real Envoy (1.40, ``.ci/install-envoy.sh``) in front of two ``kvgate engine`` servers,
on loopback (:mod:`support.envoy_stack`): the picker resolves sessions that name nothing, holds what the budget
says to hold (Envoy never answers 504 meanwhile), keeps each session on one engine, ends turns with their usage,
keeps D true when a held client leaves, and goes on with its books after a restart with ``--state-dir``."""

from __future__ import annotations

import asyncio
import itertools
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from support.aio import timed
from support.envoy_stack import Agent, Stack, envoy_stack, epp_missing

pytestmark = pytest.mark.skipif(epp_missing() is not None, reason=str(epp_missing()))


async def listing(client: aiohttp.ClientSession, stack: Stack) -> dict[str, Any]:
    async with client.get(stack.http + "/v1/sessions") as r:
        assert r.status == 200
        got: dict[str, Any] = await r.json()
        return got


def d_true(got: dict[str, Any]) -> None:
    """D (the summary's) is the sum of the demands of the sessions admitted now, and nothing is held."""
    admitted = sum(s["demand_tokens"] for s in got["data"] if s["state"] in ("running", "thinking", "parked"))
    assert got["summary"]["demand_tokens"] == admitted, got["summary"]
    assert got["summary"]["held"] == 0 and got["summary"]["waiting"] == 0, got["summary"]


def words(i: int, n: int) -> str:
    return " ".join(f"w{i}x{j}" for j in range(n))


@timed(240)
@pytest.mark.parametrize("body", ["buffered", "streamed"])
async def test_agents_that_name_nothing_in_three_apis_streamed_and_not(tmp_path: Path, body: str) -> None:
    async with envoy_stack(tmp_path, "--envoy-body", body) as (stack, client):
        agents = [Agent(api, stream, words(i, 40)) for i, (api, stream) in
                  enumerate(itertools.product(("chat", "responses", "messages"), (False, True)))]
        for k in range(3):
            got = await asyncio.gather(*(a.turn(client, stack.front, a.first if k == 0 else f"go on {k}")
                                         for a in agents))
            assert got == [200] * len(agents)
        listed = await listing(client, stack)
        rows = listed["data"]
        assert len(rows) == len(agents), [(r["id"], r["turns"]) for r in rows]
        assert sorted(r["turns"] for r in rows) == [3] * len(agents)
        assert all(r["source"] == "lineage" for r in rows)
        for a in agents:  # each conversation on one engine, as Envoy reports who served it
            assert len(set(a.served)) == 1 and a.served[0].startswith("127.0.0.1:"), (a.api, a.stream, a.served)
        assert all(r["last_cached_tokens"] > 0 for r in rows)  # its engine still held its prefix
        assert sum(e.engine.stats.hits for e in stack.engines) > 0
        d_true(listed)
        async with client.get(stack.http + "/kvgate/info") as r:
            info = await r.json()
        assert info["epp"]["served_elsewhere"] == 0 and info["epp"]["hold"] == "always"
        async with client.get(stack.front + "/kvgate/info") as r:  # through Envoy: the picker answers it
            assert r.status == 200 and (await r.json())["epp"]["grpc_port"] == stack.grpc_port
        assert info["turns"]["finished"] == 3 * len(agents)


@timed(240)
async def test_a_new_sessions_first_turn_is_counted_by_the_engines_tokenizer(tmp_path: Path) -> None:
    """A new session in a fleet is not placed yet when its first turn is counted: an engine up counts it (this
    engine's tokenizer makes ~2.6 times the tokens of a characters/4 estimate, which let a burst past the pools)."""
    async with envoy_stack(tmp_path) as (stack, client):
        agents = [Agent(api, i % 2 == 1, words(i, 120)) for i, api in enumerate(("chat", "responses", "messages") * 2)]
        assert await asyncio.gather(*(a.turn(client, stack.front, a.first) for a in agents)) == [200] * len(agents)
        rows = (await listing(client, stack))["data"]
        assert len(rows) == len(agents)
        for r in rows:  # the demand counted is the prompt the engine ran
            assert r["context_tokens"] == r["last_prompt_tokens"] > 0, r


@timed(300)
async def test_a_burst_on_small_pools_is_held_by_the_picker_not_envoy(tmp_path: Path) -> None:
    async with envoy_stack(tmp_path, "--control-opt", "low=0.6,high=0.8", kv_pool=6144) as (stack, client):
        agents = [Agent("chat", i % 2 == 1, words(i, 120), out=200) for i in range(24)]
        waiting = [0]

        async def session(a: Agent) -> list[int]:
            return [await a.turn(client, stack.front, a.first), await a.turn(client, stack.front, "more", end=True)]

        async def watch() -> None:  # the engines' own queues, sampled
            while True:
                waiting[0] = max(waiting[0], *(e.engine.queue_lengths()[1] for e in stack.engines))
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        got = await asyncio.gather(*(session(a) for a in agents))
        watcher.cancel()
        assert all(g == [200, 200] for g in got), got  # no 504 from Envoy, no 503 from the picker
        held = sum(h != "none" for a in agents for h in a.holds)
        assert held >= 4, [a.holds for a in agents]  # the picker held turns
        assert [e.engine.stats.preemptions for e in stack.engines] == [0, 0]  # the engines never ran out of KV
        assert waiting[0] <= 1, waiting  # nor queued (a request waits for its first step at most)
        listed = await listing(client, stack)
        assert listed["data"] == [] or all(r["state"] == "released" for r in listed["data"])
        d_true(listed)


@timed(240)
async def test_a_client_that_leaves_while_held_leaves_d_true(tmp_path: Path) -> None:
    async with envoy_stack(tmp_path, "--idle-timeout", "100000", kv_pool=4096) as (stack, client):
        fill = [Agent("chat", i % 2 == 0, words(i, 200), out=300) for i in range(12)]  # more than the pools take
        tasks = [asyncio.create_task(a.turn(client, stack.front, a.first)) for a in fill]
        for _ in range(400):
            now = await listing(client, stack)
            if now["summary"]["held"] > 0 and now["summary"]["in_flight"] == 0:
                break
            await asyncio.sleep(0.05)
        held = now["summary"]["held"]
        assert held > 0, now["summary"]  # (sessions that never end: the rest wait for good)
        assert sum(t.done() for t in tasks) == len(tasks) - held
        for t in tasks:
            t.cancel()  # the held clients go away
        for _ in range(200):
            now = await listing(client, stack)
            if now["summary"]["held"] == 0:
                break
            await asyncio.sleep(0.05)
        d_true(now)
        assert sum(r["state"] == "thinking" for r in now["data"]) == len(tasks) - held
        assert [e.queue_lengths() for e in stack.engines] == [(0, 0), (0, 0)]  # nothing reached the engines


@timed(240)
async def test_the_picker_restarted_with_its_state_dir_keeps_its_books(tmp_path: Path) -> None:
    state = tmp_path / "state"
    async with envoy_stack(tmp_path, "--state-dir", str(state), "--state-flush", "0.05") as (stack, client):
        agents = [Agent("chat", i % 2 == 0, words(i, 60)) for i in range(4)]
        for k in range(2):
            assert await asyncio.gather(*(a.turn(client, stack.front, a.first if k == 0 else "next")
                                          for a in agents)) == [200] * 4
        before = await listing(client, stack)
        await asyncio.sleep(0.3)  # (a few flush intervals)
        await stack.stop_picker()
        await stack.start_picker(client)
        after = await listing(client, stack)
        key = lambda got: sorted((r["id"], r["turns"], r["demand_tokens"], r["replica"]) for r in got["data"])  # noqa: E731
        assert key(after) == key(before) and len(key(after)) == 4
        assert after["summary"]["demand_tokens"] == before["summary"]["demand_tokens"]
        for _ in range(100):  # (Envoy reconnects to the picker on its own)
            if (await asyncio.gather(*(a.turn(client, stack.front, "again") for a in agents))) == [200] * 4:
                break
            await asyncio.sleep(0.1)
        again = await listing(client, stack)
        assert sorted(r["turns"] for r in again["data"]) == [3] * 4  # the same sessions went on
        for a in agents:
            assert len(set(a.served)) == 1, a.served
        d_true(again)


@timed(240)
async def test_hold_never_answers_429_with_retry_after(tmp_path: Path) -> None:
    async with envoy_stack(tmp_path, "--hold", "never", "--idle-timeout", "100000", kv_pool=4096) as (stack, client):
        fill = [Agent("chat", False, words(i, 200), out=300) for i in range(12)]
        statuses = []
        for a in fill:  # one at a time: each that fits is admitted, the rest refused at once
            async with client.post(stack.front + "/v1/chat/completions", json={
                    "model": "Qwen/Qwen3-8B", "messages": [{"role": "user", "content": a.first}], "max_tokens": 300,
            }) as r:
                statuses.append(r.status)
                if r.status == 429:
                    assert int(r.headers["Retry-After"]) >= 1
                    assert (await r.json())["error"]["type"] == "HoldRefused"
        assert 200 in statuses and 429 in statuses, statuses
        now = await listing(client, stack)
        d_true(now)
        assert len(now["data"]) == statuses.count(200)


@pytest.mark.slow
@timed(240)
async def test_a_hold_past_envoys_message_timeout_then_max_park_is_503_not_504(tmp_path: Path) -> None:
    """Held 8 s (240 gateway seconds at x30), past the 5 s message timeout of the bootstrap: the picker's
    override keeps Envoy waiting, and --max-park-s answers 503 with Retry-After (Envoy would say 504)."""
    args = ("--max-park-s", "240", "--idle-timeout", "100000")
    async with envoy_stack(tmp_path, *args, kv_pool=4096) as (stack, client):
        fill = [Agent("chat", False, words(i, 200), out=300) for i in range(12)]
        tasks = [asyncio.create_task(a.turn(client, stack.front, a.first)) for a in fill]
        got = await asyncio.gather(*tasks)
        assert 200 in got and 503 in got and set(got) <= {200, 503}, got
        t0 = asyncio.get_running_loop().time()
        async with client.post(stack.front + "/v1/chat/completions", json={
                "model": "Qwen/Qwen3-8B", "messages": [{"role": "user", "content": words(77, 200)}],
                "max_tokens": 300}) as r:
            assert r.status == 503, await r.text()
            assert r.headers["Retry-After"] == "8"
            assert (await r.json())["error"]["type"] == "ParkTimeout"
        assert asyncio.get_running_loop().time() - t0 >= 7.5
        d_true(await listing(client, stack))


@timed(240)
async def test_two_pickers_on_a_shared_store_take_any_turn(tmp_path: Path) -> None:
    """Active-active: Envoy balances its ext_proc streams over two pickers sharing --store redis:// (one budget for
    the engine, a session's one turn in flight across them); every turn of named sessions is served, each picker
    takes some, and each lists every session with all its turns (the books are one)."""
    from support.redis_server import REDIS, RedisServer

    if REDIS is None:
        pytest.skip("redis-server is not installed (bash .ci/install-redis.sh)")
    pytest.importorskip("redis", reason="redis-py is not installed (pip install 'kvgate[redis]')")
    srv = RedisServer()
    srv.start()
    try:
        async with envoy_stack(tmp_path, "--store", srv.url, pickers=2, engines=1) as (stack, client):
            agents = [Agent("chat", i % 2 == 0, words(i, 60), sid=f"agent-{i}") for i in range(6)]
            for k in range(4):
                assert await asyncio.gather(*(a.turn(client, stack.front, a.first if k == 0 else f"then {k}")
                                              for a in agents)) == [200] * 6
            want = {f"agent-{i}": 4 for i in range(6)}
            for _ in range(100):  # (a turn's end reaches the books once Envoy has passed its last bytes on)
                finished, views = [], []
                for http in (stack.http, *stack.others):
                    async with client.get(http + "/kvgate/info") as r:
                        finished.append((await r.json())["turns"].get("finished", 0))
                    async with client.get(http + "/v1/sessions") as r:
                        views.append({row["id"]: row["turns"] for row in (await r.json())["data"]})
                if sum(finished) == 24 and all(v == want for v in views):
                    break
                await asyncio.sleep(0.1)
            assert all(v == want for v in views), views  # each picker lists every session with all its turns
            assert sum(finished) == 24 and min(finished) > 0, finished  # both pickers took turns
    finally:
        srv.stop()


@timed(240)
async def test_an_engine_gone_fails_its_turns_and_its_sessions_move(tmp_path: Path) -> None:
    """Envoy's 503 for an engine it cannot reach is a connect failure: the replica is marked down at once, the
    client's retry of the same turn continues its session on the engine left, and D stays true."""
    async with envoy_stack(tmp_path, "--health-interval", "0.2") as (stack, client):
        agents = [Agent("chat", i % 2 == 0, words(i, 60)) for i in range(4)]
        assert await asyncio.gather(*(a.turn(client, stack.front, a.first) for a in agents)) == [200] * 4
        await stack.engines[0].stop()
        got = await asyncio.gather(*(a.turn(client, stack.front, "next") for a in agents))
        assert set(got) <= {200, 503} and 503 in got, got  # Envoy's own answer for the engine gone
        async with client.get(stack.http + "/metrics") as r:
            assert f'kvgate_upstream_errors_total{{kind="connect"}} {got.count(503)}.0' in await r.text()
        for a, g in zip(agents, got, strict=True):  # the clients retry the same turn
            if g != 200:
                assert await a.turn(client, stack.front, "next") == 200
        assert await asyncio.gather(*(a.turn(client, stack.front, "again") for a in agents)) == [200] * 4
        listed = await listing(client, stack)
        d_true(listed)
        # the same sessions went on (a failed turn counts as one of its session's turns)
        assert sorted(r["turns"] for r in listed["data"]) == sorted(3 + (g != 200) for g in got)
        assert len({r["replica"] for r in listed["data"]}) == 1  # all on the engine left
        assert len({a.served[-1] for a in agents}) == 1
