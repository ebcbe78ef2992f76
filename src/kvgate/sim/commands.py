"""The simulator's commands: ``kvgate sim``, ``paired``, ``arms``, ``demo``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import click

from kvgate.errors import UsageError
from kvgate.sim.options import batch_options, config_from, sim_options


@click.command()
@sim_options
@click.option("--seed", type=click.IntRange(min=0), default=501, show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write the run's records (Parquet + run.json) here.")
@click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object.")
def sim(seed: int, out: Path | None, as_json: bool, **kw: Any) -> None:
    """Run one simulated experiment and print its summary."""
    from kvgate.records import write_run
    from kvgate.sim.runner import simulate

    cfg = config_from(kw, seed=seed)
    res = simulate(cfg)
    if out is not None:
        write_run(out, res.meta, res.tables)
    s = res.meta["summary"]
    if as_json:
        click.echo(json.dumps(s, sort_keys=True))
        return
    _print_summary(s, out)


def _print_summary(s: dict[str, Any], out: Path | None) -> None:
    deg = f"yes, from minute {s['degraded_from_min']}" if s["persistently_degraded"] else "no"
    rows = [
        ("hit ratio, last 10 min", s["hit_ratio_last10"]),
        ("sessions in system, last 5 min", s["sessions_in_system_last5"]),
        ("turns/s, last 10 min", s["turns_per_s_last10"]),
        ("persistently degraded", deg),
        ("sessions arrived / finished", f"{s['sessions_arrived']} / {s['sessions_finished']}"),
        ("preemptions", s["preemptions"]),
        ("wall time (s)", s["wall_s"]),
    ]
    for k in ("control", "recovered", "recovery_min", "parks"):
        if k in s:
            rows.append((k, s[k]))
    fleet = s.get("fleet")
    if fleet:
        rows.append(("router", fleet["router"]))
        rows.append(("replicas degraded", f"{fleet['replicas_degraded']} of {fleet['replicas']}"))
        failed = {f[0] if isinstance(f, list | tuple) else f for f in fleet.get("failed_replicas", [])}
        for r in s.get("replicas", []):
            deg_r = "failed" if r["replica"] in failed else "degraded" if r["persistently_degraded"] else "healthy"
            rows.append((f"  replica {r['replica']}", f"hit ratio {r['hit_ratio_last10']}, {deg_r}"))
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        click.echo(f"{k:<{w}}  {v}")
    if out is not None:
        click.echo(f"records: {out}")


@click.command()
@sim_options
@batch_options("501-512", "Seeds, e.g. 501-512 or 1,3,5.")
def paired(seeds: str, jobs: int | None, out: Path | None, as_json: bool, **kw: Any) -> None:
    """Both arms of each seed, with and without the triggers under test (--burst, --flush-at, ...), identical base
    arrivals.

    Prints a table like the paper's Table 2, the discordant-pair counts and the two-sided sign test.
    """
    from kvgate.sim.batch import parse_seeds
    from kvgate.sim.paired import run_paired
    from kvgate.workload.triggers import REGISTRY, trigger_end_min

    cfg = config_from(kw)
    if trigger_end_min(cfg) is None:
        under_test = ", ".join(c.option for c in REGISTRY.values() if c.experiment)
        raise UsageError(f"paired needs a trigger under test: {under_test}")
    res = run_paired(cfg, parse_seeds(seeds), out=out, jobs=jobs, progress=not as_json)
    if as_json:
        click.echo(json.dumps(res, sort_keys=True))
        return
    from kvgate.sim.paired import format_paired

    click.echo(format_paired(res))


@click.command()
@sim_options
@batch_options("1-16", "Seeds, e.g. 1-16.")
def arms(seeds: str, jobs: int | None, out: Path | None, as_json: bool, **kw: Any) -> None:
    """Every control arm on every seed with identical arrivals (the paper's Table 3).

    --control takes a comma-separated list of arms NAME[:k=v[:k=v]], e.g.
    none,admission-cap,aimd,cap,budgeter or cap:K=22:K_hi=25,budgeter:low=0.65:high=0.85.
    """
    from kvgate.sim.arms import format_arms, run_arms
    from kvgate.sim.batch import parse_seeds

    specs = [s.strip() for s in kw["control"].split(",") if s.strip()]
    if not specs:
        raise UsageError("--control needs at least one arm")
    from kvgate.sim.arms import arm_config

    cfg = config_from(dict(kw, control="none", control_opt=""))
    for spec in specs:
        c = arm_config(cfg, spec, 0)
        from kvgate.sim.config import validate

        validate(c)
    res = run_arms(cfg, specs, parse_seeds(seeds), out=out, jobs=jobs, progress=not as_json)
    if as_json:
        res = dict(res)
        res.pop("per_run", None)
        click.echo(json.dumps(res, sort_keys=True))
        return
    click.echo(format_arms(res))


@click.command()
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("kvgate-demo"),
              show_default=True, help="Where to write the figure and records.")
@click.option("--seed", type=click.IntRange(min=0), default=501, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def demo(out: Path, seed: int, as_json: bool) -> None:
    """Figure 1 of the paper: the same arrivals with and without a 5-minute burst (lambda = 0.035, +1.5 lambda)."""
    from kvgate.sim.demo import run_demo

    res = run_demo(out, seed, progress=not as_json)
    if as_json:
        click.echo(json.dumps(res, sort_keys=True))
        return
    click.echo(res["text"])
