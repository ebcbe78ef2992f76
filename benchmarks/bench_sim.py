"""Simulator speed: one 90-minute paper-8b burst run, the 24 runs of `kvgate paired`, and the per-block
reference pool timed beside the fast one on the same run.

    python3 benchmarks/bench_sim.py [--repeat 3] [--json out.json]

Targets (docs/benchmarks.md): one run <= 1 s of wall time; the 24 paired runs <= 15 s on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kvgate.sim import runner  # noqa: E402
from kvgate.sim.paired import run_paired  # noqa: E402
from kvgate.sim.runner import SimConfig, simulate  # noqa: E402

RUN = SimConfig(preset="paper-8b", lam=0.035, minutes=90, seed=501, bursts=("1.5@15+5",))


def time_run(cfg: SimConfig, repeat: int) -> tuple[float, dict[str, Any]]:
    walls = []
    meta: dict[str, Any] = {}
    for _ in range(repeat):
        t0 = time.perf_counter()
        res = simulate(cfg)
        walls.append(time.perf_counter() - t0)
        meta = res.meta
    return statistics.median(walls), meta


def time_reference(cfg: SimConfig) -> float:
    """The same run with the per-block reference pool (tests/reference_cache.py) inside the engine."""
    from reference_cache import BlockKVPool

    orig = runner.build_engine

    def build(c: SimConfig) -> Any:
        eng = orig(c)
        eng.pool = BlockKVPool(eng.num_blocks, eng.block_size, c.prefix_caching)
        return eng

    runner.build_engine = build  # type: ignore[assignment]
    try:
        t0 = time.perf_counter()
        res = simulate(cfg)
        wall = time.perf_counter() - t0
    finally:
        runner.build_engine = orig  # type: ignore[assignment]
    fast = simulate(cfg)
    same = res.tables["turns"].equals(fast.tables["turns"])
    print(f"reference pool gives identical turn records: {same}")
    return wall


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--skip-reference", action="store_true")
    a = ap.parse_args()
    one, meta = time_run(RUN, a.repeat)
    sim_s = RUN.minutes * 60
    twin_one, _ = time_run(RUN.with_(bursts=()), a.repeat)
    t0 = time.perf_counter()
    res = run_paired(RUN, list(range(501, 513)), progress=False)
    paired = time.perf_counter() - t0
    out: dict[str, Any] = {
        "cores": os.cpu_count(),
        "burst_run_wall_s": round(one, 3),
        "twin_run_wall_s": round(twin_one, 3),
        "sim_s_per_wall_s": round(sim_s / one, 0),
        "engine_steps": meta["engine_steps"],
        "turns": meta["summary"]["turns_done"],
        "paired_24_runs_wall_s": round(paired, 2),
        "paired_counts": res["counts"],
    }
    if not a.skip_reference:
        ref = time_reference(RUN)
        out["reference_pool_run_wall_s"] = round(ref, 3)
        out["fast_over_reference_speedup"] = round(ref / one, 1)
    for k, v in out.items():
        print(f"{k:<32} {v}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
