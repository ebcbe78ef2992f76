"""The served engine's config: the engine's own (:class:`~kvgate.engine.factory.EngineConfig`) plus serving's."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from kvgate.engine.costmodel import profile as get_profile
from kvgate.engine.factory import EngineConfig
from kvgate.errors import UsageError
from kvgate.serve.agent import AgentTurns
from kvgate.serve.kvevents import KVEventsConfig
from kvgate.serve.tokenizer import BLOCK

MODEL_NAMES = {"qwen3-8b-mi300x": "Qwen/Qwen3-8B", "qwen3-32b-mi300x": "Qwen/Qwen3-32B"}
"""Default served model name per profile (any other profile serves under its own name)."""


@dataclass(frozen=True)
class ServerConfig(EngineConfig):
    """Everything that defines a served engine: the engine (inherited fields) and how it is served.

    ``block_size`` is the simulated vLLM's (16 by default; vLLM's CPU build uses 128); the SGLang engine's page is
    1 token whatever it says (``kvgate engine`` refuses ``--block-size`` other than 1 with ``--engine sglang``)."""

    time_scale: float = 30.0
    model: str | None = None
    slice_ms: float = 2.0
    """Real milliseconds a decode jump may run ahead of the next possible arrival."""
    cache_report: bool = True
    """Report cached prompt tokens in ``usage`` (vLLM's ``--enable-prompt-tokens-details``, SGLang's
    ``--enable-cache-report``). Off: vLLM answers ``"prompt_tokens_details": null``, SGLang omits it."""
    kv_events: KVEventsConfig | None = None
    """vLLM's ``--kv-events-config``: publish the pool's KV cache events on ZMQ (:mod:`kvgate.serve.kvevents`)."""
    agent: AgentTurns = AgentTurns()
    """How requests that offer tools are answered: the session shape (``--agent-turns``), the seed, spawning tools
    (:mod:`kvgate.serve.agent`)."""

    def validate(self) -> None:
        get_profile(self.profile)
        self.check_engine()
        bs = self.block_size
        if not (bs % BLOCK == 0 or BLOCK % bs == 0):
            raise UsageError(f"--block-size {bs}: must divide {BLOCK} or be a multiple of it (e.g. 16, 128)")
        if self.cpu_offload_tokens:
            raise UsageError("--cpu-offload-tokens: the served engine has no host tier (its content bridge caps a "
                             "session's hits in the GPU pool only); the simulator models it (kvgate sim)")
        if not math.isfinite(self.time_scale) or self.time_scale <= 0:
            raise UsageError("--time-scale must be a positive number")
        if self.kv_pool is not None and self.kv_pool < max(BLOCK, bs):
            raise UsageError(f"--kv-pool must be at least {max(BLOCK, bs)} tokens (one block)")
        self.agent.validate()
        if self.slice_ms <= 0:
            raise UsageError("--slice-ms must be positive")
        if self.kv_events is not None and self.kv_events.enabled:
            if self.engine != "vllm":
                raise UsageError("--kv-events-config: KV events are published by the vllm engine only")
            if bs % BLOCK:
                raise UsageError(f"--kv-events-config: needs a --block-size that is a multiple of {BLOCK}")

    def model_name(self) -> str:
        return self.model or MODEL_NAMES.get(self.profile, self.profile)


def check_block_size(engine: str, block_size: int | None) -> None:
    """``--block-size`` as given on the command line (None: not given) for ``--engine``: SGLang's page is 1."""
    if block_size is not None and engine == "sglang" and block_size != 1:
        raise UsageError("--block-size: the SGLang engine's page is 1 token")


def engine_config(cfg: ServerConfig) -> EngineConfig:
    """The engine part of a served config."""
    return EngineConfig(**{f.name: getattr(cfg, f.name) for f in dataclasses.fields(EngineConfig)})
