"""One run of the comparison: start the stack, drive it, watch it, stop it, write ``compare.json``.

::

    start engines ─▶ start front (router / frontend / gateway) ─▶ kvgate drive (a subprocess) ──▶ stop all by PID
                                                                  │ every 1/4 virtual minute: the router's
                                                                  │ diagnostics, each engine's cache counters
                                                                  └ at the failure minute: SIGKILL replica 0

The driver's virtual clock is read from its own samples (``samples.jsonl``, one line every 10 virtual s), so the
failure lands at the minute it is meant to, however long the start-up took.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvgate.compare import diag
from kvgate.compare.plan import DESIGNS, Plan, Run
from kvgate.compare.procs import Running, kvgate_cli, kvgate_env
from kvgate.compare.stacks import STACKS, Env, build
from kvgate.errors import UsageError

Say = Callable[[str], None]


def done(out: Path, run: Run) -> bool:
    return (out / run.key / "compare.json").exists()


def claim(out: Path, run: Run) -> int | None:
    """Claim ``run`` for this process, so that several ``kvgate compare run`` streams can share one directory: a
    held lock's file descriptor (close it when the run ends), or None if the run is done or another live stream
    holds it. The lock is an ``flock`` under ``OUT/.locks``: the kernel drops it when its holder dies, so a stream
    that was killed leaves nothing stale."""
    import fcntl

    locks = out / ".locks"
    locks.mkdir(parents=True, exist_ok=True)
    fd = os.open(locks / run.key.replace("/", "__"), os.O_CREAT | os.O_RDWR, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        return None
    if done(out, run):  # finished by another stream since this one listed its runs
        os.close(fd)
        return None
    os.ftruncate(fd, 0)
    os.write(fd, f"{os.getpid()}\n".encode())
    return fd


def drive_argv(run: Run, scale: float, endpoint: str, extra: list[str], out: Path) -> list[str]:
    d = DESIGNS[run.design]
    args = ["drive", "--endpoint", endpoint, "--time-scale", f"{scale:g}", "--lam", f"{run.lam:g}",
            "--minutes", f"{run.minutes:g}", "--seed", str(run.seed), "--out", str(out), "--force", "--json",
            "--label", f"compare {run.key}", *extra]
    if run.arm == "burst" and d.burst:
        args += ["--burst", d.burst]
    if d.real:
        from kvgate.realvllm.experiment import FULL as REAL

        trace = out.parent / "workload.jsonl"
        trace.parent.mkdir(parents=True, exist_ok=True)
        trace.write_text(json.dumps(REAL.trace_line()) + "\n")
        args += ["--trace", str(trace)]
    return args


def _virtual_now(samples: Path) -> float:
    """The driver's last sample time (virtual s), -1 before the first."""
    try:
        with samples.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 4096))
            lines = f.read().splitlines()
        return float(json.loads(lines[-1])["t_s"]) if lines else -1.0
    except (OSError, ValueError, KeyError, IndexError):
        return -1.0


def run_one(plan: Plan, run: Run, out: Path, env: Env, say: Say) -> dict[str, Any]:
    """Run ``run`` into ``out/run.key``; returns what ``compare.json`` holds."""
    stack = STACKS[run.stack]
    d = DESIGNS[run.design]
    scale = plan.scale(run)
    rdir = out / run.key
    rdir.mkdir(parents=True, exist_ok=True)
    built = build(stack, replicas=run.replicas, scale=scale, env=env, work=rdir)
    extra = list(built.drive_args)
    switch_on = None
    if d.control_at is not None and (stack.front.startswith("kvgate") or stack.front == "envoy+epp"):
        _set_control_at(built.procs, d.control_at)
        key = "epp" if stack.front == "envoy+epp" else "gateway"
        built.config[key] = [*built.config[key], "--control-at", f"{d.control_at:g}"]
    elif d.control_at is not None and stack.program_scheduling:
        switch_on = _router_off_until(built)
        built.config["switched_on"] = f"vllm-router restarted with program scheduling at minute {d.control_at:g}"
    info: dict[str, Any] = {"run": run.__dict__, "key": run.key, "stack": stack.__dict__, "config": built.config,
                            "time_scale": scale, "design": d.__dict__}
    polls: list[dict[str, Any]] = []
    t_wall = time.time()
    with Running(built.procs, rdir / "logs", say) as live:
        info["startup_s"] = live.startup_s
        argv = kvgate_cli(*drive_argv(run, scale, built.endpoint, extra, rdir / "drive"))
        info["drive_argv"] = argv[3:]
        say(f"{run.key}: up in {sum(live.startup_s.values()):.0f} s, driving {run.minutes:g} min at x{scale:g}")
        with open(rdir / "logs" / "drive.log", "wb") as dlog:
            drv = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=dlog,
                                   env=kvgate_env(), start_new_session=True)
        try:
            info["failed_at_s"], info["switched_at_s"] = _watch(drv, run, built, live, rdir, scale, polls, switch_on)
            stdout = drv.stdout.read() if drv.stdout else b""
            drv.wait(timeout=60)
            info["engine_lag"] = _engine_lags(built.engines) if stack.engine == "kvgate-engine" else None
        finally:
            if drv.poll() is None:
                os.killpg(drv.pid, signal.SIGTERM)  # (SIGINT is ignored by a driver started from a background job)
                drv.wait(timeout=60)
        info["loadavg_end"] = round(os.getloadavg()[0], 2)
    if drv.returncode not in (0, 130):
        raise UsageError(f"kvgate drive failed for {run.key} (status {drv.returncode}); see {rdir}/logs/drive.log")
    info["summary"] = json.loads(stdout.decode().strip().splitlines()[-1])
    info["polls"] = polls
    info["diagnostics"] = _diagnostics(built, rdir, polls)
    info["wall_s"] = round(time.time() - t_wall, 1)
    (rdir / "compare.json").write_text(json.dumps(info, indent=1, sort_keys=True, default=str))
    return info


def _set_control_at(procs: list[Any], minute: float) -> None:
    from dataclasses import replace

    for i, p in enumerate(procs):
        if p.name in ("gateway", "epp"):
            procs[i] = replace(p, argv=(*p.argv, "--control-at", f"{minute:g}"))


def _engine_lags(urls: list[str]) -> list[dict[str, float] | None]:
    """Each kvgate engine's own lag behind its clock (``/kvgate/stats``): a loaded machine shows there first."""
    from kvgate.compare.procs import get_text

    out: list[dict[str, float] | None] = []
    for u in urls:
        try:
            st = json.loads(get_text(u + "/kvgate/stats", timeout=2.0)[1])
            out.append({k: round(float(st[k]), 3) for k in ("lag_p99_s", "lag_max_s")})
        except (OSError, ValueError, KeyError, TypeError):
            out.append(None)  # a killed replica
    return out


def _router_off_until(built: Any) -> Any:
    """Start vllm-router without program scheduling (the uncontrolled router); return the process that switches
    it on (the same port and options, program scheduling enabled), to start in its place at the control minute.
    Neither competitor has a runtime switch: a restart is how an operator turns it on."""
    from dataclasses import replace

    i = next(i for i, p in enumerate(built.procs) if p.name == "vllm-router")
    on = built.procs[i]
    argv = list(on.argv)
    k = argv.index("--enable-program-scheduling")
    built.procs[i] = replace(on, argv=tuple(argv[:k] + argv[k + 3 :]))
    return on


DRIVE_SLACK_S = 300.0
"""Wall seconds a driver may run beyond twice its run's length (start-up, the last turns, a loaded machine)."""


def _watch(drv: subprocess.Popen[bytes], run: Run, built: Any, live: Running, rdir: Path, scale: float,
           polls: list[dict[str, Any]], switch_on: Any = None) -> tuple[float | None, float | None]:
    """Poll while the driver runs; kill replica 0 at the failure minute, restart the router with its scheduler
    at the control minute. Returns when each happened (virtual s)."""
    d = DESIGNS[run.design]
    fail_at = d.fail_at if run.arm == "fail" else None  # the failure design's twin runs its whole fleet throughout
    failed: float | None = None
    switched: float | None = None
    samples = rdir / "drive" / "samples.jsonl"
    period = 15.0 / scale  # a poll every 15 virtual seconds
    budget_s = 2.0 * run.minutes * 60.0 / scale + DRIVE_SLACK_S
    deadline = time.monotonic() + budget_s
    while drv.poll() is None:
        if time.monotonic() > deadline:  # a wedged stack: the caller stops the driver
            raise UsageError(f"kvgate drive for {run.key} was still running after {budget_s:.0f} s (twice its "
                             f"run's wall time and {DRIVE_SLACK_S:.0f} s); see {rdir}/logs/drive.log")
        time.sleep(period)
        now = _virtual_now(samples)
        if now < 0:
            continue
        p: dict[str, Any] = {"t_s": now}
        if built.router:
            p["router"] = diag.router_snapshot(built.router)
        if built.engines:
            p["engines"] = [diag.engine_counters(u) for u in built.engines]
        polls.append(p)
        if fail_at is not None and failed is None and now >= fail_at * 60.0:
            live.stop(built.engine_procs[0], grace_s=5.0, sig=signal.SIGKILL)
            failed = now
        if switch_on is not None and switched is None and d.control_at is not None and now >= d.control_at * 60:
            live.restart(switch_on)
            switched = now
    return failed, switched


def _diagnostics(built: Any, rdir: Path, polls: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    if built.router:
        snaps = [p["router"] for p in polls if p.get("router")]
        out["vllm_router"] = {
            "max_queued_requests": max((s["queued_requests"] for s in snaps), default=0),
            "max_paused_programs": max((s["paused_programs"] for s in snaps), default=0),
            "polls_with_queued": sum(s["queued_requests"] > 0 for s in snaps),
            "max_ledger_tokens": max((s.get("used_tokens", 0) for s in snaps), default=0),
            "max_engine_tokens": max((s.get("engine_tokens", 0) for s in snaps), default=0),
            "events": diag.router_log_events(rdir / "logs" / "vllm-router.log"),
        }
    if built.frontend_log and "thunderagent" in built.config:
        out["thunderagent"] = diag.thunderagent_log(rdir / "logs" / f"{built.frontend_log}.log")
    meta_path = rdir / "drive" / "run.json"
    if built.gateway and meta_path.exists():
        out["kvgate"] = diag.gateway_holds(json.loads(meta_path.read_text()))
    return out
