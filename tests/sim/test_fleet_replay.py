"""A fleet under a sticky router is exactly its replicas run apart: each replica's turns and samples, bit for bit,
are those of one engine serving alone the sessions the router placed on it.

A sticky router keeps a session on its replica and every replica has its own gateway policy (D_r against C_r),
so nothing of one replica should reach another's: not its arrivals, not its think times, not its steps. The
simulator must not let them either, not even as a shorter decode jump (which would round a turn's times
differently): a replica's jump is bounded only by what reaches every replica (samples, timers, the end) and cut
short only when work is sent to it. The check replays each replica's sessions through ``simulate_fleet`` with one
engine (``sessions_in``) and compares the records; the fleet's own router and controls (no control, the budgeter
parking sessions, AIMD with its timers) are the cases.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from kvgate.sim.config import SimConfig, validate
from kvgate.sim.fleet import simulate_fleet
from kvgate.workload.arrivals import SessionSpec, generate

F = SimConfig(preset="paper-8b", kv_pool=400_000, replicas=4, lam=0.14, minutes=30, bursts=("1.5@15+5",))
CASES = {
    "consistent-hash": F.with_(router="consistent-hash", seed=502),
    "kvgate-budgeter": F.with_(router="kvgate", control="budgeter", seed=501),
    "kvgate-aimd": F.with_(router="kvgate", control="aimd", seed=511, replicas=3, lam=0.105),
}


def _of_replica(table: pa.Table, r: int) -> pa.Table:
    return table.filter(np.asarray(table.column("replica")) == r).drop_columns(["replica"])


def _placed(cfg: SimConfig, sessions: pa.Table) -> list[list[SessionSpec]]:
    specs = {sp.sid: sp for sp in generate(validate(cfg), cfg.lam, cfg.horizon_s, cfg.seed, cfg.parsed_bursts())}
    out: list[list[SessionSpec]] = [[] for _ in range(cfg.replicas)]
    for sid, r in zip(sessions.column("session").to_pylist(), sessions.column("replica").to_pylist(), strict=True):
        out[r].append(specs[sid])
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_each_replica_runs_as_one_engine_serving_its_sessions_alone(name: str) -> None:
    cfg = CASES[name]
    fleet = simulate_fleet(cfg)
    assert fleet.meta["parks"] > 0 or cfg.control == "none"
    lone = cfg.with_(replicas=1, router="round-robin", bursts=())
    placed = _placed(cfg, fleet.tables["sessions"])
    assert all(len(p) > 10 for p in placed)
    for r, mine in enumerate(placed):
        alone = simulate_fleet(lone, mine)
        turns = _of_replica(fleet.tables["turns"], r)
        assert turns.num_rows > 100
        assert turns.equals(alone.tables["turns"]), f"replica {r}: its turns differ from its sessions run alone"
        assert _of_replica(fleet.tables["samples"], r).equals(alone.tables["samples"]), f"replica {r}: samples"
