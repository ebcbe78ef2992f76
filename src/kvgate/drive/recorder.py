"""The driver's records as they happen: rows streamed to ``<table>.jsonl`` (one flushed line each, so a crash loses
at most the turns in flight and the partial directory still loads), kept for the final Parquet; failed attempts in
``errors.jsonl``."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import IO, Any

from kvgate.errors import UsageError

RECORD_FILES = ("turns", "sessions", "samples")


def _jv(v: Any) -> Any:
    """A record value as strict JSON (NaN and infinities become null)."""
    if isinstance(v, float) and not math.isfinite(v):
        return None
    return v


class Recorder:
    """Streams rows to ``<table>.jsonl`` (one flushed line per row) and keeps them for the final Parquet."""

    def __init__(self, out: Path, *, force: bool = False) -> None:
        from kvgate.records import SCHEMAS, Columns

        self.out = out
        prepare_out(out, force=force)
        out.mkdir(parents=True, exist_ok=True)
        self.cols: dict[str, Columns] = {name: Columns(SCHEMAS[name]) for name in RECORD_FILES}
        self.names = {name: [f.name for f in SCHEMAS[name]] for name in RECORD_FILES}
        self.files: dict[str, IO[str]] = {
            name: open(out / f"{name}.jsonl", "w", encoding="utf-8")  # noqa: SIM115 - closed in close()
            for name in (*RECORD_FILES, "errors")
        }

    def add(self, table: str, values: tuple[Any, ...], extra: dict[str, Any] | None = None) -> None:
        self.cols[table].add(*values)
        row = {n: _jv(v) for n, v in zip(self.names[table], values, strict=True)}
        if extra:
            row.update(extra)
        self._line(table, row)

    def error(self, row: dict[str, Any]) -> None:
        self._line("errors", row)

    def _line(self, name: str, row: dict[str, Any]) -> None:
        f = self.files[name]
        f.write(json.dumps(row, separators=(",", ":")) + "\n")
        f.flush()

    def write_meta(self, meta: dict[str, Any]) -> None:
        tmp = self.out / ".run.json.tmp"
        tmp.write_text(json.dumps(meta, indent=2, sort_keys=True, default=str) + "\n")
        tmp.replace(self.out / "run.json")

    def tables(self) -> dict[str, Any]:
        t = {name: c.table() for name, c in self.cols.items()}
        t["sessions"] = t["sessions"].sort_by("session")
        return t

    def close(self) -> None:
        for f in self.files.values():
            f.close()

    def finish(self, meta: dict[str, Any], tables: dict[str, Any]) -> None:
        """Parquet + run.json (written last), then drop the converted jsonl files (``errors.jsonl`` stays)."""
        from kvgate.records import write_run

        self.close()
        write_run(self.out, meta, tables)
        for name in RECORD_FILES:
            (self.out / f"{name}.jsonl").unlink(missing_ok=True)


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
