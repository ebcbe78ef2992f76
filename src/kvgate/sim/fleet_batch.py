"""Fleet runs through :func:`kvgate.sim.batch.run_many`: an executor whose jobs run :func:`simulate_fleet`.

Resumable as ``batch.run_one`` is: a job whose out dir already holds a ``run.json`` for the same config returns it.
(Once ``sim.runner.simulate`` delegates to ``simulate_fleet``, the plain executors run fleets and this goes.)
"""

from __future__ import annotations

import json
import multiprocessing as mp
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from kvgate.records import write_run
from kvgate.sim.batch import run_many
from kvgate.sim.executor import Done, Executor, Job, default_jobs
from kvgate.sim.fleet import simulate_fleet


def run_fleet_one(job: Job) -> dict[str, Any]:
    """Run one job ``(config, out dir or None[, records])`` with the fleet simulator."""
    cfg, out = job[0], job[1]
    records = job[2] if len(job) > 2 else True
    outp = Path(out) if out else None
    if outp is not None and (outp / "run.json").exists():
        try:
            meta = json.loads((outp / "run.json").read_text())
        except (OSError, json.JSONDecodeError):
            meta = {}
        if meta.get("config") == json.loads(json.dumps(asdict(cfg))):
            return meta
    res = simulate_fleet(cfg)
    if outp is not None:
        write_run(outp, res.meta, res.tables if records else {})
        return res.meta
    return res.meta if not records else dict(res.meta, _tables=res.tables)


def _indexed(item: tuple[int, Job]) -> tuple[int, dict[str, Any]]:
    return item[0], run_fleet_one(item[1])


@dataclass(frozen=True)
class FleetExecutor(Executor):
    """Local forked processes running fleet jobs."""

    def run(self, jobs_list: Sequence[Job], done: Done) -> None:
        n = len(jobs_list)
        jobs = min(self.jobs or default_jobs(), n)
        if jobs <= 1:
            for i, job in enumerate(jobs_list):
                done(i, run_fleet_one(job))
            return
        with mp.get_context("fork").Pool(jobs) as pool:
            for i, meta in pool.imap_unordered(_indexed, list(enumerate(jobs_list))):
                done(i, meta)


def run_fleet_many(jobs_list: Sequence[Job], *, jobs: int | None = None, progress: bool = True) -> list[dict[str, Any]]:
    return run_many(jobs_list, jobs=jobs, progress=progress, label="fleet runs", executor=FleetExecutor(jobs=jobs))
