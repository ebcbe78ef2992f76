"""A fake upstream engine that can misbehave, and a gateway stack in front of it."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
from aiohttp import web

from kvgate.gateway import Gateway, GatewayConfig
from kvgate.http.dialect import MESSAGES, RESPONSES
from kvgate.policy import SessionState

VLLM_METRICS = (
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="16",num_gpu_blocks="1000",enable_prefix_caching="True"} 1.0\n'
    "vllm:num_requests_running 0.0\n"
)


class FakeUpstream:
    """A minimal OpenAI-compatible engine: completions and chat (plain or SSE), Responses and Messages (plain or
    SSE, usage in each API's own fields), /metrics, /server_info, echo.

    Usage: prompt_tokens = the id list's length (token-id prompts) or body bytes / 4; cached_tokens = half of it;
    completion_tokens = the chunks sent. ``mode`` makes it misbehave: "500", "hang" (never answers), "die" (dies
    after two stream chunks), "slow" (``delay_s`` before answering, ``chunk_delay_s`` between chunks).
    """

    def __init__(self, *, metrics: str | None = VLLM_METRICS, server_info: dict[str, Any] | None = None,
                 tokenizes: bool = False) -> None:
        self.metrics = metrics
        self.tokenizes = tokenizes
        """Whether ``/tokenize`` answers a count (the ask's bytes / 4), as vLLM's does; else it is echoed."""
        self.server_info = server_info
        self.mode = "ok"
        self.delay_s = 0.0
        self.chunk_delay_s = 0.0
        self.chunks = 3
        self.seen: list[dict[str, Any]] = []
        self.cancelled = 0
        self.streamed = 0
        """Stream chunks written (all requests)."""
        self.answers = 0
        self.port = 0
        self._runner: web.AppRunner | None = None

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def start(self, port: int = 0) -> None:
        app = web.Application(client_max_size=256 << 20)
        app.router.add_post("/v1/completions", self._complete)
        app.router.add_post("/v1/chat/completions", self._complete)
        app.router.add_post("/v1/responses", self._agentic)
        app.router.add_post("/v1/messages", self._agentic)
        app.router.add_get("/metrics", self._metrics)
        app.router.add_get("/server_info", self._server_info)
        if self.tokenizes:
            app.router.add_post("/tokenize", self._tokenize)
        for path in ("/get_server_info", "/kvgate/info"):  # not served, as on vLLM (discovery asks)
            app.router.add_get(path, self._not_found)
        app.router.add_route("*", "/{tail:.*}", self._echo)
        self._runner = web.AppRunner(app, handler_cancellation=True, shutdown_timeout=0.2, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", port, reuse_address=True)
        await site.start()
        self.port = self._runner.addresses[0][1]

    async def stop(self) -> None:
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    async def _metrics(self, request: web.Request) -> web.StreamResponse:
        if self.metrics is None:
            raise web.HTTPNotFound()
        return web.Response(text=self.metrics)

    async def _not_found(self, request: web.Request) -> web.StreamResponse:
        raise web.HTTPNotFound()

    async def _tokenize(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        self.seen.append({"path": request.path, "headers": dict(request.headers), "body": json.loads(raw), "raw": raw})
        return web.json_response({"count": max(1, len(raw) // 4)})

    async def _server_info(self, request: web.Request) -> web.StreamResponse:
        if self.server_info is None:
            raise web.HTTPNotFound()
        return web.json_response(self.server_info)

    async def _echo(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        rec = {"method": request.method, "path": request.raw_path, "headers": dict(request.headers), "body": body}
        self.seen.append(rec)
        return web.json_response({**rec, "body": body.decode()}, headers={"X-Upstream": "yes"})

    async def _agentic(self, request: web.Request) -> web.StreamResponse:
        """/v1/responses and /v1/messages: a fixed answer, its usage in the API's fields (half the prompt cached)."""
        raw = await request.read()
        body = json.loads(raw)
        self.seen.append({"path": request.path, "headers": dict(request.headers), "body": body, "raw": raw})
        if self.mode == "500":
            return web.json_response({"error": {"message": "engine exploded", "code": 500}}, status=500)
        api = RESPONSES if request.path == "/v1/responses" else MESSAGES
        p = max(1, len(raw) // 4)
        usage = api.make_usage(p, p // 2, self.chunks)
        self.answers += 1
        rid = f"resp_{self.answers}" if api is RESPONSES else f"msg_{self.answers}"
        text = "ok " * self.chunks
        if api is RESPONSES:
            whole: dict[str, Any] = {"id": rid, "object": "response", "status": "completed", "model": "m",
                                     "output": [{"type": "message", "id": "m1", "role": "assistant", "status":
                                                 "completed", "content": [{"type": "output_text", "text": text,
                                                                           "annotations": []}]}], "usage": usage}
            events = [("response.created", {"type": "response.created", "response": {**whole, "output": [],
                                                                                        "usage": None}}),
                      ("response.output_text.delta", {"type": "response.output_text.delta", "delta": text}),
                      ("response.completed", {"type": "response.completed", "response": whole})]
        else:
            whole = {"id": rid, "type": "message", "role": "assistant", "model": "m", "stop_reason": "max_tokens",
                     "content": [{"type": "text", "text": text}], "usage": usage}
            start = {**whole, "content": [], "usage": {**usage, "output_tokens": 0}}
            events = [("message_start", {"type": "message_start", "message": start}),
                      ("content_block_delta", {"type": "content_block_delta", "index": 0,
                                               "delta": {"type": "text_delta", "text": text}}),
                      ("message_delta", {"type": "message_delta", "delta": {"stop_reason": "max_tokens"},
                                         "usage": {"output_tokens": self.chunks}}),
                      ("message_stop", {"type": "message_stop"})]
        if not body.get("stream"):
            return web.json_response(whole)
        r = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await r.prepare(request)
        for name, ev in events:
            await r.write(f"event: {name}\ndata: ".encode() + json.dumps(ev).encode() + b"\n\n")
        await r.write_eof()
        return r

    async def _complete(self, request: web.Request) -> web.StreamResponse:
        raw = await request.read()
        body = json.loads(raw)
        self.seen.append({"path": request.path, "headers": dict(request.headers), "body": body, "raw": raw})
        try:
            if self.mode == "500":
                return web.json_response({"error": {"message": "engine exploded", "code": 500}}, status=500)
            if self.mode == "hang":
                await asyncio.sleep(30)
            if self.delay_s:
                await asyncio.sleep(self.delay_s)
            chat = request.path.endswith("chat/completions")
            prompt = body.get("prompt")
            p = len(prompt) if isinstance(prompt, list) else max(1, len(raw) // 4)
            usage = {"prompt_tokens": p, "completion_tokens": self.chunks, "total_tokens": p + self.chunks,
                     "prompt_tokens_details": {"cached_tokens": p // 2}}
            base = {"id": "cmpl-1", "object": "chat.completion" if chat else "text_completion", "created": 1,
                    "model": body.get("model", "m")}
            if not body.get("stream"):
                choice = (
                    {"index": 0, "message": {"role": "assistant", "content": "ok " * self.chunks},
                     "finish_reason": "length"}
                    if chat
                    else {"index": 0, "text": "ok " * self.chunks, "finish_reason": "length"}
                )
                return web.json_response({**base, "choices": [choice], "usage": usage})
            r = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await r.prepare(request)
            obj = "chat.completion.chunk" if chat else "text_completion"
            for i in range(self.chunks):
                if self.mode == "die" and i == 2:
                    assert request.transport is not None
                    request.transport.abort()
                    return r
                delta = {"delta": {"content": "ok "}} if chat else {"text": "ok "}
                ev = {**base, "object": obj, "choices": [{"index": 0, **delta, "finish_reason": None}]}
                await r.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
                self.streamed += 1
                if self.chunk_delay_s:
                    await asyncio.sleep(self.chunk_delay_s)
            so = body.get("stream_options") or {}
            if so.get("include_usage"):
                ev = {**base, "object": obj, "choices": [], "usage": usage}
                await r.write(b"data: " + json.dumps(ev).encode() + b"\n\n")
            await r.write(b"data: [DONE]\n\n")
            await r.write_eof()
            return r
        except asyncio.CancelledError:
            self.cancelled += 1
            raise


def check_clean(gw: Gateway, *, idle: bool = True) -> None:
    """D is the true sum of admitted demand; nothing held, in flight, or holding an upstream connection."""
    a = gw.audit()
    assert a["demand"] == a["admitted_demand"], a
    assert a["unknown"] == [] and a["orphans"] == 0, a
    assert a["held"] == a["held_policy"] == 0 and a["in_flight"] == 0, a
    if idle:
        assert all(gw.policy.state_of(sid) is not SessionState.RUNNING for sid, s in gw.sessions.items()
                   if s.known_to_policy), a
    assert gw.upstream_connections()["acquired"] == 0


async def settle(cond: Callable[[], bool], timeout: float = 10.0) -> None:
    """Wait until ``cond()`` holds (polling the loop; the bound is a hang guard, not a measurement)."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached")
        await asyncio.sleep(0.01)


@contextlib.asynccontextmanager
async def stack(
    upstream: FakeUpstream | None = None, **cfg: Any
) -> AsyncIterator[tuple[FakeUpstream, Gateway, aiohttp.ClientSession, str]]:
    """A fake upstream, a gateway in front of it and a client session; all stopped at the end, then leak checks."""
    before = asyncio.all_tasks()
    up = upstream or FakeUpstream()
    await up.start()
    gw = Gateway(GatewayConfig(upstream=up.url, **cfg))
    client = aiohttp.ClientSession()
    try:
        port = await gw.start("127.0.0.1", 0)
        yield up, gw, client, f"http://127.0.0.1:{port}"
        await asyncio.sleep(0.02)  # let cancelled handlers finish their cleanup
        check_clean(gw)
    finally:
        await client.close()
        await gw.stop()
        await up.stop()
    await settle(lambda: not (asyncio.all_tasks() - before - {asyncio.current_task()}))


async def post(
    client: aiohttp.ClientSession, url: str, body: Any, session: str | None = None, **headers: str
) -> tuple[int, Any, aiohttp.ClientResponse]:
    h = dict(headers)
    if session is not None:
        h["X-Session-ID"] = session
    data = body if isinstance(body, bytes) else json.dumps(body).encode()
    async with client.post(url, data=data, headers={"Content-Type": "application/json", **h}) as r:
        raw = await r.read()
        try:
            out: Any = json.loads(raw)
        except ValueError:
            out = raw
        return r.status, out, r
