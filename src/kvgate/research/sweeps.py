"""The commands that run grids of simulations: ``kvgate sweep``, ``kvgate phase-map`` and ``kvgate escape``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import click

from kvgate.errors import UsageError
from kvgate.options import FINITE
from kvgate.sim.options import executor_options


def _floats(text: str, what: str) -> list[float]:
    """``0.02,0.03`` or ``0.02:0.05:0.005`` (start:stop:step, stop included)."""
    try:
        if ":" in text:
            a, b, c = (float(x) for x in text.split(":"))
            if not (c > 0 and b >= a and math.isfinite(b) and math.isfinite(a)) or (b - a) / c > 100_000:
                raise ValueError
            n = int(round((b - a) / c))
            return [round(a + i * c, 10) for i in range(n + 1)]
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--{what} {text!r}: expected a list (0.02,0.03) or a range START:STOP:STEP") from None
    if not vals:
        raise UsageError(f"--{what}: no values")
    if not all(math.isfinite(v) and v >= 0 for v in vals) or (what == "pool" and min(vals) <= 0):
        least = "above 0" if what == "pool" else "at least 0"
        raise UsageError(f"--{what} {text!r}: expected finite values, {least}")
    return vals


@click.command()
@click.argument("spec", required=False, type=click.Path(dir_okay=False, exists=True, path_type=Path))
@click.option("--set", "sets", multiple=True, metavar="FIELD=VALUE", help="Base config field. Repeatable.")
@click.option("--grid", "grids", multiple=True, metavar="FIELD=V1,V2,...",
              help="Swept field and its values (seed=1-12 for a seed range). Repeatable.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
              help="Run directories and sweep.parquet go here (resumable).")
@click.option("--records", is_flag=True, help="Keep every run's records, not only its run.json.")
@click.option("--jobs", type=int, default=None, help="Parallel runs [default: all cores].")
@click.option("--dry-run", is_flag=True, help="List the runs and exit.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
@executor_options
def sweep(spec: Path | None, sets: tuple[str, ...], grids: tuple[str, ...], out: Path, records: bool,
          jobs: int | None, dry_run: bool, as_json: bool) -> None:
    """A grid of simulated runs from a TOML/JSON SPEC and/or flags; one Parquet row per run (config + summary).

    \b
    SPEC:   [base] any sim config field = value;  [grid] field = [values]
    e.g.    kvgate sweep --set minutes=60 --grid lam=0.03,0.04 --grid bursts=,1.5@15+5 --grid seed=1-12 --out sw/
    """
    from kvgate.sim.sweep import from_flags, load_spec, run_sweep

    sw = from_flags(load_spec(spec) if spec else None, sets, grids)
    if dry_run:
        runs = sw.runs()
        if as_json:
            click.echo(json.dumps({"runs": [rid for rid, _, _ in runs]}))
        else:
            for rid, _, _ in runs:
                click.echo(rid)
            click.echo(f"{len(runs)} runs")
        return
    table = run_sweep(sw, out, records=records, progress=not as_json, jobs=jobs)
    deg = table.column("s_persistently_degraded").to_pylist() if "s_persistently_degraded" in table.column_names \
        else []
    res: dict[str, Any] = {"runs": table.num_rows, "persistently_degraded": sum(bool(x) for x in deg),
                           "table": str(out / "sweep.parquet")}
    if as_json:
        click.echo(json.dumps(res, sort_keys=True))
        return
    click.echo(f"{res['runs']} runs, {res['persistently_degraded']} persistently degraded; table: {res['table']}")


@click.command("phase-map")
@click.option("--lam", "lams", default="0.020:0.050:0.005", show_default=True, help="Arrival rates (list or range).")
@click.option("--burst", "bursts", default="0:3:0.5", show_default=True,
              help="Burst sizes as multiples of λ (0: no burst), list or range.")
@click.option("--burst-at", type=FINITE, default=15.0, show_default=True, help="Burst start (minute).")
@click.option("--burst-min", type=FINITE, default=5.0, show_default=True, help="Burst length (minutes).")
@click.option("--pool", "pools", default=None, help="KV pools in tokens, a third axis (list) [default: the profile's].")
@click.option("--seeds", default="1-12", show_default=True)
@click.option("--minutes", type=FINITE, default=60.0, show_default=True)
@click.option("--preset", default="paper-8b", show_default=True)
@click.option("--profile", default="qwen3-8b-mi300x", show_default=True)
@click.option("--engine", type=click.Choice(["vllm", "sglang"]), default="vllm", show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("kvgate-phase-map"),
              show_default=True)
@click.option("--jobs", type=int, default=None, help="Parallel runs [default: all cores].")
@click.option("--json", "as_json", is_flag=True)
@executor_options
def phase_map(lams: str, bursts: str, burst_at: float, burst_min: float, pools: str | None, seeds: str,
              minutes: float, preset: str, profile: str, engine: str, out: Path, jobs: int | None,
              as_json: bool) -> None:
    """λ x trigger size (x pool) -> fraction of seeds persistently degraded, with the drain bound 1/S and the
    healthy-side bound overlaid; writes OUT/index.md, OUT/phase-map.png and OUT/phase-map.parquet."""
    from kvgate.analysis.phase import PhaseSpec
    from kvgate.experiments.phase_map import run_phase_map
    from kvgate.sim.batch import parse_seeds

    pool_axis = tuple(int(p) for p in _floats(pools, "pool")) if pools else (None,)
    spec = PhaseSpec(tuple(_floats(lams, "lam")), tuple(_floats(bursts, "burst")), pool_axis,
                     tuple(parse_seeds(seeds)), burst_at=burst_at, burst_min=burst_min, minutes=minutes,
                     preset=preset, profile=profile, engine=engine)
    _echo_page(run_phase_map(spec, out, progress=not as_json, jobs=jobs), out, as_json)


@click.command()
@click.option("--lam", "lams", default="0.035,0.040,0.045", show_default=True, help="Arrival rates (list or range).")
@click.option("--runs", type=int, default=200, show_default=True, help="Runs (seeds) per λ.")
@click.option("--minutes", type=FINITE, default=240.0, show_default=True, help="Length of each run (censoring time).")
@click.option("--preset", default="paper-8b", show_default=True)
@click.option("--profile", default="qwen3-8b-mi300x", show_default=True)
@click.option("--engine", type=click.Choice(["vllm", "sglang"]), default="vllm", show_default=True)
@click.option("--kv-pool", type=click.IntRange(min=1), default=None, help="KV pool in tokens [default: the profile's].")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("kvgate-escape"),
              show_default=True)
@click.option("--jobs", type=int, default=None, help="Parallel runs [default: all cores].")
@click.option("--json", "as_json", is_flag=True)
@executor_options
def escape(lams: str, runs: int, minutes: float, preset: str, profile: str, engine: str, kv_pool: int | None,
           out: Path, jobs: int | None, as_json: bool) -> None:
    """Time to spontaneous collapse of the healthy regime vs λ, from many trigger-free runs: Kaplan-Meier for
    the censored runs, the mean escape time with a confidence interval, beside a Poisson fluctuation estimate."""
    from kvgate.analysis.escape import EscapeSpec
    from kvgate.experiments.escape_times import run_escape

    if runs < 2:
        raise UsageError("--runs must be at least 2")
    spec = EscapeSpec(lams=tuple(_floats(lams, "lam")), runs=runs, minutes=minutes, preset=preset, profile=profile,
                      engine=engine, kv_pool=kv_pool)
    _echo_page(run_escape(spec, out, progress=not as_json, jobs=jobs), out, as_json)


def _echo_page(res: dict[str, Any], out: Path, as_json: bool) -> None:
    """A result that wrote a page under ``out``: as JSON, or its text and where the page is."""
    if as_json:
        click.echo(json.dumps(res, sort_keys=True, default=str))
        return
    click.echo(res["text"])
    click.echo(f"page: {out / 'index.md'}")
