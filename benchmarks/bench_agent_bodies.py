"""Agent-sized bodies through the gateway, beside nginx: added latency and CPU per turn at 1 KB, 128 KB and 1 MB,
chat and Responses; and lineage's memory for 100,000 sessions of 50 turns.

    python3 benchmarks/bench_agent_bodies.py [--rounds 5] [--json out.json] [--page PATH]
    python3 benchmarks/bench_agent_bodies.py --quick     # 2 rounds, fewer turns, no page: a check that it runs
    python3 benchmarks/bench_agent_bodies.py --lineage-memory [--sessions 100000 --turns 50]

Agent turns are bodies of 50 KB to 1 MB (a 12-40K-token context). Each turn here is one of an agent's: a
conversation (a shared system prompt, its task, then assistant messages with tool calls and their results) grown
to the body size, one turn's items more per request, conversations interleaved as concurrent agents send them,
fresh conversations every round. Proxies, one process each, pinned to CPU 0 (load client and upstream on CPU 1):

* ``direct``: no proxy (what "added" is relative to);
* ``gateway-lineage``: ``kvgate gateway`` with the budgeter on and no session header: lineage finds every turn's
  session from its conversation (the path of agents that name nothing);
* ``gateway-header``: the same, each conversation naming its session with ``X-Session-ID``;
* ``gateway-lineage-asyncio``: ``gateway-lineage`` on asyncio's own event loop (``--loop asyncio``) rather than
  uvloop, the default: what the choice of loop is worth;
* ``nginx``: Debian's nginx as a plain reverse proxy (one worker, upstream keep-alive, no buffering, no log), in
  the same run (skipped, and said so, when it is not installed: ``apt-get install -y nginx-light``).

Measured at concurrency 1, interleaved rounds (every other one reversed), medians over rounds: latency median and
p99 (added = proxy - direct of the same round), and CPU seconds per turn of the proxy (utime + stime from /proc).
Beside it, in this process, the time of one ``orjson.loads`` of the same bodies: the gateway's target at 128 KB is
an added median <= 0.5 ms and CPU per turn <= 2 x one ``orjson.loads`` (its parse of the body is one of them).
Writes ``docs/results/agent-bodies/index.md`` (the table, the machine's load, each target met or not).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import orjson

from kvgate.page import Code, Heading, Page, Para, Span, Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_gateway import (  # noqa: E402
    CLIENT_CPU,
    PROXY_CPU,
    Proxy,
    _Conn,
    _pinned,
    cpu_seconds,
    free_port,
    settle,
    start_nginx,
    wait_port,
)

PAGE = Path(__file__).resolve().parent.parent / "docs" / "results" / "agent-bodies" / "index.md"
SIZES = {"1KB": 1 << 10, "128KB": 128 << 10, "1MB": 1 << 20}
APIS = ("chat", "responses")
SYSTEM = "You are a software engineering agent working in a large repository. Use the tools to inspect it. " * 20
_USAGE = {"prompt_tokens": 30000, "completion_tokens": 64, "total_tokens": 30064,
          "prompt_tokens_details": {"cached_tokens": 29000}}
_CHAT = orjson.dumps({"id": "chatcmpl-b", "object": "chat.completion", "created": 1, "model": "m", "choices": [
    {"index": 0, "message": {"role": "assistant", "content": "Running it.", "tool_calls": [
        {"id": "call_b", "type": "function", "function": {"name": "bash", "arguments": "{\"command\":\"ls\"}"}}]},
     "finish_reason": "tool_calls"}], "usage": _USAGE})
_RESP = orjson.dumps({"id": "resp_b", "object": "response", "status": "completed", "model": "m", "output": [
    {"type": "function_call", "call_id": "call_b", "name": "bash", "arguments": "{\"command\":\"ls\"}"}],
    "usage": {"input_tokens": 30000, "input_tokens_details": {"cached_tokens": 29000}, "output_tokens": 64,
              "total_tokens": 30064}})
_HEAD = b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n"
ANSWERS = {b"/v1/chat/completions": _HEAD % len(_CHAT) + _CHAT, b"/v1/responses": _HEAD % len(_RESP) + _RESP}
_OTHER = _HEAD % 2 + b"{}"


class _Upstream(asyncio.Protocol):
    """Instant: every request (Content-Length bodies, keep-alive) answered at once by its path's template."""

    def connection_made(self, transport: Any) -> None:
        self.t = transport
        self.buf = b""

    def data_received(self, data: bytes) -> None:
        buf = self.buf + data if self.buf else data
        out = []
        while True:
            end = buf.find(b"\r\n\r\n")
            if end < 0:
                break
            head = buf[:end]
            low = head.lower()
            i = low.find(b"content-length:")
            n = int(low[i + 15 : low.find(b"\r\n", i) if low.find(b"\r\n", i) > 0 else None]) if i >= 0 else 0
            if len(buf) < end + 4 + n:
                break
            path = head.split(b" ", 2)[1]
            out.append(ANSWERS.get(path, _OTHER))
            buf = buf[end + 4 + n :]
        self.buf = buf
        if out:
            self.t.write(b"".join(out))


def serve_upstream(port: int) -> None:
    os.sched_setaffinity(0, {CLIENT_CPU})

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(_Upstream, "127.0.0.1", port, backlog=1024)
        async with server:
            await server.serve_forever()

    asyncio.run(main())


# -- agent bodies ------------------------------------------------------------------------------------------------
def _pair(api: str, tag: str, k: int, filler: str) -> list[dict[str, Any]]:
    """One turn's items: the model's tool call and its result (about 1 KB plus ``filler``)."""
    call_id = f"call_{tag}_{k}"
    args = json.dumps({"command": f"grep -rn pattern_{k} src/"})
    out = f"src/module_{k}.py:{k}: match {tag}\n" * 8 + filler
    if api == "responses":
        return [{"type": "function_call", "call_id": call_id, "name": "bash", "arguments": args},
                {"type": "function_call_output", "call_id": call_id, "output": out}]
    return [{"role": "assistant", "content": None, "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "bash", "arguments": args}}]},
            {"role": "tool", "tool_call_id": call_id, "content": out}]


def conversation(api: str, size: int, tag: str, turns: int) -> list[bytes]:
    """The request bodies of one conversation's ``turns`` turns, the first about ``size`` bytes."""
    task = {"role": "user", "content": f"Task {tag}: make the failing tests pass. " * 4}
    filler = "x" * max(0, min(8000, size // 16))
    items: list[dict[str, Any]] = [task]
    k = 0
    while len(orjson.dumps(items)) + len(SYSTEM) < size - 600 and size > 2048:
        items += _pair(api, tag, k, filler)
        k += 1
    bodies = []
    for _ in range(turns):
        if api == "responses":
            body = {"model": "m", "instructions": SYSTEM if size > 2048 else SYSTEM[:300], "input": items,
                    "max_output_tokens": 64, "store": False}
        else:
            msgs = [{"role": "system", "content": SYSTEM if size > 2048 else SYSTEM[:300]}, *items]
            body = {"model": "m", "messages": msgs, "max_tokens": 64}
        bodies.append(orjson.dumps(body))
        items = items + _pair(api, tag, k, "")
        k += 1
    return bodies


def request(api: str, body: bytes, port: int, sid: str | None) -> bytes:
    path = "/v1/responses" if api == "responses" else "/v1/chat/completions"
    hdr = f"X-Session-ID: {sid}\r\n" if sid else ""
    return (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n{hdr}"
            f"Content-Length: {len(body)}\r\n\r\n").encode() + body


def workload(api: str, size: int, n: int, round_no: int) -> list[tuple[str, bytes]]:
    """``n`` turns of interleaved conversations: ``(conversation id, body)`` in sending order."""
    convs = 4 if size >= SIZES["1MB"] else 16
    turns = -(-n // convs)
    per = [conversation(api, size, f"r{round_no}c{c}", turns) for c in range(convs)]
    return [(f"r{round_no}c{c}", per[c][t]) for t in range(turns) for c in range(convs)][:n]


def loads_seconds(bodies: list[bytes]) -> float:
    """Median time of one ``orjson.loads`` of these bodies (each parsed a few times, this process)."""
    times = []
    for b in bodies[:40]:
        for _ in range(3):
            t0 = time.perf_counter()
            orjson.loads(b)
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


# -- measuring ---------------------------------------------------------------------------------------------------
async def run_turns(proxy: Proxy, api: str, turns: list[tuple[str, bytes]], named: bool) -> dict[str, Any]:
    """Send the turns one at a time on one keep-alive connection: latencies and the proxy's CPU per turn."""
    loop = asyncio.get_running_loop()
    _, conn = await loop.create_connection(_Conn, "127.0.0.1", proxy.port)
    reqs = [request(api, body, proxy.port, sid if named else None) for sid, body in turns]
    pids = proxy.pids()
    lat = []
    errors = 0
    cpu0 = cpu_seconds(pids)
    for req in reqs:
        t0 = time.perf_counter()
        status = await conn.send(req)
        lat.append(time.perf_counter() - t0)
        errors += status != 200
    cpu = cpu_seconds(pids) - cpu0
    conn.t.close()
    lat.sort()
    return {"median_ms": 1000 * statistics.median(lat), "p99_ms": 1000 * lat[int(0.99 * (len(lat) - 1))],
            "cpu_ms": 1000 * cpu / len(reqs) if pids else None, "errors": errors, "n": len(reqs)}


def start_gateway(up: int, loop: str = "auto") -> Proxy:
    port = free_port()
    cmd = [sys.executable, "-m", "kvgate.cli", "gateway", "--upstream", f"http://127.0.0.1:{up}",
           "--port", str(port), "--kv-pool", "1000000000000", "--control", "budgeter", "--log-level", "warning",
           "--loop", loop,
           "--max-body-bytes", str(64 << 20), "--max-sessions", "1000000"]
    proc = subprocess.Popen(cmd, preexec_fn=_pinned(PROXY_CPU), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(port, proc=proc)
    return Proxy("gateway", port, proc)


@contextlib.contextmanager
def stack() -> Iterator[tuple[int, dict[str, Proxy]]]:
    up = free_port()
    up_proc = subprocess.Popen([sys.executable, __file__, "--serve-upstream", str(up)])
    wait_port(up, proc=up_proc)  # type: ignore[arg-type]
    proxies: dict[str, Proxy] = {"direct": Proxy("direct", up)}
    with tempfile.TemporaryDirectory() as tmp:
        try:
            gw = start_gateway(up)  # its default loop: uvloop (a dependency of kvgate, as of uvicorn[standard])
            proxies["gateway-lineage"] = gw
            proxies["gateway-header"] = Proxy("gateway-header", gw.port, gw.proc)
            proxies["gateway-lineage-asyncio"] = start_gateway(up, "asyncio")  # asyncio's own loop, for scale
            ng = start_nginx(up, Path(tmp))
            if ng is not None:
                proxies["nginx"] = ng
            else:
                print("nginx: skipped (not installed: apt-get install -y nginx-light)", file=sys.stderr)
            yield up, proxies
        finally:
            for p in proxies.values():
                if p.name != "gateway-header":
                    p.stop()
            up_proc.terminate()
            up_proc.wait(10)


async def measure(rounds: int, n_of: dict[str, int]) -> dict[str, Any]:
    os.sched_setaffinity(0, {CLIENT_CPU})
    res: dict[str, Any] = {}
    with stack() as (_, proxies):
        names = list(proxies)
        for r in range(rounds):
            for api in APIS:
                for size_name, size in SIZES.items():
                    turns = workload(api, size, n_of[size_name], r)
                    key = f"{api}/{size_name}"
                    res.setdefault(key, {"loads_ms": [], "body_kb": round(len(turns[0][1]) / 1024, 1)})
                    res[key]["loads_ms"].append(1000 * loads_seconds([b for _, b in turns]))
                    order = names if r % 2 == 0 else names[::-1]
                    for name in order:
                        await settle([p for p in proxies.values() if p.proc is not None])
                        gc.collect()
                        # (each proxy gets its own conversations: lineage would take another's as replays)
                        mine = [(f"{sid}-{name}", body.replace(b"Task r", f"Task {name} r".encode(), 1))
                                for sid, body in turns]
                        got = await run_turns(proxies[name], api, mine, named=name == "gateway-header")
                        res[key].setdefault(name, []).append(got)
                    print(f"round {r + 1}/{rounds} {key} done", file=sys.stderr)
    return res


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, per in res.items():
        loads = statistics.median(per["loads_ms"])
        row: dict[str, Any] = {"body_kb": per["body_kb"], "loads_ms": round(loads, 4)}
        direct = per["direct"]
        for name, runs in per.items():
            if name in ("loads_ms", "body_kb") or name == "direct":
                continue
            added = [x["median_ms"] - d["median_ms"] for x, d in zip(runs, direct, strict=True)]
            added99 = [x["p99_ms"] - d["p99_ms"] for x, d in zip(runs, direct, strict=True)]
            cpu = [x["cpu_ms"] for x in runs if x["cpu_ms"] is not None]
            row[name] = {"median_ms": round(statistics.median(x["median_ms"] for x in runs), 4),
                         "added_median_ms": round(statistics.median(added), 4),
                         "added_p99_ms": round(statistics.median(added99), 4),
                         "cpu_ms_per_turn": round(statistics.median(cpu), 4) if cpu else None,
                         "cpu_over_loads": round(statistics.median(cpu) / loads, 2) if cpu else None,
                         "errors": sum(x["errors"] for x in runs)}
        row["direct_median_ms"] = round(statistics.median(x["median_ms"] for x in direct), 4)
        out[key] = row
    return out


def table(summary: dict[str, Any]) -> Table:
    rows: list[list[Span]] = []
    for key, row in summary.items():
        rows.append([f"{key} ({row['body_kb']} KB)", "direct", str(row["direct_median_ms"]), "–", "–", "–",
                     f"(loads {row['loads_ms']} ms)"])
        for name, v in row.items():
            if isinstance(v, dict):
                rows.append(["", name, str(v["median_ms"]), str(v["added_median_ms"]), str(v["added_p99_ms"]),
                             str(v["cpu_ms_per_turn"]), str(v["cpu_over_loads"])])
    return Table(["api / body", "proxy", "median ms", "added median ms", "added p99 ms", "CPU ms/turn",
                  "CPU / one orjson.loads"], rows)


def host_speed() -> dict[str, Any]:
    """What the host is and how fast it runs Python: its CPU model and the median time of one iteration of a plain
    Python loop (``for i in range(n): s += i``), so pages made on different hosts can be compared (the added
    latency is an absolute figure; a slower host moves it in proportion)."""
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        model = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    times = []
    for _ in range(7):
        t0 = time.perf_counter()
        s = 0
        for i in range(200_000):
            s += i
        times.append((time.perf_counter() - t0) / 200_000)
    return {"cpu": model or "unknown", "python_loop_ns": round(1e9 * statistics.median(times), 1)}


def page(summary: dict[str, Any], rounds: int, loads: tuple[float, float], host: dict[str, Any]) -> Page:
    """The results page: the table, the load it ran at, and at 128 KB each gateway's targets, met or not."""
    targets: list[list[Span]] = []
    for key, row in summary.items():
        if not key.endswith("128KB"):
            continue
        small = summary.get(key.replace("128KB", "1KB"), {})
        for name, v in row.items():
            if isinstance(v, dict) and name.startswith(("gateway", "nginx")):
                cpu, base = v["cpu_ms_per_turn"], small.get(name, {}).get("cpu_ms_per_turn")
                body = "–" if cpu is None or base is None else f"{(cpu - base) / row['loads_ms']:.2f} x"
                over = v["cpu_over_loads"]
                targets.append([key.split("/")[0], name,
                                f"{'met' if v['added_median_ms'] <= 0.5 else 'NOT met'} ({v['added_median_ms']} ms)",
                                f"{'unmeasured' if over is None else ('met' if over <= 2 else 'NOT met')} ({over} x)",
                                body])
    return Page("Agent-sized bodies through the gateway, beside nginx", [
        Para((Code(f"python3 benchmarks/bench_agent_bodies.py --rounds {rounds}"), f": {os.cpu_count()} cores, load "
              f"average {loads[0]:.2f} at the start and {loads[1]:.2f} at the end (figures move by milliseconds at "
              "a load above ~1.5); host ", host["cpu"], f", one iteration of a plain Python loop "
              f"{host['python_loop_ns']} ns (pages made on different hosts compare by it: a slower host moves every "
              "time here, the ratios to one orjson.loads much less).")),
        table(summary),
        Heading("Targets at 128 KB"),
        Table(["api", "proxy", "added median <= 0.5 ms", "CPU per turn <= 2 x one orjson.loads",
               "CPU per turn, 128 KB less 1 KB (x one orjson.loads)"], targets),
        Para("The last column is the part of a turn's CPU that grows with its body (the fixed cost of a request, "
             "seen at 1 KB, taken out); nginx is shown for scale (the targets are the gateway's)."),
    ])


# -- lineage's memory ------------------------------------------------------------------------------------------
def rss_mb() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def lineage_memory(sessions: int, turns: int) -> dict[str, Any]:
    """Index ``sessions`` conversations of ``turns`` turns (sharing one system prompt) and measure what it holds:
    the trails and the index (recording a session's first request and its last ones gives the state of all
    ``turns``: a trail keeps its first and last MARKS requests)."""
    from kvgate.gateway.lineage import MARKS, Lineage
    from kvgate.http.dialect import CHAT

    class S:
        __slots__ = ("trail", "busy", "dropped")

        def __init__(self) -> None:
            self.trail, self.busy, self.dropped = None, False, False

    system = {"role": "system", "content": SYSTEM}
    lin = Lineage()
    gc.collect()
    before = rss_mb()
    t0 = time.perf_counter()
    kept = []
    for i in range(sessions):
        s = S()
        items: list[Any] = [{"role": "user", "content": f"task {i}: fix the failing test in module {i % 997}"}]
        todo = [0, *range(max(1, turns - MARKS), turns)]
        k = 0
        for t in todo:
            while k < t:
                items += [{"role": "assistant", "content": f"step {k}"}, {"role": "tool", "content": f"out {i}.{k}"}]
                k += 1
            p = lin.probe(CHAT, {"messages": [system, *items]}, b"", None)
            assert p is not None
            lin.record(s, p, index=True)
        kept.append(s)
    gc.collect()
    after = rss_mb()
    return {"sessions": sessions, "turns": turns, "lineage_mb": round(after - before, 1),
            "bytes_per_session": round((after - before) * 2**20 / sessions),
            "seconds": round(time.perf_counter() - t0, 1), "index": lin.stats()}


def main() -> None:
    ap = argparse.ArgumentParser(description="Agent-sized bodies (1 KB, 128 KB, 1 MB; chat and Responses) through "
                                 "the gateway and nginx: added latency and CPU per turn; or lineage's memory.")
    ap.add_argument("--rounds", type=int, default=5, help="Interleaved rounds (default 5).")
    ap.add_argument("--quick", action="store_true", help="2 rounds, fewer turns, no page (a check that it runs).")
    ap.add_argument("--json", type=Path, help="Write the raw and summarized results here.")
    ap.add_argument("--page", type=Path, default=PAGE, help="The results page (default docs/results/agent-bodies).")
    ap.add_argument("--lineage-memory", action="store_true", help="Only measure lineage's memory.")
    ap.add_argument("--sessions", type=int, default=100_000, help="--lineage-memory: sessions (default 100000).")
    ap.add_argument("--turns", type=int, default=50, help="--lineage-memory: turns a session (default 50).")
    ap.add_argument("--serve-upstream", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve_upstream:
        serve_upstream(args.serve_upstream)
        return
    if args.lineage_memory:
        print(json.dumps(lineage_memory(args.sessions, args.turns), indent=1))
        return
    n_of = {"1KB": 400, "128KB": 200, "1MB": 40} if not args.quick else {"1KB": 100, "128KB": 40, "1MB": 8}
    rounds = 2 if args.quick else args.rounds
    load0 = os.getloadavg()[0]
    host = host_speed()
    res = asyncio.run(measure(rounds, n_of))
    summary = summarize(res)
    text = page(summary, rounds, (load0, os.getloadavg()[0]), host).markdown()
    print(text)
    if not args.quick:
        args.page.parent.mkdir(parents=True, exist_ok=True)
        args.page.write_text(text)
    if args.json:
        args.json.write_text(json.dumps({"raw": res, "summary": summary, "host": host}, indent=1))


if __name__ == "__main__":
    main()
