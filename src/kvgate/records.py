"""Run records: one schema for every writer (the simulator, the HTTP driver) and every reader (analysis).

A run directory holds::

    run.json          full config, seed, kvgate version, summary
    turns.parquet     one row per turn (TURNS schema)
    sessions.parquet  one row per session (SESSIONS schema)
    samples.parquet   time samples, at least every 10 s (SAMPLES schema)

Times are seconds from the start of the run. ``cached_tokens`` is null when the engine did not report it
(unknown, not zero). Writers that stream (the HTTP driver) append rows to ``*.jsonl`` files with the same
columns as they go and convert to Parquet at the end; readers accept either.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from kvgate.errors import UsageError

TURNS = pa.schema(
    [
        ("session", pa.int64()),
        ("cohort", pa.string()),  # "base" | "trigger"
        ("turn", pa.int32()),
        ("submit_s", pa.float64()),  # the session reached this turn boundary (asked the gateway)
        ("sent_s", pa.float64()),  # the gateway let it go to the engine (submit + park wait)
        ("admit_s", pa.float64()),  # the engine first scheduled it (NaN over HTTP: not observable)
        ("first_token_s", pa.float64()),
        ("end_s", pa.float64()),
        ("prompt_tokens", pa.int64()),
        ("cached_tokens", pa.int64()),  # null = not reported by the engine
        ("output_tokens", pa.int64()),
        ("park_wait_s", pa.float64()),
        ("preemptions", pa.int32()),
        ("status", pa.string()),  # "ok" | "error" | "aborted"
        ("lag_s", pa.float64()),  # driver schedule lag (0 in simulation)
    ]
)

SESSIONS = pa.schema(
    [
        ("session", pa.int64()),
        ("cohort", pa.string()),
        ("arrival_s", pa.float64()),
        ("end_s", pa.float64()),  # null while unfinished at the end of the run
        ("turns", pa.int32()),  # turns in the session's shape
        ("turns_done", pa.int32()),
        ("first_sent_s", pa.float64()),  # when its first turn left the gateway (null if never)
        ("source", pa.string()),
    ]
)

SAMPLES = pa.schema(
    [
        ("t_s", pa.float64()),
        ("in_system", pa.int32()),  # arrived, not finished
        ("admitted", pa.int32()),  # admitted by the gateway (thinking or in flight)
        ("parked", pa.int32()),  # parked at a turn boundary
        ("gateway_waiting", pa.int32()),  # new sessions not yet admitted
        ("running", pa.int32()),  # engine: requests running
        ("waiting", pa.int32()),  # engine: requests waiting
        ("kv_usage", pa.float64()),  # engine: fraction of KV blocks held by requests
        ("demand_tokens", pa.int64()),  # sum of (context + output budget) over sessions in the system
        ("admitted_demand_tokens", pa.int64()),  # the gateway's D
        ("pool_tokens", pa.int64()),
        ("preemptions", pa.int64()),  # engine: cumulative
    ]
)

SCHEMAS = {"turns": TURNS, "sessions": SESSIONS, "samples": SAMPLES}


class Columns:
    """Column-wise row buffer for one table (cheap appends in the simulator's hot loop)."""

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema
        self.cols: dict[str, list[Any]] = {f.name: [] for f in schema}

    def add(self, *values: Any) -> None:
        for col, v in zip(self.cols.values(), values, strict=True):
            col.append(v)

    def __len__(self) -> int:
        return len(next(iter(self.cols.values())))

    def table(self) -> pa.Table:
        return pa.table({k: pa.array(v, type=self.schema.field(k).type) for k, v in self.cols.items()})


@dataclass
class Run:
    """A loaded run: tables as numpy column dicts plus its run.json."""

    path: Path | None
    meta: dict[str, Any]
    turns: dict[str, np.ndarray]
    sessions: dict[str, np.ndarray]
    samples: dict[str, np.ndarray]

    @property
    def config(self) -> dict[str, Any]:
        return self.meta.get("config", {})

    @property
    def summary(self) -> dict[str, Any]:
        return self.meta.get("summary", {})


def _np(table: pa.Table) -> dict[str, np.ndarray]:
    out = {}
    for name in table.column_names:
        col = table.column(name)
        if (pa.types.is_integer(col.type) or pa.types.is_floating(col.type)) and col.null_count:
            out[name] = np.array(col.to_pylist(), dtype=float)  # nulls -> NaN
        elif pa.types.is_string(col.type):
            out[name] = np.array(col.to_pylist(), dtype=object)
        else:
            out[name] = col.to_numpy()
    return out


def from_tables(meta: dict[str, Any], tables: Mapping[str, pa.Table], path: Path | None = None) -> Run:
    return Run(path, meta, _np(tables["turns"]), _np(tables["sessions"]), _np(tables["samples"]))


def write_run(out: Path, meta: Mapping[str, Any], tables: Mapping[str, pa.Table]) -> None:
    """Write a run directory atomically enough: tables first, ``run.json`` last (a run without it is partial)."""
    out.mkdir(parents=True, exist_ok=True)
    for name, t in tables.items():
        tmp = out / f".{name}.parquet.tmp"
        pq.write_table(t, tmp, compression="zstd")
        tmp.replace(out / f"{name}.parquet")
    tmp = out / ".run.json.tmp"
    tmp.write_text(json.dumps(meta, indent=2, sort_keys=True, default=_json_default) + "\n")
    tmp.replace(out / "run.json")


def _json_default(o: Any) -> Any:
    if isinstance(o, np.integer):
        return int(o)
    if isinstance(o, np.floating):
        return float(o)
    if isinstance(o, Path):
        return str(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


def _read_table(run_dir: Path, name: str) -> pa.Table:
    pq_path = run_dir / f"{name}.parquet"
    if pq_path.exists():
        return pq.read_table(pq_path)
    jl = run_dir / f"{name}.jsonl"
    if jl.exists():
        rows = [json.loads(line) for line in jl.read_text().splitlines() if line.strip()]
        schema = SCHEMAS[name]
        return pa.table({f.name: pa.array([r.get(f.name) for r in rows], type=f.type) for f in schema})
    return SCHEMAS[name].empty_table()


def load_run(run_dir: str | Path) -> Run:
    p = Path(run_dir)
    meta_path = p / "run.json"
    if not meta_path.exists():
        raise UsageError(f"{p}: not a kvgate run directory (no run.json)")
    try:
        meta = json.loads(meta_path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise UsageError(f"{meta_path}: unreadable ({e})") from None
    return from_tables(meta, {n: _read_table(p, n) for n in SCHEMAS}, p)


def iter_runs(paths: Iterable[str | Path]) -> Iterable[Run]:
    """Load every run directory under the given paths (a path may be a run or hold runs)."""
    for raw in paths:
        p = Path(raw)
        if (p / "run.json").exists():
            yield load_run(p)
        elif p.is_dir():
            found = sorted(q.parent for q in p.rglob("run.json"))
            if not found:
                raise UsageError(f"{p}: no kvgate runs found")
            for q in found:
                yield load_run(q)
        else:
            raise UsageError(f"{p}: no such run directory")
