"""A restart that loses nothing (``kvgate.gateway.store``, ``kvgate.gateway.books``): the session books on disk,
restored by a gateway started again on its state directory — D, every admitted session's demand, lineage's index
(a conversation that names nothing is found again), held and released sessions out of D, the clock, the control
switched at run time and the release bound; then ``kvgate gateway`` SIGKILLed mid-turn and started again."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path
from typing import Any

import aiohttp

from kvgate.gateway import Gateway, GatewayConfig
from kvgate.serve.app import EngineServer
from kvgate.serve.config import ServerConfig
from support.aio import timed
from support.fake_upstream import FakeUpstream, check_clean, post

SYSTEM = {"role": "system", "content": "You are a coding agent. " * 100}
MODEL = "Qwen/Qwen3-8B"


def chat(i: int, k: int) -> dict[str, Any]:
    msgs: list[Any] = [SYSTEM, {"role": "user", "content": f"task {i} " * 30}]
    for j in range(k):
        msgs += [{"role": "assistant", "content": f"step {i}.{j}"}, {"role": "user", "content": f"result {i}.{j}"}]
    return {"model": "m", "messages": msgs, "max_tokens": 8}


@timed(60)
async def test_a_gateway_started_again_on_its_state_dir_goes_on_with_its_books(tmp_path: Path) -> None:
    up = FakeUpstream()
    await up.start()
    cfg = GatewayConfig(upstream=up.url, state_dir=str(tmp_path / "state"), time_scale=10.0, kv_pool=100_000,
                        state_flush_s=0.05)
    client = aiohttp.ClientSession()
    try:
        gw = Gateway(cfg)
        base = f"http://127.0.0.1:{await gw.start('127.0.0.1', 0)}"
        for k in range(3):
            for i in range(4):
                status, _, r = await post(client, base + "/v1/chat/completions", chat(i, k))
                assert status == 200
            await post(client, base + "/v1/chat/completions", chat(100, k), "named-1")
        async with client.post(base + "/admin/control", json={"control": "budgeter", "opts": {"low": 0.6}}) as ctl:
            assert ctl.status == 200
        before = {s.sid: (gw.policy.demand_of(s.sid), s.est.turns, s.name.label) for s in gw.sessions.values()}
        d_before, t_before = gw.policy.demand, gw.now()
        assert len(before) == 5 and d_before > 0
        await gw.stop()  # (a clean stop flushes; the SIGKILL test below loses the flush interval at most)

        gw2 = Gateway(cfg)
        base = f"http://127.0.0.1:{await gw2.start('127.0.0.1', 0)}"
        assert gw2.now() >= t_before  # the clock goes on
        assert gw2.policy.demand == d_before  # D is back at once
        after = {s.sid: (gw2.policy.demand_of(s.sid), s.est.turns, s.name.label) for s in gw2.sessions.values()}
        assert after == before
        assert gw2.control.spec() == "budgeter:low=0.6:high=0.95"  # the control switched at run time
        assert gw2.sessions_state()["lineage"]["sessions"] == 4
        # the conversations go on where they were: the same sessions, by lineage and by name
        for i in range(4):
            status, _, r = await post(client, base + "/v1/chat/completions", chat(i, 3))
            assert status == 200 and r.headers["X-Kvgate-Lineage"] == "continue"
            assert gw2.sessions[r.headers["X-Kvgate-Session"]].est.turns == 4
        status, _, r = await post(client, base + "/v1/chat/completions", chat(100, 3), "named-1")
        assert status == 200 and gw2.sessions["named-1"].est.turns == 4
        assert len(gw2.sessions) == 5
        check_clean(gw2)
        await gw2.stop()
    finally:
        await client.close()
        await up.stop()


def served(i: int, k: int, out: int) -> dict[str, Any]:
    """Turn k of conversation i for kvgate engine, asking ``out`` tokens."""
    return {**chat(i, k), "max_tokens": out, "model": MODEL}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


async def wait_up(url: str, timeout: float = 30.0) -> None:
    async with aiohttp.ClientSession() as c:
        for _ in range(int(timeout / 0.05)):
            try:
                async with c.get(url + "/kvgate/info") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.05)
    raise AssertionError(f"{url} did not come up")


@timed(120)
async def test_sigkilled_mid_turn_and_started_again(tmp_path: Path) -> None:
    scale = 5.0  # slow enough that turns are in flight at the kill
    eng = EngineServer(ServerConfig(kv_pool=400_000, time_scale=scale))
    eng_port = await eng.start("127.0.0.1", 0)
    port = free_port()
    args = [sys.executable, "-m", "kvgate.cli", "gateway", "--upstream", f"http://127.0.0.1:{eng_port}",
            "--port", str(port), "--time-scale", str(scale), "--state-dir", str(tmp_path / "state"),
            "--state-flush", "0.05", "--log-level", "warning"]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), "src") if p)}
    base = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        await wait_up(base)
        async with aiohttp.ClientSession() as c:
            for i in range(6):  # six conversations naming nothing, two turns each
                for k in range(2):
                    status, _, _ = await post(c, base + "/v1/chat/completions", served(i, k, 4))
                    assert status == 200
            async with c.get(base + "/v1/sessions") as r:
                listing = await r.json()
            d_before = listing["summary"]["demand_tokens"]
            ids = {d["id"] for d in listing["data"]}
            await asyncio.sleep(0.3)  # (a flush interval and more)
            # two turns in flight at the kill: long outputs on the slow engine
            inflight = [asyncio.create_task(post(c, base + "/v1/chat/completions", served(i, 2, 2000)))
                        for i in (0, 1)]
            await asyncio.sleep(0.5)
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)
            got = await asyncio.gather(*inflight, return_exceptions=True)
            assert all(isinstance(g, aiohttp.ClientError) for g in got), got  # their clients saw the connection drop
            proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
            await wait_up(base)
            async with c.get(base + "/v1/sessions") as r:
                listing = await r.json()
            assert {d["id"] for d in listing["data"]} == ids  # nothing lost
            d_after = listing["summary"]["demand_tokens"]
            assert abs(d_after - d_before) <= 0.1 * d_before + 2 * 2000  # the in-flight turns' new budgets
            for i in range(6):  # every conversation goes on in its own session
                status, _, r = await post(c, base + "/v1/chat/completions", served(i, 2, 4))
                assert status == 200 and r.headers["X-Kvgate-Session"] in ids
            async with c.get(base + "/kvgate/info") as r:
                info = await r.json()
            assert info["resolution"]["store"]["path"].endswith("gateway.sqlite")
            assert json.dumps(info)  # (answerable)
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
        await eng.stop()
