"""One served engine: the simulated engine a :class:`~kvgate.serve.config.ServerConfig` names, its pool as vLLM
reports it, the content bridge and the engine loop in front of it, the tokenizer and the served model."""

from __future__ import annotations

import os
import time

from kvgate.engine.base import Engine
from kvgate.engine.cache import RunKVPool
from kvgate.engine.costmodel import profile as get_profile
from kvgate.engine.factory import build_engine
from kvgate.errors import UsageError
from kvgate.serve.agent import AgentPolicy
from kvgate.serve.bridge import BRIDGE_MEMORY, ContentBridge, bridge_block
from kvgate.serve.config import ServerConfig, engine_config
from kvgate.serve.kvevents import KVEventPublisher
from kvgate.serve.loop import EngineLoop
from kvgate.serve.tokenizer import Tokenizer

_ID_PREFIX = {"completions": "cmpl-", "chat": "chatcmpl-", "responses": "resp_", "messages": "msg_"}


class ServedEngine:
    """What every route reads. ``engine`` overrides the one the config builds (tests serve the vLLM engine under
    the SGLang API this way)."""

    def __init__(self, cfg: ServerConfig, engine: Engine | None = None) -> None:
        cfg.validate()
        self.cfg = cfg
        self.engine: Engine = engine if engine is not None else build_engine(engine_config(cfg), capped=True)
        self.profile = get_profile(cfg.profile)
        self.model = cfg.model_name()
        self.max_model_len = self.profile.max_model_len
        self.block_size: int = self.engine.block_size
        usable = self.engine.num_blocks  # the blocks requests can fill on the empty pool
        self.kv_pool: int = usable * self.block_size
        """The pool as vLLM's scheduler sees it: what requests can fill."""
        self.num_gpu_blocks = usable + 1
        """As vLLM reports it: the usable blocks plus its null block (block 0), so that the pool discovery's
        ``(num_gpu_blocks - 1) x block_size`` is :attr:`kv_pool`."""
        self.bridge = ContentBridge(
            self.block_size, caching=cfg.prefix_caching, caps=self.engine.hit_caps,
            max_blocks=BRIDGE_MEMORY * (self.kv_pool // bridge_block(self.block_size)) + 1,
        )
        self.loop = EngineLoop(self.engine, self.bridge, cfg.time_scale, cfg.slice_ms / 1000.0)
        self.kv_events: KVEventPublisher | None = None
        """The KV event publisher (``--kv-events-config``), the pool's observer; None when off."""
        if cfg.kv_events is not None and cfg.kv_events.enabled:
            pool = getattr(self.engine, "pool", None)
            if not isinstance(pool, RunKVPool):
                raise UsageError("--kv-events-config: this engine's pool does not report KV events")
            self.kv_events = KVEventPublisher(cfg.kv_events, self.block_size)
            pool.observe(self.kv_events)
            self.loop.events = self.kv_events
        bs = self.block_size
        per_request = -(-self.max_model_len // bs)
        self.cache_config = {
            "block_size": str(bs),
            "num_gpu_blocks": str(self.num_gpu_blocks),
            # vLLM's: max_model_len x the whole max-length requests that fit (not the pool)
            "kv_cache_size_tokens": str(int(self.num_gpu_blocks / per_request * self.max_model_len)),
            "hash_block_size": str(bs),
            "cache_hit_alignment_tokens": str(bs),
            "enable_prefix_caching": str(cfg.prefix_caching),
        }
        """The labels of ``vllm:cache_config_info``, as vLLM 0.32 reports them (those kvgate knows)."""
        self.created_block = bs if cfg.engine == "vllm" and cfg.prefix_caching else 0
        """The block of usage's ``created_cache_tokens`` (vLLM's engine with prefix caching), else 0 (none)."""
        self.cache_details: bool | None = True if cfg.cache_report else (None if cfg.engine == "vllm" else False)
        """Cached-token details in usage: True; None (vLLM's null); False (absent, as SGLang without the flag)."""
        self.tokenizer = Tokenizer()
        self.agent = AgentPolicy(cfg.agent)
        """Decides the replies to requests that offer tools (:mod:`kvgate.serve.agent`)."""
        self.created = int(time.time())
        self._rid = 0
        self._rid_prefix = os.urandom(4).hex()

    def next_rid(self) -> int:
        """A new engine request id."""
        self._rid += 1
        return self._rid

    def response_id(self, rid: int, api: str) -> str:
        """The id of request ``rid``'s answer in ``api``'s form (unique across restarts)."""
        return _ID_PREFIX.get(api, "cmpl-") + self._rid_prefix + format(rid, "x")

    def queue_lengths(self) -> tuple[int, int]:
        """Requests running, and waiting (in the engine's queue, or parsed and about to join it)."""
        running, waiting = self.engine.queue_lengths()
        return running, waiting + self.loop.pending()
