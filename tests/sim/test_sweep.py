"""Sweeps, the phase map and escape times: specs, resumable grids, and the estimators on known data."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

import numpy as np
import pyarrow.parquet as pq
import pytest

from kvgate.analysis.escape import exponential_mean, kaplan_meier, poisson_estimate
from kvgate.analysis.phase import PhaseSpec, expectations
from kvgate.errors import UsageError
from kvgate.sim.sweep import from_flags, from_mapping, run_id, run_sweep


def test_grid_is_the_product_in_order() -> None:
    sw = from_mapping({"base": {"minutes": 30}, "grid": {"lam": [0.03, 0.04], "bursts": ["", "1.5@15+5"],
                                                         "seed": "1-3"}})
    runs = sw.runs()
    assert sw.size == len(runs) == 12
    assert runs[0][2].lam == 0.03 and runs[0][2].bursts == () and runs[0][2].seed == 1
    assert runs[-1][2].lam == 0.04 and runs[-1][2].bursts == ("1.5@15+5",) and runs[-1][2].seed == 3
    assert all(cfg.minutes == 30 for _, _, cfg in runs)
    assert len({rid for rid, _, _ in runs}) == 12
    assert run_id({"lam": 0.035, "bursts": ("1.5@15+5",), "seed": 3}) == "lam=0.035/bursts=1.5@15+5/seed=3"


def test_flags_type_values_by_field() -> None:
    sw = from_flags(None, ["minutes=45", "kv_pool=500000", "prefix_caching=false"],
                    ["lam=0.03,0.035", "seed=1-2", "control=none,budgeter"])
    cfg = sw.runs()[0][2]
    assert cfg.minutes == 45.0 and isinstance(cfg.minutes, float)
    assert cfg.kv_pool == 500000 and cfg.prefix_caching is False
    assert sw.size == 8


@pytest.mark.parametrize(
    "spec, msg",
    [
        ({"grid": {"lamda": [0.03]}}, "unknown config field 'lamda'"),
        ({"grid": {"lam": []}}, "lam has no values"),
        ({"base": {"minutes": "long"}}, "minutes takes a number"),
        ({"base": {"prefix_caching": 1}}, "prefix_caching takes true or false"),
        ({"runs": {}}, "unknown section"),
    ],
)
def test_bad_specs_are_one_line_errors(spec: dict, msg: str) -> None:
    with pytest.raises(UsageError, match=msg):
        from_mapping(spec)


def test_sweep_writes_one_row_per_run_and_resumes(tmp_path: Path) -> None:
    sw = from_mapping({"base": {"minutes": 20}, "grid": {"lam": [0.02, 0.03], "seed": [1, 2]}})
    t1 = run_sweep(sw, tmp_path, progress=False)
    assert t1.num_rows == 4
    assert t1.column("run").to_pylist() == [rid for rid, _, _ in sw.runs()]
    assert t1.column("lam").to_pylist() == [0.02, 0.02, 0.03, 0.03]
    assert "s_hit_ratio_all" in t1.column_names and "s_persistently_degraded" in t1.column_names
    stamps = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("run.json")}
    t2 = run_sweep(sw, tmp_path, progress=False)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("run.json")} == stamps  # nothing re-ran
    assert pq.read_table(tmp_path / "sweep.parquet").to_pylist() == t2.to_pylist()


def test_sweep_command_reports_bad_input_in_one_line(tmp_path: Path) -> None:
    bad = tmp_path / "s.toml"
    bad.write_text("[grid]\nlam = [0.03\n")
    r = subprocess.run([sys.executable, "-m", "kvgate.cli", "sweep", str(bad), "--out", str(tmp_path / "o")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.startswith("kvgate: error:") and "Traceback" not in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_kaplan_meier_matches_a_hand_computation() -> None:
    # times 1, 2(censored), 3, 3, 4(censored): S(1) = 4/5, S(3) = 4/5 * (1 - 2/3) = 4/15
    xs, ys = kaplan_meier([1, 2, 3, 3, 4], [True, False, True, True, False])
    assert xs.tolist() == [1.0, 3.0]
    assert np.allclose(ys, [0.8, 4 / 15])


def test_exponential_mean_and_its_interval() -> None:
    rng = np.random.default_rng(3)
    true_mean = 50.0
    t = rng.exponential(true_mean, 4000)
    cens = np.minimum(t, 120.0)
    mean, lo, hi, d, _ = exponential_mean(cens, t < 120.0)
    assert lo < true_mean < hi
    assert abs(mean - true_mean) / true_mean < 0.05
    assert d == int((t < 120.0).sum())
    mean0, lo0, hi0, d0, _ = exponential_mean([60.0] * 10, [False] * 10)
    assert d0 == 0 and mean0 == math.inf and hi0 == math.inf and lo0 > 0


def test_poisson_estimate_falls_as_load_rises() -> None:
    slow = poisson_estimate(0.03, 250.0, 18.5)
    fast = poisson_estimate(0.045, 250.0, 18.5)
    assert fast < slow < math.inf


def test_phase_expectations_can_fail() -> None:
    spec = PhaseSpec(lams=(0.01, 0.03, 0.04), bursts=(0.0, 1.5), seeds=(1, 2))
    bounds = {None: {"drain_lam": 0.013, "healthy_lam": 0.09, "warm_lam": 0.045}}
    good = {(None, 0.01, 0.0): [False, False], (None, 0.01, 1.5): [False, False],
            (None, 0.03, 0.0): [False, False], (None, 0.03, 1.5): [True, False],
            (None, 0.04, 0.0): [False, True], (None, 0.04, 1.5): [True, True]}
    assert [c["met"] for c in expectations(spec, good, bounds)] == [True, True, True]
    bad = dict(good)
    bad[(None, 0.01, 1.5)] = [True, True]  # collapsed below the drain bound
    bad[(None, 0.03, 1.5)] = [False, False]
    bad[(None, 0.04, 1.5)] = [False, False]  # bursts no worse than their twins
    bad[(None, 0.04, 0.0)] = [False, False]  # no rise with λ
    assert [c["met"] for c in expectations(spec, bad, bounds)] == [False, False, False]
