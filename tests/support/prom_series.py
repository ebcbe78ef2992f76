"""Record the Prometheus series a kvgate gateway exports in a driven run, for `promtool test rules`.

    python3 tests/support/prom_series.py [--out tests/data/gateway-series.json]

`kvgate drive` -> `kvgate gateway` -> `kvgate engine`, all on one clock scaled ×30: λ = 0.04 with a 2× burst
for 4 minutes at minute 10 and no control, so the server collapses; the budgeter is switched on at minute 22
through the admin API (recovery, then sustained parking); the engine is killed at minute 44 (upstream errors).
The gateway's /metrics is scraped once per gateway minute. The file holds, per scrape, the gateway minute and
every sample of the kvgate_* families (name, labels, value); tests/gateway/test_prometheus_rules.py turns it into
promtool's input series. Committed output: tests/data/gateway-series.json.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parents[1]
DEFAULT_OUT = HERE / "data" / "gateway-series.json"
SCALE = 30.0
MINUTES = 54
CONTROL_AT = 22
KILL_AT = 44


def scrape(port: int) -> list[tuple[str, dict[str, str], float]]:
    from prometheus_client.parser import text_string_to_metric_families

    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
        text = r.read().decode()
    out = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("kvgate_") and not s.name.endswith("_created"):
                out.append((s.name, dict(s.labels), float(s.value)))
    return out


def post(port: int, path: str, body: dict[str, Any]) -> None:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", data=json.dumps(body).encode(),
                                 headers={"Content-Type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=5):
        pass


PY = [sys.executable, "-m", "kvgate.cli"]


def start_stack(procs: list[subprocess.Popen[bytes]], scale: float) -> tuple[subprocess.Popen[bytes], int]:
    """`kvgate engine` and `kvgate gateway --control none` on one scaled clock; appends both to ``procs``
    (the caller stops them) and returns the engine process and the gateway's port."""
    from support.ports import free_port, wait_health

    ep, gp = free_port(), free_port()
    eng = subprocess.Popen([*PY, "engine", "--port", str(ep), "--time-scale", str(scale)],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs.append(eng)
    wait_health(ep, eng)
    gw = subprocess.Popen([*PY, "gateway", "--upstream", f"http://127.0.0.1:{ep}", "--port", str(gp),
                           "--time-scale", str(scale), "--control", "none", "--log-level", "warning"],
                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs.append(gw)
    wait_health(gp, gw)
    return eng, gp


def drive(procs: list[subprocess.Popen[bytes]], gp: int, scale: float, minutes: float, out: Path,
          *extra: str) -> subprocess.Popen[bytes]:
    """`kvgate drive` at λ = 0.04 with a 2x burst for 4 minutes at minute 10 (a collapse without control)."""
    drv = subprocess.Popen([*PY, "drive", "--endpoint", f"http://127.0.0.1:{gp}", "--lam", "0.04", "--burst",
                            "1.0@10+4", "--minutes", str(minutes), "--seed", "1", "--time-scale", str(scale),
                            "--out", str(out), *extra],
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    procs.append(drv)
    return drv


def record(out: Path, scale: float = SCALE, minutes: int = MINUTES) -> dict[str, Any]:
    procs: list[subprocess.Popen[bytes]] = []
    scrapes: list[dict[str, Any]] = []
    try:
        eng, gp = start_stack(procs, scale)
        t0 = time.monotonic()
        drive(procs, gp, scale, minutes, out.parent / ".series-run", "--retries", "1")
        for minute in range(minutes + 1):
            due = t0 + minute * 60.0 / scale
            time.sleep(max(0.0, due - time.monotonic()))
            if minute == CONTROL_AT:
                post(gp, "/admin/control", {"control": "budgeter"})
            if minute == KILL_AT:
                eng.kill()
            scrapes.append({"minute": minute, "samples": scrape(gp)})
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=20)
    data = {"scale": scale, "minutes": minutes, "control_at": CONTROL_AT, "kill_at": KILL_AT, "scrapes": scrapes}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(data, separators=(",", ":")) + "\n")
    return data


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    a = ap.parse_args()
    sys.path.insert(0, str(HERE))
    d = record(a.out)
    print(f"{len(d['scrapes'])} scrapes written to {a.out}")


if __name__ == "__main__":
    main()
