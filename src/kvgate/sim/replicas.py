"""The fleet simulator's state: a session with its place in the fleet, and a replica (its engine, its gateway's
policy, its members), as :mod:`kvgate.sim.fleet`'s event loop keeps them."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kvgate.engine.base import Engine, Request
from kvgate.fleet.routers import ReplicaView
from kvgate.policy import Policy, SessionState
from kvgate.records import SampleRow
from kvgate.workload.session import Session, Sessions


@dataclass(eq=False)
class FleetSession(Session):
    """A session with the simulator's side of its current turn, and where it is in the fleet."""

    t_req: float = 0.0
    req: Request | None = None
    sent: float = 0.0
    attempt_sent: float = 0.0
    replica: int = -1
    policy: Policy | None = None
    """The policy that knows the session (None: re-placed after a failure, not asked yet)."""
    epoch: int = 0
    """Bumped when a failure re-sends the turn (the old attempt's timeout is stale)."""
    parks: int = 0
    """Times held at a boundary (a pending migration check is for one of them)."""


class Replica:
    """One engine replica: up or down, its engine and its gateway's policy, the sessions placed on it."""

    __slots__ = ("index", "pool", "engine", "policy", "up", "busy", "wake", "gen", "members", "status", "pending",
                 "in_flight")

    def __init__(self, index: int, pool: int) -> None:
        self.index = index
        self.pool = pool
        self.engine: Engine | None = None
        self.policy: Policy | None = None
        self.up = False
        self.busy = False
        self.wake = False
        """Whether the loop must see if the replica can step (work arrived, or its step ended, since it last looked)."""
        self.gen = 0
        self.members: dict[int, FleetSession] = {}
        self.status: Any = None
        self.pending: tuple[float, int, int] | None = None
        """Its engine's jump left pending: (its start, its step event's sequence number, its planned steps)."""
        self.in_flight = 0
        """Turns sent to it and not yet answered (what a router counts)."""

    def start(self, engine: Engine, policy: Policy) -> None:
        self.engine, self.policy, self.up, self.busy, self.wake = engine, policy, True, False, True
        self.pending, self.in_flight = None, 0
        self.pool = engine.kv_pool
        self.gen += 1
        tracks = getattr(engine, "tracks_sessions", False)
        self.status = getattr(engine, "session_status", None) if tracks else None

    def demand(self) -> int:
        return sum(s.demand for s in self.members.values())

    def view(self, usage: bool, demand: bool) -> ReplicaView:
        """What a router may know of it (KV usage and placed demand only when the router reads them)."""
        e = self.engine
        if not self.up or e is None:
            return ReplicaView(self.index, False, kv_pool=self.pool)
        return ReplicaView(self.index, True, self.in_flight, e.usage() if usage else 0.0, self.pool,
                           self.demand() if demand else 0)

    def sample_row(self, now: float, alone: Sessions | None, shared: bool) -> SampleRow:
        """Its samples row: sessions in the system and their demand (``alone``'s when it is the only engine), the
        policy's counts (its members' only, when one ``shared`` policy runs over the fleet), the engine's queues."""
        eng, pol = self.engine, self.policy
        assert eng is not None and pol is not None
        if not shared:
            c = pol.counts()
            adm, par, wai, adm_d = c["admitted"], c["parked"], c["waiting"], pol.demand
        else:
            adm = par = wai = adm_d = 0
            for sid in self.members:
                st = pol.state_of(sid)
                if st is SessionState.RUNNING or st is SessionState.THINKING:
                    adm += 1
                    adm_d += pol.demand_of(sid)
                elif st is SessionState.WAITING:
                    wai += 1
                elif st is not SessionState.DONE:
                    par += 1
        in_sys, dem = (alone.in_system, alone.demand) if alone is not None else (len(self.members), self.demand())
        return SampleRow(
            now, in_sys, adm, par, wai, len(eng.running), len(eng.waiting), eng.usage(), dem, adm_d, self.pool,
            eng.stats.preemptions,
        )


def replica_index(rep: Replica) -> int:
    return rep.index
