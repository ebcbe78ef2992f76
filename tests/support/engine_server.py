"""``kvgate engine`` in the test's own loop, fast (scaled 500×) and on a free loopback port."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

from kvgate.serve.app import EngineServer
from kvgate.serve.config import ServerConfig


@contextlib.asynccontextmanager
async def engine(**cfg: Any) -> AsyncIterator[str]:
    """The engine's base URL while the block runs (``cfg``: :class:`ServerConfig` fields over the defaults)."""
    srv = EngineServer(ServerConfig(**{"time_scale": 500.0, "kv_pool": 200_000, **cfg}))
    port = await srv.start("127.0.0.1", 0)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        await srv.stop()
