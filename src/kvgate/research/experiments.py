"""The experiments' commands: ``kvgate experiment``, ``reproduce``, ``report`` and ``drain``.

(They run the paper's experiments through the simulator's batches; their home is the experiments package.)
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import click

from kvgate.errors import UsageError
from kvgate.options import FINITE
from kvgate.sim.options import executor_options


def _print_verdicts(res: dict[str, dict[str, Any]], out: Path, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps({n: p["verdicts"] for n, p in res.items()}, sort_keys=True))
        return
    for n, p in res.items():
        v = p["verdicts"]
        click.echo(f"{n:<14} reproduced {v.get('reproduced', 0)}, differs {v.get('differs', 0)}, "
                   f"not reproduced {v.get('not reproduced', 0)}, calibrated {v.get('calibrated', 0)}")
    click.echo(f"index: {out / 'index.html'}")


@click.command()
@click.argument("name")
@click.option("--quick", is_flag=True, help="Reduced version (fewer seeds, shorter runs) that keeps the claim.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("kvgate-results"),
              show_default=True, help="Records, figures and pages go under OUT/NAME.")
@click.option("--jobs", type=int, default=None, help="Parallel runs [default: all cores].")
@click.option("--json", "as_json", is_flag=True)
@executor_options
def experiment(name: str, quick: bool, out: Path, jobs: int | None, as_json: bool) -> None:
    """Run one experiment and write its page (the expected figure vs kvgate's, claim by claim).

    \b
    NAME: the paper's Table 1: paired-8b, no-cache, flush, trigger-size, trace-32b, sglang, recovery-8b,
          recovery-32b, mix-shift, thresholds, prevention, cpu-offload, drain;
          kvgate's fleet claims: fleet-burst, fleet-failure, fleet-thrash, fleet-prevention, fleet-recovery;
          analyses: offload-sweep, sensitivity, gateway-sizing;
          real-vllm (on the real CPU vLLM, in real time: about 75 minutes, --quick about 6),
          real-sglang (the same on a real SGLang's CPU engine: about 70 minutes, --quick about 6)
    """
    if name in ("real-vllm", "real-sglang"):
        if name == "real-vllm":
            from kvgate.realvllm.experiment import run as run_real
        else:
            from kvgate.realsglang.experiment import run as run_real

        page = run_real(out / name, quick=quick, progress=None if as_json else (lambda m: click.echo(m, err=True)))
        if as_json:
            click.echo(json.dumps(page["claims"], sort_keys=True))
            return
        for c in page["claims"]:
            click.echo(f"[{c['verdict']}] {c['claim']}: {c['measured']}")
        click.echo(f"page: {out / name / 'index.md'}")
        return
    from kvgate.experiments.runner import get, run_experiments

    get(name)
    res = run_experiments([name], out, quick=quick, jobs=jobs, progress=not as_json)
    page = res[name]
    if as_json:
        click.echo(json.dumps(page, sort_keys=True))
        return
    for c in page["claims"]:
        click.echo(f"[{c['verdict']}] {c['claim']}: paper {c['paper']}; kvgate {c['kvgate']}")
    click.echo(f"page: {out / name / 'index.html'}")


@click.command()
@click.option("--quick", is_flag=True, help="Reduced versions of every experiment (for CI).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("kvgate-results"),
              show_default=True)
@click.option("--only", default=None, help="Comma-separated subset of experiments.")
@click.option("--jobs", type=int, default=None, help="Parallel runs [default: all cores].")
@click.option("--json", "as_json", is_flag=True)
@executor_options
def reproduce(quick: bool, out: Path, only: str | None, jobs: int | None, as_json: bool) -> None:
    """Every experiment of the paper, in parallel across cores, resumable; writes OUT/index.html."""
    from kvgate.experiments.catalog import EXPERIMENTS
    from kvgate.experiments.runner import get, run_experiments

    if only is not None and not only.strip():
        raise UsageError("--only: no experiments given (leave it out to run them all)")
    names = [n.strip() for n in only.split(",")] if only is not None else list(EXPERIMENTS)
    for n in names:
        get(n)
    res = run_experiments(names, out, quick=quick, jobs=jobs, progress=not as_json)
    _print_verdicts(res, out, as_json)


@click.command()
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True)
def report(out: Path, as_json: bool) -> None:
    """Rebuild every experiment page and figure under OUT from its records, without running anything."""
    from kvgate.experiments.runner import report as rebuild

    res = rebuild(out)
    _print_verdicts(res, out, as_json)


@click.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--cost", default=None, metavar="A,B",
              help="Use c(L) = A s + B ms x L instead of fitting it on cache-disabled runs.")
@click.option("--from-min", type=FINITE, default=None,
              help="Fit the drift from this minute [default: 10 min after the run's rate change].")
@click.option("--json", "as_json", is_flag=True)
def drain(runs: tuple[Path, ...], cost: str | None, from_min: float | None, as_json: bool) -> None:
    """The drain condition (§4): fit c(L) on cache-disabled runs, print S and 1/S, and for collapsed runs whose
    rate was lowered (--rate-at) the drift of the remaining cold work in engine-seconds per hour."""
    from kvgate.analysis.drain import ColdCost, cold_work_per_session, drift_per_hour, fit_cold_cost
    from kvgate.experiments.common import session_prompts
    from kvgate.records import iter_runs

    loaded = list(iter_runs(runs))
    nocache = [r for r in loaded if r.config.get("prefix_caching") is False]
    if cost:
        try:
            a, b = (float(x) for x in cost.split(","))
        except ValueError:
            raise UsageError(f"malformed --cost {cost!r}: expected A,B (seconds, ms per token)") from None
        if not (math.isfinite(a) and math.isfinite(b) and b > 0):  # (A may be negative: the paper's own is)
            raise UsageError(f"--cost {cost!r}: A and B finite, B (ms per token) positive")
        c = ColdCost(a, b / 1000.0, 0)
    elif nocache:
        c = fit_cold_cost(nocache)
        if c.windows < 2:
            raise UsageError("too few 2-minute windows with >= 4 requests running in the cache-disabled runs")
    else:
        raise UsageError("no cache-disabled runs among the inputs to fit c(L) from; pass --cost A,B")
    from kvgate.workload.config import WorkloadConfig
    from kvgate.workload.triggers import RateChange, triggers_of

    s_cold = cold_work_per_session(c, WorkloadConfig.from_dict(loaded[0].config).workload())
    drifts = []
    for r in loaded:
        changes = sorted((t for t in triggers_of(r.config) if isinstance(t, RateChange)), key=lambda t: t.at_min)
        if not changes or r.config.get("prefix_caching") is False:
            continue
        t_change = changes[-1].at_s
        start = from_min * 60 if from_min is not None else t_change + 600
        end = float(r.config["minutes"]) * 60
        lam_after = changes[-1].lam
        drifts.append({"run": str(r.path), "lam_after": lam_after, "seed": r.config.get("seed"),
                       "drift_engine_s_per_h": round(drift_per_hour(r, c, start, end, session_prompts(r)), 1),
                       "collapsed": bool(r.summary.get("persistently_degraded"))})
    res = {
        "c_intercept_s": round(c.intercept_s, 4),
        "c_slope_ms_per_token": round(c.slope_ms_per_token, 5),
        "windows": c.windows,
        "S_engine_s": round(s_cold, 2),
        "inv_S_sessions_per_s": round(1.0 / s_cold, 5),
        "drift": drifts,
    }
    if as_json:
        click.echo(json.dumps(res, sort_keys=True))
        return
    click.echo(f"c(L) = {c.intercept_s:+.3f} s + {c.slope_ms_per_token:.4f} ms x L   ({c.windows} windows)")
    click.echo(f"S = {s_cold:.1f} engine-seconds per session; 1/S = {1 / s_cold:.4f} sessions/s")
    for d in drifts:
        click.echo(f"  lambda -> {d['lam_after']:<6} seed {d['seed']}: remaining cold work "
                   f"{d['drift_engine_s_per_h']:+.0f} engine-s/h")
