"""The agent CLIs themselves — Claude Code (``claude -p``), Codex (``codex exec``) and opencode (``opencode run``),
from npm — run unchanged (apart from the variables ``docs/agents.md`` gives) against ``kvgate gateway`` in front of
``kvgate engine --agent-turns 3``: each ends by itself (exit 0) within its session's 3 turns, every request it sends
answered 2xx, and the gateway lists one session for it with exactly its 3 turns, its title request a side request,
no rewrite and no prefix break. Skipped where a CLI is not installed (on PATH, or in ``$KVGATE_AGENT_BIN``)."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvgate.gateway import Gateway, GatewayConfig
from kvgate.serve.agent import AgentTurns
from kvgate.serve.app import EngineServer
from kvgate.serve.config import ServerConfig
from support.aio import timed

MODEL = "Qwen/Qwen3-8B"
TURNS = 3
TASK = "Fix the bug in calc.py"


def cli(name: str) -> str:
    extra = os.environ.get("KVGATE_AGENT_BIN")
    found = shutil.which(name, path=f"{extra}{os.pathsep}{os.environ.get('PATH', '')}" if extra else None)
    if found is None:
        pytest.skip(f"{name} is not installed (npm install -g the harness, or set KVGATE_AGENT_BIN)")
    return found


class Recorder:
    """A pass-through in front of the gateway that keeps every request's method, path and answer status."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.seen: list[tuple[str, str, int]] = []
        self.runner: web.AppRunner | None = None
        self.http: aiohttp.ClientSession | None = None

    async def start(self) -> str:
        app = web.Application(client_max_size=64 * 2**20)
        app.router.add_route("*", "/{tail:.*}", self.forward)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        self.http = aiohttp.ClientSession(auto_decompress=False)
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}"

    async def forward(self, req: web.Request) -> web.StreamResponse:
        assert self.http is not None
        body = await req.read()
        hdrs = {k: v for k, v in req.headers.items() if k.lower() not in ("host", "content-length")}
        async with self.http.request(req.method, self.upstream + req.path_qs, data=body, headers=hdrs) as r:
            self.seen.append((req.method, req.path, r.status))
            out = web.StreamResponse(status=r.status, headers={
                k: v for k, v in r.headers.items() if k.lower() in ("content-type", "content-encoding")})
            await out.prepare(req)
            async for chunk in r.content.iter_any():
                await out.write(chunk)
            return out

    async def stop(self) -> None:
        if self.http is not None:
            await self.http.close()
        if self.runner is not None:
            await self.runner.cleanup()


async def stack() -> AsyncIterator[tuple[str, Recorder, Gateway]]:
    eng = EngineServer(ServerConfig(kv_pool=400_000, time_scale=200.0, agent=AgentTurns(turns=TURNS)))
    port = await eng.start("127.0.0.1", 0)
    gw = Gateway(GatewayConfig(upstream=f"http://127.0.0.1:{port}", control="budgeter", time_scale=200.0))
    rec: Recorder | None = None
    try:
        rec = Recorder(f"http://127.0.0.1:{await gw.start('127.0.0.1', 0)}")
        yield await rec.start(), rec, gw
    finally:
        if rec is not None:
            await rec.stop()
        await gw.stop()
        await eng.stop()


async def run(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str]:
    proc = await asyncio.create_subprocess_exec(*argv, env=env, cwd=cwd, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), 240)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"{argv[0]} did not end by itself within 240 s") from None
    return proc.returncode or 0, out.decode(errors="replace")


def setup(tmp: Path, extra: dict[str, str]) -> tuple[dict[str, str], Path]:
    proj, home = tmp / "proj", tmp / "home"
    proj.mkdir()
    home.mkdir()
    (proj / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TMPDIR")}
    return {**keep, "HOME": str(home), **extra}, proj


async def check(gw: Gateway, rec: Recorder, base: str, source: str, side: int) -> None:
    bad = [s for s in rec.seen if s[2] >= 300 and s[0] == "POST"]
    assert not bad, rec.seen
    async with aiohttp.ClientSession() as http, http.get(base + "/v1/sessions") as r:
        rows = (await r.json())["data"]
    assert len(rows) == 1, rows
    d = rows[0]
    assert d["source"] == source and d["turns"] == TURNS, (d, rec.seen)
    assert d["rewrites"] == 0 and d["prefix_breaks"] == 0 and d["side_requests"] == side, (d, rec.seen)
    posts = [s for s in rec.seen if s[0] == "POST"]
    assert len(posts) == TURNS + side, rec.seen


@timed(300)
async def test_claude_code_ends_by_itself(tmp_path: Path) -> None:
    exe = cli("claude")
    async for base, rec, gw in stack():
        env, proj = setup(tmp_path, {"ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": "x",
                                     "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "4096"})
        rc, out = await run([exe, "-p", TASK, "--model", MODEL], env, proj)
        assert rc == 0, out[-2000:]
        await check(gw, rec, base, "claude-code", 1)


@timed(300)
async def test_codex_ends_by_itself(tmp_path: Path) -> None:
    exe = cli("codex")
    async for base, rec, gw in stack():
        env, proj = setup(tmp_path, {"KVGATE_API_KEY": "x"})
        codex_home = tmp_path / "codex"
        codex_home.mkdir()
        (codex_home / "config.toml").write_text(
            f'model = "{MODEL}"\nmodel_provider = "kvgate"\n\n[model_providers.kvgate]\nname = "kvgate"\n'
            f'base_url = "{base}/v1"\nwire_api = "responses"\nenv_key = "KVGATE_API_KEY"\n')
        env["CODEX_HOME"] = str(codex_home)
        rc, out = await run([exe, "exec", "--skip-git-repo-check", TASK], env, proj)
        assert rc == 0, out[-2000:]
        await check(gw, rec, base, "codex", 0)


@timed(300)
async def test_opencode_ends_by_itself(tmp_path: Path) -> None:
    exe = cli("opencode")
    async for base, rec, gw in stack():
        env, proj = setup(tmp_path, {"OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1"})
        cfg: dict[str, Any] = {"provider": {"kvgate": {
            "npm": "@ai-sdk/openai-compatible", "options": {"baseURL": f"{base}/v1", "apiKey": "x"},
            "models": {MODEL: {"limit": {"context": 40960, "output": 4096}}}}},
            "model": f"kvgate/{MODEL}", "small_model": f"kvgate/{MODEL}"}
        (proj / "opencode.json").write_text(json.dumps(cfg))
        cache = Path(os.environ.get("KVGATE_OPENCODE_CACHE", ""))
        if cache.is_dir():  # its provider package, installed once from npm (else it installs it now)
            shutil.copytree(cache, Path(env["HOME"]) / ".cache" / "opencode")
        rc, out = await run([exe, "run", TASK], env, proj)
        assert rc == 0, out[-2000:]
        await check(gw, rec, base, "header", 1)
