"""Real agent harnesses against ``kvgate gateway`` → ``kvgate engine --agent-turns N``, in process: where the
harnesses are installed (.ci/install-agents.sh), a recorder in front of the gateway that keeps what each request
was and how it was answered, a subprocess runner with a deadline, and the checks every harness test makes."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from kvgate.gateway import Gateway, GatewayConfig
from kvgate.serve.agent import AgentTurns
from kvgate.serve.app import EngineServer
from kvgate.serve.config import ServerConfig

MODEL = "Qwen/Qwen3-8B"
TASK = "Fix the bug in calc.py"
CACHE = Path.home() / ".cache" / "kvgate"
NPM_DIR = Path(os.environ.get("KVGATE_AGENTS_NPM", CACHE / "agents"))
SDK_VENV = Path(os.environ.get("KVGATE_AGENTS_VENV", CACHE / "agents-venv"))
AIDER_VENV = Path(os.environ.get("KVGATE_AIDER_VENV", CACHE / "aider-venv"))
DEADLINE_S = 240


def cli(name: str) -> str:
    """An agent CLI's path: in ``$KVGATE_AGENT_BIN``, the npm prefix install-agents.sh fills, or on PATH."""
    dirs = [os.environ.get("KVGATE_AGENT_BIN", ""), str(NPM_DIR / "node_modules" / ".bin"), os.environ.get("PATH", "")]
    found = shutil.which(name, path=os.pathsep.join(d for d in dirs if d))
    if found is None:
        pytest.skip(f"{name} is not installed (bash .ci/install-agents.sh, npm install -g the harness, or set "
                    "KVGATE_AGENT_BIN)")
    return found


def venv_python(venv: Path, module: str) -> str:
    """The Python of a harness venv that imports ``module`` (skips with the reason where there is none)."""
    py = venv / "bin" / "python"
    if not py.is_file():
        pytest.skip(f"no harness venv at {venv} (bash .ci/install-agents.sh)")
    probe = subprocess.run([str(py), "-c", f"import {module}"], capture_output=True, timeout=120)
    if probe.returncode != 0:
        pytest.skip(f"{module} is not installed in {venv} (bash .ci/install-agents.sh)")
    return str(py)


@dataclass(frozen=True)
class Seen:
    """One request as the recorder forwarded it."""

    method: str
    path: str
    status: int
    tools: bool
    """Whether its body offered tools."""


class Recorder:
    """A pass-through in front of the gateway that keeps every request's method, path, answer status and whether it
    offered tools."""

    def __init__(self, upstream: str) -> None:
        self.upstream = upstream
        self.seen: list[Seen] = []
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
            self.seen.append(Seen(req.method, req.path, r.status, offers_tools(body)))
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

    def posts(self) -> list[Seen]:
        return [s for s in self.seen if s.method == "POST"]


def offers_tools(body: bytes) -> bool:
    try:
        d = json.loads(body)
    except ValueError:
        return False
    return type(d) is dict and type(d.get("tools")) is list and len(d["tools"]) > 0


async def stack(turns: int, spawn: bool = False) -> AsyncIterator[tuple[str, Recorder]]:
    """``(base URL, recorder)``: kvgate engine (``--agent-turns turns``, ``--agent-spawn`` with ``spawn``) behind
    ``kvgate gateway --control budgeter`` behind the recorder; stopped when the iteration ends."""
    eng = EngineServer(ServerConfig(kv_pool=400_000, time_scale=200.0, agent=AgentTurns(turns=turns, spawn=spawn)))
    port = await eng.start("127.0.0.1", 0)
    # (the gateway's clock at 10x: its 300 s idle timeout is 30 s, past a harness's exit after its last turn)
    gw = Gateway(GatewayConfig(upstream=f"http://127.0.0.1:{port}", control="budgeter", time_scale=10.0))
    rec: Recorder | None = None
    try:
        rec = Recorder(f"http://127.0.0.1:{await gw.start('127.0.0.1', 0)}")
        yield await rec.start(), rec
    finally:
        if rec is not None:
            await rec.stop()
        await gw.stop()
        await eng.stop()


async def run(argv: list[str], env: dict[str, str], cwd: Path) -> tuple[int, str]:
    """A harness's exit code and output; fails if it does not end by itself within :data:`DEADLINE_S`."""
    proc = await asyncio.create_subprocess_exec(*argv, env=env, cwd=cwd, stdin=asyncio.subprocess.DEVNULL,
                                                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT)
    try:
        out, _ = await asyncio.wait_for(proc.communicate(), DEADLINE_S)
    except TimeoutError:
        proc.kill()
        await proc.wait()
        raise AssertionError(f"{argv[0]} did not end by itself within {DEADLINE_S} s") from None
    return proc.returncode or 0, out.decode(errors="replace")


def setup(tmp: Path, extra: dict[str, str]) -> tuple[dict[str, str], Path]:
    """``(environment, project directory)``: a project holding calc.py's bug, a home of its own, the variables."""
    proj, home = tmp / "proj", tmp / "home"
    proj.mkdir()
    home.mkdir()
    (proj / "calc.py").write_text("def add(a, b):\n    return a - b\n")
    keep = {k: v for k, v in os.environ.items() if k in ("PATH", "LANG", "TMPDIR")}
    return {**keep, "HOME": str(home), **extra}, proj


async def sessions(base: str) -> list[dict[str, Any]]:
    async with aiohttp.ClientSession() as http, http.get(base + "/v1/sessions") as r:
        assert r.status == 200
        rows: list[dict[str, Any]] = (await r.json())["data"]
        return rows


async def check(rec: Recorder, base: str, source: str, turns: int) -> dict[str, Any]:
    """Every request answered 2xx; the gateway lists one session, from ``source``, with exactly ``turns`` turns,
    its requests that offered no tools (a title) as side requests, no rewrite and no prefix break. Its row."""
    posts = rec.posts()
    bad = [s for s in posts if s.status >= 300]
    assert not bad, rec.seen
    rows = await sessions(base)
    assert len(rows) == 1, rows
    d = rows[0]
    side = sum(1 for s in posts if not s.tools) if any(s.tools for s in posts) else 0
    got = {k: d[k] for k in ("source", "turns", "rewrites", "prefix_breaks", "side_requests")}
    assert got == {"source": source, "turns": turns, "rewrites": 0, "prefix_breaks": 0, "side_requests": side}, (
        got, rec.seen)
    assert len(posts) == turns + side, rec.seen
    return d


async def check_tree(rec: Recorder, base: str, source: str, turns: int) -> list[dict[str, Any]]:
    """Every request answered 2xx; the gateway lists two sessions from ``source``, an agent's and its subagent's
    (whose ``parent`` is the agent's), each with exactly ``turns`` turns, no rewrite and no prefix break; the
    requests that offered no tools (a title) side requests. Their rows, the agent's first."""
    posts = rec.posts()
    assert not [s for s in posts if s.status >= 300], rec.seen
    side = sum(1 for s in posts if not s.tools)
    rows = sorted(await sessions(base), key=lambda d: d["parent"] is not None)
    assert len(rows) == 2, rows
    keys = ("source", "turns", "rewrites", "prefix_breaks")
    for d in rows:
        assert {k: d[k] for k in keys} == {"source": source, "turns": turns, "rewrites": 0, "prefix_breaks": 0}, (
            rows, rec.seen)
    assert rows[0]["parent"] is None and rows[1]["parent"] == rows[0]["id"], rows
    assert sum(d["side_requests"] for d in rows) == side and len(posts) == 2 * turns + side, (rows, rec.seen)
    return rows
