"""The KV pool size C of the upstream engine, as the engine reports it.

* vLLM: ``GET /metrics``, the info gauge ``vllm:cache_config_info{...} 1``: the label ``kv_cache_size_tokens``
  when present, else ``num_gpu_blocks`` x ``block_size``;
* SGLang: ``GET /server_info`` (older versions: ``/get_server_info``), ``max_total_num_tokens`` at the top
  level or in ``internal_states[0]``.

The gateway reads it at startup (``--kv-pool auto``) and again after the upstream was unreachable or dropped a
connection, once it answers again (a restarted engine may have a different pool).
"""

from __future__ import annotations

import asyncio
import json
import re
from typing import Any

from yarl import URL

from kvgate.errors import UsageError
from kvgate.http.upstream import UpstreamConnectError, UpstreamPool

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_INFO_NAMES = ("vllm:cache_config_info{", '{"vllm:cache_config_info"')


class PoolNotFound(UsageError):
    """The upstream reports no KV pool size (and none was configured)."""


def pool_from_metrics(text: str) -> int | None:
    """C from a Prometheus exposition holding ``vllm:cache_config_info``; None if absent or unusable."""
    for line in text.splitlines():
        if not line.startswith(_INFO_NAMES):
            continue
        start, end = line.find("{"), line.rfind("}")
        labels = dict(_LABEL.findall(line[start + 1 : end]))
        size = _positive(labels.get("kv_cache_size_tokens"))
        if size is not None:
            return size
        blocks, block = _positive(labels.get("num_gpu_blocks")), _positive(labels.get("block_size"))
        if blocks is not None and block is not None:
            return blocks * block
    return None


def pool_from_server_info(info: Any) -> int | None:
    """C from SGLang's ``/server_info`` answer; None if absent."""
    if type(info) is not dict:
        return None
    size = _positive(info.get("max_total_num_tokens"))
    if size is None:
        states = info.get("internal_states")
        if type(states) is list and states and type(states[0]) is dict:
            size = _positive(states[0].get("max_total_num_tokens"))
    return size


async def detect_pool(
    client: UpstreamPool, base: URL, *, headers: dict[str, str] | None = None, timeout_s: float = 5.0
) -> tuple[int, str]:
    """``(C, where it came from)``; raises :class:`PoolNotFound` with a one-line reason."""
    reasons: list[str] = []
    prefix = base.raw_path.rstrip("/")
    for path, parse in (
        ("/metrics", _parse_metrics),
        ("/server_info", _parse_info),
        ("/get_server_info", _parse_info),
    ):
        try:
            async with asyncio.timeout(timeout_s):
                resp = await client.request("GET", prefix + path, (headers or {}).items())
                try:
                    body = await resp.read()
                finally:
                    resp.release()
                status = resp.status
        except UpstreamConnectError as e:  # nothing listens: the other paths would fail too
            raise PoolNotFound(
                f"the upstream {base} is unreachable ({_one_line(e)}); start it first, or pass --kv-pool TOKENS"
            ) from None
        except (TimeoutError, OSError) as e:
            reasons.append(f"GET {path}: {_one_line(e) if str(e) else f'no answer within {timeout_s:g} s'}")
            continue
        if status != 200:
            reasons.append(f"GET {path}: HTTP {status}")
            continue
        size = parse(body)
        if size is not None:
            return size, path
        missing = "no vllm:cache_config_info" if path == "/metrics" else "no max_total_num_tokens"
        reasons.append(f"GET {path}: {missing}")
    raise PoolNotFound(
        f"cannot find the KV pool size of the upstream {base} ({'; '.join(reasons)}); pass --kv-pool TOKENS"
    )


def _parse_metrics(body: bytes) -> int | None:
    return pool_from_metrics(body.decode("utf-8", "replace"))


def _parse_info(body: bytes) -> int | None:
    try:
        return pool_from_server_info(json.loads(body))
    except ValueError:
        return None


def _positive(v: Any) -> int | None:
    try:
        n = int(float(v))
    except (TypeError, ValueError, OverflowError):
        return None
    return n if n > 0 else None


def _one_line(e: BaseException) -> str:
    text = str(e) or type(e).__name__
    return " ".join(text.split())
