"""Where a session's turns go in a fleet, and what happens to a replica's sessions when it goes down or comes back
(no I/O): the session layer's side of :mod:`kvgate.gateway.fleet`, as the simulator's ``place`` and ``fail``
(:mod:`kvgate.sim.fleet`) do it."""

from __future__ import annotations

from kvgate.errors import UpstreamError
from kvgate.fleet.routers import NoReplica
from kvgate.gateway.fleet import Fleet, Replica
from kvgate.gateway.sessions import GwSession, Sessions
from kvgate.policy import TurnRequested


class NoReplicaUp(UpstreamError):
    """Every replica of the fleet is down (503: retry later)."""

    http_status = 503


class Placement:
    """Places the sessions of :class:`Sessions` on the replicas of its fleet."""

    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions
        self.fleet: Fleet = sessions.fleet

    def place(self, s: GwSession) -> Replica:
        """The replica of the session's current turn: where it is, with a sticky router while that replica is up;
        else the router's choice (membership and the session's policy follow). Raises :class:`NoReplicaUp`."""
        fleet = self.fleet
        rep = s.replica
        if fleet.single:
            if rep is None:
                rep = s.replica = fleet.replicas[0]
                rep.members[s.sid] = s
                s.policy = rep.policy
            return rep
        if rep is not None and rep.up and fleet.sticky:
            if s.policy is None:
                s.policy = rep.policy
            return rep
        try:
            new = fleet.replicas[fleet.router.route(s.sid, fleet.replicas)]
        except NoReplica:
            raise NoReplicaUp("no upstream replica is up") from None
        if new is not rep:
            if rep is not None:
                rep.members.pop(s.sid, None)
            new.members[s.sid] = s
            s.replica = new
        if s.policy is None:
            s.policy = new.policy
        return new

    def target(self, s: GwSession) -> Replica | None:
        """Where a released turn goes: its replica; with a per-turn router another one if it went down meanwhile;
        None when its replica's books went while it was being released (sticky: ask again, on a new replica)."""
        rep = s.replica
        assert rep is not None
        if rep.up:
            return rep
        if self.fleet.sticky and not self.fleet.single:
            return None
        return self.place(s)

    def replica_down(self, rep: Replica, now: float) -> int:
        """``rep`` is down: its sessions are placed anew, as the simulator's ``fail()`` does. With per-replica
        books they go with it (the admitted demand leaves D_r); its held turns are asked again on their new
        replicas, in the order they were held there; its sessions between turns are placed now, and known to their
        new replica's policy at their next turn; its turns in flight fail and are retried by their handlers. With a
        shared policy its pool leaves the fleet's. Returns the sessions placed anew."""
        fleet = self.fleet
        if not rep.up:
            return 0
        old = fleet.retire(rep)
        members = list(rep.members.values())
        moved = 0
        if old is None:  # one policy over the fleet: smaller now
            self.sessions.apply(fleet.resize(now, rep))
        else:
            order = {sid: k for k, sid in enumerate(old.parked_order() + old.waiting_order())}
            held = [s for s in members if s.known_to_policy and s.sid in order and s.future is not None
                    and not s.future.done()]
            held.sort(key=lambda s: order[s.sid])
            for s in members:
                s.policy = None
                s.known_to_policy = False
                s.replaced = True
            for s in held:
                try:
                    pol = self.place(s).policy
                except NoReplicaUp as e:
                    if s.future is not None and not s.future.done():
                        s.future.set_exception(e)
                    continue
                assert pol is not None
                moved += 1
                decisions = pol.handle(TurnRequested(now, s.sid, s.context, s.output))
                s.known_to_policy, s.replaced = True, False
                self.sessions.apply(decisions)
        for s in members:  # between turns: placed now (in flight: placed when their handler retries)
            if not s.busy and not s.dropped and s.replica is rep:
                try:
                    self.place(s)
                except NoReplicaUp:
                    break
                moved += 1
        fleet.replacements += moved
        return moved

    def replica_up(self, rep: Replica, now: float) -> None:
        """``rep`` answers again: fresh books (per replica) or back in the shared pool."""
        if rep.up:
            return
        self.fleet.revive(rep, now)
        if self.fleet.shared is not None:
            self.sessions.apply(self.fleet.resize(now, rep))
