"""The gateway's replicas: the fleet's books (:mod:`kvgate.fleet.core`, the simulator's too) with what the gateway
drives for each replica: its URL, its connection pool, its pool watch and its KV-event consumer. No I/O and no
clock here; :mod:`kvgate.gateway.placement` drives the books from the request path and the health checks.

One upstream is a fleet of one: one policy over its pool, as before fleets. A replica that goes down loses its books
(sticky) — its sessions' admitted demand leaves with them and each is placed anew by the router, paying a miss
there — or is taken out of the shared policy's pool (per-turn). A replica that comes back starts with fresh books.
"""

from __future__ import annotations

from typing import Any

from kvgate.fleet import core
from kvgate.fleet.routers import make_router


class Replica(core.Replica):
    """One upstream's books (read by the router as a :class:`kvgate.fleet.routers.ReplicaState`) and its I/O."""

    __slots__ = ("url", "relay", "watch", "events")

    def __init__(self, index: int, url: str) -> None:
        super().__init__(index)
        self.url = url
        """The upstream's URL: the replica's name in metrics, logs and ``GET /v1/sessions``."""
        self.relay: Any = None
        """The gateway's connection pool to it (:class:`kvgate.gateway.relay.UpstreamRelay`, set by the app)."""
        self.watch: Any = None
        """Its pool watch (:class:`kvgate.gateway.pool.PoolWatch`, set by the app)."""
        self.events: Any = None
        """Its KV-event consumer (:class:`kvgate.gateway.kvevents.KVEventSubscriber`), with ``--kv-events``."""


class Fleet(core.Fleet):
    """The gateway's replicas (by URL), the router ``router`` over them, and the policies. ``start`` once the pools
    are known."""

    replicas: list[Replica]  # type: ignore[assignment]

    def __init__(self, urls: tuple[str, ...], router: str, seed: int = 0) -> None:
        super().__init__([Replica(i, u) for i, u in enumerate(urls)], make_router(router, seed))

    def stats(self, r: Replica) -> dict[str, Any]:
        """One replica's sessions and D_r (:meth:`kvgate.fleet.core.Fleet.counts_of`), as the gateway shows them."""
        admitted, parked, waiting, demand = self.counts_of(r)
        return {"replica": r.url, "index": r.index, "up": r.up, "kv_pool": r.kv_pool, "demand_tokens": demand,
                "admitted": admitted, "parked": parked, "waiting": waiting, "sessions": len(r.members),
                "in_flight": r.in_flight, "kv_usage": r.kv_usage, "downs": r.downs,
                "kv_events": None if r.events is None else r.events.stats()}
