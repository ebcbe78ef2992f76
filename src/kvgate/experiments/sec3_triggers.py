"""§3: what triggers the collapse — the no-cache control, a cache flush, and the trigger's size."""

from __future__ import annotations

from kvgate.analysis import figures as fg
from kvgate.analysis import metrics as m
from kvgate.experiments.base import Context, Experiment, Result, rng
from kvgate.experiments.common import (
    B8,
    count_against_twins,
    degraded,
    fig_path,
    figure_link,
    left_out,
    paired_plan,
    run_end,
    unfinished,
)
from kvgate.sim.config import SimConfig
from kvgate.workload.shapes import preset


# -- no-cache control (§3) ---------------------------------------------------------------------------------------
def _nc_seeds(quick: bool) -> list[int]:
    return [501, 502] if quick else [501, 502, 503, 504]


def plan_nocache(quick: bool) -> list[tuple[str, SimConfig]]:
    base = B8.with_(lam=0.0086, prefix_caching=False, minutes=90)
    seeds = _nc_seeds(quick)
    out = paired_plan(base.with_(bursts=("+16@15+5",)), seeds, "abs/")
    out += paired_plan(base.with_(bursts=("1.5@15+5",)), seeds, "prop/")
    out += [(f"sat/seed-{s}", B8.with_(seed=s, lam=0.02, prefix_caching=False, minutes=60 if quick else 90))
            for s in ([601] if quick else [601, 602])]
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
        if d["sessions_in_system_last5"] <= tw["sessions_in_system_last5"] + 3:  # back at its twin's level
            level += 1
        elif d["in_system_change_last30"] is not None and d["in_system_change_last30"] < 0:  # still draining
            shrink += 1
        if unfinished(d) <= unfinished(tw) + 3:
            at_twin += 1
    n = len(seeds)
    ctx.judge("nocache.peak", peaks, f"peak {rng(peaks, '{:.0f}')}")
    ctx.judge("nocache.drains", (shrink + level, n), f"{level} at the twin's level + {shrink} still shrinking, of {n}")
    ctx.judge("nocache.at_twin", (at_twin, n), f"{at_twin} of {n}")
    pairs = [tuple(unfinished(ctx.runs[f"prop/seed-{s}/{a}"].summary) for a in ("twin", "trigger")) for s in seeds]
    unf = [u for pair in pairs for u in pair]
    ctx.judge("nocache.prop_unfinished", unf, f"{rng(unf, '{:.0f}')} unfinished")
    ctx.judge("nocache.prop_same", all(abs(a - b) <= 1 for a, b in pairs),
              "twin / burst: " + ", ".join(f"{a:.0f} / {b:.0f}" for a, b in pairs))
    sat = [m.turn_rate(r.turns, run_end(r) - 1800, run_end(r)) for _, r in ctx.select("sat/")]
    ctx.judge("nocache.throughput", sat, f"{rng(sat)} turns/s (λ = 0.02, last 30 min)")
    turns = preset("paper-8b").shapes()[0].turns
    fr = [0.0086 / (x / turns) for x in sat if x > 0]
    ctx.judge("nocache.load_fraction", fr, rng([x * 100 for x in fr], "{:.0f}%") +
              f" (capacity {rng([x / turns for x in sat], '{:.4f}')} sessions/s)")
    figs = []
    if ctx.draw:
        r = ctx.runs[f"abs/seed-{seeds[0]}/trigger"]
        f = fg.figure_timeseries([ctx.runs[f"abs/seed-{seeds[0]}/twin"], r], ["twin", "+16 sessions"],
                                 fig_path(ctx, "nocache"), title="Prefix caching off: the backlog drains",
                                 shade=[(15, 20)])
        figs = [("No cache: the burst's backlog drains", figure_link(f))]
    return Result(ctx.claims, figs)


# -- flush trigger (§3) -----------------------------------------------------------------------------------------
def _flush_seeds(quick: bool) -> list[int]:
    return list(range(1, 7)) if quick else list(range(1, 11))


def plan_flush(quick: bool) -> list[tuple[str, SimConfig]]:
    """Per seed: the flush without control, the flush under the budgeter, and the twin without the flush (at λ = 0.04
    some of kvgate's runs collapse with no trigger at all: the count is of the seeds whose twin stays healthy)."""
    base = B8.with_(lam=0.04, minutes=60, flush_at=10.0)
    seeds = _flush_seeds(quick)
    out = [(f"none/seed-{s}", base.with_(seed=s)) for s in seeds]
    out += [(f"budgeter/seed-{s}", base.with_(seed=s, control="budgeter")) for s in seeds]
    out += [(f"twin/seed-{s}", base.with_(seed=s, flush_at=None)) for s in seeds]
    return out


def eval_flush(ctx: Context) -> Result:
    seeds = _flush_seeds(ctx.quick)
    none = {s: ctx.runs[f"none/seed-{s}"] for s in seeds}
    bud = {s: ctx.runs[f"budgeter/seed-{s}"] for s in seeds}
    twin = {s: ctx.runs[f"twin/seed-{s}"] for s in seeds}
    k, n, dn, spont = count_against_twins(none, twin)
    ctx.judge("flush.count", (k, n), f"{k} of {n}{left_out(spont)}")
    arr = {s: int(((none[s].sessions["arrival_s"] >= 600) & (none[s].sessions["arrival_s"] < 900)).sum())
           for s in seeds if s not in spont}
    most = max(arr, key=lambda s: arr[s]) if arr else None
    ctx.judge("flush.most_arrivals", (most in dn) if dn else None,
              f"most arrivals in minutes 10–15: seed {most} ({arr.get(most, 0) if most is not None else 0}), "
              f"{'collapsed' if most in dn else 'healthy'}; collapsed: {dn or 'none'}")
    db = sum(degraded(r.summary) for r in bud.values())
    dbc = sum(degraded(bud[s].summary) for s in dn)
    ctx.judge("flush.budgeter_count", (db, len(bud)),
              f"{db} of {len(bud)} ({dbc} of the {len(dn)} seeds the flush collapses without control)")
    figs = []
    if ctx.draw:
        k0 = dn[0] if dn else seeds[0]
        f = fg.figure_timeseries([none[k0], bud[k0]], [f"no control (seed {k0})", "budgeter"], fig_path(ctx, "flush"),
                                 title="Cache flush with preemption at minute 10", vline=10)
        figs = [("Flush trigger", figure_link(f))]
    return Result(ctx.claims, figs)


# -- trigger size (§3) -------------------------------------------------------------------------------------------
TS_BURSTS = {"2x-2min": "1.0@10+2", "2x-4min": "1.0@10+4", "2.5x-5min": "1.5@10+5"}
LARGE_POOL = 600_000


def _ts_seeds(quick: bool) -> list[int]:
    """Every seed kvgate runs this design on (the prevention page's uncontrolled 2×/2-min runs are seeds 1-16 too)."""
    return list(range(1, 6)) if quick else list(range(1, 17))


def plan_trigger_size(quick: bool) -> list[tuple[str, SimConfig]]:
    """Each burst on every seed, beside the twin without it (the counts are of the seeds whose twin stays healthy)."""
    base = B8.with_(lam=0.04, minutes=45 if quick else 60)
    seeds = _ts_seeds(quick)
    out = [(f"{k}/seed-{s}", base.with_(seed=s, bursts=(b,))) for k, b in TS_BURSTS.items() for s in seeds]
    out += [(f"twin/seed-{s}", base.with_(seed=s)) for s in seeds]
    out += [(f"pool600/2x-4min/seed-{s}", base.with_(seed=s, bursts=(TS_BURSTS["2x-4min"],), kv_pool=LARGE_POOL))
            for s in seeds]
    return out


def eval_trigger_size(ctx: Context) -> Result:
    seeds = _ts_seeds(ctx.quick)
    twin = {s: ctx.runs[f"twin/seed-{s}"] for s in seeds}
    rows, fr, counts = [], [], {}
    for k in TS_BURSTS:
        d, n, _, spont = counts[k] = count_against_twins({s: ctx.runs[f"{k}/seed-{s}"] for s in seeds}, twin)
        rows.append(f"{k:<10} {d}/{n} collapsed")
        fr.append(d / n if n else 0.0)
    d22, n22, _, spont = counts["2x-2min"]
    raw = [r for _, r in ctx.select("2x-2min/")]
    ctx.judge("ts.vllm_2x2", (d22, n22), f"{d22} of {n22}{left_out(spont)} (all seeds, twins not consulted: "
              f"{sum(degraded(r.summary) for r in raw)} of {len(raw)})")
    mono = all(a <= b for a, b in zip(fr, fr[1:], strict=False)) and fr[-1] > fr[0]
    ctx.judge("ts.larger_more", mono, "; ".join(rows))
    big = ctx.select("pool600/2x-4min/")
    dbig = sum(degraded(r.summary) for _, r in big)
    # like for like: the same seeds' arrivals and burst on either pool, raw counts (the 600K pool has no twins);
    # the 400K count against its twins is shown beside
    r24 = [r for _, r in ctx.select("2x-4min/")]
    d24 = sum(degraded(r.summary) for r in r24)
    t24, n24, _, _ = counts["2x-4min"]
    ctx.judge(
        "ts.larger_pool",
        (0 < dbig / len(big) < d24 / len(r24)) if d24 and big and r24 else None,
        f"2×/4 min on the same seeds: {d24} of {len(r24)} collapsed with 400K ({t24} of {n24} against twins), "
        f"{dbig} of {len(big)} with {LARGE_POOL // 1000}K",
    )
    rows.append(f"{'2x-4min, 600K pool':<10} {dbig}/{len(big)} collapsed")
    figs = []
    if ctx.draw:
        runs = [ctx.runs[f"{k}/seed-1"] for k in TS_BURSTS]
        f = fg.figure_timeseries(
            runs,
            list(TS_BURSTS),
            fig_path(ctx, "figure3"),
            title="Trigger sizes on one engine (vLLM, λ=0.04, seed 1; cf. Figure 3)",
        )
        figs = [("Trigger sizes", figure_link(f))]
    return Result(ctx.claims, figs, ["\n".join(rows)])


NO_CACHE_SETUP = (
    "8B with prefix caching off, λ 0.0086, +16 sessions over 5 min "
    "at minute 15 (and a rate-proportional burst), paired; a saturated no-cache run"
)
NO_CACHE = Experiment("no-cache", "No-cache control", NO_CACHE_SETUP, plan_nocache, eval_nocache, "§3")


FLUSH_SETUP = "8B, λ 0.04, cache flush with preemption at minute 10; no control and the budgeter on the same seeds"
FLUSH = Experiment("flush", "Flush trigger", FLUSH_SETUP, plan_flush, eval_flush, "§3")


TRIGGER_SIZE_SETUP = "8B, λ 0.04: 2× for 2 min, 2× for 4 min, 2.5× for 5 min; 2× for 4 min on a 600K pool"
TRIGGER_SIZE = Experiment(
    "trigger-size", "Trigger size", TRIGGER_SIZE_SETUP, plan_trigger_size, eval_trigger_size, "§3, §4"
)
