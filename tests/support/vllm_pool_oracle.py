"""vLLM's own prefix-cached KV pool behind kvgate's :class:`kvgate.engine.blocks.KVPool` protocol (a test oracle).

``VllmKVPool`` drives vLLM v1's ``KVCacheManager`` (and through it ``BlockPool``), the pure-Python code vLLM's
scheduler calls, with concrete token ids and vLLM's own block hashes, so that kvgate's pools can be compared
with it call for call. kvgate's vocabulary maps onto vLLM's like this:

* token identity: a :class:`SeqKey` names an infinite, append-only token stream: position ``p`` holds token
  ``group_token(group, p)`` for ``p < group_blocks * block_size`` (the group prefix every session of the group
  shares), else ``session_token(session, p)``. A request of ``num_tokens`` tokens is the stream's first
  ``num_tokens`` tokens; tokens decoded later are the stream's next ones (``append_output_token_ids``);
* ``lookup`` = ``get_computed_blocks`` on a fresh ``Request`` (pure: stats are off);
* ``admit`` = ``get_computed_blocks`` then ``allocate_slots(request, upto - hit, hit, blocks,
  full_sequence_must_fit=fit_tokens > 0)``; ``None`` is ``False``;
* ``grow`` = ``allocate_slots(request, upto - computed)`` with ``num_computed_tokens`` set to what the previous
  allocation covered (vLLM's scheduler advances it when it schedules the tokens);
* ``free`` (a finished, preempted or aborted request) = ``KVCacheManager.free``. A preempted request comes back
  as a new ``admit`` with the same tokens: vLLM's scheduler frees it and recomputes it from its prefix hit;
* ``reset`` = ``reset_prefix_cache``;
* evictions: vLLM's ``BlockRemoved`` KV-cache events (``enable_kv_cache_events``), each mapped back to the
  content key of the block whose hash it names (``eviction_log``, the reference pool's vocabulary).

The null block: vLLM reserves block 0 of ``num_gpu_blocks`` as a placeholder that is never free. kvgate's
``num_blocks`` counts the blocks a request can hold, so ``VllmKVPool(n)`` builds vLLM's pool with
``num_blocks = n + 1`` and both report ``n`` free blocks when idle.
"""

from __future__ import annotations

import logging

import torch
from vllm.distributed.kv_events import BlockRemoved
from vllm.sampling_params import SamplingParams
from vllm.utils.hashing import sha256
from vllm.v1.core.kv_cache_manager import KVCacheManager
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash, maybe_convert_block_hash
from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
from vllm.v1.request import Request, RequestStatus

from kvgate.engine.blocks import SeqKey
from support.reference_cache import ContentKey, content_key

VLLM_VERSION = "0.32.0"
"""The vLLM release this oracle was written against (the parity kvgate's pools are held to)."""

_SPAN = 1 << 32

logging.getLogger("vllm").setLevel(logging.ERROR)  # "Failed to reset prefix cache" is an answer here, not news


def group_token(group: int, pos: int) -> int:
    return 2 * (group * _SPAN + pos)


def session_token(session: int, pos: int) -> int:
    return 2 * (session * _SPAN + pos) + 1


def tokens(seq: SeqKey, start: int, stop: int, block_size: int) -> list[int]:
    """Token ids of positions ``[start, stop)`` of the stream ``seq`` names."""
    g_end = seq.group_blocks * block_size
    g, s = seq.group * _SPAN, seq.session * _SPAN
    # group_token and session_token over the two runs, as ranges (token lists of 40K-token prompts are built often)
    out = list(range(2 * (g + start), 2 * (g + min(stop, g_end)), 2))
    out += range(2 * (s + max(start, g_end)) + 1, 2 * (s + stop) + 1, 2)
    return out


class VllmKVPool:
    """kvgate's KV pool protocol on vLLM's ``KVCacheManager`` (one full-attention KV-cache group)."""

    def __init__(
        self, num_blocks: int, block_size: int = 16, enable_caching: bool = True, max_model_len: int = 1 << 20
    ) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError("num_blocks and block_size must be positive")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        init_none_hash(sha256)
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
        config = KVCacheConfig(
            num_blocks=num_blocks + 1,  # + vLLM's null block
            kv_cache_tensors=[],
            kv_cache_groups=[KVCacheGroupSpec(["layer.0"], spec)],
        )
        self.manager = KVCacheManager(
            config,
            max_model_len=max_model_len,
            scheduler_block_size=block_size,
            hash_block_size=block_size,
            enable_caching=enable_caching,
            enable_kv_cache_events=True,
        )
        self._hasher = get_request_block_hasher(block_size, sha256)
        self._reqs: dict[int, tuple[Request, SeqKey]] = {}
        self._covered: dict[int, int] = {}
        self._key_of: dict[object, ContentKey] = {}
        self._seen: set[object] = set()
        self._evictions = 0
        self.eviction_log: list[ContentKey] = []
        """Content keys evicted by allocation, in order (as ``BlockKVPool.eviction_log``)."""

    # -- helpers ------------------------------------------------------------------------------------------
    def _request(self, rid: int, seq: SeqKey, num_tokens: int) -> Request:
        return Request(
            str(rid),
            tokens(seq, 0, num_tokens, self.block_size),
            SamplingParams(max_tokens=1 << 20),
            None,
            block_hasher=self._hasher,
        )

    def _learn(self, req: Request, seq: SeqKey, start: int) -> None:
        """Remember the content key of each block hash of ``req`` from block ``start`` on (blocks get cached,
        and can be evicted, only through ``admit`` and ``grow``)."""
        seen = self._seen
        for i in range(start, len(req.block_hashes)):
            h = req.block_hashes[i]
            if h not in seen:
                seen.add(h)
                self._key_of[maybe_convert_block_hash(h)] = content_key(seq, i)

    def _drain_events(self) -> None:
        for ev in self.manager.take_events():
            if isinstance(ev, BlockRemoved):
                for h in ev.block_hashes:
                    self._evictions += 1
                    self.eviction_log.append(self._key_of[h])

    # -- the KVPool protocol -------------------------------------------------------------------------------
    @property
    def evictions(self) -> int:
        self._drain_events()
        return self._evictions

    def num_free_blocks(self) -> int:
        return self.manager.block_pool.get_num_free_blocks()

    def holds(self, rid: int) -> bool:
        return rid in self._reqs

    loaded_tokens = 0
    """One tier: no hit is ever loaded."""

    def load_seconds(self, tokens: int) -> float:
        return 0.0

    def set_session_low(self, sid: int, low: bool) -> None:
        """vLLM has no session-aware eviction: ignored."""

    def lookup(self, seq: SeqKey, num_tokens: int) -> int:
        _, hit, _ = self.manager.get_computed_blocks(self._request(-1, seq, num_tokens))
        return hit

    def admit(
        self, rid: int, seq: SeqKey, num_tokens: int, hit_tokens: int, upto_tokens: int, fit_tokens: int = 0
    ) -> bool:
        if rid in self._reqs:
            raise ValueError(f"request {rid} already holds blocks")
        if fit_tokens not in (0, num_tokens):
            raise ValueError("vLLM's admission gate checks the whole prompt: fit_tokens is 0 or num_tokens")
        bs = self.block_size
        req = self._request(rid, seq, num_tokens)
        self._learn(req, seq, 0)
        blocks, hit, _ = self.manager.get_computed_blocks(req)
        if hit_tokens > hit or hit_tokens % bs or not hit_tokens < upto_tokens <= num_tokens:
            raise ValueError(f"bad admission: hit {hit_tokens} (cached {hit}), upto {upto_tokens}, of {num_tokens}")
        if hit_tokens < hit:  # the caller takes less than the cache has (e.g. caching off in the engine)
            blocks = self.manager.create_kv_cache_blocks((list(blocks.blocks[0][: hit_tokens // bs]),))
        new = self.manager.allocate_slots(
            req, upto_tokens - hit_tokens, hit_tokens, blocks, full_sequence_must_fit=fit_tokens > 0
        )
        self._drain_events()
        if new is None:
            return False
        req.status = RequestStatus.RUNNING
        self._reqs[rid] = (req, seq)
        self._covered[rid] = upto_tokens
        return True

    def grow(self, rid: int, upto_tokens: int) -> bool:
        if rid not in self._reqs:
            raise KeyError(f"request {rid} holds no blocks")
        req, seq = self._reqs[rid]
        covered = self._covered[rid]
        if upto_tokens < covered:
            raise ValueError("an allocation never shrinks")
        if upto_tokens == covered:
            return True
        if req.num_tokens < upto_tokens:  # decoded tokens join the request before they get slots
            start = len(req.block_hashes)
            req.append_output_token_ids(tokens(seq, req.num_tokens, upto_tokens, self.block_size))
            self._learn(req, seq, start)
        req.num_computed_tokens = covered
        new = self.manager.allocate_slots(req, upto_tokens - covered)
        self._drain_events()
        if new is None:
            return False
        self._covered[rid] = upto_tokens
        return True

    def free(self, rid: int) -> None:
        if rid not in self._reqs:
            raise KeyError(f"request {rid} holds no blocks")
        req, _ = self._reqs.pop(rid)
        del self._covered[rid]
        self.manager.free(req)

    def reset(self) -> bool:
        ok = self.manager.reset_prefix_cache()
        self._drain_events()
        return bool(ok)

    # -- inspection ----------------------------------------------------------------------------------------
    def free_queue_ids(self) -> list[int]:
        """Block ids of vLLM's free queue, front (reused first) to back."""
        return [b.block_id for b in self.manager.block_pool.free_block_queue.get_all_free_blocks()]

    def request_block_ids(self, rid: int) -> list[int]:
        return list(self.manager.get_block_ids(str(rid))[0])
