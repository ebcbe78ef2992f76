"""What sharing the books on Redis costs: ``kvgate gateway --store redis://`` beside the embedded store.

    python3 benchmarks/bench_shared.py [--rounds 3] [--quick] [--json out.json]

One interleaved run on :mod:`bench_gateway`'s instant upstream (every completion answered at once with one fixed
body) and a redis-server of the run's own (``--save ''``, no AOF, on a free loopback port, stopped by its PID):

* ``direct``: no gateway (the floor every latency is relative to);
* ``embedded``: one ``kvgate gateway --store sqlite:///DIR`` (the books in the embedded SQLite store, the budgeter
  deciding in the process);
* ``redis-1``, ``redis-2``, ``redis-3``: 1, 2 and 3 gateways sharing one Redis (the books and the budget there),
  the load client's connections spread over them in turn, so successive turns of a session reach different
  instances (as behind a round-robin front).

Every gateway runs with a pool large enough that nothing parks, and requests rotate over 4,096 sessions named by
``X-Session-ID``, so every request is a turn that asks the budget and writes its book. Placement as
:mod:`bench_gateway`'s: the gateways and redis-server on CPU 0 (the gateway side, its store included, on one
core, as the embedded store's SQLite writes are in its gateway's process), the load client and the upstream on
CPU 1. So the instances of ``redis-N`` and their Redis share one core: their requests/s says what the shared
store costs in all, not how instances on cores of their own scale. (redis-server beside the load client instead
starves: each of a turn's 3 round trips waits for that busy core, and requests/s falls to a few hundred.)
Rounds visit the arms in turn, every other round in reverse; each number is the median over rounds.

Measures, per arm: latency at concurrency 1 (median and p99; added = arm - direct of the same round); CPU per turn
(the gateways' processes, and redis-server's on its own, from /proc over the run, divided by the turns served);
Redis round trips per turn, from each instance's own count by phase (``/kvgate/info``: a turn's boundary, until it
is admitted; its end; the background tasks, per second); requests/s at closed-loop concurrency 16 and 64.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import bench_gateway as bg

LEVELS = (16, 64)
ARMS = ("direct", "embedded", "redis-1", "redis-2", "redis-3")


class Arm:
    """One arm: its gateways (none for ``direct``) and the ports the load goes to."""

    def __init__(self, name: str, proxies: list[bg.Proxy], ports: list[int]) -> None:
        self.name = name
        self.proxies = proxies
        self.ports = ports

    def pids(self) -> list[int]:
        return [pid for p in self.proxies for pid in p.pids()]

    def shared(self) -> list[dict[str, Any]]:
        """Each instance's view of the shared books (``/kvgate/info``); [] without them."""
        out = []
        for p in self.proxies:
            with urllib.request.urlopen(f"http://127.0.0.1:{p.port}/kvgate/info", timeout=10) as r:
                sh = json.loads(r.read())["resolution"].get("shared")
            if sh is not None:
                out.append(sh)
        return out


def start_gateway(up: int, store: str, name: str) -> bg.Proxy:
    port = bg.free_port()
    cmd = [sys.executable, "-m", "kvgate.cli", "gateway", "--port", str(port), "--upstream", f"http://127.0.0.1:{up}",
           "--kv-pool", "100000000", "--control", "budgeter", "--log-level", "warning", "--store", store]
    proc = subprocess.Popen(cmd, preexec_fn=bg._pinned(bg.PROXY_CPU), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL)
    bg.wait_port(port, proc=proc)
    return bg.Proxy(name, port, proc)


def start_redis(workdir: Path) -> tuple[subprocess.Popen[bytes], int]:
    binary = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not Path(binary).exists():
        raise SystemExit("redis-server is not installed (apt-get install -y redis-server)")
    port = bg.free_port()
    proc = subprocess.Popen([binary, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(workdir), "--loglevel", "warning"], preexec_fn=bg._pinned(bg.PROXY_CPU),
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    bg.wait_port(port, proc=proc)
    return proc, port


@contextlib.contextmanager
def running() -> Iterator[tuple[list[Arm], subprocess.Popen[bytes]]]:
    workdir = Path(tempfile.mkdtemp(prefix="kvgate-bench-shared-"))
    up = bg.free_port()
    upstream = subprocess.Popen([sys.executable, bg.__file__, "--serve-upstream", str(up)],
                                preexec_fn=bg._pinned(bg.CLIENT_CPU))
    redis, rport = start_redis(workdir)
    arms: list[Arm] = []
    try:
        bg.wait_port(up, proc=upstream)
        arms.append(Arm("direct", [], [up]))
        emb = start_gateway(up, f"sqlite://{workdir / 'books'}", "embedded")
        arms.append(Arm("embedded", [emb], [emb.port]))
        for n in (1, 2, 3):
            store = f"redis://127.0.0.1:{rport}/{n}"  # (a database of each arm's own: one set of books each)
            gws = [start_gateway(up, store, f"redis-{n}.{i}") for i in range(n)]
            arms.append(Arm(f"redis-{n}", gws, [g.port for g in gws]))
        yield arms, redis
    finally:
        for a in arms:
            for p in a.proxies:
                p.stop()
        redis.terminate()
        redis.wait()
        upstream.terminate()
        upstream.wait()
        shutil.rmtree(workdir, ignore_errors=True)


async def spread_loop(ports: list[int], concurrency: int, *, seconds: float, count: int = 0, warmup: float = 0.3
                      ) -> bg.LoadResult:
    """:func:`bench_gateway.closed_loop` with its connections spread over ``ports`` in turn."""
    loop = asyncio.get_running_loop()
    reqs = {p: [bg._request("127.0.0.1", p, i, False) for i in range(bg.SESSIONS)] for p in ports}  # (its Host)
    conns = [(ports[i % len(ports)], (await loop.create_connection(bg._Conn, "127.0.0.1", ports[i % len(ports)]))[1])
             for i in range(concurrency)]
    counter = iter(range(1 << 62))
    state = {"measuring": False, "stop": False, "done": 0, "errors": 0}
    lat: list[float] = []
    perf = time.perf_counter

    async def worker(port: int, c: bg._Conn) -> None:
        while not state["stop"]:
            t0 = perf()
            try:
                status = await c.send(reqs[port][next(counter) % bg.SESSIONS])
            except ConnectionError:
                state["errors"] += 1
                return
            if state["measuring"]:
                lat.append(perf() - t0)
                state["errors"] += status != 200
                state["done"] += 1
                if count and state["done"] >= count:
                    state["stop"] = True

    tasks = [asyncio.create_task(worker(p, c)) for p, c in conns]
    await asyncio.sleep(warmup)
    state["measuring"] = True
    t0 = perf()
    limit = t0 + seconds
    while not state["stop"] and perf() < limit:
        await asyncio.sleep(0.005)
    state["stop"] = True
    elapsed = perf() - t0
    await asyncio.wait(tasks, timeout=10)
    for _, c in conns:
        c.t.close()
    n = state["done"]
    return bg.LoadResult(n, elapsed, lat[:n], state["errors"])


def _trips(arm: Arm) -> dict[str, int]:
    out: dict[str, int] = {"turns": 0}
    for sh in arm.shared():
        out["turns"] += sh["turns_asked"]
        for k, v in sh["round_trips_by_phase"].items():
            out[k] = out.get(k, 0) + v
    return out


async def one_arm(arm: Arm, redis_pid: int, res: dict[str, Any], quick: bool) -> None:
    """One arm's cells of one round into ``res``."""
    shared = arm.name.startswith("redis")
    everything = list(arm.proxies)
    await bg.settle(everything)
    c0, r0, t0, w0 = bg.cpu_seconds(arm.pids()), bg.cpu_seconds([redis_pid]), _trips(arm), time.monotonic()
    lr = await spread_loop(arm.ports, 1, seconds=8.0, count=600 if quick else 2000)
    wall = time.monotonic() - w0
    cpu, rcpu, t1 = bg.cpu_seconds(arm.pids()) - c0, bg.cpu_seconds([redis_pid]) - r0, _trips(arm)
    res.setdefault("latency", {}).setdefault(arm.name, []).append(
        (statistics.median(lr.latencies), bg._pct(lr.latencies, 99)))
    res.setdefault("errors", {})[arm.name] = res.get("errors", {}).get(arm.name, 0) + lr.errors
    served = lr.requests + int(0.3 * lr.rps)  # (the warm-up's turns cost CPU too)
    if arm.proxies:
        res.setdefault("cpu_ms", {}).setdefault(arm.name, []).append(1000 * cpu / served)
        res.setdefault("redis_cpu_ms", {}).setdefault(arm.name, []).append(1000 * rcpu / served)
    if shared:
        turns = max(1, t1["turns"] - t0["turns"])
        per = {k: (t1.get(k, 0) - t0.get(k, 0)) / turns for k in ("boundary", "end")}
        per["background_per_s"] = (t1.get("background", 0) - t0.get("background", 0)) / wall
        res.setdefault("trips", {}).setdefault(arm.name, []).append(per)
    for c in LEVELS:
        await bg.settle(everything)
        tr = await spread_loop(arm.ports, c, seconds=1.0 if quick else 2.0)
        res.setdefault("rps", {}).setdefault(f"{arm.name} c={c}", []).append(tr.rps)
        res["errors"][arm.name] += tr.errors


async def measure(arms: list[Arm], redis_pid: int, rounds: int, quick: bool) -> dict[str, Any]:
    res: dict[str, Any] = {}
    for r in range(rounds):
        print(f"round {r + 1}/{rounds}", file=sys.stderr)
        for arm in arms if r % 2 == 0 else arms[::-1]:
            await one_arm(arm, redis_pid, res, quick)
    return res


def summarize(res: dict[str, Any]) -> dict[str, Any]:
    med = statistics.median
    out: dict[str, Any] = {"arms": {}}
    direct = res["latency"]["direct"]
    for name in ARMS:
        lat = res["latency"].get(name)
        if lat is None:
            continue
        row: dict[str, Any] = {
            "median_ms": 1000 * med(x[0] for x in lat), "p99_ms": 1000 * med(x[1] for x in lat),
            "added_ms": 1000 * med(a[0] - d[0] for a, d in zip(lat, direct, strict=True)),
            "errors": res["errors"].get(name, 0)}
        if name in res.get("cpu_ms", {}):
            row["cpu_ms_per_turn"] = med(res["cpu_ms"][name])
            row["redis_cpu_ms_per_turn"] = med(res["redis_cpu_ms"][name])
        if name in res.get("trips", {}):
            trips = res["trips"][name]
            row["round_trips_per_turn"] = {k: med(t[k] for t in trips) for k in trips[0]}
        for c in LEVELS:
            row[f"rps_c{c}"] = med(res["rps"][f"{name} c={c}"])
        out["arms"][name] = row
    emb = out["arms"].get("embedded")
    if emb is not None:
        for name, row in out["arms"].items():
            if name.startswith("redis"):
                row["vs_embedded"] = {
                    "added_latency_ms": row["added_ms"] - emb["added_ms"],
                    "added_cpu_ms_per_turn": row["cpu_ms_per_turn"] - emb["cpu_ms_per_turn"],
                    **{f"rps_c{c}_ratio": row[f"rps_c{c}"] / emb[f"rps_c{c}"] for c in LEVELS}}
    return out


def table(summary: dict[str, Any]) -> str:
    head = ("| arm | median ms | p99 ms | added ms | CPU ms/turn (gateways) | redis CPU ms/turn | trips/turn boundary "
            "| end | background/s | " + " | ".join(f"req/s c={c}" for c in LEVELS) + " | errors |")
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for name, r in summary["arms"].items():
        t = r.get("round_trips_per_turn", {})
        cells = [name, f"{r['median_ms']:.3f}", f"{r['p99_ms']:.3f}", f"{r['added_ms']:.3f}",
                 f"{r['cpu_ms_per_turn']:.3f}" if "cpu_ms_per_turn" in r else "",
                 f"{r['redis_cpu_ms_per_turn']:.3f}" if "redis_cpu_ms_per_turn" in r else "",
                 f"{t['boundary']:.2f}" if t else "", f"{t['end']:.2f}" if t else "",
                 f"{t['background_per_s']:.1f}" if t else "",
                 *(f"{r[f'rps_c{c}']:,.0f}" for c in LEVELS), str(r["errors"])]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--quick", action="store_true", help="Shorter runs (for a smoke test).")
    ap.add_argument("--json", default=None, help="Write the results here.")
    args = ap.parse_args()
    with contextlib.suppress(OSError, AttributeError):
        os.sched_setaffinity(0, {bg.CLIENT_CPU})
    load0 = os.getloadavg()[0]
    with running() as (arms, redis):
        res = asyncio.run(measure(arms, redis.pid, args.rounds, args.quick))
    summary = summarize(res)
    summary["setup"] = {"cpus": os.cpu_count(), "gateway_and_redis_cpu": bg.PROXY_CPU, "client_upstream_cpu":
                        bg.CLIENT_CPU, "rounds": args.rounds, "quick": args.quick, "load_at_start": load0,
                        "python": sys.version.split()[0]}
    print(table(summary))
    if args.json:
        Path(args.json).write_text(json.dumps(summary, indent=2, sort_keys=True))


if __name__ == "__main__":
    main()
