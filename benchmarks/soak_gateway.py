"""Soak: `kvgate drive` -> `kvgate gateway` (budgeter) -> `kvgate engine`, all on one scaled clock, for a
given real duration, sampling the gateway's resident memory. Flat memory means no leak per turn or session.

    python3 benchmarks/soak_gateway.py --real-minutes 20 --time-scale 30 [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from tempfile import mkdtemp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_health(port: int) -> None:
    for _ in range(100):
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(port)


def rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024.0
    return float("nan")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--real-minutes", type=float, default=20.0)
    ap.add_argument("--time-scale", type=float, default=30.0)
    ap.add_argument("--lam", type=float, default=0.04)
    ap.add_argument("--every-s", type=float, default=30.0)
    ap.add_argument("--json", type=Path, default=None)
    a = ap.parse_args()
    py = [sys.executable, "-m", "kvgate.cli"]
    ep, gp = free_port(), free_port()
    out = Path(mkdtemp()) / "soak"
    minutes = a.real_minutes * a.time_scale
    procs = []
    try:
        procs.append(subprocess.Popen([*py, "engine", "--port", str(ep), "--time-scale", str(a.time_scale)],
                                      stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        wait_health(ep)
        gw = subprocess.Popen([*py, "gateway", "--upstream", f"http://127.0.0.1:{ep}", "--port", str(gp),
                               "--time-scale", str(a.time_scale), "--log-level", "warning"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(gw)
        wait_health(gp)
        drv = subprocess.Popen([*py, "drive", "--endpoint", f"http://127.0.0.1:{gp}", "--lam", str(a.lam),
                                "--minutes", str(minutes), "--time-scale", str(a.time_scale), "--out", str(out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(drv)
        t0 = time.monotonic()
        rows = []
        while drv.poll() is None:
            rows.append((round((time.monotonic() - t0) / 60, 2), round(rss_mb(gw.pid), 1)))
            print(f"{rows[-1][0]:6.2f} min  gateway RSS {rows[-1][1]:7.1f} MB", flush=True)
            time.sleep(a.every_s)
        with urllib.request.urlopen(f"http://127.0.0.1:{gp}/metrics", timeout=5) as r:
            metrics = r.read().decode()
        demand = [ln for ln in metrics.splitlines() if ln.startswith("kvgate_demand_tokens ")]
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=20)
    half = [r for _, r in rows[len(rows) // 2 :]]
    res = {"real_minutes": a.real_minutes, "simulated_minutes": minutes, "rss_mb": rows,
           "rss_second_half_min_max_mb": [min(half), max(half)] if half else None, "final_demand": demand}
    print(json.dumps({k: v for k, v in res.items() if k != "rss_mb"}))
    if a.json:
        a.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
