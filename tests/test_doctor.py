"""``kvgate doctor`` against ``kvgate engine`` configured each wrong way, a non-OpenAI server, a closed port, a
gateway, and a real vLLM."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import pytest
from aiohttp import web

from kvgate.doctor import (
    OK,
    SGLANG_FIX_REPORT,
    UNREACHABLE,
    VLLM_FIX_CACHING,
    VLLM_FIX_REPORT,
    WARN,
    Report,
    check_endpoint,
    workload_checks,
)
from kvgate.serve.app import EngineServer
from kvgate.serve.config import ServerConfig
from kvgate.workload.shapes import preset
from support.aio import timed


@asynccontextmanager
async def engine(**kw: object) -> AsyncIterator[str]:
    server = EngineServer(ServerConfig(time_scale=200.0, **kw))  # type: ignore[arg-type]
    port = await server.start("127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await server.stop()


async def doctor(url: str) -> Report:
    rep = Report(url)
    await check_endpoint(rep, url, 10.0, None)
    return rep


def warned(rep: Report) -> dict[str, str | None]:
    return {f.check: f.fix for f in rep.findings if f.level == "warn"}


@timed(30)
async def test_a_well_configured_engine_is_healthy_and_its_pool_is_discovered() -> None:
    async with engine(kv_pool=200_000) as url:
        rep = await doctor(url)
    assert rep.exit_code == OK, rep.text()
    assert rep.facts["kv_pool"] == 200_000
    assert rep.facts["probe"]["cached_tokens"] >= 64


@timed(30)
async def test_prefix_caching_off_is_named_with_its_flag() -> None:
    async with engine(prefix_caching=False) as url:
        rep = await doctor(url)
    assert rep.exit_code == WARN
    assert warned(rep)["prefix caching"] == VLLM_FIX_CACHING


@timed(30)
async def test_cached_tokens_not_reported_is_named_with_its_flag_vllm_and_sglang() -> None:
    async with engine(cache_report=False) as url:
        rep = await doctor(url)
    assert warned(rep)["cached tokens reported"] == VLLM_FIX_REPORT
    assert rep.exit_code == WARN
    async with engine(cache_report=False, engine="sglang") as url:
        rep = await doctor(url)
    assert rep.facts["engine"] == "sglang"
    assert warned(rep)["cached tokens reported"] == SGLANG_FIX_REPORT


@timed(60)
async def test_pool_too_small_for_the_workload_and_the_rate_band() -> None:
    wl = preset("paper-8b")
    async with engine(kv_pool=30_000) as url:
        rep = await doctor(url)
    workload_checks(rep, wl, rep.facts["kv_pool"], rep.facts["max_model_len"], None, "qwen3-8b-mi300x")
    assert "one session fits" in warned(rep)  # a 37.5K-token session in a 30K pool
    assert rep.facts["workload"]["N_star"] < 2
    # the default pool: the band from the profile's c(L); a rate below 1/S is healthy, one above it is not
    async with engine() as url:
        low, mid, high = await doctor(url), await doctor(url), await doctor(url)
    workload_checks(low, wl, low.facts["kv_pool"], None, 0.005, "qwen3-8b-mi300x")
    drain = low.facts["workload"]["drain_lam"]
    healthy = low.facts["workload"]["healthy_lam"]
    assert 0.005 < drain < healthy
    assert low.exit_code == OK, low.text()
    workload_checks(mid, wl, mid.facts["kv_pool"], None, (drain + healthy) / 2, "qwen3-8b-mi300x")
    assert "history-dependent" in next(f.message for f in mid.findings if f.check == "arrival rate")
    assert mid.exit_code == WARN
    workload_checks(high, wl, high.facts["kv_pool"], None, 2 * healthy, "qwen3-8b-mi300x")
    assert "over capacity" in next(f.message for f in high.findings if f.check == "arrival rate")


@timed(30)
async def test_a_non_openai_server_and_a_closed_port_cannot_be_used() -> None:
    async def hello(_r: web.Request) -> web.Response:
        return web.Response(text="hello")

    app = web.Application()
    app.router.add_get("/", hello)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        rep = await doctor(f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()
    assert rep.exit_code == UNREACHABLE
    assert any(f.check == "OpenAI server" and f.level == "fail" for f in rep.findings)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    rep = await doctor(f"http://127.0.0.1:{closed}")
    assert rep.exit_code == UNREACHABLE
    assert any(f.check == "reachable" and f.level == "fail" for f in rep.findings)


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ)
    return subprocess.run([sys.executable, "-m", "kvgate.cli", "doctor", *args], capture_output=True, text=True,
                          timeout=60, env=env)


def test_cli_exit_codes_json_and_usage_errors() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        closed = s.getsockname()[1]
    r = _cli("--endpoint", f"http://127.0.0.1:{closed}", "--json")
    assert r.returncode == 3
    assert json.loads(r.stdout)["exit_code"] == 3
    r = _cli("--endpoint", "127.0.0.1:1")
    assert r.returncode == 2
    assert r.stderr.startswith("kvgate: error:") and "Traceback" not in r.stderr
    r = _cli("--endpoint", "http://127.0.0.1:1", "--lam", "-1")
    assert r.returncode == 2 and "Traceback" not in r.stderr


@pytest.mark.real_vllm
def test_real_vllm_is_healthy(real_vllm_server: object) -> None:
    url = real_vllm_server.url  # type: ignore[attr-defined]
    r = _cli("--endpoint", url, "--json")
    out = json.loads(r.stdout)
    assert out["facts"]["kind"] == "vllm"
    from support.real_vllm import usable_pool

    assert out["facts"]["kv_pool"] == usable_pool(real_vllm_server)  # type: ignore[arg-type]
    assert out["facts"]["probe"]["cached_tokens"] > 0, r.stdout
    assert r.returncode == 0, r.stdout


@timed(30)
async def test_a_gateway_is_recognised_with_its_controller_and_its_upstream_checked_through_it() -> None:
    from kvgate.gateway import Gateway, GatewayConfig

    async with engine(cache_report=False) as url:
        for control, warn in (("none", True), ("budgeter", False)):
            gw = Gateway(GatewayConfig(upstream=url, control=control))
            port = await gw.start("127.0.0.1", 0)
            try:
                rep = await doctor(f"http://127.0.0.1:{port}")
            finally:
                await gw.stop()
            assert rep.facts["kind"] == "kvgate-gateway" and rep.facts["engine"] == "vllm"
            assert rep.facts["kv_pool"] == 400_000
            assert rep.facts["gateway"]["control"].startswith(control)
            assert ("gateway control" in warned(rep)) is warn
            assert warned(rep)["cached tokens reported"] == VLLM_FIX_REPORT  # the engine's flag, seen through it


@timed(60)
async def test_a_trace_workload_gets_its_own_n_star_and_band() -> None:
    from kvgate.workload.trace import PAPER_MAX_CONTEXT, trace_workload

    wl = trace_workload(None, max_context=PAPER_MAX_CONTEXT)
    async with engine() as url:
        rep = await doctor(url)
    workload_checks(rep, wl, rep.facts["kv_pool"], rep.facts["max_model_len"], None, "qwen3-8b-mi300x")
    w = rep.facts["workload"]
    assert w["N_star"] == round(400_000 / wl.mean_turn_context(), 1)
    assert 0 < w["drain_lam"] < w["healthy_lam"]
    assert rep.exit_code == OK, rep.text()


@timed(60)
async def test_cached_token_reporting_is_checked_per_api_in_its_own_field() -> None:
    async with engine(kv_pool=200_000) as url:
        rep = await doctor(url)
    probes = rep.facts["api_probes"]
    assert set(probes) == {"chat", "responses", "messages"}
    assert all(p["cached_tokens"] and p["cached_tokens"] >= 64 for p in probes.values()), probes
    assert rep.exit_code == OK
    async with engine(kv_pool=200_000, cache_report=False) as url:
        rep = await doctor(url)
    w = warned(rep)
    # vLLM without --enable-prompt-tokens-details: chat and Messages say nothing; Responses always reports
    assert w["cached tokens reported (chat: /v1/chat/completions)"] == VLLM_FIX_REPORT
    assert w["cached tokens reported (messages: /v1/messages)"] == VLLM_FIX_REPORT
    assert "cached tokens reported (responses: /v1/responses)" not in w
    assert rep.facts["api_probes"]["responses"]["cached_tokens"] >= 64
