"""One job of a batch: a simulated run ``(config, out dir or None[, keep records])``, resumable by its directory.

A job whose out dir already holds a ``run.json`` for the same config returns it without running, whichever
executor (:mod:`kvgate.sim.executor`) runs the job.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvgate.records import write_run
from kvgate.sim.config import SimConfig
from kvgate.sim.runner import simulate

Job = tuple[SimConfig, "str | None"] | tuple[SimConfig, "str | None", bool]
"""(config, out dir or None[, keep records]): see :func:`run_one`."""


def existing_run(out: Path | None, cfg: SimConfig) -> dict[str, Any] | None:
    """The run metadata in ``out`` if it is a finished run of ``cfg`` (stored by this or an older kvgate)."""
    if out is None:
        return None
    p = out / "run.json"
    if not p.exists():
        return None
    try:
        meta = json.loads(p.read_text())
        stored = SimConfig.from_dict(meta["config"])
    except (OSError, json.JSONDecodeError, KeyError, TypeError, AttributeError):
        return None
    return meta if stored == cfg else None


def run_one(args: Job) -> dict[str, Any]:
    """Run one job ``(config, out dir or None[, records])``; with ``records=False`` only ``run.json`` (config and
    summary) is kept, in the out dir if there is one."""
    cfg, out = args[0], args[1]
    records = args[2] if len(args) > 2 else True
    outp = Path(out) if out else None
    old = existing_run(outp, cfg)
    if old is not None:
        return old
    res = simulate(cfg)
    if outp is not None:
        write_run(outp, res.meta, res.tables if records else {})
        return res.meta
    if not records:
        return res.meta
    return dict(res.meta, _tables=res.tables)  # no directory: hand the records back in memory
