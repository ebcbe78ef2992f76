"""Traces of turns (``--otlp-endpoint URL``): the OpenTelemetry SDK, exported over OTLP/HTTP.

A span ``kvgate.turn`` per turn, from the request's arrival to its end, with children: ``kvgate.resolve`` (naming
its session: headers, body fields, lineage, and its context estimate), ``kvgate.held`` (the time the policy held
it; absent when it proceeded at once) and ``kvgate.upstream`` (the call to the engine, one per attempt; its
context is passed upstream as W3C ``traceparent`` so an engine's own spans join the trace). An upstream call that
got an answer has two children: ``kvgate.ttft``, from sending the request to the first token, and
``kvgate.decode``, from the first token to the end of the answer. For a streamed answer the first token is the
first body chunk; an answer in one piece has no token before its body, so its first token is the response's head
(the engine sends it once it has generated everything: ttft is then the whole generation and decode the body's
transfer); ``kvgate.streamed`` tells them apart. Attributes:
``kvgate.session``, ``kvgate.tenant``, ``kvgate.lineage`` (how the session was found), ``kvgate.hold`` (none,
waiting, parked), ``kvgate.cached_tokens``, ``kvgate.prompt_tokens``, ``kvgate.outcome``.

Spans are made from the gateway's clock after the fact where they lie in the past (the resolution and the hold),
live for the upstream call. Export is batched on the SDK's thread; the request path only records.
"""

from __future__ import annotations

import time
from typing import Any

from kvgate.errors import UsageError

TRACEPARENT = "traceparent"
MAX_OPEN = 100_000
"""Turns being traced at once, at most (a turn that left before its end is forgotten past it)."""


class TurnTraces:
    """Spans of turns, keyed by session id (a session has one turn at a time)."""

    def __init__(self, endpoint: str, time_scale: float) -> None:
        try:
            from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
            from opentelemetry.sdk.resources import Resource
            from opentelemetry.sdk.trace import TracerProvider
            from opentelemetry.sdk.trace.export import BatchSpanProcessor
            from opentelemetry.trace import set_span_in_context
            from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
        except ImportError as e:
            raise UsageError(f"--otlp-endpoint needs the OpenTelemetry SDK and OTLP/HTTP exporter (pip install "
                             f"'kvgate[otel]'): {e}") from None
        self.provider = TracerProvider(resource=Resource.create({"service.name": "kvgate-gateway"}))
        self.provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint)))
        self.tracer = self.provider.get_tracer("kvgate.gateway")
        self._ctx = set_span_in_context
        self._prop = TraceContextTextMapPropagator()
        self.time_scale = time_scale
        self.open: dict[Any, list[Any]] = {}
        """sid -> [arrival (ns), turn span or None, upstream span or None, its marks (``marks``) or None]."""

    def _ns(self, gw_now: float, gw_t: float) -> int:
        """The wall-clock time (ns) of gateway time ``gw_t``, ``gw_now`` being now."""
        return time.time_ns() - int((gw_now - gw_t) / self.time_scale * 1e9)

    def arrived(self, sid: Any, t_ns: int) -> None:
        """Session ``sid``'s turn arrived at wall-clock ``t_ns``."""
        if len(self.open) >= MAX_OPEN:
            self.open.clear()
        self.open[sid] = [t_ns, None, None, None]

    def sent(self, s: Any, now: float, t_req: float, hold: str, lineage: str) -> list[tuple[str, str]]:
        """The turn goes upstream (again, on a retry): the upstream span starts; the ``traceparent`` header."""
        got = self.open.get(s.sid)
        if got is None:
            got = self.open[s.sid] = [self._ns(now, t_req), None, None, None]
        t0, turn, up, marks = got
        tracer = self.tracer
        if turn is None:
            turn = got[1] = tracer.start_span("kvgate.turn", start_time=t0, attributes={
                "kvgate.session": str(s.name.label), "kvgate.tenant": s.tenant or "",
                "kvgate.lineage": lineage or s.name.source, "kvgate.hold": hold})
            ctx = self._ctx(turn)
            t_req_ns = self._ns(now, t_req)
            tracer.start_span("kvgate.resolve", ctx, start_time=t0).end(end_time=max(t0, t_req_ns))
            if hold != "none":
                tracer.start_span("kvgate.held", ctx, start_time=t_req_ns, attributes={
                    "kvgate.hold": hold, "kvgate.held_s": now - t_req}).end()
        if up is not None:  # a retry: the earlier attempt failed
            up.set_attribute("kvgate.outcome", "retried")
            self._end_upstream(up, marks)
        up = got[2] = tracer.start_span("kvgate.upstream", self._ctx(turn), attributes={"kvgate.replica": str(
            getattr(s.replica, "url", ""))})
        got[3] = [0, 0, 0]
        carrier: dict[str, str] = {}
        self._prop.inject(carrier, context=self._ctx(up))
        return [(TRACEPARENT, carrier[TRACEPARENT])] if TRACEPARENT in carrier else []

    def marks(self, s: Any) -> list[int] | None:
        """Where the relay notes the current upstream call's head and first token (wall-clock ns; 0: not yet) and
        whether it streamed (1), as ``[head, first token, streamed]``; None: not traced."""
        got = self.open.get(s.sid)
        return None if got is None else got[3]

    def _end_upstream(self, up: Any, marks: list[int] | None) -> None:
        """End the upstream span, with its ``kvgate.ttft`` and ``kvgate.decode`` children if a first token came."""
        end = time.time_ns()
        if marks is not None and marks[1]:
            ctx = self._ctx(up)
            attrs = {"kvgate.streamed": bool(marks[2])}
            start = up.start_time
            first = min(max(marks[1], start), end)
            self.tracer.start_span("kvgate.ttft", ctx, start_time=start, attributes=attrs).end(end_time=first)
            self.tracer.start_span("kvgate.decode", ctx, start_time=first, attributes=attrs).end(end_time=end)
        up.end(end_time=end)

    def ended(self, s: Any, outcome: str | None) -> None:
        got = self.open.pop(s.sid, None)
        if got is None or got[1] is None:
            return
        _, turn, up, marks = got
        attrs = {"kvgate.outcome": outcome or "error", "kvgate.cached_tokens": max(s.est.cached_tokens, 0),
                 "kvgate.prompt_tokens": max(s.est.prompt_tokens, 0)}
        if up is not None:
            up.set_attributes(attrs)
            self._end_upstream(up, marks)
        turn.set_attributes(attrs)
        turn.end()

    def close(self) -> None:
        """Export what is left (at the gateway's stop)."""
        self.provider.shutdown()
