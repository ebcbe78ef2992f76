"""Tabulate the paired runs of docs/results/retries/index.md from their --out directories (run.json per arm).

Usage: python3 docs/results/retries/tabulate.py [--figure PNG] NAME=DIR ... (prints the Markdown table; the figure
plots the median over seeds of the burst arms' 5-minute hit ratio against time)."""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path


def arm(root: Path, which: str) -> dict[str, float]:
    metas = [json.loads(p.read_text()) for p in sorted(root.glob(f"seed-*/{which}/run.json"))]
    s = [m["summary"] for m in metas]
    return {
        "seeds": len(metas),
        "degraded": sum(bool(x["persistently_degraded"]) for x in s),
        "hit10": statistics.median(x["hit_ratio_last10"] for x in s),
        "low_hit": sum(x["hit_ratio_last10"] < 0.5 for x in s),
        "in_sys": statistics.median(x["sessions_in_system_last5"] for x in s),
        "finished": sum(x["sessions_finished"] for x in s),
        "arrived": sum(x["sessions_arrived"] for x in s),
        "abandoned": sum(m.get("sessions_abandoned", 0) for m in metas),
        "timeouts": sum(m.get("client_timeouts", 0) for m in metas),
    }


def figure(args: list[str], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    from kvgate.analysis import metrics as m
    from kvgate.records import load_run

    fig, ax = plt.subplots(figsize=(8, 3.6))
    for a in args:
        name, _, d = a.partition("=")
        curves = []
        for run_dir in sorted(Path(d).glob("seed-*/trigger")):
            r = load_run(run_dir)
            end = r.config.get("minutes", 90.0) * 60.0
            curves.append([m.hit_ratio(r.turns, t, t + 300.0) for t in np.arange(0.0, end - 299.0, 60.0)])
        med = np.nanmedian(np.array(curves, dtype=float), axis=0)
        ax.plot((np.arange(len(med)) * 60.0 + 300.0) / 60.0, med, label=name)
    ax.axvspan(15, 20, color="0.9", label="burst")
    ax.set_xlabel("minute")
    ax.set_ylabel("hit ratio (5 min, median of 12 seeds)")
    ax.set_ylim(0, 1)
    ax.legend(fontsize=7, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(args: list[str]) -> None:
    if args[:1] == ["--figure"]:
        figure(args[2:], args[1])
        args = args[2:]
    print(
        "| arms | arm | persistently degraded | hit ratio < 0.5 in the last 10 min | median hit, last 10 min | "
        "median sessions in system, last 5 min | sessions finished / arrived | abandoned by their agent | "
        "client timeouts |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    for a in args:
        name, _, d = a.partition("=")
        for which in ("trigger", "twin"):
            r = arm(Path(d), which)
            print(
                f"| {name} | {which} | {r['degraded']} of {r['seeds']} | {r['low_hit']} of {r['seeds']} | "
                f"{r['hit10']:.2f} | {r['in_sys']:.0f} | {r['finished']} / {r['arrived']} | {r['abandoned']} | "
                f"{r['timeouts']} |"
            )


if __name__ == "__main__":
    main(sys.argv[1:])
