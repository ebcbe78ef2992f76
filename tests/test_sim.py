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
from kvgate.sim.runner import SimConfig, simulate
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
