"""A host-memory (CPU) tier behind the GPU KV pool, in the manner of vLLM's native CPU offloading.

Blocks of a session evicted from the GPU pool move to the host tier, which keeps them in LRU order of arrival
and drops the oldest session's tail first when full. A lookup continues past the GPU hit into the host tier
while the blocks stay contiguous; the host part of a hit is loaded into freshly allocated GPU blocks at
``bandwidth_gbs`` instead of being recomputed, and the engine charges that transfer to the step that admits
the request. Reported cached tokens include host hits (as vLLM counts connector hits). Group-prefix blocks are
not offloaded: they are evicted only when no request has used them for a long time.
"""

from __future__ import annotations

from collections import OrderedDict

from kvgate.engine.blocks import SeqKey
from kvgate.engine.cache import RunKVPool
from kvgate.engine.costmodel import Profile


class OffloadKVPool(RunKVPool):
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        host_blocks: int,
        profile: Profile,
        *,
        enable_caching: bool = True,
        bandwidth_gbs: float = 8.0,
        latency_s: float = 0.0,
    ) -> None:
        super().__init__(num_blocks, block_size, enable_caching, on_evict=self._on_evict_session)
        self.host_blocks = host_blocks
        self.bytes_per_block = profile.kv_bytes_per_token * block_size
        self.bandwidth = bandwidth_gbs * 1e9
        self.latency_s = latency_s
        self._host: OrderedDict[int, list[int]] = OrderedDict()  # session -> [lo, hi) session-relative blocks
        self._host_used = 0
        self.loaded_tokens = 0  # host tokens loaded by the last admit
        self.host_hits = 0

    # -- host tier ----------------------------------------------------------------------------------------
    def _on_evict_session(self, sid: int, lo: int, hi: int) -> None:
        """The GPU pool's eviction hook: blocks ``[lo, hi)`` of session ``sid`` move to the host tier."""
        if self.host_blocks <= 0:
            return
        cur = self._host.pop(sid, None)
        if cur is not None:
            self._host_used -= cur[1] - cur[0]
            # merge when the new tail touches or overlaps what the host already holds
            cur = [min(lo, cur[0]), max(hi, cur[1])] if lo <= cur[1] and hi >= cur[0] else [lo, hi]
        else:
            cur = [lo, hi]
        self._host[sid] = cur
        self._host_used += cur[1] - cur[0]
        while self._host_used > self.host_blocks:
            old_sid, rng = next(iter(self._host.items()))
            drop = min(self._host_used - self.host_blocks, rng[1] - rng[0])
            rng[1] -= drop
            self._host_used -= drop
            if rng[1] <= rng[0]:
                del self._host[old_sid]

    def _host_extra(self, seq: SeqKey, gpu_hit: int, num_tokens: int) -> int:
        """Blocks the host tier adds after a GPU hit of ``gpu_hit`` tokens."""
        bs = self.block_size
        rel = gpu_hit // bs - seq.group_blocks
        if rel < 0 or not self.enable_caching:
            return 0
        rng = self._host.get(seq.session)
        if rng is None or not rng[0] <= rel < rng[1]:
            return 0
        cap = (num_tokens - 1) // bs - seq.group_blocks
        return max(0, min(rng[1], cap) - rel)

    # -- pool API -----------------------------------------------------------------------------------------
    def lookup(self, seq: SeqKey, num_tokens: int) -> int:
        gpu = super().lookup(seq, num_tokens)
        return gpu + self._host_extra(seq, gpu, num_tokens) * self.block_size

    def admit(
        self, rid: int, seq: SeqKey, num_tokens: int, hit_tokens: int, upto_tokens: int, fit_tokens: int = 0
    ) -> bool:
        gpu = super().lookup(seq, num_tokens)
        gpu = min(gpu, hit_tokens)
        ok = super().admit(rid, seq, num_tokens, gpu, upto_tokens, fit_tokens)
        self.loaded_tokens = hit_tokens - gpu if ok else 0
        if ok and self.loaded_tokens:
            self.host_hits += self.loaded_tokens
            if seq.session in self._host:
                self._host.move_to_end(seq.session)
        return ok

    def load_seconds(self, tokens: int) -> float:
        return self.latency_s + tokens / self.block_size * self.bytes_per_block / self.bandwidth

    def reset(self) -> bool:
        ok = super().reset()
        if ok:
            self._host.clear()
            self._host_used = 0
        return ok
