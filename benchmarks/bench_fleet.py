"""Fleet simulator cost: a 4-replica 90-minute run against one replica's, measured in the same invocation.

    python3 benchmarks/bench_fleet.py [--seeds 501-504] [--repeat 1] [--json out.json]

For each seed and scenario, one replica at λ = 0.035 (``simulate``) and a fleet of 4 × 400K at 4λ
(``simulate_fleet``, one router each) run back to back, so both see the same machine load; the ratio is the
fleet's total time over the single replica's, in wall and in CPU time, and per completed turn (4λ does not draw
exactly 4× one replica's turns on a seed). Scenarios: the paper's burst (+1.5λ for 5 min at minute 15) and its
no-burst twin.

Target (issue 13, docs/benchmarks.md): a 4-replica 90-minute run costs <= 4.5x one replica's wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvgate.sim.batch import parse_seeds
from kvgate.sim.config import SimConfig
from kvgate.sim.fleet import simulate_fleet
from kvgate.sim.runner import simulate

LAM = 0.035
REPLICAS = 4
SCENARIOS = {"burst": ("1.5@15+5",), "twin": ()}
ROUTERS = (("kvgate", "budgeter"), ("consistent-hash", "none"), ("round-robin", "none"))


def timed(fn: Any, cfg: SimConfig) -> tuple[float, float, int]:
    c0, t0 = time.process_time(), time.perf_counter()
    res = fn(cfg)
    return time.perf_counter() - t0, time.process_time() - c0, int(res.meta["summary"]["turns_done"])


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="501-504")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    seeds = parse_seeds(a.seeds)
    rows: list[dict[str, Any]] = []
    for scen, bursts in SCENARIOS.items():
        for router, control in ROUTERS:
            one = {"wall": 0.0, "cpu": 0.0, "turns": 0}
            fleet = {"wall": 0.0, "cpu": 0.0, "turns": 0}
            for seed in seeds:
                single = SimConfig(lam=LAM, minutes=90, seed=seed, bursts=bursts, control=control)
                many = SimConfig(lam=REPLICAS * LAM, minutes=90, seed=seed, bursts=bursts, control=control,
                                   replicas=REPLICAS, router=router)  # fmt: skip
                for _ in range(a.repeat):
                    for acc, fn, cfg in ((one, simulate, single), (fleet, simulate_fleet, many)):
                        w, c, n = timed(fn, cfg)
                        acc["wall"] += w
                        acc["cpu"] += c
                        acc["turns"] += n
            row = {
                "scenario": scen, "router": router, "control": control, "seeds": len(seeds),
                "one_wall_s": round(one["wall"], 3), "fleet_wall_s": round(fleet["wall"], 3),
                "wall_ratio": round(fleet["wall"] / one["wall"], 2), "cpu_ratio": round(fleet["cpu"] / one["cpu"], 2),
                "per_turn_ratio": round((fleet["cpu"] / fleet["turns"]) / (one["cpu"] / one["turns"]), 2),
                "turns_ratio": round(fleet["turns"] / one["turns"], 2),
            }  # fmt: skip
            rows.append(row)
            print(f"{scen:<6} {router:<16} one {row['one_wall_s']:>7.2f} s  fleet {row['fleet_wall_s']:>7.2f} s  "
                  f"wall x{row['wall_ratio']:<5} cpu x{row['cpu_ratio']:<5} per turn x{row['per_turn_ratio']:<5} "
                  f"(turns x{row['turns_ratio']})", flush=True)  # fmt: skip
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
