"""The paper's metrics over run records (§3, §5, §6), whoever wrote them.

All functions take numpy column dicts as loaded by :mod:`kvgate.records` and times in seconds.

* token-weighted hit ratio of a window: sum(cached) / sum(prompt) over turns *completing* in it; turns whose
  cached count is unknown are left out of both sums; a window with no turn has no ratio (NaN);
* persistently degraded: every 5-minute window (non-overlapping, aligned to the end of the trigger) from the
  first degraded one (hit ratio < 0.5) after the trigger to the end of the run is degraded. How kvgate reads the
  paper's definition at its two edges: a window with no completed turn has no hit ratio and is no evidence either
  way -- it neither starts a degraded stretch nor ends one; and "persistent" needs a degraded window *after* the
  first one, so a run whose only degraded window is its last (or whose first degraded window is followed only by
  windows without turns) is not persistently degraded -- one window cannot show that a state persists;
* recovery time: from control start to the start of the first 5-minute window, stepped by 1 minute, from which
  every later window has hit ratio >= 0.8; needs >= 10 minutes of follow-up;
* cohort completion: fraction of the sessions arriving in a span that finished by the end of the run.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import numpy as np

Cols = Mapping[str, np.ndarray]

DEGRADED_HIT = 0.5
RECOVERED_HIT = 0.8
WINDOW_S = 300.0


def _ok_turns(turns: Cols) -> np.ndarray:
    st = turns.get("status")
    if st is None or len(st) == 0:
        return np.ones(len(turns.get("end_s", [])), dtype=bool)
    return st == "ok"


def hit_ratio(turns: Cols, t0: float, t1: float) -> float:
    """Token-weighted prefix hit ratio of turns completing in [t0, t1)."""
    end = turns["end_s"]
    cached = np.asarray(turns["cached_tokens"], dtype=float)
    m = (end >= t0) & (end < t1) & _ok_turns(turns) & ~np.isnan(cached)
    p = turns["prompt_tokens"][m].sum()
    return float(cached[m].sum() / p) if p > 0 else math.nan


def turns_done(turns: Cols, t0: float, t1: float) -> int:
    end = turns["end_s"]
    return int(((end >= t0) & (end < t1) & _ok_turns(turns)).sum())


def turn_rate(turns: Cols, t0: float, t1: float) -> float:
    return turns_done(turns, t0, t1) / (t1 - t0) if t1 > t0 else math.nan


def sample_mean(samples: Cols, col: str, t0: float, t1: float) -> float:
    t = samples["t_s"]
    m = (t >= t0) & (t <= t1)
    return float(np.mean(samples[col][m])) if m.any() else math.nan


def series(turns: Cols, samples: Cols, end_s: float, width_s: float = 60.0) -> dict[str, np.ndarray]:
    """Windowed series: hit ratio, turn throughput, recomputed prompt tokens/s, and sample means."""
    edges = np.arange(0.0, end_s + 1e-9, width_s)
    if len(edges) < 2:
        edges = np.array([0.0, end_s])
    n = len(edges) - 1
    end = turns["end_s"]
    ok = _ok_turns(turns)
    cached = np.asarray(turns["cached_tokens"], dtype=float)
    prompt = np.asarray(turns["prompt_tokens"], dtype=float)
    idx = np.searchsorted(edges, end, side="right") - 1
    valid = ok & (idx >= 0) & (idx < n)
    known = valid & ~np.isnan(cached)
    p_sum = np.bincount(idx[known], weights=prompt[known], minlength=n)
    c_sum = np.bincount(idx[known], weights=cached[known], minlength=n)
    cnt = np.bincount(idx[valid], minlength=n)
    with np.errstate(invalid="ignore", divide="ignore"):
        hit = np.where(p_sum > 0, c_sum / np.where(p_sum > 0, p_sum, 1), np.nan)
    out = {
        "t_min": edges[:-1] / 60.0,
        "hit_ratio": hit,
        "turns_per_s": cnt / width_s,
        "recomputed_tok_per_s": (p_sum - c_sum) / width_s,
    }
    st = samples.get("t_s")
    if st is not None and len(st):
        sidx = np.searchsorted(edges, st, side="right") - 1
        sv = (sidx >= 0) & (sidx < n)
        scount = np.bincount(sidx[sv], minlength=n)
        for col in ("in_system", "running", "waiting", "parked", "kv_usage", "demand_tokens", "kv_pool"):
            if col in samples:
                s = np.bincount(sidx[sv], weights=np.asarray(samples[col], dtype=float)[sv], minlength=n)
                with np.errstate(invalid="ignore", divide="ignore"):
                    out[col] = np.where(scount > 0, s / np.where(scount > 0, scount, 1), np.nan)
        if "demand_tokens" in out and "kv_pool" in out:
            out["demand_over_pool"] = out["demand_tokens"] / out["kv_pool"]
    return out


def window_hits(turns: Cols, start_s: float, end_s: float, width_s: float = WINDOW_S) -> list[tuple[float, float]]:
    """(window start, hit ratio) for complete non-overlapping windows from ``start_s`` up to ``end_s``."""
    out = []
    t = start_s
    while t + width_s <= end_s + 1e-9:
        out.append((t, hit_ratio(turns, t, t + width_s)))
        t += width_s
    return out


def persistent_degradation(turns: Cols, samples: Cols, align_s: float, end_s: float) -> tuple[bool, float | None]:
    """(persistently degraded?, start of the degraded stretch in seconds) with windows aligned at ``align_s``."""
    wins = window_hits(turns, align_s, end_s)
    if not wins:
        return False, None

    # True: degraded, False: healthy, None: no completed turn (no evidence)
    flags = [None if math.isnan(h) else h < DEGRADED_HIT for _, h in wins]
    if True not in flags:
        return False, None
    first = flags.index(True)
    later = flags[first + 1 :]
    if False in later or True not in later:
        return False, None
    return True, wins[first][0]


def recovery_time(turns: Cols, control_s: float, end_s: float, follow_up_s: float = 600.0) -> float | None:
    """Minutes from control start to recovery (see module doc), or None if it never recovers."""
    starts = np.arange(control_s, end_s - WINDOW_S + 1e-9, 60.0)
    for i, t0 in enumerate(starts):
        if end_s - t0 < follow_up_s:
            return None
        later = starts[i:]
        hits = [hit_ratio(turns, s, s + WINDOW_S) for s in later]
        if all(not math.isnan(h) and h >= RECOVERED_HIT for h in hits):
            return float((t0 - control_s) / 60.0)
    return None


def cohort_completion(sessions: Cols, t0: float, t1: float) -> float:
    arr = sessions["arrival_s"]
    m = (arr >= t0) & (arr < t1)
    if not m.any():
        return math.nan
    return float((~np.isnan(sessions["end_s"][m])).mean())


def cohort_latency_min(sessions: Cols, t0: float, t1: float) -> np.ndarray:
    """Arrival-to-completion minutes of the sessions arriving in [t0, t1) that finished."""
    arr = sessions["arrival_s"]
    end = sessions["end_s"]
    m = (arr >= t0) & (arr < t1) & ~np.isnan(end)
    return (end[m] - arr[m]) / 60.0


def first_turn_waits(turns: Cols, sessions: Cols, t0: float, t1: float) -> np.ndarray:
    """The gateway wait (s) of the first turn of each session arriving in [t0, t1); a session still waiting at
    the end has waited at least until the end."""
    arr = sessions["arrival_s"]
    first_sent = sessions["first_sent_s"]
    m = (arr >= t0) & (arr < t1)
    last_t = float(np.nanmax(turns["end_s"])) if len(turns.get("end_s", [])) else t1
    return np.where(np.isnan(first_sent[m]), last_t - arr[m], first_sent[m] - arr[m])


def first_turn_wait_p90_min(turns: Cols, sessions: Cols, t0: float, t1: float) -> float:
    """p90 of the gateway wait of the first turn of sessions arriving in [t0, t1), in minutes."""
    waits = first_turn_waits(turns, sessions, t0, t1)
    return float(np.percentile(waits, 90) / 60.0) if len(waits) else math.nan
