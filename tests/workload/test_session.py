"""The closed loop written once (workload/session), the configs composed from one config per concern, and the one
recorder: what the simulator and the HTTP driver both rely on."""

from __future__ import annotations

import json
import math
from dataclasses import asdict, fields
from pathlib import Path

import pytest

from kvgate.engine.factory import EngineConfig
from kvgate.errors import UsageError
from kvgate.policy.config import ControlConfig
from kvgate.records import Recorder, SampleRow, SessionRow, TurnRow, load_run, prepare_out
from kvgate.sim.config import SimConfig
from kvgate.workload.arrivals import SessionSpec
from kvgate.workload.config import AgentRetries, WorkloadConfig
from kvgate.workload.session import Sessions
from kvgate.workload.shapes import synthetic


def _spec(sid: int, turns: int = 3) -> SessionSpec:
    shape = synthetic(shared=100, unique=900, turns=turns, output=50, append=150)
    return SessionSpec(sid, "base", float(sid), shape, tuple(10.0 + k for k in range(turns - 1)))


def test_a_session_walks_its_turns_and_its_demand_follows_the_current_turn() -> None:
    loop = Sessions()
    a, b = loop.arrive(loop.new(_spec(1))), loop.arrive(loop.new(_spec(2, turns=1)))
    assert loop.in_system == 2
    t0 = loop.request(a)
    assert (t0.index, t0.prompt_tokens, t0.output_tokens, t0.last) == (0, 1000, 50, False)
    loop.request(b)
    assert loop.demand == 2 * 1050
    assert loop.finish(a, 5.0) == 10.0  # think time before turn 1
    t1 = loop.request(a)
    assert t1.prompt_tokens == 1000 + 50 + 150
    assert loop.demand == 1050 + t1.demand  # a's demand replaced, not added
    assert loop.finish(b, 6.0) is None  # b's only turn: it ended and left
    assert b.left and b.end == 6.0 and loop.in_system == 1 and loop.demand == t1.demand
    assert loop.finish(a, 20.0) == 11.0
    assert loop.request(a).last
    assert loop.finish(a, 40.0) is None
    assert loop.in_system == 0 and loop.demand == 0
    assert [r.turns_done for r in loop.rows()] == [3, 1]
    assert loop.rows()[0].end_s == 40.0


def test_timeouts_back_off_deterministically_then_the_agent_gives_up() -> None:
    retries = AgentRetries(timeout_s=30.0, retries=2, backoff_s=2.0, jitter=0.5, seed=6)
    loop = Sessions(retries)
    s = loop.arrive(loop.new(_spec(7)))
    loop.request(s)
    b1 = loop.timed_out(s)
    assert b1 is not None and 1.0 <= b1 <= 3.0 and s.attempt == 1
    assert not s.is_attempt(0, 0) and s.is_attempt(0, 1)  # a timer for the first attempt is stale now
    assert loop.retry(s).attempt == 1
    b2 = loop.timed_out(s)
    assert b2 is not None and 2.0 <= b2 <= 6.0
    assert b2 == retries.backoff(7, 0, 2)  # keyed by (seed, session, turn, attempt), not by call order
    assert AgentRetries(30.0, 2, 2.0, 0.5, seed=7).backoff(7, 0, 2) != b2
    assert loop.timed_out(s) is None  # out of retries
    assert s.left and s.abandoned and math.isnan(s.end)
    assert (loop.timeouts, loop.retries_sent, loop.abandoned, loop.in_system) == (3, 1, 1, 0)
    assert loop.rows()[0].end_s is None


def test_a_new_turn_starts_at_the_first_attempt() -> None:
    loop = Sessions(AgentRetries(timeout_s=30.0, retries=3))
    s = loop.arrive(loop.new(_spec(1)))
    loop.request(s)
    assert loop.timed_out(s) is not None
    loop.retry(s)
    loop.finish(s, 50.0)
    assert loop.request(s).attempt == 0 and s.is_attempt(1, 0)


def test_the_program_configs_are_one_config_per_concern_and_flat() -> None:
    names = {f.name for f in fields(SimConfig)}
    for part in (WorkloadConfig, EngineConfig, ControlConfig):
        assert {f.name for f in fields(part)} <= names, part.__name__
    cfg = SimConfig(lam=0.05, engine="sglang", control="budgeter", control_opt="low=0.6", bursts=("1.0@10+4",))
    flat = asdict(cfg)
    assert flat["lam"] == 0.05 and flat["engine"] == "sglang" and flat["control"] == "budgeter"
    assert cfg.control_opts() == {"low": 0.6}
    assert cfg.with_(lam=0.01).lam == 0.01


def test_one_loader_reads_old_and_other_programs_run_json() -> None:
    cfg = SimConfig(bursts=("1.5@15+5",), rate_at=("20:0.01",), control="cap", seed=9)
    stored = json.loads(json.dumps(asdict(cfg)))  # as run.json stores it: tuples become lists
    assert SimConfig.from_dict(stored) == cfg
    old = {k: v for k, v in stored.items() if k not in ("retention", "pin_ttl_s", "replicas")}  # an older run
    old["endpoint"] = "http://127.0.0.1:1"  # a driven run's own field
    assert SimConfig.from_dict(old) == cfg
    wl = WorkloadConfig.from_dict(stored)  # what analysis needs to regenerate the sessions
    assert (wl.lam, wl.seed, wl.bursts) == (0.035, 9, ("1.5@15+5",))


def test_control_config_rejects_bad_input_in_one_line() -> None:
    with pytest.raises(UsageError, match="unknown --control"):
        ControlConfig(control="nope").check_control()
    with pytest.raises(UsageError, match="--control-opt"):
        ControlConfig(control="cap", control_opt="K=0.5").control_opts()
    with pytest.raises(UsageError, match="--control-at"):
        ControlConfig(control="cap", control_at=-1.0).check_control()
    ControlConfig(control="budgeter", control_opt=" low=0.6,high=0.9 ").check_control(400_000)


def test_the_recorder_streams_rows_and_finishes_a_loadable_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    rec = Recorder(out)
    nan = math.nan
    rec.turn(TurnRow(2, "base", 0, 0.0, 0.5, nan, nan, 3.0, 1000, None, 50, nan, None, "ok", 0.1), {"attempt": 0})
    rec.session(SessionRow(2, "base", 0.0, 3.0, 1, 1, 0.5, "x"))
    rec.session(SessionRow(1, "base", 0.0, None, 2, 0, None, "x"))
    rec.sample(SampleRow(0.0, 2, -1, -1, -1, 1, -1, nan, 2100, -1, -1, -1))
    rec.error({"session": 1, "kind": "timeout"})
    line = json.loads((out / "turns.jsonl").read_text())
    assert line["cached_tokens"] is None and line["admit_s"] is None and line["attempt"] == 0  # strict JSON
    rec.write_meta({"kind": "test", "partial": True})
    assert load_run(out).turns["prompt_tokens"].tolist() == [1000]  # a partial run loads from its jsonl
    with pytest.raises(UsageError, match="already holds a run"):
        prepare_out(out, force=False, check_only=True)
    rec.finish({"kind": "test", "config": {}}, rec.tables())
    run = load_run(out)
    assert run.sessions["session"].tolist() == [1, 2]  # by session id
    assert not (out / "turns.jsonl").exists() and (out / "errors.jsonl").exists()
    assert math.isnan(run.turns["cached_tokens"][0])


def test_an_in_memory_recorder_writes_nothing(tmp_path: Path) -> None:
    rec = Recorder()
    rec.sample(SampleRow(0.0, 0, 0, 0, 0, 0, 0, 0.0, 0, 0, 100, 0))
    rec.error({"x": 1})
    assert rec.tables()["samples"].num_rows == 1
    assert list(tmp_path.iterdir()) == []


def test_a_batch_resumes_runs_stored_by_an_older_kvgate(tmp_path: Path) -> None:
    from kvgate.sim.job import existing_run

    cfg = SimConfig(minutes=5, bursts=("1.0@1+1",))
    stored = json.loads(json.dumps(asdict(cfg)))
    del stored["replicas"]  # a field added since that run was written
    (tmp_path / "run.json").write_text(json.dumps({"config": stored, "summary": {"x": 1}}))
    assert existing_run(tmp_path, cfg) == {"config": stored, "summary": {"x": 1}}
    assert existing_run(tmp_path, cfg.with_(seed=2)) is None
    (tmp_path / "run.json").write_text("{")
    assert existing_run(tmp_path, cfg) is None


def test_a_stored_config_regenerates_the_run_s_sessions() -> None:
    from kvgate.sim.runner import simulate

    cfg = SimConfig(minutes=15, lam=0.05, bursts=("1.0@5+3",), seed=3)
    res = simulate(cfg)
    specs = sorted(WorkloadConfig.from_dict(json.loads(json.dumps(res.meta["config"]))).session_specs(),
                   key=lambda s: s.sid)
    sess = res.tables["sessions"].to_pydict()
    assert [s.sid for s in specs] == sess["session"]
    assert [s.arrival_s for s in specs] == sess["arrival_s"]
    assert [s.cohort for s in specs] == sess["cohort"] and "trigger" in sess["cohort"]
