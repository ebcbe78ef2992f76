"""A gateway SIGKILLed at a burst's peak and started again: on its state directory, without one, and an unkilled
twin, in one command.

    python3 benchmarks/restart_gateway.py [--seed 1] [--scale 5] [--minutes 30] [--kill-at 13.5] [--work DIR]
    python3 benchmarks/restart_gateway.py --quick        # 15 minutes at x30, the kill at minute 11: a check

Per arm: ``kvgate engine`` (the 8B profile, its 400K-token pool) <- ``kvgate gateway --control budgeter`` (from
the start) <- ``kvgate drive`` (paper-8b, lambda 0.04, 2x for 4 minutes from minute 10, its transport retries up to
8 times), one scaled clock, the same seed:

* ``twin``: the gateway runs throughout;
* ``killed``: ``--state-dir``; SIGKILLed at ``--kill-at`` (virtual minutes, the burst's peak) and started again at
  once on the same port and directory;
* ``killed-nostate``: the same without a state directory (the books are lost: D starts from 0).

A sampler reads the gateway's ``/kvgate/info`` every 0.05 real seconds (D, admitted, parked, waiting). Reported:
the turns in flight at the kill and those sent while the gateway was down (their attempts failed and were retried,
from the driver's records), 5xx answers, the turns that failed for good; D after the restart against the true
admitted sum (D at the kill: while the gateway is down no turn and no end reaches it), its first sample and the
first within 10%, within one mean think time or not; beside it, D against the unkilled twin's at the same moment
(the same seed, the same arrivals; it differs by what the downtime itself moved, so it is close only when the
downtime is well under a think time: a scaled clock multiplies the restart's real seconds by the scale, hence the
default x5); and each run's regime (persistently degraded or not, hit ratio of the last 10 minutes) beside the
twin's. Writes ``docs/results/gateway-restart/index.md`` and its figure.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

from kvgate.page import Code, Image, Page, Para, Span, Strong, Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stack_runs import (  # noqa: E402
    ROOT,
    drive_args,
    engine,
    free_port,
    gateway_args,
    get_json,
    kept_result,
    regime,
    spawn,
    stop,
    wait_up,
)

PAGE = ROOT / "docs" / "results" / "gateway-restart" / "index.md"
THINK_S = 5.0
"""The paper-8b sessions' mean think time (virtual seconds)."""


class Sampler(threading.Thread):
    """Reads the gateway's info every 0.05 real seconds: (driver virtual time, D, admitted, parked, waiting)."""

    def __init__(self, base: str, t0: float, scale: float) -> None:
        super().__init__(daemon=True)
        self.base, self.t0, self.scale = base, t0, scale
        self.rows: list[tuple[float, int, int, int, int]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.is_set():
            try:
                s = get_json(self.base + "/kvgate/info", 1.0)["sessions"]
                self.rows.append(((time.monotonic() - self.t0) * self.scale, s["demand_tokens"], s["admitted"],
                                  s["parked"], s["waiting"]))
            except (OSError, ValueError, KeyError):
                pass
            self.halt.wait(0.05)


def driver_start(run: Path, drv: Any, timeout: float = 120.0) -> float:
    """When the driver's clock started (monotonic): its provisional run.json appears just before it starts."""
    t_end = time.monotonic() + timeout
    while not (run / "run.json").exists():
        if drv.poll() is not None or time.monotonic() > t_end:
            raise RuntimeError(f"kvgate drive did not start (exit {drv.returncode})")
        time.sleep(0.01)
    return time.monotonic()


def run_arm(work: Path, arm: str, args: argparse.Namespace) -> dict[str, Any]:
    d = work / arm
    done = d / "result.json"
    kept = kept_result(done, d / "run", time_scale=args.scale, minutes=args.minutes, seed=args.seed)
    if kept is not None and (arm == "twin" or kept.get("kill_at") == args.kill_at):
        return kept
    shutil.rmtree(d, ignore_errors=True)
    d.mkdir(parents=True)
    scale, minutes = args.scale, args.minutes
    extra = ["--control", "budgeter"] + (["--state-dir", str(d / "state")] if arm == "killed" else [])
    out: dict[str, Any] = {"arm": arm, "kill_at": args.kill_at}
    drv = None
    with engine(scale, d / "engine.log") as ep:
        gp = free_port()
        base = f"http://127.0.0.1:{gp}"
        gw = spawn(gateway_args(ep, gp, scale, *extra), d / "gateway.log")
        try:
            wait_up(base + "/kvgate/info", gw)
            drv = spawn(drive_args(gp, d / "run", scale, "--lam", "0.04", "--burst", "1.0@10+4", "--minutes",
                                   str(minutes), "--seed", str(args.seed), "--retries", "8"), d / "drive.log")
            t0 = driver_start(d / "run", drv)
            sampler = Sampler(base, t0, scale)
            sampler.start()
            if arm != "twin":
                time.sleep(max(0.0, t0 + args.kill_at * 60 / scale - time.monotonic()))
                gw.send_signal(signal.SIGKILL)
                gw.wait(10)
                out["kill_s"] = (time.monotonic() - t0) * scale
                gw = spawn(gateway_args(ep, gp, scale, *extra), d / "gateway.log")
                wait_up(base + "/kvgate/info", gw)
                out["restart_s"] = (time.monotonic() - t0) * scale
            drv.wait(timeout=minutes * 60 / scale + 600)
            sampler.halt.set()
            sampler.join(5)
            if drv.returncode != 0:
                raise RuntimeError(f"kvgate drive exited {drv.returncode}: see {d / 'drive.log'}")
        finally:
            stop(drv)
            stop(gw)
    out["samples"] = sampler.rows
    out["regime"] = regime(d / "run", None, minutes * 60)
    if arm != "twin":
        out.update(kill_figures(d / "run", out, sampler.rows))
    done.write_text(json.dumps(out))
    return out


def kill_figures(run: Path, out: dict[str, Any], rows: list[tuple[float, int, int, int, int]]) -> dict[str, Any]:
    """D around the kill, and the failures against the turns in flight at it."""
    from kvgate.records import load_run

    kill, back = out["kill_s"], out["restart_s"]
    before = [r for r in rows if r[0] < kill]
    after = [r for r in rows if r[0] >= back]
    d_before = before[-1][1] if before else 0
    first = after[0] if after else None
    # While the gateway is down no turn and no end reaches it: the admitted sum at the restart is the one at the kill.
    back_in = next((r[0] - back for r in after if d_before and abs(r[1] - d_before) <= 0.1 * d_before), None)
    t = load_run(run).turns
    sent, end, status = t["sent_s"], t["end_s"], t["status"]
    live = (sent < kill) & (end > kill)
    inflight = {(int(s), int(k)) for s, k in zip(t["session"][live], t["turn"][live], strict=True)}
    errors = []
    err_path = run / "errors.jsonl"
    if err_path.exists():
        errors = [json.loads(line) for line in err_path.read_text().splitlines() if line.strip()]
    near = [e for e in errors if kill - 5 <= e["t_s"] <= back + 60]
    far = [e for e in errors if not kill - 5 <= e["t_s"] <= back + 60]
    hit = {(int(e["session"]), int(e["turn"])) for e in near}
    def rel(r: tuple[float, int, int, int, int] | None) -> float | None:
        return None if r is None or not d_before else round(abs(r[1] - d_before) / d_before, 3)

    return {"d_before": d_before, "d_first": None if first is None else first[1],
            "d_first_after_s": None if first is None else round(first[0] - back, 2),
            "d_rel_first": rel(first),
            "d_within_10pct_after_s": None if back_in is None else round(back_in, 2),
            "d_within_think": back_in is not None and back_in <= THINK_S,
            "in_flight_at_kill": len(inflight), "in_flight_retried": len(hit & inflight),
            "sent_while_down_retried": len(hit - inflight),
            "failed_attempts_elsewhere": len(far),
            "http_5xx_answers": sum(1 for e in errors if (e.get("http_status") or 0) >= 500),
            "turns_failed": int((status == "error").sum()), "downtime_s": round(back - kill, 2)}


def against_twin(r: dict[str, Any], twin: list[Any]) -> dict[str, Any]:
    """D after the restart against the twin's at the same moment: the first sample's relative error, and the first
    sample within 10% (how long after the restart)."""
    def twin_d(t: float) -> float:
        before = [x for x in twin if x[0] <= t]
        return float(before[-1][1]) if before else 0.0

    after = [x for x in r["samples"] if x[0] >= r["restart_s"]]
    errs = [(x[0] - r["restart_s"], abs(x[1] - twin_d(x[0])) / max(1.0, twin_d(x[0]))) for x in after]
    within = next((dt for dt, e in errs if e <= 0.1), None)
    return {"twin_rel_first": round(errs[0][1], 3) if errs else None,
            "twin_within_10pct_after_s": None if within is None else round(within, 2)}


def figure(results: dict[str, dict[str, Any]], path: Path) -> None:
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    for arm, r in results.items():
        rows = r["samples"]
        ax.plot([x[0] / 60 for x in rows], [x[1] / 1000 for x in rows], label=arm, lw=1.2)
    kill = next((r["kill_s"] for r in results.values() if "kill_s" in r), None)
    if kill is not None:
        ax.axvline(kill / 60, color="k", ls=":", lw=1, label="SIGKILL")
    ax.set_xlabel("minute")
    ax.set_ylabel("D (thousand tokens)")
    ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


HEADER = ["arm", "downtime (virtual s)", "turns in flight at the kill (retried)", "turns sent while down, retried",
          "failed attempts elsewhere", "5xx answers", "turns failed for good", "D at the kill",
          "D after (first sample; off D at the kill by)", "within 10% of D at the kill within one think time",
          "off the twin's D (first sample)", "within 10% of the twin's after (s)", "persistently degraded",
          "hit last 10 min", "regime as the twin"]


def page(results: dict[str, dict[str, Any]], args: argparse.Namespace) -> Page:
    twin = results["twin"]["regime"]
    rows: list[list[Span]] = []
    for arm, r in results.items():
        g = r["regime"]
        same = (g["persistently_degraded"], g["healthy_at_end"]) == (twin["persistently_degraded"],
                                                                      twin["healthy_at_end"])
        if arm == "twin":
            rows.append(["twin"] + ["–"] * 11 + [str(g["persistently_degraded"]), str(g["hit_last10"]), "–"])
            continue
        rows.append([arm, str(r["downtime_s"]), f"{r['in_flight_at_kill']} ({r['in_flight_retried']})",
                     str(r["sent_while_down_retried"]), str(r["failed_attempts_elsewhere"]),
                     str(r["http_5xx_answers"]), str(r["turns_failed"]), str(r["d_before"]),
                     f"{r['d_first']} ({r['d_first_after_s']} s after; {r['d_rel_first']})",
                     f"{'yes' if r['d_within_think'] else 'no'} ({r['d_within_10pct_after_s']} s)",
                     str(r["twin_rel_first"]), str(r["twin_within_10pct_after_s"]), str(g["persistently_degraded"]),
                     str(g["hit_last10"]), "yes" if same else Strong("no")])
    return Page("A gateway SIGKILLed at a burst's peak and started again", [
        Para((Code("kvgate drive"), f" (paper-8b, lambda 0.04, 2x for 4 minutes from minute 10, seed {args.seed}, "
              f"{args.minutes:g} minutes) -> ", Code("kvgate gateway --control budgeter"), " -> ",
              Code("kvgate engine"), f", at x{args.scale:g}; the gateway SIGKILLed at minute {args.kill_at:g} and "
              "started again at once. Written by ", Code("python3 benchmarks/restart_gateway.py"),
              f"; {os.cpu_count()} cores, load average {args.loads[0]:.2f} at the start, {args.loads[1]:.2f} at "
              "the end.")),
        Image("restart.png", "D around the kill"),
        Table(HEADER, rows),
        Para("Targets: failures only for turns in flight at the kill (their attempts failed and were retried; turns "
             "sent while the gateway was down could not connect and were retried too; no 5xx answer), D back within "
             "10% of the true admitted sum within one mean think time (5 s), the same regime as the unkilled twin. "
             "While the gateway is down no turn and no session end reaches it, so the true admitted sum at the "
             "restart is D at the kill. The twin's D at the same moment differs by what the downtime itself moved "
             "(sessions the twin ended or admitted meanwhile, which the killed run's clients do after it): a scaled "
             "clock multiplies the restart's real seconds (a process start, its imports) by the scale, so that "
             "comparison holds only when the downtime is well under a think time. Without a state directory the "
             "restarted gateway starts from D = 0 and learns each session again at its next turn."),
    ])


def main() -> None:
    ap = argparse.ArgumentParser(description="A gateway SIGKILLed at a burst's peak and started again (on its state "
                                 "directory, and without one) beside an unkilled twin; writes "
                                 "docs/results/gateway-restart/.")
    ap.add_argument("--seed", type=int, default=1, help="The driver's seed (default 1).")
    ap.add_argument("--scale", type=float, default=5.0, help="Virtual seconds per real second (default 5).")
    ap.add_argument("--minutes", type=float, default=30.0, help="Virtual minutes a run (default 30).")
    ap.add_argument("--kill-at", type=float, default=13.5, help="Virtual minute of the kill (default 13.5).")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "gateway-restart",
                    help="Where the runs' records go (default runs/gateway-restart).")
    ap.add_argument("--quick", action="store_true", help="15 minutes at x30, the kill at minute 11; no page.")
    args = ap.parse_args()
    if args.quick:
        args.scale, args.minutes, args.kill_at = 30.0, 15.0, 11.0
        args.work = args.work.with_name(args.work.name + "-quick")
    load0 = os.getloadavg()[0]
    results = {arm: run_arm(args.work, arm, args) for arm in ("twin", "killed", "killed-nostate")}
    args.loads = (load0, os.getloadavg()[0])
    for arm in ("killed", "killed-nostate"):
        results[arm].update(against_twin(results[arm], results["twin"]["samples"]))
    text = page(results, args).markdown()
    print(text)
    if not args.quick:
        PAGE.parent.mkdir(parents=True, exist_ok=True)
        PAGE.write_text(text)
        figure(results, PAGE.parent / "restart.png")


if __name__ == "__main__":
    main()
