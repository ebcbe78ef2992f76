"""Where a turn goes in a fleet of engine replicas: the routers operators use, and kvgate's.

A router sees each replica through a read-only :class:`ReplicaState` (what a gateway can know: up or down, requests
in flight, KV usage, the pool C_r, the demand of the sessions placed on it, and, with KV events, how much of a
session is resident there) and answers with a replica index. Routers keep only their own placement state; no I/O,
no clock, deterministic per seed.

Each router declares what it reads, so a driver feeds it without testing its type or name: ``sticky`` (it keeps a
session on one replica, so a budget per replica holds), ``reads_kv_usage`` (a driver must keep ``kv_usage`` fresh:
the gateway scrapes each replica's ``/metrics``, the simulator reads its engines); the demand placed on each replica
(the fleet's books) and what is resident there (KV events) are in every view. The registry
(:data:`REGISTRY`, :data:`ROUTERS`, :data:`STICKY`) is built from the classes.

* ``round-robin``: every turn to the next replica (a plain load balancer);
* ``random``: every turn to a random replica;
* ``least-loaded``: every turn to the replica with the fewest requests in flight (llm-d's queue scorer, Dynamo's
  in-flight cost);
* ``consistent-hash``: a session always to the same replica (a hash ring on the session; a down replica's arc
  goes to the next; vLLM production-stack's session routing);
* ``prefix-affinity``: a session to the replica that served it (or, with KV events, holds most of it), else the
  least KV usage (llm-d's prefix and KV-usage scorers, SGLang's gateway);
* ``kvgate``: session affinity; a new or re-placed session to the replica with the most budget headroom
  (0.95 C_r − D_r): the paper's budgeter, one budget per replica.
"""

from __future__ import annotations

import hashlib
from bisect import bisect_right
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass
from typing import ClassVar, Protocol

import numpy as np

HEADROOM_FRACTION = 0.95
"""The budgeter's target: admitted demand up to this fraction of the pool (the paper's 0.95 C)."""
RING_POINTS = 64
"""Virtual nodes per replica on the consistent-hash ring."""


class NoReplica(RuntimeError):
    """No replica is up."""


class ReplicaState(Protocol):
    """What a router reads of a replica: a :class:`ReplicaView`, or any object with the same read-only fields (the
    gateway passes its live per-replica books, so routing a turn allocates nothing)."""

    @property
    def index(self) -> int: ...
    @property
    def up(self) -> bool: ...
    @property
    def in_flight(self) -> int: ...
    @property
    def kv_usage(self) -> float: ...
    @property
    def kv_pool(self) -> int: ...
    @property
    def placed(self) -> int: ...
    @property
    def resident(self) -> Callable[[Hashable], int] | None: ...
    @property
    def headroom(self) -> float: ...


@dataclass(frozen=True, slots=True)
class ReplicaView:
    """What a router may know of one replica."""

    index: int
    up: bool = True
    in_flight: int = 0
    kv_usage: float = 0.0
    """Fraction of the pool's blocks in use (vLLM's ``kv_cache_usage_perc``)."""
    kv_pool: int = 0
    """The replica's KV pool C_r, in tokens."""
    placed: int = 0
    """KV demand of the sessions placed on it (admitted, held, and between turns), as the fleet's books keep it."""
    resident: Callable[[Hashable], int] | None = None
    """Resident tokens of a session on this replica (from KV events), when known."""

    @property
    def headroom(self) -> float:
        return HEADROOM_FRACTION * self.kv_pool - self.placed


def _up(replicas: Sequence[ReplicaState]) -> list[ReplicaState]:
    up = [r for r in replicas if r.up]
    if not up:
        raise NoReplica("no replica is up")
    return up


def _stable_hash(key: Hashable) -> int:
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "big")


class Router:
    """Base: :meth:`route` places a turn; :meth:`forget` drops a session that ended. A subclass declares its
    ``name`` and what it reads (see the module's docstring)."""

    name: ClassVar[str] = ""
    sticky: ClassVar[bool] = False
    reads_kv_usage: ClassVar[bool] = False

    def __init__(self, seed: int = 0) -> None:
        """``seed`` keys the draws of a router that draws (:class:`Random`); the others need none."""

    def route(self, session: Hashable, replicas: Sequence[ReplicaState]) -> int:
        raise NotImplementedError

    def forget(self, session: Hashable) -> None:
        return None

    def replica_of(self, session: Hashable) -> int | None:
        """The replica a sticky router holds the session on (None: not placed, or not sticky)."""
        return None


class RoundRobin(Router):
    name = "round-robin"

    def __init__(self, seed: int = 0) -> None:
        self._next = 0

    def route(self, session: Hashable, replicas: Sequence[ReplicaState]) -> int:
        n = len(replicas)
        for k in range(n):
            r = replicas[(self._next + k) % n]
            if r.up:
                self._next = (self._next + k + 1) % n
                return r.index
        raise NoReplica("no replica is up")


class Random(Router):
    name = "random"

    def __init__(self, seed: int = 0) -> None:
        self._rng = np.random.default_rng([seed, 7])

    def route(self, session: Hashable, replicas: Sequence[ReplicaState]) -> int:
        up = _up(replicas)
        return up[int(self._rng.integers(len(up)))].index


class LeastLoaded(Router):
    name = "least-loaded"

    def route(self, session: Hashable, replicas: Sequence[ReplicaState]) -> int:
        return min(_up(replicas), key=lambda r: (r.in_flight, r.index)).index


class _Sticky(Router):
    """A session stays where it was placed while that replica is up."""

    sticky = True

    def __init__(self, seed: int = 0) -> None:
        self._where: dict[Hashable, int] = {}

    def route(self, session: Hashable, replicas: Sequence[ReplicaState]) -> int:
        at = self._where.get(session)
        if at is not None and at < len(replicas) and replicas[at].up:
            return at
        at = self._place(session, replicas)
        self._where[session] = at
        return at

    def _place(self, session: Hashable, replicas: Sequence[ReplicaState]) -> int:
        raise NotImplementedError

    def forget(self, session: Hashable) -> None:
        self._where.pop(session, None)

    def replica_of(self, session: Hashable) -> int | None:
        return self._where.get(session)

    def move(self, session: Hashable, replica: int) -> None:
        """Hold ``session`` on ``replica`` from its next turn (a migration)."""
        self._where[session] = replica


class ConsistentHash(_Sticky):
    name = "consistent-hash"

    def __init__(self, seed: int = 0) -> None:
        super().__init__(seed)
        self._ring: list[tuple[int, int]] = []
        self._n = 0

    def _build(self, n: int) -> None:
        self._ring = sorted((_stable_hash(("replica", i, v)), i) for i in range(n) for v in range(RING_POINTS))
        self._n = n

    def shares(self, n: int) -> list[float]:
        """The fraction of the hash space each of ``n`` replicas owns (all up): where its sessions go."""
        if self._n != n:
            self._build(n)
        out = [0.0] * n
        space = float(2**64)
        for k, (key, i) in enumerate(self._ring):
            prev = self._ring[k - 1][0] - (space if k == 0 else 0)
            out[i] += (key - prev) / space
        return out

    def _place(self, session: Hashable, replicas: Sequence[ReplicaState]) -> int:
        _up(replicas)
        if self._n != len(replicas):
            self._build(len(replicas))
        keys = [k for k, _ in self._ring]
        at = bisect_right(keys, _stable_hash(session))
        for k in range(len(self._ring)):
            i = self._ring[(at + k) % len(self._ring)][1]
            if replicas[i].up:
                return i
        raise NoReplica("no replica is up")


class PrefixAffinity(_Sticky):
    """The replica that served the session; a new (or orphaned) session goes where most of it is resident (KV
    events), else to the least KV usage."""

    name = "prefix-affinity"
    reads_kv_usage = True

    def _place(self, session: Hashable, replicas: Sequence[ReplicaState]) -> int:
        def score(r: ReplicaState) -> tuple[int, float, int]:
            held = r.resident(session) if r.resident is not None else 0
            return (-held, r.kv_usage, r.index)

        return min(_up(replicas), key=score).index


class Kvgate(_Sticky):
    """Session affinity, and placement by budget headroom: the replica whose placed demand leaves the most room
    under 0.95 C_r (ties: fewest in flight, then the lowest index)."""

    name = "kvgate"

    def _place(self, session: Hashable, replicas: Sequence[ReplicaState]) -> int:
        return min(_up(replicas), key=lambda r: (-r.headroom, r.in_flight, r.index)).index

    def migration_target(self, session: Hashable, need: int, replicas: Sequence[ReplicaState]) -> int | None:
        """A replica other than the session's own with headroom for ``need`` more tokens (the most headroom), or
        None. The caller decides when a parked session has waited long enough to pay the miss of moving."""
        here = self._where.get(session)
        fits = [r for r in replicas if r.up and r.index != here and r.headroom >= need]
        if not fits:
            return None
        return min(fits, key=lambda r: (-r.headroom, r.in_flight, r.index)).index


REGISTRY: dict[str, type[Router]] = {
    cls.name: cls for cls in (RoundRobin, Random, LeastLoaded, ConsistentHash, PrefixAffinity, Kvgate)
}
"""Every router by name (what ``--router`` accepts)."""
ROUTERS = tuple(REGISTRY)
STICKY = frozenset(name for name, cls in REGISTRY.items() if cls.sticky)
"""Routers that keep a session on one replica (a per-replica budget needs its sessions to stay)."""


def make_router(name: str, seed: int = 0) -> Router:
    """The router ``name`` (one of :data:`ROUTERS`); raises ValueError for another."""
    cls = REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown router {name!r}; choose one of {', '.join(ROUTERS)}")
    return cls(seed)
