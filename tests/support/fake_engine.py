"""A fake OpenAI-compatible engine that checks what a driver sends, and a driver run against it."""

from __future__ import annotations

import asyncio
import json
import random
import time
from pathlib import Path
from typing import Any

import numpy as np
from aiohttp import web

from kvgate.drive.driver import DriveConfig, DriveResult, drive
from kvgate.workload.shapes import Phase, Workload, synthetic


class FakeEngine:
    """A minimal OpenAI-compatible server (completions with token ids, chat, SSE, flush endpoints)."""

    def __init__(
        self,
        *,
        report_cached: bool = True,
        return_ids: bool = True,
        fail: dict[tuple[int, int], list[int]] | None = None,
        delay_s: float = 0.0,
        has_reset: bool = True,
        flush_400: int = 0,
    ) -> None:
        self.report_cached = report_cached
        self.return_ids = return_ids
        self.fail = {k: list(v) for k, v in (fail or {}).items()}
        self.delay_s = delay_s
        self.has_reset = has_reset
        self.flush_400 = flush_400
        self.requests: list[dict[str, Any]] = []  # every attempt
        self.turns: dict[int, list[dict[str, Any]]] = {}  # answered turns per session
        self.seq: dict[int, Any] = {}  # per session: last prompt + output (ids or messages)
        self.last_first: list[int] = []
        self.violations: list[str] = []
        self.flushes: list[str] = []
        self.runner: web.AppRunner | None = None
        self.url = ""

    async def __aenter__(self) -> FakeEngine:
        app = web.Application(client_max_size=64 * 1024 * 1024)
        app.router.add_get("/v1/models", self.models)
        app.router.add_get("/health", self.health)
        app.router.add_post("/v1/completions", self.completions)
        app.router.add_post("/v1/chat/completions", self.chat)
        if self.has_reset:
            app.router.add_post("/reset_prefix_cache", self.reset)
        app.router.add_post("/flush_cache", self.flush_cache)
        self.runner = web.AppRunner(app, shutdown_timeout=0.1, access_log=None)
        await self.runner.setup()
        site = web.TCPSite(self.runner, "127.0.0.1", 0)
        await site.start()
        port = self.runner.addresses[0][1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None

    # -- handlers -------------------------------------------------------------------------------------------------
    async def models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

    async def health(self, request: web.Request) -> web.Response:
        return web.Response(text="ok")

    async def reset(self, request: web.Request) -> web.Response:
        self.flushes.append("/reset_prefix_cache?" + request.query_string)
        return web.json_response(True)

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.flush_400 > 0:
            self.flush_400 -= 1
            self.flushes.append("/flush_cache 400")
            return web.Response(status=400, text="Cache not flushed: pending requests")
        self.flushes.append("/flush_cache")
        return web.Response(text="Cache flushed.")

    def _begin(self, request: web.Request, body: dict[str, Any]) -> tuple[int, int, web.Response | None]:
        sid = int(request.headers["X-Session-ID"])
        turn = len(self.turns.get(sid, []))
        self.requests.append(
            {
                "sid": sid,
                "turn": turn,
                "end": request.headers.get("X-Session-End"),
                "t": time.perf_counter(),
                "body": body,
            }
        )
        statuses = self.fail.get((sid, turn))
        if statuses:
            code = statuses.pop(0)
            return sid, turn, web.json_response({"error": {"message": "injected", "code": code}}, status=code)
        return sid, turn, None

    def _usage(self, prompt: int, cached: int, out: int) -> dict[str, Any]:
        u: dict[str, Any] = {"prompt_tokens": prompt, "completion_tokens": out, "total_tokens": prompt + out}
        u["prompt_tokens_details"] = {"cached_tokens": cached} if self.report_cached else None
        return u

    async def completions(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        sid, turn, err = self._begin(request, body)
        if err is not None:
            return err
        if self.delay_s:
            await asyncio.sleep(self.delay_s)
        prompt: list[int] = body["prompt"]
        n = int(body["max_tokens"])
        if body.get("ignore_eos") is not True or body.get("min_tokens") != n:
            self.violations.append(f"session {sid} turn {turn}: no ignore_eos/min_tokens")
        prev = self.seq.get(sid)
        if prev is None:
            cached = common_prefix(prompt, self.last_first)
            self.last_first = prompt
        else:
            cached = common_prefix(prompt, prev)
            if cached < len(prev):
                self.violations.append(f"session {sid} turn {turn}: prompt does not extend the previous sequence")
        rng = random.Random(f"{sid}/{turn}")
        out = [rng.randrange(10, 999) for _ in range(n)]
        self.seq[sid] = prompt + out
        self.turns.setdefault(sid, []).append({"prompt": prompt, "out": out, "cached": cached})
        choice: dict[str, Any] = {"index": 0, "text": " ".join(map(str, out)), "finish_reason": "length"}
        if self.return_ids and body.get("return_token_ids"):
            choice["token_ids"] = out
        usage = self._usage(len(prompt), cached, n)
        if not body.get("stream"):
            return web.json_response({"id": "x", "object": "text_completion", "choices": [choice], "usage": usage})
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        half = n // 2
        for part in (out[:half], out[half:]):
            ch: dict[str, Any] = {"index": 0, "text": " ".join(map(str, part)), "finish_reason": None}
            if self.return_ids:
                ch["token_ids"] = part
            await resp.write(f"data: {json.dumps({'choices': [ch]})}\n\n".encode())
            await asyncio.sleep(0.002)
        await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\n".encode())
        await resp.write(b"data: [DONE]\n\n")
        await resp.write_eof()
        return resp

    async def chat(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        sid, turn, err = self._begin(request, body)
        if err is not None:
            return err
        msgs: list[dict[str, str]] = body["messages"]
        prev = self.seq.get(sid)
        if prev is not None and msgs[: len(prev)] != prev:
            self.violations.append(f"session {sid} turn {turn}: messages do not extend the previous conversation")
        n = int(body["max_tokens"])
        text = " ".join(random.Random(f"{sid}/{turn}").choices(["alpha", "beta", "gamma"], k=n))
        self.seq[sid] = msgs + [{"role": "assistant", "content": text}]
        self.turns.setdefault(sid, []).append({"messages": msgs, "text": text})
        words = sum(len(m["content"].split()) for m in msgs)
        common = len(prev) - 1 if prev is not None else 0
        cached = sum(len(m["content"].split()) for m in msgs[:common])
        usage = self._usage(words, cached, n)
        if body.get("stream"):
            resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
            await resp.prepare(request)
            cut = len(text) // 2
            for part in (text[:cut], text[cut:]):
                delta = {"choices": [{"index": 0, "delta": {"content": part}, "finish_reason": None}]}
                await resp.write(f"data: {json.dumps(delta)}\n\n".encode())
            await resp.write(f"data: {json.dumps({'choices': [], 'usage': usage})}\n\ndata: [DONE]\n\n".encode())
            await resp.write_eof()
            return resp
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "length"}
        return web.json_response({"id": "c", "object": "chat.completion", "choices": [choice], "usage": usage})


def drive_config(url: str, **kw: Any) -> DriveConfig:
    base: dict[str, Any] = dict(endpoint=url, lam=0.5, minutes=1.0, seed=7, time_scale=120.0, retries=2, backoff_s=0.01)
    base.update(kw)
    return DriveConfig(**base)


async def drive_run(cfg: DriveConfig, out: Path, logs: list[str] | None = None, **kw: Any) -> DriveResult:
    return await drive(
        cfg,
        out,
        workload=kw.pop("workload", TINY),
        status=False,
        log=(logs.append if logs is not None else lambda _m: None),
        handle_signals=False,
        **kw,
    )


TINY = Workload("tiny", phases=(Phase(0.0, synthetic(shared=16, unique=32, turns=4, output=5, append=10), 2.0),))


def common_prefix(a: list[int], b: list[int]) -> int:
    n = min(len(a), len(b))
    if n == 0:
        return 0
    diff = np.nonzero(np.asarray(a[:n]) != np.asarray(b[:n]))[0]
    return int(diff[0]) if len(diff) else n
