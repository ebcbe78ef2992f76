"""One request through Envoy, between the ext_proc stream that carries it and the gateway's turn path.

The turn path (:class:`kvgate.gateway.turns.TurnPath`) is the gateway's, unchanged: it resolves the session, asks
the policy, holds the turn while the policy says so and places it. Where the gateway would then forward the turn
to its replica, :class:`PickedRelay` hands the pick to the stream instead (:attr:`Exchange.picked`: the endpoint,
the headers to add each way, the body when it changed) and waits for what Envoy reports of the answer
(:attr:`Exchange.answered`, set by the stream from the response's headers and body). The turn's end, its usage
and its failures then go through the same books as the gateway's::

    ext_proc stream ── EnvoyRequest ─▶ TurnPath.turn ─▶ policy (held: the stream extends Envoy's timeout)
         ▲                                 └─ PickedRelay.forward ─▶ Exchange.picked ─▶ stream: pick, headers
         └─ response headers, body ─▶ Exchange.answered ─▶ TurnFinished (usage, cached tokens) / TurnAborted
"""

from __future__ import annotations

import asyncio
import ipaddress
from dataclasses import dataclass
from typing import Any

from multidict import CIMultiDict

from kvgate.errors import UsageError
from kvgate.gateway.config import GatewayConfig
from kvgate.gateway.relay import Forwarded, UpstreamRelay
from kvgate.gateway.stream import UsageScanner, loads
from kvgate.http.dialect import CHAT, Api
from kvgate.http.server import Request, StreamResponse

DESTINATION_HEADER = "x-gateway-destination-endpoint"
"""Where the picker sends the request: ``IP:PORT`` (GAIE endpoint-picker protocol v1), also set in the ``envoy.lb``
dynamic metadata namespace under the same key."""
SERVED_HEADER = "x-gateway-destination-endpoint-served"
"""The endpoint that served the request, as Envoy reports it on the response (``%UPSTREAM_HOST%``)."""
LB_NAMESPACE = "envoy.lb"
ENVOY_CONNECT_ERROR = b"upstream connect error"
"""How Envoy's local reply begins when it could not connect to the picked endpoint."""


@dataclass(slots=True)
class Pick:
    """Where the turn goes and what changes on the way: ``body`` replaces the request's (None: as received)."""

    endpoint: str
    up: list[tuple[str, str]]
    """Headers set upstream."""
    down: list[tuple[str, str]]
    """Headers added to the response."""
    body: bytes | None


class Exchange:
    """What the stream and the turn path share of one request (it also stands in for the HTTP connection the
    turn path's :class:`~kvgate.http.server.Request` would have)."""

    __slots__ = ("picked", "answered", "peer", "reset", "status", "served", "scanner", "chunks", "api", "stream")

    def __init__(self, peer: str | None) -> None:
        loop = asyncio.get_running_loop()
        self.picked: asyncio.Future[Pick] = loop.create_future()
        self.answered: asyncio.Future[Forwarded] = loop.create_future()
        self.peer = (peer, 0) if peer else None
        self.reset = False
        """The turn path closed the client's connection (a retry replaced this streamed attempt)."""
        self.status = 0
        self.served = ""
        self.scanner: UsageScanner | None = None
        self.chunks: list[bytes] = []
        self.api: Api = CHAT
        self.stream = False

    @property
    def transport(self) -> Exchange:
        return self

    def close(self) -> None:
        self.reset = True

    # -- the answer, as Envoy passes it on -------------------------------------------------------------------
    def response_headers(self, status: int, content_type: str, served: str) -> None:
        self.status, self.served = status, served
        if self.stream and status == 200 and content_type.startswith("text/event-stream"):
            pick = self.picked.result() if self.picked.done() else None
            self.scanner = UsageScanner(drop_usage_only=pick is not None and pick.body is not None, api=self.api)

    def response_body(self, chunk: bytes, end: bool) -> bytes | None:
        """A chunk of the answer: what replaces it (None: relayed as it is); the answer is told at ``end``."""
        out: bytes | None = None
        sc = self.scanner
        if sc is not None:
            got = sc.feed(chunk) if chunk else b""
            if end:
                got += sc.flush()
            out = None if got == chunk else got
        elif chunk:
            self.chunks.append(chunk)
        if end:
            self.finish()
        return out

    def finish(self) -> None:
        """The answer ended (the response's last body message, or headers that end it)."""
        if self.answered.done():
            return
        status, sc = self.status, self.scanner
        resp = StreamResponse(status=status)  # (Envoy has answered the client: the turn path must not retry it)
        if sc is not None:
            self.answered.set_result((resp, sc.usage, None, sc.event))
            return
        if status >= 500:  # Envoy's own 503 for an engine it could not reach: a connect failure (marks it down)
            connect = status == 503 and b"".join(self.chunks).startswith(ENVOY_CONNECT_ERROR)
            self.answered.set_result((resp, None, "connect" if connect else "http_5xx", None))
            return
        if status >= 300:
            self.answered.set_result((resp, None, "http_4xx" if status >= 400 else "http_other", None))
            return
        data = b"".join(self.chunks)
        self.chunks = []
        obj = usage = None
        if b'"usage"' in data:
            try:
                obj = loads(data)
            except ValueError:
                obj = None
            u = obj.get("usage") if type(obj) is dict else None
            usage = u if type(u) is dict else None
        self.answered.set_result((resp, usage, None, obj))


class EnvoyRequest(Request):
    """A turn as Envoy passed it to the picker (its headers and whole body), carrying its :class:`Exchange`."""

    __slots__ = ("exchange",)

    def __init__(self, method: str, path: str, headers: CIMultiDict[str], body: bytes, exchange: Exchange) -> None:
        super().__init__(method, path, headers, "1.1", exchange)
        self.body = body
        self.exchange = exchange


class PickedRelay(UpstreamRelay):
    """A replica as the picker sees it: its turns are picked for Envoy to send (:meth:`forward`); pool reads,
    health checks and ``/tokenize`` go to it directly, as the gateway's do."""

    def __init__(self, cfg: GatewayConfig, *, client_keys: bool, url: str | None = None, **kw: Any) -> None:
        super().__init__(cfg, client_keys=client_keys, url=url, **kw)
        host, port = self.base.host or "", self.base.explicit_port or self.base.port
        try:
            ip = ipaddress.ip_address(host.strip("[]"))
        except ValueError:
            raise UsageError(f"kvgate epp: --upstream {self.base_str}: Envoy's original-destination cluster needs "
                             "an IP address, not a host name") from None
        self.endpoint = f"[{ip}]:{port}" if ip.version == 6 else f"{ip}:{port}"
        """``IP:PORT``, as the destination header says it."""
        self._client_keys = client_keys

    async def forward(
        self, request: Request, raw: bytes, stream: bool, inject: bool, extra: list[tuple[str, str]],
        api: Api = CHAT, up: list[tuple[str, str]] | None = None, marks: list[int] | None = None,
    ) -> Forwarded:
        """Hand the turn to Envoy (the picked endpoint and headers) and wait for its answer. ``marks`` stay unset:
        a turn's time to first token is Envoy's to see, so its trace has no ttft and decode spans."""
        assert isinstance(request, EnvoyRequest)
        ex = request.exchange
        ex.api, ex.stream = api, stream
        headers = list(up or ())
        if self._auth:
            headers.append(("authorization", self._auth))
        if ex.picked.done():  # the turn path retries a turn Envoy has answered already: that answer stands
            return ex.answered.result()[0], None, "http_5xx", None
        ex.picked.set_result(Pick(self.endpoint, headers, extra, raw if inject else None))
        return await ex.answered

    @property
    def drops_authorization(self) -> bool:
        """Whether the client's ``Authorization`` is not to reach the engine (the picker checks keys, or sends its
        own)."""
        return self._client_keys or self._auth is not None
