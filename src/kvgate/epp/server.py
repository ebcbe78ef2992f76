"""The picker's ext_proc server: Envoy's external-processing stream of one request, message by message.

Per request (one gRPC stream, Envoy's ``ExternalProcessor.Process``)::

    request_headers ─▶ a turn (POST to a turn path)? ── no ─▶ the first replica up, at once
         │ yes (buffered: answered at once; full-duplex: answered with the pick)
    request_body … end ─▶ TurnPath.turn ─┬─ refused ─▶ ImmediateResponse (status, Retry-After, JSON body)
                                         ├─ held ─────▶ override_message_timeout, again every half of it
                                         └─ placed ───▶ destination header + envoy.lb metadata (+ body, headers)
    response_headers ─▶ status, served endpoint; the turn's headers added
    response_body … end ─▶ usage read (SSE events framed as they pass), the turn's end told to the books

The stream ending before the answer did (the client went away, held or in flight) cancels the turn, as the
gateway's HTTP server cancels a handler whose client left: a held turn leaves the policy, one in flight is aborted.
Body modes: ``BUFFERED`` or ``FULL_DUPLEX_STREAMED`` for the request (Envoy tells which in the stream's first
message), ``STREAMED`` or ``FULL_DUPLEX_STREAMED`` for the response.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any, Protocol

from envoy.config.core.v3 import base_pb2
from envoy.extensions.filters.http.ext_proc.v3 import processing_mode_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from envoy.service.ext_proc.v3 import external_processor_pb2_grpc as pb_grpc
from google.protobuf import duration_pb2, struct_pb2
from multidict import CIMultiDict

from kvgate.epp.exchange import DESTINATION_HEADER, LB_NAMESPACE, SERVED_HEADER, EnvoyRequest, Exchange, Pick
from kvgate.gateway.placement import NoReplicaUp
from kvgate.http.dialect import api_for_path
from kvgate.http.openai import GATEWAY_INFO_PATH
from kvgate.http.server import Response, error_response, exc_response, json_response

log = logging.getLogger("kvgate.epp")

FULL_DUPLEX = processing_mode_pb2.ProcessingMode.FULL_DUPLEX_STREAMED
FIRST_EXTEND_S = 1.0
"""How long a turn waits before the picker first extends Envoy's message timeout (below any sane message_timeout)."""


class Picker(Protocol):
    """What the stream needs of the picker (:class:`kvgate.epp.picker.Picker`)."""

    fleet: Any
    extend_s: int
    streams: int

    @property
    def drops_authorization(self) -> bool: ...

    def turn(self, request: EnvoyRequest, api: Any) -> Any: ...

    def served(self, ex: Exchange) -> None: ...

    def info(self) -> dict[str, Any]: ...


def header_mutation(set_: list[tuple[str, str]], remove: tuple[str, ...] = ()) -> pb.HeaderMutation:
    return pb.HeaderMutation(
        set_headers=[base_pb2.HeaderValueOption(
            header=base_pb2.HeaderValue(key=k.lower(), raw_value=v.encode()),
            append_action=base_pb2.HeaderValueOption.OVERWRITE_IF_EXISTS_OR_ADD) for k, v in set_],
        remove_headers=list(remove))


def destination(endpoint: str) -> struct_pb2.Struct:
    """The ``envoy.lb`` dynamic metadata naming the endpoint (GAIE endpoint-picker protocol)."""
    md = struct_pb2.Struct()
    md.update({LB_NAMESPACE: {DESTINATION_HEADER: endpoint}})
    return md


def immediate(resp: Response) -> pb.ProcessingResponse:
    """A refusal (or any answer of the turn path's own) as Envoy's local reply."""
    skip = {"content-length", "transfer-encoding", "connection"}
    headers = [(k, v) for k, v in resp.headers if k.lower() not in skip]
    return pb.ProcessingResponse(immediate_response=pb.ImmediateResponse(
        status={"code": resp.status}, headers=header_mutation(headers), body=resp.body))


def _headers_of(msg: pb.HttpHeaders) -> tuple[dict[str, str], CIMultiDict[str]]:
    pseudo: dict[str, str] = {}
    out: CIMultiDict[str] = CIMultiDict()
    for h in msg.headers.headers:
        v = h.raw_value.decode("latin-1") if h.raw_value else h.value
        if h.key.startswith(":"):
            pseudo[h.key] = v
        else:
            out.add(h.key, v)
    return pseudo, out


class Stream:
    """One request's ext_proc stream: :meth:`step` answers each message Envoy sends."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker
        self.ex: Exchange | None = None
        self.task: asyncio.Task[Any] | None = None
        self.body: list[bytes] = []
        self.turn = False
        self.duplex_req = self.duplex_resp = False
        self.head: tuple[dict[str, str], CIMultiDict[str]] = ({}, CIMultiDict())

    async def step(self, msg: pb.ProcessingRequest) -> AsyncIterator[pb.ProcessingResponse]:
        if msg.HasField("protocol_config"):
            pc = msg.protocol_config
            self.duplex_req = pc.request_body_mode == FULL_DUPLEX
            self.duplex_resp = pc.response_body_mode == FULL_DUPLEX
        kind = msg.WhichOneof("request")
        if kind == "request_headers":
            async for out in self._request_headers(msg.request_headers):
                yield out
        elif kind == "request_body":
            self.body.append(msg.request_body.body)
            if msg.request_body.end_of_stream:
                async for out in self._decide():
                    yield out
        elif kind == "response_headers":
            yield self._response_headers(msg.response_headers)
        elif kind == "response_body":
            yield self._response_body(msg.response_body)
        elif kind == "request_trailers":  # (a body that ended with trailers: the turn is decided now)
            if self.turn and self.task is None:
                async for out in self._decide():
                    yield out
                if self.ex is None or not self.ex.picked.done():
                    return  # (answered with an immediate response)
            yield pb.ProcessingResponse(request_trailers=pb.TrailersResponse())
        elif kind == "response_trailers":
            if self.ex is not None:
                self.ex.finish()
            yield pb.ProcessingResponse(response_trailers=pb.TrailersResponse())

    async def _request_headers(self, msg: pb.HttpHeaders) -> AsyncIterator[pb.ProcessingResponse]:
        self.head = pseudo, _ = _headers_of(msg)
        method, path = pseudo.get(":method", "GET"), pseudo.get(":path", "/")
        self.turn = method == "POST" and api_for_path(path.partition("?")[0]) is not None
        if self.turn and not msg.end_of_stream:
            if not self.duplex_req:  # (full duplex: the headers are answered with the pick)
                yield pb.ProcessingResponse(request_headers=pb.HeadersResponse())
            return
        if self.turn:  # a turn without a body: the turn path answers it (400)
            async for out in self._decide():
                yield out
            return
        if method == "GET" and path.partition("?")[0] == GATEWAY_INFO_PATH:  # (what drivers ask a kvgate front)
            yield immediate(json_response(self.picker.info()))
            return
        rep = next((r for r in self.picker.fleet.replicas if r.up), None)
        if rep is None:
            yield immediate(exc_response(NoReplicaUp("no upstream replica is up"), {"Retry-After": "1"}))
            return
        endpoint = rep.relay.endpoint
        yield pb.ProcessingResponse(
            request_headers=pb.HeadersResponse(response=pb.CommonResponse(
                header_mutation=header_mutation([(DESTINATION_HEADER, endpoint)]))),
            dynamic_metadata=destination(endpoint))

    async def _decide(self) -> AsyncIterator[pb.ProcessingResponse]:
        """Run the turn through the gateway's path; extend Envoy's timeout while it is held; answer with the pick
        or the refusal."""
        pseudo, headers = self.head
        raw = b"".join(self.body)
        self.body = []
        self.ex = ex = Exchange(headers.get("x-forwarded-for", "").split(",")[0].strip() or None)
        path = pseudo.get(":path", "/")
        api = api_for_path(path.partition("?")[0])
        assert api is not None
        request = EnvoyRequest("POST", path, headers, raw, ex)
        self.task = task = asyncio.get_running_loop().create_task(self.picker.turn(request, api))
        wait, extend = FIRST_EXTEND_S, self.picker.extend_s
        while not ex.picked.done() and not task.done():
            await asyncio.wait((ex.picked, task), timeout=wait, return_when=asyncio.FIRST_COMPLETED)
            if not ex.picked.done() and not task.done():
                yield pb.ProcessingResponse(override_message_timeout=duration_pb2.Duration(seconds=int(extend)))
                wait = extend / 2
        if not ex.picked.done():
            try:
                resp = task.result()
            except Exception:
                log.exception("turn failed", extra={"event": "turn_error"})
                resp = error_response(500, "the picker failed on this request", "InternalError")
            yield immediate(resp)
            return
        for out in self._picked(ex.picked.result(), raw):
            yield out

    def _picked(self, pick: Pick, raw: bytes) -> list[pb.ProcessingResponse]:
        sets = [(DESTINATION_HEADER, pick.endpoint), *pick.up]
        body = pick.body
        if body is not None or self.duplex_req:
            sets.append(("content-length", str(len(raw if body is None else body))))
        remove = ("authorization",) if self.picker.drops_authorization and not any(
            k.lower() == "authorization" for k, _ in pick.up) else ()
        mutation = header_mutation(sets, remove)
        md = destination(pick.endpoint)
        if self.duplex_req:
            streamed = pb.StreamedBodyResponse(body=raw if body is None else body, end_of_stream=True)
            return [
                pb.ProcessingResponse(request_headers=pb.HeadersResponse(
                    response=pb.CommonResponse(header_mutation=mutation)), dynamic_metadata=md),
                pb.ProcessingResponse(request_body=pb.BodyResponse(response=pb.CommonResponse(
                    body_mutation=pb.BodyMutation(streamed_response=streamed)))),
            ]
        common = pb.CommonResponse(header_mutation=mutation)
        if body is not None:
            common.body_mutation.body = body
        return [pb.ProcessingResponse(request_body=pb.BodyResponse(response=common), dynamic_metadata=md)]

    def _response_headers(self, msg: pb.HttpHeaders) -> pb.ProcessingResponse:
        ex = self.ex
        if ex is None or not ex.picked.done():  # (not a turn: relayed as it is)
            return pb.ProcessingResponse(response_headers=pb.HeadersResponse())
        pseudo, headers = _headers_of(msg)
        try:
            status = int(pseudo.get(":status", "0"))
        except ValueError:
            status = 0
        ex.response_headers(status, headers.get("content-type", ""), headers.get(SERVED_HEADER, ""))
        self.picker.served(ex)
        common = pb.CommonResponse(header_mutation=header_mutation(ex.picked.result().down))
        if msg.end_of_stream:
            ex.finish()
        return pb.ProcessingResponse(response_headers=pb.HeadersResponse(response=common))

    def _response_body(self, msg: pb.HttpBody) -> pb.ProcessingResponse:
        ex = self.ex
        out = None
        if ex is not None and ex.picked.done():
            out = ex.response_body(msg.body, msg.end_of_stream)
        if self.duplex_resp:
            streamed = pb.StreamedBodyResponse(body=msg.body if out is None else out, end_of_stream=msg.end_of_stream)
            return pb.ProcessingResponse(response_body=pb.BodyResponse(response=pb.CommonResponse(
                body_mutation=pb.BodyMutation(streamed_response=streamed))))
        common = pb.CommonResponse()
        if out is not None:
            common.body_mutation.body = out
        return pb.ProcessingResponse(response_body=pb.BodyResponse(response=common))

    def close(self) -> None:
        """The stream ended: a turn whose answer did not end with it lost its client."""
        task, ex = self.task, self.ex
        if task is not None and not task.done() and (ex is None or not ex.answered.done()):
            task.cancel()


class Processor(pb_grpc.ExternalProcessorServicer):
    """Envoy's ``ExternalProcessor`` service over a :class:`~kvgate.epp.picker.Picker`."""

    def __init__(self, picker: Picker) -> None:
        self.picker = picker

    async def Process(  # noqa: N802 (the gRPC method's name)
        self, request_iterator: AsyncIterator[pb.ProcessingRequest], context: Any
    ) -> AsyncIterator[pb.ProcessingResponse]:
        st = Stream(self.picker)
        self.picker.streams += 1
        try:
            async for msg in request_iterator:
                async for out in st.step(msg):
                    yield out
        finally:
            self.picker.streams -= 1
            st.close()
