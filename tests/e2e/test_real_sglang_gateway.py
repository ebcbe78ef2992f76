"""kvgate in front of a real SGLang (0.5.23, its CPU engine, the tiny random-weight Llama): pool discovery from
``/server_info``, SGLang's cached tokens per turn (prompt + output - 1 of the previous turn, its radix cache),
``/flush_cache`` refused while requests run, parking under the budgeter, a client disconnect aborting upstream,
``kvgate doctor`` and ``kvgate drive``.

One shared server (``real_sglang_server``: 8,192 tokens, page size 1) serves every test. Prompts are words of the
tiny model's vocabulary, one token each, so lengths are exact and a decoded reply tokenizes back to its own ids;
decoding is greedy, so every run samples the same replies.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvgate.drive.client import Client
from kvgate.drive.prompts import WORDS
from kvgate.gateway import Gateway, GatewayConfig
from kvgate.realsglang.server import RealSglang
from kvgate.records import load_run
from support.aio import timed
from support.real_vllm import metric
from support.sglang_server import SHARED_POOL

pytestmark = pytest.mark.real_sglang
SRC = str(Path(__file__).resolve().parents[2] / "src")
MODEL = "tiny-llama"


@contextlib.asynccontextmanager
async def gateway(upstream: str, **cfg: Any) -> AsyncIterator[tuple[Gateway, str, aiohttp.ClientSession]]:
    gw = Gateway(GatewayConfig(upstream=upstream, **cfg))
    client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))
    try:
        port = await gw.start("127.0.0.1", 0)
        yield gw, f"http://127.0.0.1:{port}", client
    finally:
        await client.close()
        await gw.stop()


async def get_json(client: aiohttp.ClientSession, url: str) -> Any:
    async with client.get(url) as r:
        assert r.status == 200, await r.text()
        return await r.json()


def words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


async def complete(
    client: aiohttp.ClientSession, base: str, prompt: str, max_tokens: int, session: str | None = None, **kw: Any
) -> tuple[int, dict[str, Any]]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0, **kw}
    headers = {"X-Session-ID": session} if session else {}
    async with client.post(base + "/v1/completions", json=body, headers=headers) as r:
        return r.status, await r.json(content_type=None)


def cached(body: dict[str, Any]) -> int | None:
    details = body["usage"].get("prompt_tokens_details") or {}
    return details.get("cached_tokens")


async def idle(srv: RealSglang) -> str:
    """Wait until the shared server runs and queues nothing (an earlier test's request may be finishing)."""
    for _ in range(600):
        m = srv.metrics()
        if metric(m, "sglang:num_running_reqs") == 0 and metric(m, "sglang:num_queue_reqs") == 0:
            return m
        await asyncio.sleep(0.1)
    raise AssertionError("the shared SGLang server did not go idle")


# -- pool discovery ------------------------------------------------------------------------------------------------
@timed(60)
async def test_gateway_discovers_sglangs_pool_from_server_info(real_sglang_server: RealSglang) -> None:
    async with gateway(real_sglang_server.url) as (gw, base, http):
        assert gw.kv_pool == SHARED_POOL == real_sglang_server.read_server_info()["max_total_num_tokens"]
        state = await get_json(http, base + "/admin/control")
    assert state["kv_pool"] == SHARED_POOL and state["kv_pool_source"] == "/server_info"
    assert state["control"] == "budgeter"


# -- cached tokens ----------------------------------------------------------------------------------------------
@timed(180)
async def test_each_turn_hits_the_previous_prompt_and_output_less_one(real_sglang_server: RealSglang) -> None:
    """SGLang caches a finished request's prompt + output - 1 tokens (the last sampled token has no KV): the next
    turn of the session hits exactly that, through the gateway, and the session listing shows it."""
    rng = random.Random(1)
    async with gateway(real_sglang_server.url) as (gw, base, http):
        prompt = words(rng, 300)
        seen = []
        for _ in range(4):
            status, body = await complete(http, base, prompt, 8, session="grow")
            assert status == 200, body
            usage = body["usage"]
            assert usage["completion_tokens"] == 8
            seen.append((usage["prompt_tokens"], cached(body)))
            prompt = prompt + " " + body["choices"][0]["text"].strip() + " " + words(rng, 120)
        listing = await get_json(http, base + "/v1/sessions")
    for (n_prev, _), (n, c) in zip(seen, seen[1:], strict=False):
        assert n == n_prev + 8 + 120  # the reply tokenizes back to its 8 tokens
        assert c == n_prev + 8 - 1
    by_id = {s["id"]: s for s in listing["data"]}
    assert by_id["grow"]["last_cached_tokens"] == seen[-1][1] and by_id["grow"]["turns"] == 4
    assert gw.turns["finished"] == 4


# -- flush -------------------------------------------------------------------------------------------------------
@timed(240)
async def test_flush_is_refused_while_a_request_runs_and_the_driver_retries(real_sglang_server: RealSglang) -> None:
    srv = real_sglang_server
    await idle(srv)
    rng = random.Random(2)
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300)) as http:
        long = asyncio.create_task(complete(http, srv.url, words(rng, 100), 1200))
        for _ in range(600):
            if metric(srv.metrics(), "sglang:num_running_reqs") >= 1:
                break
            await asyncio.sleep(0.05)
        async with http.post(srv.url + "/flush_cache") as r:
            assert r.status == 400  # SGLang refuses while a request runs
        async with Client(srv.url, timeout_s=300) as client:
            out = await client.flush(kind="sglang", retry_s=0.5)
        status, body = await long
    assert status == 200 and body["usage"]["completion_tokens"] == 1200
    assert out["ok"] and out["endpoint"] == "/flush_cache" and out["attempts"] >= 2
    # the tree is empty afterwards: a prompt the long request had cached hits nothing
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120)) as http:
        status, body = await complete(http, srv.url, words(random.Random(2), 100), 2)
    assert status == 200 and not cached(body)


# -- parking ---------------------------------------------------------------------------------------------------
@timed(600)
async def test_budgeter_parks_sessions_and_keeps_demand_under_the_high_water_mark(
    real_sglang_server: RealSglang,
) -> None:
    async with gateway(real_sglang_server.url, control="budgeter") as (gw, base, http):
        state = await get_json(http, base + "/admin/control")
        C, high = state["kv_pool"], state["opts"]["high"]
        n_sessions, turns, out = 6, 3, 8
        first, append = C // 10, C // 14  # every session ends near 0.25 C: together ~1.5 C, far over the pool
        demand: list[int] = []
        parked_seen = 0
        done = asyncio.Event()

        async def watch() -> None:
            nonlocal parked_seen
            async with aiohttp.ClientSession() as c:
                while not done.is_set():
                    s = (await get_json(c, base + "/v1/sessions"))["summary"]
                    demand.append(s["demand_tokens"])
                    parked_seen = max(parked_seen, s["parked"])
                    await asyncio.sleep(0.05)

        async def agent(i: int) -> int:
            rng = random.Random(100 + i)
            prompt = words(rng, first)
            for k in range(turns):
                extra = {"X-Session-End": "true"} if k == turns - 1 else {}
                body = {"model": MODEL, "prompt": prompt, "max_tokens": out, "ignore_eos": True, "temperature": 0}
                async with http.post(
                    base + "/v1/completions", json=body, headers={"X-Session-ID": f"agent-{i}", **extra}
                ) as r:
                    assert r.status == 200, await r.text()
                    res = await r.json()
                prompt = prompt + " " + res["choices"][0]["text"].strip() + " " + words(rng, append)
                await asyncio.sleep(0.2)  # think
            return turns

        watcher = asyncio.create_task(watch())
        try:
            results = await asyncio.gather(*(agent(i) for i in range(n_sessions)))
        finally:
            done.set()
            await watcher
        async with http.get(base + "/metrics") as r:
            metrics = await r.text()
    assert metric(metrics, "kvgate_parks_total") > 0 and parked_seen > 0  # the sessions did exceed the budget
    assert demand and max(demand) <= high * C  # D was never seen above the high-water mark
    assert max(demand) > 0.5 * C  # and the budget was used
    assert gw.summary()["in_system"] == 0 and results == [turns] * n_sessions


# -- disconnects -----------------------------------------------------------------------------------------------
@timed(240)
async def test_client_disconnect_mid_stream_aborts_the_request_upstream(real_sglang_server: RealSglang) -> None:
    srv = real_sglang_server
    m0 = await idle(srv)
    async with gateway(srv.url) as (gw, base, http):
        body = {"model": MODEL, "prompt": words(random.Random(5), 200), "max_tokens": 3000, "ignore_eos": True,
                "stream": True}
        async with http.post(base + "/v1/completions", json=body, headers={"X-Session-ID": "leaver"}) as r:
            assert r.status == 200
            got = running = 0
            async for line in r.content:  # read until SGLang's gauge (refreshed every few steps) shows it running
                if line.startswith(b"data: {"):
                    got += 1
                    running = int(metric(srv.metrics(), "sglang:num_running_reqs"))
                    if running or got == 1000:
                        break
            assert running == 1 and got < 1000
            r.close()  # the client goes away mid-stream
        m = await idle(srv)
        # it stopped early (aborted): far fewer than 3,000 tokens were generated
        assert metric(m, "sglang:generation_tokens_total") - metric(m0, "sglang:generation_tokens_total") < 3000
        for _ in range(100):
            if gw.turns["cancelled"] + gw.turns["failed"] >= 1:
                break
            await asyncio.sleep(0.05)
        assert gw.turns["finished"] == 0 and gw.policy.demand == 0  # its demand was released


# -- doctor and the driver --------------------------------------------------------------------------------------
def test_doctor_reads_sglangs_pool_and_its_cached_tokens(real_sglang_server: RealSglang) -> None:
    cmd = [sys.executable, "-m", "kvgate.cli", "doctor", "--endpoint", real_sglang_server.url, "--preset", "paper-8b",
           "--lam", "0.035", "--timeout", "120", "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": SRC}, timeout=300)
    rep = json.loads(r.stdout)
    facts = rep["facts"]
    assert facts["kind"] == "sglang" and facts["kv_pool"] == SHARED_POOL, rep
    checks: dict[str, dict[str, Any]] = {}
    for f in rep["findings"]:
        checks.setdefault(f["check"], f)
    assert checks["pool"]["level"] == "ok" and "/server_info" in checks["pool"]["message"]
    assert checks["cached tokens reported"]["level"] == "ok", checks


SHAPES = [
    {"id": f"s{i}", "shared": 200, "initial": 300 + 40 * i, "outputs": [12, 8, 12], "appends": [200 + 20 * i, 150],
     "gaps": [0.3, 0.5]}
    for i in range(5)
]


def test_drive_records_sglangs_hits_and_pool(real_sglang_server: RealSglang, tmp_path: Path) -> None:
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(s) + "\n" for s in SHAPES))
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "kvgate.cli", "drive", "--endpoint", real_sglang_server.url, "--trace", str(trace),
           "--lam", "0.4", "--minutes", "0.4", "--seed", "7", "--timeout", "120", "--out", str(out), "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": SRC}, timeout=400)
    assert r.returncode == 0, r.stderr[-2000:]
    run = load_run(out)
    cols = run.turns
    turns = [dict(zip(cols, row, strict=True)) for row in zip(*(cols[k].tolist() for k in cols), strict=True)]
    ok = [t for t in turns if t["status"] == "ok"]
    assert len(ok) >= 5, turns
    by_session: dict[int, dict[int, dict[str, Any]]] = {}
    for t in ok:
        by_session.setdefault(t["session"], {})[t["turn"]] = t
    for ts in by_session.values():
        for k, t in ts.items():
            if k >= 1 and k - 1 in ts:
                prev = ts[k - 1]
                # SGLang's radix cache: the previous prompt and its output, less the last token, at least
                assert t["cached_tokens"] >= prev["prompt_tokens"] + prev["output_tokens"] - 1, (k, t, prev)
    assert run.meta["server"]["kind"] == "sglang"
    assert set(run.samples["kv_pool"].tolist()) == {SHARED_POOL}
