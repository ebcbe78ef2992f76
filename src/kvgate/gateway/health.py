"""A fleet's health: every ``--health-interval`` seconds each replica's ``GET /health`` (``/v1/models`` where it
has none; with a router that reads KV usage, prefix-affinity, also its ``/metrics`` for it). A replica is marked
down by a failed check or by a connection error on a relayed turn, and its sessions are placed anew
(:meth:`kvgate.gateway.placement.Placement.replica_down`); it is up again when a check passes (its C re-read
first, with ``--kv-pool auto``). One upstream is not checked: there is nowhere else to send its sessions."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

from kvgate.gateway.config import GatewayConfig
from kvgate.gateway.fleet import Fleet, Replica
from kvgate.gateway.placement import NoReplicaUp, Placement
from kvgate.gateway.pool import PoolWatch
from kvgate.gateway.relay import UpstreamRelay
from kvgate.http.dialect import FLUSH_PATHS
from kvgate.http.openai import EngineInfo, Unreachable, kv_usage_from_metrics, one_line
from kvgate.http.server import Request, StreamResponse, exc_response
from kvgate.http.signals import cancel

log = logging.getLogger("kvgate.gateway")

HEALTH_CHECK = "kvgate-gateway-health-check"
"""The name of the task checking one replica (awaited by the health loop)."""


def build_fleet(
    cfg: GatewayConfig, client_keys: bool, errors: Counter[str], on_change: Callable[[Replica, int, int], None],
    relay_class: type[UpstreamRelay] = UpstreamRelay,
) -> Fleet:
    """The fleet of ``cfg``'s upstreams, each replica with its relay (a ``relay_class``; failures counted in
    ``errors``) and its pool watch (``on_change(replica, old, new)`` when its C changes)."""
    relays = [relay_class(cfg, client_keys=client_keys, url=u, errors=errors) for u in cfg.urls]
    fleet = Fleet(tuple(r.base_str for r in relays), cfg.router_name)
    fleet.tenancy = cfg.tenancy()  # (FairPolicy with tenant options; None: the plain core)
    for rep, relay in zip(fleet.replicas, relays, strict=True):
        rep.relay = relay
        rep.watch = PoolWatch(relay.get, str(relay.base), cfg.kv_pool)
        rep.watch.on_change = functools.partial(on_change, rep)
    return fleet


async def read_pools(fleet: Fleet) -> None:
    """Every replica's C at start, at once (``--kv-pool auto``; the first that fails stops the start)."""
    got = await asyncio.gather(*(r.watch.read() for r in fleet.replicas), return_exceptions=True)
    for err in got:
        if isinstance(err, BaseException):
            raise err
    for rep in fleet.replicas:
        rep.kv_pool = rep.watch.kv_pool


async def fleet_passthrough(fleet: Fleet, request: Request) -> StreamResponse:
    """A path the gateway does not serve, in a fleet: to the first replica that is up; a prefix-cache flush to
    every one (the answer: the first failure, else the last)."""
    up = [r for r in fleet.replicas if r.up]
    if not up:
        return exc_response(NoReplicaUp("no upstream replica is up"), {"Retry-After": "1"})
    if request.method != "POST" or request.path not in FLUSH_PATHS:
        return await up[0].relay.passthrough(request)  # type: ignore[no-any-return]
    out: StreamResponse | None = None
    for r in up:
        out = await r.relay.passthrough(request)
        if out.status >= 300:
            break
    assert out is not None
    return out


def connections(fleet: Fleet) -> dict[str, int]:
    """Connections of every replica's pool: ``acquired`` (in use) and ``idle`` (kept alive)."""
    out = {"acquired": 0, "idle": 0}
    for rep in fleet.replicas:
        c = rep.relay.connections()
        out["acquired"] += c["acquired"]
        out["idle"] += c["idle"]
    return out


def describe(fleet: Fleet) -> list[dict[str, Any]]:
    """Every replica: up, C_r, D_r, sessions by state, turns in flight, connections, what discovery learnt (O(1)
    per replica with per-replica books)."""
    return [{**fleet.stats(r), "connections": r.relay.connections(), "info": r.watch.upstream_info.record()}
            for r in fleet.replicas]


def fleet_info(fleet: Fleet) -> EngineInfo:
    """What discovery learnt about a fleet: its first replica's, with the pool of the replicas up."""
    info: EngineInfo = fleet.replicas[0].watch.upstream_info
    return dataclasses.replace(info, kv_pool=fleet.live_pool(), num_gpu_blocks=None, source="fleet")


def live_tasks() -> int:
    """asyncio tasks alive in the running loop (handlers, the timer, the health loop; not the health checks the
    loop is awaiting now): a leak shows here."""
    return sum(1 for t in asyncio.all_tasks() if t.get_name() != HEALTH_CHECK)


class Health:
    """The fleet's health checks and the marking of replicas down and up. ``start()``, then ``await stop()``."""

    def __init__(
        self, fleet: Fleet, placement: Placement, interval_s: float, now: Callable[[], float],
        wake: Callable[[], None],
    ) -> None:
        self.fleet = fleet
        self.placement = placement
        self.interval_s = interval_s
        self.now = now
        self.wake = wake
        self.stopping = False
        self._path = ["/health"] * len(fleet.replicas)
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        if not self.fleet.single:
            self._task = asyncio.get_running_loop().create_task(self.loop(), name="kvgate-gateway-health")

    async def stop(self) -> None:
        self.stopping = True
        await cancel(self._task)
        self._task = None

    def failed(self, rep: Replica, kind: str) -> None:
        """A relayed turn failed on ``rep``: a connection error marks a fleet's replica down."""
        if not self.fleet.single and kind in ("connect", "disconnect"):
            self.down(rep, f"turn failed ({kind})")

    def down(self, rep: Replica, why: str) -> None:
        if not rep.up or self.stopping:
            return
        if rep.events is not None:  # what it held is unknown until its events say again
            rep.events.reset()
        moved = self.placement.replica_down(rep, self.now())
        self.wake()
        up = sum(r.up for r in self.fleet.replicas)
        log.warning("replica down", extra={"event": "replica_down", "replica": rep.url, "why": why,
                                           "sessions_replaced": moved, "up": up})

    async def up(self, rep: Replica) -> None:
        watch = rep.watch
        if watch.configured is None and not await watch.reread():  # a restarted engine may have another pool
            return
        if rep.up or self.stopping:
            return
        rep.kv_pool = watch.kv_pool
        if rep.events is not None:
            rep.events.reset()
        self.placement.replica_up(rep, self.now())
        self.wake()
        log.info("replica up", extra={"event": "replica_up", "replica": rep.url, "kv_pool": rep.kv_pool})

    async def _probe(self, rep: Replica, timeout_s: float) -> bool:
        """One health check: ``GET /health`` (``/v1/models`` where that is 404) answers 200; for a router that reads
        KV usage the replica's is read from its ``/metrics`` too."""
        i = rep.index
        try:
            async with asyncio.timeout(timeout_s):
                status, _ = await rep.relay.get(self._path[i])
                if status == 404 and self._path[i] == "/health":
                    self._path[i] = "/v1/models"
                    status, _ = await rep.relay.get("/v1/models")
                if status == 200 and self.fleet.router.reads_kv_usage:
                    m_status, text = await rep.relay.get("/metrics")
                    usage = kv_usage_from_metrics(text.decode("utf-8", "replace")) if m_status == 200 else None
                    if usage is not None:
                        rep.kv_usage = usage
        except (Unreachable, TimeoutError, OSError) as e:
            log.debug("health check failed", extra={"event": "health", "replica": rep.url, "detail": one_line(e)})
            return False
        return status == 200

    async def _check(self, rep: Replica, timeout_s: float) -> None:
        ok = await self._probe(rep, timeout_s)
        if ok and not rep.up:
            await self.up(rep)
        elif not ok and rep.up:
            self.down(rep, "health check failed")

    async def loop(self) -> None:
        interval = self.interval_s
        timeout_s = max(2.0, 2 * interval)
        replicas = self.fleet.replicas
        while True:
            await asyncio.sleep(interval)
            try:
                await asyncio.gather(*(asyncio.create_task(self._check(r, timeout_s), name=HEALTH_CHECK)
                                       for r in replicas))
            except Exception:  # never let a bug stop the health checks
                log.exception("health check failed", extra={"event": "health_error"})
