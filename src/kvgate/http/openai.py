"""The OpenAI-compatible wire, as every kvgate program speaks it: error bodies, session headers, and what an endpoint
is (pool discovery). What differs by API and by engine kind (usage fields, metric names, pool readers, flush,
quirks) is :mod:`kvgate.http.dialect`.

Errors. ``{"error": {"message", "type", "param", "code"}}`` (vLLM's and OpenAI's shape), as a body
(:func:`error_body`) or an SSE event's data (:func:`error_object`); messages on one line (:func:`one_line`).

Sessions. A turn names its session with ``X-Session-ID`` (the default of ``--session-header``); the last turn of
a session says so with ``X-Session-End: true`` (:func:`session_end`).

Discovery: what an endpoint is and how large its KV pool is, one discovery for the gateway, the driver and doctor.
The pool C is what the engine's scheduler can actually fill, in tokens:

* **vLLM** (``GET /metrics``, the info gauge ``vllm:cache_config_info{...} 1``): ``(num_gpu_blocks - 1) x
  block_size``. vLLM's ``BlockPool`` takes block 0 out of the free queue at start as its *null block* (the
  placeholder of skipped positions), so a request can never hold it. The label ``kv_cache_size_tokens`` (vLLM
  >= 0.11) is ``max_model_len x`` the number of whole max-length requests that fit, not the pool, and is used
  only when ``num_gpu_blocks`` is absent. ``block_size`` is the allocation block; ``hash_block_size`` (vLLM
  0.32) the finer granularity of the prefix-cache hashes, when it says so.
* **SGLang** (``GET /server_info``, older versions ``/get_server_info``): ``max_total_num_tokens`` at the top level
  or in ``internal_states[0]`` (the token pool's usable size; its padding slot is not counted), ``page_size`` as
  the block size, ``enable_cache_report``. vLLM serves ``/server_info`` too when started with
  ``VLLM_SERVER_DEV_MODE=1`` (``{"vllm_config", "vllm_env", "system_env"}``): that answer is vLLM's, never SGLang's.
* **Dynamo's frontend** (``GET /metrics``): ``dynamo_frontend_model_total_kv_blocks x
  dynamo_frontend_model_kv_cache_block_size``.
* **a kvgate gateway** (``GET /kvgate/info``, ``{"kvgate": "gateway", ...}``): its control, counters and C,
  and what it discovered about its upstream (``upstream``), so a driver in front of a gateway records the
  engine's pool and kind.

Order: ``/kvgate/info`` (404 elsewhere), ``/server_info`` (then ``/get_server_info`` if that is 404), ``/metrics``
(vLLM's info gauge, else Dynamo's families). SGLang is recognised before vLLM's metrics because ``kvgate engine
--engine sglang`` serves both.

Parsing is pure (:func:`cache_config_labels`, the one parser of vLLM's info gauge, :func:`parse_cache_config`,
:func:`parse_server_info`, :func:`parse_dynamo_metrics`, :func:`parse_gateway_info`); :func:`discover` does the
requests through a ``get(path) ->
(status, body)`` callable, so the gateway (its own upstream pool) and the driver (aiohttp) share it.
"""

from __future__ import annotations

import asyncio
import json
import re
from collections.abc import Awaitable, Callable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import orjson

from kvgate.http.dialect import DYNAMO, GATEWAY, SGLANG, VLLM, EngineKind, Usage, kind_of


# -- errors ----------------------------------------------------------------------------------------------------
def error_object(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    """An error as vLLM and OpenAI servers answer them: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_body(status: int, message: str, kind: str, param: str | None = None) -> bytes:
    """:func:`error_object` as a JSON body."""
    return orjson.dumps(error_object(status, message, kind, param))


def one_line(e: BaseException | str, limit: int | None = None) -> str:
    """An error (or a message) on one line: whitespace runs become one space, cut at ``limit`` characters."""
    text = e if isinstance(e, str) else (str(e) or type(e).__name__)
    out = " ".join(text.split())
    return out if limit is None else out[:limit]


# -- sessions --------------------------------------------------------------------------------------------------
SESSION_HEADER = "X-Session-ID"
"""The header naming a turn's session (the default of the driver's and the gateway's ``--session-header``)."""
SESSION_END_HEADER = "X-Session-End"
"""On the last turn of a session: ``true``."""


def session_end(value: str) -> bool:
    """Whether an ``X-Session-End`` value says the session ends after this turn (``true``, ``1``, ``yes``)."""
    return value.lower() in ("true", "1", "yes")


# -- discovery -------------------------------------------------------------------------------------------------
class Unreachable(Exception):
    """Raised by a getter when nothing listens at the endpoint (the other paths would fail too)."""


Getter = Callable[[str], Awaitable[tuple[int, bytes]]]
"""``await get(path)`` -> ``(HTTP status, body)``; raises :class:`Unreachable`, ``TimeoutError`` or ``OSError``."""


# -- what an endpoint is (pure readers) ------------------------------------------------------------------------


@dataclass(frozen=True)
class EngineInfo:
    """What discovery learnt about an endpoint (every field but ``kind`` may be unknown: None)."""

    kind: str = "unknown"
    """"vllm", "sglang", "dynamo", "kvgate-gateway" or "unknown" (:data:`KINDS`)."""
    kv_pool: int | None = None
    """C: the tokens the scheduler can fill ((num_gpu_blocks - 1) x block_size on vLLM)."""
    block_size: int | None = None
    hash_block_size: int | None = None
    num_gpu_blocks: int | None = None
    kv_cache_size_tokens: int | None = None
    """vLLM's own label, as reported (not the pool; recorded for reference)."""
    source: str = ""
    """Where the pool came from: "/metrics", "/server_info", "/get_server_info", "/kvgate/info" ("" if unknown)."""
    cache_report: bool | None = None
    """SGLang's ``enable_cache_report`` (it omits ``cached_tokens`` when 0 while on)."""
    gateway: dict[str, Any] | None = None
    """A kvgate gateway's ``/kvgate/info`` answer (then the fields above describe its upstream engine)."""
    reasons: tuple[str, ...] = field(default=(), compare=False)
    """Why the pool was not found, one entry per path tried."""

    @property
    def engine_kind(self) -> str:
        """The engine behind the endpoint: the upstream's kind for a gateway."""
        if self.gateway is not None:
            up = self.gateway.get("upstream")
            kind = up.get("kind") if type(up) is dict else None
            return kind if type(kind) is str else "unknown"
        return self.kind

    @property
    def dialect(self) -> EngineKind:
        """The engine's :class:`EngineKind` (the upstream's for a gateway)."""
        return kind_of(self.engine_kind)

    def cached(self, usage: Usage) -> int | None:
        """A turn's cached tokens as this engine means them (:meth:`EngineKind.cached`)."""
        return self.dialect.cached(usage, self.cache_report)

    def record(self) -> dict[str, Any]:
        """The fields for a run's records (no reasons, no gateway answer)."""
        d = asdict(self)
        d.pop("reasons")
        d.pop("gateway")
        return d


GATEWAY_INFO_PATH = GATEWAY.info_paths[0]
"""The gateway's self-description (see docs/gateway.md)."""
SERVER_INFO_PATHS = SGLANG.info_paths
"""SGLang's self-description (the second in older versions)."""

_LABEL = re.compile(r'(\w+)="((?:[^"\\]|\\.)*)"')
_INFO_NAMES = (VLLM.metrics.cache_config + "{", '{"' + VLLM.metrics.cache_config + '"')
_VLLM_SERVER_INFO_KEYS = ("vllm_config", "vllm_env")
_DYNAMO_BLOCKS = DYNAMO.metrics.kv_blocks
_DYNAMO_BLOCK_SIZE = DYNAMO.metrics.block_size


def vllm_kv_pool(num_gpu_blocks: int, block_size: int) -> int:
    """C of a vLLM engine: ``(num_gpu_blocks - 1) x block_size`` (block 0 is its null block, never allocated)."""
    return max(0, num_gpu_blocks - 1) * block_size


def cache_config_labels(text: str) -> dict[str, str] | None:
    """The labels of vLLM's ``vllm:cache_config_info`` in a Prometheus exposition (classic or UTF-8 quoted
    name, escaped quotes in values kept as sent); None when the family is absent. The one parser of it."""
    for line in text.splitlines():
        if line.startswith(_INFO_NAMES):
            start, end = line.find("{"), line.rfind("}")
            return dict(_LABEL.findall(line[start + 1 : end]))
    return None


def parse_cache_config(text: str) -> EngineInfo | None:
    """vLLM's pool from a Prometheus exposition holding ``vllm:cache_config_info``; None when absent."""
    labels = cache_config_labels(text)
    if labels is None:
        return None
    block = _positive(labels.get("block_size"))
    blocks = _positive(labels.get("num_gpu_blocks"))
    reported = _positive(labels.get("kv_cache_size_tokens"))
    pool = reported  # only when the block count is not reported
    if blocks is not None and block is not None:
        pool = vllm_kv_pool(blocks, block) or None
    return EngineInfo(
        kind="vllm", kv_pool=pool, block_size=block, hash_block_size=_positive(labels.get("hash_block_size")),
        num_gpu_blocks=blocks, kv_cache_size_tokens=reported, source="/metrics" if pool is not None else "",
    )


def prefix_caching_label(text: str) -> bool | None:
    """vLLM's ``enable_prefix_caching`` label of ``vllm:cache_config_info`` (None: not said)."""
    v = (cache_config_labels(text) or {}).get("enable_prefix_caching")
    return None if v is None else v.lower() == "true"


def parse_dynamo_metrics(text: str) -> EngineInfo | None:
    """Dynamo's frontend pool: ``dynamo_frontend_model_total_kv_blocks`` x ``..._kv_cache_block_size`` (the first
    sample of each: one model); None when neither family is there."""
    blocks = block = None
    for line in text.splitlines():
        if line.startswith(_DYNAMO_BLOCKS) and blocks is None:
            blocks = _positive(_sample_value(line))
        elif line.startswith(_DYNAMO_BLOCK_SIZE) and block is None:
            block = _positive(_sample_value(line))
    if blocks is None and block is None and _DYNAMO_BLOCKS not in text:
        return None
    pool = blocks * block if blocks is not None and block is not None else None
    return EngineInfo(kind="dynamo", kv_pool=pool, block_size=block, num_gpu_blocks=blocks,
                      source="/metrics" if pool is not None else "")


def kv_usage_from_metrics(text: str) -> float | None:
    """The fraction of the pool in use from a Prometheus exposition (vLLM's ``vllm:kv_cache_usage_perc``, before 0.10
    ``vllm:gpu_cache_usage_perc``; SGLang's ``sglang:token_usage``); None when absent. Several engines behind one
    URL (data-parallel ranks), each a fraction of its own pool: their mean."""
    names = VLLM.metrics.kv_usage + SGLANG.metrics.kv_usage
    values = []
    for line in text.splitlines():
        if line.startswith(names):
            try:
                values.append(float(line.rsplit(None, 1)[1]))
            except (IndexError, ValueError):
                continue
    return sum(values) / len(values) if values else None


def is_vllm_server_info(info: Any) -> bool:
    """vLLM's ``/server_info`` (``VLLM_SERVER_DEV_MODE=1``): ``{"vllm_config": ..., "vllm_env": ..., ...}``."""
    return type(info) is dict and any(k in info for k in _VLLM_SERVER_INFO_KEYS)


def parse_server_info(info: Any, path: str = "/server_info") -> EngineInfo | None:
    """SGLang's ``/server_info`` answer; None when it is not SGLang's (vLLM's dev-mode answer included)."""
    if type(info) is not dict or is_vllm_server_info(info):
        return None
    state: dict[str, Any] = {}
    states = info.get("internal_states")
    if type(states) is list and states and type(states[0]) is dict:
        state = states[0]
    size = _positive(info.get("max_total_num_tokens"))
    if size is None:
        size = _positive(state.get("max_total_num_tokens"))
    report = info.get("enable_cache_report")
    if size is None and type(report) is not bool:
        return None  # neither of SGLang's marks
    page = _positive(info.get("page_size"))
    return EngineInfo(
        kind="sglang", kv_pool=size, block_size=page if page is not None else (1 if size else None),
        source=path if size is not None else "", cache_report=report if type(report) is bool else None,
    )


def parse_gateway_info(info: Any) -> EngineInfo | None:
    """A kvgate gateway's ``/kvgate/info``: the upstream's pool (C as the gateway uses it when unknown)."""
    if type(info) is not dict or info.get("kvgate") != "gateway":
        return None
    up = info.get("upstream")
    up = up if type(up) is dict else {}
    pool = _positive(up.get("kv_pool"))
    if pool is None:
        pool = _positive(info.get("kv_pool"))
    return EngineInfo(
        kind="kvgate-gateway", kv_pool=pool, block_size=_positive(up.get("block_size")),
        hash_block_size=_positive(up.get("hash_block_size")), num_gpu_blocks=_positive(up.get("num_gpu_blocks")),
        kv_cache_size_tokens=_positive(up.get("kv_cache_size_tokens")),
        source=GATEWAY_INFO_PATH if pool is not None else "",
        cache_report=up.get("cache_report") if type(up.get("cache_report")) is bool else None, gateway=info,
    )


def _sample_value(line: str) -> str:
    """The value of one exposition sample line (its last field)."""
    parts = line.rsplit(None, 1)
    return parts[1] if len(parts) == 2 else ""


def _positive(v: Any) -> int | None:
    if type(v) is bool:
        return None
    try:
        n = int(float(v))
    except (TypeError, ValueError, OverflowError):
        return None
    return n if n > 0 else None


# -- the requests --------------------------------------------------------------------------------------------
async def discover(get: Getter, *, timeout_s: float = 5.0, gateway: bool = True) -> EngineInfo:
    """Ask the endpoint what it is (see the module docstring). Raises :class:`Unreachable` if nothing listens;
    other failures of one path only make that path count as unanswered (``reasons``).

    ``gateway=False`` skips ``/kvgate/info`` (a gateway asking about its own upstream still asks: a gateway may
    sit in front of another)."""
    reasons: list[str] = []
    vllm_seen = False

    async def fetch(path: str) -> tuple[int, bytes] | None:
        try:
            async with asyncio.timeout(timeout_s):
                return await get(path)
        except (TimeoutError, OSError) as e:
            reasons.append(f"GET {path}: {one_line(e) if str(e) else f'no answer within {timeout_s:g} s'}")
            return None

    if gateway:
        got = await fetch(GATEWAY_INFO_PATH)
        if got is not None and got[0] == 200:
            info = parse_gateway_info(_json(got[1]))
            if info is not None:
                return info
    for path in SERVER_INFO_PATHS:
        got = await fetch(path)
        if got is None:
            continue
        status, body = got
        if status != 200:
            reasons.append(f"GET {path}: HTTP {status}")
            if status == 404:
                continue
            break
        obj = _json(body)
        if is_vllm_server_info(obj):
            vllm_seen = True
            break
        info = parse_server_info(obj, path)
        if info is not None:
            if info.kv_pool is None:
                reasons.append(f"GET {path}: no max_total_num_tokens")
            return replace(info, reasons=tuple(reasons))
        reasons.append(f"GET {path}: not SGLang's answer")
        break
    got = await fetch("/metrics")
    if got is not None:
        status, body = got
        if status == 200:
            text = body.decode("utf-8", "replace")
            info = parse_cache_config(text)
            if info is not None:
                if info.kv_pool is None:
                    reasons.append("GET /metrics: vllm:cache_config_info without num_gpu_blocks and block_size")
                return replace(info, reasons=tuple(reasons))
            dynamo = parse_dynamo_metrics(text)
            if dynamo is not None:
                if dynamo.kv_pool is None:
                    reasons.append("GET /metrics: Dynamo's frontend without its model's KV blocks and block size")
                return replace(dynamo, reasons=tuple(reasons))
            reasons.append("GET /metrics: no vllm:cache_config_info")
            vllm_seen = vllm_seen or "vllm:" in text
        else:
            reasons.append(f"GET /metrics: HTTP {status}")
    return EngineInfo(kind="vllm" if vllm_seen else "unknown", reasons=tuple(reasons))


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None
