"""Run many simulations across cores, resumably, with a progress bar.

A run whose directory already holds a ``run.json`` with the same config is not run again: its summary is
read back (:mod:`kvgate.sim.job`). Where runs execute (forked local processes or Ray) is the executor's business
(``executor``); each job returns only its run metadata (records go to disk).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from kvgate.sim.executor import Executor, current
from kvgate.sim.job import Job, run_one

__all__ = ["Job", "parse_seeds", "run_many", "run_one"]


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
                if hi < lo or lo < 0:
                    raise ValueError
                if hi - lo >= MAX_SEEDS:
                    raise UsageError(f"seeds {part!r}: {hi - lo + 1:,} runs (at most {MAX_SEEDS:,})")
                out.extend(range(lo, hi + 1))
            else:
                out.append(int(part))
    except ValueError:
        raise UsageError(f"malformed seeds {text!r}: expected non-negative integers, e.g. 501-512 or 1,3,5") from None
    if not out:
        raise UsageError("no seeds given")
    if min(out) < 0:
        raise UsageError(f"malformed seeds {text!r}: a seed is a non-negative integer")
    if len(out) > MAX_SEEDS:
        raise UsageError(f"seeds {text!r}: {len(out):,} runs (at most {MAX_SEEDS:,})")
    if len(set(out)) < len(out):
        twice = next(x for i, x in enumerate(out) if x in out[:i])
        raise UsageError(f"seed {twice} is given twice (each seed is one run: a pair counted twice would count twice)")
    return out


MAX_SEEDS = 100_000
"""The most runs one seed list may ask for."""


def run_many(
    jobs_list: Sequence[Job],
    *,
    jobs: int | None = None,
    progress: bool = True,
    label: str = "simulating",
    executor: Executor | None = None,
) -> list[dict[str, Any]]:
    """Run every (config, out dir) and return their run metadata (with summaries), in order.

    ``executor`` defaults to the one installed by :func:`kvgate.sim.executor.executing` (else local processes);
    ``jobs`` overrides its parallelism.
    """
    ex = executor or current()
    if jobs is not None:
        ex = replace(ex, jobs=jobs)
    n = len(jobs_list)
    results: list[dict[str, Any] | None] = [None] * n
    bar = None
    task = None
    if progress and n:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        bar = Progress(
            TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            transient=True,
        )
        bar.start()
        task = bar.add_task(label, total=n)

    def done(i: int, meta: dict[str, Any]) -> None:
        results[i] = meta
        if bar is not None and task is not None:
            bar.advance(task)

    try:
        ex.run(jobs_list, done)
    finally:
        if bar is not None:
            bar.stop()
    return [r for r in results if r is not None]
