"""The driven paired burst on a fleet, through three gateways sharing one Redis, with faults at the burst's peak.

    python3 benchmarks/shared_runs.py [--seeds 501-508] [--scale 15] [--minutes 90] [--lanes 2] [--work DIR]

Per seed: four ``kvgate engine``s (the paper-8b engine, 400K tokens each) <- three ``kvgate gateway --store
redis://`` instances, each with all four as ``--upstream`` (one shared budget per replica) <- Envoy, round robin
over the three (a retry on a refused connection goes to another instance) <- ``kvgate drive`` (the compare plan's
4-engine paired burst: lambda 0.14, 1.5x for 5 minutes from minute 15, 90 minutes, ``--retries 8``), one scaled
clock. The fault of a seed, at the burst's peak (minute 17.5):

* ``none``: nothing;
* ``kill``: one instance SIGKILLed (not started again: the front sends its share to the two left, after a refused
  connection);
* ``redis``: Redis killed and started again at once, empty (the instances go to their local share, then resync).

Reported per run: persistently degraded or not (aligned at the burst's end, as ``kvgate compare`` judges the
paired design), the hit ratio of the last 10 minutes, turns that failed for good, the most requests any engine
had waiting and its preemptions (sampled every 15 virtual seconds), the engines' lag behind their clock. Writes
``DIR/s<seed>/result.json`` and prints one JSON line per run; a finished run is kept (run again with ``--force``).
"""

from __future__ import annotations

import argparse
import json
import shutil
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stack_runs import ROOT, drive_args, free_port, get_json, spawn, stop, wait_up  # noqa: E402

POOL = 400_000
FAULTS = {501: "none", 502: "none", 503: "kill", 504: "redis", 505: "kill", 506: "redis", 507: "kill", 508: "redis"}
PEAK_MIN = 17.5
BURST = "1.5@15+5"
ALIGN_S = 20 * 60.0
"""The burst's end: the paired design's windows are aligned there."""


def front(work: Path, gateways: list[int], listen: int) -> tuple[list[str], int]:
    """Envoy on ``listen``, round robin over the gateways, a refused connection retried on another one: (argv,
    admin port)."""
    from kvgate.epp.envoy import find_envoy, round_robin_bootstrap, write_bootstrap

    envoy = find_envoy()
    if not envoy:
        raise SystemExit("Envoy is not installed (bash .ci/install-envoy.sh)")
    admin = free_port()
    conf = round_robin_bootstrap(listen, [("127.0.0.1", p) for p in gateways], admin_port=admin)
    hcm = conf["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    route["retry_policy"] = {"retry_on": "connect-failure,refused-stream,reset-before-request", "num_retries": 3,
                             "retry_host_predicate": [{"name": "envoy.retry_host_predicates.previous_hosts",
                                                       "typed_config": {"@type": "type.googleapis.com/envoy.extensions"
                                                                        ".retry.host.previous_hosts.v3"
                                                                        ".PreviousHostsPredicate"}}],
                             "host_selection_retry_max_attempts": 5}
    path = work / "envoy.json"
    write_bootstrap(path, conf)
    return [envoy, "-c", str(path), "--use-dynamic-base-id", "--concurrency", "1", "-l", "error"], admin


class Redis:
    def __init__(self, work: Path) -> None:
        self.port = free_port()
        self.log = work / "redis.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        f = open(self.log, "ab")  # noqa: SIM115 - lives as long as the process
        self.proc = subprocess.Popen(["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                                      "--appendonly", "no"], stdout=f, stderr=subprocess.STDOUT)
        import redis

        t_end = time.monotonic() + 20
        while True:
            try:
                redis.Redis(port=self.port).ping()
                return
            except redis.ConnectionError:
                if time.monotonic() > t_end:
                    raise
                time.sleep(0.05)

    def kill(self) -> None:
        stop(self.proc, signal.SIGKILL)


class Sampler(threading.Thread):
    """Every 15 virtual seconds: each engine's waiting requests and preemptions (the most seen)."""

    def __init__(self, engines: list[str], scale: float) -> None:
        super().__init__(daemon=True)
        self.engines, self.period = engines, 15.0 / scale
        self.halt = threading.Event()
        self.waiting = [0] * len(engines)
        self.preemptions = [0] * len(engines)

    def run(self) -> None:
        while not self.halt.wait(self.period):
            for i, u in enumerate(self.engines):
                try:
                    st = get_json(u + "/kvgate/stats")
                except (OSError, ValueError):
                    continue
                self.waiting[i] = max(self.waiting[i], int(st.get("waiting", 0)))
                self.preemptions[i] = max(self.preemptions[i], int(st.get("preemptions", 0)))


def run_seed(work: Path, seed: int, scale: float, minutes: float, force: bool) -> dict[str, Any]:
    d = work / f"s{seed}"
    done = d / "result.json"
    fault = FAULTS.get(seed, "none")
    if done.exists() and not force:
        kept = json.loads(done.read_text())
        if kept.get("scale") == scale and kept.get("minutes") == minutes and kept.get("fault") == fault:
            return dict(kept)
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    procs: list[subprocess.Popen[bytes]] = []
    redis = Redis(d)
    out: dict[str, Any] = {"seed": seed, "fault": fault, "scale": scale, "minutes": minutes}
    try:
        redis.start()
        engines = []
        for i in range(4):
            port = free_port()
            p = spawn(["engine", "--port", str(port), "--time-scale", f"{scale:g}", "--kv-pool", str(POOL)],
                      d / f"engine{i}.log")
            procs.append(p)
            wait_up(f"http://127.0.0.1:{port}/health", p)
            engines.append(f"http://127.0.0.1:{port}")
        ups = [x for u in engines for x in ("--upstream", u)]
        gports, listen = [free_port() for _ in range(3)], free_port()
        gws = []
        for i, gp in enumerate(gports):
            g = spawn(["gateway", *ups, "--port", str(gp), "--time-scale", f"{scale:g}", "--kv-pool", str(POOL),
                       "--store", f"redis://127.0.0.1:{redis.port}/0", "--log-level", "warning",
                       "--allowed-host", f"127.0.0.1:{listen}"], d / f"gateway{i}.log")
            procs.append(g)
            gws.append(g)
            wait_up(f"http://127.0.0.1:{gp}/kvgate/info", g)
        argv, admin = front(d, gports, listen)
        f = open(d / "envoy.log", "ab")  # noqa: SIM115 - lives as long as the process
        env_p = subprocess.Popen(argv, stdout=f, stderr=subprocess.STDOUT)
        procs.append(env_p)
        wait_up(f"http://127.0.0.1:{admin}/ready", env_p)
        drv = spawn(drive_args(listen, d / "run", scale, "--lam", "0.14", "--burst", BURST, "--minutes",
                               f"{minutes:g}", "--seed", str(seed), "--retries", "8", "--label",
                               f"shared fleet s{seed} {fault}"), d / "drive.log")
        procs.append(drv)
        t_end = time.monotonic() + 120
        while not (d / "run" / "run.json").exists():
            if drv.poll() is not None or time.monotonic() > t_end:
                raise RuntimeError(f"kvgate drive did not start (exit {drv.returncode})")
            time.sleep(0.01)
        t0 = time.monotonic()
        sampler = Sampler(engines, scale)
        sampler.start()
        if fault != "none" and minutes > PEAK_MIN:
            time.sleep(max(0.0, t0 + PEAK_MIN * 60 / scale - time.monotonic()))
            out["fault_at_s"] = round((time.monotonic() - t0) * scale, 1)
            if fault == "kill":
                stop(gws[1], signal.SIGKILL)
            else:
                redis.kill()
                redis.start()
        drv.wait(timeout=minutes * 60 / scale * 2 + 600)
        sampler.halt.set()
        out["drive_exit"] = drv.returncode
        out["engine_waiting_max"], out["engine_preemptions"] = sampler.waiting, sampler.preemptions
        lags = []
        for u in engines:
            try:
                st = get_json(u + "/kvgate/stats")
                lags.append({k: round(float(st[k]), 3) for k in ("lag_p99_s", "lag_max_s")})
            except (OSError, ValueError, KeyError):
                lags.append(None)
        out["engine_lag"] = lags
        out["shared"] = [get_json(f"http://127.0.0.1:{gp}/kvgate/info")["resolution"]["shared"]
                         for i, gp in enumerate(gports) if gws[i].poll() is None]
    finally:
        for p in reversed(procs):
            stop(p)
        redis.kill()
    out.update(judge(d / "run", minutes))
    done.write_text(json.dumps(out, indent=1) + "\n")
    return out


def judge(run: Path, minutes: float) -> dict[str, Any]:
    """The run's regime as ``kvgate compare`` judges the paired design (windows aligned at the burst's end)."""
    from kvgate.analysis import metrics as m
    from kvgate.records import load_run

    r = load_run(run)
    t = r.turns
    end = float(r.meta.get("stopped_at_s") or minutes * 60.0)
    degraded = bool(m.persistent_degradation(t, r.samples, ALIGN_S, end)[0])
    hit = m.hit_ratio(t, end - 600, end + 1)
    status = t.get("status")
    failed = 0 if status is None else int(sum(1 for s in status if s == "error"))  # (not: in flight at the end)
    ok = [i for i, s in enumerate(status)] if status is None else [i for i, s in enumerate(status) if s == "ok"]
    lat = sorted(float(t["end_s"][i] - t["submit_s"][i]) for i in ok)
    return {"persistently_degraded": degraded, "hit_last10": None if hit != hit else round(float(hit), 3),
            "turns_done": int(m.turns_done(t, 0, end + 1)), "turns_failed": failed,
            "latency_p90_s": round(lat[int(0.9 * (len(lat) - 1))], 1) if lat else None,
            "in_system_end": r.summary.get("sessions_in_system_last5") if hasattr(r, "summary") else None}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--seeds", default="501-508")
    ap.add_argument("--scale", type=float, default=15.0)
    ap.add_argument("--minutes", type=float, default=90.0)
    ap.add_argument("--lanes", type=int, default=2, help="runs at once")
    ap.add_argument("--work", type=Path, default=ROOT / "build" / "shared-runs")
    ap.add_argument("--force", action="store_true")
    ap.add_argument("--judge", action="store_true", help="judge the finished runs again (nothing runs)")
    a = ap.parse_args()
    lo, _, hi = a.seeds.partition("-")
    seeds = list(range(int(lo), int(hi or lo) + 1))
    a.work.mkdir(parents=True, exist_ok=True)
    if a.judge:
        for seed in seeds:
            done = a.work / f"s{seed}" / "result.json"
            if done.exists():
                res = {**json.loads(done.read_text()), **judge(a.work / f"s{seed}" / "run", a.minutes)}
                done.write_text(json.dumps(res, indent=1) + "\n")
                print(json.dumps(res), flush=True)
        return
    with ThreadPoolExecutor(a.lanes) as pool:
        for res in pool.map(lambda s: run_seed(a.work, s, a.scale, a.minutes, a.force), seeds):
            print(json.dumps({k: res.get(k) for k in ("seed", "fault", "persistently_degraded", "hit_last10",
                                                         "turns_done", "turns_failed", "engine_waiting_max",
                                                         "engine_preemptions", "engine_lag")}), flush=True)


if __name__ == "__main__":
    main()
