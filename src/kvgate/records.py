"""Run records: one schema for every writer (the simulator, the HTTP driver) and every reader (analysis).

A run directory holds::

    run.json          full config, seed, kvgate version, summary
    turns.parquet     one row per turn (TURNS schema)
    sessions.parquet  one row per session (SESSIONS schema)
    samples.parquet   time samples, at least every 10 s (SAMPLES schema)

Times are seconds from the start of the run. ``cached_tokens`` is null when the engine did not report it
(unknown, not zero). Every writer adds typed rows (:class:`TurnRow`, :class:`SessionRow`, :class:`SampleRow`)
to one :class:`Recorder`; one that streams (the HTTP driver) has it append them to ``*.jsonl`` files with the same
columns as they come and convert to Parquet at the end; readers accept either.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any, NamedTuple

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
        ("tenant", pa.string()),  # its tenant ("" with one)
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
        ("kv_pool", pa.int64()),
        ("preemptions", pa.int64()),  # engine: cumulative
    ]
)

SCHEMAS = {"turns": TURNS, "sessions": SESSIONS, "samples": SAMPLES}
RECORD_FILES = tuple(SCHEMAS)


class TurnRow(NamedTuple):
    """One row of ``turns`` (the TURNS schema, same order)."""

    session: int
    cohort: str
    turn: int
    submit_s: float
    sent_s: float
    admit_s: float
    first_token_s: float
    end_s: float
    prompt_tokens: int
    cached_tokens: int | None
    output_tokens: int
    park_wait_s: float
    preemptions: int | None
    status: str
    lag_s: float


class SessionRow(NamedTuple):
    """One row of ``sessions`` (the SESSIONS schema, same order)."""

    session: int
    cohort: str
    arrival_s: float
    end_s: float | None
    turns: int
    turns_done: int
    first_sent_s: float | None
    source: str
    tenant: str = ""


class SampleRow(NamedTuple):
    """One row of ``samples`` (the SAMPLES schema, same order); -1 (NaN for ``kv_usage``): not observable."""

    t_s: float
    in_system: int
    admitted: int
    parked: int
    gateway_waiting: int
    running: int
    waiting: int
    kv_usage: float
    demand_tokens: int
    admitted_demand_tokens: int
    kv_pool: int
    preemptions: int


class Columns:
    """Row buffer for one table: rows kept as the tuples they come in (one list append in the simulator's hot
    loop), turned into columns once, by :meth:`table`."""

    def __init__(self, schema: pa.Schema) -> None:
        self.schema = schema
        self.width = len(schema)
        self.rows: list[tuple[Any, ...]] = []

    def add(self, *values: Any) -> None:
        self.append(values)

    def append(self, row: tuple[Any, ...]) -> None:
        if len(row) != self.width:
            raise ValueError(f"a row of {len(row)} values for a table of {self.width} columns")
        self.rows.append(row)

    def __len__(self) -> int:
        return len(self.rows)

    def table(self) -> pa.Table:
        cols = list(zip(*self.rows, strict=True)) if self.rows else [()] * self.width
        return pa.table({f.name: pa.array(c, type=f.type) for f, c in zip(self.schema, cols, strict=True)})


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


def numpy_columns(table: pa.Table) -> dict[str, np.ndarray]:
    """A table as numpy columns: nullable numbers as float with NaN, strings as object arrays."""
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


OLD_NAMES = {"pool_tokens": "kv_pool"}
"""Names older kvgate versions wrote (run.json keys, sample columns) and their names now."""


def from_tables(meta: dict[str, Any], tables: Mapping[str, pa.Table], path: Path | None = None) -> Run:
    """A run from its run.json and tables (an older kvgate's names read as today's)."""
    for old, new in OLD_NAMES.items():
        if old in meta and new not in meta:
            meta[new] = meta.pop(old)
    samples = tables["samples"]
    if any(old in samples.column_names for old in OLD_NAMES):
        samples = samples.rename_columns([OLD_NAMES.get(c, c) for c in samples.column_names])
        tables = {**tables, "samples": samples}
    return Run(path, meta, numpy_columns(tables["turns"]), numpy_columns(tables["sessions"]),
               numpy_columns(tables["samples"]))


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


def _json_value(v: Any) -> Any:
    """A record value as strict JSON (NaN and infinities become null)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


def prepare_out(out: Path, *, force: bool, check_only: bool = False) -> None:
    """Refuse to mix two runs in one directory; with ``force`` remove the old run's record files."""
    names = ["run.json"] + [f"{n}.{ext}" for n in (*RECORD_FILES, "errors") for ext in ("parquet", "jsonl")]
    old = [out / n for n in names if (out / n).exists()]
    if out.exists() and not out.is_dir():
        raise UsageError(f"--out {out}: not a directory")
    if old and not force:
        raise UsageError(f"--out {out} already holds a run; pick another directory or pass --force")
    if not check_only:
        for p in old:
            p.unlink()


class Recorder:
    """The records of one run, for every writer: typed rows into column buffers (the tables at the end).

    With ``out`` it also streams every row to ``<table>.jsonl`` there as it comes (one flushed line each, so a
    crash loses nothing written; failed attempts go to ``errors.jsonl``) and :meth:`finish` turns them into the
    run directory (Parquet + ``run.json``). Without, it only buffers (the simulator: the tables are its result).
    """

    def __init__(self, out: Path | None = None, *, force: bool = False) -> None:
        self.out = out
        self.cols: dict[str, Columns] = {name: Columns(SCHEMAS[name]) for name in RECORD_FILES}
        self.names = {name: [f.name for f in SCHEMAS[name]] for name in RECORD_FILES}
        self.files: dict[str, IO[str]] = {}
        if out is not None:
            prepare_out(out, force=force)
            out.mkdir(parents=True, exist_ok=True)
            self.files = {
                name: open(out / f"{name}.jsonl", "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
                for name in (*RECORD_FILES, "errors")
            }

    def turn(self, row: TurnRow, extra: Mapping[str, Any] | None = None) -> None:
        self.add("turns", row, extra)

    def session(self, row: SessionRow, extra: Mapping[str, Any] | None = None) -> None:
        self.add("sessions", row, extra)

    def sample(self, row: SampleRow, extra: Mapping[str, Any] | None = None) -> None:
        self.add("samples", row, extra)

    def add(self, table: str, values: tuple[Any, ...], extra: Mapping[str, Any] | None = None) -> None:
        """A row of ``table`` (its values in the schema's order); ``extra`` keys go to the streamed line only."""
        self.cols[table].append(values)
        if self.files:
            row = {n: _json_value(v) for n, v in zip(self.names[table], values, strict=True)}
            if extra:
                row.update(extra)
            self._line(table, row)

    def error(self, row: Mapping[str, Any]) -> None:
        """A failed attempt, to ``errors.jsonl`` (kept beside the run; not a table)."""
        if self.files:
            self._line("errors", row)

    def _line(self, name: str, row: Mapping[str, Any]) -> None:
        f = self.files[name]
        f.write(json.dumps(row, separators=(",", ":")) + "\n")
        f.flush()

    def write_meta(self, meta: Mapping[str, Any]) -> None:
        """A provisional ``run.json`` (the run so far), replaced by :meth:`finish`."""
        assert self.out is not None
        tmp = self.out / ".run.json.tmp"
        tmp.write_text(json.dumps(meta, indent=2, sort_keys=True, default=str) + "\n")
        tmp.replace(self.out / "run.json")

    def tables(self) -> dict[str, pa.Table]:
        t = {name: c.table() for name, c in self.cols.items()}
        t["sessions"] = t["sessions"].sort_by("session")
        return t

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def finish(self, meta: Mapping[str, Any], tables: Mapping[str, pa.Table]) -> None:
        """Parquet + run.json (written last), then drop the converted jsonl files (``errors.jsonl`` stays)."""
        assert self.out is not None
        self.close()
        write_run(self.out, meta, tables)
        for name in RECORD_FILES:
            (self.out / f"{name}.jsonl").unlink(missing_ok=True)


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
        rows = [{OLD_NAMES.get(k, k): v for k, v in json.loads(line).items()}
                for line in jl.read_text().splitlines() if line.strip()]
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
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{meta_path}: unreadable ({one_line_of(e)})") from None
    if not isinstance(meta, dict):
        raise UsageError(f"{meta_path}: not a run's record (a JSON object), a {type(meta).__name__}")
    tables = {}
    for n in SCHEMAS:
        try:
            tables[n] = _read_table(p, n)
        except (OSError, UnicodeDecodeError, ValueError, pa.ArrowException, AttributeError) as e:
            raise UsageError(f"{p}: its {n} records are unreadable ({one_line_of(e)})") from None
    if not meta.get("config") and not meta.get("summary") and not any(t.num_rows for t in tables.values()):
        raise UsageError(f"{meta_path}: no config, no summary and no records: nothing to read")
    return from_tables(meta, tables, p)


def one_line_of(e: BaseException, limit: int = 200) -> str:
    text = " ".join(str(e).split()) or type(e).__name__
    return text if len(text) <= limit else text[: limit - 1] + "…"


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
