"""The gateway's side of the fleet's books (:class:`kvgate.fleet.core.Fleet`, which the simulator drives too): where
a session's turns go, and what happens to a replica's sessions when it goes down or comes back. No I/O: the request
path (:mod:`kvgate.gateway.turns`) and the health checks (:mod:`kvgate.gateway.health`) call it, and it carries out
what the books decide on the gateway's session records (:class:`kvgate.gateway.sessions.GwSession`)."""

from __future__ import annotations

from kvgate.errors import UpstreamError
from kvgate.fleet.routers import NoReplica
from kvgate.gateway.fleet import Fleet, Replica
from kvgate.gateway.sessions import GwSession, Sessions
from kvgate.policy.core import Decision


class NoReplicaUp(UpstreamError):
    """Every replica of the fleet is down (503: retry later)."""

    http_status = 503


class Placement:
    """Places the sessions of :class:`Sessions` on the replicas of its fleet; the fleet's
    :class:`~kvgate.fleet.core.Driver`."""

    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions
        self.fleet: Fleet = sessions.fleet
        self.fleet.driver = self

    def place(self, s: GwSession) -> Replica:
        """The replica of the session's current turn (:meth:`kvgate.fleet.core.Fleet.place`); a session no policy
        knows takes its replica's. Raises :class:`NoReplicaUp`."""
        try:
            rep: Replica = self.fleet.place(s)  # type: ignore[assignment]
        except NoReplica:
            raise NoReplicaUp("no upstream replica is up") from None
        if s.policy is None:
            s.policy = rep.policy
        return rep

    def target(self, s: GwSession) -> Replica | None:
        """Where a released turn goes (:meth:`kvgate.fleet.core.Fleet.target`); None: ask again, on a new replica."""
        try:
            return self.fleet.target(s)  # type: ignore[return-value]
        except NoReplica:
            raise NoReplicaUp("no upstream replica is up") from None

    def replica_down(self, rep: Replica, now: float) -> int:
        """``rep`` is down (:meth:`kvgate.fleet.core.Fleet.fail`); with per-replica books its sessions are unknown to
        any policy until asked again. Returns the sessions placed anew."""
        if rep.up and self.fleet.shared is None:
            for s in rep.members.values():
                s.known_to_policy = False
                s.replaced = True
        return self.fleet.fail(rep, now)

    def replica_up(self, rep: Replica, now: float) -> None:
        """``rep`` answers again: fresh books (per replica) or back in the shared pool."""
        self.fleet.revive(rep, now)

    # -- the fleet's driver ------------------------------------------------------------------------------------
    def apply(self, decisions: list[Decision], now: float) -> None:
        self.sessions.apply(decisions)

    def turn_failed(self, s: GwSession, now: float) -> None:
        """Nothing now: the turn's handler sees the broken connection and retries it on the session's new replica."""

    def ask_again(self, s: GwSession, now: float) -> None:
        """A held turn of a replica that went down, asked on its new replica (the client sees only latency)."""
        try:
            decisions = self.fleet.ask(s, now, s.est.context, s.est.output, s.tenant, s.priority)
        except NoReplica:
            s.slot.fail(NoReplicaUp("no upstream replica is up"))
            return
        s.known_to_policy, s.replaced = True, False
        self.sessions.apply(decisions)
