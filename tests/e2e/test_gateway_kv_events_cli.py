"""As processes: ``kvgate gateway --router prefix-affinity --control budgeter-resident --kv-events ...`` in front
of 2 × ``kvgate engine --kv-events-config`` (replica 0 in the older positional arrays, which name no session;
replica 1 in vLLM's tagged maps, with session ids), on loopback TCP. A session the gateway has never seen, whose
earlier turn went straight to replica 1, is placed there; the gateway's ``/metrics`` and ``GET /v1/sessions`` show
what each replica's events say it holds.
Bounded waits only; every process is stopped by the test."""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
import urllib.request
from typing import Any

from support.ports import free_port, wait_health
from support.wait import until

PY = [sys.executable, "-m", "kvgate.cli"]


def _post(url: str, sid: str, prompt: list[int]) -> None:
    body = json.dumps({"model": "Qwen/Qwen3-8B", "prompt": prompt, "max_tokens": 8}).encode()
    req = urllib.request.Request(url + "/v1/completions", body, {"Content-Type": "application/json",
                                                                  "X-Session-ID": sid})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200
        r.read()


def _get(url: str) -> Any:
    with urllib.request.urlopen(url, timeout=10) as r:
        body = r.read()
    return body.decode() if url.endswith("/metrics") else json.loads(body)


def test_gateway_follows_engines_kv_events_from_the_command_line() -> None:
    procs: list[subprocess.Popen[bytes]] = []
    try:
        ports = [free_port() for _ in range(2)]
        events = [(free_port(), free_port()) for _ in range(2)]
        for (port, (pub, rep)), enc in zip(zip(ports, events, strict=True), ("array", "map"), strict=True):
            cfg = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
                   "replay_endpoint": f"tcp://*:{rep}"}
            procs.append(subprocess.Popen([*PY, "engine", "--port", str(port), "--time-scale", "1000", "--kv-pool",
                                           "8192", "--kv-events-config", json.dumps(cfg), "--kv-events-encoding",
                                           enc], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
        for port, proc in zip(ports, procs, strict=True):
            wait_health(port, proc)
        urls = [f"http://127.0.0.1:{p}" for p in ports]
        gp = free_port()
        kv = [a for pub, rep in events for a in ("--kv-events", f"tcp://127.0.0.1:{pub},tcp://127.0.0.1:{rep}")]
        gw = subprocess.Popen([*PY, "gateway", *(a for u in urls for a in ("--upstream", u)), *kv, "--port", str(gp),
                               "--router", "prefix-affinity", "--control", "budgeter-resident",
                               "--health-interval", "0.2", "--log-level", "warning"],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(gw)
        wait_health(gp, gw)
        base = f"http://127.0.0.1:{gp}"

        def followed() -> dict[str, dict[str, Any]]:
            return {k["replica"]: k for k in _get(base + "/kvgate/info")["kv_events"]}

        # warm-up turns straight to each engine until the gateway's subscriptions are live (ZMQ joins lazily)
        rng = random.Random(1)
        for i, url in enumerate(urls):
            k = 0

            def live(url: str = url) -> bool:
                return bool(followed()[url]["synced"])

            while not live():
                assert k < 200, "the gateway never received the engine's events"
                _post(url, f"warmup{i}-{k}", [rng.randrange(1000, 9000) for _ in range(40)])
                k += 1
                time.sleep(0.02)
        alice = [rng.randrange(1000, 9000) for _ in range(300)]
        held = followed()[urls[1]]["resident_tokens"]
        _post(urls[1], "alice", alice)  # (an earlier gateway's turn)
        until(lambda: followed()[urls[1]]["resident_tokens"] >= held + 288, "alice's blocks at the gateway")
        _post(base, "alice", alice + [5] * 20)
        listing = _get(base + "/v1/sessions")
        (a,) = [s for s in listing["data"] if s["id"] == "alice"]
        assert a["replica"] == urls[1] and a["resident_tokens"] >= 288
        assert listing["control"].startswith("budgeter-resident")
        per = followed()
        assert all(per[u]["gaps"] == 0 and per[u]["bad_messages"] == 0 for u in urls)  # both encodings decoded
        metrics = _get(base + "/metrics")
        assert f'kvgate_replica_resident_tokens{{replica="{urls[1]}"}}' in metrics
        assert f'kvgate_replica_kv_events_total{{replica="{urls[0]}"}}' in metrics
        assert per[urls[0]]["resident_tokens"] > 0 and per[urls[0]]["sessions"] == 0  # stores, but no names
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=20)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait(timeout=10)
