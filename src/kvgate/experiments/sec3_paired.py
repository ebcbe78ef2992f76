"""§3 and §4: paired history dependence (Table 2), the degraded regime's anatomy and Figure 4."""

from __future__ import annotations

import math

import numpy as np

from kvgate.analysis import figures as fg
from kvgate.analysis import metrics as m
from kvgate.analysis.stats import sign_test_p
from kvgate.experiments import stated
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
    # the cache-warm capacity: the budgeter under overload keeps the cache warm and the engine busy
    out += [(f"warm/seed-{s}", B8.with_(seed=s, lam=0.07, control="budgeter", minutes=60)) for s in (611, 612)]
    lam04 = range(601, 605) if quick else range(601, 611)
    out += [(f"lam04/seed-{s}", B8.with_(seed=s, lam=0.04, minutes=30)) for s in lam04]
    out += [(f"lam05/seed-{s}", B8.with_(seed=s, lam=0.05, minutes=30)) for s in lam04]  # above the warm capacity
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
    # the paper's sign test (p = 0.00391) follows from these two counts: shown on the first, not judged again
    p = sign_test_p(c["only_trigger"], c["only_twin"])
    ctx.judge("paired.only_burst", (c["only_trigger"], n),
              f"{c['only_trigger']} of {n} ({pair_txt}; two-sided sign test p = {p:.5f})")
    ctx.judge("paired.only_twin", (c["only_twin"], n), f"{c['only_twin']} of {n}")
    arms = [(s, a, ctx.runs[f"seed-{s}/{a}"]) for s in seeds for a in ("twin", "trigger")]
    deg = [r for _, _, r in arms if degraded(r.summary)]
    hea = [r for _, _, r in arms if not degraded(r.summary)]
    hv = [r.summary["hit_ratio_last10"] for r in deg]
    ctx.judge("paired.degraded_hit", hv, rng(hv))
    if not ctx.quick:
        _degraded_backlog(ctx, arms, _nstar(ctx.runs[f"seed-{seeds[0]}/trigger"]))
    hh = [r.summary["hit_ratio_last10"] for r in hea]
    hs = [r.summary["sessions_in_system_last5"] for r in hea]
    ctx.judge("paired.healthy_hit", hh, rng(hh))
    ctx.judge("paired.healthy_sessions", hs, rng(hs, "{:.0f}"))
    trig_deg = [s for s in seeds if degraded(ctx.runs[f"seed-{s}/trigger"].summary)]
    done_inj = []
    for s in trig_deg:
        r = ctx.runs[f"seed-{s}/trigger"]
        inj = r.sessions["cohort"] == "trigger"
        if inj.any() and not np.isnan(r.sessions["end_s"][inj]).any():
            done_inj.append(s)
    fin = len(done_inj)
    ctx.judge("paired.injected_finished", (fin, len(trig_deg)), f"{fin} of {len(trig_deg)}")
    ih = [ctx.runs[f"seed-{s}/trigger"].summary["hit_ratio_last10"] for s in done_inj]
    ctx.judge("paired.injected_hit", ih, rng(ih) + f" ({len(ih)} runs)")
    # the trigger's size alone does not decide: within the one burst design, a healthy burst arm that received more
    # injected sessions than a degraded one (the paper: 11 and 13 collapsed, 17 did not)
    inj_d = [ctx.runs[f"seed-{s}/trigger"].summary["trigger_sessions"] for s in trig_deg]
    inj_h = [ctx.runs[f"seed-{s}/trigger"].summary["trigger_sessions"] for s in seeds if s not in trig_deg]
    ctx.judge("paired.size_not_alone", (max(inj_h) > min(inj_d)) if inj_d and inj_h else None,
              f"degraded burst arms injected {rng(inj_d, '{:.0f}')}, healthy ones {rng(inj_h, '{:.0f}')} sessions")
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
    # Figure 4's values are one typical pair's: each of kvgate's pairs is held against them (mean shown beside)
    pre = [mean_of(list(ser[id(r)]["demand_over_pool"][5:15])) for r in trigs]
    ctx.judge("paired.healthy_side_demand", pre, f"{rng(pre)} (mean {mean_of(pre):.2f}; minutes 5–15)")
    resp = [float(np.mean(r.turns["end_s"] - r.turns["sent_s"])) for r in healthy_twins]
    ctx.judge("paired.healthy_side_R", None, rng(resp, "{:.1f}") + " s")
    peak = [float(np.nanmax(ser[id(r)]["demand_over_pool"])) for r in healthy_twins]
    ctx.judge("paired.twin_peak_demand", peak, rng(peak))
    dtr = [r for r in trigs if degraded(r.summary)]
    d25 = [float(ser[id(r)]["demand_over_pool"][25]) for r in dtr]
    ctx.judge("paired.demand_25", d25, f"{rng(d25)} (mean {mean_of(d25):.2f})")
    if not ctx.quick:
        _demand_end(ctx, ser, dtr)
    rb = [mean_of(list(ser[id(r)]["recomputed_tok_per_s"][5:15])) for r in trigs]
    ctx.judge("paired.recomputed_before", rb, f"{rng(rb, '{:.0f}')} tokens/s (mean {mean_of(rb):.0f})")
    rd = [mean_of(list(ser[id(r)]["recomputed_tok_per_s"][-10:])) for r in dtr]
    ctx.judge("paired.recomputed_degraded", rd, f"{rng(rd, '{:.0f}')} tokens/s (mean {mean_of(rd):.0f})")
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
    _anatomy_more(ctx, seeds, dtr)
    sat = [m.turn_rate(r.turns, run_end(r) - 1800, run_end(r)) for _, r in ctx.select("nocache-sat/")]
    ratio = [mean_of(tp) / mean_of(sat)] if tp and sat else []
    ctx.judge("anatomy.like_nocache", ratio, f"{rng(ratio)} ({rng(tp)} vs no-cache {rng(sat)} turns/s)")
    stated.paired_rows(ctx, seeds)
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


def _degraded_backlog(ctx: Context, arms: list[tuple[int, str, Run]], nstar: float) -> None:
    """Table 2's degraded arms' backlog, with the degraded twins and when each slid (a late one has had less time
    to build it)."""
    sv = [r.summary["sessions_in_system_last5"] for _, _, r in arms if degraded(r.summary)]
    late = [f"{r.summary['sessions_in_system_last5']:.0f} from minute {r.summary['degraded_from_min']:.0f}"
            for _, a, r in arms if a == "twin" and degraded(r.summary)]
    ctx.judge("paired.degraded_backlog", sv, rng(sv, "{:.0f}") + f" ({rng([x / nstar for x in sv], '{:.1f}')} × N* "
              f"= C / L̄ = {nstar:.1f}; degraded twins: {', '.join(late) or 'none'})")


def _demand_end(ctx: Context, ser: dict[int, dict[str, np.ndarray]], dtr: list[Run]) -> None:
    """Figure 4's demand over the last 5 minutes, per degraded burst arm, with its sessions and their tokens each
    (the demand is their product)."""
    dend = [mean_of(list(ser[id(r)]["demand_over_pool"][-5:])) for r in dtr]
    nend = [mean_of(list(ser[id(r)]["in_system"][-5:])) for r in dtr]
    each = [d * int(r.config["kv_pool"] or 400_000) / k / 1000 for d, k, r in zip(dend, nend, dtr, strict=True)]
    ctx.judge("paired.demand_end", dend, f"{rng(dend, '{:.1f}')} (mean {mean_of(dend):.1f}; {rng(nend, '{:.0f}')} "
              f"sessions of {rng(each, '{:.1f}')}K tokens each)")


def _missed_unpreempted(run: Run, t0: float, t1: float) -> float:
    """Of the turns completing in [t0, t1) that missed (less than half their prompt cached), the fraction whose
    request was never preempted: their previous prefix was evicted while the session was between turns."""
    t = run.turns
    sel = (t["end_s"] >= t0) & (t["end_s"] < t1) & (t["status"] == "ok")
    miss = sel & (t["cached_tokens"] < 0.5 * t["prompt_tokens"])
    if not miss.any():
        return math.nan
    return float((t["preemptions"][miss] == 0).mean())


def _nstar(run: Run) -> float:
    """N* = C / L̄: the sessions the pool holds at the mean context of their turns (§4)."""
    from kvgate.workload.config import WorkloadConfig

    return int(run.config["kv_pool"] or 400_000) / WorkloadConfig.from_dict(run.config).workload().mean_turn_context()


def _anatomy_more(ctx: Context, seeds: list[int], dtr: list[Run]) -> None:
    """The degraded regime beside the healthy one: half the throughput, a backlog that keeps growing, misses from
    evictions between turns; and how near the healthy side runs to the cache-warm capacity."""
    from kvgate.workload.config import WorkloadConfig

    wl = WorkloadConfig.from_dict(ctx.runs[f"seed-{seeds[0]}/trigger"].config).workload()
    half, twins, offered = [], [], []
    lam = float(ctx.runs[f"seed-{seeds[0]}/twin"].config["lam"])
    rate = lam * wl.shapes()[0].turns  # the offered turns/s
    for s in seeds:
        tr, tw = ctx.runs[f"seed-{s}/trigger"].summary, ctx.runs[f"seed-{s}/twin"].summary
        if degraded(tr) and not degraded(tw) and tw["turns_per_s_last10"]:
            half.append(tr["turns_per_s_last10"] / tw["turns_per_s_last10"])
            twins.append(tw["turns_per_s_last10"])
            offered.append(tr["turns_per_s_last10"] / rate)
    ctx.judge("anatomy.half_throughput", half, rng(half) + " (degraded burst arm / its healthy twin, last 10 min; "
              f"the twins {rng(twins)} turns/s against the offered {rate:.3g}; the degraded arms {rng(offered)} of "
              "the offered)")
    grew = [r for r in dtr if all(sample_at(r, "in_system", a + 20, 20) > sample_at(r, "in_system", a, 20) + 1e-9
                                  for a in range(30, int(run_end(r) / 60) - 19, 20))]
    ctx.judge("anatomy.backlog_grows", (len(grew), len(dtr)),
              f"{len(grew)} of {len(dtr)} grow over every 20 minutes from minute 30")
    ev = [_missed_unpreempted(r, run_end(r) - 600, run_end(r) + 1) for r in dtr]
    whole = [_missed_unpreempted(r, 0, run_end(r) + 1) for r in dtr]
    ctx.judge("anatomy.evicted_between_turns", ev, rng([x * 100 for x in ev], "{:.1f}%") + " of missed turns (over "
              f"the whole run: {rng([x * 100 for x in whole], '{:.1f}%')})")
    warm = [r for _, r in ctx.select("warm/")]
    cap = [m.turn_rate(r.turns, run_end(r) - 1800, run_end(r)) for r in warm]
    whit = [m.hit_ratio(r.turns, run_end(r) - 1800, run_end(r)) for r in warm]
    frac = [rate / c for c in cap if c > 0]
    ctx.judge("paired.lam_fraction", frac, rng([x * 100 for x in frac], "{:.0f}%") + f" of the cache-warm capacity "
              f"{rng(cap)} turns/s (budgeter under overload, λ = 0.07, last 30 min, hit {rng(whit)})")


PAIRED_8B_SETUP = (
    "8B, 400K pool, λ 0.035, +1.5λ for 5 min at minute 15, "
    "90 min, seeds 501–512, each with its no-burst twin; a session cap on the same bursts; λ 0.04 "
    "without a burst; the degraded regime's anatomy (§4) and Figure 4"
)
PAIRED_8B = Experiment(
    "paired-8b", "Paired history dependence", PAIRED_8B_SETUP, plan_paired, eval_paired, "§3, Table 2, §4"
)
