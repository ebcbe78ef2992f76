"""§3 and §4: paired history dependence (Table 2), the degraded regime's anatomy and Figure 4."""

from __future__ import annotations

import math

import numpy as np

from kvgate.analysis import figures as fg
from kvgate.analysis import metrics as m
from kvgate.analysis.stats import sign_test_p
from kvgate.experiments.base import Context, Experiment, Result, rng
from kvgate.experiments.common import (
    B8,
    PAIRED,
    degraded,
    fig_path,
    figure_link,
    mean_of,
    pair_counts,
    paired_plan,
    run_end,
    sample_at,
    stayed_healthy,
)
from kvgate.records import Run
from kvgate.sim.config import SimConfig


def _paired_seeds(quick: bool) -> list[int]:
    return list(range(501, 505)) if quick else list(range(501, 513))


def plan_paired(quick: bool) -> list[tuple[str, SimConfig]]:
    seeds = _paired_seeds(quick)
    base = PAIRED.with_(minutes=60 if quick else 90)
    out = paired_plan(base, seeds)
    out += [(f"cap/seed-{s}", base.with_(seed=s, control="cap", label="cap")) for s in seeds]
    lam04 = range(601, 605) if quick else range(601, 611)
    out += [(f"lam04/seed-{s}", B8.with_(seed=s, lam=0.04, minutes=30)) for s in lam04]
    out += [(f"nocache-sat/seed-{s}", B8.with_(seed=s, lam=0.02, prefix_caching=False, minutes=60))
            for s in ([601] if quick else [601, 602])]
    return out


def _half_cached_frac(run: Run, t0: float, t1: float) -> float:
    t = run.turns
    ok = (t["end_s"] >= t0) & (t["end_s"] < t1) & (t["status"] == "ok")
    if not ok.any():
        return math.nan
    return float((t["cached_tokens"][ok] < 0.5 * t["prompt_tokens"][ok]).mean())


def eval_paired(ctx: Context) -> Result:
    seeds = _paired_seeds(ctx.quick)
    n = len(seeds)
    c = pair_counts(ctx, seeds)
    pair_txt = f"{c['only_trigger']} only burst, {c['only_twin']} only twin, {c['both']} both, {c['neither']} neither"
    ctx.judge("paired.only_burst", (c["only_trigger"], n), f"{c['only_trigger']} of {n} ({pair_txt})")
    ctx.judge("paired.only_twin", (c["only_twin"], n), f"{c['only_twin']} of {n}")
    if not ctx.quick:
        p = sign_test_p(c["only_trigger"], c["only_twin"])
        ctx.judge("paired.sign_test", p <= 0.05, f"p = {p:.5f}")
    arms = [(s, a, ctx.runs[f"seed-{s}/{a}"]) for s in seeds for a in ("twin", "trigger")]
    deg = [r for _, _, r in arms if degraded(r.summary)]
    hea = [r for _, _, r in arms if not degraded(r.summary)]
    hv = [r.summary["hit_ratio_last10"] for r in deg]
    ctx.judge("paired.degraded_hit", hv, rng(hv))
    if not ctx.quick:
        sv = [r.summary["sessions_in_system_last5"] for r in deg]
        ctx.judge("paired.degraded_backlog", sv, rng(sv, "{:.0f}"))
    hh = [r.summary["hit_ratio_last10"] for r in hea]
    hs = [r.summary["sessions_in_system_last5"] for r in hea]
    ctx.judge("paired.healthy_hit", hh, rng(hh))
    ctx.judge("paired.healthy_sessions", hs, rng(hs, "{:.0f}"))
    trig_deg = [s for s in seeds if degraded(ctx.runs[f"seed-{s}/trigger"].summary)]
    fin = 0
    for s in trig_deg:
        r = ctx.runs[f"seed-{s}/trigger"]
        inj = r.sessions["cohort"] == "trigger"
        if inj.any() and not np.isnan(r.sessions["end_s"][inj]).any():
            fin += 1
    ctx.judge("paired.injected_finished", (fin, len(trig_deg)), f"{fin} of {len(trig_deg)}")
    twins = [ctx.runs[f"seed-{s}/twin"] for s in seeds]
    if not ctx.quick:
        td = [r for r in twins if degraded(r.summary)]
        ctx.judge("paired.twins_spontaneous", (len(td), n), f"{len(td)} of {n}")
        on = [r.summary["degraded_from_min"] for r in td]
        ctx.judge("paired.twin_onset", on, rng(on, "{:.0f}") + " min" if on else "no twin degraded")
    l4 = ctx.select("lam04/")
    bad4 = sum(not stayed_healthy(r) for _, r in l4)
    ctx.judge("paired.lam04_healthy", (bad4, len(l4)), f"{len(l4) - bad4} of {len(l4)} healthy ({bad4} degraded)")
    col = [s for s in seeds if degraded(ctx.runs[f"seed-{s}/trigger"].summary)]
    capbad = sum(degraded(ctx.runs[f"cap/seed-{s}"].summary) for s in col)
    ctx.judge("paired.cap_prevents", (capbad, len(col)),
              f"{capbad} of the {len(col)} seeds whose burst collapses without control")
    healthy_twins = [r for r in twins if not degraded(r.summary)]
    hsys = [m.sample_mean(r.samples, "in_system", 600, run_end(r)) for r in healthy_twins]
    ctx.judge("paired.healthy_side_sessions", hsys, rng(hsys, "{:.1f}") + " (mean, minute 10 to the end)")
    trigs = [ctx.runs[f"seed-{s}/trigger"] for s in seeds]
    ser = {id(r): m.series(r.turns, r.samples, run_end(r)) for r in trigs + twins}
    # Figure 4's point values are one pair's; kvgate's estimate is the mean over its pairs (their range shown)
    pre = [mean_of(list(ser[id(r)]["demand_over_pool"][5:15])) for r in trigs]
    ctx.judge("paired.healthy_side_demand", [mean_of(pre)], f"{mean_of(pre):.2f} (mean; {rng(pre)}; minutes 5–15)")
    resp = [float(np.mean(r.turns["end_s"] - r.turns["sent_s"])) for r in healthy_twins]
    ctx.judge("paired.healthy_side_R", None, rng(resp, "{:.1f}") + " s")
    peak = [float(np.nanmax(ser[id(r)]["demand_over_pool"])) for r in healthy_twins]
    ctx.judge("paired.twin_peak_demand", peak, rng(peak))
    dtr = [r for r in trigs if degraded(r.summary)]
    d25 = [float(ser[id(r)]["demand_over_pool"][25]) for r in dtr]
    ctx.judge("paired.demand_25", [mean_of(d25)] if d25 else [], f"{mean_of(d25):.2f} (mean; {rng(d25)})")
    if not ctx.quick:
        dend = [mean_of(list(ser[id(r)]["demand_over_pool"][-5:])) for r in dtr]
        ctx.judge(
            "paired.demand_end", [mean_of(dend)] if dend else [], f"{mean_of(dend):.1f} (mean; {rng(dend, '{:.1f}')})"
        )
    rb = [mean_of(list(ser[id(r)]["recomputed_tok_per_s"][5:15])) for r in trigs]
    ctx.judge("paired.recomputed_before", [mean_of(rb)], f"{mean_of(rb):.0f} tokens/s (mean; {rng(rb, '{:.0f}')})")
    rd = [mean_of(list(ser[id(r)]["recomputed_tok_per_s"][-10:])) for r in dtr]
    ctx.judge("paired.recomputed_degraded", [mean_of(rd)] if rd else [],
              f"{mean_of(rd):.0f} tokens/s (mean; {rng(rd, '{:.0f}')})")
    # anatomy of the degraded regime (§4): last 10 minutes of the degraded burst arms
    half = [_half_cached_frac(r, run_end(r) - 600, run_end(r) + 1) for r in dtr]
    ctx.judge("anatomy.half_cached", half, rng([x * 100 for x in half], "{:.1f}%"))
    run_ = [sample_at(r, "running", run_end(r) / 60, 10) for r in dtr]
    ctx.judge("anatomy.running", run_, rng(run_, "{:.1f}"))
    kv = [sample_at(r, "kv_usage", run_end(r) / 60, 10) for r in dtr]
    ctx.judge("anatomy.kv_usage", kv, rng([x * 100 for x in kv], "{:.0f}%"))
    if not ctx.quick:
        pre_ = [r.summary["preemptions"] for r in dtr]
        ctx.judge("anatomy.preemptions", pre_, rng(pre_, "{:.0f}"))
    tp = [r.summary["turns_per_s_last10"] for r in dtr]
    ctx.judge("anatomy.turns_per_s", tp, rng(tp))
    sat = [m.turn_rate(r.turns, run_end(r) - 1800, run_end(r)) for _, r in ctx.select("nocache-sat/")]
    ratio = [mean_of(tp) / mean_of(sat)] if tp and sat else []
    ctx.judge("anatomy.like_nocache", ratio, f"{rng(ratio)} ({rng(tp)} vs no-cache {rng(sat)} turns/s)")
    figs = []
    if ctx.draw:
        s0 = seeds[0]
        tw, tr = ctx.runs[f"seed-{s0}/twin"], ctx.runs[f"seed-{s0}/trigger"]
        f1 = fg.figure_timeseries([tw, tr], ["no burst (twin)", "burst (+1.5λ, 5 min)"], fig_path(ctx, "figure1"),
                                  title=f"Figure 1 — paper-8b, λ=0.035, seed {s0}", shade=[(15, 20)])
        f4 = fg.figure_loop(tr, fig_path(ctx, "figure4"), title=f"Figure 4 — the loop, burst arm of seed {s0}",
                            shade=[(15, 20)], twin=tw)
        figs = [
            ("Figure 1: a burst that outlasts itself", figure_link(f1)),
            ("Figure 4: resident demand / pool, recomputed tokens, hit ratio (twin dashed)", figure_link(f4)),
        ]
    return Result(ctx.claims, figs)


PAIRED_8B_SETUP = (
    "8B, 400K pool, λ 0.035, +1.5λ for 5 min at minute 15, "
    "90 min, seeds 501–512, each with its no-burst twin; a session cap on the same bursts; λ 0.04 "
    "without a burst; the degraded regime's anatomy (§4) and Figure 4"
)
PAIRED_8B = Experiment(
    "paired-8b", "Paired history dependence", PAIRED_8B_SETUP, plan_paired, eval_paired, "§3, Table 2, §4"
)
