"""Run many simulations across cores, resumably, with a progress bar.

A run whose directory already holds a ``run.json`` with the same config is not run again: its summary is
read back. Workers are forked processes; each returns only the summary (records go to disk).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import os
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

from kvgate.records import write_run
from kvgate.sim.runner import SimConfig, simulate


def parse_seeds(text: str) -> list[int]:
    """``501-512``, ``1,3,5`` or a mix (``1-4,9``)."""
    from kvgate.errors import UsageError

    out: list[int] = []
    try:
        for part in text.split(","):
            part = part.strip()
            if not part:
                continue
            if "-" in part:
                a, b = part.split("-", 1)
                lo, hi = int(a), int(b)
                if hi < lo:
                    raise ValueError
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
    except ValueError:
        raise UsageError(f"malformed seeds {text!r}: expected e.g. 501-512 or 1,3,5") from None
    if not out:
        raise UsageError("no seeds given")
    return out


def _existing(out: Path | None, cfg: SimConfig) -> dict[str, Any] | None:
    if out is None:
        return None
    p = out / "run.json"
    if not p.exists():
        return None
    try:
        meta = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError):
        return None
    if meta.get("config") != json.loads(json.dumps(asdict(cfg))):
        return None
    return meta


def run_one(args: tuple[SimConfig, str | None]) -> dict[str, Any]:
    cfg, out = args
    outp = Path(out) if out else None
    old = _existing(outp, cfg)
    if old is not None:
        return old
    res = simulate(cfg)
    if outp is not None:
        write_run(outp, res.meta, res.tables)
        return res.meta
    return dict(res.meta, _tables=res.tables)  # no directory: hand the records back in memory


def default_jobs() -> int:
    return max(1, os.cpu_count() or 1)


def run_many(
    jobs_list: Sequence[tuple[SimConfig, str | None]],
    *,
    jobs: int | None = None,
    progress: bool = True,
    label: str = "simulating",
) -> list[dict[str, Any]]:
    """Run every (config, out dir) and return their run metadata (with summaries), in order."""
    n = len(jobs_list)
    jobs = min(jobs or default_jobs(), n) if n else 1
    results: list[dict[str, Any] | None] = [None] * n
    bar = None
    if progress:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            transient=True,
        )  # fmt: skip
    task = None
    if bar is not None:
        bar.start()
        task = bar.add_task(label, total=n)
    try:
        if jobs <= 1 or n <= 1:
            for i, item in enumerate(jobs_list):
                results[i] = run_one(item)
                if bar is not None and task is not None:
                    bar.advance(task)
        else:
            ctx = mp.get_context("fork")
            with ctx.Pool(jobs) as pool:
                for i, meta in pool.imap_unordered(_indexed, list(enumerate(jobs_list))):
                    results[i] = meta
                    if bar is not None and task is not None:
                        bar.advance(task)
    finally:
        if bar is not None:
            bar.stop()
    return [r for r in results if r is not None]


def _indexed(item: tuple[int, tuple[SimConfig, str | None]]) -> tuple[int, dict[str, Any]]:
    i, job = item
    return i, run_one(job)
