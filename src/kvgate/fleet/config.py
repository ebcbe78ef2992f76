"""A fleet's config: replicas, their pools, the router and the fleet triggers (no I/O)."""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.engine.costmodel import profile as get_profile
from kvgate.errors import UsageError
from kvgate.fleet.routers import ROUTERS
from kvgate.workload.triggers import Join, ReplicaFailure, triggers_of


@dataclass(frozen=True)
class FleetConfig:
    """The fleet: how many replicas, their pools, the router, and the fleet's triggers (failures, joins,
    migration). Composed into :class:`kvgate.sim.config.SimConfig` with the workload, engine and control configs;
    the defaults are one replica and no trigger: a run of one engine."""

    replicas: int = 1
    replica_pools: tuple[int, ...] = ()
    """KV pool of every replica (the initial ones, then each of ``join_at``'s); empty: the config's pool."""
    router: str = "kvgate"
    fail_at: tuple[str, ...] = ()
    """``R@M``: replica R fails at minute M."""
    join_at: tuple[float, ...] = ()
    """Minutes at which a new replica joins (replica ``replicas + i`` for the i-th)."""
    migrate_after_s: float | None = None
    """kvgate router: move a session parked this long to a replica with headroom (None: never)."""

    @property
    def is_fleet(self) -> bool:
        """More than one engine, or a fleet trigger: recorded with a replica column and summarised per replica."""
        return self.replicas > 1 or bool(self.join_at or self.fail_at or self.replica_pools)

    @property
    def slots(self) -> int:
        """Replicas over the whole run (the initial ones and those that join)."""
        return self.replicas + len(self.join_at)

    def pools(self) -> list[int]:
        """Every replica's KV pool in tokens, by index."""
        if self.replica_pools:
            return [int(p) for p in self.replica_pools]
        pool = self.kv_pool or get_profile(self.profile).kv_pool  # type: ignore[attr-defined]
        return [pool] * self.slots


def check_fleet(cfg: FleetConfig, max_context: int) -> None:
    """Check the fleet's fields (``max_context``: the workload's longest session); raises UsageError."""
    if cfg.replicas < 1:
        raise UsageError("--replicas must be at least 1")
    if cfg.router not in ROUTERS:
        raise UsageError(f"unknown --router {cfg.router!r}; choose from {', '.join(ROUTERS)}")
    if cfg.replica_pools and len(cfg.replica_pools) != cfg.slots:
        raise UsageError(f"--replica-pools needs {cfg.slots} pools (one per replica, joining ones included)")
    need = max_context
    for p in cfg.pools():
        if p < need:
            raise UsageError(f"a replica's KV pool of {p} tokens is smaller than one session's context ({need})")
    if any(not m >= 0 for m in cfg.join_at):
        raise UsageError("--join-at minutes must be non-negative")
    events = [t for t in triggers_of(cfg) if isinstance(t, ReplicaFailure | Join)]
    for t in events:
        if isinstance(t, ReplicaFailure) and not (0 <= t.replica < cfg.slots and t.at_min >= 0):
            raise UsageError(f"--fail-at {t.spec()!r}: replica must be 0..{cfg.slots - 1} and the minute >= 0")
    up = set(range(cfg.replicas))
    for _, failing, r in sorted((t.at_min, isinstance(t, ReplicaFailure), t.replica) for t in events):
        if failing:
            up.discard(r)
            if not up:
                raise UsageError(f"--fail-at: replica {r} is the last one up when it fails; keep one replica up")
        else:
            up.add(r)
    if cfg.migrate_after_s is not None and (cfg.router != "kvgate" or not cfg.migrate_after_s > 0):
        raise UsageError("--migrate-after needs --router kvgate and a positive number of seconds")
