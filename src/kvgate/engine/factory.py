"""One engine config and the one place an engine is built from it (the simulator and ``kvgate engine`` alike)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from kvgate.engine.base import Engine
from kvgate.engine.costmodel import profile as get_profile
from kvgate.errors import UsageError


@dataclass(frozen=True)
class EngineConfig:
    """Everything that defines a simulated engine."""

    engine: str = "vllm"
    profile: str = "qwen3-8b-mi300x"
    kv_pool: int | None = None
    """The KV pool C in tokens (None: the profile's)."""
    prefix_caching: bool = True
    block_size: int = 16
    cpu_offload_tokens: int = 0
    offload_bandwidth_gbs: float = 50.0
    offload_latency_s: float = 0.015
    offload_policy: str = "write-through"
    """Which blocks the host tier holds: vLLM's connector (every computed block, LRU by store or load) or
    "on-evict" (what the GPU pool evicts); ``engine/offload.py``."""
    mixed_decode_factor: float | None = None
    mixed_share_exponent: float | None = None
    """Overrides of the profile's mixed-step constants (the calibration's scans; None: the profile's)."""
    sglang_policy: str = "fcfs"
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    evict_sessions: bool = False
    retention: bool = False
    pin_ttl_s: float = 0.0
    prefix_first: int = 0

    def check_engine(self) -> None:
        """Raise UsageError (one line, named by the command-line option) for an engine that is not modelled."""
        if self.engine not in ("vllm", "sglang"):
            raise UsageError(f"unknown engine {self.engine!r}; choose vllm or sglang")
        if self.block_size < 1:
            raise UsageError("--block-size must be a positive number of tokens")
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise UsageError("--max-num-batched-tokens and --max-num-seqs must be positive")
        if not self.offload_bandwidth_gbs > 0 or not self.offload_latency_s >= 0:
            raise UsageError("--offload-bandwidth must be positive and --offload-latency non-negative")
        if self.pin_ttl_s < 0 or self.prefix_first < 0:
            raise UsageError("--pin-ttl and --prefix-first must be non-negative")
        if self.engine != "vllm" and (self.evict_sessions or self.retention or self.pin_ttl_s or self.prefix_first):
            raise UsageError("the engine-side alternatives are options of the simulated vLLM (--engine vllm)")


def build_engine(cfg: EngineConfig, *, capped: bool = False) -> Engine:
    """The engine ``cfg`` names; raises UsageError for a combination that is not modelled. ``capped``: the vLLM
    pool caps hits per session (``kvgate engine``'s content bridge; see :mod:`kvgate.engine.capped`)."""
    prof = get_profile(cfg.profile)
    if cfg.mixed_decode_factor is not None:
        prof = replace(prof, mixed_decode_factor=cfg.mixed_decode_factor)
    if cfg.mixed_share_exponent is not None:
        prof = replace(prof, mixed_share_exponent=cfg.mixed_share_exponent)
    pool = cfg.kv_pool or prof.kv_pool
    limits = {"max_num_batched_tokens": cfg.max_num_batched_tokens, "max_num_seqs": cfg.max_num_seqs}
    if cfg.engine == "vllm":
        from kvgate.engine.vllm import VllmEngine

        bs = cfg.block_size
        alt = {
            "session_aware": cfg.evict_sessions, "retention": cfg.retention, "pin_ttl_s": cfg.pin_ttl_s,
            "prefix_first": cfg.prefix_first,
        }
        if cfg.cpu_offload_tokens:
            if cfg.evict_sessions or cfg.retention:
                raise UsageError("session-aware eviction and retention are not modelled with the CPU offload tier")
            from kvgate.engine.offload import OffloadKVPool

            alt = {"pin_ttl_s": cfg.pin_ttl_s, "prefix_first": cfg.prefix_first}
            kv = OffloadKVPool(
                pool // bs, bs, cfg.cpu_offload_tokens // bs, prof, enable_caching=cfg.prefix_caching,
                bandwidth_gbs=cfg.offload_bandwidth_gbs, latency_s=cfg.offload_latency_s, policy=cfg.offload_policy,
            )
            return VllmEngine(prof, pool, prefix_caching=cfg.prefix_caching, pool=kv, block_size=bs, **limits, **alt)
        if capped:
            from kvgate.engine.capped import CappedKVPool

            kv = CappedKVPool(pool // bs, bs, cfg.prefix_caching)
            return VllmEngine(prof, pool, prefix_caching=cfg.prefix_caching, pool=kv, block_size=bs, **limits, **alt)
        return VllmEngine(prof, pool, prefix_caching=cfg.prefix_caching, block_size=bs, **limits, **alt)
    if cfg.engine == "sglang":
        from kvgate.engine.sglang import SglangEngine

        return SglangEngine(prof, pool, prefix_caching=cfg.prefix_caching, policy=cfg.sglang_policy, **limits)
    raise UsageError(f"unknown engine {cfg.engine!r}; choose vllm or sglang")
