"""``kvgate gateway``: the policy core in front of a real (or simulated) OpenAI-compatible engine, over HTTP.

Theory of operation. An HTTP/1.1 server (:mod:`kvgate.http.server`) relays ``/v1/completions`` and
``/v1/chat/completions`` to one fixed upstream through one pool of keep-alive connections
(:mod:`kvgate.http.upstream`), and asks the policy core (:mod:`kvgate.policy`, the same object the simulator
drives) before every turn::

    client ──POST──▶ parse body, session id ─▶ TurnRequested(now, s, L_s, o_s) ─┬─ Proceed ──────────────┐
                                                                               └─ Park: await s.future ─┤
                                                       (resolved by a Proceed for s from a later event) │
    client ◀── relay (SSE chunks as they arrive) ◀── upstream ◀── body (include_usage added if needed) ◀┘
              └─ usage ─▶ TurnFinished ─▶ Proceed for held sessions ─▶ their futures

* A session is named by the ``X-Session-ID`` header (``--session-header``), else the body's ``session_id``,
  else OpenAI's ``user``; a request naming none is a one-turn session (400 with ``--require-session``). Every
  request is a turn boundary; turns of one session are serialised (a second request waits for the first). A
  session ends after a turn sent with ``X-Session-End: true``, on ``DELETE /v1/sessions/{id}``, or after
  ``--idle-timeout`` seconds without a request (policy event ``SessionEnded``).
* L_s and o_s come from :mod:`kvgate.http.gateway_sessions` (exact for token-id prompts, else estimated from the
  previous usage plus the appended text at 4 characters per token).
* A held turn costs the client only latency. A client that goes away releases what it held at once: a turn in
  flight becomes ``TurnAborted`` (its demand is released, the session stays), a held one ``SessionEnded`` (it
  leaves the queue). The server cancels the handler when the client disconnects, so the cancellation lands
  wherever the handler waits: held, waiting for the upstream, or relaying a stream.
* Upstream failures: unreachable / dropped 502, timed out 504 (JSON bodies), an upstream 5xx 502 with its message,
  a 4xx relayed as it is; each aborts the turn. A stream that fails after its headers were sent ends with an
  error event (vLLM's shape) and ``data: [DONE]``.
* Time. The gateway's clock is ``(monotonic - start) x --time-scale`` virtual seconds: events carry it as
  ``now``, latencies are measured on it, and ``--control-at``, ``--idle-timeout``, ``--max-park-s`` and the
  policy's timers (AIMD's interval, thunder's tick) run on it, so a gateway in front of
  ``kvgate engine --time-scale N`` runs on the engine's clock. One asyncio task sleeps until the earliest of
  ``policy.next_deadline()``, the pending controller switch and the oldest idle session's expiry. I/O timeouts
  (``--upstream-timeout``, ``--shutdown-grace``) are real seconds.
* KV pool C: ``--kv-pool auto`` reads it from the upstream (:mod:`kvgate.http.gateway_pool`) at startup, and
  again when the upstream answers after connection errors (a restarted engine), switching the limit to the new C.

Cost. The request path does no scan over sessions: a dict lookup, the O(1) policy event, a few counters. Bodies
are parsed once (orjson when installed) and forwarded as received, except that ``include_usage`` is spliced in
when a stream lacks it; stream chunks are relayed unparsed (:mod:`kvgate.http.gateway_stream`).
See docs/gateway.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hmac
import ipaddress
import json
import logging
import math
import sys
import tomllib
from collections import Counter, OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs

import click
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from yarl import URL

from kvgate import __version__
from kvgate.errors import ClientError, KvgateError, PolicyRefusal, UpstreamError, UsageError
from kvgate.http.discovery import GATEWAY_INFO_PATH, EngineInfo, Unreachable
from kvgate.http.gateway_metrics import (
    LATENCY_BUCKETS,
    PARK_WAIT_BUCKETS,
    Histogram,
    UsageWindows,
    regime_alarm,
    setup_logging,
)
from kvgate.http.gateway_pool import PoolNotFound, detect_pool, discover_upstream
from kvgate.http.gateway_sessions import (
    GwSession,
    estimate_context,
    output_budget,
    record_turn,
    usage_tokens,
)
from kvgate.http.gateway_stream import UsageScanner, dumps, loads, with_include_usage
from kvgate.http.server import HttpServer, Request, Response, StreamResponse, error_body
from kvgate.http.signals import settle_for_serving, until_signalled
from kvgate.http.upstream import Response as UpResponse
from kvgate.http.upstream import UpstreamConnectError, UpstreamPool, pool_for
from kvgate.policy import (
    LIMITS,
    Park,
    Policy,
    PolicyError,
    Proceed,
    SessionEnded,
    SessionState,
    Timer,
    TurnAborted,
    TurnFinished,
    TurnRequested,
    make_limit,
    parse_arm,
)
from kvgate.policy.core import Decision
from kvgate.policy.limits import Limit

log = logging.getLogger("kvgate.gateway")

_RUNNING = SessionState.RUNNING
_HELD = frozenset({SessionState.WAITING, SessionState.PARKED})

HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer",
     "transfer-encoding", "upgrade"}
)  # fmt: skip
"""Headers that belong to one connection and are never relayed (RFC 9110 §7.6.1)."""
_UP_DROP = HOP_BY_HOP | {"host", "content-length", "expect"}  # (the gateway has the whole body)
_DOWN_DROP = HOP_BY_HOP | {"content-length"}
SESSION_END_HEADER = "X-Session-End"
PARK_WAIT_HEADER = "X-Kvgate-Park-Wait"
"""On every turn's response: seconds (gateway time) the policy held the turn before it went upstream ("0": none)."""
HOLD_HEADER = "X-Kvgate-Hold"
""""none", "parked" (an admitted session parked at its turn boundary) or "waiting" (a new session not yet
admitted)."""
CONTROL_HEADER = "X-Kvgate-Control"
"""The controller that released the turn, as an arm spec (``budgeter:low=0.7:high=0.9``)."""
_DONE = b"data: [DONE]\n\n"
ANON_PREFIX = "anon-"
PASSTHROUGH_READ_LIMIT = 1 << 20
"""Pass-through responses up to this size (by Content-Length) are read whole; larger or unsized ones stream."""
LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))


# -- errors: who is at fault, and the HTTP status that says so ------------------------------------------------
class Unauthorized(ClientError):
    http_status = 401


class Forbidden(ClientError):
    http_status = 403


class NotFound(ClientError):
    http_status = 404


class ParkTimeout(PolicyRefusal):
    """The turn was held longer than ``--max-park-s``."""


class ShuttingDown(PolicyRefusal):
    """The gateway is stopping and will not start this turn."""


class UpstreamTimeout(UpstreamError):
    http_status = 504


def error_response(status: int, message: str, kind: str, headers: Mapping[str, str] | None = None) -> Response:
    """An error as OpenAI-compatible servers answer them: ``{"error": {"message", "type", "param", "code"}}``."""
    return Response(status=status, body=error_body(status, message, kind), content_type="application/json",
                    headers=headers)  # fmt: skip


def _exc_response(e: KvgateError, headers: Mapping[str, str] | None = None) -> Response:
    return error_response(e.http_status, str(e), type(e).__name__, headers)


def _json(obj: Any, status: int = 200) -> Response:
    return Response(status=status, body=dumps(obj), content_type="application/json")


# -- configuration -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class GatewayConfig:
    """Everything that defines a gateway (the command's options, typed)."""

    upstream: str
    control: str = "budgeter"
    control_opts: Mapping[str, int | float] = field(default_factory=dict)
    control_at_min: float | None = None
    kv_pool: int | None = None
    """C in tokens; None: read it from the upstream."""
    session_header: str = "X-Session-ID"
    time_scale: float = 1.0
    idle_timeout_s: float = 300.0
    max_park_s: float | None = None
    default_max_tokens: int = 1024
    require_session: bool = False
    api_keys: tuple[str, ...] = ()
    upstream_api_key: str | None = None
    admin_token: str | None = None
    max_body_bytes: int = 32 << 20
    upstream_timeout_s: float = 600.0
    shutdown_grace_s: float = 30.0

    def validate(self) -> None:
        """Raise :class:`UsageError` with a one-line message for anything wrong."""
        u = URL(self.upstream)
        if u.scheme not in ("http", "https") or not u.host:
            raise UsageError(f"--upstream {self.upstream!r}: expected an http(s) URL such as http://127.0.0.1:8100")
        if u.query_string or u.fragment:
            raise UsageError(f"--upstream {self.upstream!r}: no query or fragment, please")
        if self.control not in LIMITS:
            raise UsageError(f"unknown --control {self.control!r}; choose from {', '.join(LIMITS)}")
        try:
            make_limit(self.control, capacity_tokens=self.kv_pool or 1_000_000, **dict(self.control_opts))
        except PolicyError as e:
            raise UsageError(f"--control {self.control}: {e}") from None
        for name, v, lo in (
            ("--time-scale", self.time_scale, 0.0),
            ("--idle-timeout", self.idle_timeout_s, 0.0),
            ("--upstream-timeout", self.upstream_timeout_s, 0.0),
        ):
            if not (math.isfinite(v) and v > lo):
                raise UsageError(f"{name} must be a positive number, got {v}")
        if self.max_park_s is not None and not self.max_park_s > 0:
            raise UsageError(f"--max-park-s must be positive, got {self.max_park_s}")
        if self.shutdown_grace_s < 0:
            raise UsageError("--shutdown-grace must be non-negative")
        if self.control_at_min is not None and self.control_at_min < 0:
            raise UsageError("--control-at must be non-negative")
        if self.kv_pool is not None and self.kv_pool < 1:
            raise UsageError("--kv-pool must be a positive number of tokens or 'auto'")
        if self.default_max_tokens < 0:
            raise UsageError("--default-max-tokens must be non-negative")
        if self.max_body_bytes < 1024:
            raise UsageError("--max-body-bytes must be at least 1024")
        if not self.session_header.strip():
            raise UsageError("--session-header must name a header")


def control_opts(name: str, text: str) -> dict[str, int | float]:
    """``K=V,K=V`` for controller ``name``, typed as the controller declares its options."""
    text = text.strip()
    if not text:
        return {}
    try:
        _, opts = parse_arm(name + ":" + text.replace(",", ":"))
    except PolicyError as e:
        raise UsageError(f"--control-opt: {e}") from None
    return opts


# -- the gateway ---------------------------------------------------------------------------------------------
class Gateway:
    """The HTTP gateway. ``await start(host, port)``, then ``await stop()`` (graceful)."""

    def __init__(self, cfg: GatewayConfig) -> None:
        cfg.validate()
        self.cfg = cfg
        self._scale = float(cfg.time_scale)
        base = URL(cfg.upstream)
        self._base = base.with_path(base.path.rstrip("/"))
        self._base_str = str(self._base).rstrip("/")
        self._base_path = self._base.raw_path.rstrip("/")
        self._sess_hdr = cfg.session_header
        self._keys = tuple(k.encode() for k in cfg.api_keys)
        self._auth_up = f"Bearer {cfg.upstream_api_key}" if cfg.upstream_api_key else None
        drop = _UP_DROP | ({"authorization"} if self._keys or self._auth_up else set())
        self._drop_pass = frozenset(drop)
        self._drop_turn = frozenset(drop | {"accept-encoding"})
        self._max_park_real = None if cfg.max_park_s is None else cfg.max_park_s / self._scale
        self._retry_after = str(max(1, math.ceil(self._max_park_real or 1.0)))
        self._idle_s = cfg.idle_timeout_s
        self._default_max = cfg.default_max_tokens
        # state
        self._sessions: dict[Any, GwSession] = {}
        self._idle: OrderedDict[Any, GwSession] = OrderedDict()
        """Sessions between turns, oldest activity first (idle expiry pops from the front)."""
        self._anon = 0
        self._inflight = 0
        self._held = 0
        self._capacity = cfg.kv_pool or 0
        self._pool_source = "--kv-pool" if cfg.kv_pool else ""
        self._pool_stale = False
        self.upstream_info = EngineInfo()
        """What discovery learnt about the upstream (kind, pool, block size); see :mod:`kvgate.http.discovery`."""
        self._control: tuple[str, dict[str, int | float]] = (cfg.control, dict(cfg.control_opts))
        self._control_at: float | None = None if cfg.control_at_min is None else cfg.control_at_min * 60.0
        self._policy: Policy | None = None
        self._spec_of: tuple[Limit | None, str] = (None, "")
        self._stopping = False
        # metrics
        self.park_wait = Histogram(PARK_WAIT_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)
        self.windows = UsageWindows()
        self.upstream_errors: Counter[str] = Counter()
        self.turns: Counter[str] = Counter()
        self.replaced_attempts = 0
        """Requests cancelled because a retry of the same turn of the session arrived while they were held or in
        flight."""
        self.session_ends: Counter[str] = Counter()
        self.requests = 0
        # runtime
        self._loop: asyncio.AbstractEventLoop | None = None
        self._t0 = 0.0
        self._client: UpstreamPool | None = None
        self._server: HttpServer | None = None
        self._timer_task: asyncio.Task[None] | None = None
        self._refresh_task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        """Set to make the timer task recompute its deadline (a sooner one may have appeared)."""
        self.port = 0
        self._routes: dict[tuple[str, str], Callable[[Request], Awaitable[StreamResponse]]] = {
            ("POST", "/v1/completions"): functools.partial(self._turn, chat=False),
            ("POST", "/v1/chat/completions"): functools.partial(self._turn, chat=True),
            ("GET", "/metrics"): self._metrics,
            ("GET", GATEWAY_INFO_PATH): self._info,
            ("GET", "/v1/sessions"): self._list_sessions,
            ("GET", "/admin/control"): self._get_control,
            ("POST", "/admin/control"): self._post_control,
            ("GET", "/dashboard"): self._dashboard,
            ("GET", "/kvgate/dashboard.json"): self._dashboard_json,
        }
        """Exact (method, path) routes; ``DELETE /v1/sessions/{id}`` by prefix; anything else passes through."""
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Collector(self))
        ProcessCollector(registry=self.registry)

    # -- lifecycle -----------------------------------------------------------------------------------------
    async def start(self, host: str = "127.0.0.1", port: int = 8000) -> int:
        """Read the KV pool (unless configured), then listen. Returns the bound port."""
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._wake = asyncio.Event()
        cfg = self.cfg
        # bodies are relayed as they come (compressed or not); no cookies are kept, no redirect followed
        self._client = pool_for(
            self._base, connect_timeout=min(10.0, cfg.upstream_timeout_s), read_timeout=cfg.upstream_timeout_s
        )
        try:
            if not self._capacity:
                info = await self._detect_pool()
                assert info.pool_tokens is not None
                self.upstream_info, self._capacity, self._pool_source = info, info.pool_tokens, info.source
            else:  # C is given; the engine's kind and block size are still worth knowing (best-effort)
                hdrs = {"Authorization": self._auth_up} if self._auth_up else None
                with contextlib.suppress(Unreachable, TimeoutError, OSError):
                    self.upstream_info = await discover_upstream(self._client, self._base, headers=hdrs, timeout_s=2.0)
            self._t0 = loop.time()
            name, opts = self._control
            if not self._control_at:  # no --control-at, or minute 0: the controller from the start
                self._control_at = None
                first = make_limit(name, self._capacity, **opts)
            else:
                first = make_limit("none", self._capacity)
            self._policy = Policy(first, now=0.0)
            self._server = HttpServer(self._dispatch, max_body=cfg.max_body_bytes)
            self.port = await self._server.start(host, port, backlog=1024)
        except BaseException:
            await self._close_client()
            raise
        self._timer_task = loop.create_task(self._timer_loop(), name="kvgate-gateway-timer")
        log.info(
            "gateway listening",
            extra={"event": "start", "host": host, "port": self.port, "upstream": self._base_str,
                   "control": self.limit.spec(), "control_at_s": self._control_at, "kv_pool_tokens": self._capacity,
                   "kv_pool_source": self._pool_source, "upstream_kind": self.upstream_info.kind,
                   "block_size": self.upstream_info.block_size, "time_scale": self._scale, "version": __version__},
        )  # fmt: skip
        return self.port

    async def stop(self) -> None:
        """Stop accepting, answer held turns 503, let turns in flight finish within ``--shutdown-grace``, close."""
        if self._stopping:
            return
        self._stopping = True
        held = 0
        for s in list(self._sessions.values()):
            fut = s.future
            if fut is not None and not fut.done():
                fut.set_exception(ShuttingDown("the gateway is shutting down"))
                held += 1
        log.info("gateway stopping", extra={"event": "stop", "in_flight": self._inflight, "held": held})
        if self._server is not None:  # stops listening, lets handlers finish within the grace period
            await self._server.shutdown(self.cfg.shutdown_grace_s)
        for task in (self._timer_task, self._refresh_task):
            if task is not None:
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task
        self._timer_task = self._refresh_task = None
        await self._close_client()
        log.info("gateway stopped", extra={"event": "stopped"})

    async def _close_client(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    # -- routing -------------------------------------------------------------------------------------------
    def _dispatch(self, request: Request) -> Awaitable[StreamResponse]:
        """The handler of a request (returned as the coroutine itself: one level fewer for every resume)."""
        handler = self._routes.get((request.method, request.path))
        if handler is not None:
            return handler(request)
        if request.method == "DELETE":
            sid = request.path.removeprefix("/v1/sessions/")
            if sid != request.path and sid and "/" not in sid:
                return self._delete_session(request, sid)
        return self._passthrough(request)

    # -- clock and policy glue -----------------------------------------------------------------------------
    def now(self) -> float:
        """Gateway time: virtual seconds since start (real seconds x --time-scale)."""
        assert self._loop is not None
        return (self._loop.time() - self._t0) * self._scale

    @property
    def policy(self) -> Policy:
        assert self._policy is not None, "the gateway has not started"
        return self._policy

    @property
    def limit(self) -> Limit:
        return self.policy.limit

    @property
    def capacity_tokens(self) -> int:
        return self._capacity

    def _apply(self, decisions: list[Decision], start: int = 0) -> None:
        """Release held turns the policy let proceed."""
        sessions = self._sessions
        for i in range(start, len(decisions)):
            d = decisions[i]
            if type(d) is Proceed:
                s = sessions.get(d.session)
                fut = None if s is None else s.future
                if fut is not None and not fut.done():
                    fut.set_result(None)

    def set_control(self, name: str, opts: Mapping[str, Any] | None = None) -> Limit:
        """Switch the controller now (``PolicyError`` for a bad name or option). Cancels a pending --control-at."""
        opts = dict(opts or {})
        limit = make_limit(name, self._capacity, **opts)
        self._control = (name, opts)
        self._control_at = None
        self._apply(self.policy.set_limit(self.now(), limit))
        self._wake.set()
        log.info("controller switched", extra={"event": "control", "control": limit.spec()})
        return limit

    def _real(self, virtual: float) -> float:
        return self._t0 + virtual / self._scale

    def _next_wake(self) -> float | None:
        """The earliest deadline of the timer task, in loop (real) time."""
        best = self.policy.next_deadline()
        if self._control_at is not None and (best is None or self._control_at < best):
            best = self._control_at
        if self._idle:
            first = next(iter(self._idle.values()))
            expiry = first.last_active + self._idle_s
            if best is None or expiry < best:
                best = expiry
        return None if best is None else self._real(best) + 1e-6

    async def _timer_loop(self) -> None:
        loop = asyncio.get_running_loop()
        wake = self._wake
        while True:
            wake.clear()
            when = self._next_wake()
            if when is None:
                await wake.wait()
            elif when > loop.time():
                handle = loop.call_at(when, wake.set)
                try:
                    await wake.wait()
                finally:
                    handle.cancel()
            try:
                self._tick()
            except Exception:  # never let a bug stop the timers
                log.exception("timer failed", extra={"event": "timer_error"})

    def _tick(self) -> None:
        now = self.now()
        if self._control_at is not None and now >= self._control_at:
            name, opts = self._control
            self.set_control(name, opts)
        idle = self._idle
        if idle:
            limit = now - self._idle_s
            while idle:
                s = next(iter(idle.values()))
                if s.last_active > limit:
                    break
                self._end(s, "idle")
        policy = self.policy
        deadline = policy.next_deadline()
        if deadline is not None and now >= deadline:
            self._apply(policy.handle(Timer(now)))

    # -- sessions ------------------------------------------------------------------------------------------
    async def _enter(self, sid: Any, anonymous: bool) -> GwSession:
        """The session's record, holding its turn (turns of one session are serialised)."""
        sessions = self._sessions
        while True:
            s = sessions.get(sid)
            if s is None:
                s = sessions[sid] = GwSession(sid, anonymous)
            if not s.busy:
                s.busy = True
                self._idle.pop(sid, None)
                return s
            assert self._loop is not None
            fut: asyncio.Future[None] = self._loop.create_future()
            if s.queue is None:
                s.queue = deque()
            s.queue.append(fut)
            try:
                await fut
            except asyncio.CancelledError:
                if not fut.cancelled():
                    self._leave(s)  # it was handed to us: pass it on
                else:
                    with contextlib.suppress(ValueError):
                        s.queue.remove(fut)
                raise
            if not s.dropped:
                return s
            self._leave(s)  # the session ended meanwhile: wake the next waiter, then start a new one

    def _leave(self, s: GwSession) -> None:
        """Release the session's turn: hand it to the next request of the session, or mark the session idle."""
        q = s.queue
        while q:
            fut = q.popleft()
            if not fut.done():
                fut.set_result(None)
                return
        s.busy = False
        if not s.dropped:
            s.last_active = self.now()
            if not self._idle:
                self._wake.set()  # the timer may be sleeping with no idle deadline
            self._idle[s.sid] = s

    def _end(self, s: GwSession, reason: str) -> None:
        """End the session (its turn, if any, must not be in flight): SessionEnded, then forget it."""
        if s.dropped:
            return
        s.dropped = True
        sid = s.sid
        if self._sessions.get(sid) is s:
            del self._sessions[sid]
        self._idle.pop(sid, None)
        if s.known_to_policy:
            policy = self.policy
            decisions = policy.handle(SessionEnded(self.now(), sid))
            policy.forget(sid)
            s.known_to_policy = False
            self._apply(decisions)
        self.session_ends[reason] += 1

    def _abandon(self, s: GwSession, reason: str) -> None:
        """The turn's handler is leaving early: release whatever the turn holds in the policy."""
        if s.dropped or not s.known_to_policy:
            return
        state = self.policy.state_of(s.sid)
        if s.superseded and state in _HELD:
            s.reattach = True  # a retry of this turn takes over its place in the policy
            return
        if state is _RUNNING:
            self._apply(self.policy.handle(TurnAborted(self.now(), s.sid)))
        elif state in _HELD:
            self._end(s, reason)

    # -- the turn ------------------------------------------------------------------------------------------
    async def _turn(self, request: Request, chat: bool) -> StreamResponse:
        self.requests += 1
        try:
            if self._keys and not self._client_authorized(request):
                raise Unauthorized("invalid or missing API key (Authorization: Bearer KEY)")
            raw = request.body  # whole, within --max-body-bytes (else the server answered 413)
            try:
                body = loads(raw)
            except ValueError as e:
                raise ClientError(f"malformed JSON body: {e}") from None
            if type(body) is not dict:
                raise ClientError("the body must be a JSON object")
            if self._stopping:
                raise ShuttingDown("the gateway is shutting down")
        except KvgateError as e:
            return _exc_response(e)
        headers = request.headers
        sid: Any = headers.get(self._sess_hdr)
        if not sid:
            sid = body.get("session_id") or body.get("user")
            if sid is not None and type(sid) is not str:
                sid = str(sid) if type(sid) is int else None
        anonymous = not sid
        if anonymous:
            if self.cfg.require_session:
                return error_response(
                    400, f"a session id is required ({self._sess_hdr} header, or session_id or user in the body)",
                    "ClientError",
                )  # fmt: skip
            self._anon += 1
            sid = self._anon  # an int: never equal to a client's (string) id
        inject = False
        if body.get("stream") is True:
            so = body.get("stream_options")
            if type(so) is not dict or not so.get("include_usage"):
                raw = with_include_usage(raw, body)
                inject = True
        end = headers.get(SESSION_END_HEADER, "").lower() in ("true", "1", "yes")
        budget = output_budget(body, self._default_max)
        key = hash(request.body)
        if not anonymous:
            prev = self._sessions.get(sid)
            if prev is not None and prev.attempt is not None and prev.attempt_key == key and not prev.superseded:
                # a retry of the turn in flight (the agent timed out): it replaces the earlier attempt, which is
                # cancelled (its upstream request with it), so the turn is counted once
                prev.superseded = True
                prev.attempt.cancel()
                self.replaced_attempts += 1
        s = await self._enter(sid, anonymous)
        s.attempt, s.attempt_key, s.superseded = asyncio.current_task(), key, False
        try:
            return await self._run(request, s, body, raw, chat, inject, budget)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not s.superseded or task is None or task.uncancel() > 0:
                raise
            # replaced by a retry of this turn: tell this attempt's client, if it still listens
            if body.get("stream") is True:  # the answer may have begun: end the connection instead
                request._conn.transport.close()
                raise
            return error_response(409, "replaced by a retry of the same turn of this session", "RetryReplaced")
        finally:
            s.attempt = s.attempt_key = None
            if anonymous:
                self._end(s, "one-turn")
            elif end or s.end_after:
                self._end(s, "client" if end else "delete")
            self._leave(s)

    async def _run(
        self, request: Request, s: GwSession, body: dict[str, Any], raw: bytes, chat: bool, inject: bool,
        budget: int,
    ) -> StreamResponse:  # fmt: skip
        sid = s.sid
        try:
            context, kind, sent = estimate_context(s, body, chat)
        except Exception:  # the estimator is defensive; a bug there must not fail the turn
            log.exception("context estimate failed", extra={"event": "estimate_error"})
            context, kind, sent = s.context, 0, 0
        s.context, s.output = context, budget
        if self._stopping:
            return _exc_response(ShuttingDown("the gateway is shutting down"), {"Retry-After": "1"})
        policy = self.policy
        t_req = self.now()
        reattached = s.reattach and s.known_to_policy and policy.state_of(sid) in (_HELD | {_RUNNING})
        s.reattach = False
        if reattached:  # the replaced attempt's place: still held, or admitted since
            held = policy.state_of(sid) in _HELD
        else:
            try:
                decisions = policy.handle(TurnRequested(t_req, sid, context, budget))
            except PolicyError as e:
                return _exc_response(e)
            s.known_to_policy = True
            if len(decisions) > 1:
                self._apply(decisions, 1)
            held = type(decisions[0]) is Park
        outcome = "cancelled"
        hold = "none"
        try:
            if held:
                hold = "parked" if policy.state_of(sid) is SessionState.PARKED else "waiting"
                refused = await self._hold(s, t_req)
                if refused is not None:
                    outcome = "refused"
                    refused.headers.extend(self._turn_headers(hold, self.now() - t_req))
                    return refused
            self._inflight += 1
            t_sent = self.now()
            extra = self._turn_headers(hold, t_sent - t_req if hold != "none" else 0.0)
            try:
                resp, usage, failure = await self._forward(request, raw, body.get("stream") is True, inject, extra)
            finally:
                self._inflight -= 1
            now = self.now()
            if failure is None:
                outcome = "finished"
                self._finished(s, now, now - t_sent, usage, context, kind, sent)
            else:
                outcome = "cancelled" if failure == "client" else "failed"  # "client": a write found it gone
                if failure != "client":
                    self.upstream_errors[failure] += 1
                    if failure in ("connect", "disconnect") and self.cfg.kv_pool is None:
                        self._pool_stale = True
                record_turn(s, context, kind, sent, None)
                self._apply(policy.handle(TurnAborted(now, sid)))
            return resp
        finally:
            self.turns[outcome] += 1
            if outcome == "cancelled":
                self._abandon(s, "disconnect")

    def _turn_headers(self, hold: str, wait: float) -> list[tuple[str, str]]:
        """What the gateway did with the turn, for the client (docs/gateway.md, "Response headers")."""
        limit = self.policy.limit
        if limit is not self._spec_of[0]:
            self._spec_of = (limit, limit.spec())
        return [(PARK_WAIT_HEADER, "0" if not wait else f"{wait:.6f}"), (HOLD_HEADER, hold),
                (CONTROL_HEADER, self._spec_of[1])]  # fmt: skip

    async def _hold(self, s: GwSession, t_req: float) -> Response | None:
        """Wait until the policy lets the session's turn proceed; an error response if it must not wait longer."""
        assert self._loop is not None
        fut: asyncio.Future[None] = self._loop.create_future()
        s.future = fut
        self._held += 1
        error: KvgateError | None = None
        try:
            if self._max_park_real is None:
                await fut
            else:
                async with asyncio.timeout(self._max_park_real):
                    await fut
        except TimeoutError:
            if self.policy.state_of(s.sid) is not _RUNNING:  # not admitted at the same instant
                error = ParkTimeout(f"held by the policy for more than {self.cfg.max_park_s:g} s; retry later")
        except ShuttingDown as e:
            error = e
        finally:
            s.future = None
            self._held -= 1
        if error is not None:
            self._abandon(s, "refused")
            return _exc_response(error, {"Retry-After": self._retry_after})
        self.park_wait.observe(self.now() - t_req)
        return None

    def _finished(
        self, s: GwSession, now: float, latency: float, usage: dict[str, Any] | None, context: int, kind: int,
        sent: int,
    ) -> None:  # fmt: skip
        if usage is not None:
            prompt, cached, completion = usage_tokens(usage)
            s.cached_tokens = -1 if cached is None else cached
        else:
            prompt, cached, completion = context, None, 0
        record_turn(s, context, kind, sent, usage)
        self.latency.observe(latency)
        if not s.anonymous and usage is not None:
            self.windows.add(now, prompt, cached)
        self._apply(self.policy.handle(TurnFinished(now, s.sid, latency, prompt, cached, completion)))
        if self._pool_stale:
            self._refresh_pool_soon()

    # -- upstream ------------------------------------------------------------------------------------------
    def _up_headers(self, headers: Any, turn: bool) -> list[tuple[str, str]]:
        """The client's headers as relayed upstream: hop-by-hop ones dropped, Authorization as configured."""
        drop = self._drop_turn if turn else self._drop_pass
        if "Connection" in headers:
            drop = drop | {t.strip().lower() for t in headers.get("Connection", "").split(",")}
        out = [(k, v) for k, v in headers.items() if k.lower() not in drop]
        if self._auth_up is not None:
            out.append(("Authorization", self._auth_up))
        if turn:
            out.append(("Accept-Encoding", "identity"))  # the gateway reads the usage in the response
            if "Content-Type" not in headers:
                out.append(("Content-Type", "application/json"))
        elif "Accept-Encoding" not in headers:
            # NOTE: ask for what the client can read: the gateway relays bodies undecoded
            out.append(("Accept-Encoding", "identity"))
        return out

    @staticmethod
    def _down_headers(headers: Any) -> list[tuple[str, str]]:
        drop = _DOWN_DROP
        if "Connection" in headers:
            drop = drop | {t.strip().lower() for t in headers.get("Connection", "").split(",")}
        return [(k, v) for k, v in headers.items() if k.lower() not in drop]

    def _target(self, request: Request) -> str:
        # NOTE: the upstream's scheme and authority are fixed; the client chooses only path and query (the
        # server reduced an absolute-form target, "http://elsewhere/x", to its path and query).
        return self._base_path + request.raw_path

    async def _forward(
        self, request: Request, raw: bytes, stream: bool, inject: bool, extra: list[tuple[str, str]]
    ) -> tuple[StreamResponse, dict[str, Any] | None, str | None]:
        """Send the turn upstream and relay the answer: ``(response, usage, failure kind or None)``. ``extra``:
        headers added to the response, whatever it is."""
        assert self._client is not None
        try:
            resp = await self._client.request(
                "POST", self._target(request), self._up_headers(request.headers, True), raw
            )
        except Exception as e:
            return self._upstream_failure(e, extra)
        done = False
        try:
            status = resp.status
            if stream and status == 200 and resp.content_type == "text/event-stream":
                out = StreamResponse(status=status, headers=self._down_headers(resp.headers) + extra)
                scanner = UsageScanner(drop_usage_only=inject)
                failure = await _relay(request, resp, out, scanner)
                done = failure is None
                return out, scanner.usage, failure
            data = await resp.read()
            done = True
            if status >= 500:
                failed = self._upstream_status(status, data, resp.headers)
                failed.headers.extend(extra)
                return failed, None, "http_5xx"
            out = Response(body=data, status=status, headers=self._down_headers(resp.headers) + extra)
            if status >= 300:
                return out, None, "http_4xx" if status >= 400 else "http_other"
            usage = None
            if b'"usage"' in data:
                try:
                    obj = loads(data)
                except ValueError:
                    obj = None
                u = obj.get("usage") if type(obj) is dict else None
                usage = u if type(u) is dict else None
            return out, usage, None
        except Exception as e:
            return self._upstream_failure(e, extra)
        finally:
            if done:
                resp.release()
            else:
                resp.close()

    def _upstream_failure(
        self, e: BaseException, extra: list[tuple[str, str]] | None = None
    ) -> tuple[Response, None, str]:
        if isinstance(e, TimeoutError):
            exc: KvgateError = UpstreamTimeout(f"the upstream timed out ({_one_line(e)})")
            kind = "timeout"
        elif isinstance(e, UpstreamConnectError):
            exc, kind = UpstreamError(f"the upstream is unreachable: {_one_line(e)}"), "connect"
        elif isinstance(e, OSError):
            exc, kind = UpstreamError(f"the upstream connection failed: {_one_line(e)}"), "disconnect"
        else:
            raise e
        log.warning("upstream %s", kind, extra={"event": "upstream_error", "kind": kind, "detail": str(exc)})
        out = _exc_response(exc)
        if extra:
            out.headers.extend(extra)
        return out, None, kind

    @staticmethod
    def _upstream_status(status: int, data: bytes, headers: Any) -> Response:
        detail = data[:500].decode("utf-8", "replace")
        try:
            obj = loads(data)
            err = obj.get("error") if type(obj) is dict else None
            if type(err) is dict and err.get("message"):
                detail = str(err["message"])
            elif type(obj) is dict and obj.get("detail"):
                detail = str(obj["detail"])
        except ValueError:
            pass
        extra = {"Retry-After": headers["Retry-After"]} if "Retry-After" in headers else None
        return error_response(502, f"the upstream answered {status}: {_one_line(detail)}", "UpstreamError", extra)

    # -- pool ----------------------------------------------------------------------------------------------
    async def _detect_pool(self) -> EngineInfo:
        assert self._client is not None
        hdrs = {"Authorization": self._auth_up} if self._auth_up else None
        return await detect_pool(self._client, self._base, headers=hdrs)

    def _refresh_pool_soon(self) -> None:
        self._pool_stale = False
        if self._refresh_task is None and not self._stopping:
            assert self._loop is not None
            self._refresh_task = self._loop.create_task(self._refresh_pool(), name="kvgate-gateway-pool")

    async def _refresh_pool(self) -> None:
        """Re-read C after the upstream came back; switch the limit if it changed."""
        try:
            info = await self._detect_pool()
        except PoolNotFound as e:
            log.warning("KV pool not re-read", extra={"event": "pool_error", "detail": str(e)})
            return
        finally:
            self._refresh_task = None
        self.upstream_info = info
        size, source = info.pool_tokens, info.source
        assert size is not None
        if size != self._capacity:
            old = self._capacity
            self._capacity, self._pool_source = size, source
            limit = self.limit
            self._apply(self.policy.set_limit(self.now(), make_limit(limit.name, size, **limit.params())))
            self._wake.set()
            log.warning("KV pool changed", extra={"event": "pool", "old_tokens": old, "kv_pool_tokens": size})

    # -- pass-through --------------------------------------------------------------------------------------
    async def _passthrough(self, request: Request) -> StreamResponse:
        """Any other path: relayed to the upstream as it is (method, headers but hop-by-hop ones, body)."""
        assert self._client is not None
        try:
            if self._keys and request.path not in ("/health",) and not self._client_authorized(request):
                raise Unauthorized("invalid or missing API key (Authorization: Bearer KEY)")
            raw = request.body  # whole, within --max-body-bytes (else the server answered 413)
        except KvgateError as e:
            return _exc_response(e)
        try:
            resp = await self._client.request(
                request.method, self._target(request), self._up_headers(request.headers, False), raw
            )
        except Exception as e:
            failed, _, kind = self._upstream_failure(e)
            self.upstream_errors[kind] += 1
            return failed
        done = False
        try:
            size = resp.content_length
            headers = self._down_headers(resp.headers)
            if request.method == "HEAD" or (size is not None and size <= PASSTHROUGH_READ_LIMIT):
                try:
                    data = await resp.read()
                except Exception as e:
                    failed, _, kind = self._upstream_failure(e)
                    self.upstream_errors[kind] += 1
                    return failed
                done = True
                return Response(body=data, status=resp.status, headers=headers)
            out = StreamResponse(status=resp.status, headers=headers)
            failure = await _relay(request, resp, out, None)
            if failure is not None and failure != "client":
                self.upstream_errors[failure] += 1
            done = failure is None
            return out
        finally:
            if done:
                resp.release()
            else:
                resp.close()

    # -- requests: helpers ---------------------------------------------------------------------------------
    def _client_authorized(self, request: Request) -> bool:
        auth = request.headers.get("Authorization", "")
        if not auth.startswith("Bearer "):
            return False
        given = auth[7:].strip().encode()
        ok = False
        for key in self._keys:  # NOTE: compare with every key, in constant time, whatever matches
            ok |= hmac.compare_digest(given, key)
        return ok

    def _admin_check(self, request: Request, query_token: bool = False) -> None:
        token = self.cfg.admin_token
        if token:
            auth = request.headers.get("Authorization", "")
            given = auth[7:].strip() if auth.startswith("Bearer ") else request.headers.get("X-Admin-Token", "")
            if not given and query_token:  # the dashboard's address: a browser cannot send a header
                given = parse_qs(request.raw_path.partition("?")[2]).get("token", [""])[0]
            if not hmac.compare_digest(given.encode(), token.encode()):
                raise Unauthorized("admin token required (Authorization: Bearer TOKEN or X-Admin-Token)")
            return
        remote = request.remote or ""
        try:
            ok = any(ipaddress.ip_address(remote.split("%")[0]) in net for net in LOOPBACK)
        except ValueError:
            ok = False
        if not ok:
            raise Forbidden("admin endpoints answer loopback clients only (set --admin-token to allow others)")

    # -- admin, sessions, metrics --------------------------------------------------------------------------
    def control_state(self) -> dict[str, Any]:
        limit = self.limit
        name, opts = self._control
        return {
            "control": limit.name,
            "spec": limit.spec(),
            "opts": limit.params(),
            "capacity_tokens": self._capacity,
            "kv_pool_source": self._pool_source,
            "scheduled": None
            if self._control_at is None
            else {"control": name, "opts": opts, "at_s": self._control_at},
            "now_s": round(self.now(), 3),
            "time_scale": self._scale,
        }

    def info(self) -> dict[str, Any]:
        """``GET /kvgate/info``: what this gateway is, its controller and counters, and its upstream (O(1))."""
        policy = self.policy
        up = self.upstream_info
        return {
            "kvgate": "gateway",
            "version": __version__,
            **self.control_state(),
            "parks": policy.parks,
            "readmissions": policy.readmissions,
            "waits": policy.waits,
            "turns": dict(self.turns),
            "replaced_attempts": self.replaced_attempts,
            "sessions": self.summary(),
            "upstream": {"url": self._base_str, **up.record()},
        }

    async def _info(self, request: Request) -> StreamResponse:
        return _json(self.info())

    def dashboard_state(self) -> dict[str, Any]:
        """``GET /kvgate/dashboard.json``: what the live page shows (O(1))."""
        from kvgate.http.dashboard import park_waits

        policy = self.policy
        pw = self.park_wait
        return {
            "now_s": round(self.now(), 3),
            "time_scale": self._scale,
            "control": self.limit.spec(),
            "upstream": self._base_str,
            "sessions": self.summary(),
            "parks": policy.parks,
            "readmissions": policy.readmissions,
            "waits": policy.waits,
            "park_waits": park_waits(pw.bounds, pw.counts, pw.total),
            "turns": dict(self.turns),
            "replaced_attempts": self.replaced_attempts,
            "upstream_errors": sum(self.upstream_errors.values()),
        }

    async def _dashboard(self, request: Request) -> StreamResponse:
        from kvgate.http.dashboard import PAGE

        try:
            self._admin_check(request, query_token=True)
        except KvgateError as e:
            return _exc_response(e)
        return Response(body=PAGE.encode(), content_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-store"})  # fmt: skip

    async def _dashboard_json(self, request: Request) -> StreamResponse:
        try:
            self._admin_check(request, query_token=True)
        except KvgateError as e:
            return _exc_response(e)
        return _json(self.dashboard_state())

    async def _get_control(self, request: Request) -> StreamResponse:
        try:
            self._admin_check(request)
        except KvgateError as e:
            return _exc_response(e)
        return _json(self.control_state())

    async def _post_control(self, request: Request) -> StreamResponse:
        try:
            self._admin_check(request)
            raw = request.body  # whole, within --max-body-bytes (else the server answered 413)
            try:
                body = loads(raw)
            except ValueError as e:
                raise ClientError(f"malformed JSON body: {e}") from None
            if type(body) is not dict or type(body.get("control")) is not str:
                raise ClientError('expected {"control": NAME, "opts": {...}}')
            opts = body.get("opts") or {}
            if type(opts) is not dict:
                raise ClientError('"opts" must be an object')
            name = body["control"]
            if ":" in name:
                name, spec_opts = parse_arm(name)
                opts = {**spec_opts, **opts}
            self.set_control(name, opts)
        except KvgateError as e:
            return _exc_response(e)
        except TypeError as e:
            return error_response(400, str(e), "ClientError")
        return _json(self.control_state())

    def session_info(self, s: GwSession, now: float) -> dict[str, Any]:
        policy = self.policy
        state = policy.state_of(s.sid).value if s.known_to_policy else "new"
        return {
            "id": s.sid if not s.anonymous else f"{ANON_PREFIX}{s.sid}",
            "state": state,
            "context_tokens": s.context,
            "output_tokens": s.output,
            "demand_tokens": policy.demand_of(s.sid) if s.known_to_policy else 0,
            "turns": s.turns,
            "last_prompt_tokens": s.prompt_tokens if s.prompt_tokens >= 0 else None,
            "last_cached_tokens": s.cached_tokens if s.cached_tokens >= 0 else None,
            "idle_s": None if s.busy else round(now - s.last_active, 3),
            "end_after_turn": s.end_after,
        }

    def summary(self) -> dict[str, Any]:
        """Sessions by state, D, C and the alarm inputs (O(1): for /v1/sessions and tests)."""
        policy = self.policy
        counts = policy.counts()
        now = self.now()
        hit5 = self.windows.hit_ratio(now, 300.0)
        alarm, n_star = regime_alarm(
            hit5, policy.demand, self._capacity, counts["in_system"], self.windows.mean_prompt(now, 300.0)
        )
        return {
            **{k: counts[k] for k in ("in_system", "admitted", "parked", "waiting", "running", "thinking")},
            "demand_tokens": policy.demand,
            "capacity_tokens": self._capacity,
            "demand_ratio": policy.demand / self._capacity,
            "hit_ratio_1m": _finite(self.windows.hit_ratio(now, 60.0)),
            "hit_ratio_5m": _finite(hit5),
            "n_star": _finite(n_star),
            "regime_alarm": alarm,
            "in_flight": self._inflight,
            "held": self._held,
        }

    async def _list_sessions(self, request: Request) -> StreamResponse:
        try:
            self._admin_check(request)
        except KvgateError as e:
            return _exc_response(e)
        now = self.now()
        data = [self.session_info(s, now) for s in self._sessions.values()]  # O(n): an inspection endpoint
        return _json({"object": "list", "data": data, "summary": self.summary(), "control": self.limit.spec()})

    async def _delete_session(self, request: Request, sid: str) -> StreamResponse:
        if self._keys and not self._client_authorized(request):
            return _exc_response(Unauthorized("invalid or missing API key (Authorization: Bearer KEY)"))
        s = self._sessions.get(sid)
        if s is None or s.anonymous:
            return _exc_response(NotFound(f"no session {sid!r}"))
        if s.busy:
            s.end_after = True
            return _json({"id": sid, "ended": False, "end_after_turn": True}, 202)
        self._end(s, "delete")
        return _json({"id": sid, "ended": True})

    async def _metrics(self, request: Request) -> StreamResponse:
        body = generate_latest(self.registry)
        return Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})

    # -- for tests and inspection --------------------------------------------------------------------------
    def audit(self) -> dict[str, Any]:
        """Cross-check the gateway's records against the policy core (O(n); tests call it, never the hot path).

        ``demand`` must equal ``admitted_demand`` (the true sum of d_s over admitted sessions), ``unknown`` and
        ``orphans`` must be empty, and ``held`` must match the policy's held sessions.
        """
        policy = self.policy
        admitted = 0
        unknown = []
        held_policy = 0
        for sid, s in self._sessions.items():
            if not s.known_to_policy:
                if not s.busy:
                    unknown.append(sid)
                continue
            state = policy.state_of(sid)
            if state in (SessionState.RUNNING, SessionState.THINKING):
                admitted += policy.demand_of(sid)
            elif state in _HELD:
                held_policy += 1
        counts = policy.counts()
        orphans = counts["in_system"] - sum(1 for s in self._sessions.values() if s.known_to_policy)
        return {
            "demand": policy.demand,
            "admitted_demand": admitted,
            "sessions": len(self._sessions),
            "in_system": counts["in_system"],
            "unknown": unknown,
            "orphans": orphans,
            "held": self._held,
            "held_policy": held_policy,
            "in_flight": self._inflight,
            "idle": len(self._idle),
        }

    def upstream_connections(self) -> dict[str, int]:
        """Connections of the upstream pool: ``acquired`` (in use) and ``idle`` (kept alive)."""
        pool = self._client
        if pool is None:
            return {"acquired": 0, "idle": 0}
        return {"acquired": pool.acquired, "idle": pool.idle}


class _Collector:
    """Prometheus families computed at scrape time from the gateway's state."""

    def __init__(self, gw: Gateway) -> None:
        self.gw = gw

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        gw = self.gw
        if gw._policy is None:
            return
        policy = gw.policy
        s = gw.summary()

        def gauge(name: str, doc: str, value: float) -> Metric:
            return GaugeMetricFamily(name, doc, value=value)

        def counter(name: str, doc: str, value: float) -> Metric:
            return CounterMetricFamily(name, doc, value=value)

        yield gauge("kvgate_sessions_in_system", "Sessions in the system (admitted, parked or waiting).",
                    s["in_system"])  # fmt: skip
        yield gauge("kvgate_sessions_admitted", "Admitted sessions (running or thinking).", s["admitted"])
        yield gauge("kvgate_sessions_running", "Admitted sessions with a turn in flight.", s["running"])
        yield gauge("kvgate_sessions_parked", "Sessions parked at a turn boundary (admitted before).", s["parked"])
        yield gauge("kvgate_sessions_waiting", "New sessions waiting for admission.", s["waiting"])
        yield gauge("kvgate_demand_tokens", "D: resident KV demand of admitted sessions (context + output budget).",
                    s["demand_tokens"])  # fmt: skip
        yield gauge("kvgate_kv_pool_tokens", "C: the upstream's KV pool in tokens.", s["capacity_tokens"])
        yield gauge("kvgate_demand_ratio", "D / C.", s["demand_ratio"])
        yield gauge("kvgate_n_star", "N* = C / mean context of agent turns in the last 5 minutes (NaN: no turns).",
                    _nan(s["n_star"]))  # fmt: skip
        hit = GaugeMetricFamily("kvgate_agent_hit_ratio", "Token-weighted prefix-cache hit ratio of agent turns "
                                "(cached / prompt tokens) over a trailing window.", labels=["window"])  # fmt: skip
        hit.add_metric(["1m"], _nan(s["hit_ratio_1m"]))
        hit.add_metric(["5m"], _nan(s["hit_ratio_5m"]))
        yield hit
        yield gauge("kvgate_regime_alarm", "1 while the 5-minute agent hit ratio < 0.5 and (D > C or sessions in "
                    "system > N*).", 1.0 if s["regime_alarm"] else 0.0)  # fmt: skip
        yield gauge("kvgate_turns_in_flight", "Turns sent upstream and not yet answered.", s["in_flight"])
        yield counter("kvgate_parks", "Admitted sessions parked at a turn boundary.", policy.parks)
        yield counter("kvgate_readmissions", "Parked sessions admitted again.", policy.readmissions)
        yield counter("kvgate_waits", "New sessions that waited for admission.", policy.waits)
        yield counter("kvgate_requests", "Completion requests received.", gw.requests)
        turns = CounterMetricFamily(
            "kvgate_turns",
            "Turns by outcome (finished, failed upstream, refused after --max-park-s or shutdown, cancelled).",
            labels=["outcome"],
        )
        for outcome in ("finished", "failed", "refused", "cancelled"):
            turns.add_metric([outcome], gw.turns[outcome])
        yield turns
        errors = CounterMetricFamily("kvgate_upstream_errors", "Upstream failures by kind.", labels=["kind"])
        for kind in ("connect", "disconnect", "timeout", "http_5xx", "http_4xx", "http_other"):
            errors.add_metric([kind], gw.upstream_errors[kind])
        yield errors
        ends = CounterMetricFamily("kvgate_session_ends", "Sessions ended, by cause.", labels=["reason"])
        for reason in ("client", "delete", "idle", "disconnect", "refused", "one-turn"):
            ends.add_metric([reason], gw.session_ends[reason])
        yield ends
        yield gw.park_wait.family("kvgate_park_wait_seconds", "Time a turn was held by the policy (gateway time).")
        yield gw.latency.family("kvgate_turn_latency_seconds", "Upstream time of a turn, sent to last byte "
                                "(gateway time).")  # fmt: skip
        info = GaugeMetricFamily("kvgate_control_info", "The active controller.", labels=["control", "spec"])
        info.add_metric([policy.limit.name, policy.limit.spec()], 1.0)
        yield info
        yield gauge("kvgate_time_scale", "Gateway seconds per real second.", gw._scale)
        yield gauge("kvgate_gateway_time_seconds", "The gateway's clock.", gw.now())


async def _relay(request: Request, resp: UpResponse, out: StreamResponse, scanner: UsageScanner | None) -> str | None:
    """Relay the upstream body chunk by chunk as it arrives; the failure kind, or None when it all went through.

    "client": the client went away (a write failed); "timeout" / "disconnect": the upstream failed, and the
    client got an error event (vLLM's shape) and ``data: [DONE]`` (the status line was sent already).
    """
    try:
        await out.prepare(request)
    except ConnectionError:
        return "client"
    error: BaseException | None = None
    held = b""
    while True:
        try:
            chunk = await resp.readany()
        except Exception as e:  # the upstream failed or timed out mid-body
            error = e
            break
        if not chunk:
            break
        if scanner is not None:
            chunk = scanner.feed(chunk)
            if not chunk:
                continue
            if chunk.endswith(_DONE):
                # the stream's last event: it goes out with the end of the body, in one write
                held += chunk
                continue
        try:
            if held:  # (data after [DONE]: unusual, relayed as it is)
                chunk, held = held + chunk, b""
            await out.write(chunk)
        except ConnectionError:
            return "client"
    try:
        if scanner is not None:
            held += scanner.flush()
        if error is not None:
            timeout = isinstance(error, TimeoutError)
            what = "timed out" if timeout else "failed"
            event = {"error": {"message": f"the upstream {what} mid-stream: {_one_line(error)}",
                               "type": "UpstreamTimeout" if timeout else "UpstreamError", "param": None,
                               "code": 504 if timeout else 502}}  # fmt: skip
            log.warning("upstream failed mid-stream", extra={"event": "upstream_error", "detail": _one_line(error)})
            held += b"data: " + dumps(event) + b"\n\n" + _DONE
        await out.write_eof(held)
    except ConnectionError:
        return "client"
    if error is not None:
        return "timeout" if isinstance(error, TimeoutError) else "disconnect"
    return None


def _finite(x: float) -> float | None:
    return None if x is None or math.isnan(x) else round(x, 6)


def _nan(x: float | None) -> float:
    return math.nan if x is None else x


def _one_line(e: BaseException | str) -> str:
    text = e if isinstance(e, str) else (str(e) or type(e).__name__)
    return " ".join(text.split())[:300]


# -- the command ------------------------------------------------------------------------------------------------
async def serve(cfg: GatewayConfig, host: str, port: int, ready: Callable[[Gateway], None] | None = None) -> None:
    """Run a gateway until SIGINT or SIGTERM, then shut it down gracefully."""
    gw = Gateway(cfg)
    await gw.start(host, port)
    settle_for_serving()
    try:
        await until_signalled(None if ready is None else lambda: ready(gw))
    finally:
        await gw.stop()


_CONFIG_KEYS = {
    "upstream", "upstream_api_key", "control", "control_opt", "control_at", "kv_pool", "session_header", "host",
    "port", "time_scale", "idle_timeout", "max_park_s", "default_max_tokens", "require_session", "api_key",
    "admin_token", "max_body_bytes", "upstream_timeout", "shutdown_grace", "log_level", "loop",
}  # fmt: skip


def load_config_file(path: Path) -> dict[str, Any]:
    """Option defaults from a TOML (or, by extension, JSON) file: keys are option names (``kv-pool`` or
    ``kv_pool``); ``control-opt`` may be a table; ``api-key`` a string or a list."""
    try:
        text = path.read_bytes()
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text.decode())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UsageError(f"--config {path}: {_one_line(e)}") from None
    if type(data) is not dict:
        raise UsageError(f"--config {path}: expected a table of options")
    out: dict[str, Any] = {}
    for key, value in data.items():
        k = str(key).replace("-", "_")
        if k not in _CONFIG_KEYS:
            raise UsageError(f"--config {path}: unknown option {key!r}")
        if k == "control_opt" and type(value) is dict:
            value = ",".join(f"{a}={b}" for a, b in value.items())
        if k == "api_key" and type(value) is str:
            value = [value]
        if k == "kv_pool":
            value = str(value)
        out[k] = value
    return out


def _config_callback(ctx: click.Context, _param: click.Parameter, value: Path | None) -> Path | None:
    if value is not None:
        ctx.default_map = {**(ctx.default_map or {}), **load_config_file(value)}
    return value


def _kv_pool(text: str) -> int | None:
    t = str(text).strip().lower()
    if t == "auto":
        return None
    try:
        n = int(t.replace("_", ""))
    except ValueError:
        raise UsageError(f"--kv-pool {text!r}: expected 'auto' or a number of tokens") from None
    return n


def _install_loop(kind: str) -> str:
    """Pick the event loop: uvloop when asked (or available with 'auto'), else asyncio's."""
    if kind == "asyncio":
        return "asyncio"
    try:
        import uvloop  # type: ignore[import-not-found]
    except ImportError:
        if kind == "uvloop":
            raise UsageError("--loop uvloop: uvloop is not installed (pip install uvloop)") from None
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


@click.command("gateway", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option(
    "--config",
    type=click.Path(dir_okay=False, path_type=Path),
    is_eager=True,
    expose_value=False,
    callback=_config_callback,
    help="TOML (or .json) file of option defaults; flags override it.",
)
@click.option(
    "--upstream",
    required=True,
    metavar="URL",
    help="The engine: an OpenAI-compatible server (vLLM, SGLang, kvgate engine), e.g. http://127.0.0.1:8100.",
)
@click.option(
    "--upstream-api-key",
    envvar="KVGATE_UPSTREAM_API_KEY",
    default=None,
    metavar="KEY",
    help="Authorization: Bearer KEY sent upstream (replaces the client's). Env: KVGATE_UPSTREAM_API_KEY.",
)
@click.option("--control", default="budgeter", show_default=True, help=f"Controller: {', '.join(LIMITS)}.")
@click.option("--control-opt", default="", metavar="K=V,...", help="Controller parameters, e.g. low=0.7,high=0.9.")
@click.option(
    "--control-at",
    type=float,
    default=None,
    metavar="MIN",
    help="Minute (gateway time) the controller starts; before it: none [default: from the start].",
)
@click.option(
    "--kv-pool",
    default="auto",
    show_default=True,
    metavar="auto|TOKENS",
    help="KV pool C; auto asks the upstream: vLLM's (num_gpu_blocks - 1) x block_size from /metrics, SGLang's "
    "max_total_num_tokens from /server_info, another kvgate gateway's /kvgate/info.",
)
@click.option(
    "--session-header",
    default="X-Session-ID",
    show_default=True,
    metavar="NAME",
    help="Header naming the session (else body session_id, else user).",
)
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=int, default=8000, show_default=True)
@click.option(
    "--time-scale",
    type=float,
    default=1.0,
    show_default=True,
    help="Gateway seconds per real second (match kvgate engine --time-scale).",
)
@click.option(
    "--idle-timeout",
    type=float,
    default=300.0,
    show_default=True,
    metavar="S",
    help="End a session after this long without a request (gateway seconds).",
)
@click.option(
    "--max-park-s",
    type=float,
    default=None,
    metavar="S",
    help="Answer 503 (Retry-After) to a turn held longer (gateway seconds) [default: wait].",
)
@click.option(
    "--default-max-tokens",
    type=int,
    default=1024,
    show_default=True,
    metavar="N",
    help="Output budget o_s of a request without max_tokens.",
)
@click.option("--require-session", is_flag=True, help="Answer 400 to requests that name no session.")
@click.option(
    "--api-key",
    "api_keys",
    multiple=True,
    envvar="KVGATE_API_KEYS",
    metavar="KEY",
    help="Accept clients with Authorization: Bearer KEY (repeatable; env KVGATE_API_KEYS, space-separated). "
    "The client's key is not forwarded.",
)
@click.option(
    "--admin-token",
    envvar="KVGATE_ADMIN_TOKEN",
    default=None,
    metavar="TOKEN",
    help="Required by /admin/* and GET /v1/sessions [default: loopback clients only].",
)
@click.option(
    "--max-body-bytes",
    type=int,
    default=32 << 20,
    show_default=True,
    metavar="N",
    help="Larger request bodies get 413.",
)
@click.option(
    "--upstream-timeout",
    type=float,
    default=600.0,
    show_default=True,
    metavar="S",
    help="Real seconds to wait for the upstream's headers or its next bytes (then 504).",
)
@click.option(
    "--shutdown-grace",
    type=float,
    default=30.0,
    show_default=True,
    metavar="S",
    help="On SIGTERM, real seconds turns in flight get to finish.",
)
@click.option(
    "--log-level",
    type=click.Choice(["debug", "info", "warning", "error"]),
    default="info",
    show_default=True,
    help="JSON log lines on stderr.",
)
@click.option(
    "--loop",
    "loop_kind",
    type=click.Choice(["auto", "asyncio", "uvloop"]),
    default="auto",
    show_default=True,
    help="Event loop (auto: uvloop when installed).",
)
def command(
    upstream: str, upstream_api_key: str | None, control: str, control_opt: str, control_at: float | None,
    kv_pool: str, session_header: str, host: str, port: int, time_scale: float, idle_timeout: float,
    max_park_s: float | None, default_max_tokens: int, require_session: bool, api_keys: tuple[str, ...],
    admin_token: str | None, max_body_bytes: int, upstream_timeout: float, shutdown_grace: float, log_level: str,
    loop_kind: str,
) -> None:  # fmt: skip
    """Serve the policy core in front of an OpenAI-compatible engine: park agent sessions at turn boundaries.

    \b
    Relays /v1/completions and /v1/chat/completions (streaming or not) to --upstream, holding a
    session's turn while the controller says so (the client sees only latency); every other path
    is passed through. Sessions: X-Session-ID (or body session_id, or user); X-Session-End: true
    on the last turn. Serves /metrics (Prometheus), GET /v1/sessions, DELETE /v1/sessions/ID and
    POST /admin/control {"control": NAME, "opts": {...}}. Stops gracefully on SIGTERM.
    See docs/gateway.md.
    """
    cfg = GatewayConfig(
        upstream=upstream, control=control, control_opts=control_opts(control, control_opt),
        control_at_min=control_at, kv_pool=_kv_pool(kv_pool), session_header=session_header,
        time_scale=time_scale, idle_timeout_s=idle_timeout, max_park_s=max_park_s,
        default_max_tokens=default_max_tokens, require_session=require_session,
        api_keys=tuple(k for k in api_keys if k), upstream_api_key=upstream_api_key, admin_token=admin_token,
        max_body_bytes=max_body_bytes, upstream_timeout_s=upstream_timeout, shutdown_grace_s=shutdown_grace,
    )  # fmt: skip
    cfg.validate()
    setup_logging(log_level)
    loop_name = _install_loop(loop_kind)

    def ready(gw: Gateway) -> None:
        log.info(
            f"kvgate gateway: serving at http://{host}:{gw.port} in front of {gw._base_str} "
            f"({gw.limit.spec()}, {gw.capacity_tokens}-token KV pool from {gw._pool_source}, upstream "
            f"{gw.upstream_info.kind} with {gw.upstream_info.block_size or '?'}-token blocks, "
            f"time x{time_scale:g}, {loop_name} loop); Ctrl-C stops",
            extra={"event": "ready", "port": gw.port},
        )

    try:
        asyncio.run(serve(cfg, host, port, ready))
    except PoolNotFound:
        raise
    except OSError as e:  # e.g. the port is taken
        raise UsageError(f"cannot listen on {host}:{port}: {_one_line(e)}") from None


def main(argv: list[str] | None = None) -> None:
    """``python -m kvgate.http.gateway``: the command on its own (``kvgate gateway`` once registered)."""
    try:
        command.main(args=argv, prog_name="kvgate gateway", standalone_mode=False)
    except click.ClickException as e:
        click.echo(f"kvgate: error: {e.format_message()}", err=True)
        sys.exit(2)
    except UsageError as e:
        click.echo(f"kvgate: error: {e}", err=True)
        sys.exit(2)
    except KeyboardInterrupt:  # pragma: no cover
        sys.exit(130)


if __name__ == "__main__":  # pragma: no cover
    main()
