"""``kvgate arms``: every control arm on every seed with identical arrivals (§6, Table 3).

An arm is ``NAME[:k=v[:k=v]]`` (e.g. ``cap:K=22:K_hi=25``). With ``--control-at``, recovery is reported over
the runs that were collapsed when control began (hit ratio < 0.5 in the 5 minutes before), and over the
*matched* seeds, collapsed in every arm.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from kvgate.errors import UsageError
from kvgate.policy import parse_control
from kvgate.sim.batch import run_many
from kvgate.sim.config import SimConfig


def arm_config(cfg: SimConfig, spec: str, seed: int) -> SimConfig:
    try:
        name, opts = parse_control(spec)
    except Exception as e:  # PolicyError / ValueError from the parser
        raise UsageError(f"bad arm {spec!r}: {e}") from None
    opt = ",".join(f"{k}={v}" for k, v in opts.items())
    return cfg.with_(seed=seed, control=name, control_opt=opt, label=spec)


def run_arms(
    cfg: SimConfig, specs: list[str], seeds: list[int], *, out: Path | None = None, jobs: int | None = None,
    progress: bool = True,
) -> dict[str, Any]:
    jobs_list = []
    for spec in specs:
        for seed in seeds:
            c = arm_config(cfg, spec, seed)
            jobs_list.append((c, str(out / spec.replace(":", "_") / f"seed-{seed}") if out else None))
    metas = run_many(jobs_list, jobs=jobs, progress=progress, label="control arms")
    summ: dict[str, dict[int, dict[str, Any]]] = {spec: {} for spec in specs}
    i = 0
    for spec in specs:
        for seed in seeds:
            summ[spec][seed] = metas[i]["summary"]
            i += 1
    with_control = cfg.control_at is not None
    matched = [s for s in seeds if with_control and all(summ[a][s].get("collapsed_at_control") for a in specs)]
    arms: dict[str, Any] = {}
    for spec in specs:
        runs = summ[spec]
        rel = [s for s in seeds if runs[s].get("collapsed_at_control")] if with_control else list(seeds)
        arms[spec] = {
            "runs": len(seeds),
            "collapsed": sum(bool(runs[s]["persistently_degraded"]) for s in seeds),
            "collapsed_at_control": len(rel) if with_control else None,
            "recovered": sum(bool(runs[s].get("recovered")) for s in rel) if with_control else None,
            "recovery_min": [runs[s].get("recovery_min") for s in rel if runs[s].get("recovered")],
            "hit_end": [runs[s]["hit_ratio_last10"] for s in rel],
            "cohort_done": [runs[s]["cohort_done"] for s in rel],
            "cohort_latency_p50_min": [runs[s]["cohort_latency_p50_min"] for s in rel],
            "gateway_wait_p90_min": [runs[s]["gateway_wait_p90_min"] for s in rel],
            "turns_per_s_end": [runs[s]["turns_per_s_last10"] for s in rel],
            "seeds": rel,
            "matched": {
                "recovered": sum(bool(runs[s].get("recovered")) for s in matched),
                "recovery_min": [runs[s].get("recovery_min") for s in matched if runs[s].get("recovered")],
                "cohort_latency_p50_min": [runs[s]["cohort_latency_p50_min"] for s in matched],
                "cohort_latency_p90_min": [runs[s]["cohort_latency_p90_min"] for s in matched],
            },
        }
    return {"arms": arms, "matched_seeds": matched, "control_at": cfg.control_at, "per_run": summ}


def _rng(vals: list[Any], fmt: str = "{:.2f}") -> str:
    v = [x for x in vals if x is not None]
    if not v:
        return "-"
    lo, hi = min(v), max(v)
    return fmt.format(lo) if lo == hi else f"{fmt.format(lo)}-{fmt.format(hi)}"


def _rec(vals: list[Any]) -> str:
    v = [x for x in vals if x is not None]
    if not v:
        return "-"
    lo, hi = min(v), max(v)
    if hi < 5:
        return "<5"
    return f"<={hi:.0f}" if lo < 5 else _rng(v, "{:.0f}")


def format_arms(res: dict[str, Any]) -> str:
    ctl = res["control_at"] is not None
    w = max(12, *(len(s) for s in res["arms"]))
    if ctl:
        head = f"{'control':<{w}}  degraded  recovered  time (min)  hit (end)   cohort done  first-turn wait p90 (min)"
    else:
        head = f"{'control':<{w}}  degraded  hit (end)   turns/s (end)  first-turn wait p90 (min)"
    lines = [head]
    for spec, a in res["arms"].items():
        if ctl:
            lines.append(
                f"{spec:<{w}}  {a['collapsed']:>2}/{a['runs']:<5}  {a['recovered']:>2}/{a['collapsed_at_control']:<6}  "
                f"{_rec(a['recovery_min']):<10}  {_rng(a['hit_end']):<10}  "
                f"{_rng([x * 100 for x in a['cohort_done'] if x is not None], '{:.0f}%'):<11}  "
                f"{_rng(a['gateway_wait_p90_min'])}"
            )
        else:
            lines.append(
                f"{spec:<{w}}  {a['collapsed']:>2}/{a['runs']:<5}  {_rng(a['hit_end']):<10}  "
                f"{_rng(a['turns_per_s_end']):<13}  {_rng(a['gateway_wait_p90_min'])}"
            )
    if ctl:
        lines.append("")
        lines.append(
            "recovered / time / hit / cohort: over the runs collapsed when control began "
            "(hit < 0.5 in the 5 min before)"
        )
        ms = res["matched_seeds"]
        lines.append(f"seeds collapsed in every arm: {len(ms)} {ms}")
        for spec, a in res["arms"].items():
            mm = a["matched"]
            lines.append(
                f"  {spec:<{w}} recovered {mm['recovered']}/{len(ms)}  time {_rec(mm['recovery_min'])}  "
                f"cohort latency p50 {_rng(mm['cohort_latency_p50_min'], '{:.1f}')} min"
            )
    return "\n".join(lines)
