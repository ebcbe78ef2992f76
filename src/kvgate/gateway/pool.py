"""The KV pool size C of the gateway's upstream engine, through :mod:`kvgate.http.openai`.

C is what the engine's scheduler can fill: ``(num_gpu_blocks - 1) x block_size`` on vLLM (block 0 is its null
block), ``max_total_num_tokens`` on SGLang, the upstream's pool for another kvgate gateway.

The gateway reads it at startup (``--kv-pool auto``) and again after the upstream was unreachable or dropped a
connection, once it answers again (a restarted engine may have a different pool). With ``--kv-pool TOKENS`` it
still asks, best-effort, so that ``/kvgate/info`` can tell the engine's kind and block size.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable

from kvgate.errors import UsageError
from kvgate.http.openai import EngineInfo, Getter, Unreachable, discover

log = logging.getLogger("kvgate.gateway")


class PoolNotFound(UsageError):
    """The upstream reports no KV pool size (and none was configured)."""


async def detect_pool(get: Getter, where: str, *, timeout_s: float = 5.0) -> EngineInfo:
    """The upstream's :class:`EngineInfo` with a pool; raises :class:`PoolNotFound` with a one-line reason."""
    try:
        info = await discover(get, timeout_s=timeout_s)
    except Unreachable as e:
        raise PoolNotFound(
            f"the upstream {where} is unreachable ({e}); start it first, or pass --kv-pool TOKENS"
        ) from None
    if info.kv_pool is None:
        raise PoolNotFound(
            f"cannot find the KV pool size of the upstream {where} ({'; '.join(info.reasons)}); pass --kv-pool TOKENS"
        )
    return info


class PoolWatch:
    """C as the gateway uses it: given (``--kv-pool``) or read from the upstream at start, then re-read once the
    upstream answers again after connection errors; ``on_change(old, new)`` runs when it changed."""

    def __init__(self, get: Getter, where: str, configured: int | None) -> None:
        self._get = get
        self._where = where
        self.kv_pool = configured or 0
        """C in tokens (0 until read)."""
        self.source = "--kv-pool" if configured else ""
        """Where C came from: "--kv-pool", or the upstream's path that answered."""
        self.upstream_info = EngineInfo()
        """What discovery learnt about the upstream (kind, pool, block size)."""
        self.configured = configured
        """``--kv-pool`` (None: read from the upstream)."""
        self._watch = configured is None
        self.stale = False
        """The upstream failed a connection since C was read: re-read it after the next finished turn."""
        self._task: asyncio.Task[None] | None = None
        self.on_change: Callable[[int, int], None] | None = None

    async def read(self) -> None:
        """At start: C from the upstream (``PoolNotFound`` if it says none), else, best-effort, what it is."""
        if not self.kv_pool:
            info = await detect_pool(self._get, self._where)
            assert info.kv_pool is not None
            self.upstream_info, self.kv_pool, self.source = info, info.kv_pool, info.source
            return
        # C is given; the engine's kind and block size are still worth knowing
        with contextlib.suppress(Unreachable, TimeoutError, OSError):
            self.upstream_info = await discover(self._get, timeout_s=2.0)

    async def reread(self) -> bool:
        """Read C again now (a replica coming back: a restarted engine may have another pool); False when the
        upstream does not tell it."""
        try:
            info = await detect_pool(self._get, self._where, timeout_s=2.0)
        except PoolNotFound:
            return False
        assert info.kv_pool is not None
        self.upstream_info, self.kv_pool, self.source = info, info.kv_pool, info.source
        self.stale = False
        return True

    def upstream_failed(self, kind: str) -> None:
        """A turn failed upstream with ``kind``: a connection error may mean a restarted engine."""
        if self._watch and kind in ("connect", "disconnect"):
            self.stale = True

    def refresh_soon(self) -> None:
        """Re-read C in the background (once at a time)."""
        self.stale = False
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._refresh(), name="kvgate-gateway-pool")

    async def _refresh(self) -> None:
        try:
            info = await detect_pool(self._get, self._where)
        except PoolNotFound as e:
            log.warning("KV pool not re-read", extra={"event": "pool_error", "detail": str(e)})
            return
        finally:
            self._task = None
        self.upstream_info = info
        size, source = info.kv_pool, info.source
        assert size is not None
        if size != self.kv_pool:
            old = self.kv_pool
            self.kv_pool, self.source = size, source
            if self.on_change is not None:
                self.on_change(old, size)

    async def stop(self) -> None:
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
