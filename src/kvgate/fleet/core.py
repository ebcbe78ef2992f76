"""A fleet's books, without I/O and without a clock, written once: the simulator (:mod:`kvgate.sim.fleet`, in
virtual time) and the gateway (:mod:`kvgate.gateway.placement`, over HTTP) drive the same :class:`Fleet`.

What it keeps: the replicas (up or down, the pool C_r of each, the sessions placed on each, the policy that admits
their turns), the router over them (:mod:`kvgate.fleet.routers`) and the control the policies run. What it does:
places a session at its turn boundary, asks that replica's policy for the turn, takes a replica out when it goes
down and puts it back when it comes back, resizes a control when a pool changes, switches the control, and counts
per replica.

Books. A sticky router (``consistent-hash``, ``prefix-affinity``, ``kvgate``) keeps a session on one replica, so
every replica has its own :class:`~kvgate.policy.Policy`, its control sized to C_r: D_r against C_r, the paper's
parking rule per replica. A per-turn router (``round-robin``, ``random``, ``least-loaded``) moves a session between
turns, so one policy runs over the fleet, its control sized to the live replicas' summed pools. One replica is a
fleet of one: one policy over its pool, and no router to ask.

A session is the driver's own record (the simulator's ``FleetSession``, the gateway's ``GwSession``) read and
written through :class:`Member`; what needs the driver's I/O goes through :class:`Driver`.

A replica that goes down (:meth:`Fleet.fail`), in this order:

1. it is down; per-replica books retire with it (their counters kept) and its sessions forget them; a shared
   policy's control shrinks to the live pools;
2. its turns in flight failed: the driver hears of each (:meth:`Driver.turn_failed`: the simulator records the
   error and the agent re-sends the turn at once; the gateway's handler sees the broken connection and retries);
3. its held turns (per-replica books) are asked again on their new replicas, in the order they were held;
4. its other sessions are placed now, and known to their new replica's policy at their next turn.

A replica that comes back (:meth:`Fleet.revive`) starts with fresh books, or rejoins the shared pool.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping, Sequence
from typing import Any, Protocol

from kvgate.fleet.routers import HEADROOM_FRACTION, NoReplica, Router
from kvgate.policy import (
    Policy,
    PolicyError,
    SessionEnded,
    SessionState,
    Tenancy,
    TurnRequested,
    make_control,
    make_policy,
)
from kvgate.policy.core import Decision
from kvgate.policy.limits import Control

_RUNNING = SessionState.RUNNING
_THINKING = SessionState.THINKING
_WAITING = SessionState.WAITING
_DONE = SessionState.DONE


class Member(Protocol):
    """A session as the fleet reads and writes it (the driver's own record)."""

    replica: Replica | None
    """The replica it is placed on (None: not placed yet)."""
    policy: Policy | None
    """The policy that knows it (None: its replica's books went, or it was placed and not asked yet)."""

    @property
    def sid(self) -> Hashable: ...
    @property
    def demand(self) -> int:
        """Its current turn's demand: prompt (context) plus output budget."""
        ...


class Driver(Protocol):
    """What the fleet needs done with the driver's I/O."""

    def apply(self, decisions: list[Decision], now: float) -> None:
        """Carry out a policy's decisions (send a turn let proceed; a held one waits)."""

    def turn_failed(self, s: Any, now: float) -> None:
        """``s``'s turn was in flight on a replica that went down."""

    def ask_again(self, s: Any, now: float) -> None:
        """``s``'s turn, held on a replica that went down, is asked again (:meth:`Fleet.ask`, then ``apply``)."""


class Replica:
    """One replica's books, read by the router as a :class:`kvgate.fleet.routers.ReplicaState`. A driver subclasses
    it with what it drives (the simulator's engine, the gateway's connection pool)."""

    __slots__ = ("index", "kv_pool", "up", "in_flight", "policy", "members", "kv_usage", "resident", "downs",
                 "shared", "retired_parks")

    def __init__(self, index: int, kv_pool: int = 0, up: bool = True) -> None:
        self.index = index
        self.kv_pool = kv_pool
        """C_r in tokens."""
        self.up = up
        self.in_flight = 0
        """Turns sent to it and not yet answered (the driver counts them)."""
        self.policy: Policy | None = None
        """The policy that admits turns here (the shared one with a per-turn router; None while down, sticky)."""
        self.members: dict[Any, Any] = {}
        """The sessions placed here, by id (:class:`Member`)."""
        self.kv_usage = 0.0
        """Fraction of the pool in use, as the driver last read it (for routers that read it)."""
        self.resident: Callable[[Hashable], int] | None = None
        """Resident tokens of a session here (from KV events), when known."""
        self.downs = 0
        """Times it went down."""
        self.shared = False
        """Its policy is the fleet's one (a per-turn router, or one replica)."""
        self.retired_parks = 0
        """Parks counted by its books that went down with it."""

    @property
    def placed(self) -> int:
        """The demand of the sessions placed here: admitted (D_r), held, and between turns."""
        return sum(s.demand for s in self.members.values())

    @property
    def headroom(self) -> float:
        """0.95 C_r less the demand placed here: what the kvgate router places by."""
        return HEADROOM_FRACTION * self.kv_pool - self.placed

    @property
    def demand(self) -> int:
        """D_r: the admitted demand its own books hold (0 with a shared policy: see :meth:`Fleet.counts_of`)."""
        p = self.policy
        return 0 if p is None or self.shared else p.demand


def _state(policy: Policy, sid: Hashable) -> SessionState | None:
    try:
        return policy.state_of(sid)
    except PolicyError:  # not known to it
        return None


class Fleet:
    """The replicas, the router over them, and the policies. Set ``driver`` and ``active``, then :meth:`start`."""

    def __init__(self, replicas: Sequence[Replica], router: Router) -> None:
        self.replicas = list(replicas)
        self.single = len(self.replicas) == 1
        self.router = router
        self.sticky = router.sticky
        self.driver: Driver | None = None
        self.shared: Policy | None = None
        """The one policy over the fleet (a per-turn router, or one replica)."""
        self.active: tuple[str, Mapping[str, Any]] = ("none", {})
        """The control the policies run now, and its options."""
        self.residency: Callable[[Hashable], int | None] | None = None
        """Measured resident tokens of a session on its replica, given to every policy made here
        (``Policy.residency``, what ``budgeter-resident`` reads); None where nothing measures it."""
        self.tenancy: Tenancy | None = None
        """Tenancy of the policies made here (``FairPolicy``: fair share across tenants); None: ``Policy``."""
        self.refresh: Callable[[], None] | None = None
        """Called before a router that reads the replicas' KV usage routes, by a driver that reads it on demand."""
        self.retired = [0, 0, 0]
        """Parks, readmissions and waits of the books of replicas that went down."""
        self.replacements = 0
        """Sessions placed anew because their replica went down."""

    # -- controls and books ------------------------------------------------------------------------------------
    def control_for(self, pool: int) -> Control:
        name, opts = self.active
        return make_control(name, max(1, pool), **opts)

    def live_pool(self) -> int:
        """The summed pools of the replicas that are up (C of the fleet)."""
        return sum(r.kv_pool for r in self.replicas if r.up)

    def start(self, now: float) -> None:
        """Books for every replica that is up, under the active control."""
        if self.single or not self.sticky:
            self.shared = self._policy(self.live_pool(), now)
            for r in self.replicas:
                r.policy, r.shared = self.shared, True
            return
        for r in self.replicas:
            if r.up:
                r.policy = self._policy(r.kv_pool, now)

    def _policy(self, pool: int, now: float) -> Policy:
        pol = make_policy(self.control_for(pool), now=now, tenancy=self.tenancy)
        pol.residency = self.residency
        return pol

    def set_control(self, now: float, name: str, opts: Mapping[str, Any]) -> list[Decision]:
        """Every live policy switches to control ``name`` over its pool; the decisions, all policies together."""
        self.active = (name, dict(opts))
        if self.shared is not None:
            return self.shared.set_control(now, self.control_for(self.live_pool()))
        out: list[Decision] = []
        for r in self.replicas:
            if r.up and r.policy is not None:
                out += r.policy.set_control(now, self.control_for(r.kv_pool))
        return out

    def resize(self, now: float, replica: Replica) -> list[Decision]:
        """``replica``'s pool or state changed: its policy (or the shared one) gets the same control over the new C."""
        if self.shared is not None:
            return self.shared.set_control(now, self.control_for(self.live_pool()))
        if replica.up and replica.policy is not None:
            return replica.policy.set_control(now, self.control_for(replica.kv_pool))
        return []

    # -- a session's turn --------------------------------------------------------------------------------------
    def place(self, s: Member) -> Replica:
        """The replica of ``s``'s current turn: where it is, with a sticky router while that replica is up; else the
        router's choice (membership follows; the policy does not: see :meth:`ask`). Raises
        :class:`~kvgate.fleet.routers.NoReplica` when every replica is down."""
        rep = s.replica
        if rep is not None and rep.up and (self.sticky or self.single):
            return rep
        if self.single:
            new = self.replicas[0]
        else:
            if self.refresh is not None:
                self.refresh()
            new = self.replicas[self.router.route(s.sid, self.replicas)]
        if new is not rep:
            if rep is not None:
                rep.members.pop(s.sid, None)
            new.members[s.sid] = s
            s.replica = new
        return new

    def ask(
        self, s: Member, now: float, context: int, output: int, tenant: Hashable = None, priority: int | None = None
    ) -> list[Decision]:
        """``s`` reaches its turn boundary: placed, then asked of its replica's policy (with its ``tenant`` and the
        turn's ``priority``, read by a fair policy). The decisions."""
        rep = s.replica
        if rep is None or not rep.up or not (self.sticky or self.single):  # (else: where it is, as place() says)
            rep = self.place(s)
        pol: Policy = rep.policy  # type: ignore[assignment]
        s.policy = pol
        return pol.handle(TurnRequested(now, s.sid, context, output, tenant, priority))

    def target(self, s: Member) -> Replica | None:
        """Where a turn let proceed goes: its replica; with a per-turn router another one if it went down meanwhile;
        None when its replica's books went meanwhile (sticky: ask again, on a new replica)."""
        rep = s.replica
        assert rep is not None
        if rep.up:
            return rep
        if self.sticky and not self.single:
            return None
        return self.place(s)

    def leave(self, s: Member) -> None:
        """``s`` left the fleet (its policy is told by the driver)."""
        rep = s.replica
        if rep is not None and rep.members.get(s.sid) is s:
            del rep.members[s.sid]
        if not self.single:
            self.router.forget(s.sid)

    def migration_target(self, s: Member) -> Replica | None:
        """A replica other than ``s``'s own with headroom for its demand (the kvgate router's), or None."""
        if self.refresh is not None:
            self.refresh()
        at = self.router.migration_target(s.sid, s.demand, self.replicas)  # type: ignore[attr-defined]
        return None if at is None else self.replicas[at]

    def move(self, s: Member, target: Replica, now: float) -> list[Decision]:
        """Move held ``s`` to ``target`` (a migration): it ends at its policy, and is new on ``target``."""
        pol = s.policy
        assert pol is not None and s.replica is not None
        decisions = pol.handle(SessionEnded(now, s.sid))
        pol.forget(s.sid)  # it may come back later, as a new session there
        self.router.move(s.sid, target.index)  # type: ignore[attr-defined]
        s.replica.members.pop(s.sid, None)
        target.members[s.sid] = s
        s.replica = target
        return decisions

    # -- replicas going down and coming back ------------------------------------------------------------------
    def fail(self, rep: Replica, now: float) -> int:
        """``rep`` went down (see the module's docstring). Returns the sessions placed anew."""
        if not rep.up:
            return 0
        driver = self.driver
        assert driver is not None
        rep.up = False
        rep.downs += 1
        members = list(rep.members.values())
        old = rep.policy
        flying = [s for s in members if old is not None and _state(old, s.sid) is _RUNNING]
        held: list[Any] = []
        if self.shared is not None:
            driver.apply(self.resize(now, rep), now)
        elif old is not None:
            rep.policy = None
            self.retired[0] += old.parks
            self.retired[1] += old.readmissions
            self.retired[2] += old.waits
            rep.retired_parks += old.parks
            order = {sid: k for k, sid in enumerate(old.parked_order() + old.waiting_order())}
            held = sorted((s for s in members if s.sid in order), key=lambda s: order[s.sid])
            for s in members:
                s.policy = None
        for s in flying:
            driver.turn_failed(s, now)
        resent = {id(s) for s in flying}
        moved = 0
        for s in held:
            driver.ask_again(s, now)
            moved += s.replica is not rep
        for s in members:  # between turns: placed now (in flight: placed when their turn is sent again)
            if s.replica is rep and id(s) not in resent and rep.members.get(s.sid) is s:
                try:
                    self.place(s)
                except NoReplica:
                    break
                moved += 1
        self.replacements += moved
        return moved

    def revive(self, rep: Replica, now: float) -> None:
        """``rep`` is up (back, or joining): fresh books, or back in the shared pool (whose control grows)."""
        if rep.up:
            return
        rep.up = True
        if self.shared is None:
            rep.policy = self._policy(rep.kv_pool, now)
            return
        rep.policy, rep.shared = self.shared, True
        assert self.driver is not None
        self.driver.apply(self.resize(now, rep), now)

    # -- aggregates over the live policies ---------------------------------------------------------------------
    def policies(self) -> Iterator[Policy]:
        if self.shared is not None:
            yield self.shared
            return
        for r in self.replicas:
            if r.policy is not None:
                yield r.policy

    def timed_policies(self) -> list[Policy]:
        """The live policies whose control has timers (the others never need ``Timer``)."""
        return [p for p in self.policies() if type(p.control).next_deadline is not Control.next_deadline]

    def is_live(self, policy: Policy) -> bool:
        """Whether ``policy`` admits turns on a replica that is up."""
        return any(r.up and r.policy is policy for r in self.replicas)

    @property
    def control(self) -> Control:
        """The control of the first live policy (every policy runs the same one, over its own pool)."""
        for p in self.policies():
            return p.control
        return self.control_for(1)

    @property
    def demand(self) -> int:
        return sum(p.demand for p in self.policies())

    def counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for p in self.policies():
            for k, v in p.counts().items():
                out[k] = out.get(k, 0) + v
        return out or {k: 0 for k in ("in_system", "admitted", "parked", "waiting", "running", "thinking", "done")}

    @property
    def parks(self) -> int:
        return self.retired[0] + sum(p.parks for p in self.policies())

    @property
    def readmissions(self) -> int:
        return self.retired[1] + sum(p.readmissions for p in self.policies())

    @property
    def waits(self) -> int:
        return self.retired[2] + sum(p.waits for p in self.policies())

    def next_deadline(self) -> float | None:
        best = None
        for p in self.policies():
            d = p.next_deadline()
            if d is not None and (best is None or d < best):
                best = d
        return best

    def counts_of(self, r: Replica) -> tuple[int, int, int, int]:
        """One replica's sessions admitted, parked (or suspended), waiting, and their admitted demand: O(1) with its
        own books; O(its sessions) with a shared policy, whose sessions count on the replica they are placed on."""
        pol = r.policy
        if pol is None:
            return 0, 0, 0, 0
        if not r.shared or self.single:
            c = pol.counts()
            return c["admitted"], c["parked"], c["waiting"], pol.demand
        admitted = parked = waiting = demand = 0
        for sid in r.members:
            st = _state(pol, sid)
            if st is _RUNNING or st is _THINKING:
                admitted += 1
                demand += pol.demand_of(sid)
            elif st is _WAITING:
                waiting += 1
            elif st is not None and st is not _DONE:
                parked += 1
        return admitted, parked, waiting, demand
