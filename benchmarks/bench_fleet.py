"""Fleet simulator cost: a 4-replica 90-minute run against one replica's, measured in the same invocation.

    python3 benchmarks/bench_fleet.py [--seeds 501-504] [--repeat 1] [--json out.json]

For each seed and scenario a fleet of 4 x 400K at 4 lambda (``simulate_fleet``, one router each) is measured
against two baselines, run back to back with it so all see the same machine load:

* ``replica``: each of the fleet's own replicas run alone, on one engine, with exactly the sessions the router
  placed on it (sticky routers; the fleet's records of that replica are bit for bit the lone engine's, see
  tests/sim/test_fleet_replay.py). The ratio is the fleet's time over its mean replica's: the cost of being a
  fleet, the work itself being equal.
* ``draw``: one replica at lambda = 0.035 on the same seed (``simulate``), an independent draw of sessions. 4 lambda
  does not draw exactly 4x one replica's sessions on a seed, nor load each replica as one engine at lambda is
  loaded, so this ratio moves with the draw (the per-turn ratio less so).

Scenarios: the paper's burst (+1.5 lambda for 5 min at minute 15) and its no-burst twin. Times are wall (and CPU)
seconds summed over the seeds.

Target (issue 13, docs/benchmarks.md): a 4-replica 90-minute run costs <= 4.5x one replica's wall time.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

from kvgate.fleet.routers import STICKY
from kvgate.sim.batch import parse_seeds
from kvgate.sim.config import SimConfig, SimResult, validate
from kvgate.sim.fleet import simulate_fleet
from kvgate.sim.runner import simulate
from kvgate.workload.arrivals import SessionSpec, generate

LAM = 0.035
REPLICAS = 4
SCENARIOS = {"burst": ("1.5@15+5",), "twin": ()}
ROUTERS = (("kvgate", "budgeter"), ("consistent-hash", "none"), ("round-robin", "none"))


def timed(fn: Any, cfg: SimConfig, *args: Any) -> tuple[float, float, SimResult]:
    c0, t0 = time.process_time(), time.perf_counter()
    res = fn(cfg, *args)
    return time.perf_counter() - t0, time.process_time() - c0, res


def turns(res: SimResult) -> int:
    return int(res.meta["summary"]["turns_done"])


def placed(res: SimResult, cfg: SimConfig) -> list[list[SessionSpec]]:
    """The sessions of ``res`` by the replica the router placed them on (a sticky router, no failure)."""
    specs = {sp.sid: sp for sp in generate(validate(cfg), cfg.lam, cfg.horizon_s, cfg.seed, cfg.parsed_bursts())}
    sess = res.tables["sessions"]
    out: list[list[SessionSpec]] = [[] for _ in range(cfg.replicas)]
    for sid, rep in zip(sess.column("session").to_pylist(), sess.column("replica").to_pylist(), strict=True):
        out[rep].append(specs[sid])
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", default="501-504")
    ap.add_argument("--repeat", type=int, default=1)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args(argv)
    seeds = parse_seeds(a.seeds)
    rows: list[dict[str, Any]] = []
    for cfg in (SimConfig(lam=LAM, minutes=10), SimConfig(lam=REPLICAS * LAM, minutes=10, replicas=REPLICAS)):
        simulate_fleet(cfg)  # warm-up: imports and first calls are no run's cost
    for scen, bursts in SCENARIOS.items():
        for router, control in ROUTERS:
            acc = {k: {"wall": 0.0, "cpu": 0.0, "turns": 0} for k in ("draw", "fleet", "replica")}
            sticky = router in STICKY
            for seed in seeds:
                single = SimConfig(lam=LAM, minutes=90, seed=seed, bursts=bursts, control=control)
                many = SimConfig(lam=REPLICAS * LAM, minutes=90, seed=seed, bursts=bursts, control=control,
                                   replicas=REPLICAS, router=router)
                for _ in range(a.repeat):
                    w, c, res = timed(simulate, single)
                    acc["draw"]["wall"] += w
                    acc["draw"]["cpu"] += c
                    acc["draw"]["turns"] += turns(res)
                    w, c, res = timed(simulate_fleet, many)
                    acc["fleet"]["wall"] += w
                    acc["fleet"]["cpu"] += c
                    acc["fleet"]["turns"] += turns(res)
                    if not sticky:
                        continue
                    lone = many.with_(replicas=1, router="round-robin", bursts=())
                    for mine in placed(res, many):  # the mean replica: a quarter of the four
                        w, c, one = timed(simulate_fleet, lone, mine)
                        acc["replica"]["wall"] += w / REPLICAS
                        acc["replica"]["cpu"] += c / REPLICAS
                        acc["replica"]["turns"] += turns(one) / REPLICAS
            f = acc["fleet"]
            row: dict[str, Any] = {"scenario": scen, "router": router, "control": control, "seeds": len(seeds),
                                   "fleet_wall_s": round(f["wall"], 3)}
            for base in ("replica", "draw"):
                b = acc[base]
                if not b["turns"]:
                    continue
                row[f"{base}_wall_s"] = round(b["wall"], 3)
                row[f"{base}_wall_ratio"] = round(f["wall"] / b["wall"], 2)
                row[f"{base}_cpu_ratio"] = round(f["cpu"] / b["cpu"], 2)
                row[f"{base}_per_turn_ratio"] = round((f["cpu"] / f["turns"]) / (b["cpu"] / b["turns"]), 2)
            if acc["draw"]["turns"]:
                row["draw_turns_ratio"] = round(f["turns"] / acc["draw"]["turns"], 2)
            rows.append(row)
            rep = (f"replica x{row['replica_wall_ratio']:<5} (cpu x{row['replica_cpu_ratio']})"
                   if "replica_wall_ratio" in row else "replica -" + " " * 14)
            draw = f"draw x{row['draw_wall_ratio']:<5} (per turn x{row['draw_per_turn_ratio']}"
            draw += f", turns x{row['draw_turns_ratio']})"
            print(f"{scen:<6} {router:<16} fleet {row['fleet_wall_s']:>7.2f} s  {rep}  {draw}", flush=True)
    if a.json:
        a.json.write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
