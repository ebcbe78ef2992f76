"""§6: recovery after a collapse on 8B (Table 3) and on 32B trace shapes (Figure 7), and the budgeter's
threshold sensitivity."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvgate.analysis import figures as fg
from kvgate.analysis import metrics as m
from kvgate.analysis.stats import exact_paired_p
from kvgate.experiments import stated
from kvgate.experiments.base import Context, Experiment, Result, rng
from kvgate.experiments.common import (
    B8,
    RECOVERY_ARMS,
    TRACE32,
    arm_stats,
    arms_plan,
    degraded,
    fig_path,
    figure_link,
    mean_of,
    percent_range,
    recovery_time,
    run_end,
    sample_at,
    stayed_healthy,
    whole_cohorts,
)
from kvgate.records import Run
from kvgate.sim.config import SimConfig
from kvgate.workload.shapes import Workload


# -- recovery, 8B (§6, Table 3) -----------------------------------------------------------------------------------
def _rec_seeds(quick: bool) -> list[int]:
    return list(range(1, 7)) if quick else list(range(1, 17))


REC8 = B8.with_(lam=0.04, bursts=("1.0@10+4",), control_at=20.0, minutes=60)


def plan_recovery8(quick: bool) -> list[tuple[str, SimConfig]]:
    return arms_plan(REC8, RECOVERY_ARMS, _rec_seeds(quick))


def _cohort(runs: Sequence[Run], t0: float, t1: float) -> tuple[np.ndarray, int, int]:
    """Pooled arrival-to-completion minutes of finished cohort sessions, and (unfinished, total)."""
    lat, unf, tot = [], 0, 0
    for r in runs:
        arr, end = r.sessions["arrival_s"], r.sessions["end_s"]
        sel = (arr >= t0) & (arr < t1)
        tot += int(sel.sum())
        unf += int(np.isnan(end[sel]).sum())
        lat.extend(((end[sel] - arr[sel]) / 60.0)[~np.isnan(end[sel])].tolist())
    return np.array(lat), unf, tot


def _whole_text(done: Sequence[float], empty: bool = False) -> str:
    k, n = whole_cohorts(done, empty)
    return f"{k} of {n} runs (cohort done {percent_range(list(done))})"


def unfinished_cohort(runs: dict[int, Run], seeds: Sequence[int], t0: float, t1: float) -> str:
    """The cohort sessions (arriving in [t0, t1)) a run left unfinished: when each arrived, how long its first turn
    waited, and the turns it had left when the run ended."""
    out = []
    for s in seeds:
        r = runs[s]
        ses, tu = r.sessions, r.turns
        sel = (ses["arrival_s"] >= t0) & (ses["arrival_s"] < t1) & np.isnan(ses["end_s"])
        for i in np.nonzero(sel)[0]:
            mine = (tu["session"] == ses["session"][i]) & (tu["status"] == "ok")
            first = tu["sent_s"][mine & (tu["turn"] == 0)]
            wait = f"its first turn sent {(first[0] - ses['arrival_s'][i]) / 60:.0f} min after" if len(first) else (
                "no turn sent")
            out.append(f"seed {s}: a session arriving at minute {ses['arrival_s'][i] / 60:.0f}, {wait}, "
                       f"{int(ses['turns'][i]) - int(mine.sum())} of {int(ses['turns'][i])} turns left at minute "
                       f"{run_end(r) / 60:.0f}")
    return "; ".join(out)


def remaining_turns(r: Run, t: float) -> int:
    """Turns still to be served at time ``t`` by the sessions in the system then (arrived, not finished)."""
    ses, tu = r.sessions, r.turns
    live = (ses["arrival_s"] < t) & ~(ses["end_s"] <= t)
    done = (tu["status"] == "ok") & (tu["end_s"] <= t)
    ids, counts = np.unique(tu["session"][done], return_counts=True)
    served = dict(zip(ids.tolist(), counts.tolist(), strict=True))
    return int(sum(int(n) - served.get(int(sid), 0) for sid, n in zip(ses["session"][live], ses["turns"][live],
                                                                         strict=True)))


def drain_min(r: Run, start_s: float, level: float) -> float:
    """Minutes from ``start_s`` until the sessions in the system first fall to ``level`` (1-minute means); the time
    to the run's end if they never do (a lower bound)."""
    end = run_end(r)
    t = start_s + 60.0
    while t <= end + 1e-9:
        if m.sample_mean(r.samples, "in_system", t - 60.0, t) <= level:
            return (t - start_s) / 60.0
        t += 60.0
    return (end - start_s) / 60.0


def _population8(ctx: Context, st: dict[str, Any], seeds: list[int], matched: list[int]) -> None:
    """The runs the recovery rows describe: collapsed when control began (Table 3), collapsed in every arm."""
    k = sum(len(st[a]["collapsed"]) for a in RECOVERY_ARMS)
    per = ", ".join(f"{a} {len(st[a]['collapsed'])}" for a in RECOVERY_ARMS)
    ctx.judge("r8.collapsed_at_control", (k, len(seeds) * len(RECOVERY_ARMS)),
              f"{k} of {len(seeds) * len(RECOVERY_ARMS)} ({per}; of {len(seeds)} seeds each)")
    ctx.judge("r8.matched_count", (len(matched), len(seeds)), f"{len(matched)} of {len(seeds)} seeds")
    rec = sum(s in st["admission-cap"]["recovered"] for s in matched)
    others = ", ".join(f"{a} {sum(s in st[a]['recovered'] for s in matched)}"
                       for a in ("budgeter", "cap", "aimd", "none"))
    ar = {s for s in matched if s in st["admission-cap"]["recovered"]}
    tests = []  # the paper's exact paired tests (p = 0.031), shown: they follow from the counts judged
    for a in ("budgeter", "cap"):
        br = {s for s in matched if s in st[a]["recovered"]}
        tests.append(f"{a} vs admission-only p = {exact_paired_p(len(br - ar), len(ar - br)):.3f}")
    ctx.judge("r8.matched_adm", (rec, len(matched)),
              f"{rec} of {len(matched)} (the others: {others}; {', '.join(tests)})")
    if matched:
        turns = [float(np.mean([remaining_turns(st[a]["runs"][s], 1200.0) for a in RECOVERY_ARMS])) for s in matched]
        ctx.judge("r8.matched_turns", turns, rng(turns, "{:.0f}") + " remaining turns (mean over the arms)")


def eval_recovery8(ctx: Context) -> Result:
    seeds = _rec_seeds(ctx.quick)
    st = {a: arm_stats(ctx, a, seeds) for a in RECOVERY_ARMS}
    matched = [s for s in seeds if all(s in st[a]["collapsed"] for a in RECOVERY_ARMS)]
    _population8(ctx, st, seeds, matched)
    rows = ["control         recovered  time (min)  hit (end)    cohort done"]
    for a in RECOVERY_ARMS:
        x = st[a]
        rows.append(f"{a:<15} {len(x['recovered'])}/{len(x['collapsed']):<8} {recovery_time(x['time']):<11} "
                    f"{rng(x['hit']):<12} {percent_range(x['cohort'])}")
    b, c, n, ad, ai = (st[k] for k in ("budgeter", "cap", "none", "admission-cap", "aimd"))

    def rec(cid: str, x: dict[str, Any]) -> None:
        ctx.judge(cid, (len(x["recovered"]), len(x["collapsed"])), f"{len(x['recovered'])} of {len(x['collapsed'])}")

    rec("r8.none", n)
    ctx.judge("r8.none_hit", n["hit"], rng(n["hit"]))
    ctx.judge("r8.none_cohort", whole_cohorts(n["cohort"], empty=True), _whole_text(n["cohort"], empty=True))
    rec("r8.adm", ad)
    ctx.judge("r8.adm_time", ad["time"], rng(ad["time"], "{:.0f}") + " min" if ad["time"] else "none recovered")
    low = sum(1 for h in ad["hit"] if h is not None and h < 0.1)
    ctx.judge("r8.adm_low", (low, len(ad["collapsed"])), f"{low} of {len(ad['collapsed'])} (hit {rng(ad['hit'])})")
    ctx.judge("r8.adm_hit", ad["hit"], rng(ad["hit"]))
    ctx.judge("r8.adm_cohort", ad["cohort"], percent_range(ad["cohort"]))
    rec("r8.aimd", ai)
    ctx.judge("r8.aimd_time", ai["time"], rng(ai["time"], "{:.0f}") + " min" if ai["time"] else "none recovered")
    ctx.judge("r8.aimd_hit", ai["hit"], rng(ai["hit"]))
    ctx.judge("r8.aimd_cohort", ai["cohort"], percent_range(ai["cohort"]))
    rec("r8.cap", c)
    ctx.judge("r8.cap_time", c["time"], f"{recovery_time(c['time'])} min (runs {rng(c['time'], '{:.0f}')} min)"
              if c["time"] else "none recovered")
    ctx.judge("r8.cap_hit", c["hit"], rng(c["hit"]))
    ctx.judge("r8.cap_cohort", whole_cohorts(c["cohort"]), _whole_text(c["cohort"]))
    rec("r8.bud", b)
    ctx.judge("r8.bud_time", b["time"], recovery_time(b["time"]) + " min")
    ctx.judge("r8.bud_hit", b["hit"], rng(b["hit"]))
    t0, t1 = 20 * 60.0, 40 * 60.0
    left = unfinished_cohort(b["runs"], b["collapsed"], t0, t1)
    ctx.judge("r8.bud_cohort", whole_cohorts(b["cohort"]), _whole_text(b["cohort"]) + (f"; unfinished: {left}" if left
                                                                                        else ""))
    if matched:
        states, spread = [], []
        for s in matched:
            v = [sample_at(st[a]["runs"][s], "in_system", 20.0) for a in RECOVERY_ARMS]
            mu = float(np.mean(v))
            states.append(mu)
            spread.append(max(abs(x - mu) for x in v) / mu if mu > 0 else math.nan)
        ctx.judge("r8.matched_states", states, rng(states, "{:.0f}") + f" ({len(matched)} matched seeds)")
        ctx.judge("r8.matched_spread", None if max(spread) == 0 else max(spread) <= 0.06,
                  "≤ " + rng([max(spread)], "{:.1%}") + " (the arms are one run until control begins)")
        for cid, arm in (("r8.lat_bud", "budgeter"), ("r8.lat_cap", "cap")):
            lat, _, _ = _cohort([st[arm]["runs"][s] for s in matched], t0, t1)
            med = [float(np.median(lat))] if len(lat) else []
            p90 = f" (p90 {np.percentile(lat, 90):.1f})" if len(lat) else ""
            ctx.judge(cid, med, rng(med, "{:.1f}") + " min" + p90)
        for cid, arm in (("r8.aimd_unfinished", "aimd"), ("r8.adm_unfinished", "admission-cap")):
            _, unf, tot = _cohort([st[arm]["runs"][s] for s in matched], t0, t1)
            ctx.judge(cid, [unf / tot] if tot else [], f"{unf} of {tot}")
        lat, _, _ = _cohort([ai["runs"][s] for s in matched], t0, t1)
        med = [float(np.median(lat))] if len(lat) else []
        ctx.judge("r8.lat_aimd", med, rng(med, "{:.1f}") + f" min ({len(lat)} finished)")
        stated.recovery8_rows(ctx, st, matched, _cohort, t0, t1)
    # never collapsed: no 5-minute window under 0.5 over the whole run (not just "not persistently degraded")
    healthy = [r for s, r in n["runs"].items() if s not in n["collapsed"] and stayed_healthy(r)]
    lat, _, _ = _cohort(healthy, t0, t1)
    med = [float(np.median(lat))] if len(lat) else []
    ctx.judge("r8.lat_healthy", med, rng(med, "{:.1f}") + f" min ({len(healthy)} never-collapsed runs)")
    # the queued work drains afterwards: minutes from control start until the sessions in the system are back at
    # the level of the never-collapsed uncontrolled runs over the same minutes (runs that recovered under a limit
    # that parks against the pool)
    level = mean_of([m.sample_mean(r.samples, "in_system", t0, run_end(r)) for r in healthy])
    dr = [drain_min(x["runs"][s], t0, level) for x in (b, c) for s in x["recovered"]] if healthy else []
    to = (f"to {level:.1f} sessions, the never-collapsed level" if healthy
          else "no uncontrolled run stayed healthy to set the level")
    ctx.judge("r8.drain_after", dr, rng(dr, "{:.0f}") + f" min ({to})")
    figs = []
    if ctx.draw:
        seed = matched[0] if matched else seeds[0]
        runs = [ctx.runs[f"{a}/seed-{seed}"] for a in RECOVERY_ARMS]
        f5 = fg.figure_timeseries(runs, ["no control", "admission-only cap", "AIMD + park", "session cap + park",
                                         "budgeter + park"], fig_path(ctx, "figure5"),
                                  title=f"Figure 5 — recovery, control from minute 20 (seed {seed})", vline=20,
                                  shade=[(10, 14)])
        curves = []
        for a in RECOVERY_ARMS:
            xs = list(range(20, 60, 5))
            ys = []
            for x0 in xs:
                vals = [m.cohort_completion(st[a]["runs"][s].sessions, x0 * 60, x0 * 60 + 300)
                        for s in st[a]["collapsed"]]
                ys.append(float(np.nanmean(vals)) if vals else math.nan)
            curves.append((a, xs, ys))
        f8 = fg.figure_cohorts(curves, fig_path(ctx, "figure8"), title="Figure 8 — cohort completion by the end (8B)")
        figs = [("Figure 5: recovery by control", figure_link(f5)), ("Figure 8: cohort completion", figure_link(f8))]
    return Result(ctx.claims, figs, ["\n".join(rows)])


# -- recovery, 32B trace shapes (§6, Figure 7) ------------------------------------------------------------------------
def light_load_cap(workload: Workload, kv_pool: int) -> tuple[int, int]:
    """The paper's fixed-cap rule: K = floor(0.75 C / d), K_hi = floor(0.95 C / d), with d the per-session demand
    (context plus output budget) measured at turn boundaries under a lighter load -- where every session moves at
    its own pace, so the boundaries sample each turn once: d is the turn-weighted mean of prompt + output over the
    workload's shapes."""
    tot = cnt = 0
    for s in workload.shapes():
        for p, o in zip(s.prompt_tokens(), s.outputs, strict=True):
            tot += p + o
            cnt += 1
    d = tot / cnt
    return math.floor(0.75 * kv_pool / d), math.floor(0.95 * kv_pool / d)


def _cap32() -> str:
    from kvgate.engine.costmodel import profile

    k, khi = light_load_cap(TRACE32.workload(), profile(TRACE32.profile).kv_pool)
    return f"cap:K={k}:K_hi={khi}"


def _rec32_arms() -> list[str]:
    return ["none", "admission-cap", _cap32(), "adaptive-cap", "budgeter"]


REC32B_ARMS = ["none", "adaptive-cap", "budgeter"]


def _r32_seeds(quick: bool) -> tuple[list[int], list[int]]:
    return ([1, 2], [1]) if quick else ([1, 2, 3, 4], [1, 2, 3])


def plan_recovery32(quick: bool) -> list[tuple[str, SimConfig]]:
    base = TRACE32.with_(control_at=25.0, minutes=70 if quick else 100)
    a = base.with_(lam=0.03, bursts=("1.5@10+5",))
    b = base.with_(lam=0.025, bursts=("2.0@10+5",))
    s1, s2 = _r32_seeds(quick)
    out = [(f"l03/{k}", c) for k, c in arms_plan(a, _rec32_arms(), s1)]
    out += [(f"l025/{k}", c) for k, c in arms_plan(b, REC32B_ARMS, s2)]
    return out


def _count_between(t: np.ndarray, t0: float, t1: float) -> int:
    return int(((t >= t0) & (t < t1)).sum())


def _done_by(r: Run, t0: float, t1: float, by_s: float) -> float:
    arr, end = r.sessions["arrival_s"], r.sessions["end_s"]
    sel = (arr >= t0) & (arr < t1)
    if not sel.any():
        return math.nan
    return float((~np.isnan(end[sel]) & (end[sel] <= by_s)).mean())


def _matched(st: dict[str, dict[str, Any]], seeds: list[int]) -> dict[str, dict[str, Any]]:
    """``arm_stats`` restricted to the seeds collapsed in every arm when control began (the paper's population on
    32B)."""
    both = [s for s in seeds if all(s in x["collapsed"] for x in st.values())]
    out = {}
    for a, x in st.items():
        y = dict(x)
        y["collapsed"] = both
        y["recovered"] = [s for s in x["recovered"] if s in both]
        y["time"] = [x["all"][s]["recovery_min"] for s in y["recovered"]]
        y["hit"] = [x["all"][s]["hit_ratio_last10"] for s in both]
        out[a] = y
    return out


def eval_recovery32(ctx: Context) -> Result:
    s1, s2 = _r32_seeds(ctx.quick)
    cap_arm = _cap32()
    st = _matched({a: arm_stats(ctx, a, s1, "l03/") for a in _rec32_arms()}, s1)
    bud, ada, cap, adm = st["budgeter"], st["adaptive-cap"], st[cap_arm], st["admission-cap"]
    both = bud["collapsed"]
    ctx.judge("r32.collapsed_every_arm", (len(both), len(s1)),
              f"{len(both)} of {len(s1)} seeds ({', '.join(map(str, both)) or 'none'})")

    def rec(cid: str, x: dict[str, Any], extra: str = "") -> None:
        ctx.judge(cid, (len(x["recovered"]), len(x["collapsed"])),
                  f"{len(x['recovered'])} of {len(x['collapsed'])}{extra}")

    rec("r32.bud", bud)
    ctx.judge("r32.bud_time", bud["time"], recovery_time(bud["time"]) + " min")
    ctx.judge("r32.bud_hit", bud["hit"], rng(bud["hit"]))
    rec("r32.ada", ada)
    ctx.judge("r32.ada_time", ada["time"], recovery_time(ada["time"]) + " min")
    rec("r32.cap", cap, f" ({cap_arm.replace('cap:', 'K from a lighter load: ').replace(':', ', ')})")
    rec("r32.adm", adm)
    ctx.judge("r32.adm_hit", adm["hit"], rng(adm["hit"]))
    if not ctx.quick:
        t0, t1 = 25 * 60.0, 45 * 60.0
        for cid, arms in (("r32.users_bud", ["budgeter"]), ("r32.users_ada", ["adaptive-cap"]),
                          ("r32.users_other", ["none", "admission-cap", cap_arm])):
            v = [_done_by(st[a]["runs"][s], t0, t1, 90 * 60.0) for a in arms for s in both]
            ctx.judge(cid, v, percent_range(v))
        br = [bud["runs"][s] for s in both]
        left = [sample_at(r, "in_system", 90.0) for r in br]
        ctx.judge("r32.users_in_system", left, rng(left, "{:.0f}") + " sessions (minute 90)")
        arr = [_count_between(r.sessions["arrival_s"], 60 * 60.0, 90 * 60.0) for r in br]
        fin = [_count_between(r.sessions["end_s"], 60 * 60.0, 90 * 60.0) for r in br]
        ctx.judge("r32.users_behind", all(f < a for a, f in zip(arr, fin, strict=True)) if br else None,
                  "; ".join(f"{f} completed vs {a} arrived" for a, f in zip(arr, fin, strict=True)) + " (min 60–90)")
    st2 = {a: arm_stats(ctx, a, s2, "l025/") for a in REC32B_ARMS}
    nrs = list(st2["none"]["runs"].values())
    nd = sum(degraded(r.summary) for r in nrs)
    ctx.judge("r32b.none", (nd, len(nrs)), f"{nd} of {len(nrs)}")
    nh = [r.summary["hit_ratio_last10"] for r in nrs]
    ctx.judge("r32b.none_hit", nh, rng(nh))
    ns = [r.summary["sessions_in_system_last5"] for r in nrs]
    ctx.judge("r32b.none_sessions", ns, rng(ns, "{:.0f}"))
    for cid, a in (("r32b.bud_hit", "budgeter"), ("r32b.ada_hit", "adaptive-cap")):
        h = [r.summary["hit_ratio_last10"] for s, r in st2[a]["runs"].items() if s in st2[a]["collapsed"]]
        ctx.judge(cid, h, rng(h))
    for cid, a in (("r32b.bud_cohort", "budgeter"), ("r32b.ada_cohort", "adaptive-cap"),
                   ("r32b.none_cohort", "none")):
        v = [r.summary["cohort_done"] for r in st2[a]["runs"].values()]
        ctx.judge(cid, v, percent_range(v))
    ctl = [r for a in ("budgeter", "adaptive-cap") for r in st2[a]["runs"].values()]
    grow = [(sample_at(r, "in_system", run_end(r) / 60, 5) - sample_at(r, "in_system", run_end(r) / 60 - 30, 5)) / 3
            for r in ctl]
    ctx.judge("r32b.queue_growth", grow, rng(grow, "{:+.1f}") + " sessions per 10 min")
    lvl = [r.summary["sessions_in_system_last5"] for r in ctl]
    ctx.judge("r32b.queue_level", lvl, rng(lvl, "{:.0f}") + " sessions")
    arr = [float(((r.sessions["arrival_s"] >= run_end(r) - 1800) & (r.sessions["arrival_s"] < run_end(r))).sum()) / 30
           for r in ctl]
    done = [float(((r.sessions["end_s"] >= run_end(r) - 1800) & (r.sessions["end_s"] <= run_end(r))).sum()) / 30
            for r in ctl]
    ctx.judge("r32b.completions", done, rng(done) + " per min (last 30 min)")
    out = sum(a > d for a, d in zip(arr, done, strict=True))  # per run: a run whose queue drained does not count
    ctx.judge("r32b.outpace", (out, len(ctl)),
              f"{out} of {len(ctl)}; per run, arrivals vs completions per min (last 30 min): "
              + ", ".join(f"{a:.2f}/{d:.2f}" for a, d in zip(arr, done, strict=True)))
    figs = []
    if ctx.draw:
        seed = sorted(st["none"]["runs"])[0]
        arms = _rec32_arms()
        runs = [ctx.runs[f"l03/{a.replace(':', '_')}/seed-{seed}"] for a in arms]
        f = fg.figure_timeseries(
            runs,
            arms,
            fig_path(ctx, "figure7"),
            title="Figure 7 — 32B (est.) trace shapes, control from minute 25",
            vline=25,
        )
        figs = [("Figure 7: recovery on 32B trace shapes", figure_link(f))]
    return Result(ctx.claims, figs)


# -- threshold sensitivity (§6) -----------------------------------------------------------------------------------
TH_ARMS = ["budgeter", "budgeter:low=0.65:high=0.85", "budgeter:low=0.85:high=0.98"]


def plan_thresholds(quick: bool) -> list[tuple[str, SimConfig]]:
    return arms_plan(REC8, TH_ARMS, _rec_seeds(quick))


def eval_thresholds(ctx: Context) -> Result:
    seeds = _rec_seeds(ctx.quick)
    st = {a: arm_stats(ctx, a, seeds) for a in TH_ARMS}
    alt = [st[a] for a in TH_ARMS[1:]]
    col = sum(len(x["collapsed"]) for x in alt)
    rec = sum(len(x["recovered"]) for x in alt)
    ctx.judge("th.recovered", (rec, col), f"{rec} of {col}")
    times = [t for x in alt for t in x["time"]]
    ctx.judge("th.time", times, recovery_time(times) + " min")
    hits = [h for x in alt for h in x["hit"]]
    ctx.judge("th.hit", hits, rng(hits))
    coh = [h for x in alt for h in x["cohort"]]
    ctx.judge("th.cohort", whole_cohorts(coh), _whole_text(coh))
    tp = [t for x in alt for t in x["tput"]]
    ctx.judge("th.tput_alt", tp, rng(tp) + " turns/s")
    ctx.judge("th.tput_default", st["budgeter"]["tput"], rng(st["budgeter"]["tput"]) + " turns/s")
    rows = ["thresholds                    recovered  time   hit (end)   turns/s (end)"]
    for a in TH_ARMS:
        x = st[a]
        rows.append(f"{a:<29} {len(x['recovered'])}/{len(x['collapsed']):<8} {recovery_time(x['time']):<6} "
                    f"{rng(x['hit']):<11} {rng(x['tput'])}")
    figs = []
    if ctx.draw:
        runs = [ctx.runs[f"{a.replace(':', '_')}/seed-{seeds[0]}"] for a in TH_ARMS]
        f = fg.figure_timeseries(
            runs,
            ["0.75/0.95 (default)", "0.65/0.85", "0.85/0.98"],
            fig_path(ctx, "thresholds"),
            title=f"Budgeter thresholds, control from minute 20 (seed {seeds[0]})",
            vline=20,
        )
        figs = [("Budgeter thresholds", figure_link(f))]
    return Result(ctx.claims, figs, ["\n".join(rows)])


RECOVERY_8B_SETUP = "λ 0.04, 2× for 4 min at minute 10, five controls from minute 20 to 60, 16 seeds"
RECOVERY_8B = Experiment(
    "recovery-8b", "Recovery, 8B", RECOVERY_8B_SETUP, plan_recovery8, eval_recovery8, "§6, Table 3"
)


RECOVERY_32B_SETUP = (
    "32B (est.), trace shapes; λ 0.03 with 2.5× for "
    "5 min (5 arms; the fixed cap from a lighter load) and λ 0.025 with 3× for 5 min (3 arms), control "
    "from minute 25"
)
RECOVERY_32B = Experiment(
    "recovery-32b", "Recovery, 32B trace shapes", RECOVERY_32B_SETUP, plan_recovery32, eval_recovery32, "§6, Figure 7"
)


THRESHOLDS_SETUP = "the recovery setup with budgeter thresholds 0.65/0.85 and 0.85/0.98"
THRESHOLDS = Experiment("thresholds", "Threshold sensitivity", THRESHOLDS_SETUP, plan_thresholds, eval_thresholds, "§6")
