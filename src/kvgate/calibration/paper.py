"""``kvgate calibrate``: micro-experiments on the simulated engine, each beside the paper's measurement.

Engine-level targets drive a bare :class:`VllmEngine` with hand-made requests; load-level targets run the
simulator. Each target has the paper's value, a band that counts as "ok", kvgate's value, and a role:

* ``fit`` -- the paper's figure set a profile constant (docs/calibration.md says which);
* ``target`` -- a figure the load-level constants (the mixed step's ``mixed_decode_factor`` and
  ``mixed_share_exponent``) are held against besides their fit;
* ``check`` -- a consequence of the constants, not fitted.

The bands are the paper's own ranges where it gives one, otherwise +-20% around its point value (decode: the ends
of its 20-190 tok/s range; c(L): the slope within +-15%). Calibration is kept apart from reproduction: it uses only
the paper's engine measurements (§2, §4) and seeds reserved for it (``CALIBRATION_SEEDS``); no experiment uses
one of these seeds or configurations (tests/experiments/test_verdicts.py asserts it). ``scan`` rows re-run the
load-level targets with ``mixed_decode_factor`` across its plausible range; the two constants themselves are
fitted jointly by :mod:`kvgate.calibration.mixed` (``kvgate calibrate --fit-mixed``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from kvgate.analysis import metrics as m
from kvgate.analysis.drain import cold_work_per_session, fit_cold_cost, fit_cold_cost_all_miss
from kvgate.engine.base import Request
from kvgate.engine.blocks import SeqKey
from kvgate.engine.costmodel import profile as get_profile
from kvgate.engine.vllm import VllmEngine
from kvgate.records import from_tables
from kvgate.sim.batch import run_many
from kvgate.sim.config import SimConfig
from kvgate.workload.shapes import preset


def _run_to_idle(eng: VllmEngine, t: float = 0.0) -> float:
    while eng.has_work():
        t += eng.step(t).duration
    return t


def _prefill_time(prof_name: str, context: int, new: int) -> float:
    """Time to prefill ``new`` tokens on top of a cached ``context - new`` prefix (1 output token)."""
    prof = get_profile(prof_name)
    eng = VllmEngine(prof)
    key = SeqKey(0, 0, 1)
    t = 0.0
    if context > new:
        eng.add(Request(1, key, context - new, 1, 0.0, None))
        t = _run_to_idle(eng)
    eng.add(Request(2, key, context, 1, t, None))
    return _run_to_idle(eng, t) - t


def _decode_rate(prof_name: str, batch: int, context: int, out: int = 200) -> float:
    """Per-request decode tokens/s with ``batch`` requests at ``context`` decoding together."""
    eng = VllmEngine(get_profile(prof_name), 10_000_000)
    for i in range(batch):
        eng.add(Request(i, SeqKey(0, 0, i), context, out, 0.0, None))
    t = 0.0
    while any(r.t_first < 0 for r in list(eng.running) + list(eng.waiting)) or eng.waiting:
        t += eng.step(t).duration
    t0 = t
    t = _run_to_idle(eng, t)
    return (out - 1) / (t - t0)


def _target(
    name: str, paper: str, sim: float, lo: float, hi: float, unit: str = "", role: str = "check"
) -> dict[str, Any]:
    ok = not math.isnan(sim) and lo <= sim <= hi
    return {"name": name, "paper": paper, "sim": round(sim, 4), "band": [lo, hi], "unit": unit, "ok": ok,
            "role": role}


CALIBRATION_SEEDS = range(9001, 9100)
"""Seeds reserved for calibration runs; experiments use seeds below 1000."""

MDF_SCAN = (6.0, 8.0, 9.0, 11.0, 14.0)
"""Values of ``mixed_decode_factor`` the scan rows try at the profile's ``mixed_share_exponent`` (the profile's
factor is 9: the joint fit's minimum, ``kvgate calibrate --fit-mixed``)."""


def run_calibration(prof_name: str = "qwen3-8b-mi300x", *, quick: bool = False, progress: bool = True) -> list[dict]:
    get_profile(prof_name)
    t: list[dict[str, Any]] = []
    for ctx in (20_000, 36_000):
        rate = ctx / _prefill_time(prof_name, ctx, ctx)
        t.append(_target(f"cold prefill at {ctx // 1000}K context", "10-13K tok/s", rate, 10_000, 13_000, "tok/s",
                         "fit"))
    for ctx, new in ((21_600, 1_300), (10_000, 4_000), (30_000, 1_000)):
        rate = new / _prefill_time(prof_name, ctx, new)
        t.append(_target(f"incremental prefill, {new} new on {ctx // 1000}K", "5-16K new tok/s", rate, 5_000,
                         16_000, "tok/s"))
    t.append(_target("decode, 1 request at 6K context", "up to 190 tok/s", _decode_rate(prof_name, 1, 6_000),
                     150, 230, "tok/s", "fit"))
    t.append(_target("decode, 20 requests at 30K context", "down to 20 tok/s", _decode_rate(prof_name, 20, 30_000),
                     15, 30, "tok/s", "fit"))
    t.append(_target("21.6K-context turn, prefill on a miss", "~2 s", _prefill_time(prof_name, 21_600, 21_600),
                     1.6, 2.4, "s"))
    t.append(_target("21.6K-context turn, prefill on a hit", "~0.15 s", _prefill_time(prof_name, 21_600, 1_301),
                     0.10, 0.20, "s"))
    t.extend(_load_targets(prof_name, quick=quick, progress=progress))
    return t


def calibration_jobs(
    prof_name: str, *, quick: bool, mdf: float | None = None, exponent: float | None = None
) -> list[SimConfig]:
    """The load-level calibration runs, all on reserved seeds (see ``CALIBRATION_SEEDS``); ``mdf`` and
    ``exponent`` override the profile's mixed-step constants (the scans and the joint fit)."""
    minutes = 60.0 if quick else 90.0
    base = SimConfig(profile=prof_name, minutes=minutes, mixed_decode_factor=mdf, mixed_share_exponent=exponent,
                     label="calibration")
    seeds = iter(CALIBRATION_SEEDS)
    nc = [next(seeds) for _ in range(8 if quick else 16)]
    busy, warm = next(seeds), next(seeds)
    healthy = [next(seeds) for _ in range(3 if quick else 6)]
    warm_more = [next(seeds) for _ in range(1 if quick else 2)]
    jobs = [base.with_(seed=s, lam=0.0086, prefix_caching=False, bursts=("+16@15+5",)) for s in nc]
    jobs.append(base.with_(seed=busy, lam=0.02, prefix_caching=False))
    jobs += [base.with_(seed=s, lam=WARM_LAM, control="budgeter") for s in (warm, *warm_more)]
    for s in healthy:
        jobs.append(base.with_(seed=s, lam=0.035))
        jobs.append(base.with_(seed=s, lam=0.035, bursts=("1.5@15+5",)))
    return jobs


WARM_LAM = 0.07
"""The cache-warm capacity's load: twice the paper's healthy λ, an overload the budgeter holds at capacity."""


def split_runs(jobs: list[SimConfig], runs: list[Any]) -> dict[str, Any]:
    """The calibration runs by their part: cache-off with a burst (c(L)), cache-off busy, cache-warm (budgeter),
    healthy λ = 0.035 without and with a burst."""
    parts: dict[str, list[Any]] = {"nocache": [], "busy": [], "warm": [], "twins": [], "bursts": []}
    for c, x in zip(jobs, runs, strict=True):
        if not c.prefix_caching:
            parts["nocache" if c.bursts else "busy"].append(x)
        else:
            parts["warm" if c.control == "budgeter" else "bursts" if c.bursts else "twins"].append(x)
    return parts


def warm_capacity(warm: list[Any], end: float) -> tuple[float, float]:
    """The cache-warm capacity (turns/s over the last 30 minutes, mean over the budgeter's overload runs) and its
    hit ratio."""
    rate = float(np.mean([m.turn_rate(x.turns, end - 1800, end) for x in warm]))
    return rate, float(np.mean([m.hit_ratio(x.turns, end - 1800, end) for x in warm]))


def _load_runs(prof_name: str, quick: bool, progress: bool, mdf: float | None = None) -> dict[str, Any]:
    jobs = calibration_jobs(prof_name, quick=quick, mdf=mdf)
    metas = run_many([(c, None) for c in jobs], progress=progress, label="calibration runs", jobs=1)
    parts = split_runs(jobs, [from_tables(mm, mm["_tables"]) for mm in metas])
    # the healthy regime's figures are those of the no-burst runs that stayed healthy (no 5-minute window below a
    # 0.5 hit ratio from minute 5): at λ = 0.035 some slide into the degraded regime on their own, as in the paper
    end = jobs[0].minutes * 60.0

    def stayed_healthy(x: Any) -> bool:
        return all(math.isnan(h) or h >= m.DEGRADED_HIT for _, h in m.window_hits(x.turns, 300.0, end))

    return {
        "nocache": parts["nocache"], "busy": parts["busy"][0], "warm": parts["warm"],
        "healthy": [x for x in parts["twins"] if stayed_healthy(x)], "bursts": parts["bursts"],
        "end": end, "minutes": jobs[0].minutes,
    }


def _mdf_targets(r: dict[str, Any], role: str, tag: str = "") -> list[dict[str, Any]]:
    """The three figures that pin ``mixed_decode_factor``: c(L) on cache-off runs (its fit), the slope of c(L) on
    all-miss windows of degraded runs, and the healthy side's response time."""
    out = []
    cost = fit_cold_cost(r["nocache"])
    out.append(_target(f"{tag}c(L) slope, cache off (2-min windows, >= 4 running)", "0.146 ms/token",
                       cost.slope_ms_per_token, 0.146 * 0.85, 0.146 * 1.15, "ms/token",
                       "fit" if role == "main" else role))
    deg = [x for x in r["bursts"] if x.meta["summary"]["persistently_degraded"]]
    dc = fit_cold_cost_all_miss(deg, from_s=20 * 60.0)
    # The paper's second c(L): its slope is the target, as printed (its intercept trades against it; the paper calls
    # the first fit's intercept an artifact, and says what the fit implies: 1/S = 0.012, the check below)
    out.append(_target(f"{tag}c(L) slope, all-miss windows of degraded runs", "0.187 ms/token",
                       dc.slope_ms_per_token if dc.windows >= 2 else math.nan, 0.187 * 0.85, 0.187 * 1.15,
                       "ms/token", "target" if role == "main" else role))
    if role == "main":
        s_deg = cold_work_per_session(dc, preset("paper-8b")) if dc.windows >= 2 else math.nan
        out.append(_target(f"{tag}1/S for paper-8b from the degraded runs' c(L)", "0.012 sessions/s", 1.0 / s_deg,
                           PAPER_INV_S_DEGRADED / 1.15, PAPER_INV_S_DEGRADED / 0.85, "sessions/s"))
    resp = float(np.mean([np.mean(x.turns["end_s"] - x.turns["sent_s"]) for x in r["healthy"]]))
    out.append(_target(f"{tag}healthy λ=0.035: mean turn response R", "~6 s (Little's law on ~10)", resp, 4.8, 7.2,
                       "s", "target" if role == "main" else role))
    return out


PAPER_INV_S_DEGRADED = 0.012
"""1/S for the synthetic workload from the paper's c(L) on all-miss windows of degraded runs (§4); its band is that
of c(L) within +-15%."""


def _load_targets(prof_name: str, *, quick: bool, progress: bool) -> list[dict[str, Any]]:
    r = _load_runs(prof_name, quick, progress)
    nocache, nocache_busy, warm, healthy, bursts = r["nocache"], r["busy"], r["warm"], r["healthy"], r["bursts"]
    end, minutes = r["end"], r["minutes"]
    out = _mdf_targets(r, "main")
    cost = fit_cold_cost(nocache)
    out.append(_target("c(L) intercept", "-0.06 s (a fit artifact)", cost.intercept_s, -1.5, 0.5, "s"))
    s_cold = cold_work_per_session(cost, preset("paper-8b"))
    out.append(_target("1/S for paper-8b", "~0.013 sessions/s", 1.0 / s_cold, 0.011, 0.015, "sessions/s"))
    out.append(_target("no-cache throughput under load", "0.33-0.43 turns/s",
                       m.turn_rate(nocache_busy.turns, end - 1800, end), 0.33, 0.43, "turns/s"))
    cap, cap_hit = warm_capacity(warm, end)
    out.append(_target("cache-warm capacity (budgeter, overload)", "up to 1.27 turns/s", cap, 1.0, 1.45, "turns/s",
                       "fit"))
    out.append(_target("hit ratio at cache-warm capacity", "0.93-0.95", cap_hit, 0.90, 0.97))
    h_sess = float(np.mean([m.sample_mean(x.samples, "in_system", 600, end) for x in healthy]))
    out.append(_target("healthy λ=0.035: sessions in system", "~10", h_sess, 8, 12))
    h_last = float(np.mean([m.sample_mean(x.samples, "in_system", end - 300, end) for x in healthy]))
    out.append(_target("healthy λ=0.035: sessions in system, last 5 min (Table 2's healthy twins)",
                       "5-9, mean 7.2", h_last, 5.0, 9.0))
    h_hit = float(np.nanmean([m.hit_ratio(x.turns, end - 600, end) for x in healthy]))
    out.append(_target("healthy λ=0.035: hit ratio", "0.94-0.95", h_hit, 0.92, 0.97))
    deg = [x for x in bursts if x.meta["summary"]["persistently_degraded"]]
    if deg:

        def mean_of(f: object) -> float:
            return float(np.mean([f(x) for x in deg]))  # type: ignore[operator]

        out.append(_target("degraded regime: turns/s (last 10 min)", "0.35-0.46",
                           mean_of(lambda x: m.turn_rate(x.turns, end - 600, end)), 0.35, 0.46))
        out.append(_target("degraded regime: hit ratio", "0.10-0.12",
                           mean_of(lambda x: m.hit_ratio(x.turns, end - 600, end)), 0.08, 0.14))
        out.append(_target("degraded regime: requests running", "16-32",
                           mean_of(lambda x: m.sample_mean(x.samples, "running", end - 600, end)), 16, 32))
        pre = mean_of(lambda x: x.meta["summary"]["preemptions"]) * 90.0 / minutes
        out.append(_target("degraded regime: preemptions per 90-min run", "23-37", pre, 10, 60))
    else:
        out.append(_target("degraded regime (no burst run collapsed)", "collapse", math.nan, 0, 0))
    for v in MDF_SCAN if not quick else (8.0, 14.0):
        out.extend(_mdf_targets(_load_runs(prof_name, quick, False, mdf=v), "scan", f"[mdf={v:g}] "))
    return out


def format_targets(profile: str, targets: list[dict[str, Any]]) -> str:
    w = max(len(t["name"]) for t in targets)
    lines = [f"profile {profile}", f"{'target':<{w}}  {'role':<6} {'paper':<26} {'kvgate':>10}   verdict"]
    for t in targets:
        v = t["sim"]
        vs = "n/a" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.4g}"
        lines.append(f"{t['name']:<{w}}  {t.get('role', ''):<6} {t['paper']:<26} {vs:>10}   "
                     f"{'ok' if t['ok'] else 'OFF'}")
    off = [t["name"] for t in targets if not t["ok"] and t.get("role") != "scan"]
    lines.append("")
    lines.append("all targets in band" if not off else f"{len(off)} target(s) off: " + "; ".join(off))
    return "\n".join(lines)
