"""Escape times: how long a healthy server survives before it collapses on its own (no trigger).

The paper (§4) does not model the escape time from the healthy regime; its Poisson fluctuation model "was too
pessimistic by an order of magnitude". ``kvgate escape`` measures it. Every run starts empty and healthy, gets
no trigger, and lasts ``minutes``; its escape time is the start of its persistently degraded stretch (the
first 5-minute window from which every later window is degraded), or it is *censored* at the end of the run
when it never collapses. From many runs per λ:

* the Kaplan-Meier survival curve S(t) (censoring handled exactly);
* the mean escape time under a constant hazard (the escape of a metastable state is memoryless once the
  start-up transient is over): rate = collapses / total time at risk, mean = 1 / rate, with the exact
  (chi-square) 95% interval of a Poisson count over that exposure;
* kvgate's Poisson fluctuation estimate beside it (the paper gives its own only as "pessimistic"): in the
  healthy regime the sessions in the system are an M/G/∞ population, Poisson with mean m = λ E[Σ_k (Z_k + R0)];
  the regime is left when it first exceeds N* = C / L̄, whose rate is the rate of up-crossings of N* − 1 → N*,
  λ P(N = N* − 1). So the estimated mean escape time is 1 / (λ P(N = ⌈N*⌉ − 1)).

Time at risk starts after ``warmup`` minutes (the population needs a few session lifetimes to reach steady state);
a run that collapses before it counts as a collapse at ``warmup``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvgate.analysis.phase import ServerChoice
from kvgate.errors import UsageError


@dataclass(frozen=True)
class EscapeSpec(ServerChoice):
    lams: tuple[float, ...]
    runs: int = 200
    minutes: float = 240.0
    warmup: float = 10.0
    kv_pool: int | None = None
    seed0: int = 20_001

    def __post_init__(self) -> None:
        if not self.lams or min(self.lams) <= 0:
            raise UsageError("escape needs positive arrival rates")
        if self.minutes <= self.warmup + 10:
            raise UsageError(f"escape: runs must last more than {self.warmup + 10:g} minutes")


def kaplan_meier(times: Sequence[float], events: Sequence[bool]) -> tuple[np.ndarray, np.ndarray]:
    """Survival curve from right-censored data: (event times, S just after each)."""
    t = np.asarray(times, dtype=float)
    e = np.asarray(events, dtype=bool)
    order = np.lexsort((~e, t))  # at equal times, events before censorings
    t, e = t[order], e[order]
    at_risk = len(t)
    s = 1.0
    xs, ys = [], []
    i = 0
    while i < len(t):
        j = i
        d = 0
        while j < len(t) and t[j] == t[i]:
            d += int(e[j])
            j += 1
        if d:
            s *= 1.0 - d / at_risk
            xs.append(t[i])
            ys.append(s)
        at_risk -= j - i
        i = j
    return np.array(xs), np.array(ys)


def exponential_mean(times: Sequence[float], events: Sequence[bool], start: float = 0.0,
                     level: float = 0.95) -> tuple[float, float, float, int, float]:
    """Mean escape time under a constant hazard from ``start``: (mean, low, high, collapses, exposure).

    The interval is exact for a Poisson count over a fixed exposure (chi-square); with no collapse the mean
    is only bounded below (high = inf)."""
    from scipy.stats import chi2

    t = np.maximum(np.asarray(times, dtype=float) - start, 0.0)
    d = int(np.sum(events))
    exposure = float(t.sum())
    if exposure <= 0:
        return math.nan, math.nan, math.nan, d, exposure
    a = 1.0 - level
    rate_lo = chi2.ppf(a / 2, 2 * d) / (2 * exposure) if d else 0.0
    rate_hi = chi2.ppf(1 - a / 2, 2 * d + 2) / (2 * exposure)
    mean = exposure / d if d else math.inf
    return mean, 1.0 / rate_hi, (1.0 / rate_lo if rate_lo > 0 else math.inf), d, exposure


def poisson_estimate(lam: float, occupancy_s: float, n_star: float) -> float:
    """Mean time (s) to the first up-crossing of N* by a Poisson(λ·occupancy) population (see module doc)."""
    from scipy.stats import poisson

    m = lam * occupancy_s
    k = max(0, math.ceil(n_star) - 1)
    p = poisson.pmf(k, m)
    return math.inf if p <= 0 else 1.0 / (lam * p)


def round_min(x: float | None) -> float | None:
    if x is None or not math.isfinite(x):
        return None if x is None or math.isnan(x) else math.inf
    return round(x, 1)


def _fmt(x: float | None) -> str:
    return "–" if x is None else "∞" if x == math.inf else f"{x:.0f}"


def escape_text(rows: list[dict[str, Any]], spec: EscapeSpec, n_star: float) -> str:
    out = [f"{'λ':>7} {'runs':>5} {'collapsed':>9} {'mean escape (min)':>18} {'95% CI':>14} {'KM median':>9} "
           f"{'Poisson est.':>12}"]
    for r in rows:
        ci = f"{_fmt(r['ci95_min'][0])}–{_fmt(r['ci95_min'][1])}"
        out.append(f"{r['lam']:>7g} {r['runs']:>5} {r['collapsed']:>9} {_fmt(r['mean_escape_min']):>18} {ci:>14} "
                   f"{_fmt(r['km_median_min']):>9} {_fmt(r['poisson_estimate_min']):>12}")
    out.append(f"runs of {spec.minutes:g} min (censored there), time at risk from minute {spec.warmup:g}; "
               f"N* = {n_star:.1f}")
    return "\n".join(out)


def escape_page(rows: list[dict[str, Any]], spec: EscapeSpec, n_star: float, fig: str) -> str:
    lines = [
        "# Escape times: how long the healthy regime survives without a trigger", "",
        f"Setup: preset {spec.preset}, profile {spec.profile}, engine {spec.engine}, pool "
        f"{spec.kv_pool or 'the profile default'}; {spec.runs} trigger-free runs per λ of {spec.minutes:g} minutes "
        f"(seeds from {spec.seed0}); a run's escape time is the start of its persistently degraded stretch, "
        f"censored at the end of the run; time at risk from minute {spec.warmup:g}. N* = C/L̄ = {n_star:.1f}.", "",
        "The mean assumes a constant hazard (collapses / time at risk) with the exact Poisson 95% interval; "
        "the Kaplan-Meier median needs half the runs to collapse. The Poisson estimate is kvgate's fluctuation "
        "model (M/G/∞ population exceeding N*; see `kvgate.analysis.escape`), the kind the paper found "
        "too pessimistic by an order of magnitude.", "",
        "| λ | runs | collapsed | mean escape (min) | 95% CI (min) | KM median (min) | Poisson estimate (min) "
        "| R0 (s) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| {r['lam']:g} | {r['runs']} | {r['collapsed']} | {_fmt(r['mean_escape_min'])} | "
                     f"{_fmt(r['ci95_min'][0])}–{_fmt(r['ci95_min'][1])} | {_fmt(r['km_median_min'])} | "
                     f"{_fmt(r['poisson_estimate_min'])} | {r['R0_s']} |")
    lines += ["", f"![Kaplan-Meier survival of the healthy regime]({fig})", ""]
    return "\n".join(lines)


def escape_figure(curves: list[tuple[float, np.ndarray, np.ndarray]], spec: EscapeSpec, path: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.0))
    for lam, xs, ys in curves:
        ax.step(np.concatenate([[0.0], xs, [spec.minutes]]), np.concatenate([[1.0], ys, [ys[-1] if len(ys) else 1.0]]),
                where="post", label=f"λ = {lam:g}")
    ax.set_xlim(0, spec.minutes)
    ax.set_ylim(0, 1.02)
    ax.set_xlabel("minutes since start (no trigger)")
    ax.set_ylabel("fraction of runs still healthy (Kaplan-Meier)")
    ax.set_title(f"Survival of the healthy regime ({spec.preset}, {spec.runs} runs per λ)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
