"""A fleet run's summary: one run summary per replica (``analysis.summary.summarize_cols`` on the replica's own
rows) and the fleet's (every turn; the samples summed over replicas), plus what only a fleet has: replicas
persistently degraded, failed turns, migrations, parked turns and their waits.

Records of a fleet carry a ``replica`` column in ``turns`` and ``samples`` (one sample row per live replica per
sample time) and in ``sessions`` (the replica the session was last placed on; -1: never placed). No I/O.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

import numpy as np

from kvgate.analysis.summary import summarize_cols

Cols = Mapping[str, np.ndarray]

SUMMED = (
    "in_system", "admitted", "parked", "gateway_waiting", "running", "waiting", "demand_tokens",
    "admitted_demand_tokens", "kv_pool", "preemptions",
)
"""Sample columns that add up over replicas (``kv_usage`` is averaged, weighted by the pools)."""


def select(cols: Cols, mask: np.ndarray) -> dict[str, np.ndarray]:
    return {k: v[mask] for k, v in cols.items()}


def replica_ids(samples: Cols, turns: Cols) -> list[int]:
    """Every replica that appears in the records, in order."""
    found: set[int] = set()
    for cols in (samples, turns):
        if "replica" in cols and len(cols["replica"]):
            found.update(int(x) for x in np.unique(cols["replica"]))
    return sorted(found - {-1})


def fleet_samples(samples: Cols) -> dict[str, np.ndarray]:
    """The samples of the whole fleet: one row per sample time, the columns of :data:`SUMMED` summed over the
    replicas sampled then, ``kv_usage`` the pool-weighted mean. One replica's samples come back unchanged."""
    if "replica" not in samples or len(np.unique(samples["replica"])) <= 1:
        return {k: v for k, v in samples.items() if k != "replica"}
    t = samples["t_s"]
    times, idx = np.unique(t, return_inverse=True)
    out: dict[str, np.ndarray] = {"t_s": times}
    for col in SUMMED:
        if col in samples:
            out[col] = np.bincount(idx, weights=np.asarray(samples[col], dtype=float), minlength=len(times))
            out[col] = out[col].astype(np.int64)
    pool = np.asarray(samples["kv_pool"], dtype=float)
    used = np.bincount(idx, weights=np.asarray(samples["kv_usage"], dtype=float) * pool, minlength=len(times))
    out["kv_usage"] = used / np.maximum(out["kv_pool"].astype(float), 1.0)
    return out


def _p(v: np.ndarray, q: float) -> float | None:
    return round(float(np.percentile(v, q)), 2) if len(v) else None


def fleet_summary(meta: Mapping[str, Any], turns: Cols, sessions: Cols, samples: Cols) -> dict[str, Any]:
    """The summary stored in a fleet run's ``run.json``: the fleet's own (the keys of a one-engine summary, over
    every turn and the summed samples) with ``replicas`` (one summary per replica) and ``fleet`` (what only a
    fleet has)."""
    out = summarize_cols(meta, turns, sessions, fleet_samples(samples))
    ids = replica_ids(samples, turns)
    if "replica" not in turns:
        return out
    parks = meta.get("replica_parks", {})
    per: list[dict[str, Any]] = []
    for r in ids:
        sm = dict(meta, parks=int(parks.get(str(r), 0)))
        s_r = select(sessions, sessions["replica"] == r) if "replica" in sessions else sessions
        row = summarize_cols(sm, select(turns, turns["replica"] == r), s_r, select(samples, samples["replica"] == r))
        row["replica"] = r
        per.append(row)
    out["replicas"] = per
    degraded = [row["replica"] for row in per if row["persistently_degraded"]]
    held = (turns["park_wait_s"] > 0) & (turns["status"] == "ok") if len(turns["status"]) else np.zeros(0, bool)
    waits = turns["park_wait_s"][held] / 60.0
    unfinished = int(np.isnan(sessions["end_s"]).sum()) if len(sessions["end_s"]) else 0
    out["fleet"] = {
        "router": meta.get("config", {}).get("router"),
        "replicas": len(ids),
        "replicas_degraded": len(degraded),
        "degraded_replicas": degraded,
        "failed_turns": int((turns["status"] == "error").sum()) if len(turns["status"]) else 0,
        "failed_replicas": [int(r) for r, _ in meta.get("failed_at", [])],
        "migrations": int(meta.get("migrations", 0)),
        "parked_turns": int(held.sum()),
        "parked_sessions": int(len(np.unique(turns["session"][held]))),
        "park_wait_p50_min": _p(waits, 50),
        "park_wait_p90_min": _p(waits, 90),
        "park_wait_max_min": round(float(waits.max()), 2) if len(waits) else None,
        "sessions_unfinished": unfinished,
        "hit_ratio_min_replica_last10": _min([row["hit_ratio_last10"] for row in per]),
    }
    return out


def _min(v: list[float | None]) -> float | None:
    x = [a for a in v if a is not None and not math.isnan(a)]
    return min(x) if x else None
