"""The request path of a turn (``POST /v1/completions``, ``/v1/chat/completions``, ``/v1/responses``,
``/v1/messages``; what differs by API is its dialect, :mod:`kvgate.http.dialect`)::

    parse body, session id ─▶ the session's turn (serialised) ─▶ TurnRequested ─┬─ Proceed ─────────────┐
                                                                              └─ held: await its slot ─┤
    relay (SSE chunks as they arrive) ◀── upstream ◀── body (include_usage added if needed) ◀───────────┘
      └─ usage ─▶ TurnFinished (or TurnAborted) ─▶ the session's turn released ─▶ the next request, or idle

* A session is named by the ``X-Session-ID`` header (``--session-header``), else the body's ``session_id``,
  else OpenAI's ``user``; a request naming none is a one-turn session (400 with ``--require-session``). A session
  ends after a turn sent with ``X-Session-End: true`` or after a ``DELETE`` that arrived while the turn was busy.
* A request of a session with the same body as the attempt holding the session's turn is a retry of it (the
  agent timed out): the earlier attempt is cancelled (409 if its client still listens) and the retry takes over
  its place in the policy, so the turn counts once.
* In a fleet the session is placed on a replica first (:meth:`Placement.place`), and asked to that replica's
  policy. A turn whose replica failed it with a connection error before any byte of the answer reached the client
  (nothing listens, or the connection dropped before the response was relayed) marks the replica down and is
  retried once per remaining replica, on the session's new replica (a new ``TurnRequested`` there: it may be held
  again); a turn that failed after its answer began (a stream) ends with the error event, as with one upstream.
  One upstream: no retry, the client gets the 502 (as before fleets).
* A held turn costs the client only latency; held longer than ``--max-park-s`` it is answered 503 with
  ``Retry-After``. A client that goes away releases what it held: a turn in flight becomes ``TurnAborted``, a
  held one ``SessionEnded``.

Cost: a dict lookup, the O(1) policy event, a few counters; the body is parsed once and forwarded as received
(``include_usage`` spliced in when a stream lacks it).
"""

from __future__ import annotations

import asyncio
import logging
import math
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvgate.errors import ClientError, KvgateError, PolicyRefusal
from kvgate.gateway.asks import PolicyCalls
from kvgate.gateway.auth import UnsupportedMediaType, client_key, unauthorized
from kvgate.gateway.bodies import Bodies, ReadApi, dispose, keyed_tokenize_ask, off_loop
from kvgate.gateway.breaks import prefix_break
from kvgate.gateway.config import GatewayConfig
from kvgate.gateway.estimate import estimate_turn, record_turn
from kvgate.gateway.fleet import Replica
from kvgate.gateway.headers import TurnHeaders
from kvgate.gateway.identity import Resolution, Resolver
from kvgate.gateway.metrics import LATENCY_BUCKETS, PARK_WAIT_BUCKETS, Histogram, UsageWindows
from kvgate.gateway.placement import NoReplicaUp, Placement
from kvgate.gateway.relay import COUNTS_KEPT, UpstreamRelay
from kvgate.gateway.sessions import GwSession, Sessions
from kvgate.gateway.stream import loads, with_cache_salt, with_include_usage
from kvgate.gateway.tenants import OverQuota, Tenants
from kvgate.http.clock import Clock
from kvgate.http.dialect import Api, Usage
from kvgate.http.openai import SESSION_END_HEADER, session_end
from kvgate.http.server import Request, Response, StreamResponse, error_response, exc_response
from kvgate.policy import PolicyError

if TYPE_CHECKING:
    from kvgate.gateway.sharing import Sharing

log = logging.getLogger("kvgate.gateway")

class ParkTimeout(PolicyRefusal):
    """The turn was held longer than ``--max-park-s``."""


class ShuttingDown(PolicyRefusal):
    """The gateway is stopping and will not start this turn."""


class TurnPath:
    """Handles turns for the gateway; counts what happened to them."""

    def __init__(
        self, cfg: GatewayConfig, sessions: Sessions, placement: Placement, errors: Counter[str],
        wake: Callable[[], None], failed: Callable[[Replica, str], None],
    ) -> None:
        self.cfg = cfg
        self.sessions = sessions
        self.calls = PolicyCalls(sessions)
        """The turns' policy calls (ask, finished, aborted, abandon)."""
        self.placement = placement
        self.errors = errors  # upstream failures by kind (every replica's)
        self._failed = failed
        """Told of a replica that failed a turn (kind "connect" or "disconnect" marks a fleet's replica down)."""
        self._now: Callable[[], float] = _not_started  # gateway time (the clock's now once started)
        self._wake = wake
        self._keys = tuple(k.encode() for k in cfg.api_keys)
        self._salts = cfg.cache_salts
        self._sess_hdr = cfg.session_header
        self._default_max = cfg.default_max_tokens
        self.max_park_real = self._max_park_real = None if cfg.max_park_s is None else cfg.max_park_s / cfg.time_scale
        self._retry_after = str(max(1, math.ceil(self._max_park_real or 1.0)))
        self._headers = TurnHeaders(sessions.fleet)
        self.stopping = False
        """The gateway is stopping: new turns are refused."""
        self.in_flight = 0
        """Turns sent upstream and not yet answered."""
        self.held = 0
        """Turns held by the policy now."""
        self.requests = 0
        """Completion requests received."""
        self.outcomes: Counter[str] = Counter()
        """Turns by outcome (:data:`kvgate.gateway.metrics.TURN_OUTCOMES`)."""
        self.retried = 0  # turns retried on another replica after theirs failed them before answering
        self.replaced_attempts = 0
        """Requests cancelled by a retry of the same turn of the session (held or in flight)."""
        self.park_wait = Histogram(PARK_WAIT_BUCKETS)
        self.latency = Histogram(LATENCY_BUCKETS)
        self.windows = UsageWindows()
        self.resolver = Resolver(cfg.session_from, cfg.session_header, sessions)
        sessions.max_sessions, sessions.idle_s = cfg.max_sessions, cfg.idle_timeout_s
        self.tenants = Tenants(sessions.fleet.tenancy, cfg)
        self.shared: Sharing | None = None  # (--store redis://: the books and budget shared by the gateways)
        self.bodies = Bodies(cfg.offload_body_bytes)  # (large ones read off the event loop)

    def start(self, clock: Clock) -> None:
        """Run on the gateway's clock from now on."""
        self._now = clock.now

    async def turn(self, request: Request, api: Api) -> StreamResponse:
        self.requests += 1
        client = None
        try:
            if self._keys:
                client = client_key(self._keys, request)
                if client is None:
                    raise unauthorized()
            ambiguous(request.headers, self._sess_hdr)
            raw = request.body  # whole, within --max-body-bytes (else the server answered 413)
            body = self.bodies.parse_now(raw, api)
            if body is None:
                body, api = await self.bodies.parse(raw, api, client)  # (in the order turns arrived)
            if self.stopping:
                raise ShuttingDown("the gateway is shutting down")
            who = self.tenants.of(request.headers, client)
        except KvgateError as e:
            return exc_response(e)
        headers = request.headers
        sessions = self.sessions
        res = resolved(self, headers, body, raw, api, client) if self.shared is None else \
            await resolve(self, headers, body, raw, api, client)
        tools = offers_tools(body)
        side_of, res = side_split(sessions, res, body, api, client, tools)
        anonymous = res.anonymous
        if res.named is None and side_of is None and self.cfg.require_session:  # (lineage follows, never names)
            return unnamed(self._sess_hdr, self.resolver.sources)
        sid = res.sid
        inject = False
        if self._salts and client is not None:  # the key's own prefix cache (vLLM's, SGLang's cache_salt)
            raw, body = with_cache_salt(raw, body, self._salts[client])
        if body.get("stream") is True and api.usage_option:
            so = body.get("stream_options")
            if type(so) is not dict or not so.get("include_usage"):
                raw = with_include_usage(raw, body)
                inject = True
        end = session_end(headers.get(SESSION_END_HEADER, ""))
        budget = api.budget(body, self._default_max)
        key = 0
        if res.named is not None:  # (lineage: the same body again is a fork)
            key = body_key(request.body)
            if sessions.supersede(sid, key):
                self.replaced_attempts += 1
        s = sessions.open(sid, anonymous)
        if s.slot.busy:
            s = await self._enter(sid, anonymous)
        else:
            sessions.take(s)
        self.tenants.bind(s, who)
        s.slot.begin(request.serving_task(), key)
        try:
            sides(sessions, s, res, side_of, tools)
            try:
                fresh = self.resolver.bind(s, res)
            except Exception:  # lineage is defensive; a bug there must not fail the turn
                log.exception("session binding failed", extra={"event": "resolve_error"})
                fresh = False
            sessions.trim(self._now())
            return await self._run(request, s, body, raw, api, inject, budget, fresh, res.lineage)
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if not s.slot.superseded or task is None or task.uncancel() > 0:
                raise
            # replaced by a retry of this turn: tell this attempt's client, if it still listens
            if body.get("stream") is True:  # the answer may have begun: end the connection instead
                request.close_connection()
                raise
            return error_response(409, "replaced by a retry of the same turn of this session", "RetryReplaced")
        finally:
            s.slot.over()
            if self.shared is not None:
                await self.shared.turn_over(s, anonymous or end or s.slot.end_after)
            if anonymous:
                sessions.end(s, "one-turn", self._now())
            elif end or s.slot.end_after:
                sessions.end(s, "client" if end else "delete", self._now())
            self._leave(s)
            dispose(api, body, res)

    async def _enter(self, sid: Any, anonymous: bool) -> GwSession:
        """The session's record, holding its turn (turns of one session are serialised)."""
        sessions = self.sessions
        while True:
            s = sessions.open(sid, anonymous)
            if not s.slot.busy:
                sessions.take(s)
                return s
            fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
            s.slot.wait(fut)
            try:
                await fut
            except asyncio.CancelledError:
                if not fut.cancelled():
                    self._leave(s)  # it was handed to us: pass it on
                else:
                    s.slot.unwait(fut)
                raise
            if not s.slot.dropped:
                return s
            self._leave(s)  # the session ended meanwhile: wake the next waiter, then start a new one

    def _leave(self, s: GwSession) -> None:
        if self.sessions.leave(s, self._now()):
            self._wake()  # the timer may be sleeping with no idle deadline

    async def _run(
        self, request: Request, s: GwSession, body: dict[str, Any], raw: bytes, api: Api, inject: bool,
        budget: int, fresh: bool, lineage: str,
    ) -> StreamResponse:
        first = _estimate(s, body, api, fresh) if self.shared is None and not isinstance(api, ReadApi) else None
        est = told(self, s, first, budget) if first and not first[3] else await boundary(  # (inline: no coroutine)
            self, s, body, api, fresh, budget, first)
        if not isinstance(est, tuple):
            return est
        context, kind, sent = est
        sessions = self.sessions
        t_req = now = self._now()
        if s.est.turns and s.last_active:
            sessions.think.observe(t_req - s.last_active)  # the gap since its last turn ended
        outcome: str | None = None
        hold = "none"
        fleet = sessions.fleet
        retries = len(fleet.replicas) - 1
        try:
            while True:
                try:
                    rep = s.replica  # (one upstream: placed once)
                    if rep is None or not fleet.single:
                        rep = self.placement.place(s)
                    held = self.calls.ask(s, now, context, budget)
                except (PolicyError, OverQuota) as e:
                    return exc_response(e, self.tenants.refusal(s, e))
                except NoReplicaUp as e:
                    if outcome is None and not s.known_to_policy and not s.replaced and not s.est.turns:
                        sessions.end(s, "refused", self._now())  # a new session with nowhere to go: not kept
                    outcome = "refused"
                    return exc_response(e, {"Retry-After": "1"})
                outcome = "cancelled"
                if held:
                    hold = self.calls.hold_kind(s)
                    refused = await self._hold(s, t_req)
                    if refused is not None:
                        outcome = "refused"
                        refused.headers.extend(self._headers.of(s, hold, self._now() - t_req))
                        return refused
                    target = self.placement.target(s)
                    if target is None:  # its replica went down as it was released: ask its new one
                        now = self._now()
                        continue
                    rep = target
                relay: UpstreamRelay = rep.relay
                rep.in_flight, self.in_flight = rep.in_flight + 1, self.in_flight + 1
                t_sent = self._now()
                extra = self._headers.of(s, hold, t_sent - t_req if hold != "none" else 0.0, lineage)
                up = self.tenants.sent(s, t_sent, t_req, hold, lineage)  # (its id: the engine caches by it)
                try:
                    resp, usage, failure, answer = await relay.forward(
                        request, raw, body.get("stream") is True, inject, extra, api, up, self.tenants.marks(s))
                finally:
                    self.in_flight -= 1
                    rep.in_flight -= 1
                now = self._now()
                if failure is None:
                    outcome = "finished"
                    self._finished(s, rep, now, now - t_sent, api.usage(usage), context, kind, sent)
                    if answer is not None and not s.anonymous:
                        sessions.answered_with(s, api, answer, body.get("stream") is True)
                    return resp
                outcome = "cancelled" if failure == "client" else "failed"  # "client": a write found it gone
                unanswered(self, s, rep, failure, now, (context, kind, sent))
                if retries > 0 and failure in ("connect", "disconnect") and type(resp) is Response and not rep.up:
                    retries -= 1  # nothing reached the client: the session's new replica serves the turn
                    self.retried += 1
                    now = self._now()
                    continue
                return resp
        finally:
            self.tenants.ended(s, outcome)
            if outcome is not None:
                self.outcomes[outcome] += 1
                if self.shared is not None:
                    self.shared.outcome(s, outcome)
                if outcome == "cancelled":
                    sessions.lineage.failed(s)
                    self.calls.abandon(s, "disconnect", self._now())

    async def _hold(self, s: GwSession, t_req: float) -> Response | None:
        """Wait until the policy lets the session's turn proceed; an error response if it must not wait longer."""
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        s.slot.hold(fut)
        self.held += 1
        error: KvgateError | None = None
        try:
            if self._max_park_real is None:
                await fut
            else:
                async with asyncio.timeout(self._max_park_real):
                    await fut
        except TimeoutError:
            if not self.calls.is_running(s):  # not admitted at the same instant
                error = ParkTimeout(f"held by the policy for more than {self.cfg.max_park_s:g} s; retry later")
        except (ShuttingDown, NoReplicaUp) as e:
            error = e
        finally:
            s.slot.hold(None)
            self.held -= 1
        if error is not None:
            self.calls.abandon(s, "refused", self._now())
            return exc_response(error, {"Retry-After": self._retry_after})
        self.park_wait.observe(self._now() - t_req)
        return None

    def _finished(
        self, s: GwSession, rep: Replica, now: float, latency: float, usage: Usage | None, context: int,
        kind: str, sent: int,
    ) -> None:
        sessions = self.sessions
        cause = ""
        if usage is not None:
            prompt, completion = usage.prompt, usage.completion
            self.tenants.answered(s, prompt, completion)
            cached = rep.watch.upstream_info.cached(usage)  # the engine's quirks (SGLang omits a 0)
            s.est.cached(cached)
            if s.est.turns and not s.anonymous:
                notes = s.cache
                cause = prefix_break(s.est.prompt_tokens, prompt, cached, notes.note, notes.mark != sessions.pressure,
                                     self.windows.hit_ratio(now, 60.0))
        else:
            prompt, cached, completion = context, None, 0
        record_turn(s.est, context, kind, sent, usage)
        self.latency.observe(latency)
        if cause:
            s.cache.broke(cause)
            sessions.breaks[cause] += 1
        elif not s.anonymous and usage is not None:  # (a break is the session's own doing: not the regime's)
            self.tenants.hit(s, now, prompt, cached, self.windows)
        self.calls.finished(s, now, latency, prompt, cached, completion)
        s.cache.marked(sessions.pressure)
        watch = rep.watch
        if watch.stale and not self.stopping:
            watch.refresh_soon()


async def resolve(path: TurnPath, headers: Any, body: dict[str, Any], raw: bytes, api: Api, client: int | None
                  ) -> Resolution:
    """The turn's session as the resolver finds it (first the other instances' turns since, when they share)."""
    if path.shared is not None:
        await path.shared.sync_turn()  # (lineage and ids find the sessions of the other instances' turns too)
    return resolved(path, headers, body, raw, api, client)


def resolved(path: TurnPath, headers: Any, body: dict[str, Any], raw: bytes, api: Api, client: int | None
             ) -> Resolution:
    """The turn's session as the resolver finds it now."""
    try:
        return path.resolver.resolve(headers, body, raw, api, client)
    except Exception:  # lineage is defensive; a bug there must not fail the turn
        log.exception("session resolution failed", extra={"event": "resolve_error"})
        return Resolution(path.sessions.anonymous_id(), client)


def unanswered(path: TurnPath, s: GwSession, rep: Replica, failure: str, now: float, est: tuple[int, str, int]
               ) -> None:
    """The upstream did not answer ``s``'s turn (``failure``; "client": the client left first)."""
    if failure != "client":
        path.errors[failure] += 1
        rep.watch.upstream_failed(failure)
        path._failed(rep, failure)
    record_turn(s.est, *est, None)
    path.sessions.lineage.failed(s)
    path.calls.aborted(s, now)


async def boundary(path: TurnPath, s: GwSession, body: dict[str, Any], api: Api, fresh: bool, budget: int,
                   first: tuple[int, str, int, bool] | None = None) -> tuple[int, str, int] | StreamResponse:
    """The turn's estimate at its boundary (context, how it was told, tokens sent), or the answer that ends it;
    ``first``: the estimate already made (:func:`_estimate`)."""
    est = told(path, s, await estimated(path, s, body, api, fresh, first), budget)
    if path.shared is None or not isinstance(est, tuple):
        return est
    # the shared budget decides (the local policy has no control)
    got = await path.shared.admit(s, budget, est, lambda: estimated(path, s, body, api, fresh))
    if isinstance(got, KvgateError):
        path.outcomes["refused"] += 1
        return exc_response(got, {"Retry-After": path._retry_after})
    s.est.recounted(got[0])
    return got


def told(path: TurnPath, s: GwSession, est: tuple[int, str, int] | tuple[int, str, int, bool], budget: int
         ) -> tuple[int, str, int] | StreamResponse:
    """The session's estimator told the turn's context; the answer that ends the turn if the gateway stops."""
    s.est.told(est[0], budget)
    if path.stopping:
        return exc_response(ShuttingDown("the gateway is shutting down"), {"Retry-After": "1"})
    return est[:3] if len(est) > 3 else est  # type: ignore[return-value]


async def estimated(path: TurnPath, s: GwSession, body: dict[str, Any], api: Api, fresh: bool,
                    first: tuple[int, str, int, bool] | None = None) -> tuple[int, str, int]:
    """The turn's context (a start-over's as the engine counts it), how it was told, the tokens sent."""
    if first is None:
        first = (_estimate(s, body, api, fresh) if not isinstance(api, ReadApi)  # (inline: no coroutine)
                 else await off_loop(api, _estimate, s, body, api, fresh))
    context, kind, sent, over = first
    if over:
        counted = await session_engine_count(path.sessions, s, body, api)
        context = counted if counted is not None else context
    return context, kind, sent


def unnamed(session_header: str, sources: tuple[str, ...]) -> Response:
    """``--require-session``'s 400 for a request no source names."""
    named_by = ", ".join(s for s in sources if s != "lineage")
    return error_response(400, f"a session id is required ({session_header} header, or another source of "
                          f"--session-from: {named_by})", "ClientError")


def ambiguous(headers: Any, session_header: str) -> None:
    """ClientError for a request whose session header, or ``X-Session-End``, is sent twice with different values
    (which one the client meant is not the gateway's guess); 415 for a body in a content coding (the gateway reads
    the body it relays: the session, the estimate and the budget go by it)."""
    for name in (session_header, SESSION_END_HEADER):
        values = headers.getall(name, ())
        if len(values) > 1 and any(v != values[0] for v in values):
            raise ClientError(f"{name} sent {len(values)} times with different values")
    coding = headers.get("Content-Encoding")
    if coding is not None and coding.strip().lower() not in ("", "identity"):
        raise UnsupportedMediaType(f"a turn's body in Content-Encoding {coding.strip()[:40]!r}: send it uncoded")


def body_key(raw: bytes) -> int:
    """What tells a retry's body from another (a retry resends the same bytes): its length, its first and last
    8 KiB (a whole-body hash would cost O(body) per turn; two turns of one session differ in length or at an end)."""
    n = len(raw)
    return hash((n, raw[:8192], raw[-8192:])) if n > 16384 else hash(raw)


def _not_started() -> float:
    raise RuntimeError("the gateway has not started")


SIDE_BEFORE_TURNS = 2
"""The most side requests a session's first turn is found to come after (a title, a classifier call)."""
SIDE_MAX_ITEMS = 4
"""The most items a side request's conversation has (a title or classifier call: an instruction and the text)."""


def side_split(sessions: Sessions, res: Resolution, body: dict[str, Any], api: Api,
               client: int | None, tools: bool) -> tuple[Any, Resolution]:
    """``(the id it was sent under, a one-turn session of its own)`` for a side request, else ``(None, res)``."""
    if res.named is not None and not tools and is_side_request(sessions, res, body, api):
        return res.sid, Resolution(sessions.anonymous_id(), client)
    return None, res


def sides(sessions: Sessions, s: GwSession, res: Resolution, side_of: Any, tools: bool) -> None:
    """Count a side request on the session it was sent under; count the turns that came before a session's first
    turn as side requests (:func:`came_first`) and start it over; note that a named session's turns offer tools."""
    if side_of is not None:
        got = sessions.by_id.get(side_of)
        sessions.side_requests += 1
        if got is not None:
            got.lin.sided(1, False)
        return
    if res.named is None:
        return
    if tools and came_first(s, res):
        sessions.side_requests += s.est.turns
        s.lin.sided(s.est.turns, False)
        restart(s)  # the session's first turn is this one
    if tools:
        s.lin.sided(0, True)


async def session_engine_count(sessions: Sessions, s: GwSession, body: dict[str, Any], api: Api) -> int | None:
    """A start-over's prompt as the session's engine counts it (a new session in a fleet, not placed yet: the first
    replica up, as the replicas serve one model; a character estimate would miss the template and the tokenizer,
    and the placement and the budget go by this count); None where it cannot."""
    fleet = sessions.fleet
    rep = s.replica
    if rep is None:
        rep = fleet.replicas[0] if fleet.single else next((r for r in fleet.replicas if r.up), None)
    return await engine_count(None if rep is None else rep.relay, body, api, s.name.client)


def offers_tools(body: dict[str, Any]) -> bool:
    tools = body.get("tools")
    return type(tools) is list and len(tools) > 0


def is_side_request(sessions: Sessions, res: Resolution, body: dict[str, Any], api: Api) -> bool:
    """Whether a request under a named session's id is a side request: a short conversation (at most
    :data:`SIDE_MAX_ITEMS` items) that offers no tools, under the id of a session whose turns offer them and whose
    conversation it does not continue (it shares none of its items). Served as a one-turn session of its own and
    counted on the session: never one of its turns, a rewrite or a prefix break. One that comes before the
    session's first turn is served as its turn, then counted as a side request when that turn comes
    (:func:`came_first`)."""
    if not api.chat_like or res.named is None or res.probe is None:  # (the caller saw that it offers no tools)
        return False
    p = res.probe
    if p.n > SIDE_MAX_ITEMS:
        return False
    s = sessions.by_id.get(res.sid)
    if s is None or not s.lin.offers_tools or s.lin.trail is None:  # (its first turn, even in flight, has set both)
        return False  # (one that comes before the session's first turn is told by that turn: came_first)
    return p.root != s.lin.trail.root


def came_first(s: GwSession, res: Resolution) -> bool:
    """Whether the session's turns so far were side requests that came before its first turn (Claude Code's and
    opencode's title request), of a request that offers tools (the caller's check): the session's turns offered
    none, were short and this one shares none of their items."""
    t, p = s.lin.trail, res.probe
    if s.lin.offers_tools or not s.est.turns or t is None or p is None or t.n == 0:
        return False
    return s.est.turns <= SIDE_BEFORE_TURNS and t.n <= SIDE_MAX_ITEMS and p.root != t.root


def restart(s: GwSession) -> None:
    """Forget what the session's side requests left of a history: its next turn is its first."""
    s.est.restart()
    s.lin.restart()


TOKENIZE_TIMEOUT_S = 2.0
"""How long a start-over's ``/tokenize`` ask may take before the character estimate stands."""


async def engine_count(relay: UpstreamRelay | None, body: dict[str, Any], api: Api, client: int | None = None
                       ) -> int | None:
    """The prompt tokens the engine behind ``relay`` counts for ``body`` (vLLM's ``/tokenize``); None when it does
    not answer it (the relay stops asking after a 404 or 405), fails or takes too long. A count is kept by the ask's
    digest and the client key (:attr:`UpstreamRelay.counts`): a conversation sent again (a retry, a regenerate) is
    counted without asking, and never from what another key sent (how fast an answer comes must not tell one
    tenant what another has sent)."""
    if relay is None or relay.client is None or not relay.tokenizes:
        return None
    keyed = (keyed_tokenize_ask(api, body) if not isinstance(api, ReadApi)
             else await off_loop(api, keyed_tokenize_ask, api, body))
    if keyed is None:
        return None
    ask, digest = keyed
    counts, key = relay.counts, (client, digest)
    known = counts.pop(key, None)
    if known is not None:
        counts[key] = known  # (most recently used last)
        return known
    try:
        status, data = await asyncio.wait_for(relay.post("/tokenize", ask), TOKENIZE_TIMEOUT_S)
        if status in (404, 405):
            relay.tokenizes = False
        got = loads(data).get("count") if status == 200 else None
    except Exception as e:  # unreachable, timed out, not JSON: the character estimate stands
        log.debug("tokenize failed", extra={"event": "tokenize", "detail": str(e)[:200]})
        return None
    if type(got) is not int or got <= 0:
        return None
    counts[key] = got
    if len(counts) > COUNTS_KEPT:
        del counts[next(iter(counts))]
    return got


def _estimate(s: GwSession, body: dict[str, Any], api: Api, fresh: bool) -> tuple[int, str, int, bool]:
    """The turn's context, how it was told, the tokens sent and whether it starts over (:func:`estimate_turn`); the
    session's last context if the estimator fails (it is defensive; a bug there must not fail the turn)."""
    try:
        return estimate_turn(s.est, body, api, fresh)
    except Exception:
        log.exception("context estimate failed", extra={"event": "estimate_error"})
        return s.est.context, "", 0, False
