"""A fleet run's records: the one-engine tables with a ``replica`` column (turns: where the turn ran; samples: one
row per live replica per sample time; sessions: the replica the session was last placed on, -1 if never)."""

from __future__ import annotations

import time
from dataclasses import asdict
from typing import Any

import pyarrow as pa

from kvgate import __version__
from kvgate.analysis.fleet import fleet_summary
from kvgate.analysis.summary import summarize_tables
from kvgate.records import Recorder, SampleRow, SessionRow, numpy_columns
from kvgate.sim.config import SimResult

REPLICA = "replica"


class FleetRecorder(Recorder):
    """:class:`kvgate.records.Recorder` (in memory) with the replica of every row kept beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.replica_of: dict[str, list[int]] = {name: [] for name in self.cols}

    def sample_at(self, row: SampleRow, replica: int) -> None:
        self.sample(row)
        self.replica_of["samples"].append(replica)

    def session_at(self, row: SessionRow, replica: int) -> None:
        self.session(row)
        self.replica_of["sessions"].append(replica)

    def tables(self) -> dict[str, Any]:
        out = {}
        for name, c in self.cols.items():
            t = c.table()
            out[name] = t.append_column(REPLICA, pa.array(self.replica_of[name], type=pa.int32()))
        out["sessions"] = out["sessions"].sort_by("session")
        return out


def without_replica(tables: dict[str, Any]) -> dict[str, Any]:
    """The tables as a one-engine run writes them (the ``replica`` column dropped)."""
    return {k: (t.drop_columns([REPLICA]) if REPLICA in t.column_names else t) for k, t in tables.items()}


def result(sim: Any, wall0: float) -> SimResult:
    """The records and metadata (with its summary) of a finished run, ``sim`` (:class:`kvgate.sim.fleet.FleetSim`):
    a run of one engine is recorded as such."""
    cfg, rec, reps, fleet = sim.cfg, sim.rec, sim.reps, sim.fleet
    for rep in reps:  # a jump that runs past the end counts whole, as one not left pending does
        if rep.pending is not None:
            rep.pending = None
            rep.engine.settle()  # type: ignore[union-attr]
    sessions = sim.sessions
    for sid in sorted(sessions):
        s = sessions[sid]
        rec.session_at(s.row(), -1 if s.replica is None else s.replica.index)
    tables = rec.tables()
    live = [r for r in reps if r.up]
    replica_parks = {}  # a sticky router's books, per replica (those that went down included)
    if fleet.sticky:
        replica_parks = {r.index: r.retired_parks + (r.policy.parks if r.policy is not None else 0)
                         for r in reps if r.policy is not None or r.downs}
    meta: dict[str, Any] = {
        "kvgate_version": __version__,
        "kind": "sim",
        "config": asdict(cfg),
        "seed": cfg.seed,
        "kv_pool": sim.kv_pool,
        "engine_steps": sim.dead_steps + sum(r.engine.stats.steps for r in live),  # type: ignore[union-attr]
        "parks": fleet.parks,
        "flushed_at_s": sim.flushed_at,
        "flush_refusals": sim.flush_refusals,
        "client_timeouts": sessions.timeouts,
        "client_retries": sessions.retries_sent,
        "sessions_abandoned": sessions.abandoned,
        "sim_wall_s": time.perf_counter() - wall0,
    }
    if cfg.is_fleet:
        meta.update({
            "replica_pools": sim.pools, "replica_parks": {str(k): v for k, v in sorted(replica_parks.items())},
            "failed_at": sim.failed_at, "joined_at": sim.joined_at, "migrations": sim.migrations,
        })
        cols = {k: numpy_columns(v) for k, v in tables.items()}
        meta["summary"] = fleet_summary(meta, cols["turns"], cols["sessions"], cols["samples"])
    else:  # a one-engine run, recorded as the one-engine simulator records it
        tables = without_replica(tables)
        meta["summary"] = summarize_tables(meta, tables)
    meta["summary"]["wall_s"] = round(time.perf_counter() - wall0, 4)
    return SimResult(cfg, meta, tables)
