"""The simulator end to end: determinism, identical base sessions across arms, the closed loop, the CLI."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow as pa
import pytest

from kvgate.records import load_run, write_run
from kvgate.sim.config import SimConfig
from kvgate.sim.runner import simulate
from kvgate.workload.arrivals import generate, parse_burst
from kvgate.workload.shapes import preset

SHORT = SimConfig(lam=0.035, minutes=25, seed=501)


def test_same_config_gives_identical_records() -> None:
    a, b = simulate(SHORT), simulate(SHORT)
    for name in ("turns", "sessions", "samples"):
        assert a.tables[name].equals(b.tables[name]), name


def test_base_sessions_identical_whatever_the_trigger_or_controller() -> None:
    wl = preset("paper-8b")
    base = generate(wl, 0.035, 3600, 7)
    with_burst = generate(wl, 0.035, 3600, 7, [parse_burst("1.5@15+5")])
    assert [s for s in with_burst if s.cohort == "base"] == base
    assert any(s.cohort == "trigger" for s in with_burst)
    # the simulated arms agree on every base session's arrival and shape
    twin = simulate(SHORT)
    trig = simulate(SHORT.with_(bursts=("1.5@15+5",), control="budgeter"))
    tw, tr = twin.tables["sessions"].to_pydict(), trig.tables["sessions"].to_pydict()
    base_tw = {s: a for s, a, c in zip(tw["session"], tw["arrival_s"], tw["cohort"], strict=True) if c == "base"}
    base_tr = {s: a for s, a, c in zip(tr["session"], tr["arrival_s"], tr["cohort"], strict=True) if c == "base"}
    assert base_tw == base_tr


def test_closed_loop_prompts_follow_the_shape() -> None:
    res = simulate(SHORT)
    t = res.tables["turns"].to_pydict()
    by = {}
    for s, k, p, sub, end in zip(t["session"], t["turn"], t["prompt_tokens"], t["submit_s"], t["end_s"], strict=True):
        by[(s, k)] = (p, sub, end)
    for (s, k), (p, sub, _end) in by.items():
        assert p == 6000 + 1300 * k
        if k:
            prev = by[(s, k - 1)]
            assert sub > prev[2]  # the next turn is requested only after the previous one ended (think time)


def test_healthy_run_hits_and_twin_stays_small() -> None:
    s = simulate(SHORT).meta["summary"]
    assert s["hit_ratio_last10"] > 0.9
    assert s["sessions_in_system_last5"] < 15
    assert not s["persistently_degraded"]


def test_records_round_trip(tmp_path: Path) -> None:
    res = simulate(SHORT)
    write_run(tmp_path / "r", res.meta, res.tables)
    run = load_run(tmp_path / "r")
    assert run.summary == json.loads(json.dumps(res.meta["summary"]))
    assert len(run.turns["end_s"]) == res.tables["turns"].num_rows
    assert np.all(run.turns["end_s"] >= run.turns["submit_s"])


def test_unknown_cached_tokens_stay_unknown(tmp_path: Path) -> None:
    res = simulate(SHORT)
    turns = res.tables["turns"]
    col = pa.array([None] * turns.num_rows, type=pa.int64())
    i = turns.schema.get_field_index("cached_tokens")
    tables = dict(res.tables, turns=turns.set_column(i, "cached_tokens", col))
    write_run(tmp_path / "r", res.meta, tables)
    run = load_run(tmp_path / "r")
    assert np.isnan(run.turns["cached_tokens"]).all()
    from kvgate.analysis.metrics import hit_ratio

    assert np.isnan(hit_ratio(run.turns, 0, 1e9))


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgate.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["sim", "--preset", "nope"], "unknown preset"),
        (["sim", "--profile", "nope"], "unknown profile"),
        (["sim", "--burst", "1.5at15"], "malformed burst"),
        (["sim", "--lam", "-1"], "negative arrival rate"),
        (["sim", "--kv-pool", "1000"], "smaller than one session"),
        (["sim", "--control", "nope"], "unknown"),
        (["paired", "--seeds", "5-1", "--burst", "1@1+1"], "malformed seeds"),
        (["sim", "--minutes", "abc"], "abc"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(args: list[str], needle: str) -> None:
    p = _cli(*args)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr
    assert "Traceback" not in p.stderr


def test_malformed_trace_names_the_line(tmp_path: Path) -> None:
    f = tmp_path / "t.jsonl"
    f.write_text('{"id": "a", "initial": 3000, "outputs": [10, 10], "appends": [5], "gaps": [1.0]}\n{"id": \n')
    p = _cli("sim", "--trace", str(f), "--minutes", "5")
    assert p.returncode == 2
    assert ":2:" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_sim_json_has_the_summary_fields() -> None:
    p = _cli("sim", "--minutes", "20", "--json")
    assert p.returncode == 0, p.stderr
    s = json.loads(p.stdout)
    for k in ("hit_ratio_last10", "sessions_in_system_last5", "turns_per_s_last10", "persistently_degraded",
              "degraded_from_min", "preemptions", "sessions_arrived", "sessions_finished", "wall_s"):
        assert k in s


def test_client_timeouts_abort_retry_and_give_up() -> None:
    """An attempt that cannot finish within the agent's timeout is aborted and retried; after the last retry the
    agent gives up and its session leaves the system (nothing of it stays on the engine)."""
    from kvgate.sim.config import SimConfig
    from kvgate.sim.runner import simulate

    # a 6K-token cold prefill takes ~0.5 s on the 8B profile: a 0.05 s timeout can never be met
    cfg = SimConfig(lam=0.02, minutes=10, seed=3, client_timeout_s=0.05, client_retries=2, retry_backoff_s=1.0)
    res = simulate(cfg)
    turns = res.tables["turns"].to_pydict()
    sessions = res.tables["sessions"].to_pydict()
    n = len(sessions["session"])
    assert n > 3
    assert res.meta["sessions_abandoned"] == n
    assert res.meta["client_timeouts"] == 3 * n and res.meta["client_retries"] == 2 * n
    assert set(turns["status"]) == {"aborted"} and len(turns["status"]) == 3 * n
    assert all(t == 0 for t in turns["turn"])
    assert all(e is None for e in sessions["end_s"])
    samples = res.tables["samples"].to_pydict()
    assert samples["in_system"][-1] == 0 and samples["running"][-1] == 0


def test_client_timeouts_are_off_by_default_and_generous_ones_change_nothing() -> None:
    from kvgate.sim.config import SimConfig
    from kvgate.sim.runner import simulate

    cfg = SimConfig(lam=0.035, minutes=30, seed=11)
    a = simulate(cfg).meta["summary"]
    b = simulate(cfg.with_(client_timeout_s=3600.0, client_retries=2)).meta["summary"]
    a.pop("wall_s")
    b.pop("wall_s")
    assert a == b


def test_retries_through_the_gateway_keep_held_turns_and_count_once() -> None:
    """With the budgeter, a timed-out held turn keeps its place and a cancelled one asks again: every session
    either finishes or is abandoned, and D never exceeds what the admitted sessions hold (it ends at 0)."""
    from kvgate.sim.config import SimConfig
    from kvgate.sim.runner import simulate

    cfg = SimConfig(lam=0.04, minutes=60, seed=2, bursts=("1.0@10+4",), control="budgeter", kv_pool=200_000,
                    client_timeout_s=30.0, client_retries=3)
    res = simulate(cfg)
    m = res.meta
    assert m["client_timeouts"] > 0 and m["parks"] > 0
    s = res.tables["samples"].to_pydict()
    for d, a, pool in zip(s["admitted_demand_tokens"], s["demand_tokens"], s["kv_pool"], strict=True):
        assert 0 <= d <= a  # admitted demand is part of the demand of all sessions in the system
        assert pool == 200_000
