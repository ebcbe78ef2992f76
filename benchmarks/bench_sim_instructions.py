"""Simulator cost in machine instructions: the same runs as ``bench_sim.py`` (and the fleet ratio of
``bench_fleet.py``), counted by valgrind's callgrind, so before and after compare on a busy machine too.

    python3 benchmarks/bench_sim_instructions.py [--baseline DIR] [--only burst,twin,paired,fleet] [--json out.json]

Wall and CPU time on a shared 2-core machine move by 5-10% with the load; instruction counts do not (callgrind
counts what the interpreter executes, whatever else runs). Each measurement runs twice under callgrind in a fresh
interpreter, once with the warm-up alone and once with the warm-up and the runs, and the difference is the runs'
cost (imports and first-call setup cancel); the hash seed is fixed, since a random one moves the counts by about
1% from one process to the next. With ``--baseline DIR`` (a checkout of an earlier commit) DIR's code
is counted too and the ratio after / before printed. Cache misses and branch mispredictions are not counted, so
instructions are a floor of the time, not the time: ``bench_sim.py`` stays the wall-time benchmark.

Measurements: ``burst`` one 90-minute paper-8b run with the +1.5 lambda burst (seed 501, lambda = 0.035), ``twin``
the same without the burst, ``paired`` the 24 runs of ``kvgate paired --seeds 501-512`` (in one process),
``fleet`` a fleet of 4 x 400K at 4 lambda (kvgate router, a budget per replica, the burst) over one replica at
lambda with the same control (the fleet target: <= 4.5x).

Needs ``valgrind`` (Debian: ``apt-get install valgrind``); ~10 minutes for both trees on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

MEASURES = ("burst", "twin", "paired", "fleet_one", "fleet_four")
CHILD = r"""
import sys
try:
    from kvgate.sim.config import SimConfig
except ImportError:  # trees from before the one-house layout
    from kvgate.sim.runner import SimConfig
from kvgate.sim.runner import simulate

what, n = sys.argv[1], int(sys.argv[2])
run = SimConfig(preset="paper-8b", lam=0.035, minutes=90, seed=501, bursts=("1.5@15+5",))
simulate(SimConfig(preset="paper-8b", lam=0.035, minutes=2, seed=1))  # warm-up: imports, first calls
for _ in range(n):
    if what == "burst":
        simulate(run)
    elif what == "twin":
        simulate(run.with_(bursts=()))
    elif what == "paired":
        from kvgate.sim.paired import arms
        for seed in range(501, 513):
            for cfg in arms(run, seed):
                simulate(cfg)
    elif what == "fleet_one":
        simulate(run.with_(control="budgeter"))
    elif what == "fleet_four":
        from kvgate.sim.fleet import simulate_fleet
        simulate_fleet(run.with_(control="budgeter", lam=4 * 0.035, replicas=4, router="kvgate", kv_pool=400_000))
"""


def instructions(src: Path, what: str, n: int) -> int:
    """Instructions callgrind counts for the warm-up plus ``n`` measurements, with ``src`` on the path."""
    env = {**os.environ, "PYTHONPATH": str(src), "PYTHONHASHSEED": "0"}  # (a random seed moves counts ~1%)
    cmd = ["valgrind", "--tool=callgrind", "--callgrind-out-file=/dev/null", sys.executable, "-c", CHILD, what, str(n)]
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
    m = re.search(r"Collected\s*:\s*(\d+)", p.stderr)
    if p.returncode != 0 or m is None:
        tail = p.stderr.strip().splitlines()[-3:]
        raise SystemExit(f"bench_sim_instructions: {what} under {src} failed: {' | '.join(tail)}")
    return int(m.group(1))


def count(src: Path, what: str) -> int:
    """Instructions of one measurement (the warm-up's cancelled)."""
    return instructions(src, what, 1) - instructions(src, what, 0)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--baseline", type=Path, default=None, help="Checkout whose code to count too (before).")
    ap.add_argument("--only", default=",".join(("burst", "twin", "paired", "fleet")),
                    help="Comma-separated subset of burst, twin, paired, fleet.")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    if shutil.which("valgrind") is None:
        print("bench_sim_instructions: needs valgrind (apt-get install valgrind)", file=sys.stderr)
        return 2
    chosen = [w.strip() for w in a.only.split(",") if w.strip()]
    unknown = set(chosen) - {"burst", "twin", "paired", "fleet"}
    if unknown:
        print(f"bench_sim_instructions: unknown measurement(s) {', '.join(sorted(unknown))}", file=sys.stderr)
        return 2
    whats = [m for m in MEASURES if m in chosen or (m.startswith("fleet") and "fleet" in chosen)]
    here = Path(__file__).resolve().parents[1] / "src"
    trees = {"after": here} | ({"before": a.baseline.resolve() / "src"} if a.baseline else {})
    has_fleet = {t: (src / "kvgate" / "sim" / "fleet.py").exists() for t, src in trees.items()}
    jobs = [(tree, what) for tree in trees for what in whats if has_fleet[tree] or not what.startswith("fleet")]
    with ThreadPoolExecutor(max_workers=max(1, a.jobs)) as ex:
        counts = dict(zip(jobs, ex.map(lambda j: count(trees[j[0]], j[1]), jobs), strict=True))
    out: dict[str, Any] = {}
    head = " ".join(f"{t + ' (M instr)':>18}" for t in trees)
    print(f"{'measurement':<14} {head}" + ("  after/before" if a.baseline else ""))
    for what in whats:
        row = {t: counts[(t, what)] for t in trees if (t, what) in counts}
        out[what] = row
        ratio = f"  {row['after'] / row['before']:.3f}" if "before" in row else ""
        print(f"{what:<14} " + " ".join(f"{row[t] / 1e6:>18,.0f}" if t in row else f"{'-':>18}" for t in trees) + ratio)
    if "fleet_one" in whats:
        for t in (t for t in trees if has_fleet[t]):
            r = counts[(t, "fleet_four")] / counts[(t, "fleet_one")]
            out[f"fleet_ratio_{t}"] = round(r, 3)
            print(f"fleet of 4 / one replica ({t}): {r:.2f}x instructions (target: <= 4.5x wall time)")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
