"""The aiohttp application around one served engine: the route table and the server's life cycle."""

from __future__ import annotations

import os

from aiohttp import web

from kvgate.engine.base import Engine
from kvgate.errors import UsageError
from kvgate.http.dialect import SGLANG, VLLM
from kvgate.http.openai import SERVER_INFO_PATHS
from kvgate.serve.admin import AdminRoutes
from kvgate.serve.config import ServerConfig
from kvgate.serve.errors import error_middleware
from kvgate.serve.generate import Generation
from kvgate.serve.metrics import MetricsRoute
from kvgate.serve.served import ServedEngine
from kvgate.serve.tokens import TokenRoutes
from kvgate.workload.triggers import TRIGGER_PATH

VLLM_FLUSH = (VLLM.flush_path or "").partition("?")[0]
SGLANG_FLUSH = SGLANG.flush_path or ""


class EngineServer(ServedEngine):
    """A served engine on an HTTP port: vLLM's routes (and SGLang's with ``engine="sglang"``). ``engine``
    overrides the one the config builds (tests serve the vLLM engine under the SGLang API this way)."""

    def __init__(self, cfg: ServerConfig, engine: Engine | None = None) -> None:
        super().__init__(cfg, engine)
        self.generation = Generation(self)
        self.tokens = TokenRoutes(self)
        self.admin = AdminRoutes(self)
        self.metrics = MetricsRoute(self)
        self.registry = self.metrics.registry
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    def app(self) -> web.Application:
        app = web.Application(middlewares=[error_middleware], client_max_size=256 * 1024 * 1024)
        r = app.router
        gen, tok, adm = self.generation, self.tokens, self.admin
        r.add_post("/v1/completions", gen.completions)
        r.add_post("/v1/chat/completions", gen.chat_completions)
        r.add_post("/v1/responses", gen.responses)
        r.add_post("/v1/messages", gen.messages)
        r.add_post("/v1/messages/count_tokens", gen.count_tokens)
        r.add_post("/tokenize", tok.tokenize)
        r.add_post("/detokenize", tok.detokenize)
        r.add_get("/v1/models", adm.models)
        r.add_get("/health", adm.health)
        r.add_get("/ping", adm.health)
        r.add_get("/version", adm.version)
        r.add_get("/metrics", self.metrics.metrics)
        r.add_post(VLLM_FLUSH, adm.reset_prefix_cache)
        r.add_get("/kvgate/stats", adm.kvgate_stats)
        r.add_get("/kvgate/kv_blocks", adm.kv_blocks)
        r.add_post(TRIGGER_PATH, adm.trigger)
        if self.cfg.engine == "sglang":
            for path in SERVER_INFO_PATHS:
                r.add_get(path, adm.server_info)
            r.add_get("/get_model_info", adm.model_info)
            r.add_route("GET", SGLANG_FLUSH, adm.flush_cache)
            r.add_route("POST", SGLANG_FLUSH, adm.flush_cache)
        app.on_startup.append(self._on_startup)
        app.on_shutdown.append(self._on_shutdown)
        return app

    async def _on_startup(self, _app: web.Application) -> None:
        self.loop.start()

    async def _on_shutdown(self, _app: web.Application) -> None:
        await self.loop.stop()
        if self.kv_events is not None:
            await self.kv_events.stop()

    async def start(self, host: str = "127.0.0.1", port: int = 8100) -> int:
        """Serve on ``host:port`` (port 0: a free one); returns the port."""
        if self.kv_events is not None:
            self.kv_events.start()  # first: a port taken fails before the HTTP server listens
        runner = web.AppRunner(self.app(), handler_cancellation=True, shutdown_timeout=5.0, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as e:
            await runner.cleanup()
            if self.kv_events is not None:
                self.kv_events.close()
            reason = os.strerror(e.errno) if e.errno else str(e)
            raise UsageError(f"cannot listen on {host}:{port}: {reason}") from None
        self._runner = runner
        addrs = runner.addresses
        self.port = int(addrs[0][1]) if addrs else port
        return self.port

    async def stop(self) -> None:
        """Stop listening, fail the requests in flight, close every connection."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None
        if self.kv_events is not None:
            await self.kv_events.stop()
