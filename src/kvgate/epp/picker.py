"""``kvgate epp``: the gateway's policy core as the endpoint picker of an Envoy (Gateway API Inference Extension).

A :class:`Picker` is a :class:`kvgate.gateway.app.Gateway` — the same identity, lineage, policy, placement, books
and store, its HTTP side (``/metrics``, ``/kvgate/info``, ``/v1/sessions``, ``/dashboard``, ``/admin/*``, with the
gateway's auth rules) — whose turns arrive over Envoy's ext_proc stream (:mod:`kvgate.epp.server`) instead of its
HTTP port, and whose replicas' relays hand each turn to Envoy to send (:class:`kvgate.epp.exchange.PickedRelay`).
A gRPC health service answers for liveness, readiness and the ext_proc service. See docs/envoy.md.
"""

from __future__ import annotations

import logging
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvgate.epp.exchange import EnvoyRequest, Exchange, PickedRelay
from kvgate.epp.server import Processor
from kvgate.errors import PolicyRefusal
from kvgate.gateway.app import Gateway
from kvgate.gateway.config import GatewayConfig
from kvgate.gateway.sessions import GwSession
from kvgate.gateway.turns import ShuttingDown, TurnPath
from kvgate.http.dialect import APIS, Api
from kvgate.http.server import Request, Response, StreamResponse, error_response, exc_response

log = logging.getLogger("kvgate.epp")

EXT_PROC_SERVICE = "envoy.service.ext_proc.v3.ExternalProcessor"
HEALTH_SERVICES = ("", "liveness", "readiness", EXT_PROC_SERVICE)
MAX_MESSAGE_TIMEOUT_S = 3600
"""The longest message timeout Envoy accepts (``max_message_timeout``); a longer hold re-extends it."""
HOLDS = ("always", "never")


def extend_s(cfg: GatewayConfig) -> int:
    """What the picker extends Envoy's message timeout to while a turn is held (real seconds): past the longest
    hold (``--max-park-s``) with a margin, at most :data:`MAX_MESSAGE_TIMEOUT_S` (re-extended every half of it)."""
    if cfg.max_park_s is None:
        return MAX_MESSAGE_TIMEOUT_S
    return int(min(MAX_MESSAGE_TIMEOUT_S, max(10.0, cfg.max_park_s / cfg.time_scale + 10.0)))


class HoldRefused(PolicyRefusal):
    """The policy would hold the turn, and this picker does not hold turns (``kvgate epp --hold never``)."""

    http_status = 429


class PickerPath(TurnPath):
    """The gateway's turn path; with ``hold_never`` a turn the policy would hold is refused at once (429 with
    Retry-After) instead, for hosts whose Envoy cannot wait on the picker."""

    hold_never = False

    async def _hold(self, s: GwSession, t_req: float) -> Response | None:
        if not self.hold_never:
            return await super()._hold(s, t_req)
        self.calls.abandon(s, "refused", self._now())
        refusal = HoldRefused("the KV budget is full and this picker does not hold turns; retry later")
        return exc_response(refusal, {"Retry-After": self._retry_after})


class Picker(Gateway):
    """The endpoint picker: ``await start(host, port)`` (HTTP side) also serves ext_proc on ``grpc_port``."""

    relay_class = PickedRelay
    path_class = PickerPath

    def __init__(self, cfg: GatewayConfig, grpc_port: int, hold: str = "always") -> None:
        super().__init__(cfg)
        for api in APIS.values():  # (turns come through Envoy)
            self._routes.pop(("POST", api.path), None)
        assert isinstance(self._path, PickerPath)
        self._path.hold_never = hold == "never"
        self.hold = hold
        self.grpc_port = grpc_port
        self.extend_s = extend_s(cfg)
        self.streams = 0
        """ext_proc streams open now (requests Envoy is passing through the picker)."""
        self.served_elsewhere = 0
        """Turns Envoy reports served by another endpoint than the one picked (its retries)."""
        self._grpc: Any = None
        self._grpc_health = health.aio.HealthServicer()

    @property
    def drops_authorization(self) -> bool:
        rep = self.fleet.replicas[0].relay
        return bool(rep.drops_authorization)

    def turn(self, request: EnvoyRequest, api: Api) -> Any:
        """The gateway's turn path for a request Envoy passed on (a coroutine of its response)."""
        return self._path.turn(request, api)

    def served(self, ex: Exchange) -> None:
        if ex.served and ex.picked.done() and ex.served != ex.picked.result().endpoint:
            self.served_elsewhere += 1

    async def start(self, host: str = "127.0.0.1", port: int = 8000) -> int:
        got = await super().start(host, port)
        try:
            server = grpc.aio.server(options=[("grpc.max_receive_message_length", self.cfg.max_body_bytes + (1 << 20)),
                                              ("grpc.max_send_message_length", self.cfg.max_body_bytes + (1 << 20))])
            from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc

            pb_grpc.add_ExternalProcessorServicer_to_server(Processor(self), server)
            health_pb2_grpc.add_HealthServicer_to_server(self._grpc_health, server)
            wanted = self.grpc_port
            try:
                self.grpc_port = server.add_insecure_port(f"{host}:{wanted}")
            except RuntimeError as e:  # (grpc's "Failed to bind": the port in use, or the address not this host's)
                raise OSError(f"gRPC port {wanted}: in use, or not an address of this host ({str(e).split(';')[0]})"
                              ) from None
            if not self.grpc_port:
                raise OSError(f"cannot listen on {host}:{wanted} for gRPC")
            await server.start()
        except BaseException:
            await super().stop()
            raise
        self._grpc = server
        for name in HEALTH_SERVICES:
            await self._grpc_health.set(name, health_pb2.HealthCheckResponse.SERVING)
        log.info("endpoint picker listening", extra={"event": "epp_start", "grpc_port": self.grpc_port,
                                                      "port": got, "hold": self.hold})
        return got

    async def stop(self) -> None:
        """Answer held turns 503, let Envoy's streams finish within ``--shutdown-grace``, then stop the gateway."""
        if self._grpc is not None:
            for name in HEALTH_SERVICES:
                await self._grpc_health.set(name, health_pb2.HealthCheckResponse.NOT_SERVING)
            self._path.stopping = True
            for fut in self._sessions.held_futures():
                fut.set_exception(ShuttingDown("the endpoint picker is shutting down"))
            server, self._grpc = self._grpc, None
            await server.stop(self.cfg.shutdown_grace_s)
        await super().stop()

    async def _passthrough(self, request: Request) -> StreamResponse:
        """The HTTP side serves the picker's own endpoints only (turns come through Envoy)."""
        return error_response(404, f"no such endpoint on the picker: {request.method} {request.path}", "NotFound")

    def info(self) -> dict[str, Any]:
        """``GET /kvgate/info``: the gateway's, and the picker's ext_proc side."""
        epp = {"grpc_port": self.grpc_port, "hold": self.hold, "streams": self.streams, "extend_s": self.extend_s,
               "served_elsewhere": self.served_elsewhere}
        return {**super().info(), "epp": epp}
