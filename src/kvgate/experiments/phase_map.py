"""Running the phase map and the engine alternatives (``kvgate phase-map``, ``kvgate engine-alternatives``): the
grids of simulated runs; what they measure and how it is judged and drawn is :mod:`kvgate.analysis.phase`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from kvgate.analysis.phase import (
    ALT_BURSTS,
    ALT_LAMS,
    ALTERNATIVES,
    NOCACHE_LAM,
    NOCACHE_SEEDS,
    PAPER_BURST,
    PAPER_LAM,
    WARM_SEEDS,
    PhaseSpec,
    alternatives_figure,
    alternatives_page,
    alternatives_verdicts,
    cell_table,
    compute_bounds,
    expectations,
    figure,
    format_text,
    page,
    write_parquet,
)
from kvgate.errors import UsageError


def base_config(spec: PhaseSpec) -> Any:
    from kvgate.sim.config import SimConfig

    return SimConfig(preset=spec.preset, profile=spec.profile, engine=spec.engine, minutes=spec.minutes,
                     align_min=spec.burst_at + spec.burst_min).with_(**dict(spec.overrides))


def plan(spec: PhaseSpec) -> list[tuple[str, dict[str, Any], Any, bool]]:
    """(id, cell, config, keep records) for every grid run and the c(L) runs."""
    base = base_config(spec)
    out = []
    lo = min(spec.lams)
    for pool in spec.pools:
        for lam in spec.lams:
            for b in spec.bursts:
                bursts = (f"{b:g}@{spec.burst_at:g}+{spec.burst_min:g}",) if b > 0 else ()
                for seed in spec.seeds:
                    cfg = base.with_(lam=lam, bursts=bursts, seed=seed, kv_pool=pool)
                    rid = f"pool={pool or 'default'}/lam={lam:g}/burst={b:g}/seed={seed}"
                    cell = {"pool": pool, "lam": lam, "burst": b, "seed": seed}
                    out.append((rid, cell, cfg, b == 0 and lam == lo))  # R0 needs the records of these
    for pool in spec.pools:
        sat = base.with_(lam=2 * max(spec.lams), control="budgeter", kv_pool=pool, align_min=None)
        for seed in WARM_SEEDS:
            out.append(
                (
                    f"warm/pool={pool or 'default'}/seed={seed}",
                    {"warm": True, "pool": pool, "seed": seed},
                    sat.with_(seed=seed),
                    False,
                )
            )
    nc = base.with_(lam=NOCACHE_LAM, prefix_caching=False, bursts=("+16@15+5",), minutes=90.0, align_min=None)
    for seed in NOCACHE_SEEDS:
        out.append((f"nocache/seed={seed}", {"nocache": True, "seed": seed}, nc.with_(seed=seed), True))
    return out


def run_phase_map(spec: PhaseSpec, out: Path, *, progress: bool = True, jobs: int | None = None) -> dict[str, Any]:
    from kvgate.records import load_run
    from kvgate.sim.batch import run_many
    from kvgate.sim.config import validate

    runs = plan(spec)
    for rid, _, cfg, _ in runs:
        try:
            validate(cfg)
        except UsageError as e:
            raise UsageError(f"phase-map run {rid}: {e}") from None
    out.mkdir(parents=True, exist_ok=True)
    metas = run_many([(cfg, str(out / "runs" / rid), keep) for rid, _, cfg, keep in runs], jobs=jobs,
                     progress=progress, label=f"phase map ({len(runs)} runs)")
    cells: dict[tuple[Any, float, float], list[bool]] = {}
    warm: dict[Any, list[float]] = {}
    for (_, cell, _, _), meta in zip(runs, metas, strict=True):
        if cell.get("nocache"):
            continue
        if cell.get("warm"):
            warm.setdefault(cell["pool"], []).append(meta["summary"]["turns_per_s_last10"] or 0.0)
            continue
        key = (cell["pool"], cell["lam"], cell["burst"])
        cells.setdefault(key, []).append(bool(meta["summary"]["persistently_degraded"]))
    nc_runs = [load_run(out / "runs" / rid) for rid, cell, _, _ in runs if cell.get("nocache")]
    lo = min(spec.lams)
    r0_runs = [load_run(out / "runs" / rid) for rid, cell, _, keep in runs
               if keep and "lam" in cell and cell["lam"] == lo]
    bounds = {pool: compute_bounds(spec, pool, nc_runs, [r for r in r0_runs if r.config.get("kv_pool") == pool],
                                   warm.get(pool, [])) for pool in spec.pools}
    table = cell_table(spec, cells)
    checks = expectations(spec, cells, bounds)
    write_parquet(out / "phase-map.parquet", spec, cells)
    fig = figure(spec, cells, bounds, out / "phase-map")
    text = format_text(spec, cells, bounds, checks)
    (out / "index.md").write_text(page(spec, table, bounds, checks, fig.name))
    return {"cells": {f"{k[0]}/{k[1]:g}/{k[2]:g}": v for k, v in cells.items()}, "bounds": bounds,
            "expectations": checks, "text": text}


def plan_alternatives(quick: bool) -> tuple[list[tuple[str, dict[str, Any], Any]], tuple[int, ...]]:
    seeds = tuple(range(1, 5 if quick else 7))
    lams = ALT_LAMS
    bursts = (0.0, PAPER_BURST) if quick else ALT_BURSTS
    runs = []
    for name, over in ALTERNATIVES.items():
        spec = PhaseSpec(lams=lams, bursts=bursts, seeds=seeds, overrides=tuple(over.items()))
        for rid, cell, cfg, _ in plan(spec):
            if "lam" not in cell:
                continue  # the bounds' runs: not needed here
            runs.append((f"{name}/{rid}", {**cell, "alt": name, "control": "none"}, cfg))
        bursts_cfg = (f"{PAPER_BURST:g}@{spec.burst_at:g}+{spec.burst_min:g}",)
        for seed in seeds:
            cfg = base_config(spec).with_(lam=PAPER_LAM, bursts=bursts_cfg, seed=seed, control="budgeter")
            cell = {"alt": name, "control": "budgeter", "lam": PAPER_LAM, "burst": PAPER_BURST, "seed": seed}
            runs.append((f"{name}/budgeter/seed={seed}", cell, cfg))
    return runs, seeds


def run_alternatives(
    out: Path, *, quick: bool = False, progress: bool = True, jobs: int | None = None
) -> dict[str, Any]:
    """Every alternative on the same seeds as vanilla vLLM over a λ x burst slice of the phase map, and the
    paper's burst arm with and without the budgeter; writes OUT/index.md and OUT/engine-alternatives.png."""
    import tempfile

    from kvgate.sim.batch import run_many

    runs, seeds = plan_alternatives(quick)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="kvgate-engine-alt-") as tmp:  # run metadata only; the page keeps all
        metas = run_many([(cfg, str(Path(tmp) / rid), False) for rid, _, cfg in runs], jobs=jobs,
                         progress=progress, label=f"engine alternatives ({len(runs)} runs)")
    deg: dict[tuple[str, str, float, float, int], bool] = {}
    for (_, cell, _), meta in zip(runs, metas, strict=True):
        key = (cell["alt"], cell["control"], cell["lam"], cell["burst"], cell["seed"])
        deg[key] = bool(meta["summary"]["persistently_degraded"])
    lams, bursts, verdicts = alternatives_verdicts(deg, seeds)
    van_none = [deg[("vanilla", "none", PAPER_LAM, PAPER_BURST, s)] for s in seeds]
    van_bud = [deg[("vanilla", "budgeter", PAPER_LAM, PAPER_BURST, s)] for s in seeds]
    fig = alternatives_figure(deg, lams, bursts, seeds, out / "engine-alternatives")
    (out / "index.md").write_text(alternatives_page(verdicts, lams, bursts, seeds, quick, len(runs), van_none, van_bud,
                                            fig.name))
    return {"verdicts": [{k: v for k, v in x.items() if k != "fractions"} for x in verdicts], "runs": len(runs)}


@click.command("engine-alternatives")
@click.option("--quick", is_flag=True, help="Fewer seeds and cells (CI).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path),
              default=Path("docs/results/engine-alternatives"), show_default=True)
@click.option("--jobs", type=int, default=None, help="Parallel runs [default: all cores].")
def engine_alternatives_command(quick: bool, out: Path, jobs: int | None) -> None:
    """Each engine-side alternative of the simulated vLLM against vanilla on phase-map slices, with and without
    the budgeter; writes OUT/index.md and OUT/engine-alternatives.png."""
    res = run_alternatives(out, quick=quick, jobs=jobs)
    for v in res["verdicts"]:
        click.echo(
            f"{v['alternative']:<26} moves threshold: {v['direction'] if v['moves_threshold'] else 'no':<7} "
            f"(better/worse {v['better_pairs']}/{v['worse_pairs']}, p {v['p']:.3g}); budgeter matters: "
            f"{'yes' if v['budgeter_matters'] else 'no'} ({v['burst_none']:.2f} -> {v['burst_budgeter']:.2f})"
        )
    click.echo(f"page: {out / 'index.md'}")
