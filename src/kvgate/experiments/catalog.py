"""Every row of the paper's Table 1 as a kvgate experiment (see ``base`` for the framework).

Run lengths and seed counts follow the paper; ``quick`` keeps the claims with fewer seeds and, where a claim
allows, shorter runs (claims that need the paper's sample size or run length are left out of quick pages). No
constant is tuned per experiment: all runs use the calibrated engine profiles and the paper's controller
defaults. Claims are declared once, with the paper's numbers and their rule, in ``claims.py``; an evaluation here
only measures and hands each rule its observation. Seeds 9001 and above are reserved for ``kvgate calibrate``.
Where several seeds are run beyond the paper's count, it is to find seeds that collapse without control, against
which a policy's effect is judged.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvgate.analysis import figures as fg
from kvgate.analysis import metrics as m
from kvgate.analysis.drain import cold_work_per_session, drift_per_hour, fit_cold_cost, fit_cold_cost_all_miss
from kvgate.analysis.stats import exact_paired_p, sign_test_p
from kvgate.experiments.base import Context, Experiment, Result, frac, rng
from kvgate.records import Run
from kvgate.sim.runner import SimConfig
from kvgate.workload.shapes import Workload, preset

B8 = SimConfig(preset="paper-8b")
TRACE32 = SimConfig(trace="bundled", profile="qwen3-32b-mi300x", max_context=38_000)
RECOVERY_ARMS = ["none", "admission-cap", "aimd", "cap", "budgeter"]
HOST_TOKENS = 900_000
"""The paper's 128 GiB host tier at 144 KiB per token."""


def _pd(s: dict[str, Any]) -> bool:
    return bool(s["persistently_degraded"])


def _fig(ctx: Context, name: str) -> Any:
    return ctx.fig_dir / name


def _rel(paths: list[Any]) -> str:
    return f"figures/{paths[0].name}"


def _end(run: Run) -> float:
    return float(run.config["minutes"]) * 60.0


def _onset_min(run: Run, from_min: float = 5.0) -> float | None:
    """Start (minutes) of the persistently degraded stretch with windows aligned at ``from_min`` (no trigger)."""
    ok, since = m.persistent_degradation(run.turns, run.samples, from_min * 60.0, _end(run))
    return since / 60.0 if ok and since is not None else None


def _stayed_healthy(run: Run, from_min: float = 5.0) -> bool:
    """No 5-minute window (from ``from_min``) with a hit ratio below 0.5."""
    hs = [h for _, h in m.window_hits(run.turns, from_min * 60.0, _end(run))]
    return all(math.isnan(h) or h >= m.DEGRADED_HIT for h in hs)


def _sample_at(run: Run, col: str, t_min: float, width_min: float = 1.0) -> float:
    return m.sample_mean(run.samples, col, (t_min - width_min) * 60.0, t_min * 60.0)


def _unfinished(s: dict[str, Any]) -> int:
    return int(s["sessions_arrived"] - s["sessions_finished"])


def _mean(v: Sequence[float]) -> float:
    x = [a for a in v if a is not None and not math.isnan(a)]
    return float(np.mean(x)) if x else math.nan


def _seeds_of(ctx: Context, prefix: str) -> list[int]:
    return sorted({int(k[len(prefix) :].split("seed-")[1].split("/")[0]) for k in ctx.runs if k.startswith(prefix)})


# -- paired history dependence (§3, Table 2; §4 anatomy and Figure 4) ------------------------------------------------
def _paired_plan(base: SimConfig, seeds: list[int], tag: str = "") -> list[tuple[str, SimConfig]]:
    from kvgate.sim.paired import arms

    out = []
    for s in seeds:
        twin, trig = arms(base, s)
        out.append((f"{tag}seed-{s}/twin", twin))
        out.append((f"{tag}seed-{s}/trigger", trig))
    return out


def _pair_counts(ctx: Context, seeds: list[int], tag: str = "", degraded: Any = None) -> dict[str, int]:
    bad = degraded or (lambda r: _pd(r.summary))
    c = {"only_trigger": 0, "only_twin": 0, "both": 0, "neither": 0}
    for s in seeds:
        a, b = bad(ctx.runs[f"{tag}seed-{s}/trigger"]), bad(ctx.runs[f"{tag}seed-{s}/twin"])
        c["both" if a and b else "only_trigger" if a else "only_twin" if b else "neither"] += 1
    return c


def _paired_seeds(quick: bool) -> list[int]:
    return list(range(501, 505)) if quick else list(range(501, 513))


PAIRED = B8.with_(lam=0.035, bursts=("1.5@15+5",))


def plan_paired(quick: bool) -> list[tuple[str, SimConfig]]:
    seeds = _paired_seeds(quick)
    base = PAIRED.with_(minutes=60 if quick else 90)
    out = _paired_plan(base, seeds)
    out += [(f"cap/seed-{s}", base.with_(seed=s, control="cap", label="cap")) for s in seeds]
    lam04 = range(601, 605) if quick else range(601, 611)
    out += [(f"lam04/seed-{s}", B8.with_(seed=s, lam=0.04, minutes=30)) for s in lam04]
    out += [(f"nocache-sat/seed-{s}", B8.with_(seed=s, lam=0.02, prefix_caching=False, minutes=60))
            for s in ([601] if quick else [601, 602])]  # fmt: skip
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
    c = _pair_counts(ctx, seeds)
    pair_txt = f"{c['only_trigger']} only burst, {c['only_twin']} only twin, {c['both']} both, {c['neither']} neither"
    ctx.judge("paired.only_burst", (c["only_trigger"], n), f"{c['only_trigger']} of {n} ({pair_txt})")
    ctx.judge("paired.only_twin", (c["only_twin"], n), f"{c['only_twin']} of {n}")
    if not ctx.quick:
        p = sign_test_p(c["only_trigger"], c["only_twin"])
        ctx.judge("paired.sign_test", p <= 0.05, f"p = {p:.5f}")
    arms = [(s, a, ctx.runs[f"seed-{s}/{a}"]) for s in seeds for a in ("twin", "trigger")]
    deg = [r for _, _, r in arms if _pd(r.summary)]
    hea = [r for _, _, r in arms if not _pd(r.summary)]
    hv = [r.summary["hit_ratio_last10"] for r in deg]
    ctx.judge("paired.degraded_hit", hv, rng(hv))
    if not ctx.quick:
        sv = [r.summary["sessions_in_system_last5"] for r in deg]
        ctx.judge("paired.degraded_backlog", sv, rng(sv, "{:.0f}"))
    hh = [r.summary["hit_ratio_last10"] for r in hea]
    hs = [r.summary["sessions_in_system_last5"] for r in hea]
    ctx.judge("paired.healthy_hit", hh, rng(hh))
    ctx.judge("paired.healthy_sessions", hs, rng(hs, "{:.0f}"))
    trig_deg = [s for s in seeds if _pd(ctx.runs[f"seed-{s}/trigger"].summary)]
    fin = 0
    for s in trig_deg:
        r = ctx.runs[f"seed-{s}/trigger"]
        inj = r.sessions["cohort"] == "trigger"
        if inj.any() and not np.isnan(r.sessions["end_s"][inj]).any():
            fin += 1
    ctx.judge("paired.injected_finished", (fin, len(trig_deg)), f"{fin} of {len(trig_deg)}")
    twins = [ctx.runs[f"seed-{s}/twin"] for s in seeds]
    if not ctx.quick:
        td = [r for r in twins if _pd(r.summary)]
        ctx.judge("paired.twins_spontaneous", (len(td), n), f"{len(td)} of {n}")
        on = [r.summary["degraded_from_min"] for r in td]
        ctx.judge("paired.twin_onset", on, rng(on, "{:.0f}") + " min" if on else "no twin degraded")
    l4 = ctx.select("lam04/")
    bad4 = sum(not _stayed_healthy(r) for _, r in l4)
    ctx.judge("paired.lam04_healthy", (bad4, len(l4)), f"{len(l4) - bad4} of {len(l4)} healthy ({bad4} degraded)")
    col = [s for s in seeds if _pd(ctx.runs[f"seed-{s}/trigger"].summary)]
    capbad = sum(_pd(ctx.runs[f"cap/seed-{s}"].summary) for s in col)
    ctx.judge("paired.cap_prevents", (capbad, len(col)),
              f"{capbad} of the {len(col)} seeds whose burst collapses without control")  # fmt: skip
    healthy_twins = [r for r in twins if not _pd(r.summary)]
    hsys = [m.sample_mean(r.samples, "in_system", 600, _end(r)) for r in healthy_twins]
    ctx.judge("paired.healthy_side_sessions", hsys, rng(hsys, "{:.1f}") + " (mean, minute 10 to the end)")
    trigs = [ctx.runs[f"seed-{s}/trigger"] for s in seeds]
    ser = {id(r): m.series(r.turns, r.samples, _end(r)) for r in trigs + twins}
    # Figure 4's point values are one pair's; kvgate's estimate is the mean over its pairs (their range shown)
    pre = [_mean(list(ser[id(r)]["demand_over_pool"][5:15])) for r in trigs]
    ctx.judge("paired.healthy_side_demand", [_mean(pre)], f"{_mean(pre):.2f} (mean; {rng(pre)}; minutes 5–15)")
    resp = [float(np.mean(r.turns["end_s"] - r.turns["sent_s"])) for r in healthy_twins]
    ctx.judge("paired.healthy_side_R", None, rng(resp, "{:.1f}") + " s")
    peak = [float(np.nanmax(ser[id(r)]["demand_over_pool"])) for r in healthy_twins]
    ctx.judge("paired.twin_peak_demand", peak, rng(peak))
    dtr = [r for r in trigs if _pd(r.summary)]
    d25 = [float(ser[id(r)]["demand_over_pool"][25]) for r in dtr]
    ctx.judge("paired.demand_25", [_mean(d25)] if d25 else [], f"{_mean(d25):.2f} (mean; {rng(d25)})")
    if not ctx.quick:
        dend = [_mean(list(ser[id(r)]["demand_over_pool"][-5:])) for r in dtr]
        ctx.judge(
            "paired.demand_end", [_mean(dend)] if dend else [], f"{_mean(dend):.1f} (mean; {rng(dend, '{:.1f}')})"
        )
    rb = [_mean(list(ser[id(r)]["recomputed_tok_per_s"][5:15])) for r in trigs]
    ctx.judge("paired.recomputed_before", [_mean(rb)], f"{_mean(rb):.0f} tokens/s (mean; {rng(rb, '{:.0f}')})")
    rd = [_mean(list(ser[id(r)]["recomputed_tok_per_s"][-10:])) for r in dtr]
    ctx.judge("paired.recomputed_degraded", [_mean(rd)] if rd else [],
              f"{_mean(rd):.0f} tokens/s (mean; {rng(rd, '{:.0f}')})")  # fmt: skip
    # anatomy of the degraded regime (§4): last 10 minutes of the degraded burst arms
    half = [_half_cached_frac(r, _end(r) - 600, _end(r) + 1) for r in dtr]
    ctx.judge("anatomy.half_cached", half, rng([x * 100 for x in half], "{:.1f}%"))
    run_ = [_sample_at(r, "running", _end(r) / 60, 10) for r in dtr]
    ctx.judge("anatomy.running", run_, rng(run_, "{:.1f}"))
    kv = [_sample_at(r, "kv_usage", _end(r) / 60, 10) for r in dtr]
    ctx.judge("anatomy.kv_usage", kv, rng([x * 100 for x in kv], "{:.0f}%"))
    if not ctx.quick:
        pre_ = [r.summary["preemptions"] for r in dtr]
        ctx.judge("anatomy.preemptions", pre_, rng(pre_, "{:.0f}"))
    tp = [r.summary["turns_per_s_last10"] for r in dtr]
    ctx.judge("anatomy.turns_per_s", tp, rng(tp))
    sat = [m.turn_rate(r.turns, _end(r) - 1800, _end(r)) for _, r in ctx.select("nocache-sat/")]
    ratio = [_mean(tp) / _mean(sat)] if tp and sat else []
    ctx.judge("anatomy.like_nocache", ratio, f"{rng(ratio)} ({rng(tp)} vs no-cache {rng(sat)} turns/s)")
    figs = []
    if ctx.draw:
        s0 = seeds[0]
        tw, tr = ctx.runs[f"seed-{s0}/twin"], ctx.runs[f"seed-{s0}/trigger"]
        f1 = fg.figure_timeseries([tw, tr], ["no burst (twin)", "burst (+1.5λ, 5 min)"], _fig(ctx, "figure1"),
                                  title=f"Figure 1 — paper-8b, λ=0.035, seed {s0}", shade=[(15, 20)])  # fmt: skip
        f4 = fg.figure_loop(tr, _fig(ctx, "figure4"), title=f"Figure 4 — the loop, burst arm of seed {s0}",
                            shade=[(15, 20)], twin=tw)  # fmt: skip
        figs = [
            ("Figure 1: a burst that outlasts itself", _rel(f1)),
            ("Figure 4: resident demand / pool, recomputed tokens, hit ratio (twin dashed)", _rel(f4)),
        ]
    return Result(ctx.claims, figs)


# -- no-cache control (§3) ---------------------------------------------------------------------------------------
def _nc_seeds(quick: bool) -> list[int]:
    return [501, 502] if quick else [501, 502, 503, 504]


def plan_nocache(quick: bool) -> list[tuple[str, SimConfig]]:
    base = B8.with_(lam=0.0086, prefix_caching=False, minutes=90)
    seeds = _nc_seeds(quick)
    out = _paired_plan(base.with_(bursts=("+16@15+5",)), seeds, "abs/")
    out += _paired_plan(base.with_(bursts=("1.5@15+5",)), seeds, "prop/")
    out += [(f"sat/seed-{s}", B8.with_(seed=s, lam=0.02, prefix_caching=False, minutes=60 if quick else 90))
            for s in ([601] if quick else [601, 602])]  # fmt: skip
    return out


def eval_nocache(ctx: Context) -> Result:
    seeds = _nc_seeds(ctx.quick)
    peaks, shrink, level, at_twin = [], 0, 0, 0
    for s in seeds:
        r = ctx.runs[f"abs/seed-{s}/trigger"]
        tw = ctx.runs[f"abs/seed-{s}/twin"].summary
        t = r.samples["t_s"]
        peaks.append(float(r.samples["in_system"][t >= 15 * 60].max()))
        d = r.summary
        if d["in_system_change_last30"] is not None and d["in_system_change_last30"] < 0:
            shrink += 1
        elif d["sessions_in_system_last5"] <= tw["sessions_in_system_last5"] + 3:
            level += 1
        if _unfinished(d) <= _unfinished(tw) + 3:
            at_twin += 1
    n = len(seeds)
    ctx.judge("nocache.peak", peaks, f"peak {rng(peaks, '{:.0f}')}")
    ctx.judge("nocache.drains", (shrink + level, n), f"{shrink} shrinking + {level} at the twin's level, of {n}")
    ctx.judge("nocache.at_twin", (at_twin, n), f"{at_twin} of {n}")
    unf = [_unfinished(ctx.runs[f"prop/seed-{s}/{a}"].summary) for s in seeds for a in ("twin", "trigger")]
    ctx.judge("nocache.prop_unfinished", unf, f"{rng(unf, '{:.0f}')} unfinished")
    sat = [m.turn_rate(r.turns, _end(r) - 1800, _end(r)) for _, r in ctx.select("sat/")]
    ctx.judge("nocache.throughput", sat, f"{rng(sat)} turns/s (λ = 0.02, last 30 min)")
    turns = preset("paper-8b").shapes()[0].turns
    fr = [0.0086 / (x / turns) for x in sat if x > 0]
    ctx.judge("nocache.load_fraction", fr, rng([x * 100 for x in fr], "{:.0f}%") +
              f" (capacity {rng([x / turns for x in sat], '{:.4f}')} sessions/s)")  # fmt: skip
    figs = []
    if ctx.draw:
        r = ctx.runs[f"abs/seed-{seeds[0]}/trigger"]
        f = fg.figure_timeseries([ctx.runs[f"abs/seed-{seeds[0]}/twin"], r], ["twin", "+16 sessions"],
                                 _fig(ctx, "nocache"), title="Prefix caching off: the backlog drains",
                                 shade=[(15, 20)])  # fmt: skip
        figs = [("No cache: the burst's backlog drains", _rel(f))]
    return Result(ctx.claims, figs)


# -- flush trigger (§3) -----------------------------------------------------------------------------------------
def _flush_seeds(quick: bool) -> list[int]:
    return list(range(1, 7)) if quick else list(range(1, 11))


def plan_flush(quick: bool) -> list[tuple[str, SimConfig]]:
    base = B8.with_(lam=0.04, minutes=60, flush_at=10.0)
    seeds = _flush_seeds(quick)
    out = [(f"none/seed-{s}", base.with_(seed=s)) for s in seeds]
    out += [(f"budgeter/seed-{s}", base.with_(seed=s, control="budgeter")) for s in seeds]
    return out


def eval_flush(ctx: Context) -> Result:
    seeds = _flush_seeds(ctx.quick)
    none = {s: ctx.runs[f"none/seed-{s}"] for s in seeds}
    bud = {s: ctx.runs[f"budgeter/seed-{s}"] for s in seeds}
    dn = [s for s in seeds if _pd(none[s].summary)]
    ctx.judge("flush.count", (len(dn), len(seeds)), f"{len(dn)} of {len(seeds)}")
    arr = {s: int(((r.sessions["arrival_s"] >= 600) & (r.sessions["arrival_s"] < 900)).sum()) for s, r in none.items()}
    most = max(arr, key=lambda s: arr[s])
    ctx.judge("flush.most_arrivals", (most in dn) if dn else None,
              f"most arrivals in minutes 10–15: seed {most} ({arr[most]}), "
              f"{'collapsed' if most in dn else 'healthy'}; collapsed: {dn or 'none'}")  # fmt: skip
    db = sum(_pd(r.summary) for r in bud.values())
    ctx.judge("flush.budgeter_count", (db, len(bud)), f"{db} of {len(bud)}")
    dbc = sum(_pd(bud[s].summary) for s in dn)
    ctx.judge("flush.budgeter_prevents", (dbc, len(dn)), f"{dbc} of the {len(dn)} seeds the flush collapses")
    figs = []
    if ctx.draw:
        k0 = dn[0] if dn else seeds[0]
        f = fg.figure_timeseries([none[k0], bud[k0]], [f"no control (seed {k0})", "budgeter"], _fig(ctx, "flush"),
                                 title="Cache flush with preemption at minute 10", vline=10)  # fmt: skip
        figs = [("Flush trigger", _rel(f))]
    return Result(ctx.claims, figs)


# -- trigger size (§3) -------------------------------------------------------------------------------------------
TS_BURSTS = {"2x-2min": "1.0@10+2", "2x-4min": "1.0@10+4", "2.5x-5min": "1.5@10+5"}
LARGE_POOL = 600_000


def _ts_seeds(quick: bool) -> list[int]:
    return list(range(1, 6)) if quick else list(range(1, 11))


def plan_trigger_size(quick: bool) -> list[tuple[str, SimConfig]]:
    base = B8.with_(lam=0.04, minutes=45 if quick else 60)
    seeds = _ts_seeds(quick)
    out = [(f"{k}/seed-{s}", base.with_(seed=s, bursts=(b,))) for k, b in TS_BURSTS.items() for s in seeds]
    out += [(f"pool600/2x-4min/seed-{s}", base.with_(seed=s, bursts=(TS_BURSTS["2x-4min"],), kv_pool=LARGE_POOL))
            for s in seeds]  # fmt: skip
    return out


def eval_trigger_size(ctx: Context) -> Result:
    rows, fr = [], []
    inj_c, inj_h = [], []
    for k in TS_BURSTS:
        runs = ctx.select(f"{k}/")
        d = sum(_pd(r.summary) for _, r in runs)
        rows.append(f"{k:<10} {d}/{len(runs)} collapsed")
        fr.append(d / len(runs))
        for _, r in runs:
            (inj_c if _pd(r.summary) else inj_h).append(r.summary["trigger_sessions"])
    r22 = ctx.select("2x-2min/")
    d22 = sum(_pd(r.summary) for _, r in r22)
    ctx.judge("ts.vllm_2x2", (d22, len(r22)), f"{d22} of {len(r22)}")
    mono = all(a <= b for a, b in zip(fr, fr[1:], strict=False)) and fr[-1] > fr[0]
    ctx.judge("ts.larger_more", mono, "; ".join(rows))
    overlap = bool(inj_c and inj_h and min(inj_c) < max(inj_h))
    ctx.judge(
        "ts.size_not_alone",
        overlap if inj_c and inj_h else None,
        f"collapsed with {rng(inj_c, '{:.0f}')}, healthy with {rng(inj_h, '{:.0f}')} injected sessions",
    )
    big = ctx.select("pool600/2x-4min/")
    dbig = sum(_pd(r.summary) for _, r in big)
    d24 = sum(_pd(r.summary) for _, r in ctx.select("2x-4min/"))
    ctx.judge(
        "ts.larger_pool",
        (dbig < d24) if d24 else None,
        f"2×/4 min: {d24}/{len(big)} collapsed with 400K, {dbig}/{len(big)} with {LARGE_POOL // 1000}K",
    )
    rows.append(f"{'2x-4min, 600K pool':<10} {dbig}/{len(big)} collapsed")
    figs = []
    if ctx.draw:
        runs = [ctx.runs[f"{k}/seed-1"] for k in TS_BURSTS]
        f = fg.figure_timeseries(
            runs,
            list(TS_BURSTS),
            _fig(ctx, "figure3"),
            title="Trigger sizes on one engine (vLLM, λ=0.04, seed 1; cf. Figure 3)",
        )
        figs = [("Trigger sizes", _rel(f))]
    return Result(ctx.claims, figs, ["\n".join(rows)])


# -- trace shapes on 32B (§3, Figure 2) ----------------------------------------------------------------------------
def _t32_seeds(quick: bool) -> list[int]:
    return [1, 2] if quick else [1, 2, 3, 4]


def plan_trace32(quick: bool) -> list[tuple[str, SimConfig]]:
    seeds = _t32_seeds(quick)
    base = TRACE32.with_(lam=0.025, minutes=40)
    out = []
    for s in seeds:
        out.append((f"burst/seed-{s}", base.with_(seed=s, bursts=("1.0@10+4",), align_min=14.0)))
        out.append((f"noburst/seed-{s}", base.with_(seed=s, align_min=14.0)))
        out.append((f"budgeter/seed-{s}", base.with_(seed=s, bursts=("1.0@10+4",), control="budgeter")))
    out.append(("long-noburst/seed-1", base.with_(seed=1, minutes=90 if quick else 120)))
    for s in seeds:
        out.append((f"lam0.03/seed-{s}", base.with_(seed=s, lam=0.03, minutes=80)))
        out.append((f"lam0.03-burst/seed-{s}", base.with_(seed=s, lam=0.03, minutes=80, bursts=("1.5@10+5",))))
    for s in [1] if quick else [1, 2]:
        out.append((f"lam0.035/seed-{s}", base.with_(seed=s, lam=0.035, minutes=40)))
    return out


def _deg_or_partial(r: Run) -> bool:
    return _pd(r.summary) or (r.summary["hit_ratio_last10"] or 1.0) < 0.9


def eval_trace32(ctx: Context) -> Result:
    seeds = _t32_seeds(ctx.quick)
    b = {s: ctx.runs[f"burst/seed-{s}"] for s in seeds}
    nb = {s: ctx.runs[f"noburst/seed-{s}"] for s in seeds}
    bud = {s: ctx.runs[f"budgeter/seed-{s}"] for s in seeds}
    pd = sum(_pd(r.summary) for r in b.values())
    bad = [s for s in seeds if _deg_or_partial(b[s])]
    ctx.judge("t32.count", (len(bad), len(seeds)),
              f"{pd} persistently + {len(bad) - pd} partially of {len(seeds)}")  # fmt: skip
    c = {"only_trigger": 0, "only_twin": 0, "both": 0, "neither": 0}
    for s in seeds:
        x, y = _deg_or_partial(b[s]), _deg_or_partial(nb[s])
        c["both" if x and y else "only_trigger" if x else "only_twin" if y else "neither"] += 1
    ctx.judge("t32.twin_effect", c, f"{c['only_trigger']} only burst, {c['only_twin']} only no-burst, "
              f"{c['both']} both, {c['neither']} neither")  # fmt: skip
    eh = [b[s].summary["hit_ratio_last10"] for s in bad]
    ctx.judge("t32.burst_end_hit", eh, rng(eh))
    nbh = [r.summary["hit_ratio_last10"] for r in nb.values()]
    ctx.judge("t32.noburst_hit", nbh, rng(nbh))
    bb = sum(_deg_or_partial(bud[s]) for s in bad)
    ctx.judge("t32.budgeter_prevents", (bb, len(bad)), f"{bb} of the {len(bad)} seeds the burst degrades")
    lr = ctx.runs["long-noburst/seed-1"]
    on = _onset_min(lr)
    ctx.judge("t32.long_noburst", [on], f"after {on:.0f} min" if on is not None else
              f"not within {lr.config['minutes']:.0f} min")  # fmt: skip
    l3 = [ctx.runs[f"lam0.03/seed-{s}"] for s in seeds]
    o3 = [_onset_min(r) for r in l3]
    n3 = sum(x is not None for x in o3)
    ctx.judge("t32.lam03_count", (n3, len(l3)), f"{n3} of {len(l3)}")
    ctx.judge("t32.lam03_onset", o3, f"after {rng(o3, '{:.0f}')} min")
    l3b = [ctx.runs[f"lam0.03-burst/seed-{s}"] for s in seeds]
    n3b = sum(_pd(r.summary) for r in l3b)
    ctx.judge("t32.lam03_burst", (n3b, len(l3b)), f"{n3b} of {len(l3b)}")
    dh = [m.hit_ratio(r.turns, 74 * 60, 80 * 60) for r, o in zip(l3, o3, strict=True) if o is not None]
    dh += [m.hit_ratio(r.turns, 74 * 60, 80 * 60) for r in l3b if _pd(r.summary)]
    ctx.judge("t32.degraded_hit", dh, rng(dh))
    l35 = ctx.select("lam0.035/")
    o35 = [_onset_min(r) for _, r in l35]
    ctx.judge("t32.lam035_onset", o35, f"after {rng(o35, '{:.0f}')} min" if any(x is not None for x in o35)
              else "no degradation within 40 min")  # fmt: skip
    figs = []
    if ctx.draw:
        s0 = seeds[0]
        f = fg.figure_timeseries([nb[s0], b[s0], bud[s0]], ["no burst", "burst", "burst + budgeter"],
                                 _fig(ctx, "figure2"), title="Figure 2 — Qwen3-32B (est.), trace shapes, λ=0.025",
                                 shade=[(10, 14)])  # fmt: skip
        figs = [("Figure 2: 32B trace shapes", _rel(f))]
    return Result(ctx.claims, figs)


# -- SGLang (§3, Figure 3) ---------------------------------------------------------------------------------------
def plan_sglang(quick: bool) -> list[tuple[str, SimConfig]]:
    sg = B8.with_(engine="sglang", lam=0.04, minutes=60)
    seeds = [1, 2] if quick else [1, 2, 3, 4]
    s3 = [1, 2] if quick else [1, 2, 3]
    out = [(f"2x2/seed-{s}", sg.with_(seed=s, bursts=("1.0@10+2",))) for s in seeds]
    vs = range(1, 5) if quick else range(1, 11)
    out += [(f"vllm-2x2/seed-{s}", sg.with_(seed=s, engine="vllm", bursts=("1.0@10+2",))) for s in vs]
    out += [(f"1.5x5/seed-{s}", sg.with_(seed=s, bursts=("1.5@15+5",))) for s in s3]
    out += [(f"1.5x10/seed-{s}", sg.with_(seed=s, bursts=("1.5@15+10",))) for s in s3]
    out += [(f"flush/seed-{s}", sg.with_(seed=s, flush_at=10.0)) for s in s3]
    out += _paired_plan(sg.with_(bursts=("1.5@15+5",)), seeds, "paired/")
    return out


def eval_sglang(ctx: Context) -> Result:
    def deg(prefix: str) -> tuple[int, int, list[Run]]:
        rs = [r for _, r in ctx.select(prefix)]
        return sum(_pd(r.summary) for r in rs), len(rs), rs

    a, an, r22 = deg("2x2/")
    v, vn, _ = deg("vllm-2x2/")
    ctx.judge("sg.absorbs_2x2", (a, an), f"{an - a} of {an} absorbed ({a} collapsed)")
    ctx.judge("sg.vllm_2x2", (v, vn), f"{v} of {vn}")
    dips = []
    for r in r22:
        s = m.series(r.turns, r.samples, _end(r))
        dips.append(float(np.nanmin(s["hit_ratio"][10:20])))
    dipped = [x for x in dips if x < 0.5]
    ctx.judge("sg.dips", (len(dipped), len(dips)), f"{len(dipped)} of {len(dips)} (minimum 1-min hit {rng(dips)})")
    ctx.judge("sg.dip_depth", dipped, rng(dipped) if dipped else "no dip below 0.5")
    b5, b5n, r5 = deg("1.5x5/")
    b10, b10n, r10 = deg("1.5x10/")
    ctx.judge("sg.large_collapses", (b5 + b10, b5n + b10n), f"{b5 + b10} of {b5n + b10n}")
    lh = [r.summary["hit_ratio_last10"] for r in r5 + r10 if _pd(r.summary)]
    ctx.judge("sg.large_hit", lh, rng(lh))
    lb = [r.summary["sessions_in_system_last5"] for r in r5 + r10 if _pd(r.summary)]
    ctx.judge("sg.large_backlog", lb, rng(lb, "{:.0f}") + " sessions")
    fl, fln, _ = deg("flush/")
    ctx.judge("sg.flush", (fl, fln), f"{fln - fl} of {fln} recovered")
    seeds = _seeds_of(ctx, "paired/")
    c = _pair_counts(ctx, seeds, "paired/")
    ctx.judge("sg.paired_burst", (c["only_trigger"] + c["both"], len(seeds)),
              f"{c['only_trigger'] + c['both']} of {len(seeds)}")  # fmt: skip
    ctx.judge("sg.paired_twin", (c["only_twin"] + c["both"], len(seeds)),
              f"{c['only_twin'] + c['both']} of {len(seeds)} twins degraded")  # fmt: skip
    bh = [ctx.runs[f"paired/seed-{s}/trigger"].summary["hit_ratio_last10"] for s in seeds
          if _pd(ctx.runs[f"paired/seed-{s}/trigger"].summary)]  # fmt: skip
    th = [ctx.runs[f"paired/seed-{s}/twin"].summary["hit_ratio_last10"] for s in seeds
          if not _pd(ctx.runs[f"paired/seed-{s}/twin"].summary)]  # fmt: skip
    ctx.judge("sg.paired_burst_hit", bh, rng(bh))
    ctx.judge("sg.paired_twin_hit", th, rng(th))
    figs = []
    if ctx.draw:
        runs = [ctx.runs["2x2/seed-1"], ctx.runs["1.5x5/seed-1"], ctx.runs["1.5x10/seed-1"]]
        f = fg.figure_timeseries(
            runs,
            ["2× 2 min @10", "+1.5λ 5 min @15", "+1.5λ 10 min @15"],
            _fig(ctx, "sglang"),
            title="SGLang-like engine at λ=0.04 (cf. the paper's Figure 3)",
        )
        figs = [("SGLang: trigger sizes", _rel(f))]
    return Result(ctx.claims, figs)


# -- recovery, 8B (§6, Table 3) -----------------------------------------------------------------------------------
def _arms_plan(base: SimConfig, arms: list[str], seeds: list[int]) -> list[tuple[str, SimConfig]]:
    from kvgate.sim.arms import arm_config

    return [(f"{a.replace(':', '_')}/seed-{s}", arm_config(base, a, s)) for a in arms for s in seeds]


def _rec_seeds(quick: bool) -> list[int]:
    return list(range(1, 7)) if quick else list(range(1, 17))


REC8 = B8.with_(lam=0.04, bursts=("1.0@10+4",), control_at=20.0, minutes=60)


def plan_recovery8(quick: bool) -> list[tuple[str, SimConfig]]:
    return _arms_plan(REC8, RECOVERY_ARMS, _rec_seeds(quick))


def _arm_stats(ctx: Context, arm: str, seeds: list[int], prefix: str = "") -> dict[str, Any]:
    key = prefix + arm.replace(":", "_")
    runs = {s: ctx.runs[f"{key}/seed-{s}"] for s in seeds if f"{key}/seed-{s}" in ctx.runs}
    rs = {s: r.summary for s, r in runs.items()}
    col = [s for s in rs if rs[s].get("collapsed_at_control")]
    return {
        "collapsed": col,
        "recovered": [s for s in col if rs[s].get("recovered")],
        "time": [rs[s]["recovery_min"] for s in col if rs[s].get("recovered")],
        "hit": [rs[s]["hit_ratio_last10"] for s in col],
        "cohort": [rs[s]["cohort_done"] for s in col],
        "tput": [rs[s]["turns_per_s_last10"] for s in col],
        "all": rs,
        "runs": runs,
    }


def _rec_time(v: list[float]) -> str:
    if not v:
        return "–"
    return "<5" if max(v) < 5 else f"≤{max(v):.0f}" if min(v) < 5 else rng(v, "{:.0f}")


def _pct(v: Sequence[float | None]) -> str:
    return rng([x * 100 for x in v if x is not None], "{:.0f}%")


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


def eval_recovery8(ctx: Context) -> Result:
    seeds = _rec_seeds(ctx.quick)
    st = {a: _arm_stats(ctx, a, seeds) for a in RECOVERY_ARMS}
    matched = [s for s in seeds if all(s in st[a]["collapsed"] for a in RECOVERY_ARMS)]
    rows = ["control         recovered  time (min)  hit (end)    cohort done"]
    for a in RECOVERY_ARMS:
        x = st[a]
        rows.append(f"{a:<15} {len(x['recovered'])}/{len(x['collapsed']):<8} {_rec_time(x['time']):<11} "
                    f"{rng(x['hit']):<12} {_pct(x['cohort'])}")  # fmt: skip
    b, c, n, ad, ai = (st[k] for k in ("budgeter", "cap", "none", "admission-cap", "aimd"))

    def rec(cid: str, x: dict[str, Any]) -> None:
        ctx.judge(cid, (len(x["recovered"]), len(x["collapsed"])), f"{len(x['recovered'])} of {len(x['collapsed'])}")

    rec("r8.none", n)
    ctx.judge("r8.none_hit", n["hit"], rng(n["hit"]))
    ctx.judge("r8.none_cohort", n["cohort"], _pct(n["cohort"]))
    rec("r8.adm", ad)
    ctx.judge("r8.adm_time", ad["time"], rng(ad["time"], "{:.0f}") + " min" if ad["time"] else "none recovered")
    low = sum(1 for h in ad["hit"] if h is not None and h < 0.1)
    ctx.judge("r8.adm_low", (low, len(ad["collapsed"])), f"{low} of {len(ad['collapsed'])} (hit {rng(ad['hit'])})")
    rec("r8.aimd", ai)
    ctx.judge("r8.aimd_time", ai["time"], rng(ai["time"], "{:.0f}") + " min" if ai["time"] else "none recovered")
    ctx.judge("r8.aimd_hit", ai["hit"], rng(ai["hit"]))
    rec("r8.cap", c)
    ctx.judge("r8.cap_time", c["time"], _rec_time(c["time"]) + " min")
    ctx.judge("r8.cap_hit", c["hit"], rng(c["hit"]))
    ctx.judge("r8.cap_cohort", c["cohort"], _pct(c["cohort"]))
    rec("r8.bud", b)
    ctx.judge("r8.bud_time", b["time"], _rec_time(b["time"]) + " min")
    ctx.judge("r8.bud_hit", b["hit"], rng(b["hit"]))
    ctx.judge("r8.bud_cohort", b["cohort"], _pct(b["cohort"]))
    t0, t1 = 20 * 60.0, 40 * 60.0
    if matched:
        if not ctx.quick:
            br = {s for s in matched if s in b["recovered"]}
            ar = {s for s in matched if s in ad["recovered"]}
            p = exact_paired_p(len(br - ar), len(ar - br))
            ctx.judge("r8.matched_test", len(br) > len(ar) and p <= 0.05,
                      f"{len(br)}/{len(matched)} vs {len(ar)}/{len(matched)}, p = {p:.3f}")  # fmt: skip
        states, spread = [], []
        for s in matched:
            v = [_sample_at(st[a]["runs"][s], "in_system", 20.0) for a in RECOVERY_ARMS]
            mu = float(np.mean(v))
            states.append(mu)
            spread.append(max(abs(x - mu) for x in v) / mu if mu > 0 else math.nan)
        ctx.judge("r8.matched_states", states, rng(states, "{:.0f}") + f" ({len(matched)} matched seeds)")
        ctx.judge("r8.matched_spread", spread, "≤ " + rng([max(spread)], "{:.1%}"))
        for cid, arm in (("r8.lat_bud", "budgeter"), ("r8.lat_cap", "cap")):
            lat, _, _ = _cohort([st[arm]["runs"][s] for s in matched], t0, t1)
            med = [float(np.median(lat))] if len(lat) else []
            p90 = f" (p90 {np.percentile(lat, 90):.1f})" if len(lat) else ""
            ctx.judge(cid, med, rng(med, "{:.1f}") + " min" + p90)
        for cid, arm in (("r8.aimd_unfinished", "aimd"), ("r8.adm_unfinished", "admission-cap")):
            _, unf, tot = _cohort([st[arm]["runs"][s] for s in matched], t0, t1)
            ctx.judge(cid, [unf / tot] if tot else [], f"{unf} of {tot}")
    healthy = [r for s, r in n["runs"].items() if s not in n["collapsed"] and not _pd(r.summary)]
    lat, _, _ = _cohort(healthy, t0, t1)
    med = [float(np.median(lat))] if len(lat) else []
    ctx.judge("r8.lat_healthy", med, rng(med, "{:.1f}") + f" min ({len(healthy)} never-collapsed runs)")
    figs = []
    if ctx.draw:
        seed = matched[0] if matched else seeds[0]
        runs = [ctx.runs[f"{a}/seed-{seed}"] for a in RECOVERY_ARMS]
        f5 = fg.figure_timeseries(runs, ["no control", "admission-only cap", "AIMD + park", "session cap + park",
                                         "budgeter + park"], _fig(ctx, "figure5"),
                                  title=f"Figure 5 — recovery, control from minute 20 (seed {seed})", vline=20,
                                  shade=[(10, 14)])  # fmt: skip
        curves = []
        for a in RECOVERY_ARMS:
            xs = list(range(20, 60, 5))
            ys = []
            for x0 in xs:
                vals = [m.cohort_completion(st[a]["runs"][s].sessions, x0 * 60, x0 * 60 + 300)
                        for s in st[a]["collapsed"]]  # fmt: skip
                ys.append(float(np.nanmean(vals)) if vals else math.nan)
            curves.append((a, xs, ys))
        f8 = fg.figure_cohorts(curves, _fig(ctx, "figure8"), title="Figure 8 — cohort completion by the end (8B)")
        figs = [("Figure 5: recovery by controller", _rel(f5)), ("Figure 8: cohort completion", _rel(f8))]
    return Result(ctx.claims, figs, ["\n".join(rows)])


# -- recovery, 32B trace shapes (§6, Figure 7) ------------------------------------------------------------------------
def light_load_cap(workload: Workload, capacity_tokens: int) -> tuple[int, int]:
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
    return math.floor(0.75 * capacity_tokens / d), math.floor(0.95 * capacity_tokens / d)


def _cap32() -> str:
    from kvgate.engine.costmodel import profile

    k, khi = light_load_cap(TRACE32.workload(), profile(TRACE32.profile).kv_pool_tokens)
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
    out = [(f"l03/{k}", c) for k, c in _arms_plan(a, _rec32_arms(), s1)]
    out += [(f"l025/{k}", c) for k, c in _arms_plan(b, REC32B_ARMS, s2)]
    return out


def _done_by(r: Run, t0: float, t1: float, by_s: float) -> float:
    arr, end = r.sessions["arrival_s"], r.sessions["end_s"]
    sel = (arr >= t0) & (arr < t1)
    if not sel.any():
        return math.nan
    return float((~np.isnan(end[sel]) & (end[sel] <= by_s)).mean())


def eval_recovery32(ctx: Context) -> Result:
    s1, s2 = _r32_seeds(ctx.quick)
    cap_arm = _cap32()
    st = {a: _arm_stats(ctx, a, s1, "l03/") for a in _rec32_arms()}
    bud, ada, cap, adm = st["budgeter"], st["adaptive-cap"], st[cap_arm], st["admission-cap"]

    def rec(cid: str, x: dict[str, Any], extra: str = "") -> None:
        ctx.judge(cid, (len(x["recovered"]), len(x["collapsed"])),
                  f"{len(x['recovered'])} of {len(x['collapsed'])}{extra}")  # fmt: skip

    rec("r32.bud", bud)
    ctx.judge("r32.bud_time", bud["time"], _rec_time(bud["time"]) + " min")
    ctx.judge("r32.bud_hit", bud["hit"], rng(bud["hit"]))
    rec("r32.ada", ada)
    ctx.judge("r32.ada_time", ada["time"], _rec_time(ada["time"]) + " min")
    rec("r32.cap", cap, f" ({cap_arm.replace('cap:', 'K from a lighter load: ').replace(':', ', ')})")
    rec("r32.adm", adm)
    ctx.judge("r32.adm_hit", adm["hit"], rng(adm["hit"]))
    if not ctx.quick:
        t0, t1 = 25 * 60.0, 45 * 60.0
        for cid, arms in (("r32.users_bud", ["budgeter"]), ("r32.users_ada", ["adaptive-cap"]),
                          ("r32.users_other", ["none", "admission-cap", cap_arm])):  # fmt: skip
            v = [_done_by(st[a]["runs"][s], t0, t1, 90 * 60.0) for a in arms for s in st[a]["collapsed"]]
            ctx.judge(cid, v, _pct(v))
    st2 = {a: _arm_stats(ctx, a, s2, "l025/") for a in REC32B_ARMS}
    nrs = list(st2["none"]["runs"].values())
    nd = sum(_pd(r.summary) for r in nrs)
    ctx.judge("r32b.none", (nd, len(nrs)), f"{nd} of {len(nrs)}")
    nh = [r.summary["hit_ratio_last10"] for r in nrs]
    ctx.judge("r32b.none_hit", nh, rng(nh))
    ns = [r.summary["sessions_in_system_last5"] for r in nrs]
    ctx.judge("r32b.none_sessions", ns, rng(ns, "{:.0f}"))
    for cid, a in (("r32b.bud_hit", "budgeter"), ("r32b.ada_hit", "adaptive-cap")):
        h = [r.summary["hit_ratio_last10"] for s, r in st2[a]["runs"].items() if s in st2[a]["collapsed"]]
        ctx.judge(cid, h, rng(h))
    for cid, a in (("r32b.bud_cohort", "budgeter"), ("r32b.ada_cohort", "adaptive-cap"),
                   ("r32b.none_cohort", "none")):  # fmt: skip
        v = [r.summary["cohort_done"] for r in st2[a]["runs"].values()]
        ctx.judge(cid, v, _pct(v))
    ctl = [r for a in ("budgeter", "adaptive-cap") for r in st2[a]["runs"].values()]
    grow = [(_sample_at(r, "in_system", _end(r) / 60, 5) - _sample_at(r, "in_system", _end(r) / 60 - 30, 5)) / 3
            for r in ctl]  # fmt: skip
    ctx.judge("r32b.queue_growth", grow, rng(grow, "{:+.1f}") + " sessions per 10 min")
    lvl = [r.summary["sessions_in_system_last5"] for r in ctl]
    ctx.judge("r32b.queue_level", lvl, rng(lvl, "{:.0f}") + " sessions")
    arr = [float(((r.sessions["arrival_s"] >= _end(r) - 1800) & (r.sessions["arrival_s"] < _end(r))).sum()) / 30
           for r in ctl]  # fmt: skip
    done = [float(((r.sessions["end_s"] >= _end(r) - 1800) & (r.sessions["end_s"] <= _end(r))).sum()) / 30
            for r in ctl]  # fmt: skip
    ctx.judge("r32b.arrivals", arr, rng(arr) + " per min (last 30 min)")
    ctx.judge("r32b.completions", done, rng(done) + " per min (last 30 min)")
    ctx.judge(
        "r32b.outpace",
        (_mean(arr) > _mean(done)) if ctl else None,
        f"arrivals {_mean(arr):.2f} vs completions {_mean(done):.2f} per min (means, last 30 min)",
    )
    figs = []
    if ctx.draw:
        seed = sorted(st["none"]["runs"])[0]
        arms = _rec32_arms()
        runs = [ctx.runs[f"l03/{a.replace(':', '_')}/seed-{seed}"] for a in arms]
        f = fg.figure_timeseries(
            runs,
            arms,
            _fig(ctx, "figure7"),
            title="Figure 7 — 32B (est.) trace shapes, control from minute 25",
            vline=25,
        )
        figs = [("Figure 7: recovery on 32B trace shapes", _rel(f))]
    return Result(ctx.claims, figs)


# -- session-mix shift (§6, Figure 6) ------------------------------------------------------------------------------
MIX_ARMS = ["none", "cap:K=10:K_hi=13", "cap:K=14:K_hi=17", "cap:K=22:K_hi=25", "cap:K=34:K_hi=37", "budgeter",
            "adaptive-cap", "thunder"]  # fmt: skip


def plan_mix(quick: bool) -> list[tuple[str, SimConfig]]:
    base = SimConfig(preset="paper-shift", lam=0.075, minutes=80)
    return _arms_plan(base, MIX_ARMS, [1] if quick else [1, 2])


def eval_mix(ctx: Context) -> Result:
    from kvgate.experiments.verdicts import baseline

    pts = []
    res: dict[str, list[Run]] = {}
    for a in MIX_ARMS:
        rs = [r for _, r in ctx.select(a.replace(":", "_") + "/")]
        res[a] = rs
        for r in rs:
            pts.append((a, r.summary["gateway_wait_p90_min"] or 0.0, r.summary["hit_ratio_last10"] or 0.0))

    def col(arms: list[str]) -> tuple[int, int]:
        return sum(_pd(r.summary) for a in arms for r in res[a]), sum(len(res[a]) for a in arms)

    def wait(arms: list[str]) -> list[float]:
        return [r.summary["gateway_wait_p90_min"] for a in arms for r in res[a]]

    tight = ["cap:K=10:K_hi=13", "cap:K=14:K_hi=17"]
    loose = ["cap:K=22:K_hi=25", "cap:K=34:K_hi=37"]
    good = ["budgeter", "adaptive-cap"]
    k, n = col(["none"])
    ctx.judge("mix.none", (k, n), f"{k} of {n}")
    nh = [r.summary["hit_ratio_last10"] for r in res["none"]]
    ctx.judge("mix.none_hit", nh, rng(nh))
    k, n = col(loose)
    ctx.judge("mix.loose", (k, n), f"{k} of {n}")
    k, n = col(tight)
    ctx.judge("mix.tight", (k, n), f"{k} of {n} collapsed")
    ctx.judge("mix.tight_wait", wait(tight), rng(wait(tight), "{:.1f}") + " min")
    k, n = col(good)
    ctx.judge("mix.good", (k, n), f"{k} of {n} collapsed")
    ctx.judge("mix.good_wait", wait(good), rng(wait(good), "{:.2f}") + " min")
    done60 = [m.cohort_completion(r.sessions, 0, 3600) for a in good for r in res[a]]
    ctx.judge("mix.good_done", done60, _pct(done60))
    th = res["thunder"]
    ctx.claims.append(baseline("ThunderAgent-style scheduler approximation (not in the paper's comparison)",
                               f"{col(['thunder'])[0]}/{len(th)} collapsed, wait p90 {rng(wait(['thunder']), '{:.2f}')}"
                               f" min, hit {rng([r.summary['hit_ratio_last10'] for r in th])}"))  # fmt: skip
    figs = []
    if ctx.draw:
        f = fg.figure_mix_shift(pts, _fig(ctx, "figure6"), title="Figure 6 — shift from short to long sessions")
        figs = [("Figure 6: the session-mix shift", _rel(f))]
    return Result(ctx.claims, figs)


# -- threshold sensitivity (§6) -----------------------------------------------------------------------------------
TH_ARMS = ["budgeter", "budgeter:low=0.65:high=0.85", "budgeter:low=0.85:high=0.98"]


def plan_thresholds(quick: bool) -> list[tuple[str, SimConfig]]:
    return _arms_plan(REC8, TH_ARMS, _rec_seeds(quick))


def eval_thresholds(ctx: Context) -> Result:
    seeds = _rec_seeds(ctx.quick)
    st = {a: _arm_stats(ctx, a, seeds) for a in TH_ARMS}
    alt = [st[a] for a in TH_ARMS[1:]]
    col = sum(len(x["collapsed"]) for x in alt)
    rec = sum(len(x["recovered"]) for x in alt)
    ctx.judge("th.recovered", (rec, col), f"{rec} of {col}")
    times = [t for x in alt for t in x["time"]]
    ctx.judge("th.time", times, _rec_time(times) + " min")
    hits = [h for x in alt for h in x["hit"]]
    ctx.judge("th.hit", hits, rng(hits))
    coh = [h for x in alt for h in x["cohort"]]
    ctx.judge("th.cohort", coh, _pct(coh))
    tp = [t for x in alt for t in x["tput"]]
    ctx.judge("th.tput_alt", tp, rng(tp) + " turns/s")
    ctx.judge("th.tput_default", st["budgeter"]["tput"], rng(st["budgeter"]["tput"]) + " turns/s")
    rows = ["thresholds                    recovered  time   hit (end)   turns/s (end)"]
    for a in TH_ARMS:
        x = st[a]
        rows.append(f"{a:<29} {len(x['recovered'])}/{len(x['collapsed']):<8} {_rec_time(x['time']):<6} "
                    f"{rng(x['hit']):<11} {rng(x['tput'])}")  # fmt: skip
    figs = []
    if ctx.draw:
        runs = [ctx.runs[f"{a.replace(':', '_')}/seed-{seeds[0]}"] for a in TH_ARMS]
        f = fg.figure_timeseries(
            runs,
            ["0.75/0.95 (default)", "0.65/0.85", "0.85/0.98"],
            _fig(ctx, "thresholds"),
            title=f"Budgeter thresholds, control from minute 20 (seed {seeds[0]})",
            vline=20,
        )
        figs = [("Budgeter thresholds", _rel(f))]
    return Result(ctx.claims, figs, ["\n".join(rows)])


# -- prevention (§6) --------------------------------------------------------------------------------------------------
def _prev_seeds(quick: bool) -> tuple[list[int], list[int], list[int]]:
    return (list(range(1, 9)), list(range(1, 7)), list(range(1, 5))) if quick else \
        (list(range(1, 17)), list(range(1, 11)), list(range(1, 9)))  # fmt: skip


def plan_prevention(quick: bool) -> list[tuple[str, SimConfig]]:
    s1, s2, s3 = _prev_seeds(quick)
    b = B8.with_(lam=0.04, minutes=60)
    out = []
    for s in s1:
        out.append((f"burst/none/seed-{s}", b.with_(seed=s, bursts=("1.0@10+2",))))
        out.append((f"burst/budgeter/seed-{s}", b.with_(seed=s, bursts=("1.0@10+2",), control="budgeter")))
    for s in s2:
        out.append((f"flush/none/seed-{s}", b.with_(seed=s, flush_at=10.0)))
        out.append((f"flush/budgeter/seed-{s}", b.with_(seed=s, flush_at=10.0, control="budgeter")))
    t = TRACE32.with_(lam=0.025, minutes=40, bursts=("1.0@10+4",))
    for s in s3:
        out.append((f"trace32/none/seed-{s}", t.with_(seed=s)))
        out.append((f"trace32/budgeter/seed-{s}", t.with_(seed=s, control="budgeter")))
    return out


def eval_prevention(ctx: Context) -> Result:
    def group(g: str, cid: str, bad: Any) -> list[int]:
        seeds = _seeds_of(ctx, f"{g}/none/")
        nb = {s: bad(ctx.runs[f"{g}/none/seed-{s}"]) for s in seeds}
        bb = {s: bad(ctx.runs[f"{g}/budgeter/seed-{s}"]) for s in seeds}
        k = sum(bb.values())
        ctx.judge(f"prev.{cid}", (k, len(seeds)), f"{k} of {len(seeds)}")
        col = [s for s in seeds if nb[s]]
        kb = sum(bb[s] for s in col)
        ctx.judge(f"prev.{cid}_vs_none", (kb, len(col)), f"{kb} of the {len(col)} seeds that collapse without it")
        return [s for s in seeds if not nb[s]]

    healthy = group("burst", "burst", lambda r: _pd(r.summary))
    group("flush", "flush", lambda r: _pd(r.summary))
    group("trace32", "t32", _deg_or_partial)
    ratios, parks = [], []
    for s in healthy:
        r0, r1 = ctx.runs[f"burst/none/seed-{s}"], ctx.runs[f"burst/budgeter/seed-{s}"]
        if r0.summary["turns_done"]:
            ratios.append(r1.summary["turns_done"] / r0.summary["turns_done"])
            parks.append(r1.summary["parks"])
    none_tp = [ctx.runs[f"burst/none/seed-{s}"].summary["turns_done"] for s in healthy]
    cv = float(np.std(none_tp) / np.mean(none_tp)) if len(none_tp) > 1 else math.nan
    dev = [abs(x - 1) / cv for x in ratios] if cv > 0 else []
    txt = f"{rng(dev, '{:.1f}')} CVs: ratio {rng(ratios, '{:.3f}')} on {len(ratios)} seeds"
    ctx.judge("prev.tput", dev, txt + f" (parks {rng(parks, '{:.0f}')}; run-to-run CV of no control {cv:.1%})")
    return Result(ctx.claims)


# -- CPU offload (§6) -----------------------------------------------------------------------------------------------
def _off_seeds(quick: bool) -> tuple[list[int], list[int]]:
    return ([501, 502, 503], [1, 2]) if quick else (list(range(501, 507)), [1, 2, 3])


def offload_paired_plan(quick: bool, bandwidth_gbs: float | None = None, tag: str = "p/") -> list[tuple[str, Any]]:
    cfg = PAIRED.with_(minutes=90, cpu_offload_tokens=HOST_TOKENS)
    if bandwidth_gbs is not None:
        cfg = cfg.with_(offload_bandwidth_gbs=bandwidth_gbs)
    return _paired_plan(cfg, _off_seeds(quick)[0], tag)


def plan_offload(quick: bool) -> list[tuple[str, SimConfig]]:
    p, rs = _off_seeds(quick)
    out = offload_paired_plan(quick)
    out += [(f"base/seed-{s}/trigger", PAIRED.with_(seed=s, minutes=90, align_min=20.0)) for s in p]
    r = B8.with_(lam=0.04, minutes=60 if quick else 90, bursts=("1.0@10+4",), cpu_offload_tokens=HOST_TOKENS)
    for s in rs:
        out.append((f"rec/none/seed-{s}", r.with_(seed=s)))
        out.append((f"rec/budgeter/seed-{s}", r.with_(seed=s, control="budgeter", control_at=20.0)))
    return out


def eval_offload(ctx: Context) -> Result:
    seeds = _seeds_of(ctx, "p/")
    n = len(seeds)
    c = _pair_counts(ctx, seeds, "p/")
    bd = c["only_trigger"] + c["both"]
    td = c["only_twin"] + c["both"]
    bw = ctx.runs[f"p/seed-{seeds[0]}/trigger"].config["offload_bandwidth_gbs"]
    ctx.judge("off.burst", (bd, n), f"{bd} of {n} (host tier at {bw:g} GB/s)")
    ctx.judge("off.twins", (td, n), f"{td} of {n}")
    deg = [ctx.runs[f"p/seed-{s}/trigger"] for s in seeds if _pd(ctx.runs[f"p/seed-{s}/trigger"].summary)]
    h = [r.summary["hit_ratio_last10"] for r in deg]
    ctx.judge("off.hit", h, rng(h) if h else "no burst arm degraded")
    ss = [r.summary["sessions_in_system_last5"] for r in deg]
    ctx.judge("off.sessions", ss, rng(ss, "{:.0f}") if ss else "no burst arm degraded")
    on = [r.summary["degraded_from_min"] for r in deg]
    ctx.judge("off.onset", on, f"from minute {rng(on, '{:.0f}')}" if on else "no collapse")
    base = [ctx.runs[f"base/seed-{s}/trigger"] for s in seeds]
    ob = [r.summary["degraded_from_min"] for r in base if _pd(r.summary)]
    ctx.judge("off.onset_base", ob, f"from minute {rng(ob, '{:.0f}')}" if ob else "no collapse")
    rs = _seeds_of(ctx, "rec/none/")
    rn = {s: _pd(ctx.runs[f"rec/none/seed-{s}"].summary) for s in rs}
    rb = {s: _pd(ctx.runs[f"rec/budgeter/seed-{s}"].summary) for s in rs}
    k = sum(rn.values())
    ctx.judge("off.rec_none", (k, len(rs)), f"{k} of {len(rs)}")
    col = [s for s in rs if rn[s]]
    kb = sum(rb[s] for s in col)
    ctx.judge("off.rec_budgeter", (kb, len(col)), f"{kb} of the {len(col)} seeds that collapse without it")
    return Result(ctx.claims)


# -- drain condition (§4) ---------------------------------------------------------------------------------------------
DRAIN_RATES = [0.006, 0.010, 0.014, 0.018]


def plan_drain(quick: bool) -> list[tuple[str, SimConfig]]:
    seeds = [1] if quick else [1, 2]
    base = B8.with_(lam=0.04, bursts=("1.5@10+5",), minutes=100 if quick else 150)
    out = [(f"rate-{r}/seed-{s}", base.with_(seed=s, rate_at=(f"30:{r}",))) for r in DRAIN_RATES for s in seeds]
    nc = B8.with_(lam=0.0086, prefix_caching=False, bursts=("+16@15+5",), minutes=90)
    out += [(f"nocache/seed-{s}", nc.with_(seed=s)) for s in range(501, 505 if quick else 509)]
    return out


def _reformed(run: Run, from_s: float) -> bool:
    return any(not math.isnan(h) and h >= m.RECOVERED_HIT for _, h in m.window_hits(run.turns, from_s, _end(run)))


def eval_drain(ctx: Context) -> Result:
    wl = preset("paper-8b")
    cost = fit_cold_cost([r for _, r in ctx.select("nocache/")])
    s_cold = cold_work_per_session(cost, wl)
    ctx.judge("drain.cl", None, f"{cost.intercept_s:+.2f} s + {cost.slope_ms_per_token:.3f} ms × L "
              f"({cost.windows} windows)")  # fmt: skip
    ctx.judge("drain.inv_s", None, f"{1 / s_cold:.4f} sessions/s (S ≈ {s_cold:.0f} s)")
    rate_runs = [r for rr in DRAIN_RATES for _, r in ctx.select(f"rate-{rr}/")]
    deg = fit_cold_cost_all_miss(rate_runs, from_s=20 * 60.0)
    s_deg = cold_work_per_session(deg, wl) if deg.windows >= 2 else math.nan
    ctx.judge("drain.cl_degraded", None, f"{deg.intercept_s:+.2f} s + {deg.slope_ms_per_token:.3f} ms × L "
              f"({deg.windows} windows); 1/S = {1 / s_deg:.4f}")  # fmt: skip
    drifts: dict[float, list[float]] = {}
    curves = []
    for r in DRAIN_RATES:
        for k, run in ctx.select(f"rate-{r}/"):
            drifts.setdefault(r, []).append(drift_per_hour(run, cost, 40 * 60, _end(run)))
            if ctx.draw and k.endswith("seed-1"):
                from kvgate.analysis.drain import remaining_cold_work

                ts = np.arange(30 * 60, _end(run) + 1, 300.0)
                curves.append((f"λ → {r}", ts / 60, remaining_cold_work(run, cost, ts)))
    for cid, r in (("drain.d006", 0.006), ("drain.d010", 0.010), ("drain.d014", 0.014)):
        ctx.judge(cid, drifts[r], rng(drifts[r], "{:+.0f}") + " engine-s/h")
    ctx.judge("drain.d018", all(x > 0 for x in drifts[0.018]), rng(drifts[0.018], "{:+.0f}") + " engine-s/h")
    r18 = [r for _, r in ctx.select("rate-0.018/")]
    a18 = [_sample_at(r, "in_system", 30.0) for r in r18]
    b18 = [_sample_at(r, "in_system", 90.0) for r in r18]
    ctx.judge("drain.s018_start", a18, rng(a18, "{:.0f}") + " (minute 30)")
    ctx.judge("drain.s018_end", b18, rng(b18, "{:.0f}") + " (minute 90)")
    ref = [f"λ {rr}" for rr in DRAIN_RATES for _, r in ctx.select(f"rate-{rr}/") if _reformed(r, 40 * 60.0)]
    ctx.judge(
        "drain.no_reform",
        (len(ref), len(rate_runs)),
        f"{len(ref)} of {len(rate_runs)} re-formed" + (f" ({', '.join(ref)})" if ref else ""),
    )
    falls = [r for r in DRAIN_RATES if max(drifts[r]) < 0]
    grows = [r for r in DRAIN_RATES if min(drifts[r]) > 0]
    inv = 1 / s_cold
    ok = bool(falls and grows and max(falls) < min(grows) and max(falls) - 0.002 <= inv <= min(grows) + 0.002)
    ctx.judge("drain.bracket", ok, f"falls up to λ = {max(falls) if falls else 'n/a'}, grows from "
              f"{min(grows) if grows else 'n/a'}; 1/S = {inv:.4f}")  # fmt: skip
    figs = []
    if ctx.draw:
        f = fg.figure_drift(curves, _fig(ctx, "drain"), title="Remaining cold work after lowering λ at minute 30")
        figs = [("Drain condition: remaining cold work", _rel(f))]
    return Result(ctx.claims, figs)


PAPER_EXPERIMENTS: list[Experiment] = [
    Experiment(
        "paired-8b",
        "Paired history dependence",
        "8B, 400K pool, λ 0.035, +1.5λ for 5 min at minute 15, "
        "90 min, seeds 501–512, each with its no-burst twin; a session cap on the same bursts; λ 0.04 "
        "without a burst; the degraded regime's anatomy (§4) and Figure 4",
        plan_paired,
        eval_paired,
        "§3, Table 2, §4",
    ),
    Experiment(
        "no-cache",
        "No-cache control",
        "8B with prefix caching off, λ 0.0086, +16 sessions over 5 min "
        "at minute 15 (and a rate-proportional burst), paired; a saturated no-cache run",
        plan_nocache,
        eval_nocache,
        "§3",
    ),
    Experiment(
        "flush",
        "Flush trigger",
        "8B, λ 0.04, cache flush with preemption at minute 10; no control and the budgeter on the same seeds",
        plan_flush,
        eval_flush,
        "§3",
    ),
    Experiment(
        "trigger-size",
        "Trigger size",
        "8B, λ 0.04: 2× for 2 min, 2× for 4 min, 2.5× for 5 min; 2× for 4 min on a 600K pool",
        plan_trigger_size,
        eval_trigger_size,
        "§3, §4",
    ),
    Experiment(
        "trace-32b",
        "Trace shapes on 32B",
        "Qwen3-32B profile (estimated), 365K pool, bundled "
        "mini-SWE-agent shapes truncated at 38K, λ 0.025, 2× for 4 min at minute 10, 40 min, each with its "
        "no-burst twin; λ 0.03 and 0.035 without a trigger",
        plan_trace32,
        eval_trace32,
        "§3, Figure 2",
    ),
    Experiment(
        "sglang",
        "Second engine (SGLang)",
        "SGLang-like engine, 8B, 400K, λ 0.04",
        plan_sglang,
        eval_sglang,
        "§3, Figure 3",
    ),
    Experiment(
        "recovery-8b",
        "Recovery, 8B",
        "λ 0.04, 2× for 4 min at minute 10, five controllers from minute 20 to 60, 16 seeds",
        plan_recovery8,
        eval_recovery8,
        "§6, Table 3",
    ),
    Experiment(
        "recovery-32b",
        "Recovery, 32B trace shapes",
        "32B (est.), trace shapes; λ 0.03 with 2.5× for "
        "5 min (5 arms; the fixed cap from a lighter load) and λ 0.025 with 3× for 5 min (3 arms), control "
        "from minute 25",
        plan_recovery32,
        eval_recovery32,
        "§6, Figure 7",
    ),
    Experiment(
        "mix-shift",
        "Session-mix shift",
        "paper-shift, λ 0.075, short → long sessions at minute 30, 80 min, 2 seeds",
        plan_mix,
        eval_mix,
        "§6, Figure 6",
    ),
    Experiment(
        "thresholds",
        "Threshold sensitivity",
        "the recovery setup with budgeter thresholds 0.65/0.85 and 0.85/0.98",
        plan_thresholds,
        eval_thresholds,
        "§6",
    ),
    Experiment(
        "prevention",
        "Prevention",
        "budgeter from the start under a 2×/2-min burst, a flush, and 32B "
        "trace shapes, against no control on the same seeds",
        plan_prevention,
        eval_prevention,
        "§6",
    ),
    Experiment(
        "cpu-offload",
        "CPU KV offload",
        "a 0.9M-token host tier at the default (published) bandwidth; paired design and recovery design",
        plan_offload,
        eval_offload,
        "§6",
    ),
    Experiment(
        "drain",
        "Drain condition",
        "collapse at λ 0.04 (+1.5λ 5 min at 10), lower λ at minute 30; "
        "c(L) from no-cache runs and from all-miss windows of degraded runs",
        plan_drain,
        eval_drain,
        "§4",
    ),
]


def _all() -> dict[str, Experiment]:
    from kvgate.experiments.analyses import ANALYSES

    return {e.name: e for e in PAPER_EXPERIMENTS + ANALYSES}


EXPERIMENTS: dict[str, Experiment] = _all()
_ = frac
