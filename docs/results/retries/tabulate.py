"""Tabulate the paired runs of docs/results/retries/index.md from their --out directories (run.json per arm).

Usage: python3 docs/results/retries/tabulate.py NAME=DIR ... (prints the Markdown table)."""

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


def main(args: list[str]) -> None:
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
