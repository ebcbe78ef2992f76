"""The gateway's replicas and their books: which ones are up, the pool C_r of each, the policy that knows the
sessions placed on it, and the router of :mod:`kvgate.fleet.routers` (the simulator's, the same objects). No I/O
and no clock.

As in the simulator (:mod:`kvgate.sim.fleet`): a sticky router (``consistent-hash``, ``prefix-affinity``,
``kvgate``) keeps a session on one replica, so every replica has its own :class:`~kvgate.policy.Policy`, its
control sized to C_r (D_r against C_r, the paper's parking rule per replica); a per-turn router (``round-robin``,
``random``, ``least-loaded``) moves a session between turns, so one policy runs over the fleet, its control sized
to the live replicas' summed pools. One upstream is a fleet of one: one policy over its pool, as before fleets.

A replica that goes down loses its books (sticky) — its sessions' admitted demand leaves with them and each is
placed anew by the router, paying a miss there — or is taken out of the shared policy's pool (per-turn);
:class:`kvgate.gateway.sessions.Sessions` moves the sessions. A replica that comes back starts with fresh books.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator, Mapping
from typing import Any

from kvgate.fleet.routers import HEADROOM_FRACTION, STICKY, Router, make_router
from kvgate.policy import Policy, SessionState, make_control
from kvgate.policy.core import Decision
from kvgate.policy.limits import Control

_ADMITTED = frozenset({SessionState.RUNNING, SessionState.THINKING})
_HELD = frozenset({SessionState.WAITING, SessionState.PARKED})


class Replica:
    """One upstream's books. Read by the router as a :class:`kvgate.fleet.routers.ReplicaState`."""

    __slots__ = ("index", "url", "kv_pool", "up", "in_flight", "policy", "members", "kv_usage", "resident", "downs",
                 "shared", "relay", "watch", "events")

    def __init__(self, index: int, url: str) -> None:
        self.index = index
        self.url = url
        """The upstream's URL: the replica's name in metrics, logs and ``GET /v1/sessions``."""
        self.kv_pool = 0
        """C_r in tokens (0 until read)."""
        self.up = True
        self.in_flight = 0
        """Turns sent to this replica and not yet answered."""
        self.policy: Policy | None = None
        """The policy that admits turns here (the shared one with a per-turn router; None while down, sticky)."""
        self.members: dict[Any, Any] = {}
        """The sessions placed here, by id (:class:`kvgate.gateway.sessions.GwSession`)."""
        self.kv_usage = 0.0
        """Fraction of the pool in use, as the replica last reported it (prefix-affinity's fallback score)."""
        self.resident: Callable[[Hashable], int] | None = None
        """Resident tokens of a session here (from KV events), when known."""
        self.downs = 0
        """Times the replica was marked down."""
        self.shared = False
        self.relay: Any = None
        """The gateway's connection pool to it (:class:`kvgate.gateway.relay.UpstreamRelay`, set by the app)."""
        self.watch: Any = None
        """Its pool watch (:class:`kvgate.gateway.pool.PoolWatch`, set by the app)."""
        self.events: Any = None
        """Its KV-event consumer (:class:`kvgate.gateway.kvevents.KVEventSubscriber`), with ``--kv-events``."""

    @property
    def demand(self) -> int:
        """D_r: the admitted demand this replica's own books hold (0 with a shared policy: see :meth:`Fleet.stats`)."""
        p = self.policy
        return 0 if p is None or self.shared else p.demand

    @property
    def headroom(self) -> float:
        """0.95 C_r less the demand of the sessions placed here: admitted (D_r) and held (parked or waiting), which
        will need the room before a newcomer does. The simulator's router reads the same."""
        p = self.policy
        if p is None or self.shared:
            return HEADROOM_FRACTION * self.kv_pool
        held = sum(p.demand_of(sid) for sid in p.parked_order() + p.waiting_order())
        return HEADROOM_FRACTION * self.kv_pool - p.demand - held


class Fleet:
    """The replicas, the router over them, and the policies. ``start`` once the pools are known."""

    def __init__(self, urls: tuple[str, ...], router: str, seed: int = 0) -> None:
        self.replicas = [Replica(i, u) for i, u in enumerate(urls)]
        self.single = len(self.replicas) == 1
        self.router_name = router
        self.router: Router = make_router(router, seed)
        self.sticky = router in STICKY
        self.shared: Policy | None = None
        """The one policy over the fleet (a per-turn router, or one replica)."""
        self.active: tuple[str, dict[str, int | float]] = ("none", {})
        """The control the policies run now (before ``--control-at``: none)."""
        self._retired = [0, 0, 0]
        """parks, readmissions and waits of the books of replicas that went down."""
        self.replacements = 0
        """Sessions placed anew because their replica went down."""
        self.residency: Callable[[Hashable], int | None] | None = None
        """Measured resident tokens of a session on its replica (KV events), given to every policy made here
        (``Policy.residency``: what ``budgeter-resident`` reads); None without KV events."""

    # -- controls ------------------------------------------------------------------------------------------
    def control_for(self, pool: int) -> Control:
        name, opts = self.active
        return make_control(name, max(1, pool), **opts)

    def live_pool(self) -> int:
        """The summed pools of the replicas that are up (C of the fleet)."""
        return sum(r.kv_pool for r in self.replicas if r.up)

    def start(self, now: float) -> None:
        """Books for every replica (their pools read), under the active control."""
        if self.single or not self.sticky:
            self.shared = self._policy(self.live_pool(), now)
            for r in self.replicas:
                r.policy, r.shared = self.shared, True
            return
        for r in self.replicas:
            r.policy = self._policy(r.kv_pool, now)

    def _policy(self, pool: int, now: float) -> Policy:
        pol = Policy(self.control_for(pool), now=now)
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

    def retire(self, replica: Replica) -> Policy | None:
        """``replica`` went down: with per-replica books they go (their counters kept); returns them."""
        replica.up = False
        replica.downs += 1
        if self.shared is not None:
            return None
        pol, replica.policy = replica.policy, None
        if pol is not None:
            self._retired[0] += pol.parks
            self._retired[1] += pol.readmissions
            self._retired[2] += pol.waits
        return pol

    def revive(self, replica: Replica, now: float) -> None:
        """``replica`` is back: fresh books (per replica), or back in the shared pool (the caller resizes)."""
        replica.up = True
        if self.shared is None:
            replica.policy = self._policy(replica.kv_pool, now)

    # -- aggregates over the live policies ---------------------------------------------------------------------
    def policies(self) -> Iterator[Policy]:
        if self.shared is not None:
            yield self.shared
            return
        for r in self.replicas:
            if r.policy is not None:
                yield r.policy

    @property
    def control(self) -> Control:
        """The control of the first live policy (every policy runs the same one, over its own pool)."""
        for p in self.policies():
            return p.control
        return self.control_for(1)

    @property
    def demand(self) -> int:
        if self.shared is not None:
            return self.shared.demand
        return sum(p.demand for p in self.policies())

    def counts(self) -> dict[str, int]:
        if self.shared is not None:
            return self.shared.counts()
        out: dict[str, int] = {}
        for p in self.policies():
            for k, v in p.counts().items():
                out[k] = out.get(k, 0) + v
        return out or {k: 0 for k in ("in_system", "admitted", "parked", "waiting", "running", "thinking", "done")}

    @property
    def parks(self) -> int:
        return self._retired[0] + sum(p.parks for p in self.policies())

    @property
    def readmissions(self) -> int:
        return self._retired[1] + sum(p.readmissions for p in self.policies())

    @property
    def waits(self) -> int:
        return self._retired[2] + sum(p.waits for p in self.policies())

    def next_deadline(self) -> float | None:
        best = None
        for p in self.policies():
            d = p.next_deadline()
            if d is not None and (best is None or d < best):
                best = d
        return best

    # -- per replica -------------------------------------------------------------------------------------------
    def stats(self, r: Replica) -> dict[str, Any]:
        """One replica's sessions and D_r (O(1) with its own books; O(its sessions) with a shared policy, whose
        sessions are attributed to the replica they were last placed on)."""
        admitted = parked = waiting = demand = 0
        pol = r.policy
        if pol is not None and (not r.shared or self.single):
            c = pol.counts()
            admitted, parked, waiting, demand = c["admitted"], c["parked"], c["waiting"], pol.demand
        elif pol is not None:
            for sid, s in r.members.items():
                if not s.known_to_policy:
                    continue
                st = pol.state_of(sid)
                if st in _ADMITTED:
                    admitted += 1
                    demand += pol.demand_of(sid)
                elif st is SessionState.WAITING:
                    waiting += 1
                elif st is SessionState.PARKED:
                    parked += 1
        return {"replica": r.url, "index": r.index, "up": r.up, "kv_pool": r.kv_pool, "demand_tokens": demand,
                "admitted": admitted, "parked": parked, "waiting": waiting, "sessions": len(r.members),
                "in_flight": r.in_flight, "kv_usage": r.kv_usage, "downs": r.downs,
                "kv_events": None if r.events is None else r.events.stats()}
