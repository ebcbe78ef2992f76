"""``--otlp-endpoint``: a tiny OTLP/HTTP receiver on loopback gets the gateway's spans, decoded with
opentelemetry-proto: a span per turn, its children (resolution, the time held by the policy, the upstream call),
the upstream call's children (time to first token, decode), their attributes, and the ``traceparent`` the
upstream saw."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest
from aiohttp import web

from support.aio import timed
from support.fake_upstream import FakeUpstream, post, stack

try:
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter  # noqa: F401
    from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import (
        ExportTraceServiceRequest,
        ExportTraceServiceResponse,
    )
except ImportError as e:  # the 'otel' extra
    pytest.skip(f"the OpenTelemetry SDK / OTLP exporter does not import: {e}", allow_module_level=True)


END = {"X-Session-End": "true"}


class Receiver:
    """An OTLP/HTTP trace receiver: every span it got, as ``{name, trace, span, parent, attrs, start, end}``."""

    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self.runner: web.AppRunner | None = None

    async def start(self) -> str:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self.runner = web.AppRunner(app)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        return f"http://127.0.0.1:{port}/v1/traces"

    async def _traces(self, request: web.Request) -> web.Response:
        req = ExportTraceServiceRequest.FromString(await request.read())
        for rs in req.resource_spans:
            for ss in rs.scope_spans:
                for sp in ss.spans:
                    attrs = {a.key: getattr(a.value, a.value.WhichOneof("value")) for a in sp.attributes}
                    self.spans.append({"name": sp.name, "trace": sp.trace_id.hex(), "span": sp.span_id.hex(),
                                       "parent": sp.parent_span_id.hex(), "attrs": attrs,
                                       "start": sp.start_time_unix_nano, "end": sp.end_time_unix_nano})
        return web.Response(body=ExportTraceServiceResponse().SerializeToString(),
                            content_type="application/x-protobuf")

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()


@timed(30)
async def test_spans_of_a_held_turn_reach_an_otlp_receiver() -> None:
    rx = Receiver()
    endpoint = await rx.start()
    up = FakeUpstream()
    up.delay_s = 0.3
    try:
        async with stack(up, kv_pool=1000, otlp_endpoint=endpoint, fair_share=True) as (_, gw, client, base):
            body = {"model": "m", "prompt": list(range(600)), "max_tokens": 100}
            first = asyncio.create_task(post(client, base + "/v1/completions", body, "s1", **END))
            await asyncio.sleep(0.05)
            st2, _, r2 = await post(client, base + "/v1/completions", body, "s2", **END)  # held: pool 1000
            st1, _, _ = await first
            assert st1 == st2 == 200 and r2.headers["X-Kvgate-Hold"] == "waiting"
            seen = {r["headers"].get("X-Session-ID"): r["headers"] for r in up.seen}
    finally:
        await rx.stop()
    by_name: dict[str, list[dict[str, Any]]] = {}
    for sp in rx.spans:
        by_name.setdefault(sp["name"], []).append(sp)
    turns = {sp["attrs"]["kvgate.session"]: sp for sp in by_name["kvgate.turn"]}
    assert set(turns) == {"s1", "s2"}
    t2 = turns["s2"]
    assert t2["attrs"]["kvgate.tenant"] == "default" and t2["attrs"]["kvgate.hold"] == "waiting"
    assert t2["attrs"]["kvgate.prompt_tokens"] == 600 and t2["attrs"]["kvgate.cached_tokens"] == 300
    assert t2["attrs"]["kvgate.outcome"] == "finished"
    kids = {sp["name"]: sp for sp in rx.spans if sp["parent"] == t2["span"]}
    assert set(kids) == {"kvgate.resolve", "kvgate.held", "kvgate.upstream"}
    held = kids["kvgate.held"]
    assert held["trace"] == t2["trace"] and held["attrs"]["kvgate.held_s"] > 0.1  # held while s1 ran (0.3 s)
    assert t2["start"] <= kids["kvgate.resolve"]["start"] <= held["start"] <= held["end"]
    assert held["end"] <= kids["kvgate.upstream"]["start"] <= kids["kvgate.upstream"]["end"] <= t2["end"]
    # s1 proceeded at once: no held span; the upstream saw each upstream span's context as traceparent
    assert not [sp for sp in rx.spans if sp["parent"] == turns["s1"]["span"] and sp["name"] == "kvgate.held"]
    ups = {sp["trace"]: sp for sp in by_name["kvgate.upstream"]}
    for sid, t in turns.items():
        tp = seen[sid]["traceparent"]
        assert tp.rsplit("-", 1)[0] == f"00-{t['trace']}-{ups[t['trace']]['span']}"  # (then its flags)
        ttft, _ = upstream_parts(rx.spans, ups[t["trace"]])
        assert ttft["attrs"]["kvgate.streamed"] is False and seconds(ttft) >= 0.25  # the engine's 0.3 s


def upstream_parts(spans: list[dict[str, Any]], up: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """The ``kvgate.ttft`` and ``kvgate.decode`` children of upstream span ``up``, checked to tile it in order."""
    kids = {sp["name"]: sp for sp in spans if sp["parent"] == up["span"]}
    assert set(kids) == {"kvgate.ttft", "kvgate.decode"}, kids
    ttft, decode = kids["kvgate.ttft"], kids["kvgate.decode"]
    assert ttft["trace"] == decode["trace"] == up["trace"]
    assert up["start"] == ttft["start"] <= ttft["end"] == decode["start"] <= decode["end"] == up["end"]
    return ttft, decode


def seconds(sp: dict[str, Any]) -> float:
    return (sp["end"] - sp["start"]) / 1e9


@timed(30)
async def test_upstream_span_splits_into_ttft_and_decode() -> None:
    """A streamed answer: ttft ends at the first chunk (after the engine's delay), decode runs over the chunks
    that follow; an answer in one piece: ttft ends at the response's head, which comes after the delay too."""
    rx = Receiver()
    endpoint = await rx.start()
    up = FakeUpstream()
    up.delay_s, up.chunk_delay_s = 0.3, 0.1  # 3 chunks: 0.3 s before the first, 0.1 s after each
    try:
        async with stack(up, kv_pool=100_000, otlp_endpoint=endpoint, fair_share=True) as (_, gw, client, base):
            body = {"model": "m", "prompt": list(range(100)), "max_tokens": 10}
            st1, text, _ = await post(client, base + "/v1/completions", {**body, "stream": True}, "s1", **END)
            st2, _, _ = await post(client, base + "/v1/completions", body, "s2", **END)
            assert st1 == st2 == 200 and b"[DONE]" in text
    finally:
        await rx.stop()
    turns = {sp["attrs"]["kvgate.session"]: sp for sp in rx.spans if sp["name"] == "kvgate.turn"}
    ups = {sp["trace"]: sp for sp in rx.spans if sp["name"] == "kvgate.upstream"}
    assert set(turns) == {"s1", "s2"}
    for sid, streamed in (("s1", True), ("s2", False)):
        t = turns[sid]
        u = ups[t["trace"]]
        assert u["parent"] == t["span"] and u["end"] <= t["end"]
        ttft, decode = upstream_parts(rx.spans, u)
        assert ttft["attrs"]["kvgate.streamed"] is streamed and decode["attrs"]["kvgate.streamed"] is streamed
        assert seconds(ttft) >= 0.25  # nothing came before the engine's delay
        if streamed:
            assert seconds(decode) >= 0.15  # the first chunk, then at least two more 0.1 s apart
