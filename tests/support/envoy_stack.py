"""A real Envoy in front of ``kvgate epp`` and ``kvgate engine`` servers on loopback, and agents that talk to it.

The stack: two :class:`kvgate.serve.app.EngineServer` in the test's event loop, ``kvgate epp`` as a process
(``--envoy-config F --envoy-listen L`` writes Envoy's bootstrap), ``envoy -c F --use-dynamic-base-id`` as a
process. Envoy reports ready before the picker listens (early requests would be answered 500), so the picker's
gRPC and HTTP ports are waited for first, then a request through Envoy. Envoy: ``$KVGATE_ENVOY_BIN``, the venv of
``.ci/install-envoy.sh``, or ``envoy`` on PATH; the tests skip where none runs.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from kvgate.serve.app import EngineServer
from kvgate.serve.config import ServerConfig
from support.ports import free_port

MODEL = "Qwen/Qwen3-8B"
SCALE = 30.0


def envoy_bin() -> str | None:
    """The envoy binary, or None."""
    from kvgate.epp.envoy import find_envoy

    return find_envoy() or None


def epp_missing() -> str | None:
    """Why the Envoy tests cannot run here (None: they can)."""
    try:
        import grpc  # noqa: F401
        from envoy.service.ext_proc.v3 import external_processor_pb2  # noqa: F401
    except ImportError as e:
        return f"the epp extra is not installed (pip install '.[epp]'): {e}"
    if envoy_bin() is None:
        return "no envoy binary (bash .ci/install-envoy.sh, or set KVGATE_ENVOY_BIN)"
    return None


def _listens(port: int) -> bool:
    with socket.socket() as s:
        s.settimeout(0.5)
        return s.connect_ex(("127.0.0.1", port)) == 0


@dataclass
class Stack:
    engines: list[EngineServer]
    picker: subprocess.Popen[bytes] | None
    envoy: subprocess.Popen[bytes] | None
    args: list[str]
    http: str
    """The picker's HTTP side."""
    front: str
    """Envoy's listener."""
    grpc_port: int
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    others: list[str] = field(default_factory=list)
    """The HTTP sides of further pickers (``pickers`` > 1: active-active on a shared ``--store``)."""

    async def start_picker(self, client: aiohttp.ClientSession) -> None:
        self.picker = await _picker(client, self.args, self.grpc_port, self.http)
        self.procs.append(self.picker)

    async def stop_picker(self) -> None:
        p = self.picker
        assert p is not None
        p.send_signal(signal.SIGTERM)
        await asyncio.to_thread(p.wait, 30)

    async def engines_idle(self) -> bool:
        return all(e.queue_lengths() == (0, 0) for e in self.engines)


async def _picker(client: aiohttp.ClientSession, args: list[str], grpc_port: int, http: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), "src") if p)}
    proc = subprocess.Popen(args, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    for _ in range(600):
        if proc.poll() is not None:
            err = proc.stderr.read().decode() if proc.stderr else ""
            raise RuntimeError(f"kvgate epp exited: {err[-2000:]}")
        if _listens(grpc_port):
            try:
                async with client.get(http + "/kvgate/info") as r:
                    if r.status == 200:
                        return proc
            except aiohttp.ClientError:
                pass
        await asyncio.sleep(0.05)
    proc.kill()
    raise TimeoutError("kvgate epp did not come up")


async def _more_pickers(stack: Stack, client: aiohttp.ClientSession, n: int, conf: Path) -> None:
    """``n`` more pickers on the same upstreams and options; Envoy's ext_proc cluster balances over all of them."""
    boot = json.loads(conf.read_text())
    cluster = next(c for c in boot["static_resources"]["clusters"] if c["name"] == "kvgate_epp")
    eps = cluster["load_assignment"]["endpoints"][0]["lb_endpoints"]
    for _ in range(n):
        g, h = free_port(), free_port()
        args = list(stack.args)
        args[args.index("--grpc-port") + 1], args[args.index("--port") + 1] = str(g), str(h)
        i = args.index("--envoy-config")
        del args[i:i + 4]  # (--envoy-config F --envoy-listen L: the first picker wrote it)
        stack.procs.append(await _picker(client, args, g, f"http://127.0.0.1:{h}"))
        stack.others.append(f"http://127.0.0.1:{h}")
        eps.append({"endpoint": {"address": {"socket_address": {"address": "127.0.0.1", "port_value": g}}}})
    cluster["lb_policy"] = "ROUND_ROBIN"
    conf.write_text(json.dumps(boot))


async def _wait_front(client: aiohttp.ClientSession, front: str, envoy: subprocess.Popen[bytes]) -> None:
    for _ in range(600):
        if envoy.poll() is not None:
            raise RuntimeError("envoy exited early")
        try:
            async with client.get(front + "/v1/models") as r:
                if r.status == 200:
                    return
        except aiohttp.ClientError:
            pass
        await asyncio.sleep(0.05)
    raise TimeoutError("envoy did not pass a request")


@contextlib.asynccontextmanager
async def envoy_stack(
    tmp: Path, *extra: str, kv_pool: int = 400_000, pickers: int = 1, engines: int = 2
) -> AsyncIterator[tuple[Stack, aiohttp.ClientSession]]:
    """The stack (``engines`` of them, at most 2), and a client session; everything stopped (by PID) at the end."""
    servers = [EngineServer(ServerConfig(kv_pool=kv_pool, time_scale=SCALE)) for _ in range(engines)]
    stack: Stack | None = None
    client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=300))
    try:
        ports = [await e.start("127.0.0.1", 0) for e in servers]
        grpc_port, http_port, listen = free_port(), free_port(), free_port()
        conf = tmp / "envoy.json"
        ups = [a for port in ports for a in ("--upstream", f"http://127.0.0.1:{port}")]
        args = [sys.executable, "-m", "kvgate.cli", "epp", *ups, "--control", "budgeter", "--grpc-port", str(grpc_port),
                "--port", str(http_port), "--envoy-config", str(conf), "--envoy-listen", str(listen),
                "--time-scale", str(SCALE), "--log-level", "warning", *extra]
        stack = Stack(servers, None, None, args, f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{listen}",
                      grpc_port)
        await stack.start_picker(client)
        await _more_pickers(stack, client, pickers - 1, conf)
        bin_ = envoy_bin()
        assert bin_ is not None
        stack.envoy = subprocess.Popen([bin_, "-c", str(conf), "--use-dynamic-base-id", "-l", "error"],
                                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        stack.procs.append(stack.envoy)
        await _wait_front(client, stack.front, stack.envoy)
        yield stack, client
    finally:
        await client.close()
        if stack is not None:
            for p in stack.procs:
                if p.poll() is None:
                    p.terminate()
                    try:
                        await asyncio.to_thread(p.wait, 20)
                    except subprocess.TimeoutExpired:
                        p.kill()
        for e in servers:
            await e.stop()


# -- agents that name nothing: a conversation in one of three APIs, streamed or not ------------------------------
PATHS = {"chat": "/v1/chat/completions", "responses": "/v1/responses", "messages": "/v1/messages"}


def body_of(api: str, convo: list[dict[str, Any]], stream: bool, out: int) -> dict[str, Any]:
    if api == "chat":
        return {"model": MODEL, "messages": convo, "max_tokens": out, "stream": stream}
    if api == "responses":
        return {"model": MODEL, "input": convo, "max_output_tokens": out, "stream": stream}
    return {"model": MODEL, "messages": convo, "max_tokens": out, "stream": stream}


def _events(raw: bytes) -> list[Any]:
    out = []
    for line in raw.decode().splitlines():
        if line.startswith("data:") and line[5:].strip() != "[DONE]":
            out.append(json.loads(line[5:]))
    return out


def reply_of(api: str, raw: bytes, stream: bool) -> str:
    """The assistant's text in an answer."""
    if not stream:
        j = json.loads(raw)
        if api == "chat":
            return str(j["choices"][0]["message"]["content"])
        if api == "responses":
            return "".join(c["text"] for o in j["output"] if o.get("type") == "message" for c in o["content"]
                           if c.get("type") == "output_text")
        return "".join(c.get("text", "") for c in j["content"])
    ev = _events(raw)
    if api == "chat":
        return "".join(e["choices"][0]["delta"].get("content") or "" for e in ev if e.get("choices"))
    if api == "responses":
        return "".join(e["delta"] for e in ev if e.get("type") == "response.output_text.delta")
    return "".join(e["delta"].get("text", "") for e in ev if e.get("type") == "content_block_delta")


@dataclass
class Agent:
    """One conversation; :meth:`turn` sends its next turn through ``front`` and extends it with the reply."""

    api: str
    stream: bool
    first: str
    out: int = 16
    convo: list[dict[str, Any]] = field(default_factory=list)
    served: list[str] = field(default_factory=list)
    """The endpoint that served each turn (Envoy's ``x-gateway-destination-endpoint-served``)."""
    holds: list[str] = field(default_factory=list)
    sid: str = ""
    """An ``X-Session-ID`` to send ('' : the agent names nothing)."""

    async def turn(self, client: aiohttp.ClientSession, front: str, text: str, end: bool = False) -> int:
        self.convo.append({"role": "user", "content": text})
        headers = {"X-Session-End": "true"} if end else {}
        if self.sid:
            headers["X-Session-ID"] = self.sid
        async with client.post(front + PATHS[self.api], json=body_of(self.api, self.convo, self.stream, self.out),
                               headers=headers) as r:
            raw = await r.read()
            if r.status != 200:
                self.convo.pop()
                return r.status
            self.served.append(r.headers.get("x-gateway-destination-endpoint-served", ""))
            self.holds.append(r.headers.get("x-kvgate-hold", ""))
        self.convo.append({"role": "assistant", "content": reply_of(self.api, raw, self.stream)})
        return 200
