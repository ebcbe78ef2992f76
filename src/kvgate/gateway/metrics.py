"""The gateway's metrics: cheap accumulators on the request path, Prometheus families at scrape time.

On the request path every turn costs a few additions (:class:`Histogram.observe`, :meth:`UsageWindows.add`,
counter increments); nothing takes a lock and nothing scans sessions. Gauges (sessions by state, D, C, hit
ratios, the regime alarm) are computed when Prometheus scrapes ``/metrics``, from the policy core's O(1) counts.

Hit ratio. Token-weighted over agent turns (requests that named a session) finished in the last 1 and 5
minutes of gateway time (virtual seconds with ``--time-scale``): sum(cached_tokens) / sum(prompt_tokens) over the
turns whose usage reported ``cached_tokens``. Turns are kept in 5-second buckets, so a window is exact to a
bucket.

Regime alarm (the paper's degraded regime, §3-4): 1 while the 5-minute agent hit ratio < 0.5 and either D > C or
the sessions in the system exceed N* = C / (mean prompt tokens of the agent turns of the last 5 minutes).

Replicas: the ``kvgate_replica_*`` families carry a ``replica`` label (the upstream's URL), one series per replica
(one for one upstream): up, C_r, D_r, sessions admitted / parked / waiting there, turns in flight, connections,
times marked down; with ``--kv-events``, what each followed replica's events say it holds (resident tokens and
sessions, whether the view is exact) and how its stream went (events, gaps, restarts). The unlabelled families
above are the fleet's (C: the replicas up).
"""

from __future__ import annotations

import math
from bisect import bisect_left
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Protocol

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from kvgate.gateway.fleet import Fleet
from kvgate.gateway.health import describe, live_tasks
from kvgate.gateway.tenants import TenantBook, tenant_families
from kvgate.gateway.windows import UsageWindows
from kvgate.http.openai import EngineInfo
from kvgate.http.prometheus import ScrapeCollector, counter, gauge, labelled
from kvgate.policy import Policy
from kvgate.policy.limits import Control

PARK_WAIT_BUCKETS = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
"""Seconds (gateway time) a turn was held by the policy."""
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Seconds (gateway time) from sending a turn upstream to its last byte."""
ALARM_HIT_RATIO = 0.5


class Histogram:
    """A Prometheus histogram without locks (the gateway is one event loop)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        buckets = []
        acc = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            acc += n
            buckets.append(("+Inf" if bound == math.inf else repr(float(bound)), acc))
        return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=self.total)


def regime_alarm(hit5: float, demand: int, capacity: int, in_system: int, mean_context: float) -> tuple[bool, float]:
    """``(alarm, N*)``: see the module docstring. N* is NaN without recent turns."""
    n_star = capacity / mean_context if mean_context and mean_context > 0 else math.nan
    if math.isnan(hit5) or hit5 >= ALARM_HIT_RATIO:
        return False, n_star
    over = demand > capacity or (not math.isnan(n_star) and in_system > n_star)
    return over, n_star


def summary(
    policy: Policy | Fleet, windows: UsageWindows, kv_pool: int, now: float, in_flight: int, held: int
) -> dict[str, Any]:
    """Sessions by state, D, C and the alarm inputs (O(1): for ``/v1/sessions``, the gauges and tests)."""
    counts = policy.counts()
    hit5 = windows.hit_ratio(now, 300.0)
    alarm, n_star = regime_alarm(hit5, policy.demand, kv_pool, counts["in_system"], windows.mean_prompt(now, 300.0))
    return {
        **{k: counts[k] for k in ("in_system", "admitted", "parked", "waiting", "running", "thinking")},
        "demand_tokens": policy.demand,
        "kv_pool": kv_pool,
        "demand_ratio": policy.demand / kv_pool,
        "hit_ratio_1m": _finite(windows.hit_ratio(now, 60.0)),
        "hit_ratio_5m": _finite(hit5),
        "n_star": _finite(n_star),
        "regime_alarm": alarm,
        "in_flight": in_flight,
        "held": held,
    }


def _finite(x: float) -> float | None:
    return None if x is None or math.isnan(x) else round(x, 6)


def _nan(x: float | None) -> float:
    return math.nan if x is None else x


# -- Prometheus ------------------------------------------------------------------------------------------------
class GatewayView(Protocol):
    """What the collector and the admin routes read of the gateway."""

    time_scale: float
    upstream_url: str
    turns: Counter[str]
    upstream_errors: Counter[str]
    session_ends: Counter[str]
    park_wait: Histogram
    latency: Histogram
    tenant_book: TenantBook | None

    fleet: Fleet

    @property
    def started(self) -> bool: ...
    @property
    def upstream_info(self) -> EngineInfo: ...
    @property
    def requests(self) -> int: ...
    @property
    def replaced_attempts(self) -> int: ...
    def now(self) -> float: ...
    @property
    def retried(self) -> int: ...
    def summary(self) -> dict[str, Any]: ...
    def sessions_state(self) -> dict[str, Any]: ...
    def control_state(self) -> dict[str, Any]: ...
    def info(self) -> dict[str, Any]: ...
    def set_control(self, name: str, opts: Mapping[str, Any] | None = None) -> Control: ...


TURN_OUTCOMES = ("finished", "failed", "refused", "cancelled")
"""What became of a turn: answered, failed upstream, refused (after --max-park-s or at shutdown), cancelled."""
UPSTREAM_ERROR_KINDS = ("connect", "disconnect", "timeout", "http_5xx", "http_4xx", "http_other", "too_large")
"""How the upstream failed a request."""
SESSION_END_REASONS = ("client", "delete", "idle", "disconnect", "refused", "one-turn", "released", "cap")
"""Why a session ended (left the policy: "released" keeps its record for its return)."""
BREAK_CAUSES = ("rewrite", "head", "unseen")
"""Why a prefix broke (:mod:`kvgate.gateway.breaks`)."""
LINEAGE_KINDS = ("continue", "retry", "rewrite", "fork", "replay", "new")


class GatewayCollector(ScrapeCollector):
    """The gateway's families (names and labels: tests/data/gateway-series.json), computed at scrape time."""

    def __init__(self, gw: GatewayView) -> None:
        self.gw = gw

    def collect(self) -> Iterator[Metric]:
        gw = self.gw
        if not gw.started:
            return
        policy = gw.fleet
        s = gw.summary()
        yield gauge("kvgate_sessions_in_system", "Sessions in the system (admitted, parked or waiting).",
                    s["in_system"])
        yield gauge("kvgate_sessions_admitted", "Admitted sessions (running or thinking).", s["admitted"])
        yield gauge("kvgate_sessions_running", "Admitted sessions with a turn in flight.", s["running"])
        yield gauge("kvgate_sessions_parked", "Sessions parked at a turn boundary (admitted before).", s["parked"])
        yield gauge("kvgate_sessions_waiting", "New sessions waiting for admission.", s["waiting"])
        yield gauge("kvgate_demand_tokens", "D: resident KV demand of admitted sessions (context + output budget).",
                    s["demand_tokens"])
        yield gauge("kvgate_kv_pool_tokens", "C: the upstream's KV pool in tokens.", s["kv_pool"])
        yield gauge("kvgate_demand_ratio", "D / C.", s["demand_ratio"])
        yield gauge("kvgate_n_star", "N* = C / mean context of agent turns in the last 5 minutes (NaN: no turns).",
                    _nan(s["n_star"]))
        hit = {"1m": _nan(s["hit_ratio_1m"]), "5m": _nan(s["hit_ratio_5m"])}
        yield labelled(GaugeMetricFamily, "kvgate_agent_hit_ratio", "Token-weighted prefix-cache hit ratio of agent "
                       "turns (cached / prompt tokens) over a trailing window.", "window", hit)
        yield gauge("kvgate_regime_alarm", "1 while the 5-minute agent hit ratio < 0.5 and (D > C or sessions in "
                    "system > N*).", 1.0 if s["regime_alarm"] else 0.0)
        yield gauge("kvgate_turns_in_flight", "Turns sent upstream and not yet answered.", s["in_flight"])
        yield counter("kvgate_parks", "Admitted sessions parked at a turn boundary.", policy.parks)
        yield counter("kvgate_readmissions", "Parked sessions admitted again.", policy.readmissions)
        yield counter("kvgate_waits", "New sessions that waited for admission.", policy.waits)
        yield counter("kvgate_requests", "Completion requests received.", gw.requests)
        yield labelled(CounterMetricFamily, "kvgate_turns", "Turns by outcome (finished, failed upstream, refused "
                       "after --max-park-s or shutdown, cancelled).", "outcome", gw.turns, TURN_OUTCOMES)
        yield labelled(CounterMetricFamily, "kvgate_upstream_errors", "Upstream failures by kind.", "kind",
                       gw.upstream_errors, UPSTREAM_ERROR_KINDS)
        yield labelled(CounterMetricFamily, "kvgate_session_ends", "Sessions ended, by cause.", "reason",
                       gw.session_ends, SESSION_END_REASONS)
        yield from tenant_families(gw.tenant_book, gw.fleet, gw.now())
        yield gw.park_wait.family("kvgate_park_wait_seconds", "Time a turn was held by the policy (gateway time).")
        yield gw.latency.family("kvgate_turn_latency_seconds", "Upstream time of a turn, sent to last byte "
                                "(gateway time).")
        limit = policy.control
        yield gauge("kvgate_control_info", "The active control.", 1.0, {"control": limit.name, "spec": limit.spec()})
        yield gauge("kvgate_time_scale", "Gateway seconds per real second.", gw.time_scale)
        yield gauge("kvgate_gateway_time_seconds", "The gateway's clock.", gw.now())
        yield gauge("kvgate_gateway_tasks", "asyncio tasks alive in the gateway (handlers, timers, health checks).",
                    live_tasks())
        yield counter("kvgate_turns_retried", "Turns retried on another replica after theirs failed them before "
                      "answering.", gw.retried)
        st = gw.sessions_state()
        yield labelled(CounterMetricFamily, "kvgate_prefix_breaks", "Turns whose cached tokens fell while the pool "
                       "had room, by cause (rewrite, head, unseen); not in the alarm's hit ratio.", "cause",
                       st["prefix_breaks"], BREAK_CAUSES)
        yield labelled(CounterMetricFamily, "kvgate_lineage_resolutions", "Requests that named no session, by how "
                       "lineage resolved them.", "kind", st["lineage"]["resolved"], LINEAGE_KINDS)
        yield gauge("kvgate_sessions_released", "Sessions idle past the learnt bound: out of D, kept for their "
                    "return.", s["released"])
        yield gauge("kvgate_release_after_seconds", "How long an idle session keeps its demand in D (gateway "
                    "seconds), learnt from the think times seen.", s["release_after_s"])
        yield from replica_families(describe(gw.fleet))


REPLICA_GAUGES = (
    ("kvgate_replica_up", "up", "1 while the replica is up (its health checks pass)."),
    ("kvgate_replica_kv_pool_tokens", "kv_pool", "C_r: the replica's KV pool in tokens."),
    ("kvgate_replica_demand_tokens", "demand_tokens", "D_r: resident KV demand of the sessions admitted on the "
     "replica."),
    ("kvgate_replica_sessions_admitted", "admitted", "Sessions admitted on the replica (running or thinking)."),
    ("kvgate_replica_sessions_parked", "parked", "Sessions parked at a turn boundary on the replica."),
    ("kvgate_replica_sessions_waiting", "waiting", "New sessions placed on the replica, waiting for admission."),
    ("kvgate_replica_turns_in_flight", "in_flight", "Turns sent to the replica and not yet answered."),
)


def replica_families(replicas: Sequence[dict[str, Any]]) -> Iterator[Metric]:
    """The per-replica families (label ``replica``: the upstream's URL)."""
    for name, key, doc in REPLICA_GAUGES:
        fam = GaugeMetricFamily(name, doc, labels=["replica"])
        for r in replicas:
            fam.add_metric([r["replica"]], float(r[key]))
        yield fam
    conns = GaugeMetricFamily("kvgate_replica_upstream_connections", "Connections to the replica: in use "
                              "(acquired) or kept alive (idle).", labels=["replica", "state"])
    downs = CounterMetricFamily("kvgate_replica_downs", "Times the replica was marked down.", labels=["replica"])
    for r in replicas:
        for state in ("acquired", "idle"):
            conns.add_metric([r["replica"], state], float(r["connections"][state]))
        downs.add_metric([r["replica"]], float(r["downs"]))
    yield conns
    yield downs
    followed = [r for r in replicas if r.get("kv_events") is not None]
    if not followed:
        return
    for name, key, doc, fam_cls in KV_EVENT_FAMILIES:
        fam = fam_cls(name, doc, labels=["replica"])
        for r in followed:
            fam.add_metric([r["replica"]], float(r["kv_events"][key]))
        yield fam


KV_EVENT_FAMILIES: tuple[tuple[str, str, str, Any], ...] = (
    ("kvgate_replica_resident_tokens", "resident_tokens", "Tokens of the blocks the replica's KV events say it holds.",
     GaugeMetricFamily),
    ("kvgate_replica_resident_sessions", "sessions", "Sessions with blocks resident on the replica (KV events).",
     GaugeMetricFamily),
    ("kvgate_replica_kv_events_synced", "synced", "1 while the replica's KV-event view is exact (a message applied "
     "since it started, none lost since).", GaugeMetricFamily),
    ("kvgate_replica_kv_events", "events", "KV events applied (BlockStored, BlockRemoved, AllBlocksCleared).",
     CounterMetricFamily),
    ("kvgate_replica_kv_event_gaps", "gaps", "KV-event messages lost (sequence gaps no replay filled).",
     CounterMetricFamily),
    ("kvgate_replica_kv_event_restarts", "restarts", "Times the replica's KV-event stream numbered from 0 again.",
     CounterMetricFamily),
)
"""The families of replicas followed with ``--kv-events`` (name, key of their ``kv_events`` stats, doc, kind)."""
