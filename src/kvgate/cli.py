"""The ``kvgate`` command line.

Every command prints a human summary by default and one JSON object with ``--json``. Bad input gets a one-line
``kvgate: error: ...`` on stderr and exit status 2; no command prints a traceback for a user mistake.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from kvgate import __version__
from kvgate.errors import UsageError


def _fail(msg: str) -> None:
    click.echo(f"kvgate: error: {msg}", err=True)
    sys.exit(2)


def sim_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """Options shared by every command that runs the simulator."""
    opts = [
        click.option("--preset", default="paper-8b", show_default=True, help="Workload preset: paper-8b, paper-shift."),
        click.option("--trace", default=None, help="Replay trace shapes (kvgate JSONL) instead; 'bundled' for the "
                     "packaged mini-SWE-agent set."),
        click.option("--max-context", type=int, default=None, help="Truncate trace sessions at this context "
                     "[default: 38000]."),
        click.option("--lam", type=float, default=0.035, show_default=True, help="Base session arrival rate (1/s)."),
        click.option("--minutes", type=float, default=90.0, show_default=True, help="Run length (simulated)."),
        click.option("--burst", "bursts", multiple=True, metavar="X@S+D",
                     help="Extra Poisson stream at X*lam from minute S for D minutes (+N@S+D: N extra sessions). "
                     "Repeatable."),
        click.option("--flush-at", type=float, default=None, metavar="MIN",
                     help="Flush the prefix cache (preempting running requests) at this minute."),
        click.option("--rate-at", "rate_at", multiple=True, metavar="MIN:LAM",
                     help="Change the base arrival rate at a minute. Repeatable."),
        click.option("--engine", type=click.Choice(["vllm", "sglang"]), default="vllm", show_default=True),
        click.option("--profile", default="qwen3-8b-mi300x", show_default=True,
                     help="Engine cost profile: a name, or a .json file from kvgate calibrate --endpoint."),
        click.option("--kv-pool", type=int, default=None, help="KV pool in tokens [default: the profile's]."),
        click.option("--no-prefix-cache", is_flag=True, help="Disable prefix caching."),
        click.option("--cpu-offload-tokens", type=int, default=0, help="Host KV tier size in tokens (vllm)."),
        click.option("--offload-bandwidth", "offload_bandwidth_gbs", type=float, default=50.0, show_default=True,
                     metavar="GB/S", help="Effective host-to-GPU bandwidth of the offload tier."),
        click.option("--offload-latency", "offload_latency_s", type=float, default=0.015, show_default=True,
                     metavar="S", help="Fixed latency of one host-to-GPU load (seconds per request)."),
        click.option("--block-size", type=int, default=16, show_default=True,
                     help="KV block size of the simulated vLLM in tokens (its CPU build uses 128)."),
        click.option("--evict-sessions", is_flag=True,
                     help="Engine alternative (vllm): evict parked and ended sessions' cached blocks first."),
        click.option("--retention", is_flag=True,
                     help="Engine alternative (vllm): evict longer contexts' cached blocks last."),
        click.option("--pin-ttl", "pin_ttl_s", type=click.FloatRange(min=0), default=0.0, metavar="S",
                     help="Engine alternative (vllm): pin a finished turn's blocks for S seconds [default: off]."),
        click.option("--prefix-first", type=click.IntRange(min=0), default=0, metavar="N",
                     help="Engine alternative (vllm): admit the first N waiting requests by cached fraction."),
        click.option("--sglang-policy", type=click.Choice(["fcfs", "lpm"]), default="fcfs", show_default=True),
        click.option("--control", default="none", show_default=True,
                     help="Gateway controller: none, budgeter, cap, adaptive-cap, aimd, admission-cap, thunder."),
        click.option("--control-at", type=float, default=None, metavar="MIN",
                     help="Minute the controller starts (before it: none) [default: from the start]."),
        click.option("--control-opt", default="", metavar="K=V,...", help="Controller parameters, e.g. K=22,K_hi=25."),
        click.option("--client-timeout", "client_timeout_s", type=float, default=None, metavar="S",
                     help="Agent-side timeout of one attempt of a turn [default: none]."),
        click.option("--client-retries", type=int, default=0, show_default=True,
                     help="Retries of a timed-out turn before the agent gives up its session."),
        click.option("--retry-backoff", "retry_backoff_s", type=float, default=2.0, show_default=True, metavar="S",
                     help="Backoff before the first retry (doubles per retry)."),
        click.option("--retry-jitter", type=float, default=0.5, show_default=True,
                     help="Backoff jitter: each wait times 1 ± this, drawn per attempt."),
    ]  # fmt: skip
    for o in reversed(opts):
        f = o(f)
    return f


def executor_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--executor local|ray`` and ``--ray-address`` for a command that runs batches of simulations: the
    command body runs with that executor installed (``kvgate.sim.executor.executing``)."""
    import functools

    @functools.wraps(f)
    def wrapper(*args: Any, executor: str, ray_address: str | None, **kw: Any) -> Any:
        from kvgate.sim.executor import Executor, executing

        with executing(Executor(executor, jobs=kw.get("jobs"), address=ray_address)):
            return f(*args, **kw)

    wrapper = click.option("--ray-address", default=None, metavar="ADDR",
                           help="Ray cluster to join (e.g. ray://head:10001) [default: start a local Ray].")(wrapper)
    return click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
                        help="Where runs execute: forked local processes, or Ray tasks.")(wrapper)  # fmt: skip


def config_from(kw: dict[str, Any], **over: Any) -> Any:
    from kvgate.sim.runner import SimConfig

    cfg = SimConfig(
        preset=kw["preset"],
        trace=kw["trace"],
        max_context=kw["max_context"],
        lam=kw["lam"],
        minutes=kw["minutes"],
        bursts=tuple(kw["bursts"]),
        flush_at=kw["flush_at"],
        rate_at=tuple(kw["rate_at"]),
        engine=kw["engine"],
        profile=kw["profile"],
        kv_pool=kw["kv_pool"],
        prefix_caching=not kw["no_prefix_cache"],
        cpu_offload_tokens=kw["cpu_offload_tokens"],
        offload_bandwidth_gbs=kw["offload_bandwidth_gbs"],
        offload_latency_s=kw["offload_latency_s"],
        block_size=kw["block_size"],
        sglang_policy=kw["sglang_policy"],
        evict_sessions=kw.get("evict_sessions", False),
        retention=kw.get("retention", False),
        pin_ttl_s=kw.get("pin_ttl_s", 0.0),
        prefix_first=kw.get("prefix_first", 0),
        control=kw["control"],
        control_at=kw["control_at"],
        control_opt=kw["control_opt"],
        client_timeout_s=kw["client_timeout_s"],
        client_retries=kw["client_retries"],
        retry_backoff_s=kw["retry_backoff_s"],
        retry_jitter=kw["retry_jitter"],
    )
    if over:
        cfg = cfg.with_(**over)
    from kvgate.sim.runner import validate

    validate(cfg)
    return cfg


class _LazyGroup(click.Group):
    """Commands with heavy imports (the HTTP servers and driver) are loaded only when used."""

    LAZY = {
        "engine": ("kvgate.http.engine_server", "command"),
        "drive": ("kvgate.http.driver", "command"),
        "gateway": ("kvgate.http.gateway", "command"),
        "summary": ("kvgate.http.runs", "command"),
        "sweep": ("kvgate.sim.sweep_cli", "sweep"),
        "phase-map": ("kvgate.sim.sweep_cli", "phase_map"),
        "escape": ("kvgate.sim.sweep_cli", "escape"),
        "engine-alternatives": ("kvgate.analysis.phase", "engine_alternatives_command"),
        "real-vllm": ("kvgate.realvllm.command", "command"),
        "doctor": ("kvgate.doctor", "command"),
    }

    def list_commands(self, ctx: click.Context) -> list[str]:
        names = set(super().list_commands(ctx))
        names.update(n for n, (mod, _) in self.LAZY.items() if importlib.util.find_spec(mod) is not None)
        return sorted(names)

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in self.LAZY:
            mod, attr = self.LAZY[name]
            if importlib.util.find_spec(mod) is None:
                return None
            cmd = getattr(importlib.import_module(mod), attr)
            assert isinstance(cmd, click.Command)
            return cmd
        return super().get_command(ctx, name)


@click.group(cls=_LazyGroup, context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.version_option(__version__, prog_name="kvgate")
def cli() -> None:
    """kvgate: keep prefix-cached LLM engines serving agent sessions out of the metastable degraded regime.

    \b
    Simulate the paper's experiments on a laptop:
      kvgate demo                          Figure 1 (a burst that outlasts itself) in seconds
      kvgate sim --burst 1.5@15+5          one simulated run
      kvgate paired --seeds 501-512 ...    paired runs with and without a trigger, sign test
      kvgate arms --control none,budgeter  controllers side by side on identical arrivals
      kvgate reproduce                     every experiment of the paper, with pages and figures
      kvgate calibrate                     the engine profile against the paper's measurements
    \b
    Over HTTP:
      kvgate engine                        a vLLM-compatible simulated engine in scaled real time
      kvgate drive --endpoint URL          closed-loop agent sessions against any OpenAI endpoint
      kvgate gateway --upstream URL        the gateway that parks sessions against the KV budget
      kvgate summary RUN_DIR...            the summary (and figures) of simulated or driven runs
    """


@cli.command()
@sim_options
@click.option("--seed", type=int, default=501, show_default=True)
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write the run's records (Parquet + run.json) here.")  # fmt: skip
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
    w = max(len(k) for k, _ in rows)
    for k, v in rows:
        click.echo(f"{k:<{w}}  {v}")
    if out is not None:
        click.echo(f"records: {out}")


@cli.command()
@sim_options
@click.option("--seeds", default="501-512", show_default=True, help="Seeds, e.g. 501-512 or 1,3,5.")
@click.option("--jobs", type=int, default=None, help="Parallel runs [default: all cores].")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write every run's records under this directory (resumable).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
@executor_options
def paired(seeds: str, jobs: int | None, out: Path | None, as_json: bool, **kw: Any) -> None:
    """Both arms of each seed, with and without the trigger (--burst / --flush-at), identical base arrivals.

    Prints a table like the paper's Table 2, the discordant-pair counts and the two-sided sign test.
    """
    from kvgate.sim.paired import run_paired

    if not kw["bursts"] and kw["flush_at"] is None:
        raise UsageError("paired needs a trigger: --burst or --flush-at")
    from kvgate.sim.batch import parse_seeds

    cfg = config_from(kw)
    res = run_paired(cfg, parse_seeds(seeds), out=out, jobs=jobs, progress=not as_json)
    if as_json:
        click.echo(json.dumps(res, sort_keys=True))
        return
    from kvgate.sim.paired import format_paired

    click.echo(format_paired(res))


@cli.command()
@sim_options
@click.option("--seeds", default="1-16", show_default=True, help="Seeds, e.g. 1-16.")
@click.option("--jobs", type=int, default=None, help="Parallel runs [default: all cores].")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write every run's records under this directory (resumable).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object.")
@executor_options
def arms(seeds: str, jobs: int | None, out: Path | None, as_json: bool, **kw: Any) -> None:
    """Every controller arm on every seed with identical arrivals (the paper's Table 3).

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
        from kvgate.sim.runner import validate

        validate(c)
    res = run_arms(cfg, specs, parse_seeds(seeds), out=out, jobs=jobs, progress=not as_json)
    if as_json:
        res = dict(res)
        res.pop("per_run", None)
        click.echo(json.dumps(res, sort_keys=True))
        return
    click.echo(format_arms(res))


@cli.command()
@click.option("--profile", default="qwen3-8b-mi300x", show_default=True)
@click.option("--json", "as_json", is_flag=True)
@click.option("--quick", is_flag=True, help="Shorter runs for the load-dependent targets (fewer measurements "
              "with --endpoint).")  # fmt: skip
@click.option("--endpoint", default=None, metavar="URL",
              help="Measure this live vLLM-compatible server instead and fit a profile for it.")  # fmt: skip
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="With --endpoint: write the fitted profile here (usable as --profile FILE).")  # fmt: skip
@click.option("--name", default=None, help="With --endpoint: the fitted profile's name [default: from the model].")
@click.option("--note", default="", help="With --endpoint: a note stored in the profile (machine, server flags).")
@click.option("--time-scale", type=float, default=1.0, show_default=True,
              help="With --endpoint: virtual seconds per real second of the server (kvgate engine's).")  # fmt: skip
@click.option("--max-num-batched-tokens", type=int, default=None,
              help="With --endpoint: the server's step budget when /server_info does not tell it.")  # fmt: skip
@click.option("--max-num-seqs", type=int, default=None,
              help="With --endpoint: the server's batch limit when /server_info does not tell it.")  # fmt: skip
@click.option("--api-key", envvar="KVGATE_API_KEY", default=None, help="Bearer token [env: KVGATE_API_KEY].")
def calibrate(
    profile: str, as_json: bool, quick: bool, endpoint: str | None, out: Path | None, name: str | None, note: str,
    time_scale: float, max_num_batched_tokens: int | None, max_num_seqs: int | None, api_key: str | None,
) -> None:  # fmt: skip
    """Micro-experiments on the simulated engine beside the paper's measurements (ok/off per target).

    \b
    With --endpoint URL: measure a live vLLM (cold and incremental prefill, decode by batch size, a
    c(L) load of all-miss turns), fit the cost model's constants and write a profile file:
      kvgate calibrate --endpoint http://127.0.0.1:8000 --out my-engine.json
      kvgate sim --profile my-engine.json --block-size 128 ...
    """
    if endpoint is not None:
        from kvgate.engine.costmodel import save_profile
        from kvgate.sim.calibrate_endpoint import format_report, run

        prof, cal = run(
            endpoint, name=name, quick=quick, time_scale=time_scale, max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs, api_key=api_key, note=note,
            progress=None if as_json else (lambda m: click.echo(m, err=True)),
        )  # fmt: skip
        if out is not None:
            save_profile(prof, out, cal)
        if as_json:
            from kvgate.engine.costmodel import profile_to_dict

            click.echo(json.dumps(profile_to_dict(prof, cal), sort_keys=True))
            return
        click.echo(format_report(prof, cal))
        if out is not None:
            click.echo(f"profile: {out}")
        return
    if out is not None or name is not None:
        raise UsageError("--out and --name need --endpoint")
    from kvgate.sim.calibrate import format_targets, run_calibration

    targets = run_calibration(profile, quick=quick, progress=not as_json)
    if as_json:
        click.echo(json.dumps({"profile": profile, "targets": targets}, sort_keys=True))
        return
    click.echo(format_targets(profile, targets))


@cli.command()
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("kvgate-demo"),
              show_default=True, help="Where to write the figure and records.")  # fmt: skip
@click.option("--seed", type=int, default=501, show_default=True)
@click.option("--json", "as_json", is_flag=True)
def demo(out: Path, seed: int, as_json: bool) -> None:
    """Figure 1 of the paper: the same arrivals with and without a 5-minute burst (lambda = 0.035, +1.5 lambda)."""
    from kvgate.sim.demo import run_demo

    res = run_demo(out, seed, progress=not as_json)
    if as_json:
        click.echo(json.dumps(res, sort_keys=True))
        return
    click.echo(res["text"])


@cli.command("import-trace")
@click.argument("src", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("dst", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--shared-tokens", type=int, default=1200, show_default=True,
              help="Tokens of the prefix every session shares (mini-SWE-agent's prompt without the task, "
                   "as the paper replays it with the task last).")  # fmt: skip
@click.option("--json", "as_json", is_flag=True)
def import_trace(src: Path, dst: Path, shared_tokens: int, as_json: bool) -> None:
    """Convert mini-SWE-agent usage traces (shared/data/*.jsonl: calls of [t, prompt, completion, cached])
    into kvgate's trace-shape JSONL (docs/trace-format.md), for --trace."""
    from kvgate.workload.trace import import_mini_swe_agent

    stats = import_mini_swe_agent(src, dst, shared_tokens=shared_tokens)
    if as_json:
        click.echo(json.dumps(stats, sort_keys=True, default=str))
        return
    for k, v in stats.items():
        click.echo(f"{k:<32} {v}")


def _print_verdicts(res: dict[str, dict[str, Any]], out: Path, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps({n: p["verdicts"] for n, p in res.items()}, sort_keys=True))
        return
    for n, p in res.items():
        v = p["verdicts"]
        click.echo(f"{n:<14} reproduced {v.get('reproduced', 0)}, differs {v.get('differs', 0)}, "
                   f"not reproduced {v.get('not reproduced', 0)}, calibrated {v.get('calibrated', 0)}")  # fmt: skip
    click.echo(f"index: {out / 'index.html'}")


@cli.command()
@click.argument("name")
@click.option("--quick", is_flag=True, help="Reduced version (fewer seeds, shorter runs) that keeps the claim.")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("kvgate-results"),
              show_default=True, help="Records, figures and pages go under OUT/NAME.")  # fmt: skip
@click.option("--jobs", type=int, default=None, help="Parallel runs [default: all cores].")
@click.option("--json", "as_json", is_flag=True)
@executor_options
def experiment(name: str, quick: bool, out: Path, jobs: int | None, as_json: bool) -> None:
    """Run one experiment of the paper's Table 1 and write its page (paper vs kvgate, claim by claim).

    \b
    NAME: paired-8b, no-cache, flush, trigger-size, trace-32b, sglang, recovery-8b, recovery-32b,
          mix-shift, thresholds, prevention, cpu-offload, drain; analyses: offload-sweep, sensitivity;
          real-vllm (on the real CPU vLLM, in real time: about 75 minutes, --quick about 6)
    """
    if name == "real-vllm":
        from kvgate.realvllm.experiment import run as run_real

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


@cli.command()
@click.option("--quick", is_flag=True, help="Reduced versions of every experiment (for CI).")
@click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("kvgate-results"),
              show_default=True)  # fmt: skip
@click.option("--only", default=None, help="Comma-separated subset of experiments.")
@click.option("--jobs", type=int, default=None, help="Parallel runs [default: all cores].")
@click.option("--json", "as_json", is_flag=True)
@executor_options
def reproduce(quick: bool, out: Path, only: str | None, jobs: int | None, as_json: bool) -> None:
    """Every experiment of the paper, in parallel across cores, resumable; writes OUT/index.html."""
    from kvgate.experiments.catalog import EXPERIMENTS
    from kvgate.experiments.runner import get, run_experiments

    names = [n.strip() for n in only.split(",")] if only else list(EXPERIMENTS)
    for n in names:
        get(n)
    res = run_experiments(names, out, quick=quick, jobs=jobs, progress=not as_json)
    _print_verdicts(res, out, as_json)


@cli.command()
@click.argument("out", type=click.Path(file_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True)
def report(out: Path, as_json: bool) -> None:
    """Rebuild every experiment page and figure under OUT from its records, without running anything."""
    from kvgate.experiments.runner import report as rebuild

    res = rebuild(out)
    _print_verdicts(res, out, as_json)


@cli.command()
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--cost", default=None, metavar="A,B",
              help="Use c(L) = A s + B ms x L instead of fitting it on cache-disabled runs.")  # fmt: skip
@click.option("--from-min", type=float, default=None,
              help="Fit the drift from this minute [default: 10 min after the run's rate change].")  # fmt: skip
@click.option("--json", "as_json", is_flag=True)
def drain(runs: tuple[Path, ...], cost: str | None, from_min: float | None, as_json: bool) -> None:
    """The drain condition (§4): fit c(L) on cache-disabled runs, print S and 1/S, and for collapsed runs whose
    rate was lowered (--rate-at) the drift of the remaining cold work in engine-seconds per hour."""
    from kvgate.analysis.drain import ColdCost, cold_work_per_session, drift_per_hour, fit_cold_cost
    from kvgate.records import iter_runs

    loaded = list(iter_runs(runs))
    nocache = [r for r in loaded if r.config.get("prefix_caching") is False]
    if cost:
        try:
            a, b = (float(x) for x in cost.split(","))
        except ValueError:
            raise UsageError(f"malformed --cost {cost!r}: expected A,B (seconds, ms per token)") from None
        c = ColdCost(a, b / 1000.0, 0)
    elif nocache:
        c = fit_cold_cost(nocache)
        if c.windows < 2:
            raise UsageError("too few 2-minute windows with >= 4 requests running in the cache-disabled runs")
    else:
        raise UsageError("no cache-disabled runs among the inputs to fit c(L) from; pass --cost A,B")
    from kvgate.workload.config import WorkloadConfig

    s_cold = cold_work_per_session(c, WorkloadConfig.from_dict(loaded[0].config).workload())
    drifts = []
    for r in loaded:
        rate_at = r.config.get("rate_at") or []
        if not rate_at or r.config.get("prefix_caching") is False:
            continue
        t_change = max(float(x.split(":")[0]) for x in rate_at) * 60
        start = from_min * 60 if from_min is not None else t_change + 600
        end = float(r.config["minutes"]) * 60
        lam_after = float(sorted(rate_at, key=lambda x: float(x.split(":")[0]))[-1].split(":")[1])
        drifts.append({"run": str(r.path), "lam_after": lam_after, "seed": r.config.get("seed"),
                       "drift_engine_s_per_h": round(drift_per_hour(r, c, start, end), 1),
                       "collapsed": bool(r.summary.get("persistently_degraded"))})  # fmt: skip
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
                   f"{d['drift_engine_s_per_h']:+.0f} engine-s/h")  # fmt: skip


def main(argv: list[str] | None = None) -> None:
    try:
        cli.main(args=argv, prog_name="kvgate", standalone_mode=False)
    except click.exceptions.NoArgsIsHelpError as e:  # pragma: no cover - click >= 8.2
        click.echo(e.ctx.get_help() if e.ctx else str(e))
        sys.exit(0)
    except click.ClickException as e:
        _fail(e.format_message().replace("\n", " "))
    except click.exceptions.Abort:
        _fail("aborted")
    except UsageError as e:
        _fail(str(e))
    except KeyboardInterrupt:
        click.echo("kvgate: interrupted", err=True)
        sys.exit(130)


if __name__ == "__main__":  # pragma: no cover
    main()
