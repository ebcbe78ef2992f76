"""kvgate's gateway beside its peers: CPU per request of each proxy on the same instant upstream.

    python3 benchmarks/bench_peers.py [--rounds 3] [--seconds 2] [--only gateway,vllm-router,...] [--json out.json]

One interleaved run (every round visits every cell, and in each cell every proxy, in turn; every other round in
reverse order). The proxies, each its own process tree pinned to CPU 0 (the load client and the upstream on CPU 1):

* ``gateway``: ``kvgate gateway`` with the budgeter on (a pool large enough that nothing parks), on its default
  event loop (uvloop when installed; ``--loop asyncio`` for asyncio's own), ``--allowed-host 127.0.0.1`` (the
  requests' ``Host`` names no port), sessions named by ``X-Session-ID``;
* ``gateway-lineage``: the same gateway, requests without the header: the conversation itself names the session;
* ``vllm-router``: vllm-router 0.1.17 (Rust) ``--policy consistent_hash``, the session-keyed plain routing
  (``RUST_LOG=warn``: it logs every request otherwise);
* ``vllm-router-ps``: the same with program scheduling (the mode that parks, as kvgate does), configured as
  ``kvgate compare`` runs it, with a token capacity nothing fills;
* ``nginx``: Debian's nginx as a plain reverse proxy (one worker, upstream keep-alive, no buffering, no logs);
* ``floor``: the cheapest proxy CPython can be, :mod:`bench_gateway`'s raw relay (``asyncio-bare``: asyncio
  protocols, no HTTP parser, framing by Content-Length only, pooled upstream connections) on the gateway's event
  loop (uvloop when installed, unless ``--loop asyncio``). What no CPython proxy can beat: where it costs more
  than vllm-router, no cell can reach vllm-router's CPU per request in CPython. It cannot relay a streamed
  (chunked) answer: it runs in the plain cells only ("—" in the streamed ones).

The upstream is :mod:`bench_gateway`'s (a raw asyncio server answering every completion at once with one fixed
body, plain or SSE, and ``POST /tokenize`` as vLLM does, with a count of a quarter of the ask's bytes: the
gateway asks it for a conversation's first turn and keeps the count). Cells: 1 KB chat bodies at closed-loop
concurrency 1, 64 and 256, plain and streamed; agent turns of 128 KB and 1 MB (a system prompt, the task, then
tool calls and their results) at 1 and 16, plain. The table's ``floor / vllm-router`` column: where it is above 1,
even the floor costs more than vllm-router.
CPU per request: the proxy's process tree's CPU time (/proc schedstat, utime + stime of ended threads) over the
cell's run, warm-up included, over every request it served then. Ratios are taken within a round (the same
machine load for both sides) and their median over rounds is reported, with the load average beside each round.
Every answer must be a 200 (the errors are counted and reported: a cell's CPU per request is of relayed requests
only if it has none). ``--cells '1k c=64,128k c=1'`` runs some of the cells.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bench_gateway as bg

ROOT = Path(__file__).resolve().parents[1]
PROXIES = ("gateway", "gateway-lineage", "vllm-router", "vllm-router-ps", "nginx", "floor")
PLAIN_ONLY = frozenset({"floor"})
"""Proxies that cannot relay a streamed answer: measured in the plain cells only."""
CELLS: tuple[tuple[str, bool, int], ...] = (
    *(("1k", False, c) for c in (1, 64, 256)), *(("1k", True, c) for c in (1, 64, 256)),
    *(("128k", False, c) for c in (1, 16)), *(("1m", False, c) for c in (1, 16)),
)
"""(body, streamed, concurrency) of every cell."""
SIZES = {"1k": 1 << 10, "128k": 128 << 10, "1m": 1 << 20}
SESSIONS = {"1k": 1024, "128k": 128, "1m": 32}
"""Sessions the requests of a cell rotate over (fewer for the large bodies: each is a distinct body in memory)."""
TOOL = {"type": "function", "function": {
    "name": "bash", "description": "Run a shell command.",
    "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}


# -- the requests ------------------------------------------------------------------------------------------------
def _words(n_chars: int, seed: int) -> str:
    out, i = [], seed
    size = 0
    while size < n_chars:
        w = f"w{(i * 7919) % 997}"
        out.append(w)
        size += len(w) + 1
        i += 1
    return " ".join(out)[:n_chars]


def body(kind: str, sid: int, stream: bool) -> bytes:
    """A chat request of about ``SIZES[kind]`` bytes whose task names session ``sid``: 1 KB a system prompt and the
    task; the agent sizes tool call after tool call to fill the rest."""
    size = SIZES[kind]
    system = _words(min(4096, size // 4), 0)
    msgs: list[dict[str, Any]] = [{"role": "system", "content": system},
                                  {"role": "user", "content": f"Task of session {sid}: fix the failing test."}]
    head: dict[str, Any] = {"model": "m", "max_tokens": 16}
    if stream:
        head["stream"] = True
    if kind != "1k":
        head["tools"] = [TOOL]
        k = 0
        per = 16 << 10
        while len(json.dumps(msgs)) + per < size:
            cid = f"call_{sid}_{k}"
            msgs.append({"role": "assistant", "content": "", "tool_calls": [
                {"id": cid, "type": "function", "function": {"name": "bash", "arguments": '{"command": "ls"}'}}]})
            msgs.append({"role": "tool", "tool_call_id": cid, "content": _words(per - 200, sid * 31 + k)})
            k += 1
    left = size - len(json.dumps({**head, "messages": msgs}, separators=(",", ":")))
    if left > 0:
        msgs[1]["content"] += " " + _words(left - 1, sid)
    return json.dumps({**head, "messages": msgs}, separators=(",", ":")).encode()


def request(kind: str, sid: int, stream: bool, header: bool) -> bytes:
    raw = body(kind, sid, stream)
    sess = f"X-Session-ID: agent-{sid}\r\n" if header else ""
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {bg.CLIENT_KEY}\r\n{sess}Content-Length: {len(raw)}\r\n\r\n").encode() + raw


async def closed_loop(port: int, concurrency: int, reqs: list[bytes], seconds: float
                      ) -> tuple[int, int, dict[str, int]]:
    """``concurrency`` keep-alive connections sending ``reqs`` for ``seconds``: (answers, errors, the errors by
    status, "closed" for a connection the proxy closed). Connection k sends requests k, k + concurrency, ... in
    turn, so no session has two requests in flight (the same body sent again while the first is served is a
    retry that replaces it: a 409 for the first) as long as there are at least as many sessions as connections."""
    loop = asyncio.get_running_loop()
    conns = [(await loop.create_connection(bg._Conn, "127.0.0.1", port))[1] for _ in range(concurrency)]
    state = {"stop": False, "done": 0, "errors": 0}
    statuses: dict[str, int] = {}

    async def worker(c: bg._Conn, k: int) -> None:
        mine = reqs[k % len(reqs)::concurrency] or reqs
        i = 0
        while not state["stop"]:
            req, i = mine[i], (i + 1) % len(mine)
            try:
                status = await c.send(req)
            except ConnectionError:
                state["errors"] += 1
                statuses["closed"] = statuses.get("closed", 0) + 1
                return
            state["done"] += 1
            if status != 200:
                state["errors"] += 1
                statuses[str(status)] = statuses.get(str(status), 0) + 1

    tasks = [asyncio.create_task(worker(c, k)) for k, c in enumerate(conns)]
    await asyncio.sleep(seconds)
    state["stop"] = True
    await asyncio.wait(tasks, timeout=30)
    for c in conns:
        c.t.close()
    return state["done"], state["errors"], statuses


# -- the proxies -------------------------------------------------------------------------------------------------
def start_router(up: int, program_scheduling: bool, name: str) -> bg.Proxy | None:
    binary = shutil.which("vllm-router")
    if binary is None:
        return None
    port = bg.free_port()
    args = [binary, "--worker-urls", f"http://127.0.0.1:{up}", "--host", "127.0.0.1", "--port", str(port),
            "--policy", "consistent_hash", "--prometheus-host", "127.0.0.1", "--prometheus-port", str(bg.free_port())]
    if program_scheduling:
        sys.path.insert(0, str(ROOT / "src"))
        from kvgate.compare.stacks import vllm_router_ps_config

        ps = vllm_router_ps_config(100_000_000, 1.0)
        args += ["--enable-program-scheduling", "--program-scheduling-config-json", json.dumps(ps)]
    proc = subprocess.Popen(args, preexec_fn=bg._pinned(bg.PROXY_CPU), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env={**os.environ, "RUST_LOG": "warn"})
    bg.wait_port(port, timeout=60, proc=proc)
    return bg.Proxy(name, port, proc)


def floor_loop(loop: str) -> str:
    """The floor's event loop: the gateway's (``loop``; auto: uvloop when installed)."""
    if loop == "auto":
        return "uvloop" if importlib.util.find_spec("uvloop") is not None else "asyncio"
    return loop


@contextlib.contextmanager
def running(want: list[str], loop: str = "auto") -> Iterator[list[bg.Proxy]]:
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-peers-"))
    up = bg.free_port()
    upstream = subprocess.Popen([sys.executable, bg.__file__, "--serve-upstream", str(up)],
                                preexec_fn=bg._pinned(bg.CLIENT_CPU))
    proxies: list[bg.Proxy] = []
    try:
        bg.wait_port(up, proc=upstream)
        for name in want:
            p: bg.Proxy | None
            if name in ("gateway", "gateway-lineage"):
                # (its Host names no port: let the gateway answer to it rather than refuse it with 421)
                # (a pool nothing fills: with lineage every request here is a new session, as the same conversation
                # is sent again and again, and at 1 MB, 286 of them held 75% of bench_gateway's 10^8 tokens)
                p = bg.start_gateway(up, loop, name, ("--allowed-host", "127.0.0.1", "--kv-pool", str(10**12)))
            elif name in ("vllm-router", "vllm-router-ps"):
                p = start_router(up, name.endswith("-ps"), name)
            elif name == "nginx":
                p = bg.start_nginx(up, workdir)
            elif name == "floor":
                p = bg.start_bare(up, "asyncio", floor_loop(loop), name="floor")
            else:
                raise SystemExit(f"unknown proxy {name!r}")
            if p is None:
                print(f"{name}: skipped (not installed)", file=sys.stderr)
            else:
                proxies.append(p)
        time.sleep(1.0)  # (the routers' first health checks)
        yield proxies
    finally:
        for p in proxies:
            p.stop()
        upstream.terminate()
        upstream.wait()
        shutil.rmtree(workdir, ignore_errors=True)


# -- the run -----------------------------------------------------------------------------------------------------
def cell_name(kind: str, stream: bool, c: int) -> str:
    return f"{kind}{' stream' if stream else ''} c={c}"


async def measure(proxies: list[bg.Proxy], rounds: int, seconds: float,
                  cells: tuple[tuple[str, bool, int], ...] = CELLS) -> dict[str, Any]:
    reqs = {(kind, stream, header): [request(kind, i, stream, header) for i in range(SESSIONS[kind])]
            for kind, stream, _ in cells for header in (True, False)}
    cpu: dict[str, dict[str, list[float]]] = {}
    rps: dict[str, dict[str, list[float]]] = {}
    errors: dict[str, Any] = {}
    loads: list[float] = []
    for r in range(rounds):
        loads.append(os.getloadavg()[0])
        print(f"round {r + 1}/{rounds} (load {loads[-1]:.1f})", file=sys.stderr)
        order = proxies if r % 2 == 0 else proxies[::-1]
        for kind, stream, c in cells:
            cell = cell_name(kind, stream, c)
            for p in order:
                if stream and p.name in PLAIN_ONLY:
                    continue
                await bg.settle(proxies)
                pids = p.pids()
                c0, t0 = bg.cpu_seconds(pids), time.perf_counter()
                done, errs, statuses = await closed_loop(p.port, c, reqs[(kind, stream, p.name != "gateway-lineage")],
                                                         seconds)
                used, wall = bg.cpu_seconds(pids) - c0, time.perf_counter() - t0
                cpu.setdefault(cell, {}).setdefault(p.name, []).append(1e3 * used / max(1, done))
                rps.setdefault(cell, {}).setdefault(p.name, []).append(done / wall)
                errors[p.name] = errors.get(p.name, 0) + errs
                if errs:
                    failed = errors.setdefault("by_cell", {}).setdefault(cell, {}).setdefault(p.name, {})
                    for k, v in statuses.items():
                        failed[k] = failed.get(k, 0) + v
    return {"cpu_per_request_ms": cpu, "rps": rps, "errors": errors, "loadavg": loads}


def ratios(res: dict[str, Any], num: str, den: str) -> dict[str, dict[str, Any]]:
    """Per cell: ``num``'s CPU per request / ``den``'s, each round's, and their median."""
    out = {}
    for cell, by in res["cpu_per_request_ms"].items():
        if num in by and den in by:
            per = [a / b for a, b in zip(by[num], by[den], strict=True) if b > 0]
            out[cell] = {"rounds": [round(x, 3) for x in per], "median": round(statistics.median(per), 3)}
    return out


def _missing(cell: str, name: str) -> str:
    """What a table shows where ``name`` has no number: "—" where it does not run (a streamed cell of a plain-only
    proxy), else "-"."""
    return "—" if name in PLAIN_ONLY and " stream " in cell else "-"


def table(res: dict[str, Any]) -> str:
    names = [n for n in PROXIES if any(n in by for by in res["cpu_per_request_ms"].values())]
    lines = ["| cell | " + " | ".join(f"{n} ms CPU/req" for n in names) + " |", "|---|" + "---|" * len(names)]
    for cell, by in res["cpu_per_request_ms"].items():
        lines.append(f"| {cell} | " + " | ".join(f"{statistics.median(by[n]):.3f}" if n in by else _missing(cell, n)
                                                  for n in names) + " |")
    out = ["\n".join(lines), ""]
    pairs = [(g, v) for g in ("gateway", "gateway-lineage") for v in ("vllm-router", "vllm-router-ps", "nginx")
             if g in names and v in names]
    pairs += [("floor", "vllm-router")] if "floor" in names and "vllm-router" in names else []
    lines = ["| cell | " + " | ".join(f"{g} / {v}" for g, v in pairs) + " |", "|---|" + "---|" * len(pairs)]
    rs = {pair: ratios(res, *pair) for pair in pairs}
    for cell in res["cpu_per_request_ms"]:
        lines.append(f"| {cell} | " + " | ".join(
            f"{rs[p][cell]['median']:.2f} ({', '.join(f'{x:.2f}' for x in rs[p][cell]['rounds'])})"
            if cell in rs[p] else _missing(cell, p[0]) for p in pairs) + " |")
    out += ["\n".join(lines), "", "load average at each round's start: "
            + ", ".join(f"{x:.1f}" for x in res["loadavg"]), f"errors: {res['errors']}"]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=2.0, help="Seconds per proxy and cell (default: %(default)s).")
    ap.add_argument("--only", default=",".join(PROXIES), help="Comma-separated subset of: " + ", ".join(PROXIES))
    ap.add_argument("--cells", default="", help="Comma-separated subset of the cells, as the table names them "
                    "(e.g. '1k c=64,128k c=1'; default: all).")
    ap.add_argument("--loop", default="auto", choices=("auto", "asyncio", "uvloop"),
                    help="The gateway's event loop (default: %(default)s, the gateway's own default).")
    ap.add_argument("--json", default=None, help="Write the results here.")
    args = ap.parse_args()
    want = [c.strip() for c in args.cells.split(",") if c.strip()]
    cells = tuple(c for c in CELLS if not want or cell_name(*c) in want)
    if want and len(cells) != len(want):
        raise SystemExit(f"unknown cell in --cells {args.cells!r}; cells: "
                         + ", ".join(cell_name(*c) for c in CELLS))
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setaffinity(0, {bg.CLIENT_CPU})
    with running(args.only.split(","), args.loop) as proxies:
        print("proxies: " + ", ".join(p.name for p in proxies), file=sys.stderr)
        res = asyncio.run(measure(proxies, args.rounds, args.seconds, cells))
    res["setup"] = {"cpus": os.cpu_count(), "proxy_cpu": bg.PROXY_CPU, "client_and_upstream_cpu": bg.CLIENT_CPU,
                    "rounds": args.rounds, "seconds": args.seconds, "python": sys.version.split()[0],
                    "gateway_loop": args.loop, "floor_loop": floor_loop(args.loop)}
    print(table(res))
    if res["errors"].get("by_cell"):
        print(f"answers other than 200 (the CPU per request of those cells is not of relayed requests): "
              f"{res['errors']}", file=sys.stderr)
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
