"""A fleet over HTTP, as real processes: ``kvgate drive`` → ``kvgate gateway`` (3 upstreams, the kvgate router) →
3 × ``kvgate engine``, all on one scaled clock; one engine is killed (SIGKILL) mid-run.

Checked from outside, through the gateway's own endpoints: it marks the killed replica down (``/metrics``), its
sessions are placed anew (none is left on it), every session the driver started finishes with no failed turn, D_r
equals the true admitted sum on every replica before the kill, after it and at the end (``GET /v1/sessions``
answers the books and the sessions at one instant), and the gateway's tasks and upstream connections in use return
to their baseline. CI-sized: short agent sessions (a trace written here), arrivals for one minute, 3 virtual
minutes at ×30; no timing assertions (waits are bounded, never measured).
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvgate.records import load_run
from kvgate.workload.shapes import SessionShape
from kvgate.workload.trace import write_shapes
from support.ports import free_port, wait_health
from support.wait import until

pytest.importorskip("kvgate.drive.driver")

SCALE = 30.0
MINUTES = 3.0
POOL = 1024
"""Each engine's KV pool: a few short sessions fill a replica's budget, so the per-replica books matter."""
PY = [sys.executable, "-m", "kvgate.cli"]


def _get(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        body = r.read()
    return json.loads(body) if path != "/metrics" else body.decode()


def _replica_gauge(port: int, name: str) -> dict[str, float]:
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for fam in text_string_to_metric_families(_get(port, "/metrics")):
        for s in fam.samples:
            if s.name == name:
                out[s.labels["replica"]] = s.value
    return out


def _check_books(gp: int) -> dict[str, Any]:
    """D_r against the true admitted sum per replica, from one ``GET /v1/sessions`` (books and sessions at one
    instant); also every session known to a policy sits on a replica that is up."""
    listing = _get(gp, "/v1/sessions")
    up = {r["replica"]: r["up"] for r in listing["replicas"]}
    for r in listing["replicas"]:
        true = sum(s["demand_tokens"] for s in listing["data"]
                   if s["replica"] == r["replica"] and s["state"] in ("running", "thinking"))
        assert r["demand_tokens"] == true, (r, listing["data"])
    for s in listing["data"]:
        if s["state"] not in ("new",):
            assert up[s["replica"]], s
    return listing


def test_a_fleet_survives_a_killed_replica(tmp_path: Path) -> None:
    trace = tmp_path / "short.jsonl"
    write_shapes([SessionShape(64, 192, (16, 16, 16, 16), (32, 32, 32), gaps=(2.0, 2.0, 2.0), source=f"s{i}")
                  for i in range(8)], trace)
    procs: list[subprocess.Popen[bytes]] = []
    try:
        eps = [free_port() for _ in range(3)]
        for ep in eps:
            procs.append(subprocess.Popen([*PY, "engine", "--port", str(ep), "--time-scale", str(SCALE),
                                           "--kv-pool", str(POOL)],
                                          stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        engines = list(procs)
        for ep, proc in zip(eps, engines, strict=True):
            wait_health(ep, proc)
        urls = [f"http://127.0.0.1:{ep}" for ep in eps]
        gp = free_port()
        gw = subprocess.Popen([*PY, "gateway", *(a for u in urls for a in ("--upstream", u)), "--port", str(gp),
                               "--time-scale", str(SCALE), "--health-interval", "0.2", "--log-level", "warning"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(gw)
        wait_health(gp, gw)
        info = _get(gp, "/kvgate/info")
        assert info["router"] == "kvgate" and [r["kv_pool"] for r in info["replicas"]] == [POOL] * 3
        base_tasks = info["tasks"]
        out = tmp_path / "run"
        drv = subprocess.Popen([*PY, "drive", "--endpoint", f"http://127.0.0.1:{gp}", "--trace", str(trace),
                                "--lam", "0.5", "--rate-at", "1:0", "--minutes", str(MINUTES), "--seed", "2",
                                "--time-scale", str(SCALE), "--out", str(out)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(drv)

        # phase 1: the fleet serves; the victim holds sessions
        victim = urls[1]

        def victim_busy() -> bool:
            listing = _check_books(gp)
            on_victim = sum(1 for s in listing["data"] if s["replica"] == victim)
            return on_victim >= 2 and listing["summary"]["admitted"] >= 4

        until(victim_busy, "sessions on replica 1")
        engines[1].send_signal(signal.SIGKILL)
        engines[1].wait(timeout=10)

        # phase 2: marked down (its health check fails, or a turn's connection does), its sessions placed anew
        until(lambda: _replica_gauge(gp, "kvgate_replica_up")[victim] == 0, "replica 1 marked down")
        assert _replica_gauge(gp, "kvgate_replica_downs_total")[victim] >= 1  # (a slow check may have too, before)
        assert _replica_gauge(gp, "kvgate_replica_kv_pool_tokens") == dict.fromkeys(urls, float(POOL))
        until(lambda: all(s["replica"] != victim for s in _check_books(gp)["data"]), "replica 1 emptied")
        assert _replica_gauge(gp, "kvgate_replica_demand_tokens")[victim] == 0
        info = _get(gp, "/kvgate/info")
        assert info["sessions_replaced"] + info["retried_turns"] > 0 and info["upstream"]["kv_pool"] == 2 * POOL
        print(
            f"replica 1 killed: {info['sessions_replaced']} sessions placed anew, {info['retried_turns']} turns "
            f"retried elsewhere"
        )  # (pytest -s shows the figures)

        # phase 3: the drive ends; every session finished, no turn failed
        assert drv.wait(timeout=MINUTES * 60 / SCALE + 60) == 0
        run = load_run(out)
        s = run.summary
        assert s["turns_error"] == 0, s
        assert s["sessions_arrived"] > 10 and s["sessions_finished"] == s["sessions_arrived"], s
        assert s["turns_done"] == 4 * s["sessions_arrived"]
        print(f"{s['sessions_arrived']} sessions, {s['turns_done']} turns, {s['parks']} parks")
        listing = _check_books(gp)
        assert listing["summary"]["in_flight"] == 0 and listing["summary"]["held"] == 0
        assert all(s["replica"] != victim for s in listing["data"])
        demand = _replica_gauge(gp, "kvgate_replica_demand_tokens")
        assert demand == {r["replica"]: r["demand_tokens"] for r in listing["replicas"]}
        # no leaks: the gateway's tasks back to their baseline, no upstream connection in use, none to the dead one
        until(lambda: _get(gp, "/kvgate/info")["tasks"] == base_tasks, "the gateway's tasks back to baseline")
        # (a health check every 0.2 s holds a survivor's connection while it is in flight: a leak is one that stays)
        def conns() -> dict[str, dict[str, int]]:
            return {r["replica"]: r["connections"] for r in _get(gp, "/kvgate/info")["replicas"]}

        until(lambda: all(c["acquired"] == 0 for c in conns().values()), "no upstream connection in use", timeout=10)
        assert conns()[victim] == {"acquired": 0, "idle": 0}
        # the survivors are up (one a busy machine's slow health check took down is back at its next check)
        until(lambda: [r["up"] for r in _get(gp, "/kvgate/info")["replicas"]] == [True, False, True], "survivors up")
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=15)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait()
