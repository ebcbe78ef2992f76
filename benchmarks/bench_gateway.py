"""The gateway's overhead beside other proxies: added latency, CPU per request, and throughput.

    python3 benchmarks/bench_gateway.py [--rounds 3] [--quick] [--only direct,gateway,nginx,litellm] [--json out.json]
    python3 benchmarks/bench_gateway.py --upstreams 8 [--rounds 5]      # one gateway over 8 upstreams vs over 1
    python3 benchmarks/bench_gateway.py --only direct,gateway-uvloop --base DIR/src   # this tree vs another's

One interleaved run. The same closed-loop load client (raw asyncio sockets, HTTP/1.1 keep-alive, one connection
per concurrent client) talks to an instant upstream (a raw asyncio HTTP server in its own process that answers
every completion with the same fixed body, plain JSON or SSE) either directly or through one proxy process:

* ``direct``: no proxy (the baseline every "added" number is relative to);
* ``gateway``: ``kvgate gateway`` with the budgeter on (a pool large enough that nothing parks) and requests
  rotating over 4,096 session ids (``X-Session-ID``), so every request is a policy turn;
* ``gateway-uvloop``: the same on uvloop (skipped when uvloop is not installed);
* ``aiohttp-bare``: a bare aiohttp server + pooled aiohttp client relay, no logic (the floor of an aiohttp proxy);
* ``asyncio-bare``: a raw asyncio relay that frames by Content-Length only (the floor of a Python proxy; plain
  answers only);
* ``nginx``: Debian's nginx as a plain reverse proxy (one worker, upstream keep-alive, no buffering, no logs);
* ``litellm``: LiteLLM's proxy (``litellm[proxy]`` from a separate venv, ``--litellm BIN``), skipped if absent;
* ``gateway-xN`` (with ``--upstreams N``, which runs ``direct``, ``gateway`` and it): ``kvgate gateway`` over a
  fleet of N instant upstreams (N ports of the one upstream process, so the upstream side costs the same) with
  the kvgate router (one budget per replica, sessions placed by headroom) and health checks every second; the
  report adds its throughput and CPU per request relative to ``gateway`` (one upstream) of the same round.

Placement on a 2-core machine: the proxy process(es) on CPU 0, the load client and the upstream on CPU 1, so
the proxy has one core and "requests/s" is what one core of it serves. Rounds visit the proxies in turn
(interleaved; every other round in reverse order), and each number is the median over rounds. Before every
measurement the run waits until no proxy process uses CPU, so a backlog one proxy is still working off does not
slow the next one on the same core.

Measures: per request latency at concurrency 1 (median and p99, added = proxy - direct of the same round),
streaming and not; CPU seconds per proxied request (utime + stime of the proxy's processes, from
/proc/<pid>/stat, before/after a run, over the requests it served); max requests/s at closed-loop
concurrency 1, 16, 64 and 256, and the ratio c=256 / c=64 of each round (median over rounds). Targets
(docs/gateway.md): gateway added median <= 0.6 ms at concurrency 1, <= 0.6 ms of CPU per request,
>= 2,000 requests/s on one core, not falling as concurrency grows.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
CLIENT_CPU, PROXY_CPU = 1, 0
SESSIONS = 4096
CLIENT_KEY = "sk-bench-" + "5f3c9a1e" * 8
"""Every request carries it (LiteLLM's proxy refuses to start without a master key; the others ignore it)."""
CONCURRENCY = (1, 16, 64, 256)

# -- the instant upstream ----------------------------------------------------------------------------------------
_COMPLETION = json.dumps({
    "id": "chatcmpl-bench", "object": "chat.completion", "created": 1700000000, "model": "m",
    "choices": [{"index": 0, "message": {"role": "assistant", "content": "Hello! How can I help you today?"},
                 "logprobs": None, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 20, "completion_tokens": 9, "total_tokens": 29,
              "prompt_tokens_details": {"cached_tokens": 16}},
}, separators=(",", ":")).encode()


def _sse_events(include_usage: bool) -> bytes:
    base = {"id": "chatcmpl-bench", "object": "chat.completion.chunk", "created": 1700000000, "model": "m"}
    events = [{**base, "choices": [{"index": 0, "delta": {"role": "assistant", "content": ""},
                                    "logprobs": None, "finish_reason": None}]}]
    for word in ("Hello!", " How", " can", " I", " help?"):
        events.append({**base, "choices": [{"index": 0, "delta": {"content": word}, "logprobs": None,
                                            "finish_reason": None}]})
    events.append({**base, "choices": [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "stop"}]})
    if include_usage:
        events.append({**base, "choices": [], "usage": {"prompt_tokens": 20, "completion_tokens": 5,
                       "total_tokens": 25, "prompt_tokens_details": {"cached_tokens": 16}}})
    chunks = [b"data: " + json.dumps(e, separators=(",", ":")).encode() + b"\n\n" for e in events]
    chunks.append(b"data: [DONE]\n\n")
    # chunked transfer encoding, one chunk per event, written at once (the upstream is instant)
    return b"".join(b"%x\r\n%s\r\n" % (len(c), c) for c in chunks) + b"0\r\n\r\n"


_PLAIN = (b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n" % len(_COMPLETION)
          + _COMPLETION)
_STREAM_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
_STREAM = _STREAM_HEAD + _sse_events(False)
_STREAM_USAGE = _STREAM_HEAD + _sse_events(True)
_MODELS = json.dumps({"object": "list", "data": [{"id": "m", "object": "model", "owned_by": "bench"}]}).encode()
_OTHER = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(_MODELS), _MODELS)
_TOKENIZE = b'{"count":%d,"max_model_len":131072,"tokens":[]}'
"""vLLM's ``POST /tokenize`` answer, with a count of a quarter of the ask's bytes (no tokenizer, no tokens)."""


def _tokenized(n: int) -> bytes:
    body = _TOKENIZE % (n // 4)
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s" % (len(body), body)


class _Upstream(asyncio.Protocol):
    """HTTP/1.1 keep-alive, Content-Length request bodies; answers from the templates above (``POST /tokenize``
    as vLLM does: ``{"count": ..., "max_model_len": ..., "tokens": []}``)."""

    def connection_made(self, transport: Any) -> None:
        self.t = transport
        self.buf = b""
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        out = []
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = buf[:end].lower()
            i = head.find(b"content-length:")
            n = int(head[i + 15 : head.find(b"\r\n", i) if head.find(b"\r\n", i) > 0 else None]) if i >= 0 else 0
            if len(buf) < end + 4 + n:
                break
            body = buf[end + 4 : end + 4 + n]
            buf = buf[end + 4 + n :]
            if not head.startswith(b"post"):
                out.append(_OTHER)
            elif head.startswith(b"post /tokenize "):
                out.append(_tokenized(n))
            elif b'"stream":true' in body or b'"stream": true' in body:
                usage = b'"include_usage":true' in body or b'"include_usage": true' in body
                out.append(_STREAM_USAGE if usage else _STREAM)
            else:
                out.append(_PLAIN)
        self.buf = buf
        if out:
            self.t.write(b"".join(out))


def serve_upstream(ports: list[int]) -> None:
    """The upstream process: serve on every port until killed."""

    async def main() -> None:
        loop = asyncio.get_running_loop()
        servers = [await loop.create_server(_Upstream, "127.0.0.1", p, backlog=2048, reuse_address=True)
                   for p in ports]
        await asyncio.gather(*(s.serve_forever() for s in servers))

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())


# -- a bare aiohttp proxy: the floor of any proxy built on aiohttp's server and pooled client ---------------------
def serve_bare(port: int, up: int) -> None:
    """Relay completions to the upstream with aiohttp and nothing else (no policy, no header handling)."""
    import aiohttp
    from aiohttp import web

    url = f"http://127.0.0.1:{up}/v1/chat/completions"

    async def main() -> None:
        client = aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0), auto_decompress=False)

        async def handler(request: web.Request) -> web.StreamResponse:
            body = await request.read()
            async with client.post(url, data=body, headers={"Content-Type": "application/json"}) as r:
                if r.content_type == "text/event-stream":
                    out = web.StreamResponse(status=r.status, headers={"Content-Type": "text/event-stream"})
                    await out.prepare(request)
                    async for chunk in r.content.iter_any():
                        await out.write(chunk)
                    await out.write_eof()
                    return out
                return web.Response(body=await r.read(), status=r.status, content_type="application/json")

        app = web.Application()
        app.router.add_post("/v1/chat/completions", handler)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        await web.TCPSite(runner, "127.0.0.1", port, backlog=2048).start()
        await asyncio.Event().wait()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())


def start_bare(up: int, kind: str = "aiohttp", loop_kind: str = "asyncio", name: str | None = None) -> Proxy:
    """The bare aiohttp proxy (``kind`` aiohttp) or the raw relay (asyncio) on CPU 0; the raw relay on
    ``loop_kind``'s event loop (asyncio or uvloop)."""
    port = free_port()
    flag = "--serve-bare" if kind == "aiohttp" else "--serve-raw"
    cmd = [sys.executable, __file__, flag, f"{port}:{up}"]
    if kind != "aiohttp" and loop_kind != "asyncio":
        cmd += ["--serve-raw-loop", loop_kind]
    proc = subprocess.Popen(cmd, preexec_fn=_pinned(PROXY_CPU))
    wait_port(port, proc=proc)
    return Proxy(name or f"{kind}-bare", port, proc)


# -- a raw asyncio relay: the floor of any Python proxy --------------------------------------------------------
class _RawUp(asyncio.Protocol):
    """A pooled upstream connection of the raw relay: Content-Length framing only."""

    def __init__(self, pool: list[_RawUp]) -> None:
        self.pool = pool
        self.parts: list[bytes] = []
        """What came of a message not yet complete."""
        self.have = 0
        """Its bytes."""
        self.need = -1
        """Its whole size, once its head is in (else -1)."""
        self.down: _RawDown | None = None

    def connection_made(self, transport: Any) -> None:
        self.t = transport

    def frame(self, data: bytes) -> list[bytes]:
        """Add ``data`` (a read); the messages it completes, whole and in order. A body may come in many reads
        (kept as they come and joined once, when complete) and a read may hold several messages."""
        if self.have:
            self.parts.append(data)
            self.have += len(data)
            if self.need >= 0 and self.have < self.need:
                return []
            data = b"".join(self.parts)
            self.parts, self.have, self.need = [], 0, -1
        out = []
        pos, size = 0, len(data)
        while pos < size:
            end = data.find(b"\r\n\r\n", pos)
            if end < 0:
                self.need = -1
                break
            head = data[pos:end].lower()
            i = head.find(b"content-length:")
            j = head.find(b"\r\n", i)
            self.need = end + 4 - pos + (int(head[i + 15 : j if j > 0 else None]) if i >= 0 else 0)
            if size - pos < self.need:
                break
            out.append(data if pos == 0 and self.need == size else data[pos : pos + self.need])
            pos += self.need
            self.need = -1
        if pos < size:
            self.parts.append(data[pos:] if pos else data)
            self.have = size - pos
        return out

    def data_received(self, data: bytes) -> None:
        for msg in self.frame(data):
            down, self.down = self.down, None
            self.pool.append(self)
            assert down is not None
            down.t.write(msg)
            down.answered()


class _RawDown(_RawUp):
    """A client connection of the raw relay: each complete request goes out on a pooled upstream connection, one
    at a time (requests pipelined behind it wait, so that their answers come back in order)."""

    def __init__(self, pool: list[_RawUp], up: int) -> None:
        super().__init__(pool)
        self.up = up
        self.queue: list[bytes] | None = None
        """None when no request is out; else the requests waiting behind the one that is."""

    def data_received(self, data: bytes) -> None:
        msgs = self.frame(data)
        if not msgs:
            return
        if self.queue is not None:
            self.queue += msgs
            return
        self.queue = msgs
        self.send(msgs.pop(0))

    def send(self, req: bytes) -> None:
        if self.pool:
            u = self.pool.pop()
            u.down = self
            u.t.write(req)
        else:
            asyncio.ensure_future(self._connect(req))

    def answered(self) -> None:
        """The answer of the request out is written: send the next."""
        queue = self.queue
        if queue:
            self.send(queue.pop(0))
        else:
            self.queue = None

    async def _connect(self, req: bytes) -> None:
        loop = asyncio.get_running_loop()
        _, u = await loop.create_connection(lambda: _RawUp(self.pool), "127.0.0.1", self.up)
        u.down = self
        u.t.write(req)


def serve_raw(port: int, up: int, loop_kind: str = "asyncio") -> None:
    """Relay requests byte for byte (plain JSON answers only: no chunked bodies, no streams), on asyncio's event
    loop or (``loop_kind`` uvloop) uvloop's, set up as the gateway sets it up."""
    if loop_kind == "uvloop":
        import uvloop

        asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())

    async def main() -> None:
        loop = asyncio.get_running_loop()
        pool: list[_RawUp] = []
        server = await loop.create_server(lambda: _RawDown(pool, up), "127.0.0.1", port, backlog=2048)
        async with server:
            await server.serve_forever()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(main())


# -- the load client -----------------------------------------------------------------------------------------------
class _Conn(asyncio.Protocol):
    """One keep-alive connection; ``send`` a request, await the whole response (Content-Length or chunked)."""

    def __init__(self) -> None:
        self.buf = b""
        self.waiter: asyncio.Future[int] | None = None
        self.need = -1  # bytes of the whole response, once known; -2: chunked
        self.status = 0

    def connection_made(self, transport: Any) -> None:
        self.t = transport
        transport.get_extra_info("socket").setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.waiter is not None and not self.waiter.done():
            self.waiter.set_exception(ConnectionError("connection lost"))

    def send(self, req: bytes) -> asyncio.Future[int]:
        self.waiter = asyncio.get_running_loop().create_future()
        self.t.write(req)
        return self.waiter

    def data_received(self, data: bytes) -> None:
        buf = self.buf = self.buf + data if self.buf else data
        if self.need == -1:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                return
            head = buf[:end].lower()
            self.status = int(head[9:12])
            i = head.find(b"content-length:")
            if i >= 0:
                j = head.find(b"\r\n", i)
                self.need = end + 4 + int(head[i + 15 : j if j > 0 else None])
            else:
                self.need = -2
        done = len(buf) >= self.need if self.need >= 0 else buf.endswith(b"0\r\n\r\n")
        if done:
            self.buf = b""
            self.need = -1
            w = self.waiter
            if w is not None and not w.done():
                w.set_result(self.status)


def _request(host: str, port: int, sid: int, stream: bool) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "Hello there, how are you today?"}],
            "max_tokens": 16}
    if stream:
        body["stream"] = True
    raw = json.dumps(body, separators=(",", ":")).encode()
    return (
        f"POST /v1/chat/completions HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
        f"Authorization: Bearer {CLIENT_KEY}\r\nX-Session-ID: agent-{sid}\r\nContent-Length: {len(raw)}\r\n\r\n"
    ).encode() + raw


@dataclass
class LoadResult:
    requests: int
    seconds: float
    latencies: list[float] = field(default_factory=list)
    errors: int = 0

    @property
    def rps(self) -> float:
        return self.requests / self.seconds if self.seconds else 0.0


async def closed_loop(
    port: int, concurrency: int, *, stream: bool, seconds: float = 0.0, count: int = 0, warmup: float = 0.3
) -> LoadResult:
    """``concurrency`` connections, each sending its next request when the previous answer is complete.

    Runs ``warmup`` seconds unmeasured, then ``seconds`` measured, or ``count`` requests (at most ``seconds``)."""
    loop = asyncio.get_running_loop()
    reqs = [_request("127.0.0.1", port, i, stream) for i in range(SESSIONS)]
    conns = []
    for _ in range(concurrency):
        _, proto = await loop.create_connection(_Conn, "127.0.0.1", port)
        conns.append(proto)
    counter = iter(range(1 << 62))
    state = {"measuring": False, "stop": False, "done": 0, "errors": 0}
    lat: list[float] = []
    perf = time.perf_counter

    async def worker(c: _Conn) -> None:
        while not state["stop"]:
            req = reqs[next(counter) % SESSIONS]
            t0 = perf()
            try:
                status = await c.send(req)
            except ConnectionError:
                state["errors"] += 1
                return
            if state["measuring"]:
                lat.append(perf() - t0)
                if status != 200:
                    state["errors"] += 1
                state["done"] += 1
                if count and state["done"] >= count:
                    state["stop"] = True

    tasks = [asyncio.create_task(worker(c)) for c in conns]
    await asyncio.sleep(warmup)
    state["measuring"] = True
    t0 = perf()
    if count:
        limit = t0 + (seconds or 1e9)
        while not state["stop"] and not all(t.done() for t in tasks) and perf() < limit:
            await asyncio.sleep(0.01)
        state["stop"] = True
    else:
        await asyncio.sleep(seconds)
        state["stop"] = True
    elapsed = perf() - t0
    state["measuring"] = False
    await asyncio.wait(tasks, timeout=10)
    for c in conns:
        c.t.close()
    n = state["done"]
    return LoadResult(n, elapsed, lat[:n], state["errors"])


# -- processes -------------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_port(port: int, timeout: float = 60.0, proc: subprocess.Popen[bytes] | None = None) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc is not None and proc.poll() is not None:
            raise RuntimeError(f"process exited with {proc.returncode} before listening on {port}")
        with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return
        time.sleep(0.05)
    raise RuntimeError(f"nothing listens on {port} after {timeout} s")


def tree(pid: int) -> list[int]:
    """``pid`` and its descendants."""
    children: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            with contextlib.suppress(OSError):
                stat = Path(f"/proc/{d}/stat").read_text()
                ppid = int(stat.rsplit(")", 1)[1].split()[1])
                children.setdefault(ppid, []).append(int(d))
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(children.get(p, []))
    return out


def cpu_seconds(pids: list[int]) -> float:
    """CPU time of the processes ``pids``: the scheduler's nanoseconds on CPU of each live thread (schedstat), where
    the kernel keeps them, plus what threads that have ended used (the process's utime + stime beyond its live
    threads', in clock ticks); else utime + stime alone (10 ms ticks: coarse for a few hundred short turns)."""
    tick = os.sysconf("SC_CLK_TCK")

    def ticks(stat: Path) -> int:
        fields = stat.read_text().rsplit(")", 1)[1].split()
        return int(fields[11]) + int(fields[12])  # utime, stime

    total = 0.0
    for pid in pids:
        with contextlib.suppress(OSError):
            whole = ticks(Path(f"/proc/{pid}/stat"))
            if not Path(f"/proc/{pid}/schedstat").exists():
                total += whole / tick
                continue
            live = 0
            for task in Path(f"/proc/{pid}/task").iterdir():
                with contextlib.suppress(OSError):  # a thread that just ended
                    ns = int((task / "schedstat").read_text().split()[0])
                    live += ticks(task / "stat")
                    total += ns / 1e9
            total += max(0, whole - live) / tick  # threads that have ended
    return total


async def settle(proxies: list[Proxy], quiet: float = 0.02, timeout: float = 30.0) -> None:
    """Wait until no proxy process uses CPU (under ``quiet`` of a core over 0.25 s), so that work one proxy
    still does after its run (LiteLLM finishing a backlog, say) is not charged to the next on the same core."""
    pids = [pid for p in proxies for pid in p.pids()]
    if not pids:
        return
    deadline = time.monotonic() + timeout
    last = cpu_seconds(pids)
    while time.monotonic() < deadline:
        await asyncio.sleep(0.25)
        now = cpu_seconds(pids)
        if now - last < quiet * 0.25:
            return
        last = now


@dataclass
class Proxy:
    name: str
    port: int
    proc: subprocess.Popen[bytes] | None = None

    def pids(self) -> list[int]:
        return tree(self.proc.pid) if self.proc is not None else []

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _pinned(cpu: int) -> Any:
    def fn() -> None:
        with contextlib.suppress(OSError, AttributeError):
            os.sched_setaffinity(0, {cpu})

    return fn


def start_gateway(up: int | list[int], loop_kind: str, name: str | None = None, extra: tuple[str, ...] = (),
                  src: str | None = None) -> Proxy:
    """``kvgate gateway`` on CPU 0; ``src``: the ``src`` folder of another checkout to run instead (``--base``)."""
    port = free_port()
    ups = [up] if isinstance(up, int) else up
    cmd = [
        *(sys.executable, "-m", "kvgate.cli", "gateway", "--port", str(port)),
        *(a for u in ups for a in ("--upstream", f"http://127.0.0.1:{u}")),
        *("--kv-pool", "100000000", "--control", "budgeter", "--log-level", "warning", "--loop", loop_kind),
        *extra,
    ]
    env = None if src is None else {**os.environ, "PYTHONPATH": src}
    proc = subprocess.Popen(cmd, preexec_fn=_pinned(PROXY_CPU), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=env)
    wait_port(port, proc=proc)
    return Proxy(name or ("gateway" if loop_kind == "asyncio" else f"gateway-{loop_kind}"), port, proc)


NGINX_CONF = """
worker_processes 1;
daemon off;
pid {dir}/nginx.pid;
error_log {dir}/error.log warn;
events {{ worker_connections 4096; }}
http {{
    access_log off;
    client_max_body_size 64m;
    client_body_temp_path {dir}/body;
    proxy_temp_path {dir}/proxy;
    fastcgi_temp_path {dir}/fastcgi;
    uwsgi_temp_path {dir}/uwsgi;
    scgi_temp_path {dir}/scgi;
    upstream engine {{ server 127.0.0.1:{up}; keepalive 512; }}
    server {{
        listen 127.0.0.1:{port} backlog=2048;
        keepalive_requests 1000000;
        location / {{
            proxy_pass http://engine;
            proxy_http_version 1.1;
            proxy_set_header Connection "";
            proxy_buffering off;
            proxy_request_buffering off;
        }}
    }}
}}
"""


def start_nginx(up: int, workdir: Path) -> Proxy | None:
    binary = shutil.which("nginx") or ("/usr/sbin/nginx" if Path("/usr/sbin/nginx").exists() else None)
    if binary is None:
        return None
    port = free_port()
    d = workdir / "nginx"
    d.mkdir(parents=True, exist_ok=True)
    conf = d / "nginx.conf"
    conf.write_text(NGINX_CONF.format(dir=d, up=up, port=port))
    proc = subprocess.Popen([binary, "-p", str(d), "-c", str(conf)], preexec_fn=_pinned(PROXY_CPU),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, proc=proc)
    return Proxy("nginx", port, proc)


LITELLM_CONF = """
model_list:
  - model_name: m
    litellm_params:
      model: openai/m
      api_base: http://127.0.0.1:{up}/v1
      api_key: sk-upstream
litellm_settings:
  drop_params: true
  set_verbose: false
general_settings:
  master_key: {key}
"""


def start_litellm(up: int, workdir: Path, binary: str | None) -> Proxy | None:
    if not binary or not Path(binary).exists():
        return None
    port = free_port()
    conf = workdir / "litellm.yaml"
    conf.write_text(LITELLM_CONF.format(up=up, key=CLIENT_KEY))
    env = {**os.environ, "LITELLM_LOG": "ERROR", "LITELLM_TELEMETRY": "False", "NO_DOCS": "True",
           "DISABLE_ADMIN_UI": "True"}
    log = open(workdir / "litellm.log", "wb")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen([binary, "--config", str(conf), "--host", "127.0.0.1", "--port", str(port),
                             "--num_workers", "1"], preexec_fn=_pinned(PROXY_CPU), stdout=log, stderr=log,
                            env=env)
    try:
        wait_port(port, timeout=120, proc=proc)
    except RuntimeError as e:
        print(f"litellm: skipped ({e}; see {workdir / 'litellm.log'})", file=sys.stderr)
        proc.kill()
        return None
    return Proxy("litellm", port, proc)


# -- the run -----------------------------------------------------------------------------------------------------------
def _pct(xs: list[float], q: float) -> float:
    if not xs:
        return float("nan")
    s = sorted(xs)
    return s[min(len(s) - 1, int(round(q / 100 * (len(s) - 1))))]


async def measure(
    proxies: list[Proxy], rounds: int, quick: bool, levels: tuple[int, ...] = CONCURRENCY
) -> dict[str, Any]:
    lat_n = 800 if quick else 3000
    lat_s = 3.0 if quick else 8.0
    tput_s = 1.0 if quick else 2.0
    res: dict[str, Any] = {"latency": {}, "cpu_per_request_ms": {}, "rps": {}, "errors": {}}
    for r in range(rounds):
        print(f"round {r + 1}/{rounds}", file=sys.stderr)
        order = proxies if r % 2 == 0 else proxies[::-1]  # (so that no proxy always runs right after another)
        for stream in (False, True):
            mode = "stream" if stream else "plain"
            for p in order:
                if stream and p.name == "asyncio-bare":  # (it frames by Content-Length only)
                    continue
                await settle(proxies)
                c0 = cpu_seconds(p.pids())
                lr = await closed_loop(p.port, 1, stream=stream, count=lat_n, seconds=lat_s)
                cpu = cpu_seconds(p.pids()) - c0
                res["latency"].setdefault((p.name, mode), []).append(
                    (statistics.median(lr.latencies), _pct(lr.latencies, 99))
                )
                if p.proc is not None:
                    # the warmup requests also cost CPU: count them in (0.3 s at this rate)
                    served = lr.requests + int(0.3 * lr.rps)
                    res["cpu_per_request_ms"].setdefault((p.name, mode, 1), []).append(1000 * cpu / served)
                res["errors"][(p.name, mode)] = res["errors"].get((p.name, mode), 0) + lr.errors
            for c in levels:
                for p in order:
                    if stream and p.name == "asyncio-bare":
                        continue
                    await settle(proxies)
                    c0 = cpu_seconds(p.pids())
                    tr = await closed_loop(p.port, c, stream=stream, seconds=tput_s)
                    cpu = cpu_seconds(p.pids()) - c0
                    res["rps"].setdefault((p.name, mode, c), []).append(tr.rps)
                    if p.proc is not None and tr.requests:
                        served = tr.requests + int(0.3 * tr.rps)
                        res["cpu_per_request_ms"].setdefault((p.name, mode, c), []).append(1000 * cpu / served)
                    res["errors"][(p.name, mode)] = res["errors"].get((p.name, mode), 0) + tr.errors
    return res


def summarize(res: dict[str, Any], names: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {"proxies": {}}
    for name in names:
        row: dict[str, Any] = {}
        for mode in ("plain", "stream"):
            lat = res["latency"].get((name, mode))
            base = res["latency"].get(("direct", mode))
            if lat and base:
                row[f"{mode}_median_ms"] = round(1000 * statistics.median(x[0] for x in lat), 3)
                row[f"{mode}_p99_ms"] = round(1000 * statistics.median(x[1] for x in lat), 3)
                if name != "direct":
                    row[f"{mode}_added_median_ms"] = round(
                        1000 * statistics.median(a[0] - b[0] for a, b in zip(lat, base, strict=True)), 3)
                    row[f"{mode}_added_p99_ms"] = round(
                        1000 * statistics.median(a[1] - b[1] for a, b in zip(lat, base, strict=True)), 3)
            for c in CONCURRENCY:
                v = res["rps"].get((name, mode, c))
                if v:
                    row[f"{mode}_rps_c{c}"] = round(statistics.median(v))
                cpu = res["cpu_per_request_ms"].get((name, mode, c))
                if cpu:
                    row[f"{mode}_cpu_ms_c{c}"] = round(statistics.median(cpu), 3)
            hi, lo = res["rps"].get((name, mode, 256)), res["rps"].get((name, mode, 64))
            if hi and lo:  # the same round's pair: the machine's drift between rounds cancels out
                row[f"{mode}_rps_256_over_64"] = round(statistics.median(a / b for a, b in zip(hi, lo, strict=True)), 3)
            row[f"{mode}_errors"] = res["errors"].get((name, mode), 0)
        out["proxies"][name] = row
    return out


def fleet_ratios(res: dict[str, Any], fleet: str, levels: tuple[int, ...], one_name: str = "gateway"
                 ) -> dict[str, Any]:
    """The fleet gateway (or any other, ``--base``) against the one-upstream gateway ``one_name``, round by round
    (the same round's pair, so the machine's drift cancels): throughput ratio (fleet / one, 1 = no overhead) and CPU
    per request ratio (fleet / one), each the median over rounds with the rounds' own values beside it."""
    out: dict[str, Any] = {}
    for mode in ("plain", "stream"):
        for c in levels:
            one, many = res["rps"].get((one_name, mode, c)), res["rps"].get((fleet, mode, c))
            if one and many:
                r = [b / a for a, b in zip(one, many, strict=True)]
                out[f"{mode}_rps_ratio_c{c}"] = {"median": round(statistics.median(r), 3),
                                                 "rounds": [round(x, 3) for x in r]}
            one, many = res["cpu_per_request_ms"].get((one_name, mode, c)), res["cpu_per_request_ms"].get(
                (fleet, mode, c))
            if one and many:
                r = [b / a for a, b in zip(one, many, strict=True)]
                out[f"{mode}_cpu_ratio_c{c}"] = {"median": round(statistics.median(r), 3),
                                                 "rounds": [round(x, 3) for x in r]}
        one, many = res["latency"].get((one_name, mode)), res["latency"].get((fleet, mode))
        if one and many:
            d = [1000 * (b[0] - a[0]) for a, b in zip(one, many, strict=True)]
            out[f"{mode}_median_latency_delta_ms"] = {"median": round(statistics.median(d), 3),
                                                      "rounds": [round(x, 3) for x in d]}
    return out


def fleet_table(ratios: dict[str, Any], n: int, title: str | None = None) -> str:
    title = title or f"gateway over {n} upstreams vs over 1 (fleet / one; medians over rounds)"
    lines = [title, "| measure | median | rounds |", "|---|---|---|"]
    for key, v in ratios.items():
        lines.append(f"| {key} | {v['median']:g} | {', '.join(f'{x:g}' for x in v['rounds'])} |")
    return "\n".join(lines)


def table(summary: dict[str, Any]) -> str:
    lines = [
        "| proxy | mode | median ms | added median ms | p99 ms | added p99 ms | CPU ms/req c=1 | c=64 | c=256 "
        "| req/s c=1 | c=16 | c=64 | c=256 | c=256 / c=64 |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, row in summary["proxies"].items():
        for mode in ("plain", "stream"):
            if f"{mode}_median_ms" not in row:
                continue
            cells = [name, mode]
            for key in ("median_ms", "added_median_ms", "p99_ms", "added_p99_ms", "cpu_ms_c1", "cpu_ms_c64",
                        "cpu_ms_c256", *(f"rps_c{c}" for c in CONCURRENCY), "rps_256_over_64"):
                v = row.get(f"{mode}_{key}")
                cells.append("–" if v is None else f"{v:g}")
            lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


@contextlib.contextmanager
def running(args: argparse.Namespace) -> Iterator[tuple[list[Proxy], Path]]:
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-bench-"))
    n_up = max(1, args.upstreams)
    up_ports = [free_port() for _ in range(n_up)]
    up_port = up_ports[0]
    upstream = subprocess.Popen([sys.executable, __file__, "--serve-upstream", ",".join(map(str, up_ports))],
                                preexec_fn=_pinned(CLIENT_CPU))
    proxies: list[Proxy] = []
    fleet = f"gateway-x{n_up}"
    try:
        for p_ in up_ports:
            wait_port(p_, proc=upstream)
        if args.only:
            want = args.only.split(",")
        elif n_up > 1:
            want = ["direct", "gateway", fleet]
        else:
            want = ["direct", "gateway", "gateway-uvloop", "aiohttp-bare", "asyncio-bare", "nginx", "litellm"]
        for name in want:
            p: Proxy | None
            if name == fleet and n_up > 1:
                p = start_gateway(up_ports, "asyncio", fleet)
            elif name == "direct":
                p = Proxy("direct", up_port)
            elif name == "gateway":
                p = start_gateway(up_port, "asyncio")
            elif name == "gateway-uvloop":
                try:
                    import uvloop  # noqa: F401
                except ImportError:
                    print("gateway-uvloop: skipped (uvloop not installed)", file=sys.stderr)
                    continue
                p = start_gateway(up_port, "uvloop")
            elif name == "aiohttp-bare":
                p = start_bare(up_port)
            elif name == "asyncio-bare":
                p = start_bare(up_port, "asyncio")
            elif name == "nginx":
                p = start_nginx(up_port, workdir)
                if p is None:
                    print("nginx: skipped (not installed: apt-get install -y nginx)", file=sys.stderr)
            elif name == "litellm":
                p = start_litellm(up_port, workdir, args.litellm)
                if p is None and not args.litellm:
                    print("litellm: skipped (pass --litellm PATH/TO/venv/bin/litellm)", file=sys.stderr)
            else:
                raise SystemExit(f"unknown proxy {name!r}")
            if p is not None:
                proxies.append(p)
        if args.base:
            proxies.append(start_gateway(up_port, "uvloop", "gateway-base", src=args.base))
        yield proxies, workdir
    finally:
        for p in proxies:
            p.stop()
        upstream.terminate()
        upstream.wait()
        shutil.rmtree(workdir, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="Shorter runs (for a smoke test).")
    ap.add_argument("--only", default=None, help="Comma-separated subset: direct, gateway, gateway-uvloop, "
                    "aiohttp-bare, asyncio-bare, nginx, litellm (direct is always needed for added "
                    "latency).")
    ap.add_argument("--litellm", default=None, metavar="BIN", help="The litellm executable of a venv with "
                    "litellm[proxy] installed.")
    ap.add_argument("--concurrency", default="1,16,64,256", help="Closed-loop concurrency levels for the "
                    "throughput runs (default: %(default)s).")
    ap.add_argument(
        "--upstreams",
        type=int,
        default=1,
        metavar="N",
        help="Also run gateway-xN: the gateway over N "
        "upstreams (default: %(default)s, no fleet); without --only runs direct, gateway and it.",
    )
    ap.add_argument("--base", default=None, metavar="SRC", help="Also run gateway-base: the gateway (uvloop) of "
                    "another checkout's src folder (git worktree add DIR COMMIT; DIR/src), and report gateway-uvloop "
                    "against it round by round (new / base).")
    ap.add_argument("--json", default=None, help="Write the results here.")
    ap.add_argument("--serve-upstream", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--serve-bare", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--serve-raw", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--serve-raw-loop", default="asyncio", choices=("asyncio", "uvloop"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_upstream is not None:
        serve_upstream([int(p) for p in args.serve_upstream.split(",")])
        return
    if args.serve_bare is not None:
        port, up = args.serve_bare.split(":")
        serve_bare(int(port), int(up))
        return
    if args.serve_raw is not None:
        port, up = args.serve_raw.split(":")
        serve_raw(int(port), int(up), args.serve_raw_loop)
        return
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setaffinity(0, {CLIENT_CPU})
    with running(args) as (proxies, _):
        names = [p.name for p in proxies]
        print("proxies: " + ", ".join(names), file=sys.stderr)
        levels = tuple(int(c) for c in args.concurrency.split(","))
        res = asyncio.run(measure(proxies, args.rounds, args.quick, levels))
    summary = summarize(res, names)
    summary["rounds"] = {  # every round's numbers, for ratios and spreads
        kind: {"/".join(map(str, k)): v for k, v in res[kind].items()} for kind in ("rps", "cpu_per_request_ms")
    }
    summary["setup"] = {"cpus": os.cpu_count(), "proxy_cpu": PROXY_CPU, "client_and_upstream_cpu": CLIENT_CPU,
                        "rounds": args.rounds, "quick": args.quick, "python": sys.version.split()[0],
                        "upstreams": args.upstreams}
    print(table(summary))
    if args.upstreams > 1 and f"gateway-x{args.upstreams}" in names and "gateway" in names:
        summary["fleet"] = fleet_ratios(res, f"gateway-x{args.upstreams}", levels)
        print(fleet_table(summary["fleet"], args.upstreams))
    if args.base and "gateway-uvloop" in names:
        summary["vs_base"] = fleet_ratios(res, "gateway-uvloop", levels, "gateway-base")
        print(fleet_table(summary["vs_base"], 1, f"gateway-uvloop vs gateway-base ({args.base}; new / base; medians "
                          "over rounds)"))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
