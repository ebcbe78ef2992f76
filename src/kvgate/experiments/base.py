"""The experiment framework: a plan of simulated runs, an evaluation into claims, and a page.

An experiment is a row of the paper's Table 1, one of kvgate's own fleet experiments, or an analysis.
``plan(quick)`` lists the runs it needs (an id and a
``SimConfig`` each); the runner executes them resumably under ``OUT/NAME/runs/ID``; ``evaluate(ctx)`` reads the
records back and returns the paper's claims beside kvgate's results with a verdict per claim, plus figures.
``kvgate report`` re-runs only ``evaluate`` on existing records.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate.experiments.verdicts import CALIBRATED, DIFFERS, NOT_REPRODUCED, REPRODUCED, Claim, judge
from kvgate.records import Run, load_run
from kvgate.sim.config import SimConfig

__all__ = ["CALIBRATED", "DIFFERS", "NOT_REPRODUCED", "REPRODUCED", "Claim", "Context", "Experiment", "Result"]


@dataclass
class Context:
    """What ``evaluate`` gets: the runs by id, where to put figures, and whether this was a quick run."""

    runs: dict[str, Run]
    fig_dir: Path
    quick: bool
    draw: bool = True
    """Draw figures (the sensitivity analysis re-evaluates experiments without them)."""
    claims: list[Claim] = field(default_factory=list)

    def judge(self, cid: str, obs: Any, kvgate: str, note: str = "") -> Claim:
        """Judge observation ``obs`` by claim ``cid`` (the paper's or kvgate's own, declared in ``claims.py``) and
        keep the row."""
        from kvgate.experiments.claims import ALL_CLAIMS, POPULATIONS, cause

        c = judge(cid, ALL_CLAIMS[cid], obs, kvgate, note)
        if c.verdict in (DIFFERS, NOT_REPRODUCED):
            why = cause(cid)
            if why:
                c.note = "; ".join(x for x in (c.note, "cause: " + why) if x)
        pop = next((x for x in self.claims if x.id == POPULATIONS.get(cid)), None)
        if pop is not None and pop.verdict != REPRODUCED:
            c.note = "; ".join(x for x in (c.note, f"on another population of runs than the paper's ({pop.id}: "
                                                   f"{pop.kvgate} vs the paper's {pop.paper})") if x)
        self.claims.append(c)
        return c

    def summary(self, run_id: str) -> dict[str, Any]:
        return self.runs[run_id].summary

    def select(self, prefix: str) -> list[tuple[str, Run]]:
        return [(k, r) for k, r in self.runs.items() if k.startswith(prefix)]


@dataclass
class Result:
    claims: list[Claim]
    figures: list[tuple[str, str]] = field(default_factory=list)  # (caption, png path relative to the page)
    tables: list[str] = field(default_factory=list)  # preformatted text tables


GROUPS = ("paper", "fleet", "analysis")
"""How an experiment's claims are counted (see :attr:`Experiment.group`)."""


@dataclass
class Experiment:
    name: str
    title: str
    setup: str
    plan: Callable[[bool], list[tuple[str, SimConfig]]]
    evaluate: Callable[[Context], Result]
    section: str = ""
    group: str = "paper"
    """Which count its claims join: ``paper`` (a row of the paper's Table 1), ``fleet`` (kvgate's own claims about a
    fleet: counted apart from the paper's) or ``analysis`` (no verdicts counted)."""

    def __post_init__(self) -> None:
        if self.group not in GROUPS:
            raise ValueError(f"experiment {self.name}: group {self.group!r} is not one of {', '.join(GROUPS)}")


def frac(n: int, d: int) -> str:
    return f"{n}/{d}"


def rng(vals: Sequence[float | None], fmt: str = "{:.2f}") -> str:
    v = [x for x in vals if x is not None and not (isinstance(x, float) and math.isnan(x))]
    if not v:
        return "n/a"
    lo, hi = min(v), max(v)
    return fmt.format(lo) if fmt.format(lo) == fmt.format(hi) else f"{fmt.format(lo)}–{fmt.format(hi)}"


def within(vals: Sequence[float | None], lo: float, hi: float) -> bool:
    v = [x for x in vals if x is not None and not (isinstance(x, float) and math.isnan(x))]
    return bool(v) and all(lo <= x <= hi for x in v)


def load_runs(run_root: Path, ids: Sequence[str]) -> dict[str, Run]:
    """Load runs and recompute their summaries, so the detector in force (not the one a record was written
    with) decides."""
    from kvgate.analysis.summary import summarize

    out = {}
    for i in ids:
        r = load_run(run_root / i)
        wall = r.meta.get("summary", {}).get("wall_s")
        r.meta["summary"] = summarize(r)
        if wall is not None:
            r.meta["summary"]["wall_s"] = wall
        out[i] = r
    return out
