"""``kvgate experiment real-vllm``: its design, regime and claim logic (verdicts that can fail), the simulator
runs beside each arm, and, against a real vLLM, ``kvgate calibrate --endpoint`` and the quick experiment."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from kvgate.realvllm import experiment as E

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _row(seed: int, arm: str, hits: list[float], sim_hits: list[float] | None = None) -> dict[str, object]:
    d = E.FULL
    sim_hits = hits if sim_hits is None else sim_hits
    t = [float(i) for i in range(len(hits))]
    real = {"t_min": t, "hit_ratio": hits, "in_system": [5.0] * len(t), "turns_per_s": [1.0] * len(t)}
    sim = {"t_min": t, "hit_ratio": sim_hits, "in_system": [5.0] * len(t), "turns_per_s": [1.0] * len(t)}
    rg, rh = E.regime(real, d)
    sg, sh = E.regime(sim, d)
    err = [b - a for a, b in zip(hits, sim_hits, strict=True)]
    return {"seed": seed, "arm": arm, "real_regime": rg, "real_hit_judged": rh, "sim_regime": sg,
            "sim_hit_judged": sh, "max_abs_minute_error": max(abs(e) for e in err[1:]), "real": real, "sim": sim,
            "error": err}


HEALTHY = [0.8, 0.85, 0.86, 0.87, 0.88]
DEGRADED = [0.8, 0.6, 0.3, 0.25, 0.22]
RECOVERED = [0.8, 0.4, 0.3, 0.8, 0.85]


def test_regime_thresholds() -> None:
    d = E.FULL  # judged from minute 3
    mk = lambda hs: {"t_min": [float(i) for i in range(len(hs))], "hit_ratio": hs}  # noqa: E731
    assert E.regime(mk(HEALTHY), d)[0] == "healthy"
    assert E.regime(mk(DEGRADED), d)[0] == "degraded"
    assert E.regime(mk([0.8, 0.8, 0.8, 0.6, 0.9]), d)[0] == "mixed"
    assert E.regime(mk([0.8, 0.8, 0.8, None, None]), d)[0] == "idle"


def test_claims_hold_on_the_phenomenon() -> None:
    rows = []
    for s in (1, 2, 3):
        rows += [_row(s, "twin", HEALTHY), _row(s, "burst", DEGRADED), _row(s, "budgeter", HEALTHY),
                 _row(s, "budgeter-late", RECOVERED)]
    assert [c["verdict"] for c in E.claims(E.FULL, rows)] == ["holds"] * 5


def test_claims_can_fail() -> None:
    rows = []
    for s in (1, 2, 3):
        rows += [_row(s, "twin", HEALTHY), _row(s, "burst", HEALTHY if s > 1 else DEGRADED),
                 _row(s, "budgeter", DEGRADED if s == 3 else HEALTHY),
                 _row(s, "budgeter-late", DEGRADED, sim_hits=RECOVERED)]
    rows[0] = _row(1, "twin", HEALTHY, sim_hits=[0.8, 0.6, 0.86, 0.87, 0.88])
    c = E.claims(E.FULL, rows)
    assert [x["verdict"] for x in c] == ["fails", "fails", "fails", "fails", "fails"]
    assert "1 of 3 seeds" in c[0]["measured"]


def test_missing_arms_are_not_run_verdicts() -> None:
    c = E.claims(E.FULL, [_row(1, "twin", HEALTHY), _row(1, "burst", DEGRADED)])
    assert [x["verdict"] for x in c][:3] == ["not run", "not run", "not run"]


def test_arm_order_runs_pairs_first() -> None:
    order = E.arm_runs(E.FULL)
    assert len(order) == 12 and len(set(order)) == 12
    assert {a for _, a in order[:6]} == {"twin", "burst"}
    assert E.arm_runs(E.QUICK) == [(1, "twin"), (1, "burst")]


def test_simulated_arms_match_the_design(tmp_path: Path) -> None:
    d = replace(E.QUICK, minutes=1.0)
    trace = tmp_path / "w.jsonl"
    trace.write_text(json.dumps(d.trace_line()) + "\n")
    cfg = E.sim_config(d, 1, "budgeter-late", trace, E.PROFILE)
    assert cfg.block_size == 128 and cfg.kv_pool == d.kv_pool and cfg.max_num_batched_tokens == 2048
    assert cfg.control == "budgeter" and cfg.control_at == d.control_at_min and cfg.bursts == (d.burst,)
    shape = cfg.workload().shapes()[0]
    assert shape.prompt_tokens()[:2] == [4000, 5016] and shape.turns == 12 and shape.shared_tokens == 2000
    assert E.sim_config(d, 1, "twin", trace, E.PROFILE).bursts == ()
    E.run_sim(d, 1, "burst", trace, E.PROFILE, tmp_path / "sim")
    series = E.per_minute(tmp_path / "sim", d.minutes)
    assert series["hit_ratio"][0] is not None


def test_page_is_written_from_results(tmp_path: Path) -> None:
    from kvgate.realvllm.page import write_page

    rows = [_row(1, "twin", HEALTHY), _row(1, "burst", DEGRADED)]
    for r in rows:
        r.update(sessions_arrived=10, sessions_finished=5, in_system_last=3.0, sim_in_system_last=3.0,
                 loadavg_per_min=[1.0], switched_at_min=None)
    from dataclasses import asdict

    res = {"design": asdict(E.FULL), "rows": rows, "claims": E.claims(E.FULL, rows), "profile": E.PROFILE}
    page = write_page(res, tmp_path).read_text()
    assert "| the burst arm is persistently degraded" in page and (tmp_path / "figures" / "seed1.png").exists()


# -- against the real engine -----------------------------------------------------------------------------------
@pytest.mark.real_vllm
def test_calibrate_endpoint_on_the_real_server(real_vllm_server: object, tmp_path: Path) -> None:
    out = tmp_path / "p.json"
    env = dict(os.environ, PYTHONPATH=SRC)
    r = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "calibrate", "--endpoint", real_vllm_server.url, "--quick",  # type: ignore[attr-defined]
         "--max-num-batched-tokens", "2048", "--out", str(out)],
        capture_output=True, text=True, timeout=900, env=env,
    )
    assert r.returncode == 0, r.stderr
    obj = json.loads(out.read_text())
    cal = obj["calibration"]
    assert cal["block_size"] == 128 and obj["kv_pool"] == real_vllm_server.kv_pool  # type: ignore[attr-defined]
    assert all(s["cached"] > 0 for s in cal["samples"] if s["kind"] == "incremental")
    assert cal["load"]["turns"] >= 8


@pytest.mark.real_vllm
@pytest.mark.skipif(os.environ.get("KVGATE_REAL_EXPERIMENT") != "1",
                    reason="the quick real-vLLM experiment takes ~6 minutes: set KVGATE_REAL_EXPERIMENT=1")
def test_quick_experiment_shows_the_phenomenon(real_vllm_model: Path, tmp_path: Path) -> None:
    env = dict(os.environ, PYTHONPATH=SRC)
    r = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "experiment", "real-vllm", "--quick", "--out", str(tmp_path), "--json"],
        capture_output=True, text=True, timeout=1200, env=env,
    )
    assert r.returncode == 0, r.stderr
    claims = json.loads(r.stdout)
    assert claims[0]["verdict"] == "holds", claims
