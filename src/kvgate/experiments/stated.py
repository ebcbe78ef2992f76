"""Rows for what the paper states in passing, beside its tables: the state at the trigger, a twin's own arrivals,
the cost of a miss as sessions age, a re-admitted session's miss, the cohort p90s and the budgeter against a cap,
SGLang's flush refusals and recovery from the 2×/2-min burst, the drift's fitting window, the traces of §2, the
healthy side's two conditions, the degraded regime as an operator sees it, the escape-time model, the drain
condition on a larger pool, and the 32B cap from a lighter load under prevention. Each function judges its
experiment's rows from that experiment's runs."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from kvgate.analysis import metrics as m
from kvgate.analysis.drain import ColdCost, drift_per_hour
from kvgate.experiments.base import Context, rng
from kvgate.experiments.common import (
    degraded,
    degraded_or_partial,
    partially_degraded,
    run_end,
    sample_at,
    session_prompts,
    stayed_healthy,
)
from kvgate.records import Run


def _missed(t: dict[str, np.ndarray], sel: np.ndarray) -> np.ndarray:
    return sel & (t["status"] == "ok") & (np.asarray(t["cached_tokens"], float) < 0.5 * t["prompt_tokens"])


def paired_rows(ctx: Context, seeds: Sequence[int], trigger_min: float = 15.0) -> None:
    """The state at the trigger (§3), a sliding twin's own arrivals (§3), a miss's cost as sessions age (§4)."""
    trig = {s: ctx.runs[f"seed-{s}/trigger"] for s in seeds}
    at = {s: sample_at(r, "in_system", trigger_min) for s, r in trig.items()}
    deg = [at[s] for s, r in trig.items() if degraded(r.summary)]
    hea = [at[s] for s, r in trig.items() if not degraded(r.summary)]
    ctx.judge("paired.state_at_trigger", bool(max(hea) < float(np.median(deg))) if hea and deg else None,
              f"sessions in the system at the burst: degraded burst arms {rng(deg, '{:.0f}')}, healthy ones "
              f"{rng(hea, '{:.0f}')}")
    if not ctx.quick:
        over = []
        for s in seeds:
            r = ctx.runs[f"seed-{s}/twin"]
            on = r.summary.get("degraded_from_min")
            if degraded(r.summary) and on is not None:
                a = r.sessions["arrival_s"]
                n = int(((a >= (on - 10) * 60) & (a < on * 60)).sum())
                over.append((n, float(r.config["lam"]) * 600))
        ctx.judge("paired.twin_fluctuation", all(n > mu for n, mu in over) if over else None,
                  "; ".join(f"{n} arrivals in the 10 min before the slide (mean {mu:.0f})" for n, mu in over)
                  or "no twin slid")
    grow = []
    for r in (r for r in trig.values() if degraded(r.summary)):
        t, end = r.turns, run_end(r)
        early = _missed(t, (t["end_s"] >= 30 * 60) & (t["end_s"] < 40 * 60))
        late = _missed(t, t["end_s"] >= end - 600)
        if early.any() and late.any():
            grow.append((float(t["prompt_tokens"][early].mean()), float(t["prompt_tokens"][late].mean())))
    ctx.judge("anatomy.miss_cost_grows", all(b > a for a, b in grow) if grow else None,
              "mean prompt of a missed turn, minutes 30–40 → last 10: "
              + ", ".join(f"{a / 1e3:.1f}K → {b / 1e3:.1f}K" for a, b in grow))
    healthy_side_row(ctx, seeds)
    operator_rows(ctx, [ctx.runs[f"seed-{s}/{a}"] for s in seeds for a in ("twin", "trigger")])


def readmitted_miss(runs: Sequence[Run], t0: float) -> tuple[float, float, int]:
    """Of the turns re-admitted after waiting parked (after ``t0``, a session's later turn): the share that
    missed (under half the prompt cached), the share of their next turns that hit, and how many."""
    miss, nxt, n = 0, 0, 0
    for r in runs:
        t = r.turns
        ok = t["status"] == "ok"
        keyed = {(int(s), int(k)): i for i, (s, k) in enumerate(zip(t["session"], t["turn"], strict=True))}
        for i in np.nonzero(ok & (t["park_wait_s"] > 0) & (t["turn"] > 0) & (t["submit_s"] >= t0))[0]:
            n += 1
            miss += bool(t["cached_tokens"][i] < 0.5 * t["prompt_tokens"][i])
            j = keyed.get((int(t["session"][i]), int(t["turn"][i]) + 1))
            nxt += j is not None and bool(ok[j] and t["cached_tokens"][j] >= 0.5 * t["prompt_tokens"][j])
    return (miss / n if n else float("nan")), (nxt / n if n else float("nan")), n


def recovery8_rows(ctx: Context, st: dict[str, Any], matched: Sequence[int], cohort: Any, t0: float,
                   t1: float) -> None:
    """The cohort p90s, the budgeter against the cap (§6), and a re-admitted session's one miss (§5)."""
    med = {}
    for cid, arm in (("r8.lat_bud_p90", "budgeter"), ("r8.lat_cap_p90", "cap")):
        lat, _, _ = cohort([st[arm]["runs"][s] for s in matched], t0, t1)
        p90 = [float(np.percentile(lat, 90))] if len(lat) else []
        med[arm] = float(np.median(lat)) if len(lat) else float("nan")
        ctx.judge(cid, p90, rng(p90, "{:.1f}") + " min")
    b, c = st["budgeter"], st["cap"]
    alike = (len(b["recovered"]) == len(b["collapsed"]) and len(c["recovered"]) == len(c["collapsed"])
             and abs(med["budgeter"] - med["cap"]) <= 0.2 * max(med["budgeter"], med["cap"]))
    ctx.judge("r8.bud_like_cap", bool(alike) if matched else None,
              f"recovered {len(b['recovered'])}/{len(b['collapsed'])} and {len(c['recovered'])}/"
              f"{len(c['collapsed'])}; cohort median {med['budgeter']:.1f} vs {med['cap']:.1f} min")
    miss, hit_next, n = readmitted_miss([b["runs"][s] for s in b["collapsed"]], t0)
    ctx.judge("r8.readmit_miss", (miss > 0.5 and hit_next > 0.5) if n else None,
              f"{n} re-admitted turns: {miss:.0%} missed, their next turn hit in {hit_next:.0%}")


def sglang_rows(ctx: Context, waits: Sequence[float], two_by_two: Sequence[Run]) -> None:
    """SGLang's flush refusals, and its recovery from the 2×/2-min burst (§3)."""
    ctx.judge("sg.flush_retry", list(waits), rng(waits, "{:.0f}") + " s of refusals before the flush went through")
    back = []
    for r in two_by_two:
        hs = [h for _, h in m.window_hits(r.turns, 17 * 60.0, 22 * 60.0, 60.0)]
        back.append(all(np.isnan(h) or h >= m.RECOVERED_HIT for h in hs))
    ctx.judge("sg.recover_2x2", (sum(back), len(back)),
              f"{sum(back)} of {len(back)} at the warm hit ratio in every minute 5–10 min after the burst")


def drift_window_row(ctx: Context, by_window: dict[float, tuple[list[float], list[float]]]) -> None:
    """The drift's dependence on its fitting window (§4): from the change (the paper's) against from minute 40."""
    gaps = {r: abs(float(np.mean(a)) - float(np.mean(b))) for r, (a, b) in by_window.items()}
    ctx.judge("drain.window", any(g > 200 for g in gaps.values()),
              "; ".join(f"λ {r}: {rng(a, '{:+.0f}')} from the change vs {rng(b, '{:+.0f}')} from minute 40"
                        for r, (a, b) in by_window.items()))


def trace_rows(ctx: Context, largest: Sequence[float]) -> None:
    """The traces of §2: the bundled SWE-bench sessions' reach, and TraceLab (not bundled)."""
    q = [float(np.percentile(largest, 25)), float(np.percentile(largest, 75))]
    ctx.judge("t32.swebench_reach", q, f"{q[0] / 1e3:.1f}K–{q[1] / 1e3:.1f}K tokens (interquartile, largest context "
              f"per session, {len(largest)} bundled sessions)")
    ctx.judge("t32.tracelab", None, "the TraceLab dataset is not bundled")


def healthy_side_row(ctx: Context, seeds: Sequence[int]) -> None:
    """The healthy side (§4) exists while the cache-warm population fits -- λT(Z + R0)L̄ ≲ C, by Little's law the
    healthy sessions times their mean context against the pool, i.e. fewer than N* = C / L̄ -- and the cache-warm
    engine keeps up (λT below its capacity): runs without a trigger inside both stay healthy, beyond it they do not."""
    from kvgate.workload.config import WorkloadConfig

    tw = [ctx.runs[f"seed-{s}/twin"] for s in seeds]
    wl = WorkloadConfig.from_dict(tw[0].config).workload()
    nstar = int(tw[0].config["kv_pool"] or 400_000) / wl.mean_turn_context()
    turns = wl.shapes()[0].turns
    warm = [m.turn_rate(r.turns, run_end(r) - 1800, run_end(r)) for _, r in ctx.select("warm/")]
    cap = float(np.mean(warm)) if warm else float("nan")
    n0 = float(np.mean([m.sample_mean(r.samples, "in_system", 600.0, run_end(r)) for r in tw
                        if not degraded(r.summary)] or [float("nan")]))
    share = {float(tw[0].config["lam"]): [not degraded(r.summary) for r in tw]}
    for prefix in ("lam04/", "lam05/"):
        runs = [r for _, r in ctx.select(prefix)]
        if runs:
            share[float(runs[0].config["lam"])] = [stayed_healthy(r) for r in runs]
    inside = [lam for lam in share if lam * turns < cap]
    beyond = [lam for lam in share if lam * turns > cap]
    ok = (n0 < nstar and all(2 * sum(share[x]) > len(share[x]) for x in inside)
          and all(2 * sum(share[x]) < len(share[x]) for x in beyond))
    ctx.judge("paired.healthy_side", bool(ok) if inside and beyond and warm else None,
              f"healthy twins hold {n0:.1f} sessions against N* = {nstar:.1f}; cache-warm capacity {cap:.2f} turns/s; "
              "without a trigger, healthy: " + ", ".join(
                  f"λ {x:g} ({x * turns:.2f} turns/s) {sum(v)} of {len(v)}" for x, v in sorted(share.items())))


def operator_rows(ctx: Context, arms: Sequence[Run]) -> None:
    """What an operator sees (§8): in the degraded regime the engine stays busy, and the hit ratio with the sessions
    in the system against what the pool holds (N*) tells the degraded runs from the healthy ones; and the escape
    model of §4, which the paper does not give."""
    from kvgate.workload.config import WorkloadConfig

    nstar = int(arms[0].config["kv_pool"] or 400_000) / WorkloadConfig.from_dict(arms[0].config).workload(
    ).mean_turn_context()
    deg = [r for r in arms if degraded(r.summary)]
    busy = [float((np.asarray(r.samples["running"])[np.asarray(r.samples["t_s"]) >= run_end(r) - 600] > 0).mean())
            for r in deg]
    sign = [bool(r.summary["hit_ratio_last10"] < m.DEGRADED_HIT and r.summary["sessions_in_system_last5"] > nstar)
            == degraded(r.summary) for r in arms]
    ctx.judge("anatomy.identified", bool(busy and min(busy) == 1.0 and all(sign)) if deg else None,
              f"engine busy (requests running) in {rng([b * 100 for b in busy], '{:.0f}%')} of the samples of the "
              f"degraded arms' last 10 minutes; hit ratio < 0.5 with more sessions than N* = {nstar:.1f} matches "
              f"'persistently degraded' in {sum(sign)} of {len(arms)} arms")
    ctx.judge("paired.escape_model", None, "the paper does not give its Poisson fluctuation model, so its error "
              "cannot be compared (kvgate's own fluctuation model is on the escape page: kvgate escape)")


def larger_pool_drain_row(ctx: Context, cost: ColdCost, drifts: dict[float, list[float]], prefix: str,
                          change_min: float, from_min: float) -> None:
    """A larger pool leaves the drain condition unchanged (§4): after the same collapse and the same lowering of λ,
    the drift of the remaining cold work on the larger pool (runs ``prefix`` + ``rate-R/``, those degraded in the
    5 minutes before the change) against the default pool's at each rate."""
    gaps, parts = [], []
    for rate, base in sorted(drifts.items()):
        runs = ctx.select(f"{prefix}rate-{rate}/")
        if not runs:
            continue
        big = [r for _, r in runs if m.hit_ratio(r.turns, (change_min - 5) * 60.0, change_min * 60.0) < m.DEGRADED_HIT]
        d = [drift_per_hour(r, cost, from_min * 60.0, run_end(r), session_prompts(r)) for r in big]
        if d and base:
            gaps.append(abs(float(np.mean(d)) - float(np.mean(base))))
        parts.append(f"λ {rate:g}: {rng(d, '{:+.0f}') if d else 'no run degraded at the change'} on the larger "
                     f"pool vs {rng(base, '{:+.0f}')} engine-s/h")
    ctx.judge("drain.pool_unchanged", all(g <= 200 for g in gaps) if parts and len(gaps) == len(parts) else None,
              "; ".join(parts) or "no larger-pool run")


def prevention_cap_row(ctx: Context, prefix: str, seeds: Sequence[int]) -> None:
    """Prevention on 32B trace shapes (§6): a session cap tuned on a lighter load left a run partially degraded."""
    runs = [ctx.runs[f"{prefix}seed-{s}"] for s in seeds if f"{prefix}seed-{s}" in ctx.runs]
    bad = [r for r in runs if degraded_or_partial(r)]
    part = sum(partially_degraded(r) for r in bad)
    ctx.judge("prev.t32_cap", (len(bad), len(runs)) if runs else None,
              f"{len(bad)} of {len(runs)} ({part} partially, {len(bad) - part} persistently degraded; end hit "
              f"{rng([r.summary['hit_ratio_last10'] for r in runs])})")
