"""The run summary stored in ``run.json`` and printed by ``kvgate sim --json``."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvgate.analysis import metrics as m
from kvgate.records import Run, from_tables
from kvgate.workload.triggers import trigger_end_min


def _r(x: float | None, nd: int = 4) -> float | None:
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return None
    return round(float(x), nd)


def summarize(run: Run) -> dict[str, Any]:
    return summarize_cols(run.meta, run.turns, run.sessions, run.samples)


def summarize_tables(meta: Mapping[str, Any], tables: Mapping[str, Any]) -> dict[str, Any]:
    return summarize(from_tables(dict(meta), tables))


def summarize_cols(meta: Mapping[str, Any], turns: m.Cols, sessions: m.Cols, samples: m.Cols) -> dict[str, Any]:
    cfg = meta.get("config", {})
    end = float(cfg.get("minutes", 0.0)) * 60.0
    if end <= 0:
        end = float(np.nanmax(turns["end_s"])) if len(turns["end_s"]) else 0.0
    align = cfg.get("align_min")
    if align is None:
        align = trigger_end_min(cfg)
    if cfg.get("prefix_caching") is False:
        # the detector is about a cache regime; without a prefix cache there is none (the backlog says the rest)
        pd, since = False, None
    else:
        pd, since = m.persistent_degradation(turns, samples, (align or 0.0) * 60.0, end)
    ok = turns["status"] == "ok" if len(turns["status"]) else np.zeros(0, dtype=bool)
    out: dict[str, Any] = {
        "hit_ratio_last10": _r(m.hit_ratio(turns, end - 600, end + 1e-9)),
        "sessions_in_system_last5": _r(m.sample_mean(samples, "in_system", end - 300, end), 2),
        "turns_per_s_last10": _r(m.turn_rate(turns, end - 600, end + 1e-9)),
        "persistently_degraded": bool(pd),
        "degraded_from_min": _r(since / 60.0 if since is not None else None, 1),
        "preemptions": int(samples["preemptions"][-1]) if len(samples["preemptions"]) else 0,
        "sessions_arrived": int(len(sessions["arrival_s"])),
        "sessions_finished": int((~np.isnan(sessions["end_s"])).sum()),
        "turns_done": int(ok.sum()),
        "hit_ratio_all": _r(m.hit_ratio(turns, -math.inf, math.inf)),
        "in_system_change_last30": _r(
            m.sample_mean(samples, "in_system", end - 300, end)
            - m.sample_mean(samples, "in_system", end - 2100, end - 1800),
            2,
        ),
        "trigger_sessions": int((sessions["cohort"] == "trigger").sum()) if len(sessions["cohort"]) else 0,
        "align_min": align,
    }
    out.update(control_summary(cfg, meta, turns, sessions, end))
    return out


COHORT_S = 1200.0


def control_summary(
    cfg: Mapping[str, Any], meta: Mapping[str, Any], turns: m.Cols, sessions: m.Cols, end: float
) -> dict[str, Any]:
    """Control outcomes (§6): recovery after control starts, the cohort arriving after it, gateway waits."""
    out: dict[str, Any] = {"control": cfg.get("control", "none"), "parks": int(meta.get("parks", 0))}
    ctrl_min = cfg.get("control_at")
    start = float(ctrl_min) * 60.0 if ctrl_min is not None else 0.0
    if ctrl_min is not None:
        before = m.hit_ratio(turns, start - 300.0, start)
        out["hit_before_control"] = _r(before)
        out["collapsed_at_control"] = bool(not math.isnan(before) and before < m.DEGRADED_HIT)
        rec = m.recovery_time(turns, start, end)
        out["recovered"] = rec is not None
        out["recovery_min"] = _r(rec, 1)
    lat = m.cohort_latency_min(sessions, start, start + COHORT_S)
    out["cohort_done"] = _r(m.cohort_completion(sessions, start, start + COHORT_S))
    out["cohort_latency_p50_min"] = _r(float(np.median(lat)) if len(lat) else None, 2)
    out["cohort_latency_p90_min"] = _r(float(np.percentile(lat, 90)) if len(lat) else None, 2)
    p1_end = phase1_end_s(cfg, end)
    out["gateway_wait_p90_min"] = _r(m.first_turn_wait_p90_min(turns, sessions, 0.0, p1_end), 3)
    return out


def phase1_end_s(cfg: Mapping[str, Any], end: float) -> float:
    """End of the workload's first phase (the mix shift's short-session phase), else the run's end."""
    if not cfg.get("trace"):
        from kvgate.workload.shapes import PRESETS

        wl = PRESETS.get(cfg.get("preset", ""))
        if wl is not None and len(wl.phases) > 1:
            return wl.phases[1].start_s
    return end


