"""§4: the drain condition — c(L), the cold work per session S, and the drift after lowering λ."""

from __future__ import annotations

import math

import numpy as np

from kvgate.analysis import figures as fg
from kvgate.analysis import metrics as m
from kvgate.analysis.drain import (
    cold_work_per_session,
    drift_per_hour,
    fit_cold_cost,
    fit_cold_cost_all_miss,
    remaining_cold_work,
)
from kvgate.experiments import stated
from kvgate.experiments.base import Context, Experiment, Result, rng
from kvgate.experiments.common import B8, fig_path, figure_link, run_end, sample_at, session_prompts
from kvgate.records import Run
from kvgate.sim.config import SimConfig
from kvgate.workload.shapes import preset

# -- drain condition (§4) ---------------------------------------------------------------------------------------------
DRAIN_RATES = [0.006, 0.010, 0.014, 0.018]


def plan_drain(quick: bool) -> list[tuple[str, SimConfig]]:
    seeds = [1] if quick else [1, 2]
    base = B8.with_(lam=0.04, bursts=("1.5@10+5",), minutes=100 if quick else 150)
    out = [(f"rate-{r}/seed-{s}", base.with_(seed=s, rate_at=(f"30:{r}",))) for r in DRAIN_RATES for s in seeds]
    out += [(f"pool600/rate-{r}/seed-{s}", base.with_(seed=s, rate_at=(f"30:{r}",), kv_pool=600_000))
            for r in (0.010, 0.014) for s in seeds]  # the drain condition on a larger pool
    nc = B8.with_(lam=0.0086, prefix_caching=False, bursts=("+16@15+5",), minutes=90)
    out += [(f"nocache/seed-{s}", nc.with_(seed=s)) for s in range(501, 505 if quick else 509)]
    return out


def _reformed(run: Run, from_s: float) -> bool:
    return any(not math.isnan(h) and h >= m.RECOVERED_HIT for _, h in m.window_hits(run.turns, from_s, run_end(run)))


def break_even(drift: dict[float, float]) -> float | None:
    """The arrival rate at which the remaining cold work stops changing: the first zero crossing, from falling to
    growing, of the drift against λ, linearly interpolated between the two rates around it."""
    pts = sorted(drift.items())
    for (a, da), (b, db) in zip(pts, pts[1:], strict=False):
        if da <= 0 < db:
            return a + (b - a) * (-da) / (db - da)
    return None


def eval_drain(ctx: Context) -> Result:
    wl = preset("paper-8b")
    cost = fit_cold_cost([r for _, r in ctx.select("nocache/")])
    s_cold = cold_work_per_session(cost, wl)
    ctx.judge("drain.cl", None, f"{cost.intercept_s:+.2f} s + {cost.slope_ms_per_token:.3f} ms × L "
              f"({cost.windows} windows)")
    ctx.judge("drain.inv_s", None, f"{1 / s_cold:.4f} sessions/s (S ≈ {s_cold:.0f} s)")
    rate_runs = [r for rr in DRAIN_RATES for _, r in ctx.select(f"rate-{rr}/")]
    deg = fit_cold_cost_all_miss(rate_runs, from_s=20 * 60.0)
    s_deg = cold_work_per_session(deg, wl) if deg.windows >= 2 else math.nan
    ctx.judge("drain.cl_degraded", None, f"{deg.intercept_s:+.2f} s + {deg.slope_ms_per_token:.3f} ms × L "
              f"({deg.windows} windows); 1/S = {1 / s_deg:.4f}")
    drifts: dict[float, list[float]] = {}
    from_change: dict[float, list[float]] = {}
    curves = []
    for r in DRAIN_RATES:
        for k, run in ctx.select(f"rate-{r}/"):
            prompts = session_prompts(run)
            drifts.setdefault(r, []).append(drift_per_hour(run, cost, 40 * 60, run_end(run), prompts))
            from_change.setdefault(r, []).append(drift_per_hour(run, cost, 30 * 60, run_end(run), prompts))
            if ctx.draw and k.endswith("seed-1"):
                ts = np.arange(30 * 60, run_end(run) + 1, 300.0)
                curves.append((f"λ → {r}", ts / 60, remaining_cold_work(run, cost, ts, prompts)))
    for cid, r in (("drain.d006", 0.006), ("drain.d010", 0.010), ("drain.d014", 0.014)):
        ctx.judge(cid, drifts[r], rng(drifts[r], "{:+.0f}") + " engine-s/h")
    ctx.judge("drain.d018", None, rng(drifts[0.018], "{:+.0f}") + " engine-s/h")
    stated.drift_window_row(ctx, {r: (from_change[r], drifts[r]) for r in DRAIN_RATES})
    stated.larger_pool_drain_row(ctx, cost, {r: drifts[r] for r in (0.010, 0.014)}, "pool600/", 30.0, 40.0)
    r18 = [r for _, r in ctx.select("rate-0.018/")]
    a18 = [sample_at(r, "in_system", 30.0) for r in r18]
    b18 = [sample_at(r, "in_system", 90.0) for r in r18]
    ctx.judge("drain.s018_start", a18, rng(a18, "{:.0f}") + " (minute 30)")
    rise = [b - a for a, b in zip(a18, b18, strict=True)]  # the claim is the growth; its start is judged above
    ctx.judge("drain.s018_end", rise, rng(rise, "{:+.0f}") + f" (minute 30 → 90: {rng(b18, '{:.0f}')} at minute 90)")
    ref = [f"λ {rr}" for rr in DRAIN_RATES for _, r in ctx.select(f"rate-{rr}/") if _reformed(r, 40 * 60.0)]
    ctx.judge(
        "drain.no_reform",
        (len(ref), len(rate_runs)),
        f"{len(ref)} of {len(rate_runs)} re-formed" + (f" ({', '.join(ref)})" if ref else ""),
    )
    be = break_even({r: float(np.mean(drifts[r])) for r in DRAIN_RATES})
    ctx.judge("drain.break_even", [be] if be is not None else [],
              f"λ = {be:.4f} (the mean drift's zero, interpolated between rates)" if be is not None
              else "the mean drift does not cross zero between the rates run")
    ctx.judge("drain.bracket", None, f"break-even {'n/a' if be is None else f'{be:.4f}'} vs 1/S = {1 / s_cold:.4f}")
    figs = []
    if ctx.draw:
        f = fg.figure_drift(curves, fig_path(ctx, "drain"), title="Remaining cold work after lowering λ at minute 30")
        figs = [("Drain condition: remaining cold work", figure_link(f))]
    return Result(ctx.claims, figs)


DRAIN_SETUP = (
    "collapse at λ 0.04 (+1.5λ 5 min at 10), lower λ at minute 30; "
    "c(L) from no-cache runs and from all-miss windows of degraded runs"
)
DRAIN = Experiment("drain", "Drain condition", DRAIN_SETUP, plan_drain, eval_drain, "§4")
