"""A fleet run's records: the one-engine tables with a ``replica`` column (turns: where the turn ran; samples: one
row per live replica per sample time; sessions: the replica the session was last placed on, -1 if never)."""

from __future__ import annotations

from typing import Any

import pyarrow as pa

from kvgate.records import Recorder, SampleRow, SessionRow, TurnRow

REPLICA = "replica"


class FleetRecorder(Recorder):
    """:class:`kvgate.records.Recorder` (in memory) with the replica of every row kept beside it."""

    def __init__(self) -> None:
        super().__init__()
        self.replica_of: dict[str, list[int]] = {name: [] for name in self.cols}

    def turn_at(self, row: TurnRow, replica: int) -> None:
        self.turn(row)
        self.replica_of["turns"].append(replica)

    def sample_at(self, row: SampleRow, replica: int) -> None:
        self.sample(row)
        self.replica_of["samples"].append(replica)

    def session_at(self, row: SessionRow, replica: int) -> None:
        self.session(row)
        self.replica_of["sessions"].append(replica)

    def tables(self) -> dict[str, Any]:
        out = {}
        for name, c in self.cols.items():
            t = c.table()
            out[name] = t.append_column(REPLICA, pa.array(self.replica_of[name], type=pa.int32()))
        out["sessions"] = out["sessions"].sort_by("session")
        return out


def without_replica(tables: dict[str, Any]) -> dict[str, Any]:
    """The tables as a one-engine run writes them (the ``replica`` column dropped)."""
    return {k: (t.drop_columns([REPLICA]) if REPLICA in t.column_names else t) for k, t in tables.items()}
