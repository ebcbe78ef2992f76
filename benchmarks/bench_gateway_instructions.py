"""The gateway's request path in machine instructions: ``kvgate gateway`` under valgrind's callgrind, counted over
a fixed number of requests from ``bench_gateway.py``'s load client to its instant upstream, so this tree and an
earlier one compare on a busy machine too.

    python3 benchmarks/bench_gateway_instructions.py [--base DIR/src] [--requests 2000] [--json out.json]

CPU time per request on a shared 2-core machine moves by 5-15% from round to round; the instructions the
interpreter executes for the same requests do not (the hash seed is fixed; what is left moves by well under 1%
between processes). For each cell the gateway starts under callgrind with instrumentation off, serves a warm-up
(every one of the load's 4,096 sessions once, then a short run at the cell's concurrency), and only then is
counting switched on (``callgrind_control``) for ``--requests`` requests and dumped: imports, start-up and the
sessions' first turns stay out. Cells: plain answers at concurrency 1, 64 and 256, streamed ones at 1 and 64.
With ``--base`` the other checkout's gateway (its ``src`` folder) is counted the same way and the ratio this /
base printed; ``--cache`` simulates the caches too (data reads, writes, first- and last-level misses per request).
Instructions are a floor of the time, not the time (cache misses, the kernel's work in socket calls and the
loop's waiting are not counted): ``bench_gateway.py`` stays the benchmark of time.

Needs ``valgrind`` (Debian: ``apt-get install valgrind``); about a minute a cell and tree.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_gateway as bg  # noqa: E402

CELLS = (("plain", 1, False), ("plain", 64, False), ("plain", 256, False), ("stream", 1, True), ("stream", 64, True))


def _callgrind_control(*args: str) -> None:
    subprocess.run(["callgrind_control", *args], check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


def _totals(out_dir: Path) -> list[int]:
    """The totals of the one dump callgrind wrote (``*.1``) in ``out_dir``: instructions first (then, with the
    cache simulated, Dr Dw I1mr D1mr D1mw ILmr DLmr DLmw)."""
    dumps = sorted(p for p in out_dir.iterdir() if p.name.endswith(".1"))
    if not dumps:
        raise SystemExit("callgrind wrote no dump (is callgrind_control able to reach the process?)")
    text = dumps[-1].read_text(errors="replace")
    m = re.search(r"^(?:summary|totals):\s*([\d ]+)$", text, re.M)
    if m is None:
        raise SystemExit(f"no instruction total in {dumps[-1]}")
    return [int(x) for x in m.group(1).split()]


def count(src: str | None, up: int, concurrency: int, stream: bool, n: int, cache: bool = False) -> list[float]:
    """Instructions per request of the gateway from ``src`` (this tree if None) over ``n`` requests (and with
    ``cache``, data reads and writes and the last-level cache's misses per request)."""
    out_dir = Path(tempfile.mkdtemp(prefix="kvgate-cg-"))
    port = bg.free_port()
    env = {**os.environ, "PYTHONHASHSEED": "0"}
    if src is not None:
        env["PYTHONPATH"] = src
    cmd = ["valgrind", "--tool=callgrind", "--instr-atstart=no", *(["--cache-sim=yes"] if cache else []),
           f"--callgrind-out-file={out_dir}/cg.%p",
           sys.executable, "-m", "kvgate.cli", "gateway", "--port", str(port), "--upstream",
           f"http://127.0.0.1:{up}", "--kv-pool", "100000000", "--control", "budgeter", "--log-level", "warning",
           "--loop", "uvloop"]
    proc = subprocess.Popen(cmd, preexec_fn=bg._pinned(bg.PROXY_CPU), stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, env=env)
    try:
        bg.wait_port(port, timeout=600, proc=proc)
        asyncio.run(bg.closed_loop(port, 16, stream=stream, count=bg.SESSIONS, seconds=600, warmup=0))
        asyncio.run(bg.closed_loop(port, concurrency, stream=stream, count=200, seconds=600, warmup=0))
        _callgrind_control("-i", "on", str(proc.pid))
        res = asyncio.run(bg.closed_loop(port, concurrency, stream=stream, count=n, seconds=1200, warmup=0))
        _callgrind_control("-d", str(proc.pid))
        _callgrind_control("-i", "off", str(proc.pid))
        if res.errors:
            raise SystemExit(f"{res.errors} requests failed")
        # the closed loop stops at n answers; requests the other connections had in flight are counted too
        served = res.requests + (concurrency - 1)
        totals = _totals(out_dir)
        return [x / served for x in (totals if not cache else (*totals[:3], sum(totals[3:6]), sum(totals[6:9])))]
    finally:
        bg.Proxy("gateway", port, proc).stop()
        shutil.rmtree(out_dir, ignore_errors=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base", metavar="SRC", default=None, help="The src folder of another checkout to count too.")
    ap.add_argument("--requests", type=int, default=2000, help="Requests counted per cell (default 2000).")
    ap.add_argument("--only", default=None, help="Comma-separated cells, e.g. plain-c1,stream-c64.")
    ap.add_argument("--cache", action="store_true", help="Simulate the caches too: data reads, writes, first- and "
                    "last-level misses per request (about 3x slower).")
    ap.add_argument("--json", default=None, help="Write the figures to this file.")
    args = ap.parse_args()
    if shutil.which("valgrind") is None or shutil.which("callgrind_control") is None:
        print("valgrind is not installed (apt-get install valgrind)", file=sys.stderr)
        return 2
    if args.base is not None and not Path(args.base, "kvgate").is_dir():
        print(f"--base {args.base}: no kvgate package there (give a checkout's src folder)", file=sys.stderr)
        return 2
    want = None if args.only is None else set(args.only.split(","))
    up = bg.free_port()
    upstream = subprocess.Popen([sys.executable, bg.__file__, "--serve-upstream", str(up)],
                                preexec_fn=bg._pinned(bg.CLIENT_CPU))
    rows: list[dict[str, Any]] = []
    try:
        bg.wait_port(up, proc=upstream)
        for kind, c, stream in CELLS:
            cell = f"{kind}-c{c}"
            if want is not None and cell not in want:
                continue
            t0 = time.monotonic()
            this = count(None, up, c, stream, args.requests, args.cache)
            row: dict[str, Any] = {"cell": cell, "this": this[0]}
            if args.cache:
                row["this_reads"], row["this_writes"], row["this_l1_misses"], row["this_ll_misses"] = this[1:]
            if args.base is not None:
                base = count(args.base, up, c, stream, args.requests, args.cache)
                row["base"], row["ratio"] = base[0], this[0] / base[0]
                if args.cache:
                    row["base_reads"], row["base_writes"], row["base_l1_misses"], row["base_ll_misses"] = base[1:]
            rows.append(row)
            extra = f"  base {row['base']:,.0f}  this/base {row['ratio']:.4f}" if "base" in row else ""
            if args.cache:
                extra += f"  L1 misses this {row['this_l1_misses']:,.0f}" + (
                    f" base {row['base_l1_misses']:,.0f}" if "base" in row else "")
                extra += f"  LL misses this {row['this_ll_misses']:,.1f}" + (
                    f" base {row['base_ll_misses']:,.1f}" if "base" in row else "")
            print(f"{cell:10s} this {row['this']:,.0f} instructions/request{extra}  ({time.monotonic() - t0:.0f} s)",
                  flush=True)
    finally:
        upstream.terminate()
        upstream.wait()
    if args.json:
        Path(args.json).write_text(json.dumps({"requests": args.requests, "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
