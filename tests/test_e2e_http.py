"""End to end over loopback: `kvgate drive` against `kvgate engine --time-scale N`, both as real processes,
compared with the in-process simulator on the same seed (a CI-sized version of the paired HTTP run)."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from kvgate.records import load_run
from kvgate.sim.config import SimConfig
from kvgate.sim.runner import simulate

pytest.importorskip("kvgate.http.driver")
pytest.importorskip("kvgate.http.engine_server")

# CI-sized by default; KVGATE_E2E_MINUTES=45 KVGATE_E2E_SCALE=30 runs the full-size check of docs/driver.md
SCALE = float(os.environ.get("KVGATE_E2E_SCALE", "45"))
MINUTES = float(os.environ.get("KVGATE_E2E_MINUTES", "36"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _wait_health(port: int, proc: subprocess.Popen[bytes], timeout: float = 20.0) -> None:
    import urllib.request

    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError("engine exited early")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError("engine did not become healthy")


@pytest.fixture(scope="module")
def pair(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("e2e")
    engines, drivers, outs = [], [], {}
    try:
        for arm, burst in (("twin", []), ("burst", ["--burst", "1.5@15+5"])):
            port = _free_port()
            eng = subprocess.Popen(
                [sys.executable, "-m", "kvgate.cli", "engine", "--port", str(port), "--time-scale", str(SCALE)],
                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            )  # fmt: skip
            engines.append(eng)
            _wait_health(port, eng)
            outs[arm] = root / arm
            drivers.append(subprocess.Popen(
                [sys.executable, "-m", "kvgate.cli", "drive", "--endpoint", f"http://127.0.0.1:{port}",
                 "--preset", "paper-8b", "--lam", "0.035", "--minutes", str(MINUTES), "--seed", "501",
                 "--time-scale", str(SCALE), "--out", str(outs[arm]), "--json", *burst],
                stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
            ))  # fmt: skip
        for d in drivers:
            d.wait(timeout=MINUTES * 60 / SCALE + 60)
            assert d.returncode == 0
    finally:
        for p in drivers + engines:
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=10)
    return outs


def test_http_pair_collapses_the_burst_arm_only(pair: dict[str, Path]) -> None:
    twin, burst = load_run(pair["twin"]).summary, load_run(pair["burst"]).summary
    assert twin["hit_ratio_last10"] > 0.9
    assert burst["hit_ratio_last10"] < 0.5
    assert burst["sessions_in_system_last5"] > 2 * twin["sessions_in_system_last5"]


def test_http_records_agree_with_the_in_process_simulator(pair: dict[str, Path]) -> None:
    for arm, bursts in (("twin", ()), ("burst", ("1.5@15+5",))):
        http = load_run(pair[arm]).summary
        sim = simulate(SimConfig(lam=0.035, minutes=MINUTES, seed=501, bursts=bursts)).meta["summary"]
        assert abs(http["hit_ratio_all"] - sim["hit_ratio_all"]) <= 0.05, (arm, http, sim)
        assert http["sessions_in_system_last5"] == pytest.approx(sim["sessions_in_system_last5"], rel=0.2), arm
        keys = ("hit_ratio_all", "hit_ratio_last10", "sessions_in_system_last5")
        print(arm, "http", [http[k] for k in keys], "sim", [sim[k] for k in keys])
