"""The fleet simulator: one replica replays the one-engine simulator exactly; failures, joins, migration, budgets
per replica and the router's placements, as the records show them."""

from __future__ import annotations

import json
from collections import defaultdict
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvgate.errors import UsageError
from kvgate.fleet.routers import ROUTERS, STICKY
from kvgate.records import numpy_columns
from kvgate.sim.config import SimConfig
from kvgate.sim.fleet import simulate_fleet
from kvgate.sim.fleet_records import without_replica
from kvgate.sim.runner import simulate

IDENTITY = {
    "flush": dict(lam=0.04, minutes=25, flush_at=8.0, seed=3),
    "burst": dict(lam=0.035, minutes=30, bursts=("1.5@10+5",), seed=501),
    "budgeter": dict(lam=0.04, minutes=25, bursts=("1.0@8+4",), control="budgeter", seed=7),
    "sglang": dict(lam=0.04, minutes=20, engine="sglang", bursts=("1.0@8+4",), seed=2),
    "aimd-late": dict(lam=0.04, minutes=20, control="aimd", control_at=10.0, bursts=("1.0@4+4",), seed=4),
    "retries": dict(lam=0.04, minutes=20, client_timeout_s=30.0, client_retries=1, bursts=("1.0@4+4",), seed=5),
}


def cols(res: Any, table: str) -> dict[str, np.ndarray]:
    return numpy_columns(res.tables[table])


@pytest.mark.parametrize("name", list(IDENTITY))
def test_a_fleet_of_one_records_the_one_engine_run(name: str) -> None:
    """One replica recorded as a fleet (a replica column, the fleet summary) is the one-engine run, for every router.
    (That the fleet loop replays the one-engine simulator it replaced is the golden summaries' test.)"""
    kw: dict[str, Any] = IDENTITY[name]
    base = simulate(SimConfig(**kw))
    assert "replica" not in base.tables["turns"].column_names
    want = {k: v for k, v in base.meta["summary"].items() if k != "wall_s"}
    routers = ROUTERS if name == "burst" else ("kvgate", "round-robin")
    for router in routers:
        res = simulate_fleet(SimConfig(router=router, replica_pools=(base.meta["kv_pool"],), **kw))
        tables = without_replica(res.tables)
        for t in ("turns", "samples", "sessions"):
            assert tables[t].equals(base.tables[t]), (name, router, t)
        assert {k: res.meta["summary"][k] for k in want} == want, (name, router)
        assert set(cols(res, "turns")["replica"]) == {0}


GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden-summaries.json"


@pytest.mark.skipif(not GOLDEN.exists(), reason="no golden summaries")
def test_the_fleet_simulator_reproduces_every_golden_summary() -> None:
    """simulate_fleet can stand in for simulate: the committed one-engine summaries, bit for bit."""
    golden = json.loads(GOLDEN.read_text())
    for name, want in golden.items():
        cfg = SimConfig.from_dict(want["config"])
        res = simulate_fleet(cfg)
        got = dict(res.meta["summary"])
        got.pop("wall_s", None)
        extra = {k: res.meta[k] for k in want["meta"]}
        assert json.loads(json.dumps({"summary": got, "meta": extra})) == {"summary": want["summary"],
                                                                           "meta": want["meta"]}, name


def test_deterministic_per_seed_and_the_random_router_keyed_by_it() -> None:
    cfg = SimConfig(replicas=3, lam=0.1, minutes=15, router="random", seed=11)
    a, b = simulate_fleet(cfg), simulate_fleet(cfg)
    for t in ("turns", "samples", "sessions"):
        assert a.tables[t].equals(b.tables[t])
    c = simulate_fleet(cfg.with_(seed=12))
    assert not a.tables["turns"].equals(c.tables["turns"])


def placements(res: Any) -> dict[int, list[int]]:
    t = cols(res, "turns")
    where: dict[int, list[int]] = defaultdict(list)
    for sid, _turn, rep in sorted(zip(t["session"], t["turn"], t["replica"], strict=True)):
        where[int(sid)].append(int(rep))
    return where


@pytest.mark.parametrize("router", ROUTERS)
def test_router_placements_are_in_the_records(router: str) -> None:
    res = simulate_fleet(SimConfig(replicas=3, lam=0.09, minutes=20, router=router, seed=21))
    where = placements(res)
    multi = [reps for reps in where.values() if len(set(reps)) > 1]
    if router in STICKY:
        assert not multi, "a sticky router moved a session without a failure"
    else:
        assert multi, "a per-turn router kept every session on one replica"
    t = cols(res, "turns")
    counts = np.bincount(t["replica"], minlength=3)
    assert (counts > 0).all()
    if router == "round-robin":
        assert counts.min() > 0.25 * counts.sum()  # every turn to the next replica (some still in flight)
    s = cols(res, "samples")
    per_t = defaultdict(set)
    for ts, rep in zip(s["t_s"], s["replica"], strict=True):
        per_t[float(ts)].add(int(rep))
    assert all(v == {0, 1, 2} for v in per_t.values())  # one sample row per replica per sample time
    sessions = cols(res, "sessions")
    done = ~np.isnan(sessions["end_s"])
    for sid, rep in zip(sessions["session"][done], sessions["replica"][done], strict=True):
        assert where[int(sid)][-1] == rep  # a session's replica is where its last turn ran


def test_consistent_hash_placement_does_not_depend_on_load() -> None:
    light = placements(simulate_fleet(SimConfig(replicas=4, lam=0.05, minutes=15, router="consistent-hash")))
    heavy = placements(simulate_fleet(SimConfig(replicas=4, lam=0.05, minutes=15, router="consistent-hash",
                                                  bursts=("2.0@2+3",))))
    common = set(light) & set(heavy)
    assert common and all(light[s][0] == heavy[s][0] for s in common)


@pytest.mark.parametrize("router", ["kvgate", "consistent-hash", "round-robin"])
def test_a_failed_replica_loses_no_session(router: str) -> None:
    # arrivals stop at minute 18 so every session can finish by the end
    cfg = SimConfig(replicas=3, lam=0.08, minutes=60, router=router, fail_at=("1@10.5",), rate_at=("18:0",),
                      control="budgeter" if router == "kvgate" else "none", seed=31)
    res = simulate_fleet(cfg)
    t = cols(res, "turns")
    failed = t["status"] == "error"
    assert failed.any(), "no turn was in flight on the failed replica"
    assert (t["replica"][failed] == 1).all() and np.allclose(t["end_s"][failed], 630.0)
    assert not ((t["replica"] == 1) & (t["end_s"] > 630.0)).any(), "a turn ran on the failed replica after it failed"
    ok = t["status"] == "ok"
    for sid, turn in zip(t["session"][failed], t["turn"][failed], strict=True):
        again = ok & (t["session"] == sid) & (t["turn"] == turn)
        assert again.sum() == 1 and t["replica"][again][0] != 1  # the agent re-sent it, elsewhere
    on_failed = set(t["session"][(t["replica"] == 1)].tolist())
    s = cols(res, "sessions")
    assert not np.isnan(s["end_s"]).any(), "a session never finished"
    assert (s["turns_done"] == s["turns"]).all()
    moved = [sid for sid in on_failed if placements(res)[sid][-1] != 1]
    assert moved, "no session of the failed replica was re-placed"
    samples = cols(res, "samples")
    assert not ((samples["replica"] == 1) & (samples["t_s"] > 630.0)).any()
    fleet = res.meta["summary"]["fleet"]
    assert fleet["failed_replicas"] == [1] and fleet["failed_turns"] == int(failed.sum())
    assert fleet["sessions_unfinished"] == 0


def test_a_replica_that_joins_adds_capacity() -> None:
    base = SimConfig(replicas=1, lam=0.08, minutes=40, router="kvgate", seed=41)
    alone = simulate_fleet(base)
    joined = simulate_fleet(base.with_(join_at=(10.0,)))
    t = cols(joined, "turns")
    assert not ((t["replica"] == 1) & (t["end_s"] < 600.0)).any()
    assert ((t["replica"] == 1) & (t["status"] == "ok")).sum() > 0
    s = cols(joined, "samples")
    assert s["t_s"][s["replica"] == 1].min() >= 600.0
    assert joined.meta["summary"]["turns_done"] > alone.meta["summary"]["turns_done"]
    assert joined.meta["joined_at"] == [(1, 600.0)]


def test_per_replica_budget_holds_for_the_kvgate_router() -> None:
    cfg = SimConfig(replicas=3, lam=0.105, minutes=40, bursts=("1.5@10+5",), router="kvgate", control="budgeter",
                      replica_pools=(400_000, 300_000, 250_000), seed=51)
    res = simulate_fleet(cfg)
    s = cols(res, "samples")
    for r, pool in enumerate(cfg.replica_pools):
        mine = s["replica"] == r
        assert (s["kv_pool"][mine] == pool).all()
        busy = mine & (s["admitted"] > 1)  # a session alone is never parked, whatever its size
        assert (s["admitted_demand_tokens"][busy] <= 0.95 * pool).all()
        assert s["admitted_demand_tokens"][mine].max() > 0.5 * pool  # the budget was actually reached
    assert res.meta["parks"] > 0
    per = res.meta["summary"]["replicas"]
    assert [p["replica"] for p in per] == [0, 1, 2]
    assert sum(p["parks"] for p in per) == res.meta["parks"]


def test_migration_moves_long_parked_sessions_to_headroom() -> None:
    # two saturated replicas park sessions; a third joins with room: sessions parked over a minute move there
    base = SimConfig(replicas=2, lam=0.14, minutes=30, router="kvgate", control="budgeter", join_at=(12.0,),
                       seed=61)
    still = simulate_fleet(base)
    moved = simulate_fleet(base.with_(migrate_after_s=60.0))
    assert still.meta["migrations"] == 0 and moved.meta["migrations"] > 0
    where = placements(moved)
    hopped = {sid: reps for sid, reps in where.items() if len(set(reps)) > 1}
    hops = sum(sum(a != b for a, b in zip(reps, reps[1:], strict=False)) for reps in hopped.values())
    assert hopped and hops <= moved.meta["migrations"]
    assert any(2 in reps for reps in hopped.values())  # to the replica that joined with room
    t = cols(moved, "turns")
    for sid, reps in hopped.items():  # the first turn after a move misses (only the shared prompt is there)
        k = next(i for i in range(1, len(reps)) if reps[i] != reps[i - 1])
        row = (t["session"] == sid) & (t["turn"] == k) & (t["status"] == "ok")
        assert t["cached_tokens"][row][0] < 0.5 * t["prompt_tokens"][row][0]
    assert not [reps for reps in placements(still).values() if len(set(reps)) > 1]


def test_fleet_triggers_reach_every_replica() -> None:
    res = simulate_fleet(SimConfig(replicas=3, lam=0.1, minutes=15, flush_at=8.0, router="consistent-hash"))
    assert len(res.meta["flushed_at_s"]) == 3


@pytest.mark.parametrize(
    "kw",
    [
        dict(replicas=0),
        dict(router="sticky"),
        dict(replicas=2, replica_pools=(400_000,)),
        dict(replicas=2, replica_pools=(400_000, 10_000)),
        dict(replicas=2, fail_at=("2@10",)),
        dict(replicas=2, fail_at=("1-10",)),
        dict(replicas=2, join_at=(-1.0,)),
        dict(replicas=2, fail_at=("0@5", "1@6")),
        dict(replicas=1, join_at=(10.0,), fail_at=("0@5",)),
        dict(replicas=2, router="round-robin", migrate_after_s=60.0),
    ],
)
def test_bad_fleet_configs_are_usage_errors(kw: dict[str, Any]) -> None:
    with pytest.raises(UsageError):
        simulate_fleet(SimConfig(minutes=1, **kw))


def test_fleet_config_round_trips_through_run_json() -> None:
    cfg = SimConfig(replicas=3, router="least-loaded", fail_at=("1@5",), join_at=(7.0,), replica_pools=(1, 2, 3, 4))
    assert SimConfig.from_dict(json.loads(json.dumps(asdict(cfg)))) == cfg


@pytest.mark.parametrize("router", ["kvgate", "least-loaded"])
def test_replica_samples_add_up_to_the_fleet(router: str) -> None:
    from kvgate.analysis.fleet import fleet_samples

    res = simulate_fleet(SimConfig(replicas=3, lam=0.1, minutes=20, router=router, control="budgeter", seed=71))
    fleet = fleet_samples(cols(res, "samples"))
    s = cols(res, "sessions")
    for t, n in zip(fleet["t_s"], fleet["in_system"], strict=True):
        alive = (s["arrival_s"] <= t) & (np.isnan(s["end_s"]) | (s["end_s"] > t))
        assert n == alive.sum(), t
    assert (fleet["kv_pool"] == 3 * 400_000).all()
    assert res.meta["summary"]["sessions_in_system_last5"] == pytest.approx(
        float(np.mean(fleet["in_system"][fleet["t_s"] >= 15 * 60])), abs=0.01)


def test_consistent_hash_shares_are_where_sessions_go() -> None:
    from kvgate.fleet.routers import ConsistentHash, ReplicaView

    ring = ConsistentHash()
    shares = ring.shares(4)
    assert sum(shares) == pytest.approx(1.0)
    views = [ReplicaView(i, kv_pool=400_000) for i in range(4)]
    got = np.bincount([ring.route(sid, views) for sid in range(20_000)], minlength=4) / 20_000
    assert np.abs(got - np.array(shares)).max() < 0.02


def test_the_sim_command_runs_a_fleet_and_refuses_bad_fleet_options() -> None:
    from click.testing import CliRunner

    from kvgate.cli import cli

    r = CliRunner().invoke(cli, ["sim", "--replicas", "2", "--lam", "0.07", "--minutes", "10", "--router",
                                 "consistent-hash", "--fail-at", "1@5", "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)
    assert s["fleet"]["router"] == "consistent-hash" and s["fleet"]["replicas"] == 2
    assert [x["replica"] for x in s["replicas"]] == [0, 1]
    for bad in (["--replica-pools", "1,x"], ["--router", "sticky"], ["--replicas", "2", "--fail-at", "7@1"]):
        r = CliRunner().invoke(cli, ["sim", "--minutes", "2", *bad])
        # click's own usage errors exit 2; kvgate's (UsageError) become one line and exit 2 in kvgate's main
        assert r.exit_code != 0 and isinstance(r.exception, SystemExit | UsageError), (bad, r.output)
