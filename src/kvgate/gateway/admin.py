"""The gateway's own endpoints: what it is (``/kvgate/info``), its metrics, its sessions, its control, and the
live dashboard. The admin ones (``/v1/sessions``, ``/admin/control``, the dashboard, and the engine's admin paths
relayed through :meth:`AdminRoutes.passthrough_refusal`) answer the ``--admin-token`` (required with client keys),
or without one loopback clients whose request carries no foreign ``Origin`` (:mod:`kvgate.gateway.auth`);
``DELETE /v1/sessions/{id}`` answers the gateway's clients (``--api-key``), since an agent ends its own session
with it. See docs/security.md."""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import Any

from prometheus_client import CollectorRegistry

from kvgate import __version__
from kvgate.errors import ClientError, KvgateError
from kvgate.gateway.auth import (
    ENGINE_ADMIN_PATHS,
    Origins,
    admin_check,
    client_key,
    client_path,
    has_admin_token,
    json_only,
    unauthorized,
)
from kvgate.gateway.config import GatewayConfig
from kvgate.gateway.dashboard import PAGE, park_waits, tenant_rows
from kvgate.gateway.fleet import Fleet
from kvgate.gateway.health import describe, live_tasks
from kvgate.gateway.identity import scoped
from kvgate.gateway.listing import session_row
from kvgate.gateway.metrics import GatewayView
from kvgate.gateway.sessions import GwSession, Sessions
from kvgate.gateway.stream import loads
from kvgate.gateway.tenants import policy_stats
from kvgate.http.openai import GATEWAY_INFO_PATH
from kvgate.http.prometheus import exposition
from kvgate.http.server import Request, Response, StreamResponse, error_response, exc_response, json_response
from kvgate.policy import parse_control

REPLICA_FIELDS = ("replica", "up", "kv_pool", "demand_tokens", "admitted", "parked", "in_flight")
"""What the dashboard shows of each replica."""
Handler = Callable[[Request], Awaitable[StreamResponse]]
Routes = dict[tuple[str, str], Handler]


def kv_events_state(fleet: Fleet) -> list[dict[str, Any]]:
    """What the KV-event consumers see, one entry per followed replica (none without ``--kv-events``)."""
    return [{"replica": r.url, **r.events.stats()} for r in fleet.replicas if r.events is not None]


class NotFound(ClientError):
    http_status = 404


class AdminRoutes:
    """The handlers of the gateway's own endpoints (:meth:`routes`), and :meth:`delete_session`."""

    def __init__(self, gw: GatewayView, sessions: Sessions, cfg: GatewayConfig, registry: CollectorRegistry) -> None:
        self.gw = gw
        self.sessions = sessions
        self.registry = registry
        self._token = cfg.admin_token
        self._keys = tuple(k.encode() for k in cfg.api_keys)
        self.origins = Origins(0, "", cfg.allowed_hosts)
        """The gateway's own names and origins (set again with its port once it listens)."""

    def routes(self) -> Routes:
        """Exact ``(method, path)`` routes."""
        guard = self._guard
        return {
            ("GET", "/metrics"): self.metrics,
            ("GET", GATEWAY_INFO_PATH): self.info,
            ("GET", "/v1/sessions"): guard(self.list_sessions),
            ("GET", "/admin/control"): guard(self.get_control),
            ("POST", "/admin/control"): guard(self.post_control, changes=True),
            ("GET", "/dashboard"): guard(self.dashboard, query_token=True),
            ("GET", "/kvgate/dashboard.json"): guard(self.dashboard_json, query_token=True),
        }

    def _guard(self, handler: Handler, query_token: bool = False, changes: bool = False) -> Handler:
        """``handler`` for admin clients only (others get 401 or 403); a call that ``changes`` state takes only
        a JSON body (415: what a cross-site "simple" POST cannot send)."""

        async def guarded(request: Request) -> StreamResponse:
            try:
                self.admin_check(request, query_token)
                if changes:
                    json_only(request)
            except KvgateError as e:
                return exc_response(e)
            return await handler(request)

        return guarded

    def admin_check(self, request: Request, query_token: bool = False) -> None:
        """Raise unless the request may use the admin endpoints (:func:`kvgate.gateway.auth.admin_check`)."""
        admin_check(self._token, request, query_token, self.origins)

    async def misdirected(self, request: Request) -> StreamResponse:
        """421 for a request whose ``Host`` is not one of the gateway's names (the caller checked it)."""
        return exc_response(self.origins.misdirected(request))

    def passthrough_refusal(self, request: Request) -> Response | None:
        """Why a path the gateway does not serve is not relayed, or None. A client key reaches only what agents ask
        (:data:`~kvgate.gateway.auth.CLIENT_PATHS`; ``/health`` needs none); the rest is the admin's: the engine's
        admin paths 401 without the admin token, anything else 404. Without keys the non-client paths are the
        admin's too (loopback, no foreign Origin)."""
        if not client_path(request):
            try:
                self.admin_check(request)
            except KvgateError as e:
                if self._keys and request.path not in ENGINE_ADMIN_PATHS:
                    return exc_response(NotFound(f"no such path {request.path[:200]!r}"))
                return exc_response(e)
        elif self._keys and request.path != "/health" and client_key(self._keys, request) is None:
            return exc_response(unauthorized())
        return None

    # -- what the gateway is -------------------------------------------------------------------------------
    def info_state(self) -> dict[str, Any]:
        """``GET /kvgate/info``: what this gateway is, its control and counters, and its upstream (O(1))."""
        gw = self.gw
        policy = gw.fleet
        out = {
            "kvgate": "gateway",
            "version": __version__,
            **gw.control_state(),
            "parks": policy.parks,
            "readmissions": policy.readmissions,
            "waits": policy.waits,
            "turns": dict(gw.turns),
            "replaced_attempts": gw.replaced_attempts,
            "sessions": gw.summary(),
            "resolution": gw.sessions_state(),
            "upstream": {"url": gw.upstream_url, **gw.upstream_info.record()},
        }
        if not policy.single:  # a fleet: its router and every replica
            out["router"] = policy.router.name
            out["replicas"] = describe(gw.fleet)
            out["retried_turns"] = gw.retried
            out["sessions_replaced"] = policy.replacements
            out["tasks"] = live_tasks()
        kv = kv_events_state(gw.fleet)
        if kv:
            out["kv_events"] = kv
        return out

    async def info(self, request: Request) -> StreamResponse:
        return json_response(self.gw.info())  # (kvgate epp adds its own)

    async def metrics(self, request: Request) -> StreamResponse:
        body, content_type = exposition(self.registry)
        return Response(body=body, headers={"Content-Type": content_type})

    # -- the dashboard -------------------------------------------------------------------------------------
    def dashboard_state(self) -> dict[str, Any]:
        """``GET /kvgate/dashboard.json``: what the live page shows (O(1), but the tenant rows: O(tenants))."""
        gw = self.gw
        policy = gw.fleet
        pw = gw.park_wait
        return {
            "now_s": round(gw.now(), 3),
            "time_scale": gw.time_scale,
            "control": policy.control.spec(),
            "upstream": gw.upstream_url,
            "sessions": gw.summary(),
            "parks": policy.parks,
            "readmissions": policy.readmissions,
            "waits": policy.waits,
            "park_waits": park_waits(pw.bounds, pw.counts, pw.total),
            "turns": dict(gw.turns),
            "replaced_attempts": gw.replaced_attempts,
            "upstream_errors": sum(gw.upstream_errors.values()),
            "replicas": [{k: r[k] for k in REPLICA_FIELDS} for r in describe(gw.fleet)],
            "tenants": [] if gw.tenant_book is None else tenant_rows(gw.tenant_book, policy_stats(gw.fleet), gw.now()),
            "shared": gw.sessions_state().get("shared"),  # (--store redis://: the instances and the store)
        }

    async def dashboard(self, request: Request) -> StreamResponse:
        return Response(body=PAGE.encode(), content_type="text/html; charset=utf-8",
                        headers={"Cache-Control": "no-store"})

    async def dashboard_json(self, request: Request) -> StreamResponse:
        return json_response(self.dashboard_state())

    # -- the control ------------------------------------------------------------------------------------
    async def get_control(self, request: Request) -> StreamResponse:
        return json_response(self.gw.control_state())

    async def post_control(self, request: Request) -> StreamResponse:
        """``{"control": NAME or SPEC, "opts": {...}}``: switch the control now."""
        try:
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
                name, spec_opts = parse_control(name)
                opts = {**spec_opts, **opts}
            self.gw.set_control(name, opts)
        except KvgateError as e:
            return exc_response(e)
        except TypeError as e:
            return error_response(400, str(e), "ClientError")
        return json_response(self.gw.control_state())

    # -- sessions ------------------------------------------------------------------------------------------
    async def list_sessions(self, request: Request) -> StreamResponse:
        gw = self.gw
        now = gw.now()
        sessions = self.sessions
        data = [session_row(s, now) for s in sessions.by_id.values()]  # O(n): an inspection endpoint
        out = {"object": "list", "data": data, "summary": gw.summary(), "control": gw.fleet.control.spec(),
               "resolution": gw.sessions_state()}
        if not gw.fleet.single:  # the books of every replica, taken at the same instant as the sessions
            out["replicas"] = describe(gw.fleet)
        kv = kv_events_state(gw.fleet)
        if kv:
            out["kv_events"] = kv
        return json_response(out)

    async def delete_session(self, request: Request, sid: str) -> StreamResponse:
        """End the session now, or after its turn if one is busy (202). With client keys: the caller's own session
        of that id (a session belongs to the key that opened it), or with the admin token any session by the id
        ``GET /v1/sessions`` lists (``ID@kN``). Without keys: any client, unless its request carries a foreign
        ``Origin``."""
        client = None
        if self._keys:
            if has_admin_token(self._token, request):
                s = self.sessions.by_id.get(sid)
                return self._end(s, sid)
            client = client_key(self._keys, request)
            if client is None:
                return exc_response(unauthorized())
        else:
            try:  # every client is one tenant's: it ends a session, but not from another site's page
                self.origins.origin_check(request)
            except KvgateError as e:
                return exc_response(e)
        return self._end(self.sessions.by_id.get(scoped(sid, client)), sid)

    def _end(self, s: GwSession | None, sid: str) -> StreamResponse:
        if s is None or s.anonymous:
            return exc_response(NotFound(f"no session {sid!r}"))
        if s.slot.busy:
            s.slot.end_when_done()
            return json_response({"id": sid, "ended": False, "end_after_turn": True}, 202)
        self.sessions.end(s, "delete", self.gw.now())
        return json_response({"id": sid, "ended": True})
