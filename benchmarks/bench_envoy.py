"""What kvgate costs inside Envoy: added latency and CPU per turn of Envoy + ``kvgate epp`` beside Envoy alone and
``kvgate gateway``, at request bodies of 1 KB, 128 KB and 1 MB.

    python3 benchmarks/bench_envoy.py [--rounds 3] [--sizes 1024,131072,1048576] [--json out.json]

One interleaved run (every round visits the stacks in turn, every other round in reverse) against the instant
upstream of ``bench_gateway.py`` (a raw asyncio server answering every completion with one fixed body), at
concurrency 1 over keep-alive connections, chat completions whose user message is the body size, rotating over
4,096 ``X-Session-ID`` values (every request a policy turn):

* ``direct``: no proxy (the baseline of every "added" number);
* ``envoy``: Envoy 1.40 alone (``--concurrency 1``), a static cluster (round robin over the one upstream);
* ``envoy+epp``: the same Envoy with the bootstrap ``kvgate epp --envoy-config`` writes (ext_proc, buffered
  request bodies, streamed responses; the original-destination cluster) and the picker (budgeter, a pool large
  enough that nothing is held);
* ``gateway``: ``kvgate gateway`` (budgeter, the same pool).

The proxies' processes run on CPU 0 (Envoy and the picker share it), the client and the upstream on CPU 1. CPU
per turn is the stack's processes' CPU (Envoy's and the picker's summed) over the turns it served; added latency
is a stack's median latency less the direct path's in the same round. Each figure is the median over rounds; the
ratios (Envoy + picker against Envoy alone and against the gateway, the gateway against Envoy alone) are taken
within each round and shown as their median and range. Envoy: ``$KVGATE_ENVOY_BIN`` or the venv of
``.ci/install-envoy.sh``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from bench_gateway import (  # noqa: E402
    CLIENT_CPU,
    PROXY_CPU,
    SESSIONS,
    Proxy,
    _Conn,
    _pinned,
    cpu_seconds,
    free_port,
    settle,
    start_gateway,
    wait_port,
)
from kvgate.epp.envoy import find_envoy, round_robin_bootstrap, write_bootstrap  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SIZES = (1024, 128 << 10, 1 << 20)
COUNTS = {1024: 300, 128 << 10: 150, 1 << 20: 40}


def envoy_bin() -> str:
    got = find_envoy()
    if not got:
        raise SystemExit("no envoy binary: bash .ci/install-envoy.sh (or set KVGATE_ENVOY_BIN)")
    return got


def request(port: int, sid: int, size: int) -> bytes:
    body = {"model": "m", "messages": [{"role": "user", "content": "x" * size}], "max_tokens": 16}
    raw = json.dumps(body, separators=(",", ":")).encode()
    return (f"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nContent-Type: application/json\r\n"
            f"X-Session-ID: agent-{sid}\r\nContent-Length: {len(raw)}\r\n\r\n").encode() + raw


class Stack(Proxy):
    """A proxy of one or more processes (Envoy and the picker)."""

    others: list[subprocess.Popen[bytes]]

    def pids(self) -> list[int]:
        return super().pids() + [p.pid for p in getattr(self, "others", [])]

    def stop(self) -> None:
        for p in getattr(self, "others", []):
            p.terminate()
            p.wait(10)
        super().stop()


def _envoy(conf: Path) -> subprocess.Popen[bytes]:
    return subprocess.Popen([envoy_bin(), "-c", str(conf), "--use-dynamic-base-id", "--concurrency", "1",
                             "-l", "error"], preexec_fn=_pinned(PROXY_CPU),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def start_envoy_alone(up: int, work: Path) -> Stack:
    listen = free_port()
    conf = round_robin_bootstrap(listen, [("127.0.0.1", up)])
    f = work / "envoy-alone.json"
    write_bootstrap(f, conf)
    proc = _envoy(f)
    wait_port(listen, proc=proc)
    return Stack("envoy", listen, proc)


def start_envoy_epp(up: int, work: Path) -> Stack:
    listen, grpc, http = free_port(), free_port(), free_port()
    f = work / "envoy-epp.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT / "src")}
    picker = subprocess.Popen(
        [sys.executable, "-m", "kvgate.cli", "epp", "--upstream", f"http://127.0.0.1:{up}", "--kv-pool", "100000000",
         "--control", "budgeter", "--grpc-port", str(grpc), "--port", str(http), "--envoy-config", str(f),
         "--envoy-listen", str(listen), "--log-level", "warning"],
        env=env, preexec_fn=_pinned(PROXY_CPU), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_port(grpc, proc=picker)
    wait_port(http, proc=picker)
    proc = _envoy(f)
    wait_port(listen, proc=proc)
    s = Stack("envoy+epp", listen, proc)
    s.others = [picker]
    return s


async def one(p: Proxy, size: int, n: int, sid0: int) -> tuple[float, float, int]:
    """``n`` turns at concurrency 1: (median latency s, CPU s per turn, errors)."""
    loop = asyncio.get_running_loop()
    _, c = await loop.create_connection(_Conn, "127.0.0.1", p.port)
    reqs = [request(p.port, (sid0 + i) % SESSIONS, size) for i in range(n + 5)]
    for r in reqs[:5]:  # warm-up
        await c.send(r)
    pids = p.pids()
    cpu0 = cpu_seconds(pids)
    lat, errors = [], 0
    for r in reqs[5:]:
        t0 = time.perf_counter()
        status = await c.send(r)
        lat.append(time.perf_counter() - t0)
        errors += status != 200
    cpu = cpu_seconds(pids) - cpu0
    c.t.close()
    return statistics.median(lat), cpu / n, errors


PAIRS = (("envoy+epp", "envoy"), ("gateway", "envoy"), ("envoy+epp", "gateway"))
"""The ratios shown: (numerator, denominator) stacks, each taken within a round."""


async def run(stacks: list[Proxy], sizes: list[int], rounds: int) -> dict[str, Any]:
    got: dict[str, dict[int, list[tuple[float, float, int]]]] = {p.name: {s: [] for s in sizes} for p in stacks}
    loads = []
    for r in range(rounds):
        loads.append(round(os.getloadavg()[0], 2))
        order = stacks if r % 2 == 0 else stacks[::-1]
        for size in sizes:
            for p in order:
                await settle([q for q in stacks if q.proc is not None])
                got[p.name][size].append(await one(p, size, COUNTS.get(size, 50), r * 977))
    out: dict[str, Any] = {"loadavg": loads, "rounds": rounds, "sizes": {}}
    for size in sizes:
        base = [x[0] for x in got["direct"][size]]  # (each round's own baseline)
        row: dict[str, Any] = {}
        for name, by in got.items():
            added = [(x[0] - b) * 1e3 for x, b in zip(by[size], base, strict=True)]
            cpu = [x[1] * 1e3 for x in by[size]]
            row[name] = {"median_ms": round(statistics.median(x[0] for x in by[size]) * 1e3, 3),
                         "added_ms": round(statistics.median(added), 3),
                         "added_ms_rounds": [round(x, 3) for x in added],
                         "cpu_ms_per_turn": round(statistics.median(cpu), 3),
                         "cpu_ms_rounds": [round(x, 3) for x in cpu],
                         "errors": sum(x[2] for x in by[size])}
        ratios = {}
        for num, den in PAIRS:
            n, d = row[num], row[den]
            cpu_r = [a / b for a, b in zip(n["cpu_ms_rounds"], d["cpu_ms_rounds"], strict=True) if b > 0]
            lat_r = [a / b for a, b in zip(n["added_ms_rounds"], d["added_ms_rounds"], strict=True) if b > 0]
            ratios[f"{num} / {den}"] = {"cpu": _spread(cpu_r), "added_latency": _spread(lat_r)}
        out["sizes"][str(size)] = {"stacks": row, "ratios": ratios}
    return out


def _spread(xs: list[float]) -> dict[str, Any]:
    """The median of per-round ratios and their range (None where a denominator was not positive)."""
    if not xs:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(xs), 2), "min": round(min(xs), 2), "max": round(max(xs), 2)}


def _r(x: dict[str, Any]) -> str:
    return "-" if x["median"] is None else f"{x['median']:.2f} ({x['min']:.2f}–{x['max']:.2f})"


def table(res: dict[str, Any]) -> str:
    lines = ["| body | stack | median ms | added ms | CPU ms / turn | errors |", "|---|---|---:|---:|---:|---:|"]
    for size, cell in res["sizes"].items():
        for name, v in cell["stacks"].items():
            lines.append(f"| {int(size) // 1024} KB | {name} | {v['median_ms']} | {v['added_ms']} | "
                         f"{v['cpu_ms_per_turn']} | {v['errors']} |")
    lines += ["", "| body | " + " | ".join(f"{n} / {d} CPU | added latency" for n, d in PAIRS) + " |",
              "|---|" + "---|---|" * len(PAIRS)]
    for size, cell in res["sizes"].items():
        lines.append(f"| {int(size) // 1024} KB | " + " | ".join(
            f"{_r(cell['ratios'][f'{n} / {d}']['cpu'])} | {_r(cell['ratios'][f'{n} / {d}']['added_latency'])}"
            for n, d in PAIRS) + " |")
    lines.append("")
    lines.append("load average at each round's start: " + ", ".join(f"{x:.1f}" for x in res["loadavg"]))
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--sizes", default=",".join(map(str, SIZES)))
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    work = Path(tempfile.mkdtemp(prefix="kvgate-bench-envoy-"))
    up = free_port()
    upstream = subprocess.Popen([sys.executable, str(Path(__file__).parent / "bench_gateway.py"), "--serve-upstream",
                                 str(up)], preexec_fn=_pinned(CLIENT_CPU))
    stacks: list[Proxy] = []
    try:
        wait_port(up, proc=upstream)
        os.sched_setaffinity(0, {CLIENT_CPU})
        stacks = [Proxy("direct", up), start_envoy_alone(up, work), start_envoy_epp(up, work),
                  start_gateway(up, "asyncio")]
        time.sleep(1.0)
        res = asyncio.run(run(stacks, sizes, args.rounds))
    finally:
        for p in stacks:
            p.stop()
        upstream.terminate()
        upstream.wait()
    print(table(res))
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
