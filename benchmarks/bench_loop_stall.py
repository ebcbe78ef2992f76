"""How long one large request body holds the gateway's event loop: ``/kvgate/info`` probed every ~5 ms while the
gateway handles a body, the worst probe's latency against the same probe's when the gateway is idle.

    python3 benchmarks/bench_loop_stall.py [--rounds 3] [--json out.json] [-- GATEWAY OPTIONS...]
    python3 benchmarks/bench_loop_stall.py --quick      # one round, smaller bodies: a check that it runs

Bodies (each a chat turn with no session id, so lineage reads its whole conversation, as for an agent that
names nothing; a new conversation every round):

* ``tiny-240k``: 240,000 one-character messages (~7 MB, ~240k JSON objects), sent to a gateway started with
  ``--max-body-nodes 400000`` (over the body's count, whichever way it counts) so that it is handled, not
  refused;
* ``tiny-240k-default``: the same body sent to a gateway with the default ``--max-body-nodes`` (over it: 413 as
  it arrives, never parsed, when the default is under 240,000);
* ``tiny-at-cap``: as many one-character messages as the default ``--max-body-nodes`` lets through;
* ``large-28mb``: 28,000 messages of 1,000 characters (~28 MB), under the default ``--max-body-bytes``;
* ``agent-1mb``: a 1 MB agent turn (``bench_agent_bodies``: a system prompt, a task, tool calls and results).

The upstream answers at once (``/tokenize`` with a count, every other path with a chat completion), in its own
process; the gateway is ``kvgate gateway`` in its own. Both, and this client, share the machine: the figures are
worst cases of a few rounds (after one untimed warm-up body a gateway), read beside the idle probe's. Extra
arguments after ``--`` go to both gateways (e.g. ``-- --offload-body-bytes 1000000000`` to read every body on
the loop).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import orjson

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_agent_bodies import conversation  # noqa: E402
from bench_gateway import free_port, wait_port  # noqa: E402

PROBE_EVERY_S = 0.005
_CHAT = orjson.dumps({"id": "chatcmpl-s", "object": "chat.completion", "created": 1, "model": "m", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "ok"}, "finish_reason": "stop"}],
    "usage": {"prompt_tokens": 1000, "completion_tokens": 1, "total_tokens": 1001}})
_COUNT = b'{"count":1000}'


class _Upstream(asyncio.Protocol):
    """Instant: reads each request's head and ``Content-Length`` bytes (any size), answers it at once."""

    def connection_made(self, transport: Any) -> None:
        self.t = transport
        self.buf = bytearray()
        self.need = -1  # bytes of the current request (head and body), once its head is read
        self.tokenize = False

    def data_received(self, data: bytes) -> None:
        self.buf += data
        while True:
            if self.need < 0:
                end = self.buf.find(b"\r\n\r\n")
                if end < 0:
                    return
                head = bytes(self.buf[:end]).lower()
                i = head.find(b"content-length:")
                n = int(head[i + 15:].split(b"\r\n", 1)[0]) if i >= 0 else 0
                self.need = end + 4 + n
                self.tokenize = head.split(b" ", 2)[1] == b"/tokenize"
            if len(self.buf) < self.need:
                return
            del self.buf[: self.need]
            self.need = -1
            body = _COUNT if self.tokenize else _CHAT
            self.t.write(b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
                         % (len(body), body))


def serve_upstream(port: int) -> None:
    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(_Upstream, "127.0.0.1", port)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


def start(cmd: list[str], port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, proc=proc)
    return proc


def start_gateway(up: int, extra: list[str]) -> tuple[subprocess.Popen[bytes], int]:
    port = free_port()
    cmd = [sys.executable, "-m", "kvgate.cli", "gateway", "--port", str(port), "--upstream",
           f"http://127.0.0.1:{up}", "--kv-pool", "1000000000", "--log-level", "warning", *extra]
    return start(cmd, port), port


# -- bodies ------------------------------------------------------------------------------------------------------
def tiny(n: int, tag: str) -> bytes:
    """``n`` one-character messages after a system prompt naming ``tag`` (a new conversation per tag); n + 2 JSON
    objects and arrays."""
    msgs = [{"role": "system", "content": f"conversation {tag}"}] + [{"role": "user", "content": "a"}] * (n - 1)
    return orjson.dumps({"model": "m", "messages": msgs, "max_tokens": 8})


def large(n: int, size: int, tag: str) -> bytes:
    msgs = [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{tag} {i} ".ljust(size, "x")}
            for i in range(n)]
    return orjson.dumps({"model": "m", "messages": msgs, "max_tokens": 8})


def agent(tag: str) -> bytes:
    return conversation("chat", 1 << 20, tag, 1)[0]


def at_cap(tag: str) -> bytes:
    """One-character messages, as many as the default ``--max-body-nodes`` lets through (two fewer), by the node
    count of the kvgate imported (its counter, whatever it counts)."""
    from kvgate.http.limits import NodeCounter, ServerLimits

    def nodes(n: int) -> int:
        c = NodeCounter(1 << 60)
        c.feed(tiny(n, tag))
        return c.nodes

    a = (nodes(8000) - nodes(1)) / 7999
    return tiny(int((ServerLimits().max_body_nodes - nodes(1)) / a) - 2, tag)


# -- probing -----------------------------------------------------------------------------------------------------
class _Client(asyncio.Protocol):
    """One keep-alive connection: :meth:`send` a request, its future is the answer's status (whole answer read)."""

    def __init__(self) -> None:
        self.buf = b""
        self.fut: asyncio.Future[int] | None = None

    def connection_made(self, transport: Any) -> None:
        self.t = transport

    def send(self, req: bytes) -> asyncio.Future[int]:
        self.fut = asyncio.get_running_loop().create_future()
        self.t.write(req)
        return self.fut

    def data_received(self, data: bytes) -> None:
        self.buf += data
        end = self.buf.find(b"\r\n\r\n")
        if end < 0:
            return
        head = self.buf[:end].lower()
        i = head.find(b"content-length:")
        n = int(head[i + 15:].split(b"\r\n", 1)[0]) if i >= 0 else 0
        if len(self.buf) >= end + 4 + n and self.fut is not None and not self.fut.done():
            status = int(self.buf[9:12])
            self.buf = self.buf[end + 4 + n:]
            self.fut.set_result(status)

    def connection_lost(self, exc: BaseException | None) -> None:
        if self.fut is not None and not self.fut.done():
            self.fut.set_result(0)


async def connect(port: int) -> _Client:
    _, c = await asyncio.get_running_loop().create_connection(_Client, "127.0.0.1", port)
    return c


async def probes(port: int, stop: asyncio.Event) -> list[float]:
    """Latencies of ``GET /kvgate/info`` on one connection, one every :data:`PROBE_EVERY_S`, until ``stop``."""
    c = await connect(port)
    req = b"GET /kvgate/info HTTP/1.1\r\nHost: 127.0.0.1:%d\r\n\r\n" % port
    out = []
    while not stop.is_set():
        t0 = time.perf_counter()
        await c.send(req)
        out.append(time.perf_counter() - t0)
        await asyncio.sleep(max(0.0, PROBE_EVERY_S - (time.perf_counter() - t0)))
    c.t.close()
    return out


async def idle(port: int, seconds: float = 1.0) -> list[float]:
    stop = asyncio.Event()
    task = asyncio.create_task(probes(port, stop))
    await asyncio.sleep(seconds)
    stop.set()
    return await task


async def during(port: int, body: bytes) -> tuple[int, float, list[float]]:
    """Send ``body`` as a chat turn while probing: (its status, its latency, the probes' latencies)."""
    c = await connect(port)
    req = (b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
           b"Content-Length: %d\r\n\r\n" % (port, len(body))) + body
    stop = asyncio.Event()
    task = asyncio.create_task(probes(port, stop))
    await asyncio.sleep(0.05)
    t0 = time.perf_counter()
    status = await asyncio.wait_for(c.send(req), 120)
    took = time.perf_counter() - t0
    await asyncio.sleep(0.05)
    stop.set()
    lat = await task
    c.t.close()
    return status, took, lat


def ms(x: float) -> float:
    return round(x * 1e3, 1)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    up = free_port()
    upstream = subprocess.Popen([sys.executable, __file__, "--serve-upstream", str(up)])
    procs = [upstream]
    try:
        wait_port(up, proc=upstream)
        old_cap, port_old = start_gateway(up, ["--max-body-nodes", "400000", *args.gateway])
        procs.append(old_cap)
        new, port = start_gateway(up, args.gateway)
        procs.append(new)
        scale = 10 if args.quick else 1
        cases = {
            "tiny-240k": (port_old, lambda t: tiny(240_000 // scale, t)),
            "tiny-240k-default": (port, lambda t: tiny(240_000 // scale, t)),
            "tiny-at-cap": (port, at_cap),
            "large-28mb": (port, lambda t: large(28_000 // scale, 1000, t)),
            "agent-1mb": (port, agent),
        }
        out: dict[str, Any] = {"idle": {}, "cases": {}}
        for p in (port_old, port):  # (warm-up: a first large body, its code paths and threads started, not timed)
            await during(p, tiny(20_000, f"warm-{os.getpid()}"))
        for name, p in (("400k-cap gateway", port_old), ("default gateway", port)):
            lat = await idle(p)
            out["idle"][name] = {"median_ms": ms(statistics.median(lat)), "max_ms": ms(max(lat))}
        for name, (p, make) in cases.items():
            rows = []
            for r in range(args.rounds):
                body = make(f"r{r}-{name}-{os.getpid()}")
                status, took, lat = await during(p, body)
                rows.append({"status": status, "bytes": len(body), "request_ms": ms(took), "probes": len(lat),
                             "worst_probe_ms": ms(max(lat)), "median_probe_ms": ms(statistics.median(lat))})
                print(name, rows[-1], flush=True)
            out["cases"][name] = {"rounds": rows, "worst_probe_ms": max(x["worst_probe_ms"] for x in rows)}
        return out
    finally:
        for proc in procs:
            proc.terminate()
        for proc in procs:
            proc.wait(10)


def main() -> None:
    if len(sys.argv) == 3 and sys.argv[1] == "--serve-upstream":
        serve_upstream(int(sys.argv[2]))
        return
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="one round, bodies a tenth the size")
    ap.add_argument("--json", type=Path)
    ap.add_argument("gateway", nargs="*", help="options for the gateways (after --)")
    args = ap.parse_args()
    if args.quick:
        args.rounds = 1
    res = asyncio.run(run(args))
    print(json.dumps(res, indent=1))
    if args.json:
        args.json.write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
