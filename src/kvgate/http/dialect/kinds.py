"""Engine kinds (:class:`EngineKind`; :data:`KINDS` by name): vLLM, SGLang, Dynamo's frontend and a kvgate gateway;
their metric names, where their KV pool is read, their flush endpoint, the flag that makes them report cached
tokens and their quirks. The discovery of an endpoint (which kind, how large its pool: reading what these name) is
:mod:`kvgate.http.openai`'s."""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.http.dialect.base import Usage


@dataclass(frozen=True)
class Metrics:
    """An engine kind's Prometheus names ("": it exports none)."""

    running: str = ""
    waiting: str = ""
    kv_usage: tuple[str, ...] = ()
    """The fraction of the pool in use (older names after the first)."""
    prefix_queries: str = ""
    prefix_hits: str = ""
    hit_rate: str = ""
    preemptions: str = ""
    cache_config: str = ""
    """vLLM's info gauge of its cache configuration (the pool, the block size, prefix caching)."""
    kv_blocks: str = ""
    block_size: str = ""
    """Dynamo's frontend: its model's KV blocks and their size (the pool is their product)."""
    engine_time: tuple[str, ...] = ()
    """Histograms whose sums, added, are the seconds requests spent in the engine up to their first token (its
    queue and its prefill steps, by the engine's own clock): the rest of a client's time to first token is the way
    there and back (:attr:`kvgate.engine.costmodel.Profile.request_s`)."""


@dataclass(frozen=True)
class EngineKind:
    """What one kind of engine (or front) says on the wire beyond the APIs."""

    name: str
    metrics: Metrics = field(default_factory=Metrics)
    pool_source: str = ""
    """Where the KV pool C is read, as :func:`kvgate.http.openai.discover` reads it."""
    info_paths: tuple[str, ...] = ()
    """Where it describes itself (GET, in order)."""
    flush_path: str | None = None
    """The prefix-cache flush (POST)."""
    flush_busy: int | None = None
    """The status the flush answers while requests run (then retried), None: it preempts them instead."""
    report_flag: str = ""
    """The server flag that makes usage carry cached tokens."""
    caching_flag: str = ""
    """How prefix caching is turned on."""
    omits_zero_cached: bool = False
    """With cached-token reporting on, a turn that hit nothing has no ``cached_tokens`` field (it reads as 0)."""

    def cached(self, usage: Usage, cache_report: bool | None) -> int | None:
        """A turn's cached tokens with the kind's quirks applied: an SGLang that reports cached tokens omits 0."""
        if usage.cached is None and self.omits_zero_cached and cache_report:
            return 0
        return usage.cached


VLLM = EngineKind(
    "vllm",
    Metrics(running="vllm:num_requests_running", waiting="vllm:num_requests_waiting",
            kv_usage=("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
            prefix_queries="vllm:prefix_cache_queries", prefix_hits="vllm:prefix_cache_hits",
            preemptions="vllm:num_preemptions", cache_config="vllm:cache_config_info",
            engine_time=("vllm:request_queue_time_seconds", "vllm:request_prefill_time_seconds")),
    pool_source="/metrics: vllm:cache_config_info{num_gpu_blocks, block_size}",
    flush_path="/reset_prefix_cache?reset_running_requests=true", flush_busy=None,
    report_flag="--enable-prompt-tokens-details",
    caching_flag="--enable-prefix-caching (and without --no-enable-prefix-caching)",
)
SGLANG = EngineKind(
    "sglang",
    Metrics(running="sglang:num_running_reqs", waiting="sglang:num_queue_reqs", kv_usage=("sglang:token_usage",),
            hit_rate="sglang:cache_hit_rate"),
    pool_source="/server_info: max_total_num_tokens", info_paths=("/server_info", "/get_server_info"),
    flush_path="/flush_cache", flush_busy=400,
    report_flag="--enable-cache-report", caching_flag="without --disable-radix-cache", omits_zero_cached=True,
)
DYNAMO = EngineKind(
    "dynamo",
    Metrics(running="dynamo_frontend_inflight_requests", waiting="dynamo_frontend_queued_requests",
            kv_blocks="dynamo_frontend_model_total_kv_blocks", block_size="dynamo_frontend_model_kv_cache_block_size"),
    pool_source="/metrics: dynamo_frontend_model_total_kv_blocks x dynamo_frontend_model_kv_cache_block_size",
)
GATEWAY = EngineKind("kvgate-gateway", pool_source="/kvgate/info: its upstream's pool", info_paths=("/kvgate/info",))
UNKNOWN = EngineKind("unknown")
KINDS: dict[str, EngineKind] = {k.name: k for k in (VLLM, SGLANG, DYNAMO, GATEWAY, UNKNOWN)}
"""The engine kinds by name (:attr:`EngineInfo.kind`)."""


def kind_of(name: str) -> EngineKind:
    """The kind named ``name`` (:data:`UNKNOWN` for any other name)."""
    return KINDS.get(name, UNKNOWN)


FLUSH_PATHS = frozenset(k.flush_path.partition("?")[0] for k in KINDS.values() if k.flush_path)
"""Every kind's flush path (a gateway in front of a fleet sends a flush to every replica)."""
