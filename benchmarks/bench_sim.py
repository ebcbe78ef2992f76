"""Simulator speed: one 90-minute paper-8b burst run, the 24 runs of `kvgate paired`, and the per-block
reference pool timed beside the fast one on the same run.

    python3 benchmarks/bench_sim.py [--repeat 3] [--json out.json] [--baseline DIR]

With ``--baseline DIR`` (a checkout of an earlier commit, e.g. ``git worktree add --detach DIR main``) the same
measurements run first on DIR's code, in a subprocess with PYTHONPATH=DIR/src, and both columns are printed
side by side: before and after in one invocation, under the same machine load. Wall and CPU time (the CPU time
of the paired runs is their worker processes').

Targets (docs/benchmarks.md): one run <= 0.2 s of wall time; the 24 paired runs <= 4 s on 2 cores.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from kvgate.engine.factory import EngineConfig  # noqa: E402
from kvgate.sim import fleet as runner  # noqa: E402
from kvgate.sim.config import SimConfig  # noqa: E402
from kvgate.sim.paired import run_paired  # noqa: E402
from kvgate.sim.runner import simulate  # noqa: E402

RUN = SimConfig(preset="paper-8b", lam=0.035, minutes=90, seed=501, bursts=("1.5@15+5",))


def time_run(cfg: SimConfig, repeat: int) -> tuple[float, float, dict[str, Any]]:
    """Median wall and CPU seconds of ``repeat`` runs."""
    walls = []
    cpus = []
    meta: dict[str, Any] = {}
    for _ in range(repeat):
        t0 = time.perf_counter()
        c0 = time.process_time()
        res = simulate(cfg)
        walls.append(time.perf_counter() - t0)
        cpus.append(time.process_time() - c0)
        meta = res.meta
    return statistics.median(walls), statistics.median(cpus), meta


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def time_reference(cfg: SimConfig) -> float:
    """The same run with the per-block reference pool (tests/support/reference_cache.py) inside the engine."""
    from support.reference_cache import BlockKVPool

    orig = runner.build_engine

    def build(c: EngineConfig) -> Any:
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


def summary_sha(summary: dict[str, Any]) -> str:
    """Digest of a summary without its wall time: equal before and after when the results are identical."""
    import hashlib

    s = {k: v for k, v in summary.items() if k != "wall_s"}
    return hashlib.sha256(json.dumps(s, sort_keys=True, default=str).encode()).hexdigest()[:12]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--skip-reference", action="store_true")
    ap.add_argument("--baseline", type=Path, default=None, help="Checkout whose code to measure first (before).")
    a = ap.parse_args()
    before: dict[str, Any] | None = None
    if a.baseline is not None:
        tmp = Path(f"/tmp/bench-sim-baseline-{os.getpid()}.json")
        env = {**os.environ, "PYTHONPATH": str(a.baseline.resolve() / "src")}
        cmd = [sys.executable, __file__, "--repeat", str(a.repeat), "--skip-reference", "--json", str(tmp)]
        subprocess.run(cmd, env=env, check=True, stdout=subprocess.DEVNULL)
        before = json.loads(tmp.read_text())
        tmp.unlink()
    one, one_cpu, meta = time_run(RUN, a.repeat)
    sim_s = RUN.minutes * 60
    twin_one, twin_cpu, _ = time_run(RUN.with_(bursts=()), a.repeat)
    t0 = time.perf_counter()
    c0 = children_cpu() + time.process_time()
    res = run_paired(RUN, list(range(501, 513)), progress=False)
    paired = time.perf_counter() - t0
    paired_cpu = children_cpu() + time.process_time() - c0
    out: dict[str, Any] = {
        "cores": os.cpu_count(),
        "burst_run_wall_s": round(one, 3),
        "burst_run_cpu_s": round(one_cpu, 3),
        "twin_run_wall_s": round(twin_one, 3),
        "twin_run_cpu_s": round(twin_cpu, 3),
        "sim_s_per_wall_s": round(sim_s / one, 0),
        "engine_steps": meta["engine_steps"],
        "turns": meta["summary"]["turns_done"],
        "paired_24_runs_wall_s": round(paired, 2),
        "paired_24_runs_cpu_s": round(paired_cpu, 2),
        "paired_counts": res["counts"],
        "burst_summary_sha": summary_sha(meta["summary"]),
    }
    if not a.skip_reference:
        ref = time_reference(RUN)
        out["reference_pool_run_wall_s"] = round(ref, 3)
        out["fast_over_reference_speedup"] = round(ref / one, 1)
    if before is not None:
        print(f"{'':<32} {'before':>16} {'after':>16}")
        for k, v in out.items():
            print(f"{k:<32} {str(before.get(k, '')):>16} {str(v):>16}")
        out = {"before": before, "after": out}
    else:
        for k, v in out.items():
            print(f"{k:<32} {v}")
    if a.json:
        a.json.write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
