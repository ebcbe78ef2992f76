"""``kvgate experiment real-sglang``: the real-vLLM design on SGLang, the simulated SGLang beside each arm, its page;
against a real SGLang, ``kvgate calibrate --endpoint`` and (opt-in) the quick experiment.

The regime and claim logic is the real-vLLM experiment's (``test_real_vllm_experiment.py`` shows its verdicts can
fail); here, what is SGLang's: the simulated arms run kvgate's SGLang engine with the calibrated profile, the design
chosen with it predicts the phenomenon, and the page says it is SGLang's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import asdict, replace
from pathlib import Path

import pytest

from kvgate.realsglang import experiment as X
from kvgate.realvllm import experiment as E

SRC = str(Path(__file__).resolve().parents[2] / "src")


def test_simulated_arms_are_sglangs(tmp_path: Path) -> None:
    d = replace(X.QUICK, minutes=1.0)
    trace = tmp_path / "w.jsonl"
    trace.write_text(json.dumps(d.trace_line()) + "\n")
    cfg = E.sim_config(d, 1, "budgeter-late", trace, X.PROFILE, engine=X.ENGINE)
    assert cfg.engine == "sglang" and cfg.block_size == 1 and cfg.kv_pool == d.kv_pool
    assert cfg.max_num_batched_tokens == 2048 and cfg.control == "budgeter" and cfg.control_at == d.control_at_min
    E.run_sim(d, 1, "burst", trace, X.PROFILE, tmp_path / "sim", engine=X.ENGINE)
    run = json.loads((tmp_path / "sim" / "run.json").read_text())
    assert run["config"]["engine"] == "sglang" and run["config"]["profile"] == X.PROFILE


def test_the_design_predicts_the_phenomenon_on_the_simulated_sglang(tmp_path: Path) -> None:
    """Chosen before the real runs: with the calibrated profile the simulated burst arm collapses, its twin and the
    budgeter arm stay healthy, the budgeter switched on late brings it back (a prediction, not a measurement)."""
    d = X.FULL
    trace = tmp_path / "w.jsonl"
    trace.write_text(json.dumps(d.trace_line()) + "\n")
    regimes = {}
    for arm in d.arms:
        E.run_sim(d, 1, arm, trace, X.PROFILE, tmp_path / arm, engine=X.ENGINE)
        regimes[arm] = E.regime(E.per_minute(tmp_path / arm, d.minutes), d)[0]
    assert regimes == {"twin": "healthy", "burst": "degraded", "budgeter": "healthy", "budgeter-late": "healthy"}


def test_page_is_sglangs(tmp_path: Path) -> None:
    from kvgate.realvllm.page import write_page

    t = [0.0, 1.0, 2.0]
    series = {"t_min": t, "hit_ratio": [0.8, 0.3, 0.2], "in_system": [5.0] * 3, "turns_per_s": [1.0] * 3}
    rows = [{"seed": 1, "arm": "burst", "real_regime": "degraded", "real_hit_judged": 0.2, "sim_regime": "degraded",
             "sim_hit_judged": 0.2, "max_abs_minute_error": 0.0, "real": series, "sim": series, "error": [0.0] * 3,
             "sessions_arrived": 9, "sessions_finished": 3, "in_system_last": 6.0, "sim_in_system_last": 6.0}]
    res = {"design": asdict(X.QUICK), "rows": rows, "claims": E.claims(X.QUICK, rows), "profile": X.PROFILE,
           "quick": True}
    page = write_page(res, tmp_path, X.intro(res), engine="real SGLang (CPU)").read_text()
    assert page.startswith("# The paper's phenomenon on a real SGLang (CPU engine) — quick version")
    assert "sglang.launch_server" in page and X.PROFILE in page and "vLLM 0.32.0's CPU build" not in page
    assert (tmp_path / "figures" / "seed1.png").exists()


# -- against the real server ---------------------------------------------------------------------------------------
@pytest.mark.real_sglang
def test_calibrate_endpoint_on_the_real_sglang(real_sglang_server: object, tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    r = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "calibrate", "--endpoint", real_sglang_server.url, "--quick",  # type: ignore[attr-defined]
         "--out", str(out)],
        capture_output=True, text=True, timeout=900, env=dict(os.environ, PYTHONPATH=SRC),
    )
    assert r.returncode == 0, r.stderr
    obj = json.loads(out.read_text())
    cal = obj["calibration"]
    assert cal["engine"] == "sglang" and cal["block_size"] == 1
    assert obj["kv_pool"] == real_sglang_server.kv_pool  # type: ignore[attr-defined]
    assert obj["kv_bytes_per_token"] == 1  # SGLang says 0.016 GB: too coarse to tell the bytes per token (unknown)
    assert not any(s["kind"] == "mixed" for s in cal["samples"])  # SGLang never mixes prefill and decode
    assert all(s["cached"] > 0 for s in cal["samples"] if s["kind"] == "incremental")
    assert cal["load"]["turns"] >= 8


@pytest.mark.real_sglang
@pytest.mark.skipif(os.environ.get("KVGATE_REAL_EXPERIMENT") != "1",
                    reason="the quick real-SGLang experiment takes ~6 minutes: set KVGATE_REAL_EXPERIMENT=1")
def test_quick_experiment_on_the_real_sglang(real_sglang_model: Path, tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "experiment", "real-sglang", "--quick", "--out", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=1200, env=dict(os.environ, PYTHONPATH=SRC),
    )
    assert r.returncode == 0, r.stderr
    claims = json.loads(r.stdout)
    assert claims[0]["verdict"] == "holds", claims
