"""``kvgate compare``: kvgate beside vllm-router's program scheduling and Dynamo's ThunderAgent, on the same engines.

``kvgate compare run [--plan quick|full|smoke]`` runs every run of the plan that is not done yet (each a directory
with its ``compare.json``), then writes the pages; ``kvgate compare report DIR`` rewrites the pages from the run
directories; ``kvgate compare list`` prints the plan and what is done.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

import click

from kvgate.errors import UsageError

if TYPE_CHECKING:
    from kvgate.compare.plan import Plan, Run
    from kvgate.compare.stacks import Env

_OUT = click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=Path("compare-runs"),
                    show_default=True, help="Directory of the runs (one sub-directory per run; resumable).")
_PLAN = click.option("--plan", "plan_name", type=click.Choice(["quick", "full", "smoke", "envoy", "envoy-smoke"]),
                     default="quick", show_default=True, help="quick: one seed, ~30 min on 2 cores; full: 8 seeds, "
                     "hours; smoke: each competitor once, a few minutes (CI); envoy: Envoy alone and Envoy + kvgate "
                     "epp beside kvgate gateway, 8 seeds; envoy-smoke: each Envoy stack once.")
_ONLY = click.option("--only", multiple=True, metavar="TEXT",
                     help="Only runs whose key contains TEXT (e.g. burst/vr-ps, -r4-, dyn); repeatable.")


@click.group("compare", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
def command() -> None:
    """kvgate beside vllm-router's program scheduling and Dynamo's ThunderAgent, on the same engines.

    Each run starts a stack on loopback (kvgate engine replicas or Dynamo's mocker; the engine alone,
    vllm-router, kvgate's gateway, Dynamo's frontend with or without ThunderAgent, kvgate in front of either),
    drives it with kvgate drive, records each system's own count of held turns, and stops it by PID.
    Install the competitors first: bash .ci/install-competitors.sh.

    \b
      kvgate compare run --plan quick --out runs/compare     # ~30 min on 2 cores
      kvgate compare run --plan full --out runs/compare      # 8 seeds: hours; resumable
      kvgate compare report runs/compare --pages docs/results
    """


def _selected(plan_name: str, only: tuple[str, ...]) -> tuple[Plan, list[Run]]:
    from kvgate.compare.plan import PLANS

    plan = PLANS[plan_name]
    runs = [r for r in plan.runs() if not only or any(o in r.key for o in only)]
    if not runs:
        raise UsageError(f"--only {' '.join(only)}: no run of the {plan_name} plan matches")
    return plan, runs


@command.command("run")
@_PLAN
@_OUT
@_ONLY
@click.option("--pages", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Write the pages here at the end [default: OUT/pages]. A run the page there already records "
              "(its result.json) is kept, not rerun.")
@click.option("--no-pages", is_flag=True, help="Do not write the pages at the end (several streams sharing OUT: "
              "write them once, with kvgate compare report).")
def run_cmd(plan_name: str, out: Path, only: tuple[str, ...], pages: Path | None, no_pages: bool) -> None:
    """Run the plan's runs that are not done yet, then write the pages.

    Resumable, and several of these may share OUT (e.g. one per core for the full plan): each run is claimed
    with a lock before it starts, so a run done or running in another stream is skipped."""
    from kvgate.compare.page import recorded_keys, write_pages
    from kvgate.compare.runner import claim, done, run_one
    from kvgate.compare.stacks import STACKS, find_env

    plan, runs = _selected(plan_name, only)
    kept = recorded_keys(pages or out / "pages", plan_name)
    n_kept = sum(r.key in kept for r in runs)
    runs = [r for r in runs if r.key not in kept]
    env = find_env()
    if runs:
        _check_env(env, {STACKS[r.stack].engine for r in runs}, {STACKS[r.stack].front for r in runs})
    todo = [r for r in runs if not done(out, r)]
    out.mkdir(parents=True, exist_ok=True)
    with (out / "commands.txt").open("a") as f:  # the page says how it was made
        f.write("kvgate compare run " + " ".join(sys.argv[sys.argv.index("run") + 1 :] if "run" in sys.argv else [])
                + "\n")
    click.echo(f"kvgate compare: {len(runs) + n_kept} runs in the {plan_name} plan, {len(runs) - len(todo)} done"
               + (f", {n_kept} recorded on the page" if n_kept else ""), err=True)
    t0 = time.monotonic()
    failed = []
    ran = 0
    for i, r in enumerate(todo, 1):
        lock = claim(out, r)
        if lock is None:
            click.echo(f"[{i}/{len(todo)}] {r.key}: done or running in another stream, skipped", err=True)
            continue
        click.echo(f"[{i}/{len(todo)}] {r.key}", err=True)
        try:
            run_one(plan, r, out, env, lambda m: click.echo("  " + m, err=True))
            ran += 1
        except UsageError as e:  # one run's stack or driver failed: the others still run
            failed.append(r.key)
            click.echo(f"  failed: {e}", err=True)
            (out / r.key / "failed.txt").write_text(str(e) + "\n")
        finally:
            os.close(lock)
    click.echo(f"kvgate compare: {ran} runs in {(time.monotonic() - t0) / 60:.1f} min", err=True)
    if not no_pages:
        for p in write_pages(out, pages or out / "pages", plan_name):
            click.echo(str(p))
    if failed:
        raise UsageError(f"{len(failed)} runs failed ({', '.join(failed)}); rerun to retry them")


def _check_env(env: Env, engines: set[str], fronts: set[str]) -> None:
    missing = []
    if any("vllm-router" in f for f in fronts) and not env.vllm_router:
        missing.append("vllm-router (pip install vllm-router==0.1.17)")
    if any(f.startswith("envoy") for f in fronts) and not env.envoy:
        missing.append("Envoy (bash .ci/install-envoy.sh)")
    if "dynamo-mocker" in engines:
        if not env.dynamo_python:
            missing.append("Dynamo 1.6.1 in ~/.cache/kvgate/dynamo-venv (or $KVGATE_DYNAMO_VENV)")
        if not env.tokenizer_dir:
            missing.append("the tiny local model (kvgate real-vllm model, or $KVGATE_MODEL_DIR)")
    if missing:
        raise UsageError("not installed: " + "; ".join(missing) + " -- bash .ci/install-competitors.sh")


@command.command("report")
@click.argument("out", type=click.Path(file_okay=False, exists=True, path_type=Path))
@_PLAN
@click.option("--pages", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Where the pages go [default: OUT/pages].")
@click.option("--note", "notes", multiple=True, metavar="TEXT", help="A line under the page's title (repeatable).")
def report_cmd(out: Path, plan_name: str, pages: Path | None, notes: tuple[str, ...]) -> None:
    """Rewrite the pages from the run directories under OUT.

    The runs the page in PAGES recorded before (its result.json) and whose directories are not under OUT are kept
    as recorded, so a page grows over several machines or sessions without rerunning what it holds."""
    from kvgate.compare.page import write_pages

    for p in write_pages(out, pages or out / "pages", plan_name, notes):
        click.echo(str(p))


@command.command("list")
@_PLAN
@_OUT
@_ONLY
@click.option("--pages", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="A page whose recorded runs count as done [default: OUT/pages].")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per run.")
def list_cmd(plan_name: str, out: Path, only: tuple[str, ...], pages: Path | None, as_json: bool) -> None:
    """The plan's runs and whether each is done (under OUT, or recorded on the page)."""
    from kvgate.compare.page import recorded_keys
    from kvgate.compare.runner import done

    plan, runs = _selected(plan_name, only)
    kept = recorded_keys(pages or out / "pages", plan_name)
    for r in runs:
        ok = done(out, r) or r.key in kept
        if as_json:
            sys.stdout.write(json.dumps({"key": r.key, "done": ok}) + "\n")
        else:
            click.echo(f"{'done' if ok else '    '}  {r.key}")
