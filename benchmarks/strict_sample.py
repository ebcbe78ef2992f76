"""A seeded draw of reproduced rows for a strict reading (docs/results/strict-reading.md).

    python3 benchmarks/strict_sample.py [--seed 4242] [--n 30] [--results docs/results] [--all-kinds]

Lists the paper's rows judged "reproduced" in the committed ``result.json`` files under ``--results``, in path
order (sorted directory names) and, within a page, in row order; by default only the rows the index counts as
independent findings (``experiments/findings.toml``: kind ``finding``), with ``--all-kinds`` every reproduced row
of the paper's. Prints ``random.Random(seed).sample(rows, n)`` in draw order: experiment, row id, kind, and the
row's claim. Baselines and kvgate's own (fleet) claims are not the paper's and are never listed.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path

from kvgate.experiments.claims import PAPER_CLAIMS
from kvgate.experiments.findings import FINDING, KIND_OF

ROOT = Path(__file__).resolve().parents[1]


def reproduced_rows(results: Path, all_kinds: bool) -> list[tuple[str, str, str, str]]:
    """(experiment, id, kind, claim) of every reproduced row of the paper's, in path and row order."""
    out = []
    for p in sorted(results.glob("*/result.json")):
        page = json.loads(p.read_text())
        if not isinstance(page, dict):
            continue
        for c in page.get("claims", []):
            cid = c.get("id", "")
            if c.get("baseline") or cid not in PAPER_CLAIMS or c.get("verdict") != "reproduced":
                continue
            kind = KIND_OF[cid].kind
            if all_kinds or kind == FINDING:
                out.append((p.parent.name, cid, kind, str(c.get("claim", ""))))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seed", type=int, default=4242)
    ap.add_argument("--n", type=int, default=30)
    ap.add_argument("--results", type=Path, default=ROOT / "docs" / "results")
    ap.add_argument("--all-kinds", action="store_true", help="every reproduced row, not only findings")
    a = ap.parse_args()
    rows = reproduced_rows(a.results, a.all_kinds)
    if a.n > len(rows):
        raise SystemExit(f"--n {a.n}: only {len(rows)} reproduced rows")
    print(f"# {len(rows)} reproduced rows; seed {a.seed}, {a.n} drawn")
    for i, (exp, cid, kind, claim) in enumerate(random.Random(a.seed).sample(rows, a.n), 1):
        print(f"{i:2d}  {exp:15s} {cid:26s} {kind:11s} {claim}")


if __name__ == "__main__":
    main()
