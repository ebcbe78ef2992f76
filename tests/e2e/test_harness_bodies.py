"""The first-turn demand of real harness requests: Claude Code 2.1 (Messages), Codex 0.171 (Responses) and
opencode 1.18 (chat), each body as the CLI sent it to ``kvgate engine`` (``tests/data/harness-bodies/``, captured
by pointing the CLIs at it). The gateway's first boundary must ask the budget for the prompt the engine counts:
its character estimate (tools and system blocks included) within 10%, and through ``kvgate gateway`` in front of
``kvgate engine`` (which answers vLLM's ``/tokenize``) the engine's own count. The title request Claude Code and
opencode send first under the session's id is a side request: counted on the session, not one of its turns."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvgate.gateway import Gateway, GatewayConfig
from kvgate.gateway.estimate import estimate_context, tokenize_body
from kvgate.gateway.sessions import GwSession
from kvgate.http.dialect import CHAT, MESSAGES, RESPONSES, Api
from kvgate.serve.agent import AgentTurns
from kvgate.serve.app import EngineServer
from kvgate.serve.config import ServerConfig
from kvgate.serve.parse import request_ids
from kvgate.serve.tokenizer import Tokenizer
from support.aio import timed

BODIES = Path(__file__).resolve().parent.parent / "data" / "harness-bodies"
FIRST_TURNS: dict[str, Api] = {"claude-code": MESSAGES, "codex": RESPONSES, "opencode": CHAT}
PASS_HEADERS = {"x-claude-code-session-id", "session-id", "thread-id", "x-session-id", "x-session-affinity",
                "user-agent",
                "anthropic-version", "anthropic-beta", "originator", "x-codex-turn-metadata"}


def captured(name: str) -> dict[str, Any]:
    return json.loads((BODIES / f"{name}.json").read_text())  # type: ignore[no-any-return]


@pytest.mark.parametrize("harness", list(FIRST_TURNS))
def test_first_turn_estimate_counts_tools_and_system_blocks(harness: str) -> None:
    api = FIRST_TURNS[harness]
    body = captured(f"{harness}-first-turn")["body"]
    assert body.get("tools"), "a harness's first turn offers its tools"
    engine = len(request_ids(api, body, Tokenizer()))
    estimate = estimate_context(GwSession("s", False).est, body, api)[0]
    assert abs(estimate / engine - 1) <= 0.10, (estimate, engine)
    without_tools = estimate_context(GwSession("s", False).est, {**body, "tools": []}, api)[0]
    assert without_tools < 0.8 * engine  # the tools are most of it: leaving them out is what the 10% catches
    ask = tokenize_body(api, body)
    assert ask is not None and len(ask["tools"]) == len(body["tools"]) or api is RESPONSES


@timed(120)
async def test_first_boundary_demand_is_the_engines_prompt_through_the_gateway() -> None:
    eng = EngineServer(ServerConfig(kv_pool=400_000, time_scale=500.0, agent=AgentTurns(turns=3)))
    port = await eng.start("127.0.0.1", 0)
    gw = Gateway(GatewayConfig(upstream=f"http://127.0.0.1:{port}", control="budgeter", time_scale=500.0))
    http = aiohttp.ClientSession()
    try:
        base = f"http://127.0.0.1:{await gw.start('127.0.0.1', 0)}"
        for harness, api in FIRST_TURNS.items():
            if (BODIES / f"{harness}-title.json").exists():  # the title request the CLI sends first, under its id
                title = captured(f"{harness}-title")
                hdrs = {k: v for k, v in title["headers"].items() if k.lower() in PASS_HEADERS}
                async with http.post(base + title["path"], json=title["body"], headers=hdrs) as r:
                    assert r.status == 200, await r.text()
                    await r.read()
            got = captured(f"{harness}-first-turn")
            hdrs = {k: v for k, v in got["headers"].items() if k.lower() in PASS_HEADERS}
            async with http.post(base + got["path"], json=got["body"], headers=hdrs) as r:
                assert r.status == 200, await r.text()
                raw = await r.read()
            prompt = stream_prompt(api, raw)
            async with http.get(base + "/v1/sessions") as r:
                rows = (await r.json())["data"]
            ctx = [d["context_tokens"] for d in rows]
            assert any(abs(c / prompt - 1) <= 0.10 for c in ctx), (harness, ctx, prompt)
        assert len(rows) == 3, rows  # one session per harness: its side request is not one of them
        by_source = {d["source"]: d for d in rows}
        assert set(by_source) == {"claude-code", "codex", "header"}, rows  # opencode's: its X-Session-ID
        for src, d in by_source.items():
            assert d["turns"] == 1 and d["rewrites"] == 0 and d["prefix_breaks"] == 0, d
            assert d["side_requests"] == (0 if src == "codex" else 1), d
        assert gw.summary()["side_requests"] == 2
    finally:
        await http.close()
        await gw.stop()
        await eng.stop()


def stream_prompt(api: Api, raw: bytes) -> int:
    """The prompt tokens the engine's streamed answer reports."""
    usage: dict[str, Any] = {}
    for line in raw.decode().splitlines():
        if not line.startswith("data: ") or line == "data: [DONE]":
            continue
        ev = json.loads(line[6:])
        u = api.event_usage(ev) if api is not CHAT else ev.get("usage")
        if u:
            usage.update(u)
    got = api.usage(usage)
    assert got is not None, raw[-500:]
    return got.prompt
