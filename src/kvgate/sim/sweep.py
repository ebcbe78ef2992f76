"""``kvgate sweep``: a grid of simulated runs, one Parquet row per run (its config and its summary).

A sweep is a *base* config (any :class:`~kvgate.sim.runner.SimConfig` field) and a *grid*: for each swept field a
list of values; the runs are the product of the lists. It is written as TOML (or JSON)::

    [base]
    preset = "paper-8b"
    minutes = 60

    [grid]
    lam = [0.030, 0.035, 0.040]
    bursts = ["", "1.0@15+5", "1.5@15+5"]   # a string is one burst ("" or "none": no burst); a list, several
    control = ["none", "budgeter"]
    seed = "1-12"                           # seeds: a range string or a list

or as flags (``--set minutes=60 --grid lam=0.03,0.035 --grid seed=1-12``). Each run is a directory
``OUT/runs/ID`` holding its ``run.json`` (and its records with ``--records``), so a sweep is resumable: a re-run
skips every run that finished. ``OUT/sweep.parquet`` has one row per run, in grid order: ``run`` (the id), the
swept fields, every config field and every summary field (``s_`` prefix). Runs go to the executor installed by
the command (``--executor local|ray``).
"""

from __future__ import annotations

import itertools
import json
import math
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

from kvgate.errors import UsageError
from kvgate.sim.config import SimConfig

_FIELDS = {f.name: f for f in fields(SimConfig)}
_TUPLES = {"bursts", "rate_at"}


@dataclass(frozen=True)
class Sweep:
    """A base config and the swept fields with their values (in grid order: the last field varies fastest)."""

    base: SimConfig
    grid: tuple[tuple[str, tuple[Any, ...]], ...]

    @property
    def size(self) -> int:
        return math.prod(len(v) for _, v in self.grid) if self.grid else 1

    def runs(self) -> list[tuple[str, dict[str, Any], SimConfig]]:
        """(id, swept values, config) for every point of the grid."""
        names = [k for k, _ in self.grid]
        out = []
        for combo in itertools.product(*(v for _, v in self.grid)):
            point = dict(zip(names, combo, strict=True))
            out.append((run_id(point), point, self.base.with_(**point)))
        return out


def run_id(point: Mapping[str, Any]) -> str:
    """A readable, filesystem-safe id for a grid point (``lam=0.035/bursts=1.5@15+5/seed=3``)."""
    parts = []
    for k, v in point.items():
        if k in _TUPLES:
            v = "+".join(v) if v else "none"
        parts.append(f"{k}={_text(v)}".replace("/", "_").replace(" ", ""))
    return "/".join(parts) or "base"


def _text(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:g}"
    return str(v)


# -- parsing -------------------------------------------------------------------------------------------------


def _coerce(name: str, value: Any) -> Any:
    """A spec value as the SimConfig field ``name`` wants it (typed by the field's annotation)."""
    if name not in _FIELDS:
        known = ", ".join(sorted(_FIELDS))
        raise UsageError(f"sweep: unknown config field {name!r}; fields: {known}")
    if name in _TUPLES:
        if value is None or value == "" or value == "none":
            return ()
        if isinstance(value, str):
            return (value,)
        if isinstance(value, Sequence):
            return tuple(str(x) for x in value)
        raise UsageError(f"sweep: {name} takes a string or a list of strings, got {value!r}")
    ann = str(_FIELDS[name].type)
    optional = "None" in ann
    kind = bool if "bool" in ann else int if "int" in ann else float if "float" in ann else str
    if isinstance(value, str) and kind is not str:
        if optional and value.strip().lower() in ("", "none"):
            return None
        value = _parse_scalar(value)
    if value is None and optional:
        return None
    if kind is bool and not isinstance(value, bool):
        raise UsageError(f"sweep: {name} takes true or false, got {value!r}")
    if kind is int and isinstance(value, float) and value.is_integer():
        value = int(value)
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value = float(value)
    if kind in (int, float) and (isinstance(value, bool) or not isinstance(value, kind)):
        raise UsageError(f"sweep: {name} takes {'an integer' if kind is int else 'a number'}, got {value!r}")
    if kind is str and not isinstance(value, str):
        raise UsageError(f"sweep: {name} takes a string, got {value!r}")
    if kind is float and not math.isfinite(value):  # (an infinite rate or length never ends a run)
        raise UsageError(f"sweep: {name} takes a finite number, got {value!r}")
    if name == "seed" and value < 0:
        raise UsageError(f"sweep: a seed is a non-negative integer, got {value!r}")
    return value


def _parse_scalar(text: str) -> Any:
    t = text.strip()
    if t.lower() in ("true", "false"):
        return t.lower() == "true"
    for conv in (int, float):
        try:
            return conv(t)
        except ValueError:
            pass
    return t


def _values(name: str, raw: Any) -> tuple[Any, ...]:
    """The list of values of one swept field (``seed`` also takes a range string such as ``1-12``)."""
    if name == "seed" and isinstance(raw, str):
        from kvgate.sim.batch import parse_seeds

        return tuple(parse_seeds(raw))
    vals = tuple(raw) if isinstance(raw, Sequence) and not isinstance(raw, str) else (raw,)
    if not vals:
        raise UsageError(f"sweep: {name} has no values")
    return tuple(_coerce(name, v) for v in vals)


def from_mapping(spec: Mapping[str, Any]) -> Sweep:
    """A sweep from a parsed spec ``{"base": {...}, "grid": {...}}``."""
    extra = set(spec) - {"base", "grid", "name"}
    if extra:
        raise UsageError(f"sweep: unknown section(s) {', '.join(sorted(extra))}; expected [base] and [grid]")
    base_raw = spec.get("base", {}) or {}
    grid_raw = spec.get("grid", {}) or {}
    if not isinstance(base_raw, Mapping) or not isinstance(grid_raw, Mapping):
        raise UsageError("sweep: [base] and [grid] must be tables")
    base = {k: _coerce(k, v) for k, v in base_raw.items()}
    grid = tuple((k, _values(k, v)) for k, v in grid_raw.items())
    try:
        sweep = Sweep(SimConfig(**base), grid)
    except TypeError as e:
        raise UsageError(f"sweep: {e}") from None
    return sweep


def load_spec(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text("utf-8")
    except OSError as e:
        raise UsageError(f"{path}: cannot read: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise UsageError(f"{path}: not text (a sweep spec is a TOML or JSON file)") from None
    try:
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text)
    except (tomllib.TOMLDecodeError, json.JSONDecodeError) as e:
        raise UsageError(f"{path}: not a valid sweep spec: {e}") from None
    if not isinstance(data, dict):
        raise UsageError(f"{path}: a sweep spec is a table with [base] and [grid]")
    return data


def from_flags(spec: Mapping[str, Any] | None, sets: Sequence[str], grids: Sequence[str]) -> Sweep:
    """Merge ``--set K=V`` (into base) and ``--grid K=V1,V2`` (into the grid) over an optional spec."""
    merged: dict[str, Any] = {"base": dict((spec or {}).get("base", {})), "grid": dict((spec or {}).get("grid", {}))}
    for text in sets:
        k, v = _kv(text, "--set")
        merged["base"][k] = v
    for text in grids:
        k, v = _kv(text, "--grid")
        if k == "seed" and "," not in v:
            merged["grid"][k] = v
        elif k in _TUPLES:
            merged["grid"][k] = [x.strip() for x in v.split(",")]
        else:
            merged["grid"][k] = [x.strip() for x in v.split(",") if x.strip()]
    return from_mapping(merged)


def _kv(text: str, flag: str) -> tuple[str, str]:
    k, sep, v = text.partition("=")
    if not sep or not k.strip():
        raise UsageError(f"{flag} {text!r}: expected FIELD=VALUE")
    return k.strip(), v.strip()


# -- running -------------------------------------------------------------------------------------------------


def run_sweep(
    sweep: Sweep, out: Path, *, records: bool = False, progress: bool = True, jobs: int | None = None
) -> Any:
    """Run (or resume) every grid point under ``out/runs`` and write ``out/sweep.parquet``; returns the table."""
    from kvgate.sim.batch import run_many
    from kvgate.sim.config import validate

    runs = sweep.runs()
    for rid, _, cfg in runs:
        try:
            validate(cfg)
        except UsageError as e:
            raise UsageError(f"sweep run {rid}: {e}") from None
    out.mkdir(parents=True, exist_ok=True)
    jobs_list = [(cfg, str(out / "runs" / rid), records) for rid, _, cfg in runs]
    metas = run_many(jobs_list, jobs=jobs, progress=progress, label=f"sweep ({len(runs)} runs)")
    table = results_table(runs, metas)
    import pyarrow.parquet as pq

    tmp = out / ".sweep.parquet.tmp"
    pq.write_table(table, tmp, compression="zstd")
    tmp.replace(out / "sweep.parquet")
    return table


def results_table(runs: Sequence[tuple[str, dict[str, Any], SimConfig]], metas: Sequence[dict[str, Any]]) -> Any:
    """One row per run: ``run``, every config field (tuples as ``;``-joined strings), every summary field as
    ``s_NAME``; a column that mixes types is stored as strings."""
    import pyarrow as pa

    rows = []
    for (rid, _, cfg), meta in zip(runs, metas, strict=True):
        row: dict[str, Any] = {"run": rid}
        for k, v in asdict(cfg).items():
            row[k] = ";".join(v) if isinstance(v, tuple) else v
        for k, v in (meta.get("summary") or {}).items():
            if isinstance(v, dict | list):
                v = json.dumps(v, sort_keys=True)
            row[f"s_{k}"] = v
        rows.append(row)
    cols: dict[str, list[Any]] = {}
    for row in rows:
        for k in row:
            cols.setdefault(k, [])
    for row in rows:
        for k, col in cols.items():
            col.append(row.get(k))
    arrays = {}
    for k, col in cols.items():
        try:
            arrays[k] = pa.array(col)
        except (pa.ArrowInvalid, pa.ArrowTypeError):
            arrays[k] = pa.array([None if x is None else str(x) for x in col], type=pa.string())
    return pa.table(arrays)
