"""``kvgate gateway`` on loopback, in front of a small fake OpenAI-compatible upstream (an aiohttp server).

Every test runs the gateway and the fake in the test's event loop, always stops both, and ends with the same
checks (:func:`stack`): D equals the true sum of admitted demand (0 when every session is idle or gone), no turn
is held or in flight, no upstream connection is in use, and no task is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import signal
import sys
import time
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest
from yarl import URL

from kvgate.gateway import Gateway, GatewayConfig
from kvgate.gateway.pool import PoolNotFound
from kvgate.policy import SessionState
from support.aio import timed
from support.fake_upstream import VLLM_METRICS, FakeUpstream, check_clean, post, settle, stack  # noqa: F401


# -- the official client ----------------------------------------------------------------------------------------
@timed(15)
async def test_openai_client_through_the_gateway() -> None:
    async with stack(kv_pool=1_000_000) as (up, gw, _, base):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="sk-test", max_retries=0, timeout=10)
        try:
            hdr = {"X-Session-ID": "agent-1"}
            msgs: list[Any] = [{"role": "user", "content": "hello " * 40}]
            chat = await client.chat.completions.create(model="m", messages=msgs, max_tokens=8, extra_headers=hdr)
            assert chat.choices[0].message.content == "ok ok ok "
            assert chat.usage is not None and chat.usage.prompt_tokens_details is not None
            assert chat.usage.prompt_tokens_details.cached_tokens == chat.usage.prompt_tokens // 2

            # streaming chat without include_usage: the gateway asks for usage and hides the usage chunk
            stream = await client.chat.completions.create(model="m", messages=msgs, stream=True, extra_headers=hdr)
            chunks = [c async for c in stream]
            assert "".join(c.choices[0].delta.content or "" for c in chunks) == "ok ok ok "
            assert all(c.choices for c in chunks) and all(c.usage is None for c in chunks)
            assert up.seen[-1]["body"]["stream_options"] == {"include_usage": True}

            # streaming chat with include_usage: the client gets its usage chunk
            stream = await client.chat.completions.create(
                model="m", messages=msgs, stream=True, stream_options={"include_usage": True}, extra_headers=hdr
            )
            chunks = [c async for c in stream]
            assert chunks[-1].choices == [] and chunks[-1].usage is not None
            assert chunks[-1].usage.completion_tokens == 3

            # completions, plain and streamed, with token ids
            comp = await client.completions.create(model="m", prompt=list(range(100)), max_tokens=4,
                                                   extra_headers={"X-Session-ID": "agent-2"})
            assert comp.choices[0].text == "ok ok ok " and comp.usage is not None and comp.usage.prompt_tokens == 100
            cstream = await client.completions.create(model="m", prompt=list(range(120)), max_tokens=4, stream=True,
                                                      extra_headers={"X-Session-ID": "agent-2"})
            texts = [c async for c in cstream]
            assert "".join(c.choices[0].text for c in texts) == "ok ok ok " and all(c.choices for c in texts)
        finally:
            await client.close()
        # the policy saw every turn; the exact L_s of agent-2's last turn is its id count
        assert gw.policy.demand_of("agent-2") == 120 + 4
        assert gw.turns["finished"] == 5
        s = gw.summary()
        assert s["hit_ratio_1m"] == pytest.approx(0.5, abs=0.01)
        assert s["admitted"] == 2 and s["demand_tokens"] == gw.policy.demand


@timed(10)
async def test_usage_chunk_injection_and_removal_on_the_wire() -> None:
    async with stack(kv_pool=1_000_000) as (up, gw, client, base):
        raw = b'{"model": "m", "prompt": [1, 2, 3], "stream": true, "max_tokens": 3}'
        async with client.post(base + "/v1/completions", data=raw, headers={"X-Session-ID": "w"}) as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/event-stream")
            wire = await r.read()
        # the upstream got the client's bytes with the option spliced in, nothing re-encoded
        assert up.seen[-1]["raw"] == b'{"stream_options":{"include_usage":true},' + raw[1:]
        events = [e for e in wire.split(b"\n\n") if e]
        assert events[-1] == b"data: [DONE]" and len(events) == 4
        assert all(b'"usage"' not in e for e in events)
        assert gw.sessions["w"].est.prompt_tokens == 3  # the usage was read before the chunk was dropped

        # a client that asked for usage sees it; a client that said false does not
        for include, expect in ((True, 5), (False, 4)):
            body = {"model": "m", "prompt": [1], "stream": True, "stream_options": {"include_usage": include}}
            status, wire, _ = await post(client, base + "/v1/completions", body, "w")
            assert status == 200
            assert len([e for e in wire.split(b"\n\n") if e]) == expect
            assert up.seen[-1]["body"]["stream_options"]["include_usage"] is True


@timed(10)
async def test_session_identification_precedence() -> None:
    async with stack(kv_pool=1_000_000) as (up, gw, client, base):
        url = base + "/v1/completions"
        body = {"model": "m", "prompt": [1, 2], "max_tokens": 1}
        await post(client, url, {**body, "session_id": "body-sid", "user": "user-sid"}, "hdr-sid")
        await post(client, url, {**body, "session_id": "body-sid", "user": "user-sid"})
        await post(client, url, {**body, "user": "user-sid"})
        await post(client, url, body)  # anonymous: a one-turn session, gone after its turn
        assert set(gw.sessions) == {"hdr-sid", "body-sid", "user-sid"}
        assert gw.sessions["user-sid"].est.turns == 1 and gw.session_ends["one-turn"] == 1
        assert gw.policy.counts()["done"] == 0  # ended sessions are forgotten

        # X-Session-End ends the session after its turn; DELETE ends an idle one
        await post(client, url, body, "hdr-sid", **{"X-Session-End": "true"})
        assert "hdr-sid" not in gw.sessions and gw.session_ends["client"] == 1
        async with client.delete(base + "/v1/sessions/body-sid") as r:
            assert r.status == 200 and (await r.json())["ended"] is True
        async with client.delete(base + "/v1/sessions/nope") as r:
            assert r.status == 404
        async with client.get(base + "/v1/sessions") as r:
            listing = await r.json()
        assert [d["id"] for d in listing["data"]] == ["user-sid"] and listing["data"][0]["state"] == "thinking"

    async with stack(kv_pool=1_000_000, require_session=True, session_header="X-Agent") as (up, gw, client, base):
        status, err, _ = await post(client, base + "/v1/completions", {"model": "m", "prompt": [1]})
        assert status == 400 and "session" in err["error"]["message"]
        async with client.post(base + "/v1/completions", json={"prompt": [1]}, headers={"X-Agent": "a"}) as r:
            assert r.status == 200
        assert set(gw.sessions) == {"a"}
        # Expect: 100-continue is answered by the gateway and not relayed (the upstream gets the whole body)
        async with client.post(
            base + "/v1/completions", json={"prompt": [1, 2]}, headers={"X-Agent": "a"}, expect100=True
        ) as r:
            assert r.status == 200
        seen = up.seen[-1]
        assert "Expect" not in seen["headers"] and int(seen["headers"]["Content-Length"]) == len(seen["raw"])


@timed(10)
async def test_parking_holds_the_second_session_until_the_first_ends() -> None:
    # C = 1000: the budgeter admits while D + d <= 750 and parks when D > 950
    async with stack(kv_pool=1000) as (up, gw, client, base):
        url = base + "/v1/completions"
        a = {"model": "m", "prompt": list(range(200)), "max_tokens": 400}  # d = 600
        status, _, _ = await post(client, url, a, "A")
        assert status == 200 and gw.policy.demand == 600
        t0 = time.monotonic()
        b_task = asyncio.create_task(post(client, url, {"model": "m", "prompt": [1] * 100, "max_tokens": 100}, "B"))
        await settle(lambda: gw.policy.counts()["waiting"] == 1)
        await asyncio.sleep(0.2)
        assert not b_task.done()  # held: no answer, no error
        async with client.get(base + "/v1/sessions") as r:
            states = {d["id"]: d["state"] for d in (await r.json())["data"]}
        assert states == {"A": "thinking", "B": "waiting"}
        # A's last turn ends A; B proceeds and its client sees only latency
        status, _, _ = await post(client, url, {**a, "prompt": list(range(250))}, "A", **{"X-Session-End": "true"})
        assert status == 200
        status, body, _ = await b_task
        assert status == 200 and body["choices"][0]["text"] == "ok ok ok "
        assert time.monotonic() - t0 >= 0.2
        assert gw.policy.state_of("B") is SessionState.THINKING and gw.policy.demand == 200
        assert gw.policy.waits == 1 and gw.park_wait.counts[-1] + sum(gw.park_wait.counts[:-1]) == 1


@timed(10)
async def test_park_timeout_answers_503_with_retry_after() -> None:
    async with stack(kv_pool=1000, max_park_s=0.2) as (up, gw, client, base):
        url = base + "/v1/completions"
        await post(client, url, {"prompt": list(range(600)), "max_tokens": 100}, "A")
        status, err, r = await post(client, url, {"prompt": [1] * 100, "max_tokens": 100}, "B")
        assert status == 503 and r.headers["Retry-After"] == "1" and err["error"]["type"] == "ParkTimeout"
        assert "B" not in gw.sessions and gw.session_ends["refused"] == 1 and gw.policy.demand == 700


@timed(10)
async def test_turns_of_one_session_are_serialised() -> None:
    async with stack(kv_pool=1_000_000) as (up, gw, client, base):
        up.delay_s = 0.1
        url = base + "/v1/completions"
        results = await asyncio.gather(*(post(client, url, {"prompt": [1] * (10 + i)}, "S") for i in range(3)))
        assert [r[0] for r in results] == [200, 200, 200]
        assert gw.sessions["S"].est.turns == 3 and gw.policy.counts()["in_system"] == 1


# -- faults -------------------------------------------------------------------------------------------------------
@timed(10)
async def test_upstream_killed_mid_stream() -> None:
    async with stack(kv_pool=1_000_000) as (up, gw, client, base):
        up.mode = "die"
        up.chunks = 5
        status, wire, _ = await post(client, base + "/v1/completions", {"prompt": [1] * 50, "stream": True}, "K")
        assert status == 200  # the status line was sent before the upstream died
        events = [e for e in wire.split(b"\n\n") if e]
        assert len(events) == 4 and b'"error"' in events[-2] and events[-1] == b"data: [DONE]"
        assert gw.upstream_errors["disconnect"] == 1 and gw.turns["failed"] == 1
        assert gw.policy.state_of("K") is SessionState.THINKING and gw.policy.demand == 0
        # the upstream comes back: the next turn goes through on a fresh connection
        up.mode = "ok"
        status, _, _ = await post(client, base + "/v1/completions", {"prompt": [1] * 60, "max_tokens": 5}, "K")
        assert status == 200 and gw.policy.demand == 65


@timed(10)
async def test_upstream_500_timeout_and_unreachable() -> None:
    async with stack(kv_pool=1_000_000, upstream_timeout_s=0.3) as (up, gw, client, base):
        url = base + "/v1/chat/completions"
        body = {"messages": [{"role": "user", "content": "x" * 400}], "max_tokens": 10}
        up.mode = "500"
        status, err, r = await post(client, url, body, "E")
        assert status == 502 and r.content_type == "application/json"
        assert "500" in err["error"]["message"] and "engine exploded" in err["error"]["message"]
        assert gw.policy.demand == 0
        up.mode = "hang"
        status, err, r = await post(client, url, {**body, "stream": True}, "E")
        assert status == 504 and err["error"]["type"] == "UpstreamTimeout"
        assert gw.policy.demand == 0
        assert gw.upstream_errors["http_5xx"] == 1 and gw.upstream_errors["timeout"] == 1
        await settle(lambda: up.cancelled == 1)  # the gateway dropped the connection: the upstream aborted
        up.mode = "ok"
        await up.stop()
        status, err, _ = await post(client, url, body, "E")
        assert status == 502 and "unreachable" in err["error"]["message"]
        assert gw.upstream_errors["connect"] == 1 and gw.policy.demand == 0
        assert gw.policy.state_of("E") is SessionState.THINKING


@timed(10)
async def test_client_disconnect_while_parked_and_while_streaming() -> None:
    async with stack(kv_pool=1000) as (up, gw, client, base):
        url = base + "/v1/completions"
        await post(client, url, {"prompt": list(range(600)), "max_tokens": 100}, "A")
        parked = asyncio.create_task(post(client, url, {"prompt": [1] * 100, "max_tokens": 100}, "B"))
        await settle(lambda: gw.policy.counts()["waiting"] == 1)
        parked.cancel()  # the client goes away while held
        with contextlib.suppress(asyncio.CancelledError):
            await parked
        await settle(lambda: "B" not in gw.sessions)
        assert gw.session_ends["disconnect"] == 1 and gw.policy.counts()["waiting"] == 0
        assert gw.policy.demand == 700

        # streaming: the client reads one chunk and leaves; the turn is aborted, its demand released
        up.chunks, up.chunk_delay_s = 20, 0.05
        async with client.post(url, json={"prompt": [1] * 100, "max_tokens": 50, "stream": True},
                               headers={"X-Session-ID": "A"}) as r:
            assert r.status == 200
            await r.content.readuntil(b"\n\n")
            assert gw.policy.state_of("A") is SessionState.RUNNING and gw.policy.demand == 150
            r.close()
        await settle(lambda: gw.policy.state_of("A") is SessionState.THINKING)
        assert gw.policy.demand == 0 and gw.turns["cancelled"] == 2
        await settle(lambda: up.cancelled == 1)  # the upstream request was aborted too
        await settle(lambda: gw.upstream_connections()["acquired"] == 0)


@timed(20)
async def test_two_thousand_sessions_expire_when_idle() -> None:
    # idle timeout 20 gateway-s at x20 = 1 real second
    async with stack(kv_pool=100_000_000, idle_timeout_s=20.0, time_scale=20.0) as (up, gw, client, base):
        url = base + "/v1/completions"
        sem = asyncio.Semaphore(64)
        body = json.dumps({"prompt": [7] * 50, "max_tokens": 10}).encode()

        async def one(i: int) -> int:
            async with sem, client.post(url, data=body, headers={"X-Session-ID": f"s{i}"}) as r:
                await r.read()
                return r.status

        statuses = await asyncio.gather(*(one(i) for i in range(2000)))
        assert statuses == [200] * 2000
        assert gw.policy.demand <= 2000 * 60
        a = gw.audit()
        assert a["demand"] == a["admitted_demand"]
        await settle(lambda: not gw.sessions, timeout=8.0)
        assert gw.policy.demand == 0 and gw.policy.counts()["in_system"] == 0
        assert gw.session_ends["idle"] == 2000 and not gw._sessions.idle  # noqa: SLF001
        assert gw.policy.counts()["done"] == 0  # forgotten: memory is bounded


@timed(10)
async def test_malformed_and_oversized_bodies() -> None:
    async with stack(kv_pool=1_000_000, max_body_bytes=4096) as (up, gw, client, base):
        url = base + "/v1/chat/completions"
        for raw in (b"{not json", b"[1, 2]", b""):
            status, err, r = await post(client, url, raw, "M")
            assert status == 400 and r.content_type == "application/json" and err["error"]["message"]
        status, err, _ = await post(client, url, {"messages": [{"role": "user", "content": "x" * 5000}]}, "M")
        assert status == 413 and "limit" in err["error"]["message"]

        async def chunked() -> AsyncIterator[bytes]:  # no Content-Length: the limit applies while reading
            for _ in range(10):
                yield b" " * 1000

        async with client.post(url, data=chunked(), headers={"X-Session-ID": "M"}) as r:
            assert r.status == 413
        assert up.seen == [] and gw.sessions == {}


# -- pass-through, auth, admin, metrics, time ------------------------------------------------------------------------
@timed(10)
async def test_passthrough_and_api_keys() -> None:
    async with stack(kv_pool=1_000_000) as (up, gw, client, base):
        hdrs = {"Authorization": "Bearer client-key", "Connection": "keep-alive, X-Drop", "X-Drop": "1", "X-Keep": "2"}
        async with client.get(URL(base + "/v1/models?x=1&y=%2F", encoded=True), headers=hdrs) as r:
            echo = await r.json()
            assert r.status == 200 and r.headers["X-Upstream"] == "yes"
        assert echo["method"] == "GET" and echo["path"] == "/v1/models?x=1&y=%2F"
        assert echo["headers"]["Authorization"] == "Bearer client-key" and echo["headers"]["X-Keep"] == "2"
        assert "X-Drop" not in echo["headers"]
        async with client.post(base + "/tokenize", data=b"abc") as r:
            assert (await r.json())["body"] == "abc"
        async with client.get(base + "//evil.example/x") as r:  # a path, never a host
            assert (await r.json())["path"] == "//evil.example/x"

    async with stack(kv_pool=1_000_000, api_keys=("k1", "k2"), upstream_api_key="up-key",
                     admin_token="adm") as (up, gw, client, base):
        url = base + "/v1/completions"
        status, err, _ = await post(client, url, {"prompt": [1]}, "S")
        assert status == 401 and err["error"]["type"] == "Unauthorized"
        status, _, _ = await post(client, url, {"prompt": [1]}, "S", Authorization="Bearer wrong")
        assert status == 401
        status, _, _ = await post(client, url, {"prompt": [1]}, "S", Authorization="Bearer k2")
        assert status == 200 and up.seen[-1]["headers"]["Authorization"] == "Bearer up-key"
        async with client.get(base + "/v1/models") as r:
            assert r.status == 401
        async with client.get(base + "/metrics") as r:
            assert r.status == 200


@timed(10)
async def test_admin_control_switch_and_token() -> None:
    async with stack(kv_pool=1000, control="none") as (up, gw, client, base):
        url = base + "/v1/completions"
        await post(client, url, {"prompt": list(range(600)), "max_tokens": 100}, "A")
        await post(client, url, {"prompt": list(range(600)), "max_tokens": 100}, "B")  # none: admitted
        assert gw.policy.counts()["admitted"] == 2
        async with client.post(base + "/admin/control", json={"control": "budgeter", "opts": {"low": 0.5}}) as r:
            state = await r.json()
            assert r.status == 200 and state["spec"] == "budgeter:low=0.5:high=0.95"
        # B's next boundary: D = 1400 > 950, so it is parked; A's turn then proceeds? A is the only admitted one
        b = asyncio.create_task(post(client, url, {"prompt": list(range(650)), "max_tokens": 100}, "B"))
        await settle(lambda: gw.policy.counts()["parked"] == 1)
        async with client.delete(base + "/v1/sessions/A") as r:
            assert r.status == 200
        status, _, _ = await b
        assert status == 200 and gw.policy.parks == 1 and gw.policy.readmissions == 1
        async with client.post(base + "/admin/control", json={"control": "budgeter", "opts": {"low": 7}}) as r:
            assert r.status == 400
        async with client.post(base + "/admin/control", json={"control": "cap:K=3"}) as r:
            assert r.status == 200 and (await r.json())["spec"] == "cap:K=3:K_hi=6"
        # a count no JSON reader keeps (the state could not be answered after it) and a timer that would spin:
        # refused before anything changes, the gateway's state still answered
        for bad in ({"control": "cap", "opts": {"K": 1e20}}, {"control": "cap:K=99999999999999999999999"},
                    {"control": "thunder:interval_s=1e-300"}, {"control": "aimd", "opts": {"interval_s": 5e-324}}):
            async with client.post(base + "/admin/control", json=bad) as r:
                assert r.status == 400 and (await r.json())["error"]["type"] == "PolicyError", bad
        assert gw.control.spec() == "cap:K=3:K_hi=6"
        async with client.get(base + "/kvgate/info") as r:
            assert r.status == 200

    async with stack(kv_pool=1000, admin_token="secret") as (up, gw, client, base):
        async with client.post(base + "/admin/control", json={"control": "none"}) as r:
            assert r.status == 401
        async with client.get(base + "/v1/sessions") as r:
            assert r.status == 401
        hdr = {"Authorization": "Bearer secret"}
        async with client.post(base + "/admin/control", json={"control": "none"}, headers=hdr) as r:
            assert r.status == 200 and gw.control.name == "none"


@timed(10)
async def test_metrics_exposition() -> None:
    async with stack(kv_pool=1000) as (up, gw, client, base):
        url = base + "/v1/completions"
        await post(client, url, {"prompt": list(range(600)), "max_tokens": 100}, "A")
        b = asyncio.create_task(post(client, url, {"prompt": [1] * 200, "max_tokens": 100}, "B"))
        await settle(lambda: gw.policy.counts()["waiting"] == 1)
        async with client.get(base + "/metrics") as r:
            text = await r.text()
        values = {}
        for line in text.splitlines():
            if line.startswith("kvgate_"):
                name, _, v = line.rpartition(" ")
                values[name] = float(v)
        assert values["kvgate_sessions_in_system"] == 2 and values["kvgate_sessions_waiting"] == 1
        assert values["kvgate_demand_tokens"] == 700 and values["kvgate_kv_pool_tokens"] == 1000
        assert values["kvgate_demand_ratio"] == pytest.approx(0.7)
        assert values['kvgate_agent_hit_ratio{window="5m"}'] == pytest.approx(0.5)
        assert values["kvgate_regime_alarm"] == 0
        assert values["kvgate_waits_total"] == 1
        assert 'kvgate_park_wait_seconds_bucket{le="+Inf"}' in values
        assert "kvgate_turn_latency_seconds_count" in values
        assert 'kvgate_upstream_errors_total{kind="timeout"}' in values
        # every kvgate_ series the Grafana dashboard plots is exposed
        dash = json.loads((Path(__file__).resolve().parents[2] / "docs" / "grafana-kvgate.json").read_text())
        exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
        names = {m for e in exprs for m in re.findall(r"kvgate_[a-z_]+", e)}
        exposed = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line.startswith("kvgate_")}
        assert names and names <= exposed, names - exposed
        async with client.delete(base + "/v1/sessions/A") as r:
            assert r.status == 200
        await b


@timed(10)
async def test_control_at_and_policy_timers_run_on_the_scaled_clock() -> None:
    # control from gateway minute 0.5 (30 s) at x200: 0.15 real seconds; AIMD ticks every 1 gateway-s (5 ms)
    async with stack(kv_pool=1000, control="aimd", control_opt="interval_s=1.0,K0=4", control_at=0.5,
                     time_scale=200.0) as (up, gw, client, base):
        assert gw.control.name == "none"
        await settle(lambda: gw.control.name == "aimd")
        assert gw.now() >= 30.0
        await post(client, base + "/v1/completions", {"prompt": [1]}, "T")  # a fast turn: K grows
        await settle(lambda: gw.control.K > 4)  # type: ignore[attr-defined]
        deadline = gw.policy.next_deadline()
        assert deadline is not None and deadline > gw.now() - 2.0


@timed(10)
async def test_graceful_stop_finishes_turns_in_flight_and_refuses_held_ones() -> None:
    up = FakeUpstream()
    await up.start()
    gw = Gateway(GatewayConfig(upstream=up.url, kv_pool=1000, shutdown_grace_s=3.0))
    port = await gw.start("127.0.0.1", 0)
    url = f"http://127.0.0.1:{port}/v1/completions"
    async with aiohttp.ClientSession() as client:
        try:
            await post(client, url, {"prompt": list(range(600)), "max_tokens": 100}, "A")
            up.delay_s = 0.4
            a = asyncio.create_task(post(client, url, {"prompt": list(range(600)), "max_tokens": 100}, "A"))
            b = asyncio.create_task(post(client, url, {"prompt": [1] * 200, "max_tokens": 100}, "B"))
            await settle(lambda: gw.policy.counts()["waiting"] == 1 and gw.in_flight == 1)
            stopping = asyncio.create_task(gw.stop())
            status_b, err_b, _ = await b
            assert status_b == 503 and err_b["error"]["type"] == "ShuttingDown"
            status_a, _, _ = await a
            assert status_a == 200
            await stopping
            check_clean(gw)
        finally:
            await gw.stop()
            await up.stop()


# -- KV pool detection and the command line ---------------------------------------------------------------------
@timed(10)
async def test_kv_pool_auto_detection() -> None:
    # C is what vLLM's scheduler can fill: (num_gpu_blocks - 1) x block_size (block 0 is its null block)
    async with stack() as (up, gw, client, base):
        assert gw.kv_pool == 999 * 16 and gw.control_state()["kv_pool_source"] == "/metrics"
        assert gw.upstream_info.kind == "vllm" and gw.upstream_info.block_size == 16
    # kv_cache_size_tokens is vLLM's max_model_len x concurrency, not the pool: the block count wins
    both = VLLM_METRICS.replace('num_gpu_blocks="1000"', 'num_gpu_blocks="1000",kv_cache_size_tokens="16010"')
    async with stack(FakeUpstream(metrics=both)) as (up, gw, client, base):
        assert gw.kv_pool == 15_984
    sized = VLLM_METRICS.replace('num_gpu_blocks="1000"', 'kv_cache_size_tokens="400000"')
    async with stack(FakeUpstream(metrics=sized)) as (up, gw, client, base):
        assert gw.kv_pool == 400_000
    async with stack(FakeUpstream(metrics=None, server_info={"max_total_num_tokens": 12345})) as (up, gw, _, _b):
        assert gw.kv_pool == 12345 and gw.control_state()["kv_pool_source"] == "/server_info"
        assert gw.upstream_info.kind == "sglang"
    # vLLM with VLLM_SERVER_DEV_MODE=1 answers /server_info too: still vLLM, C from its metrics
    dev = {"vllm_config": "max_total_num_tokens=5", "vllm_env": {}, "system_env": {}}
    async with stack(FakeUpstream(server_info=dev)) as (up, gw, _, _b):
        assert gw.kv_pool == 15_984 and gw.upstream_info.kind == "vllm"

    up = FakeUpstream(metrics="vllm:num_requests_running 0\n")
    await up.start()
    try:
        with pytest.raises(PoolNotFound, match="pass --kv-pool"):
            await Gateway(GatewayConfig(upstream=up.url)).start("127.0.0.1", 0)
    finally:
        await up.stop()


@timed(10)
async def test_kv_pool_is_read_again_after_the_upstream_restarts() -> None:
    async with stack() as (up, gw, client, base):
        url = base + "/v1/completions"
        assert gw.kv_pool == 15_984
        port = up.port
        await up.stop()
        status, _, _ = await post(client, url, {"prompt": [1]}, "R")
        assert status == 502
        up.metrics = VLLM_METRICS.replace('"1000"', '"2001"')  # the engine restarts with a larger pool
        await up.start(port)
        status, _, _ = await post(client, url, {"prompt": [1]}, "R")
        assert status == 200
        await settle(lambda: gw.kv_pool == 32_000)
        assert gw.control.kv_pool == 32_000


@timed(10)
async def test_every_turn_says_what_the_gateway_did_and_info_names_the_upstream() -> None:
    # C = 1000: A (d = 600) is admitted at once; B waits until A's session ends
    async with stack() as (up, gw, client, base):
        async with client.get(base + "/kvgate/info") as r:
            info = await r.json()
        assert info["kvgate"] == "gateway" and info["kv_pool"] == 15_984 and info["parks"] == 0
        assert info["upstream"]["kind"] == "vllm" and info["upstream"]["kv_pool"] == 15_984
        assert info["upstream"]["block_size"] == 16 and info["upstream"]["num_gpu_blocks"] == 1000
        assert info["control"] == "budgeter" and info["spec"] == gw.control.spec()
    async with stack(kv_pool=1000) as (up, gw, client, base):
        url = base + "/v1/completions"
        status, _, r = await post(client, url, {"prompt": list(range(200)), "max_tokens": 400}, "A")
        assert status == 200 and r.headers["X-Kvgate-Park-Wait"] == "0" and r.headers["X-Kvgate-Hold"] == "none"
        assert r.headers["X-Kvgate-Control"] == gw.control.spec() and r.headers["X-Kvgate-Control"].startswith("budg")
        b = asyncio.create_task(post(client, url, {"prompt": [1] * 100, "max_tokens": 100, "stream": True}, "B"))
        await settle(lambda: gw.policy.counts()["waiting"] == 1)
        await asyncio.sleep(0.3)
        await post(client, url, {"prompt": [1], "max_tokens": 1}, "A", **{"X-Session-End": "true"})
        status, _, rb = await b
        assert status == 200 and rb.headers["X-Kvgate-Hold"] == "waiting"
        assert float(rb.headers["X-Kvgate-Park-Wait"]) >= 0.3  # held at least the time A took to end
        # an admitted session parked at its boundary says "parked"; its wait is in gateway seconds
        await post(client, url, {"prompt": list(range(300)), "max_tokens": 250}, "C")  # D = 200 + 550 = 750
        gw.set_control("budgeter", {"low": 0.5, "high": 0.6})  # D > high x C: B's next boundary parks
        b2 = asyncio.create_task(post(client, url, {"prompt": [1] * 110, "max_tokens": 100}, "B"))
        await settle(lambda: gw.policy.counts()["parked"] == 1)
        async with client.get(base + "/kvgate/info") as r:
            info = await r.json()
        assert info["parks"] == 1 and info["waits"] == 1 and info["sessions"]["parked"] == 1
        assert info["upstream"]["kind"] == "vllm"  # discovered best-effort although C was given
        async with client.delete(base + "/v1/sessions/C") as r:  # D falls to 0: B is admitted again
            assert r.status == 200
        status, _, rb2 = await b2
        assert status == 200 and rb2.headers["X-Kvgate-Hold"] == "parked"
        assert float(rb2.headers["X-Kvgate-Park-Wait"]) > 0
        assert rb2.headers["X-Kvgate-Control"] == "budgeter:low=0.5:high=0.6"
    # a refusal after --max-park-s and an upstream failure carry the headers too
    async with stack(kv_pool=1000, max_park_s=0.2) as (up, gw, client, base):
        url = base + "/v1/completions"
        await post(client, url, {"prompt": list(range(200)), "max_tokens": 400}, "A")
        status, _, r = await post(client, url, {"prompt": [1] * 100, "max_tokens": 100}, "B")
        assert status == 503 and r.headers["X-Kvgate-Hold"] == "waiting"
        assert float(r.headers["X-Kvgate-Park-Wait"]) >= 0.2
        up.mode = "500"
        status, _, r = await post(client, url, {"prompt": [1], "max_tokens": 1}, "A")
        assert status == 502 and r.headers["X-Kvgate-Hold"] == "none"


@timed(10)
async def test_a_client_gone_mid_stream_closes_the_upstream_connection() -> None:
    # vLLM aborts a request when its connection closes; the gateway must close it when its client goes away
    async with stack(kv_pool=1_000_000) as (up, gw, client, base):
        up.chunks, up.chunk_delay_s = 50, 0.05
        body = json.dumps({"prompt": [1, 2, 3], "max_tokens": 50, "stream": True}).encode()
        r = await client.post(base + "/v1/completions", data=body, headers={"X-Session-ID": "gone"})
        assert r.status == 200
        await r.content.readany()  # the first chunk has arrived: the upstream is mid-stream
        r.close()  # the client goes away
        await settle(lambda: up.cancelled == 1)  # the upstream saw its connection close and dropped the request
        await settle(lambda: gw.turns["cancelled"] == 1)
        assert up.streamed < 50 and gw.policy.state_of("gone") is not SessionState.RUNNING


def _gateway_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvgate.cli", "gateway", "--host", "127.0.0.1", *args]


@timed(15)
async def test_command_startup_error_and_sigterm() -> None:
    up = FakeUpstream(metrics="nothing here\n")
    await up.start()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    try:
        proc = await asyncio.create_subprocess_exec(
            *_gateway_cmd("--upstream", up.url, "--port", "0"), stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE, env=env,
        )
        out, err = await proc.communicate()
        assert proc.returncode == 2
        lines = err.decode().strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvgate: error: cannot find the KV pool size")

        # a running gateway stops on SIGTERM after its turn in flight finishes
        up.delay_s = 0.5
        proc = await asyncio.create_subprocess_exec(
            *_gateway_cmd("--upstream", up.url, "--port", "0", "--kv-pool", "5000", "--log-level", "info",
                          "--loop", "asyncio"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
        )
        assert proc.stderr is not None
        port = 0
        while not port:
            line = await proc.stderr.readline()
            assert line, "the gateway exited before it was ready"
            rec = json.loads(line)
            if rec.get("event") == "ready":
                port = rec["port"]
        seen = len(up.seen)
        async with aiohttp.ClientSession() as client:
            turn = asyncio.create_task(post(client, f"http://127.0.0.1:{port}/v1/completions", {"prompt": [1]}, "S"))
            await settle(lambda: len(up.seen) == seen + 1)
            proc.send_signal(signal.SIGTERM)
            status, body, _ = await turn
            assert status == 200 and body["usage"]["prompt_tokens"] == 1
        rest = await proc.stderr.read()
        assert await proc.wait() == 0
        events = [json.loads(x).get("event") for x in rest.decode().splitlines() if x.startswith("{")]
        assert "stop" in events and "stopped" in events
    finally:
        await up.stop()
