"""``kvgate calibrate --fit-mixed DIR``: the mixed step's two constants fitted jointly on the calibration runs.

The mixed step's penalty (:meth:`kvgate.engine.costmodel.Profile.mixed_penalty`) has two constants:
``mixed_decode_factor`` (the factor on a decoder's KV read in a step whose token budget is all prefill) and
``mixed_share_exponent`` (with less prefill, the factor's excess over 1 is scaled by the step's prefill share to
this power). Two of the paper's load-level figures pin them: the cold cost under load (the slope of
c(L) on cache-off runs, 0.146 ms/token: steps carrying full prefill chunks) and the cache-warm capacity (up to
1.27 turns/s: steps carrying small incremental exponents). The fit runs the calibration's cache-off and cache-warm
runs (its reserved seeds, :data:`kvgate.calibration.paper.CALIBRATION_SEEDS`) at every point of a grid and takes
the point minimising

    J = ((slope - 0.146) / 0.146)^2 + ((capacity - 1.27) / 1.27)^2

(both relative errors, weighted alike). Nothing else enters: no experiment's run or verdict. The grid, every
point's figures and the minimum are written to ``DIR/grid.json`` and ``DIR/index.md``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvgate.analysis.drain import fit_cold_cost
from kvgate.calibration.paper import calibration_jobs, split_runs, warm_capacity
from kvgate.records import from_tables
from kvgate.sim.batch import run_many

PAPER_SLOPE = 0.146
"""The paper's c(L) slope on cache-disabled runs, ms per prompt token (§4)."""
PAPER_CAPACITY = 1.27
"""The paper's cache-warm capacity, turns/s ("up to 1.27", the best of its post-recovery windows; §4, §6)."""
GRID_FACTOR = tuple(float(x) for x in range(6, 17))
"""``mixed_decode_factor`` values of the grid."""
GRID_EXPONENT = (0.0, 0.5, 1.0, 1.5, 2.0, 2.5, 3.0, 4.0, 6.0)
"""``mixed_share_exponent`` values of the grid (0: the constant factor)."""


def objective(slope: float, capacity: float) -> float:
    """J of the module docstring (NaN when a figure is missing)."""
    return ((slope - PAPER_SLOPE) / PAPER_SLOPE) ** 2 + ((capacity - PAPER_CAPACITY) / PAPER_CAPACITY) ** 2


def grid_point(prof_name: str, factor: float, exponent: float) -> dict[str, Any]:
    """The cache-off c(L) slope and the cache-warm capacity with the two constants set, and their J."""
    jobs = [c for c in calibration_jobs(prof_name, quick=False, mdf=factor, exponent=exponent)
            if not c.prefix_caching and c.bursts or c.control == "budgeter"]
    # in this process, one after another: the grid's many small batches need no pool (and forking one after the
    # last batch's tables were read can hang the child on a lock it inherited)
    metas = run_many([(c, None) for c in jobs], progress=False, jobs=1)
    parts = split_runs(jobs, [from_tables(mm, mm["_tables"]) for mm in metas])
    slope = fit_cold_cost(parts["nocache"]).slope_ms_per_token
    cap, hit = warm_capacity(parts["warm"], jobs[0].minutes * 60.0)
    return {"mixed_decode_factor": factor, "mixed_share_exponent": exponent, "slope_ms_per_token": round(slope, 5),
            "capacity_turns_s": round(cap, 4), "capacity_hit": round(hit, 4),
            "objective": round(objective(slope, cap), 6)}


def fit_mixed(
    prof_name: str, factors: tuple[float, ...] = GRID_FACTOR, exponents: tuple[float, ...] = GRID_EXPONENT,
    progress: Any = None,
) -> dict[str, Any]:
    """Every grid point and the one of least J (ties: the earlier point, i.e. the smaller constants)."""
    grid = []
    for p in exponents:
        for f in factors:
            grid.append(grid_point(prof_name, f, p))
            if progress is not None:
                progress(grid[-1])
    ok = [g for g in grid if not math.isnan(g["objective"])]
    best = min(ok, key=lambda g: g["objective"]) if ok else None
    return {"profile": prof_name, "paper": {"slope_ms_per_token": PAPER_SLOPE, "capacity_turns_s": PAPER_CAPACITY},
            "objective": "((slope - 0.146) / 0.146)^2 + ((capacity - 1.27) / 1.27)^2", "grid": grid, "best": best}


def format_fit(fit: dict[str, Any]) -> str:
    """The grid as a markdown page: J by the two constants, then the minimum and its figures."""
    factors = sorted({g["mixed_decode_factor"] for g in fit["grid"]})
    exponents = sorted({g["mixed_share_exponent"] for g in fit["grid"]})
    at = {(g["mixed_decode_factor"], g["mixed_share_exponent"]): g for g in fit["grid"]}
    best = fit["best"]
    lines = [f"# Joint fit of the mixed step's constants (profile `{fit['profile']}`)", "",
             "Made by `kvgate calibrate --fit-mixed DIR` on the calibration's reserved seeds (the cache-off c(L) "
             "runs and the cache-warm budgeter runs of `kvgate calibrate`); no experiment's run enters. "
             f"Objective: J = {fit['objective']}. `mixed_share_exponent` 0 is the constant factor (the model "
             "before the exponent).", ""]
    if best is not None:
        lines += [f"**Minimum: J = {best['objective']:.4g}** at `mixed_decode_factor` = "
                  f"{best['mixed_decode_factor']:g}, `mixed_share_exponent` = {best['mixed_share_exponent']:g} "
                  f"(c(L) slope {best['slope_ms_per_token']:.4g} ms/token against {PAPER_SLOPE}; cache-warm "
                  f"capacity {best['capacity_turns_s']:.4g} turns/s against {PAPER_CAPACITY}, hit "
                  f"{best['capacity_hit']:.3g}).", ""]
    for title, key, fmt in (("J", "objective", "{:.4f}"), ("c(L) slope, cache off (ms/token)", "slope_ms_per_token",
                                                             "{:.4f}"),
                            ("cache-warm capacity (turns/s)", "capacity_turns_s", "{:.3f}")):
        lines += [f"## {title}", "", "| mixed_decode_factor | " + " | ".join(
            "constant" if p == 0 else f"exponent {p:g}" for p in exponents) + " |",
                  "|---|" + "---|" * len(exponents)]
        for f in factors:
            cells = []
            for p in exponents:
                g = at.get((f, p))
                v = "" if g is None else fmt.format(g[key])
                cells.append(f"**{v}**" if g is best else v)
            lines.append(f"| {f:g} | " + " | ".join(cells) + " |")
        lines.append("")
    return "\n".join(lines)


def write_fit(fit: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "grid.json").write_text(json.dumps(fit, indent=1) + "\n", "utf-8")
    (out / "index.md").write_text(format_fit(fit), "utf-8")
