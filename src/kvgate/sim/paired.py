"""Paired runs (§3): each seed run twice with identical base arrivals, once with the trigger and once without.

The twin keeps the trigger's window alignment (``align_min``), so both arms are judged on the same 5-minute
windows. Outcome per pair: only the trigger arm persistently degraded, only the twin, both, or neither; the
two-sided sign test runs over the discordant pairs.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvgate.analysis.stats import sign_test_p
from kvgate.sim.batch import run_many
from kvgate.sim.config import SimConfig
from kvgate.workload.triggers import trigger_end_min, twin_of


def arms(cfg: SimConfig, seed: int) -> tuple[SimConfig, SimConfig]:
    """The twin (without the triggers under test: :func:`kvgate.workload.triggers.twin_of`) and the trigger arm
    of ``seed``."""
    align = cfg.align_min if cfg.align_min is not None else trigger_end_min(cfg)
    trig = cfg.with_(seed=seed, align_min=align, label="trigger")
    twin = twin_of(cfg).with_(seed=seed, align_min=align, label="twin")
    return twin, trig


def run_paired(
    cfg: SimConfig, seeds: list[int], *, out: Path | None = None, jobs: int | None = None, progress: bool = True
) -> dict[str, Any]:
    jobs_list: list[tuple[SimConfig, str | None]] = []
    for seed in seeds:
        twin, trig = arms(cfg, seed)
        jobs_list.append((twin, str(out / f"seed-{seed}" / "twin") if out else None))
        jobs_list.append((trig, str(out / f"seed-{seed}" / "trigger") if out else None))
    metas = run_many(jobs_list, jobs=jobs, progress=progress, label="paired runs")
    pairs = []
    counts = {"only_trigger": 0, "only_twin": 0, "both": 0, "neither": 0}
    for i, seed in enumerate(seeds):
        tw, tr = metas[2 * i]["summary"], metas[2 * i + 1]["summary"]
        pairs.append({"seed": seed, "twin": tw, "trigger": tr})
        a, b = tr["persistently_degraded"], tw["persistently_degraded"]
        key = "both" if a and b else "only_trigger" if a else "only_twin" if b else "neither"
        counts[key] += 1
    return {
        "pairs": pairs,
        "counts": counts,
        "sign_test_p": sign_test_p(counts["only_trigger"], counts["only_twin"]),
        "wall_s": sum(m["summary"].get("wall_s", 0.0) for m in metas),
    }


def format_paired(res: dict[str, Any]) -> str:
    lines = [
        "            no trigger (twin)        trigger",
        "seed        hit    sessions          hit    sessions",
    ]
    for p in res["pairs"]:
        tw, tr = p["twin"], p["trigger"]

        def cell(s: dict[str, Any]) -> str:
            h = s["hit_ratio_last10"]
            star = "*" if s["persistently_degraded"] else " "
            hs = f"{h:.2f}{star}" if h is not None else " n/a "
            return f"{hs:<7}{s['sessions_in_system_last5']:>8.0f}"

        lines.append(f"{p['seed']:<12}{cell(tw)}          {cell(tr)}")
    c = res["counts"]
    lines.append("")
    lines.append("* persistently degraded from its first degraded window after the trigger to the end of the run")
    lines.append(
        f"only trigger arm degraded: {c['only_trigger']}   only twin: {c['only_twin']}   "
        f"both: {c['both']}   neither: {c['neither']}"
    )
    lines.append(f"two-sided sign test over discordant pairs: p = {res['sign_test_p']:.5f}")
    return "\n".join(lines)
