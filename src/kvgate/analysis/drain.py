"""The drain condition (§4): the cost of a cold turn c(L), the cold work per session S, and 1/S.

If every turn misses, serving a session costs ``S = sum_k c(L_k)`` engine-seconds, so the degraded regime can
drain only if ``lam < 1/S``. c(L) is measured on runs with prefix caching off: cut the run into 2-minute
windows, keep those in which at least 4 requests were running throughout, and regress the window length on the
number of turns completed in it and their total prompt tokens (no intercept):
``120 s = a * turns + b * tokens``, hence ``c(L) = a + b * L``.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np

from kvgate.records import Run
from kvgate.workload.shapes import Workload

WINDOW_S = 120.0
MIN_RUNNING = 4


@dataclass(frozen=True)
class ColdCost:
    intercept_s: float
    slope_s_per_token: float
    windows: int

    def __call__(self, context_tokens: float) -> float:
        return self.intercept_s + self.slope_s_per_token * context_tokens

    @property
    def slope_ms_per_token(self) -> float:
        return self.slope_s_per_token * 1000.0


def busy_windows(run: Run, width_s: float = WINDOW_S, min_running: int = MIN_RUNNING) -> list[tuple[int, float]]:
    """(turns, prompt tokens) of the complete windows in which at least ``min_running`` requests ran."""
    end = float(run.config.get("minutes", 0.0)) * 60.0 or float(np.nanmax(run.turns["end_s"]))
    t_s = run.samples["t_s"]
    running = run.samples["running"]
    ok = run.turns["status"] == "ok"
    tend = run.turns["end_s"][ok]
    prompt = run.turns["prompt_tokens"][ok]
    out = []
    t0 = 0.0
    while t0 + width_s <= end + 1e-9:
        m = (t_s >= t0) & (t_s < t0 + width_s)
        if m.any() and running[m].min() >= min_running:
            w = (tend >= t0) & (tend < t0 + width_s)
            out.append((int(w.sum()), float(prompt[w].sum())))
        t0 += width_s
    return out


def all_miss_windows(
    run: Run, from_s: float = 0.0, width_s: float = WINDOW_S, min_running: int = MIN_RUNNING
) -> list[tuple[int, float]]:
    """(turns, prompt tokens) of the complete windows from ``from_s`` in which at least ``min_running`` requests
    ran and every completed turn missed (less than half its prompt cached): the paper's second c(L) fit, on
    degraded cache-enabled runs."""
    end = float(run.config.get("minutes", 0.0)) * 60.0 or float(np.nanmax(run.turns["end_s"]))
    t_s = run.samples["t_s"]
    running = run.samples["running"]
    ok = run.turns["status"] == "ok"
    tend = run.turns["end_s"][ok]
    prompt = run.turns["prompt_tokens"][ok]
    cached = np.asarray(run.turns["cached_tokens"], dtype=float)[ok]
    out = []
    t0 = from_s
    while t0 + width_s <= end + 1e-9:
        m = (t_s >= t0) & (t_s < t0 + width_s)
        if m.any() and running[m].min() >= min_running:
            w = (tend >= t0) & (tend < t0 + width_s)
            if w.any() and bool((cached[w] < 0.5 * prompt[w]).all()):
                out.append((int(w.sum()), float(prompt[w].sum())))
        t0 += width_s
    return out


def fit_cold_cost_all_miss(runs: Iterable[Run], from_s: float = 0.0, width_s: float = WINDOW_S) -> ColdCost:
    return _fit([w for r in runs for w in all_miss_windows(r, from_s, width_s)], width_s)


def fit_cold_cost(runs: Iterable[Run], width_s: float = WINDOW_S) -> ColdCost:
    return _fit([w for r in runs for w in busy_windows(r, width_s)], width_s)


def _fit(rows: list[tuple[int, float]], width_s: float) -> ColdCost:
    if len(rows) < 2:
        return ColdCost(math.nan, math.nan, len(rows))
    x = np.array(rows, dtype=float)
    y = np.full(len(rows), width_s)
    coef, *_ = np.linalg.lstsq(x, y, rcond=None)
    return ColdCost(float(coef[0]), float(coef[1]), len(rows))


def cold_work_per_session(cost: ColdCost, workload: Workload) -> float:
    """S: the mean over the workload's session shapes of sum_k c(L_k) (engine-seconds)."""
    shapes = workload.shapes()
    tot = 0.0
    for s in shapes:
        tot += sum(cost(p) for p in s.prompt_tokens())
    return tot / len(shapes)


def _session_prompts(run: Run) -> dict[int, list[int]]:
    """Every session's prompt lengths, regenerated from the run's config (the workload is deterministic)."""
    from kvgate.sim.runner import SimConfig
    from kvgate.workload.arrivals import generate

    cfg = run.config
    fields = {k: v for k, v in cfg.items() if k in SimConfig.__dataclass_fields__}
    for k in ("bursts", "rate_at"):
        if k in fields and fields[k] is not None:
            fields[k] = tuple(fields[k])
    sc = SimConfig(**fields)
    specs = generate(sc.workload(), sc.lam, sc.minutes * 60.0, sc.seed, sc.parsed_bursts(), sc.parsed_rates())
    return {s.sid: s.shape.prompt_tokens() for s in specs}


def remaining_cold_work(run: Run, cost: ColdCost, times: Sequence[float]) -> np.ndarray:
    """Engine-seconds of cold work left in the system at each time: for every session that has arrived and not
    finished, sum c(L_k) over the turns it has not completed yet."""
    prompts = _session_prompts(run)
    arrival = dict(zip(run.sessions["session"].tolist(), run.sessions["arrival_s"].tolist(), strict=True))
    ends: dict[int, list[float]] = {}
    ok = run.turns["status"] == "ok"
    for s, e in zip(run.turns["session"][ok].tolist(), run.turns["end_s"][ok].tolist(), strict=True):
        ends.setdefault(int(s), []).append(float(e))
    suffix: dict[int, np.ndarray] = {}
    for sid, pr in prompts.items():
        c = np.array([cost(p) for p in pr])
        suffix[sid] = np.concatenate([np.cumsum(c[::-1])[::-1], [0.0]])
    out = np.zeros(len(times))
    for sid, suf in suffix.items():
        a = arrival.get(sid)
        if a is None:
            continue
        e = np.sort(np.array(ends.get(sid, []), dtype=float))
        for i, t in enumerate(times):
            if a <= t:
                done = int(np.searchsorted(e, t, side="right"))
                out[i] += suf[min(done, len(suf) - 1)]
    return out


def drift_per_hour(run: Run, cost: ColdCost, start_s: float, end_s: float, step_s: float = 600.0) -> float:
    """Slope (engine-seconds per hour) of the remaining cold work between ``start_s`` and ``end_s``, fitted on
    samples every ``step_s`` (the paper fits the whole post-change interval at 10-minute samples)."""
    times = np.arange(start_s, end_s + 1e-9, step_s)
    if len(times) < 2:
        return math.nan
    w = remaining_cold_work(run, cost, times)
    slope = np.polyfit(times, w, 1)[0]
    return float(slope * 3600.0)
