"""``kvgate summary RUN_DIR...``: the summary of run directories, simulated or driven, and their standard figures.

A run directory is what ``kvgate sim --out``, ``kvgate drive --out`` or a batch command wrote (``run.json`` and
the three tables, :mod:`kvgate.records`); a path holding several runs is searched for them. Each run's summary is
the one stored in its ``run.json``, recomputed from the records when it has none (a driven run that crashed:
``partial``) or with ``--recompute``. A driven run shows what it drove (engine kind, KV pool, block size) and, through
a kvgate gateway, the gateway's control, parks and waits as the driver recorded them (docs/driver.md).

``--figures DIR`` writes the standard figures: ``timeseries`` (hit ratio, turns/s and sessions in the system per
minute, one line per run: the paper's Figure 1) and one ``loop-<name>`` per run (resident demand over the pool,
recomputed tokens/s, hit ratio: Figure 4), each as PNG and SVG.
"""

from __future__ import annotations

import contextlib
import json
import math
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import click

from kvgate.errors import UsageError
from kvgate.workload.triggers import triggers_of

ROWS = (
    ("hit ratio, last 10 min", "hit_ratio_last10"),
    ("hit ratio, all turns", "hit_ratio_all"),
    ("sessions in system, last 5 min", "sessions_in_system_last5"),
    ("turns/s, last 10 min", "turns_per_s_last10"),
    ("sessions arrived / finished", ("sessions_arrived", "sessions_finished")),
    ("turns done", "turns_done"),
    ("preemptions", "preemptions"),
    ("control", "control"),
    ("parks", "parks"),
    ("gateway wait p90, first turns (min)", "gateway_wait_p90_min"),
    ("recovered / after (min)", ("recovered", "recovery_min")),
)


def run_summary(run: Any, *, recompute: bool = False) -> dict[str, Any]:
    """What ``kvgate summary`` reports for one loaded run (:class:`kvgate.records.Run`)."""
    from kvgate.analysis.summary import summarize

    meta = run.meta
    stored = meta.get("summary")
    if isinstance(stored, dict) and not recompute:
        summary = dict(stored)
    else:
        gw = meta.get("gateway")
        ctl = gw.get("summary_control") if isinstance(gw, dict) else None
        if isinstance(ctl, dict):  # a driven run through a gateway: its control, as the driver summarised it
            run = replace(run, meta={**meta, "config": {**run.config, **ctl}})
        summary = dict(summarize(run))
    out: dict[str, Any] = {
        "path": str(run.path),
        "kind": meta.get("kind", "sim"),
        "partial": bool(meta.get("partial", False)),
        "recomputed": not (isinstance(stored, dict) and not recompute),
        "seed": meta.get("seed"),
        "config": _config_line(run.config, meta.get("workload")),
        "summary": summary,
    }
    if out["kind"] == "drive":
        server = meta.get("server") or {}
        gw = meta.get("gateway")
        out["server"] = {
            "endpoint": server.get("endpoint"),
            "kind": server.get("kind"),
            "via_gateway": bool(server.get("via_gateway")),
            "kv_pool": meta.get("kv_pool"),
            "block_size": meta.get("block_size"),
        }
        if isinstance(gw, dict):
            out["gateway"] = {k: gw.get(k) for k in ("spec", "kv_pool", "turns_parked", "turns_waited",
                                                     "parks_during_run", "waits_during_run", "controls")}
    return out


def _config_line(cfg: dict[str, Any], workload: str | None = None) -> str:
    parts = [workload] if workload else []  # the workload a driven run played (a preset, a trace, or given)
    keys = (("lam", "lam "), ("minutes", ""), ("engine", ""))
    if not workload:
        keys = (("preset", ""), ("trace", "trace "), *keys)
    for key, label in keys:
        v = cfg.get(key)
        if v is None or v == "":
            continue
        parts.append(f"{label}{v:g} min" if key == "minutes" else f"{label}{v}")
    with contextlib.suppress(UsageError):  # a run written by another kvgate may name a trigger unknown here
        parts += [t.label() for t in triggers_of(cfg) if t.kind != "control"]
    if cfg.get("control") not in (None, "none"):
        at = cfg.get("control_at")
        parts.append(f"control {cfg['control']}" + (f" at {at:g} min" if at is not None else ""))
    if cfg.get("kv_pool"):
        parts.append(f"kv pool {cfg['kv_pool']}")
    if cfg.get("endpoint"):
        parts.append(f"endpoint {cfg['endpoint']}")
    return ", ".join(parts)


def _fmt(v: Any) -> str:
    if v is None or (isinstance(v, float) and math.isnan(v)):
        return "-"
    if isinstance(v, bool):
        return "yes" if v else "no"
    return str(v)


def format_run(r: dict[str, Any]) -> str:
    s = r["summary"]
    head = f"{r['path']}  ({r['kind']}{', partial' if r['partial'] else ''}, seed {_fmt(r['seed'])})"
    rows: list[tuple[str, str]] = [("config", r["config"] or "-")]
    if "server" in r:
        sv = r["server"]
        pool = f"{_fmt(sv['kv_pool'])} tokens in {_fmt(sv['block_size'])}-token blocks"
        rows.append(("server", f"{_fmt(sv['kind'])}{' via a kvgate gateway' if sv['via_gateway'] else ''}, {pool}"))
    deg = s.get("persistently_degraded")
    rows.append(("persistently degraded", f"yes, from minute {_fmt(s.get('degraded_from_min'))}" if deg else "no"))
    for label, key in ROWS:
        if isinstance(key, tuple):
            if key[0] not in s:
                continue
            rows.append((label, " / ".join(_fmt(s.get(k)) for k in key)))
        elif key in s:
            rows.append((label, _fmt(s[key])))
    if "gateway" in r:
        g = r["gateway"]
        rows.append(("gateway", f"{_fmt(g['spec'])}, C {_fmt(g['kv_pool'])}; turns parked "
                     f"{_fmt(g['turns_parked'])}, waited {_fmt(g['turns_waited'])}"))
    if r["recomputed"]:
        rows.append(("summary", "recomputed from the records"))
    w = max(len(k) for k, _ in rows)
    return "\n".join([head, *(f"  {k:<{w}}  {v}" for k, v in rows)])


def write_figures(runs: Sequence[Any], out: Path) -> list[Path]:
    """The standard figures of ``runs`` under ``out`` (see the module docstring)."""
    from kvgate.analysis.figures import figure_loop, figure_timeseries

    labels = _labels(runs)
    paths = figure_timeseries(runs, labels, out / "timeseries", shade=_shade(runs[0].config) if runs else ())
    for run, label in zip(runs, labels, strict=True):
        paths += figure_loop(run, out / f"loop-{_slug(label)}", title=label, shade=_shade(run.config))
    return paths


def _labels(runs: Sequence[Any]) -> list[str]:
    names = [Path(str(r.path)).name or str(r.path) for r in runs]
    if len(set(names)) < len(names):
        names = [str(r.path) for r in runs]
    return names


def _slug(text: str) -> str:
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in text).strip("-") or "run"


def _shade(cfg: dict[str, Any]) -> list[tuple[float, float]]:
    """The windows of the run's triggers that last (a burst, a pool shrunk for a while), in minutes."""
    try:
        return [(t.at_min, t.end_min()) for t in triggers_of(cfg) if t.end_min() > t.at_min]
    except UsageError:
        return []


@click.command("summary")
@click.argument("runs", nargs=-1, required=True, type=click.Path(path_type=Path))
@click.option("--figures", type=click.Path(file_okay=False, path_type=Path), default=None, metavar="DIR",
              help="Write the standard figures (timeseries, loop per run; PNG and SVG) here.")
@click.option("--recompute", is_flag=True, help="Recompute every summary from the records (run.json keeps its own).")
@click.option("--json", "as_json", is_flag=True, help="One JSON object per run, one per line.")
def command(runs: tuple[Path, ...], figures: Path | None, recompute: bool, as_json: bool) -> None:
    """Summarise run directories (kvgate sim --out, kvgate drive --out, batch commands), simulated or driven.

    \b
    A directory holding several runs is searched. Driven runs show the engine's kind, pool and block size and,
    through a kvgate gateway, its control, parks and waits. Examples:
      kvgate summary runs/drive-501
      kvgate summary runs/ --figures runs/figures
    """
    from kvgate.records import iter_runs

    loaded = list(iter_runs(runs))
    reports = [run_summary(r, recompute=recompute) for r in loaded]
    for r in reports:
        click.echo(json.dumps(r, sort_keys=True, default=str) if as_json else format_run(r))
    if figures is not None:
        paths = write_figures(loaded, figures)
        if not as_json:
            click.echo(f"figures: {len(paths)} files in {figures}")
