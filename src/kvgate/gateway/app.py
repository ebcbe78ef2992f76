"""``kvgate gateway``: the policy core in front of a real (or simulated) OpenAI-compatible engine, over HTTP.

Theory of operation. An HTTP/1.1 server (:mod:`kvgate.http.server`) relays the turns (``/v1/completions``,
``/v1/chat/completions``, ``/v1/responses``, ``/v1/messages``) to one fixed upstream through one pool of keep-alive
connections
(:mod:`kvgate.gateway.relay`), and asks the policy core (:mod:`kvgate.policy`, the same object the simulator
drives) before every turn (:mod:`kvgate.gateway.turns`)::

    client ──POST──▶ parse body, session id ─▶ TurnRequested(now, s, L_s, o_s) ─┬─ Proceed ──────────────┐
                                                                               └─ Park: await its slot ─┤
                                                       (resolved by a Proceed for s from a later event) │
    client ◀── relay (SSE chunks as they arrive) ◀── upstream ◀── body (include_usage added if needed) ◀┘
              └─ usage ─▶ TurnFinished ─▶ Proceed for held sessions ─▶ their futures

The pieces: :mod:`~kvgate.gateway.config` (the options), :mod:`~kvgate.gateway.sessions` (the session layer over
the policy, no I/O) and :mod:`~kvgate.gateway.estimate` (L_s from request bodies), :mod:`~kvgate.gateway.turns`
(the request path), :mod:`~kvgate.gateway.relay` (the upstream), :mod:`~kvgate.gateway.admin` (the gateway's own
endpoints), :mod:`~kvgate.gateway.metrics`, :mod:`~kvgate.gateway.pool` (C from the upstream),
:mod:`~kvgate.gateway.command` (``kvgate gateway``). This module wires them and owns the clock and the timers.

* A session ends after a turn sent with ``X-Session-End: true``, on ``DELETE /v1/sessions/{id}``, or after
  ``--idle-timeout`` seconds without a request (policy event ``SessionEnded``).
* Time. The gateway's clock is ``(monotonic - start) x --time-scale`` virtual seconds: events carry it as
  ``now``, latencies are measured on it, and ``--control-at``, ``--idle-timeout``, ``--max-park-s`` and the
  policy's timers (AIMD's interval, thunder's tick) run on it, so a gateway in front of
  ``kvgate engine --time-scale N`` runs on the engine's clock. One asyncio task sleeps until the earliest of
  ``policy.next_deadline()``, the pending control switch and the oldest idle session's expiry. I/O timeouts
  (``--upstream-timeout``, ``--shutdown-grace``) are real seconds.
* KV pool C: ``--kv-pool auto`` reads it from the upstream (:mod:`kvgate.gateway.pool`) at startup, and
  again when the upstream answers after connection errors (a restarted engine), switching the limit to the new C.
* A fleet (``--upstream`` repeated, :mod:`kvgate.gateway.fleet`): C_r read from every replica, the router places
  each session (sticky routers: one policy per replica, D_r against C_r; per-turn routers: one policy over the
  summed pools), and every ``--health-interval`` seconds each replica's ``/health`` (``/v1/models`` where there is
  none) is asked. A replica is marked down by a failed check or by a connection error on a relayed turn, and its
  sessions are placed anew (:mod:`kvgate.gateway.health`); it is back up when a check passes (its C re-read).
  Paths the gateway does not serve go to the first replica that is up (a prefix-cache flush to every one).
* KV events (``--kv-events``, :mod:`kvgate.gateway.kvevents`): one ZMQ consumer task per followed replica, started
  and stopped with the gateway, folds the replica's events into what it holds; the router reads it
  (``Replica.resident``: prefix-affinity places a new or re-placed session where it is resident) and so do the
  policies (``Policy.residency``: ``budgeter-resident``). A replica's view is cleared when it is marked down and
  when it comes back. After a batch that evicted or cleared blocks, held turns are asked again (a ``Timer``),
  since a residency-corrected D may now admit them.

See docs/gateway.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Mapping
from types import MappingProxyType
from typing import Any

from prometheus_client import ProcessCollector

from kvgate import __version__
from kvgate.errors import UsageError
from kvgate.fleet.routers import STICKY
from kvgate.gateway.admin import AdminRoutes, Handler
from kvgate.gateway.auth import Origins
from kvgate.gateway.books import Resume, meta_of, snapshot
from kvgate.gateway.config import GatewayConfig
from kvgate.gateway.fleet import Fleet, Replica
from kvgate.gateway.health import Health, build_fleet, connections, fleet_info, fleet_passthrough, read_pools
from kvgate.gateway.kvevents import FleetEvents
from kvgate.gateway.listing import audit, books_state, books_summary
from kvgate.gateway.metrics import GatewayCollector, Histogram, summary
from kvgate.gateway.placement import Placement
from kvgate.gateway.relay import UpstreamRelay
from kvgate.gateway.sessions import GwSession, Sessions
from kvgate.gateway.shared_books import SharedSessions
from kvgate.gateway.sharing import Sharing, is_shared
from kvgate.gateway.store import Keeper, open_store
from kvgate.gateway.tenants import TenantBook
from kvgate.gateway.turns import ShuttingDown, TurnPath
from kvgate.http.clock import Clock
from kvgate.http.dialect import APIS
from kvgate.http.limits import ServerCollector
from kvgate.http.openai import EngineInfo
from kvgate.http.prometheus import new_registry
from kvgate.http.server import HttpServer, Request, StreamResponse, error_response
from kvgate.policy import Policy, Timer, make_control
from kvgate.policy.limits import Control

log = logging.getLogger("kvgate.gateway")


class Gateway:
    """The HTTP gateway. ``await start(host, port)``, then ``await stop()`` (graceful)."""

    relay_class: type[UpstreamRelay] = UpstreamRelay  # forwards a turn (kvgate epp's: hands it to Envoy)
    path_class: type[TurnPath] = TurnPath  # a turn's way through the policy (kvgate epp's: may refuse holds)

    def __init__(self, cfg: GatewayConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self.time_scale = float(cfg.time_scale)  # gateway seconds per real second
        self._idle_s = cfg.idle_timeout_s
        self._keys = tuple(k.encode() for k in cfg.api_keys)
        self.upstream_errors: Counter[str] = Counter()
        """Upstream failures by kind, every replica's."""
        self.fleet = build_fleet(cfg, bool(self._keys), self.upstream_errors, self._pool_changed, self.relay_class)
        """The replicas (one for one upstream), their books and the router."""
        self._sessions = (SharedSessions if is_shared(cfg.store) else Sessions)(self.fleet)
        self.sessions: Mapping[Any, GwSession] = MappingProxyType(self._sessions.by_id)
        """The sessions the gateway knows, by id (a read-only view; anonymous ones by number)."""
        self._relay: UpstreamRelay = self.fleet.replicas[0].relay
        self.upstream_url = ", ".join(r.url for r in self.fleet.replicas)  # (a fleet's comma-separated: logs, info)
        self._pool = self.fleet.replicas[0].watch
        self._placement = Placement(self._sessions)
        self._health = Health(self.fleet, self._placement, cfg.health_interval_s, self.now, self._wake_timer)
        self._wake = asyncio.Event()
        """Set to make the timer task recompute its deadline (a sooner one may have appeared)."""
        self._events = FleetEvents(self.fleet, cfg, self._sessions, self.now, self._wake_timer)
        """The KV-event consumers of the replicas followed with ``--kv-events``."""
        self._path = path = self.path_class(cfg, self._sessions, self._placement, self.upstream_errors,
                                            self._wake_timer, self._health.failed)
        self.tenant_book: TenantBook | None = path.tenants.book  # (per-tenant counters; None without tenancy)
        self.turns: Counter[str] = path.outcomes
        """Turns by outcome."""
        self.session_ends: Counter[str] = self._sessions.ends
        self.park_wait: Histogram = path.park_wait
        self.latency: Histogram = path.latency
        self._control, self._control_at = control_of(cfg)
        self._started = False
        self._stopping = False
        self._sharing, self._store = books_of(cfg, self._sessions, path, self.now, self.time_scale)
        """The session books on disk (``--state-dir``), written by a task; None without."""
        self._clock: Clock | None = None
        """Gateway time (virtual seconds since start, real seconds x --time-scale); set when started."""
        self._server: HttpServer | None = None
        self._timer_task: asyncio.Task[None] | None = None
        self.port = 0
        self.registry = new_registry(GatewayCollector(self))
        ProcessCollector(registry=self.registry)
        self.registry.register(ServerCollector(lambda: self._server))  # type: ignore[arg-type]
        self._admin = AdminRoutes(self, self._sessions, cfg, self.registry)
        self._host_check = not self._keys or bool(cfg.allowed_hosts)  # (421 for another Host: DNS rebinding)
        self._routes: dict[tuple[str, str], Handler] = {
            **{("POST", api.path): functools.partial(path.turn, api=api) for api in APIS.values()},
            **self._admin.routes(),
        }
        """Exact (method, path) routes; ``DELETE /v1/sessions/{id}`` by prefix; anything else passes through."""
        self._allowed = allowed_methods(self._routes)
        """The methods of each path the gateway serves itself (405 with ``Allow`` for another: never relayed)."""

    # -- lifecycle -----------------------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 8000) -> int:
        """Read the KV pool (unless configured), then listen. Returns the bound port."""
        loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        fleet = self.fleet
        for rep in fleet.replicas:
            rep.relay.open()
        try:
            await read_pools(fleet)
            resume = Resume(self._store, self.time_scale)  # (no store: from gateway time 0)
            self._control, self._control_at = resume.control or self._control, resume.control_at or self._control_at
            self._clock = clock = Clock(loop, self.time_scale)
            clock.t0 -= resume.now / self.time_scale
            self._path.start(clock)
            name, opts = self._control
            if not self._control_at:  # no --control-at, or minute 0: the control from the start
                self._control_at = None
                make_control(name, self.kv_pool, **opts)
                fleet.active = (name, dict(opts))
            else:
                fleet.active = ("none", {})
            fleet.start(resume.now)
            resume.apply(self._sessions, self._control)
            await start_sharing(self._sharing, fleet, self.registry)
            self._started = True
            self._server = HttpServer(self._dispatch, limits=self.cfg.http_limits)
            self.port = await self._server.start(host, port, backlog=1024)
            self._admin.origins = Origins(self.port, host, self.cfg.allowed_hosts)
        except BaseException:
            for rep in fleet.replicas:
                await rep.relay.close()
            raise
        self._timer_task = loop.create_task(timers(self._wake, self._next_wake, self._tick),
                                            name="kvgate-gateway-timer")
        if self._store is not None:
            self._store.start(lambda: snapshot(self._sessions, meta_of(self._sessions, self.now(), self._control,
                                                                       self._control_at)))
        self._health.start()
        await self._events.start()
        info = self.upstream_info
        log.info(
            "gateway listening",
            extra={"event": "start", "host": host, "port": self.port, "upstream": self.upstream_url,
                   "replicas": len(fleet.replicas), "router": fleet.router.name,
                   "control": self.control.spec(), "control_at_s": self._control_at, "kv_pool": self.kv_pool,
                   "kv_pool_source": self.kv_pool_source, "upstream_kind": info.kind, "block_size": info.block_size,
                   "time_scale": self.time_scale, "version": __version__},
        )
        return self.port

    async def stop(self) -> None:
        """Stop accepting, answer held turns 503, let turns in flight finish within ``--shutdown-grace``, close."""
        if self._stopping:
            return
        self._stopping = self._path.stopping = self._health.stopping = True
        held = 0
        for fut in self._sessions.held_futures():
            fut.set_exception(ShuttingDown("the gateway is shutting down"))
            held += 1
        log.info("gateway stopping", extra={"event": "stop", "in_flight": self.in_flight, "held": held})
        if self._server is not None:  # stops listening, lets handlers finish within the grace period
            await self._server.shutdown(self.cfg.shutdown_grace_s)
        await asyncio.to_thread(self._path.tenants.close)  # (the traces left, exported)
        if self._timer_task is not None:
            self._timer_task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._timer_task
            self._timer_task = None
        await self._health.stop()
        await stop_sharing(self._sharing)
        await self._events.stop()
        if self._store is not None:
            await self._store.stop()
        for rep in self.fleet.replicas:
            await rep.watch.stop()
            await rep.relay.close()
        log.info("gateway stopped", extra={"event": "stopped"})

    # -- routing -------------------------------------------------------------------------------------------
    def _dispatch(self, request: Request) -> Awaitable[StreamResponse]:
        """The handler of a request (returned as the coroutine itself: one level fewer for every resume)."""
        if self._host_check and request.headers.get("Host", "").lower() not in self._admin.origins.hosts:
            return self._admin.misdirected(request)
        handler = self._routes.get((request.method, request.path))
        if handler is not None:
            return handler(request)
        own = own_path(request, self._allowed, self._admin)
        return own if own is not None else self._passthrough(request)

    async def _passthrough(self, request: Request) -> StreamResponse:
        """Any other path, if the caller may reach it (:meth:`AdminRoutes.passthrough_refusal`): relayed to the
        upstream as it is; in a fleet to the first replica that is up, a prefix-cache flush to every one."""
        refused = self._admin.passthrough_refusal(request)
        if refused is not None:
            return refused
        if self.fleet.single:
            return await self._relay.passthrough(request)
        return await fleet_passthrough(self.fleet, request)

    # -- clock, control, timers -------------------------------------------------------------------------
    def now(self) -> float:
        """Gateway time: virtual seconds since start (real seconds x --time-scale)."""
        assert self._clock is not None, "the gateway has not started"
        return self._clock.now()

    def _wake_timer(self) -> None:
        self._wake.set()

    def set_control(self, name: str, opts: Mapping[str, Any] | None = None) -> Control:
        """Switch the control now (``PolicyError`` for a bad name or option). Cancels a pending --control-at."""
        opts = dict(opts or {})
        self._events.check(make_control(name, self.kv_pool or 1, **opts))  # (a bad control raises before any change)
        self._control = (name, opts)
        self._control_at = None
        self._sessions.apply(self.fleet.set_control(self.now(), name, opts))
        limit = self.control
        self._wake.set()
        log.info("control switched", extra={"event": "control", "control": limit.spec()})
        return limit

    def _pool_changed(self, rep: Replica, old: int, size: int) -> None:
        """The upstream came back with another pool: the same control over the new C."""
        rep.kv_pool = size
        self._sessions.apply(self.fleet.resize(self.now(), rep))
        self._wake.set()
        log.warning("KV pool changed", extra={"event": "pool", "old_tokens": old, "kv_pool": size,
                                              "replica": rep.url})

    def _next_wake(self) -> float | None:
        """The earliest deadline of the timer task, in loop (real) time."""
        best = self.fleet.next_deadline()
        if self._control_at is not None and (best is None or self._control_at < best):
            best = self._control_at
        expiry = self._sessions.first_expiry(self._idle_s)
        if expiry is not None and (best is None or expiry < best):
            best = expiry
        assert self._clock is not None
        return None if best is None else self._clock.deadline(best) + 1e-6

    def _tick(self) -> None:
        now = self.now()
        if self._control_at is not None and now >= self._control_at:
            name, opts = self._control
            self.set_control(name, opts)
        self._sessions.expire(now, self._idle_s)
        for policy in list(self.fleet.policies()):
            deadline = policy.next_deadline()
            if deadline is not None and now >= deadline:
                self._sessions.apply(policy.handle(Timer(now)))

    # -- state (read-only) ---------------------------------------------------------------------------------
    @property
    def started(self) -> bool:
        return self._started

    @property
    def policy(self) -> Policy:
        """The policy of one upstream (or a per-turn router's fleet); a sticky fleet's: ``fleet.replicas[r].policy``."""
        assert self._started, "the gateway has not started"
        return self._sessions.policy

    @property
    def control(self) -> Control:
        return self.fleet.control

    @property
    def kv_pool(self) -> int:
        """C in tokens (0 before start with ``--kv-pool auto``); a fleet's: the pools of the replicas up."""
        return self._pool.kv_pool if self.fleet.single else self.fleet.live_pool()

    @property
    def kv_pool_source(self) -> str:
        return self._pool.source

    @property
    def upstream_info(self) -> EngineInfo:
        """What discovery learnt about the upstream (kind, pool, block size; :mod:`kvgate.http.openai`); a fleet's:
        its first replica's with the pool of the replicas up."""
        return self._pool.upstream_info if self.fleet.single else fleet_info(self.fleet)

    @property
    def in_flight(self) -> int:
        """Turns sent upstream and not yet answered."""
        return self._path.in_flight

    @property
    def requests(self) -> int:
        return self._path.requests

    @property
    def replaced_attempts(self) -> int:
        return self._path.replaced_attempts

    @property
    def retried(self) -> int:  # (turns retried on another replica after theirs failed them before answering)
        return self._path.retried

    def control_state(self) -> dict[str, Any]:
        limit = self.control
        name, opts = self._control
        scheduled = None if self._control_at is None else {"control": name, "opts": opts, "at_s": self._control_at}
        return {
            "control": limit.name,
            "spec": limit.spec(),
            "opts": limit.params(),
            "kv_pool": self.kv_pool,
            "kv_pool_source": self.kv_pool_source,
            "scheduled": scheduled,
            "now_s": round(self.now(), 3),
            "time_scale": self.time_scale,
        }

    def info(self) -> dict[str, Any]:
        """``GET /kvgate/info``: what this gateway is, its control and counters, and its upstream (O(1))."""
        return self._admin.info_state()

    def summary(self) -> dict[str, Any]:
        """Sessions by state, D, C and the alarm inputs (O(1): for /v1/sessions and tests)."""
        path = self._path
        return {**summary(self.fleet, path.windows, self.kv_pool, self.now(), path.in_flight, path.held),
                **books_summary(self._sessions)}

    def sessions_state(self) -> dict[str, Any]:
        """How sessions were named and found, and when silent ones leave D (``/kvgate/info``, ``GET /v1/sessions``)."""
        return {"session_from": list(self.cfg.session_from), **books_state(self._sessions),
                **stores_state(self._store, self._sharing)}

    def audit(self) -> dict[str, Any]:
        """Cross-check the gateway's records against the policy core (O(n); tests call it, never the hot path).

        ``demand`` must equal ``admitted_demand`` (the true sum of d_s over admitted sessions), ``unknown`` and
        ``orphans`` must be empty, and ``held`` must match the policy's held sessions.
        """
        a = audit(self._sessions)
        return {**a, "held": self._path.held, "in_flight": self._path.in_flight}

    def upstream_connections(self) -> dict[str, int]:
        """Connections of the upstream pools (every replica's): ``acquired`` (in use) and ``idle`` (kept alive)."""
        return connections(self.fleet)


SESSION_PATH = "/v1/sessions/"
"""``DELETE /v1/sessions/{id}``: end a session."""


async def answer(resp: StreamResponse) -> StreamResponse:
    """``resp`` as a handler's coroutine."""
    return resp


def allowed_methods(routes: dict[tuple[str, str], Any]) -> dict[str, str]:
    """Each routed path's methods, as an ``Allow`` header lists them."""
    methods: dict[str, set[str]] = {}
    for method, path in routes:
        methods.setdefault(path, set()).add(method)
    return {path: ", ".join(sorted(m)) for path, m in methods.items()}


def own_path(request: Request, allowed: dict[str, str], admin: AdminRoutes) -> Awaitable[StreamResponse] | None:
    """The answer to a request on a path of the gateway's own that no route took (never relayed), or None."""
    path = request.path
    if path.startswith(SESSION_PATH):
        sid = path[len(SESSION_PATH):]
        if request.method == "DELETE" and sid and "/" not in sid:
            return admin.delete_session(request, sid)
        return answer(own_path_refusal(request, "DELETE"))
    methods = allowed.get(path)
    return None if methods is None else answer(own_path_refusal(request, methods))


def own_path_refusal(request: Request, allowed: str) -> StreamResponse:
    """405 with ``Allow`` for a method a path of the gateway's own does not take; 404 for a session path that
    names no session (``DELETE /v1/sessions/``, ``DELETE /v1/sessions/a/b``)."""
    if request.method in allowed.split(", "):
        return error_response(404, f"no session {request.path.removeprefix(SESSION_PATH)!r}", "NotFound")
    return error_response(405, f"{request.method} {request.path}: only {allowed}", "MethodNotAllowed",
                          {"Allow": allowed})


def control_of(cfg: GatewayConfig) -> tuple[tuple[str, dict[str, int | float]], float | None]:
    """The control to run and when (``--control-at``, seconds); with ``--store redis://`` none: the shared budget
    admits, and the local policy keeps the books only."""
    if is_shared(cfg.store):
        return ("none", {}), None
    return (cfg.control, cfg.control_opts()), None if cfg.control_at is None else cfg.control_at * 60.0


def books_of(cfg: GatewayConfig, sessions: Sessions, path: TurnPath, now: Callable[[], float], time_scale: float
             ) -> tuple[Sharing | None, Keeper | None]:
    """Where the session books live: shared over ``--store redis://`` (one budget per replica, a sticky router;
    wired into the turn path), or on disk (``--state-dir``, or ``--store`` of a file store) written by a task; (None,
    None) without."""
    books = cfg.store or cfg.state_dir
    if not is_shared(cfg.store):
        return None, Keeper(open_store(books), cfg.state_flush_s) if books else None
    assert cfg.store is not None
    if len(cfg.urls) > 1 and cfg.router_name not in STICKY:
        raise UsageError(f"--store redis:// with several upstreams: a sticky --router ({', '.join(sorted(STICKY))}); "
                         "the shared budget places each session on one replica")
    assert isinstance(sessions, SharedSessions)
    sharing = Sharing(cfg.store, sessions, now, time_scale, path.max_park_real)
    sharing.park_wait = path.park_wait
    path.shared = sharing
    return sharing, None


async def start_sharing(sharing: Sharing | None, fleet: Fleet, registry: Any) -> None:
    if sharing is not None:
        await sharing.start(fleet, registry)


async def stop_sharing(sharing: Sharing | None) -> None:
    if sharing is not None:
        await sharing.stop()


def stores_state(store: Keeper | None, sharing: Sharing | None) -> dict[str, Any]:
    """The books' store (``store``) and the shared books (``shared``), as ``/kvgate/info`` shows them."""
    return {**({"store": store.stats()} if store is not None else {}),
            **({"shared": sharing.state()} if sharing is not None else {})}


async def timers(wake: asyncio.Event, next_wake: Callable[[], float | None], tick: Callable[[], None]) -> None:
    """The gateway's one timer task: sleep until ``next_wake()`` (loop time; None: until woken), ``tick()``, again."""
    loop = asyncio.get_running_loop()
    while True:
        wake.clear()
        when = next_wake()
        if when is None:
            await wake.wait()
        elif when > loop.time():
            handle = loop.call_at(when, wake.set)
            try:
                await wake.wait()
            finally:
                handle.cancel()
        try:
            tick()
        except Exception:  # never let a bug stop the timers
            log.exception("timer failed", extra={"event": "timer_error"})
