"""The KV pool size C of the gateway's upstream engine, through :mod:`kvgate.http.discovery`.

C is what the engine's scheduler can fill: ``(num_gpu_blocks - 1) x block_size`` on vLLM (block 0 is its null
block), ``max_total_num_tokens`` on SGLang, the upstream's pool for another kvgate gateway.

The gateway reads it at startup (``--kv-pool auto``) and again after the upstream was unreachable or dropped a
connection, once it answers again (a restarted engine may have a different pool). With ``--kv-pool TOKENS`` it
still asks, best-effort, so that ``/kvgate/info`` can tell the engine's kind and block size.
"""

from __future__ import annotations

from typing import Any

from yarl import URL

from kvgate.errors import UsageError
from kvgate.http.discovery import EngineInfo, Unreachable, discover, parse_cache_config, parse_server_info
from kvgate.http.upstream import UpstreamConnectError, UpstreamPool


class PoolNotFound(UsageError):
    """The upstream reports no KV pool size (and none was configured)."""


def pool_from_metrics(text: str) -> int | None:
    """C from a Prometheus exposition with vLLM's ``vllm:cache_config_info``: (num_gpu_blocks - 1) x block_size."""
    info = parse_cache_config(text)
    return None if info is None else info.pool_tokens


def pool_from_server_info(info: Any) -> int | None:
    """C from SGLang's ``/server_info`` answer (None for any other answer, vLLM's dev-mode one included)."""
    found = parse_server_info(info)
    return None if found is None else found.pool_tokens


async def discover_upstream(
    client: UpstreamPool, base: URL, *, headers: dict[str, str] | None = None, timeout_s: float = 5.0
) -> EngineInfo:
    """What the upstream is and its pool (fields unknown when it does not say); raises :class:`Unreachable`."""
    prefix = base.raw_path.rstrip("/")
    hdrs = list((headers or {}).items())

    async def get(path: str) -> tuple[int, bytes]:
        try:
            resp = await client.request("GET", prefix + path, hdrs)
        except UpstreamConnectError as e:  # nothing listens: the other paths would fail too
            raise Unreachable(_one_line(e)) from None
        try:
            body = await resp.read()
        finally:
            resp.release()
        return resp.status, body

    return await discover(get, timeout_s=timeout_s)


async def detect_pool(
    client: UpstreamPool, base: URL, *, headers: dict[str, str] | None = None, timeout_s: float = 5.0
) -> EngineInfo:
    """The upstream's :class:`EngineInfo` with a pool; raises :class:`PoolNotFound` with a one-line reason."""
    try:
        info = await discover_upstream(client, base, headers=headers, timeout_s=timeout_s)
    except Unreachable as e:
        raise PoolNotFound(
            f"the upstream {base} is unreachable ({e}); start it first, or pass --kv-pool TOKENS"
        ) from None
    if info.pool_tokens is None:
        raise PoolNotFound(
            f"cannot find the KV pool size of the upstream {base} ({'; '.join(info.reasons)}); pass --kv-pool TOKENS"
        )
    return info


def _one_line(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return " ".join(text.split())
