"""End to end over loopback, the paper's recovery design through the whole stack: `kvgate drive` →
`kvgate gateway` → `kvgate engine --time-scale N`, as real processes (λ = 0.04, 2× for 4 min at minute 10).
With no control the server collapses; the budgeter switched on at minute 20 brings the hit ratio back; the
budgeter from the start prevents the collapse. CI-sized: 36 simulated minutes at ×45 (KVGATE_E2E_* to change)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.analysis import metrics as m
from kvgate.records import load_run

pytest.importorskip("kvgate.gateway")
pytest.importorskip("kvgate.drive.driver")

from support.ports import free_port, wait_health  # noqa: E402

SCALE = float(os.environ.get("KVGATE_E2E_SCALE", "45"))
MINUTES = float(os.environ.get("KVGATE_E2E_MINUTES", "36"))
ARMS = {"none": ["--control", "none"], "at20": ["--control", "budgeter", "--control-at", "20"],
        "start": ["--control", "budgeter"]}
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("e2e-gw")
    procs: list[subprocess.Popen[bytes]] = []
    drivers, outs = [], {}
    py = [sys.executable, "-m", "kvgate.cli"]
    try:
        for arm, ctl in ARMS.items():
            ep, gp = free_port(), free_port()
            eng = subprocess.Popen([*py, "engine", "--port", str(ep), "--time-scale", str(SCALE)],
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(eng)
            wait_health(ep, eng)
            gw = subprocess.Popen([*py, "gateway", "--upstream", f"http://127.0.0.1:{ep}", "--port", str(gp),
                                   "--time-scale", str(SCALE), "--log-level", "warning", *ctl],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            procs.append(gw)
            wait_health(gp, gw)
            outs[arm] = root / arm
            drivers.append(subprocess.Popen(
                [*py, "drive", "--endpoint", f"http://127.0.0.1:{gp}", "--lam", "0.04", "--burst", "1.0@10+4",
                 "--minutes", str(MINUTES), "--seed", "1", "--time-scale", str(SCALE), "--out", str(outs[arm])],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            ))
        for d in drivers:
            d.wait(timeout=MINUTES * 60 / SCALE + 90)
            assert d.returncode == 0
    finally:
        for p in drivers + procs:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=15)
    return outs


def test_no_control_collapses(runs: dict[str, Path]) -> None:
    r = load_run(runs["none"])
    end = MINUTES * 60
    hit = m.hit_ratio(r.turns, end - 600, end + 1)
    print(f"none: hit ratio over the last 10 min {hit:.3f}")  # (pytest -s shows the figures)
    assert hit < 0.5


def test_budgeter_at_minute_20_recovers(runs: dict[str, Path]) -> None:
    r = load_run(runs["at20"])
    end = MINUTES * 60
    hit = m.hit_ratio(r.turns, end - 600, end + 1)
    before = m.hit_ratio(r.turns, 900.0, 1200.0)
    rec = m.recovery_time(r.turns, 1200.0, end)
    print(f"at20: hit ratio 5 min before the switch {before:.3f}, recovered after {rec} min, last 10 min {hit:.3f}")
    assert hit >= 0.9
    assert rec is not None and rec <= 6


def test_budgeter_from_the_start_prevents_it(runs: dict[str, Path]) -> None:
    r = load_run(runs["start"])
    end = MINUTES * 60
    ok, _ = m.persistent_degradation(r.turns, r.samples, 14 * 60.0, end)
    hit = m.hit_ratio(r.turns, end - 600, end + 1)
    print(f"start: persistently degraded {ok}, hit ratio over the last 10 min {hit:.3f}")
    assert not ok and hit >= 0.9
