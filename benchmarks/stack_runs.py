"""Helpers of the driven-stack experiments (``lineage_recovery.py``, ``restart_gateway.py``): ``kvgate engine``,
``kvgate gateway`` and ``kvgate drive`` as processes on loopback, one scaled clock, each stopped by its PID."""

from __future__ import annotations

import contextlib
import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
PY = [sys.executable, "-m", "kvgate.cli"]
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT / "src"), os.environ.get("PYTHONPATH"))
                                                   if p)}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def get_json(url: str, timeout: float = 2.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return json.loads(r.read())


def wait_up(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if proc.poll() is not None:
            raise RuntimeError(f"{proc.args} exited with {proc.returncode} before answering {url}")
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return
        except OSError:
            time.sleep(0.1)
    raise TimeoutError(f"{url} did not answer within {timeout} s")


def spawn(args: list[str], log: Path) -> subprocess.Popen[bytes]:
    log.parent.mkdir(parents=True, exist_ok=True)
    f = open(log, "ab")  # noqa: SIM115 - lives as long as the process
    return subprocess.Popen([*PY, *args], env=ENV, stdout=f, stderr=subprocess.STDOUT)


def stop(proc: subprocess.Popen[bytes] | None, sig: int = signal.SIGTERM, timeout: float = 20.0) -> None:
    """Stop one process we started, by its PID."""
    if proc is None or proc.poll() is not None:
        return
    proc.send_signal(sig)
    try:
        proc.wait(timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout)


def kept_result(done: Path, run: Path, **want: Any) -> dict[str, Any] | None:
    """A finished run's stored result when its driver ran with ``want`` (keys of the config ``kvgate drive``
    recorded in ``run/run.json``: time_scale, minutes, seed, ...); None when it must run (again)."""
    if not done.exists() or not (run / "run.json").exists():
        return None
    cfg = json.loads((run / "run.json").read_text()).get("config", {})
    if any(cfg.get(k) != v for k, v in want.items()):
        return None
    return dict(json.loads(done.read_text()))


@contextlib.contextmanager
def engine(scale: float, log: Path, *args: str) -> Iterator[int]:
    port = free_port()
    p = spawn(["engine", "--port", str(port), "--time-scale", str(scale), *args], log)
    try:
        wait_up(f"http://127.0.0.1:{port}/health", p)
        yield port
    finally:
        stop(p)


def gateway_args(up: int, port: int, scale: float, *args: str) -> list[str]:
    return ["gateway", "--upstream", f"http://127.0.0.1:{up}", "--port", str(port), "--time-scale", str(scale),
            "--log-level", "warning", *args]


def drive_args(port: int, out: Path, scale: float, *args: str) -> list[str]:
    return ["drive", "--endpoint", f"http://127.0.0.1:{port}", "--time-scale", str(scale), "--out", str(out),
            "--force", "--json", *args]


def regime(out: Path, control_s: float | None, end_s: float) -> dict[str, Any]:
    """A driven run's outcome: hit ratios before the control and over the last 10 minutes, recovery, whether it
    was persistently degraded from the control's start (or the trigger's end)."""
    from kvgate.analysis import metrics as m
    from kvgate.records import load_run

    r = load_run(out)
    t = r.turns
    align = control_s if control_s is not None else 0.0
    degraded, since = m.persistent_degradation(t, r.samples, align, end_s)
    last10 = m.hit_ratio(t, end_s - 600, end_s + 1)
    out_d: dict[str, Any] = {"hit_last10": _r(last10), "persistently_degraded": bool(degraded),
                             "turns_done": int(m.turns_done(t, 0, end_s + 1))}
    if control_s is not None:
        out_d["hit_before_control"] = _r(m.hit_ratio(t, control_s - 300, control_s))
        out_d["collapsed_at_control"] = bool(out_d["hit_before_control"] is not None
                                             and out_d["hit_before_control"] < 0.5)
        rec = m.recovery_time(t, control_s, end_s)
        out_d["recovered_min"] = rec
    out_d["healthy_at_end"] = bool(last10 == last10 and last10 >= 0.8)
    return out_d


def _r(x: float, nd: int = 3) -> float | None:
    return None if x is None or (isinstance(x, float) and math.isnan(x)) else round(float(x), nd)
