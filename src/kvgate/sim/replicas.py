"""The simulator's side of a fleet: a session with its place in the fleet, and a replica with its engine (the books
are :mod:`kvgate.fleet.core`'s), as :mod:`kvgate.sim.fleet`'s event loop keeps them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgate.engine.base import Engine, Request
from kvgate.engine.blocks import SeqKey
from kvgate.fleet.core import Replica
from kvgate.policy import Policy
from kvgate.records import SampleRow
from kvgate.workload.session import Session, Sessions


@dataclass(eq=False)
class FleetSession(Session):
    """A session with the simulator's side of its current turn, and where it is in the fleet."""

    sid: int = -1  # type: ignore[assignment]
    """Its id (``spec.sid``, an attribute here: the fleet's books read it on every turn)."""
    key: SeqKey | None = None
    """The engine's key of its token sequence (set when it arrives)."""
    t_req: float = 0.0
    req: Request | None = None
    sent: float = 0.0
    attempt_sent: float = 0.0
    replica: SimReplica | None = None
    """The replica it is placed on (None: not yet)."""
    policy: Policy | None = None
    """The policy that knows the session (None: re-placed after a failure, not asked yet)."""
    epoch: int = 0
    """Bumped when a failure re-sends the turn (the old attempt's timeout is stale)."""
    parks: int = 0
    """Times held at a boundary (a pending migration check is for one of them)."""

    def __post_init__(self) -> None:
        self.sid = self.spec.sid


class SimReplica(Replica):
    """A replica of the fleet's books with its simulated engine: stepping or idle, its pending jump."""

    __slots__ = ("engine", "busy", "wake", "gen", "status", "pending")

    def __init__(self, index: int, kv_pool: int) -> None:
        super().__init__(index, kv_pool, up=False)
        self.engine: Engine | None = None
        self.busy = False
        self.wake = False
        """Whether the loop must see if the replica can step (work arrived, or its step ended, since it last looked)."""
        self.gen = 0
        self.status: Any = None
        self.pending: tuple[float, int, int] | None = None
        """Its engine's jump left pending: (its start, its step event's sequence number, its planned steps)."""

    def start(self, engine: Engine) -> None:
        """A fresh engine (the books follow: :meth:`kvgate.fleet.core.Fleet.start` or ``revive``)."""
        self.engine, self.busy, self.wake = engine, False, True
        self.pending, self.in_flight = None, 0
        self.kv_pool = engine.kv_pool
        self.gen += 1
        tracks = getattr(engine, "tracks_sessions", False)
        self.status = getattr(engine, "session_status", None) if tracks else None

    def stop(self) -> Engine:
        """Its engine is gone (the replica failed): returns it, for its counters."""
        eng = self.engine
        assert eng is not None
        self.busy, self.wake, self.engine, self.in_flight = False, False, None, 0
        self.gen += 1
        return eng

    def sample_row(self, now: float, alone: Sessions | None, counts: tuple[int, int, int, int]) -> SampleRow:
        """Its samples row: sessions in the system and their demand (``alone``'s when it is the only engine), the
        policy's ``counts`` (:meth:`kvgate.fleet.core.Fleet.counts_of`), the engine's queues."""
        eng = self.engine
        assert eng is not None
        adm, par, wai, adm_d = counts
        in_sys, dem = (alone.in_system, alone.demand) if alone is not None else (len(self.members), self.placed)
        return SampleRow(
            now, in_sys, adm, par, wai, len(eng.running), len(eng.waiting), eng.usage(), dem, adm_d, self.kv_pool,
            eng.stats.preemptions,
        )


def replica_index(rep: SimReplica) -> int:
    return rep.index
