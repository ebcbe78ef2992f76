"""The gateway following its upstreams' KV events (``--kv-events``): against real ``kvgate engine`` servers
publishing vLLM's events (in-process, loopback, ipc sockets in the test's directory).

* prefix-affinity places a session the gateway does not know (its earlier gateway is gone) on the replica that
  holds its blocks, and does not without the events;
* ``budgeter-resident`` admits a new session that the plain budgeter keeps waiting once the engine's prefix cache
  is reset (a thinking session's prefix is gone), with D and the session's resident tokens in ``GET /v1/sessions``;
* the options: one-line errors for bad endpoints, the ``--upstreams`` file's ``kv-events=`` field.

Every test is bounded by ``timed``; waits are bounded polls, never timing assertions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvgate.errors import UsageError
from kvgate.gateway.app import Gateway
from kvgate.gateway.config import GatewayConfig, KVEventsSource, parse_kv_events, read_upstreams
from kvgate.policy import Timer
from kvgate.serve.app import EngineServer
from kvgate.serve.config import ServerConfig
from kvgate.serve.kvevents import parse_kv_events_config
from support.aio import timed
from support.wait import until_async

MODEL = "Qwen/Qwen3-8B"
FAST = 2000.0
POOL = 2048
"""Each engine's KV pool (and C): the budgeter admits while D + d_s <= 1536."""


def _events(tmp: Path, name: str) -> tuple[ServerConfig, KVEventsSource]:
    pub, replay = f"ipc://{tmp}/{name}.pub", f"ipc://{tmp}/{name}.replay"
    raw = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay}
    cfg = ServerConfig(time_scale=FAST, kv_pool=POOL, kv_events=parse_kv_events_config(json.dumps(raw)))
    return cfg, KVEventsSource(pub, replay)


@contextlib.asynccontextmanager
async def _engines(tmp: Path, n: int) -> AsyncIterator[list[tuple[str, KVEventsSource, EngineServer]]]:
    servers: list[EngineServer] = []
    out = []
    try:
        for i in range(n):
            cfg, src = _events(tmp, f"e{i}")
            server = EngineServer(cfg)
            servers.append(server)
            port = await server.start("127.0.0.1", 0)
            out.append((f"http://127.0.0.1:{port}", src, server))
        yield out
    finally:
        for server in servers:
            with contextlib.suppress(Exception):  # (a test may have stopped it)
                await server.stop()


@contextlib.asynccontextmanager
async def _gateway(**cfg: Any) -> AsyncIterator[tuple[Gateway, str]]:
    gw = Gateway(GatewayConfig(health_interval_s=0.2, **cfg))
    port = await gw.start("127.0.0.1", 0)
    try:
        yield gw, f"http://127.0.0.1:{port}"
    finally:
        await gw.stop()


def _ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 100000) for _ in range(n)]


async def _complete(http: aiohttp.ClientSession, base: str, sid: str, prompt: list[int], n: int = 16) -> None:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n}
    async with http.post(base + "/v1/completions", json=body, headers={"X-Session-ID": sid}) as r:
        assert r.status == 200, await r.text()
        await r.read()


async def _get(http: aiohttp.ClientSession, url: str) -> Any:
    async with http.get(url) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def _joined(http: aiohttp.ClientSession, url: str, sub: Any) -> None:
    """Warm-up requests straight to the engine until the gateway's subscription to it is live (a ZMQ SUB joins
    asynchronously; its first message makes it replay what it missed before)."""
    rng = random.Random(0)
    for i in range(100):
        await _complete(http, url, f"warmup{i}", _ids(rng, 40), 2)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(sub.connected.wait(), 0.1)
            return
    raise AssertionError("the gateway's subscriber never received a message")


def _session(listing: dict[str, Any], sid: str) -> dict[str, Any]:
    return next(s for s in listing["data"] if s["id"] == sid)


# -- prefix-affinity ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("events", [True, False])
@timed(60)
async def test_prefix_affinity_places_a_session_where_its_blocks_are(tmp_path: Path, events: bool) -> None:
    """alice's and bob's earlier turns went straight to replicas 1 and 0 (their gateway is gone): a gateway
    following the KV events places each where it is resident; one without them sends both to replica 0 (no KV
    in use anywhere: the lowest index)."""
    rng = random.Random(3)
    alice, bob = _ids(rng, 400), _ids(rng, 300)
    async with _engines(tmp_path, 2) as eps, aiohttp.ClientSession() as http:
        urls = [u for u, _, _ in eps]
        kv = tuple(src for _, src, _ in eps) if events else ()
        async with _gateway(upstream=urls[0], upstreams=(urls[1],), router="prefix-affinity", kv_events=kv) as (
            gw, base,
        ):
            if events:
                for rep in gw.fleet.replicas:
                    await _joined(http, rep.url, rep.events)
            await _complete(http, urls[1], "alice", alice)
            await _complete(http, urls[0], "bob", bob)
            if events:
                reps = gw.fleet.replicas

                async def seen() -> bool:
                    return reps[1].events.known("alice") and reps[0].events.known("bob")  # type: ignore[no-any-return]

                await until_async(seen, "both replicas' stores at the gateway")
                assert reps[0].events.known("alice") is None and reps[1].events.known("bob") is None  # not named there
            # their next turns (the same prefix, more appended), through the gateway
            await _complete(http, base, "alice", alice + _ids(rng, 50))
            await _complete(http, base, "bob", bob + _ids(rng, 50))
            listing = await _get(http, base + "/v1/sessions")
            placed = {sid: _session(listing, sid)["replica"] for sid in ("alice", "bob")}
            metrics = await _get_text(http, base + "/metrics")
            if events:  # replica 1 goes away: its view is cleared, alice is placed anew on replica 0
                await eps[1][2].stop()
                rep = gw.fleet.replicas[1]

                async def down() -> bool:
                    return not rep.up

                await until_async(down, "replica 1 marked down")
                st = rep.events.stats()
                assert st["resident_tokens"] == 0 and not st["synced"] and rep.events.known("alice") is None
                a = _session(await _get(http, base + "/v1/sessions"), "alice")
                assert a["replica"] == urls[0]
    if events:
        assert placed == {"alice": urls[1], "bob": urls[0]}
        a = _session(listing, "alice")
        assert a["resident_tokens"] >= 400 - 16  # its first turn's full blocks at least, as the gateway saw them
        per = {r["replica"]: r["kv_events"] for r in listing["replicas"]}
        assert per[urls[1]]["synced"] and per[urls[1]]["resident_tokens"] >= a["resident_tokens"]
        assert per[urls[1]]["gaps"] == 0 and per[urls[1]]["events"] > 0
        assert f'kvgate_replica_resident_tokens{{replica="{urls[1]}"}}' in metrics
    else:
        assert placed == {"alice": urls[0], "bob": urls[0]}
        assert _session(listing, "alice")["resident_tokens"] is None
        assert "kvgate_replica_resident_tokens" not in metrics


async def _get_text(http: aiohttp.ClientSession, url: str) -> str:
    async with http.get(url) as r:
        assert r.status == 200
        return await r.text()


# -- budgeter-resident -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("control", ["budgeter-resident", "budgeter"])
@timed(60)
async def test_after_a_cache_reset_the_corrected_budget_admits_what_the_plain_one_parks(
    tmp_path: Path, control: str
) -> None:
    """A (1000 + 16 tokens) thinks; B (800 + 16) waits: D + d_B = 1832 > 0.75 C = 1536. The engine's prefix cache
    is reset: A holds nothing now. budgeter-resident counts A's output budget alone (16 + 816 <= 1536) and admits
    B; the plain budgeter keeps B waiting until A ends."""
    rng = random.Random(7)
    async with _engines(tmp_path, 1) as eps, aiohttp.ClientSession() as http:
        (url, src, _), = eps
        async with _gateway(upstream=url, kv_pool=POOL, control=control, kv_events=(src,)) as (gw, base):
            await _joined(http, url, gw.fleet.replicas[0].events)
            await _complete(http, base, "A", _ids(rng, 1000))

            async def listing() -> dict[str, Any]:
                return await _get(http, base + "/v1/sessions")  # type: ignore[no-any-return]

            async def a_resident() -> bool:
                return (_session(await listing(), "A")["resident_tokens"] or 0) >= 1000 - 16

            await until_async(a_resident, "A's blocks at the gateway")
            b = asyncio.create_task(_complete(http, base, "B", _ids(rng, 800)))

            async def b_waiting() -> bool:
                got = [s for s in (await listing())["data"] if s["id"] == "B"]
                return bool(got) and got[0]["state"] == "waiting"

            await until_async(b_waiting, "B held")
            before = await listing()
            assert before["summary"]["demand_tokens"] == 1016 and _session(before, "A")["state"] == "thinking"

            async with http.post(base + "/reset_prefix_cache") as r:  # passed through to the engine
                assert r.status == 200

            async def a_gone() -> bool:
                return _session(await listing(), "A")["resident_tokens"] == 0

            await until_async(a_gone, "the clear at the gateway")
            if control == "budgeter-resident":
                await asyncio.wait_for(b, 30)
                after = await listing()
                assert _session(after, "B")["state"] == "thinking"
                assert after["summary"]["demand_tokens"] == 1016 + 816  # D itself is the paper's; D_meas admitted B
                assert _session(after, "A")["resident_tokens"] == 0

                async def b_resident() -> bool:  # (B's stores reach the gateway a step after they happen)
                    return (_session(await listing(), "B")["resident_tokens"] or 0) >= 800 - 16

                await until_async(b_resident, "B's blocks at the gateway")
            else:
                assert gw.policy.handle(Timer(gw.now())) == []  # asked again: still no room by D
                assert _session(await listing(), "B")["state"] == "waiting"
                async with http.delete(base + "/v1/sessions/A") as r:
                    assert r.status == 200
                await asyncio.wait_for(b, 30)
            assert not b.cancelled()
            audit = gw.audit()
            assert audit["demand"] == audit["admitted_demand"] and not audit["orphans"]


@timed(30)
async def test_switching_to_the_resident_control_needs_events_and_feeds_it(tmp_path: Path) -> None:
    """Switching to budgeter-resident at run time needs KV events (400 without); with them its policy is fed."""
    async with _engines(tmp_path, 1) as eps, aiohttp.ClientSession() as http:
        (url, src, _), = eps
        async with _gateway(upstream=url, kv_pool=POOL) as (_gw, base):
            r = await http.post(base + "/admin/control", json={"control": "budgeter-resident"})
            assert r.status == 400 and "kv-events" in (await r.json())["error"]["message"]
        async with _gateway(upstream=url, kv_pool=POOL, kv_events=(src,)) as (gw, base):
            async with http.post(base + "/admin/control", json={"control": "budgeter-resident"}) as r:
                assert r.status == 200
            assert gw.control.name == "budgeter-resident" and gw.policy.residency is not None


# -- options -----------------------------------------------------------------------------------------------------


def test_kv_events_options() -> None:
    assert parse_kv_events("tcp://10.0.0.5:5557") == KVEventsSource("tcp://10.0.0.5:5557")
    assert parse_kv_events(" tcp://h:5557,tcp://h:5558 ") == KVEventsSource("tcp://h:5557", "tcp://h:5558")
    assert parse_kv_events("-") is None and parse_kv_events("none") is None
    assert parse_kv_events("ipc:///tmp/kv.pub") == KVEventsSource("ipc:///tmp/kv.pub")
    for bad in ("foo", "tcp://*:5557", "tcp://h:x", "tcp://h:0", "tcp://h:1,tcp://h:1", "tcp://h:1,", "udp://h:1"):
        with pytest.raises(UsageError):
            parse_kv_events(bad)
    up = "http://127.0.0.1:1"
    for cfg in (
        GatewayConfig(upstream=up, kv_events=(None, None)),  # more than the upstreams
        GatewayConfig(upstream=up, control="budgeter-resident"),  # no events to read
        GatewayConfig(upstream=up, kv_events=(KVEventsSource("tcp://*:5557"),)),
    ):
        with pytest.raises(UsageError):
            cfg.validate()
    GatewayConfig(
        upstream=up, kv_events=(KVEventsSource("tcp://127.0.0.1:5557"),), control="budgeter-resident"
    ).validate()


def test_upstreams_file_with_kv_events(tmp_path: Path) -> None:
    f = tmp_path / "ups.txt"
    f.write_text("# fleet\nhttp://127.0.0.1:8101 kv-events=tcp://127.0.0.1:5557,tcp://127.0.0.1:5558\n"
                 "http://127.0.0.1:8102   # no events\n")
    urls, events = read_upstreams(f)
    assert urls == ("http://127.0.0.1:8101", "http://127.0.0.1:8102")
    assert events == (KVEventsSource("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"), None)
    f.write_text("http://127.0.0.1:8101 events=tcp://127.0.0.1:5557\n")
    with pytest.raises(UsageError, match=":1: unknown field"):
        read_upstreams(f)


def test_bad_kv_events_are_one_line_and_exit_2(tmp_path: Path) -> None:
    f = tmp_path / "ups.txt"
    f.write_text("http://127.0.0.1:8101 kv-events=tcp://127.0.0.1:5557\n")
    toml = tmp_path / "gw.toml"
    toml.write_text('upstream = "http://127.0.0.1:1"\nkv-events = ["tcp://127.0.0.1:5557", "-"]\n')
    cases = [
        ["--config", str(toml)],
        ["--upstream", "http://127.0.0.1:1", "--kv-events", "tcp://*:5557"],
        ["--upstream", "http://127.0.0.1:1", "--kv-events", "localhost:5557"],
        ["--upstream", "http://127.0.0.1:1", "--kv-events", "-", "--kv-events", "-"],
        ["--upstream", "http://127.0.0.1:1", "--control", "budgeter-resident"],
        ["--upstreams", str(f), "--kv-events", "tcp://127.0.0.1:5557"],
    ]
    for args in cases:
        p = subprocess.run([sys.executable, "-m", "kvgate.cli", "gateway", *args], capture_output=True, text=True,
                           timeout=60)
        assert p.returncode == 2, (args, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith("kvgate: error: "), (args, p.stderr)
