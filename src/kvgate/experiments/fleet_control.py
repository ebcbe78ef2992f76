"""Per-replica budgets on a fleet: the paper's §6 prevention and recovery on 4 × 400K-token replicas
behind the kvgate router (session affinity, new sessions placed by headroom, one budget D_r against C_r per
replica).

Both use the paper's own §6 conditions per replica — λ = 0.04 sessions/s per replica (4 × 0.04 on the fleet), the
paper's triggers scaled to the fleet's arrivals — and compare the kvgate router with no control against the same
router with the budgeter (its paper defaults, one per replica): from the start (prevention: a 2×/2-min burst at
minute 10, a flush of every replica at minute 10, no trigger), or switched on at minute 20 after a 2×/4-min burst
at minute 10 (recovery; Table 3's design, the two arms identical up to minute 20). The claims, in
``fleet_control.toml``, are kvgate's expectations, counted apart from the paper's.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvgate.experiments.base import Context, Experiment, Result, frac, rng
from kvgate.experiments.common import recovery_time
from kvgate.experiments.fleet import FLEET, REPLICAS, fs_of, per_replica_figure
from kvgate.experiments.verdicts import baseline
from kvgate.sim.config import SimConfig

LAM = 0.04
"""Per replica: the paper's λ for its §6 prevention and recovery runs."""
CONTROL_ARMS = ("none", "budgeter")
BASE = FLEET.with_(router="kvgate", lam=REPLICAS * LAM, minutes=60)

# -- prevention: the budget from the start -------------------------------------------------------------------------
HEALTHY_LAM = 0.035
"""Per replica: the paper's healthy load (§3, Table 2), where the budget's cost in throughput is measured."""
PREV_TRIGGERS: dict[str, dict[str, Any]] = {
    "burst": {"bursts": ("1.0@10+2",)},
    "flush": {"flush_at": 10.0},
    "twin": {},
    "healthy": {"lam": REPLICAS * HEALTHY_LAM},
}
"""The paper's prevention triggers (a 2× burst for 2 minutes, a flush, both at minute 10); no trigger at the same
load (how much of the collapse is the trigger's); no trigger at the paper's healthy load (the budget's cost in
throughput, judged where the uncontrolled fleet stays healthy)."""
LABELS = {"burst": "burst", "flush": "flush", "twin": "no trigger", "healthy": f"no trigger, 4 × {HEALTHY_LAM}"}


def _prev_seeds(quick: bool) -> list[int]:
    return [1, 2] if quick else list(range(1, 9))


def plan_prevention(quick: bool) -> list[tuple[str, SimConfig]]:
    seeds = _prev_seeds(quick)
    trig = ("burst", "flush") if quick else tuple(PREV_TRIGGERS)
    return [(f"{t}/{c}/seed-{s}", BASE.with_(seed=s, control=c, label=f"{t}, {c}", **PREV_TRIGGERS[t]))
            for t in trig for c in CONTROL_ARMS for s in seeds]


def _degraded(ctx: Context, key: str) -> int:
    return int(fs_of(ctx.runs[key])["fleet"]["replicas_degraded"])


def eval_prevention(ctx: Context) -> Result:
    seeds = _prev_seeds(ctx.quick)
    head = f"{'trigger':<22} {'control':<9} {'seeds with one degraded':>24} {'replicas degraded':>18} "
    head += f"{'fleet hit (all)':>16} {'turns done':>12} {'parked turns':>13}"
    rows = [head]
    premise = [sum(_degraded(ctx, f"{t}/none/seed-{s}") > 0 for s in seeds) for t in ("burst", "flush")]
    ctx.judge(
        "fleet_prevention.premise",
        any(premise),
        "; ".join(f"{t}: {k} of {len(seeds)} seeds" for t, k in zip(("burst", "flush"), premise, strict=True)),
    )
    for t in PREV_TRIGGERS:
        if f"{t}/none/seed-{seeds[0]}" not in ctx.runs:
            continue
        nd = {c: [_degraded(ctx, f"{t}/{c}/seed-{s}") for s in seeds] for c in CONTROL_ARMS}
        for c in CONTROL_ARMS:
            fs = [fs_of(ctx.runs[f"{t}/{c}/seed-{s}"]) for s in seeds]
            rows.append(f"{LABELS[t]:<22} {c:<9} {frac(sum(d > 0 for d in nd[c]), len(seeds)):>24} "
                        f"{sum(nd[c]):>12} of {REPLICAS * len(seeds):<3} {rng([f['hit_ratio_all'] for f in fs]):>16} "
                        f"{rng([f['turns_done'] for f in fs], '{:.0f}'):>12} "
                        f"{rng([f['fleet']['parked_turns'] for f in fs], '{:.0f}'):>13}")
        if t == "twin":
            ctx.claims.append(baseline(f"no trigger at 4 × {LAM}: replicas persistently degraded, no control / "
                                       "budget per replica", f"{sum(nd['none'])} / {sum(nd['budgeter'])} of "
                                       f"{REPLICAS * len(seeds)}", "how much of the triggered runs' collapse is "
                                       "the trigger's"))
        if t in ("twin", "healthy"):
            continue
        k = sum(d > 0 for d in nd["budgeter"])
        ctx.judge(f"fleet_prevention.{t}", (k, len(seeds)), f"{k} of {len(seeds)} seeds ({sum(nd['budgeter'])} "
                  f"of {REPLICAS * len(seeds)} replicas)")
        bad = [s for s, d in zip(seeds, nd["none"], strict=True) if d]
        kb = sum(nd["budgeter"][seeds.index(s)] > 0 for s in bad)
        ctx.judge(f"fleet_prevention.{t}_vs_none", (kb, len(bad)),
                  f"{kb} of the {len(bad)} seeds where some replica degrades without it")
    if not ctx.quick:
        healthy = [s for s in seeds if not _degraded(ctx, f"healthy/none/seed-{s}")]
        none_tp = [fs_of(ctx.runs[f"healthy/none/seed-{s}"])["turns_done"] for s in healthy]
        ratios = [
            fs_of(ctx.runs[f"healthy/budgeter/seed-{s}"])["turns_done"] / tp
            for s, tp in zip(healthy, none_tp, strict=True)
        ]
        cv = float(np.std(none_tp) / np.mean(none_tp)) if len(none_tp) > 1 else math.nan
        dev = [abs(x - 1) / cv for x in ratios] if cv > 0 else []
        ctx.judge("fleet_prevention.tput", dev, f"{rng(dev, '{:.1f}')} CVs: ratio {rng(ratios, '{:.3f}')} on "
                  f"{len(ratios)} of {len(seeds)} seeds (run-to-run CV of no control {cv:.1%})")
    figs = control_figures(ctx, "burst/{c}/seed-{s}", "prevention-burst", "from the start",
                           "+1.0 × 4λ for 2 min at minute 10", seeds[0], shade=[(10, 12)])
    return Result(ctx.claims, figs, ["\n".join(rows)])


# -- recovery: the budget switched on at minute 20 ----------------------------------------------------------------
CONTROL_AT = 20.0
RECOVERY = BASE.with_(bursts=("1.0@10+4",), control_at=CONTROL_AT)


def _rec_seeds(quick: bool) -> list[int]:
    return [1, 2] if quick else list(range(1, 9))


def plan_recovery(quick: bool) -> list[tuple[str, SimConfig]]:
    return [(f"{c}/seed-{s}", RECOVERY.with_(seed=s, control=c, label=c)) for c in CONTROL_ARMS
            for s in _rec_seeds(quick)]


def _replicas(ctx: Context, arm: str, seeds: list[int]) -> list[tuple[int, dict[str, Any]]]:
    """(seed, replica summary) of every replica of the arm's runs."""
    return [(s, row) for s in seeds for row in fs_of(ctx.runs[f"{arm}/seed-{s}"])["replicas"]]


def eval_recovery(ctx: Context) -> Result:
    seeds = _rec_seeds(ctx.quick)
    st: dict[str, dict[str, Any]] = {}
    for c in CONTROL_ARMS:
        reps = _replicas(ctx, c, seeds)
        col = [(s, r) for s, r in reps if r.get("collapsed_at_control")]
        rec = [(s, r) for s, r in col if r.get("recovered")]
        st[c] = {"all": reps, "collapsed": col, "recovered": rec,
                 "time": [r["recovery_min"] for _, r in rec],
                 "hit": [r["hit_ratio_last10"] for _, r in rec],
                 "hit_col": [r["hit_ratio_last10"] for _, r in col]}
    n, b = st["none"], st["budgeter"]
    nc = len(n["collapsed"])
    ctx.judge("fleet_recovery.premise", nc > 0, f"{nc} of {len(n['all'])} replicas ({len(seeds)} seeds)")
    ctx.judge("fleet_recovery.budgeter", (len(b["recovered"]), len(b["collapsed"])),
              f"{len(b['recovered'])} of {len(b['collapsed'])}")
    ctx.judge("fleet_recovery.time", b["time"], recovery_time(b["time"]) + " min" if b["time"] else "none recovered")
    ctx.judge("fleet_recovery.hit", b["hit"], rng(b["hit"]))
    fn = len(n["recovered"]) / nc if nc else math.nan
    fb = len(b["recovered"]) / len(b["collapsed"]) if b["collapsed"] else math.nan
    ctx.judge(
        "fleet_recovery.none",
        (fn < fb) if nc and b["collapsed"] else None,
        f"no control {len(n['recovered'])} of {nc}; budget {len(b['recovered'])} of {len(b['collapsed'])}",
    )
    rows = ["control   collapsed at 20  recovered  time (min)  hit last 10 (collapsed ones)  parked turns  "
            "park wait p90 (min)  unfinished"]
    for c in CONTROL_ARMS:
        x = st[c]
        fs = [fs_of(ctx.runs[f"{c}/seed-{s}"]) for s in seeds]
        pk = [f["fleet"]["parked_turns"] for f in fs]
        w = [f["fleet"]["park_wait_p90_min"] for f in fs]
        unf = rng([f["fleet"]["sessions_unfinished"] for f in fs], "{:.0f}")
        rec = frac(len(x["recovered"]), len(x["collapsed"]))
        rows.append(f"{c:<9} {len(x['collapsed']):>7} of {len(x['all']):<6} {rec:>9}"
                    f"  {recovery_time(x['time']):>10}  {rng(x['hit_col']):>28}  {rng(pk, '{:.0f}'):>12}  "
                    f"{rng(w) if any(pk) else '–':>19}  {unf:>10}")
        ctx.claims.append(baseline(f"{c}: replicas collapsed at minute 20 that recover; their hit ratio, last 10 min",
                                   f"{len(x['recovered'])} of {len(x['collapsed'])}; {rng(x['hit_col'])}"))
    figs = control_figures(ctx, "{c}/seed-{s}", "recovery", "from minute 20", "+1.0 × 4λ for 4 min at minute 10",
                           seeds[0], vline=CONTROL_AT, shade=[(10, 14)])
    return Result(ctx.claims, figs, ["\n".join(rows)])


def control_figures(ctx: Context, run: str, name: str, since: str, trigger: str, seed: int, **kw: Any) -> list[Any]:
    """Per-replica figures of one seed's runs, one per control arm (``run``: the run's key, with ``{c}`` and
    ``{s}``); none unless the page draws."""
    if not ctx.draw:
        return []
    figs = []
    for c in CONTROL_ARMS:
        what = f"budget per replica {since}" if c != "none" else "no control"
        figs.append(per_replica_figure(ctx, ctx.runs[run.format(c=c, s=seed)], f"{name}-{c}",
                                       f"kvgate router, {what}: 4 × 400K at 4 × {LAM}, {trigger} (seed {seed})",
                                       **kw))
    return figs


FLEET_PREVENTION = Experiment(
    "fleet-prevention",
    "Prevention with a budget per replica",
    f"{REPLICAS} × 400K-token replicas (paper-8b) behind the kvgate router at {REPLICAS} × {LAM} = "
    f"{REPLICAS * LAM:.2f}, 60 min, "
    "no control against the budgeter per replica from the start, on the same seeds 1–8, under the paper's §6 "
    "triggers: +1.0 × 4λ for 2 min at minute 10, a flush of every replica at minute 10; no trigger at the same "
    f"load, and no trigger at the paper's healthy load 4 × {HEALTHY_LAM} (the budgets' cost in throughput) (quick: "
    "seeds 1–2, no untriggered runs)",
    plan_prevention,
    eval_prevention,
    "fleet, §6",
    group="fleet",
)
FLEET_RECOVERY = Experiment(
    "fleet-recovery", "Recovery with a budget per replica",
    f"{REPLICAS} × 400K-token replicas (paper-8b) behind the kvgate router at {REPLICAS} × {LAM} = "
    f"{REPLICAS * LAM:.2f}, +1.0 × 4λ "
    f"for 4 min at minute 10, 60 min; no control against the budgeter per replica switched on at minute "
    f"{CONTROL_AT:.0f} (the paper's Table 3 design), seeds 1–8 (quick: 1–2)",
    plan_recovery, eval_recovery, "fleet, §6", group="fleet",
)
