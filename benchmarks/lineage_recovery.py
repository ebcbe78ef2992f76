"""The paper's recovery experiment through the gateway with sessions found by lineage alone, beside the same runs
naming them with ``X-Session-ID``, on chat and on Responses: is the regime the same per seed?

    python3 benchmarks/lineage_recovery.py [--seeds 1-8] [--scale 30] [--parallel 2] [--work DIR]
    python3 benchmarks/lineage_recovery.py --quick          # 2 seeds, 36 minutes at x60: a check that it runs

Per seed and arm (api chat or responses; sessions named by ``X-Session-ID``, or by nothing: ``--session-id none``),
``kvgate engine`` (the 8B profile, its 400K-token pool) <- ``kvgate gateway --control budgeter --control-at 20``
<- ``kvgate drive`` (paper-8b sessions, lambda 0.04, 2x for 4 minutes from minute 10, 60 minutes: the paper's
recovery design, Table 3), all on one scaled clock. Each run's regime: collapsed at minute 20 (hit ratio of the 5
minutes before < 0.5), recovered after how many minutes (every later 5-minute window >= 0.8), hit ratio of the
last 10 minutes, persistently degraded from minute 20. The same seed gives the same arrivals in every arm. Runs
already done in ``--work`` are kept (resumable). Writes ``docs/results/lineage-recovery/index.md``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from kvgate.page import Block, Code, Heading, Page, Para, Span, Strong, Table

sys.path.insert(0, str(Path(__file__).resolve().parent))
from stack_runs import (  # noqa: E402
    ROOT,
    drive_args,
    engine,
    free_port,
    gateway_args,
    kept_result,
    regime,
    spawn,
    stop,
    wait_up,
)  # noqa: E402

PAGE = ROOT / "docs" / "results" / "lineage-recovery" / "index.md"
ARMS = [(api, ids) for api in ("chat", "responses") for ids in ("header", "none")]


def one_run(work: Path, seed: int, api: str, ids: str, scale: float, minutes: float) -> dict[str, Any]:
    d = work / f"seed{seed}-{api}-{ids}"
    done = d / "regime.json"
    kept = kept_result(done, d / "run", time_scale=scale, minutes=minutes, seed=seed, api=api, session_id=ids)
    if kept is not None:
        return kept
    d.mkdir(parents=True, exist_ok=True)
    drv = None
    with engine(scale, d / "engine.log") as ep:
        gp = free_port()
        gw = spawn(gateway_args(ep, gp, scale, "--control", "budgeter", "--control-at", "20"), d / "gateway.log")
        try:
            wait_up(f"http://127.0.0.1:{gp}/kvgate/info", gw)
            drv = spawn(drive_args(gp, d / "run", scale, "--api", api, "--session-id", ids, "--lam", "0.04",
                                   "--burst", "1.0@10+4", "--minutes", str(minutes), "--seed", str(seed),
                                   "--retries", "6"), d / "drive.log")
            drv.wait(timeout=minutes * 60 / scale + 600)
            if drv.returncode != 0:
                raise RuntimeError(f"kvgate drive exited {drv.returncode}: see {d / 'drive.log'}")
        finally:
            stop(drv)
            stop(gw)
    out = {"seed": seed, "api": api, "ids": ids, **regime(d / "run", 1200.0, minutes * 60)}
    done.write_text(json.dumps(out))
    return out


def same(a: dict[str, Any], b: dict[str, Any]) -> bool:
    """The same regime: recovered under the budgeter (healthy over the last 10 minutes) or not, persistently
    degraded from minute 20 or not. (Whether a run had collapsed by minute 20, before any control, is shown but
    not compared: near the threshold it follows the scaled clock's jitter as much as the seed.)"""
    return (a["healthy_at_end"], a["persistently_degraded"]) == (b["healthy_at_end"], b["persistently_degraded"])


def cell(r: dict[str, Any]) -> str:
    rec = r.get("recovered_min")
    return (f"{'collapsed' if r['collapsed_at_control'] else 'healthy'} at 20; "
            f"{'recovered in ' + format(rec, 'g') + ' min' if rec is not None else 'not recovered'}; "
            f"hit {r['hit_last10']}")


def page(results: list[dict[str, Any]], args: argparse.Namespace) -> Page:
    by = {(r["seed"], r["api"], r["ids"]): r for r in results}
    blocks: list[Block] = [Para((
        "The paper's recovery design (lambda 0.04, 2x for 4 minutes from minute 10, the budgeter from minute 20, "
        f"{args.minutes:g} minutes; Table 3) driven through ", Code("kvgate gateway"), " to ", Code("kvgate engine"),
        f" at x{args.scale:g}, each seed four times: ", Code("--api chat"), " and ", Code("--api responses"),
        ", each with ", Code("X-Session-ID"), " on every turn and with nothing naming the session (",
        Code("kvgate drive --session-id none"), ": the gateway's lineage finds each conversation's session). "
        "Written by ", Code("python3 benchmarks/lineage_recovery.py"), f" (seeds {args.seeds}); {os.cpu_count()} "
        f"cores, load average {args.loads[0]:.2f} at the start, {args.loads[1]:.2f} at the end",
        f" ({args.reused} of {len(results)} runs kept from an earlier invocation on the same work directory)."
        if args.reused else "."))]
    for api in ("chat", "responses"):
        rows: list[list[Span]] = []
        k = 0
        for seed in args.seed_list:
            a, b = by.get((seed, api, "header")), by.get((seed, api, "none"))
            if a is None or b is None:
                continue
            k += same(a, b)
            rows.append([str(seed), cell(a), cell(b), "yes" if same(a, b) else Strong("no")])
        blocks += [Heading(api), Table(["seed", "X-Session-ID", "lineage alone", "same regime"], rows), Para((
            "Same regime (recovered: healthy over the last 10 minutes, or not; persistently degraded from minute 20 "
            "or not) in ", Strong(f"{k} of {len(rows)}"), " seeds. Collapsed at minute 20 (the 5 minutes before it "
            "under 0.5, no control yet) is shown for each run: near the threshold it follows the scaled clock's "
            "jitter as much as the seed."))]
    return Page("Recovery through the gateway: sessions found by lineage alone vs named by X-Session-ID", blocks)


def main() -> None:
    ap = argparse.ArgumentParser(description="The recovery experiment through the gateway, sessions found by lineage "
                                 "alone beside X-Session-ID, on chat and Responses: the regime per seed, paired.")
    ap.add_argument("--seeds", default="1-8", help="Seeds, as A-B (default 1-8).")
    ap.add_argument("--scale", type=float, default=30.0, help="Virtual seconds per real second (default 30).")
    ap.add_argument("--minutes", type=float, default=60.0, help="Virtual minutes a run (default 60).")
    ap.add_argument("--parallel", type=int, default=2, help="Runs at once (default 2).")
    ap.add_argument("--work", type=Path, default=ROOT / "runs" / "lineage-recovery",
                    help="Where the runs go; runs already there are kept (default runs/lineage-recovery).")
    ap.add_argument("--quick", action="store_true", help="Seeds 1-2, 36 minutes at x60 (a check that it runs).")
    ap.add_argument("--page", type=Path, default=PAGE, help="The paired table (default docs/results/lineage-recovery).")
    args = ap.parse_args()
    if args.quick:
        args.seeds, args.scale, args.minutes = "1-2", 60.0, 36.0
        args.work = args.work.with_name(args.work.name + "-quick")
    lo, _, hi = args.seeds.partition("-")
    if not (lo.isdigit() and (hi or lo).isdigit() and int(lo) <= int(hi or lo)) or args.parallel < 1:
        ap.error(f"--seeds takes A-B with A <= B (got {args.seeds!r}); --parallel at least 1")
    args.seed_list = list(range(int(lo), int(hi or lo) + 1))
    jobs = [(s, api, ids) for s in args.seed_list for api, ids in ARMS]
    args.reused = sum(kept_result(args.work / f"seed{s}-{api}-{ids}" / "regime.json",
                                  args.work / f"seed{s}-{api}-{ids}" / "run", time_scale=args.scale,
                                  minutes=args.minutes, seed=s, api=api, session_id=ids) is not None
                      for s, api, ids in jobs)
    load0 = os.getloadavg()[0]
    with ThreadPoolExecutor(args.parallel) as ex:
        results = list(ex.map(lambda j: one_run(args.work, *j, args.scale, args.minutes), jobs))
    args.loads = (load0, os.getloadavg()[0])
    text = page(results, args).markdown()
    if not args.quick:
        args.page.parent.mkdir(parents=True, exist_ok=True)
        args.page.write_text(text)
    print(text)


if __name__ == "__main__":
    main()
