"""Simulated fleets are a pure function of the config too: a fixed set of fleet configs (every router, a replica
failure under a sticky and a per-turn router, a join, migration, a control with timers) must reproduce the
summaries committed in tests/data/golden-fleet-summaries.json exactly. Speed work on the fleet loop must leave
them bit-identical; a deliberate change of behaviour re-records them
(`PYTHONPATH=tests python3 tests/sim/test_golden_fleet.py --record`) and says why in its commit.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from kvgate.sim.config import SimConfig
from support.golden import check_summary, main

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden-fleet-summaries.json"

F = SimConfig(preset="paper-8b", kv_pool=400_000, replicas=4, lam=0.14, minutes=40, bursts=("1.5@15+5",))
CONFIGS: dict[str, SimConfig] = {
    "kvgate-budgeter": F.with_(router="kvgate", control="budgeter", seed=501),
    "consistent-hash": F.with_(router="consistent-hash", seed=502),
    "round-robin": F.with_(router="round-robin", seed=503, minutes=25),
    "prefix-affinity": F.with_(router="prefix-affinity", seed=504),
    "least-loaded-budgeter": F.with_(router="least-loaded", control="budgeter", seed=505, minutes=25),
    "kvgate-failure": F.with_(router="kvgate", control="budgeter", seed=506, fail_at=("0@20",), lam=0.112),
    "consistent-hash-failure": F.with_(router="consistent-hash", seed=507, fail_at=("1@20",), lam=0.112),
    "kvgate-join": F.with_(router="kvgate", control="budgeter", seed=508, join_at=(20.0,), replicas=3),
    "kvgate-migrate": F.with_(router="kvgate", control="budgeter", seed=509, migrate_after_s=60.0, lam=0.18),
    "random-failure": F.with_(router="random", control="budgeter", seed=510, fail_at=("2@15",), minutes=25),
    "kvgate-aimd": F.with_(router="kvgate", control="aimd", seed=511),
}


def summarize(cfg: SimConfig) -> dict:
    from kvgate.sim.fleet import simulate_fleet

    res = simulate_fleet(cfg)
    s = dict(res.meta["summary"])
    s.pop("wall_s", None)
    extra = {k: res.meta[k] for k in ("engine_steps", "parks", "migrations", "replica_parks") if k in res.meta}
    return {"summary": s, "meta": extra}


def record() -> None:
    out = {name: {"config": asdict(cfg), **summarize(cfg)} for name, cfg in CONFIGS.items()}
    GOLDEN.write_text(json.dumps(out, indent=1, sort_keys=True, default=str) + "\n")
    print(f"{len(out)} fleet summaries written to {GOLDEN}")


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_fleet_summary_matches_the_committed_one(name: str) -> None:
    check_summary(GOLDEN, name, CONFIGS[name], summarize(CONFIGS[name]))


if __name__ == "__main__":
    main(record, __doc__)
