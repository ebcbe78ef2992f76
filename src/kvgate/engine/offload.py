"""A host-memory (CPU) tier behind the GPU KV pool, in the manner of vLLM's native CPU offloading.

A lookup continues past the GPU hit into the host tier while the blocks stay contiguous; the host part of a hit is
loaded into freshly allocated GPU blocks at ``bandwidth_gbs`` (plus ``latency_s`` a load) instead of being
recomputed, and the engine charges that transfer to the step that admits the request. Reported cached tokens
include host hits (as vLLM counts connector hits). Group-prefix blocks are not offloaded: they are evicted only when
no request has used them for a long time. Which blocks the host holds depends on the ``policy``:

* ``"write-through"`` (the default: vLLM's ``OffloadingConnector`` with its CPU backend, 0.1x-0.3x): every block is
  stored to the host as it is computed (chunks of one GPU block, ``blocks_per_chunk = 1``; no store threshold), and
  the host evicts the least recently used chunk, a chunk's recency being set when it is stored and when a request
  loads or re-stores it -- never by a hit in the GPU pool, which the connector does not see (it looks up only what
  lies beyond the GPU hit). Within a request's chunks the tail is older than the head (the request's keys are
  re-ranked head-last at its end). So a session whose turns keep hitting in the GPU leaves its early chunks, stored
  turns ago, to age in the host while its recent ones stay fresh: once the GPU evicts it, its host copy may start
  past a gap that no lookup can cross.
* ``"on-evict"``: blocks move to the host when the GPU pool evicts them, kept per session in LRU order of arrival,
  the oldest session's tail dropped first when full (kvgate's tier before it followed the connector).
"""

from __future__ import annotations

import heapq
from collections import OrderedDict

from kvgate.engine.blocks import SeqKey
from kvgate.engine.cache import RunKVPool
from kvgate.engine.costmodel import Profile
from kvgate.engine.runs import PoolObserver

POLICIES = ("write-through", "on-evict")


class WriteThroughHost:
    """vLLM's CPU tier as its connector fills it: every computed session block stored, LRU by store or load.

    A session's host blocks are segments ``[lo, hi)`` (session-relative blocks) of one rank each; a larger rank is
    more recent. Eviction takes the lowest-ranked segment, its tail first. The heap holds ``(rank, sid, lo)``
    entries, stale ones skipped lazily."""

    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = capacity_blocks
        self.used = 0
        self.segs: dict[int, list[list[int]]] = {}  # sid -> sorted [[lo, hi, rank], ...]
        self._heap: list[tuple[int, int, int]] = []
        self._rank = 0

    def put(self, sid: int, lo: int, hi: int) -> None:
        """Blocks ``[lo, hi)`` of ``sid`` were stored, or loaded: all of them now have the newest rank."""
        if hi <= lo or self.capacity <= 0:
            return
        self._drop(sid, lo, hi)
        self._rank += 1
        segs = self.segs.setdefault(sid, [])
        segs.append([lo, hi, self._rank])
        segs.sort()
        self.used += hi - lo
        heapq.heappush(self._heap, (self._rank, sid, lo))
        self._evict()

    def forget(self, sid: int, rel: int) -> None:
        """The session's content from block ``rel`` on changed: its host copy from there is no longer a prefix."""
        self._drop(sid, rel, 1 << 60)

    def extent(self, sid: int, rel: int) -> int:
        """End of the contiguous host blocks of ``sid`` starting at block ``rel`` (``rel`` when none)."""
        end = rel
        for lo, hi, _ in self.segs.get(sid, ()):
            if lo > end:
                break
            if hi > end:
                end = hi
        return end

    def clear(self) -> None:
        self.segs.clear()
        self._heap.clear()
        self.used = 0

    def _drop(self, sid: int, lo: int, hi: int) -> None:
        segs = self.segs.get(sid)
        if not segs:
            return
        keep = []
        for a, b, r in segs:
            if b <= lo or a >= hi:
                keep.append([a, b, r])
                continue
            self.used -= min(b, hi) - max(a, lo)
            if a < lo:
                keep.append([a, lo, r])
            if b > hi:
                keep.append([hi, b, r])
                heapq.heappush(self._heap, (r, sid, hi))
        if keep:
            self.segs[sid] = keep
        else:
            del self.segs[sid]

    def _evict(self) -> None:
        while self.used > self.capacity and self._heap:
            rank, sid, lo = self._heap[0]
            seg = next((x for x in self.segs.get(sid, ()) if x[0] == lo and x[2] == rank), None)
            if seg is None:
                heapq.heappop(self._heap)
                continue
            drop = min(self.used - self.capacity, seg[1] - seg[0])
            seg[1] -= drop  # the tail first
            self.used -= drop
            if seg[1] <= seg[0]:
                heapq.heappop(self._heap)
                self.segs[sid].remove(seg)
                if not self.segs[sid]:
                    del self.segs[sid]


class _Stores:
    """The GPU pool's observer while the write-through tier listens: stores go to the host, everything is passed on
    to the observer kvgate's KV events attached, if any."""

    def __init__(self, host: WriteThroughHost) -> None:
        self.host = host
        self.next: PoolObserver | None = None

    def stored(self, seq: SeqKey, first: int, last: int) -> None:
        gb = seq.group_blocks
        if last > gb and seq.session >= 0:
            self.host.put(seq.session, max(first, gb) - gb, last - gb)
        if self.next is not None:
            self.next.stored(seq, first, last)

    def evicted(self, sid: int, lo: int, hi: int) -> None:
        if self.next is not None:
            self.next.evicted(sid, lo, hi)

    def evicted_group(self, key: tuple[int, int], idx: int) -> None:
        if self.next is not None:
            self.next.evicted_group(key, idx)

    def forgot(self, sid: int, rel: int, orphan: int | None) -> None:
        self.host.forget(sid, rel)
        if self.next is not None:
            self.next.forgot(sid, rel, orphan)

    def cleared(self) -> None:
        if self.next is not None:
            self.next.cleared()


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
        policy: str = "write-through",
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"unknown offload policy {policy!r}; choose from {', '.join(POLICIES)}")
        self.policy = policy
        wt = policy == "write-through"
        super().__init__(num_blocks, block_size, enable_caching, on_evict=None if wt else self._on_evict_session)
        self.host_blocks = host_blocks
        self.bytes_per_block = profile.kv_bytes_per_token * block_size
        self.bandwidth = bandwidth_gbs * 1e9
        self.latency_s = latency_s
        self._host: OrderedDict[int, list[int]] = OrderedDict()  # on-evict: session -> [lo, hi) blocks
        self._host_used = 0
        self._wt = WriteThroughHost(host_blocks) if wt else None
        self._stores = _Stores(self._wt) if self._wt is not None else None
        if self._stores is not None:
            super().observe(self._stores)
        self.loaded_tokens = 0  # host tokens loaded by the last admit
        self.host_hits = 0

    def observe(self, observer: PoolObserver | None) -> None:
        if self._stores is not None:
            self._stores.next = observer
        else:
            super().observe(observer)

    # -- host tier, on-evict --------------------------------------------------------------------------------
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
        cap = (num_tokens - 1) // bs - seq.group_blocks
        if self._wt is not None:
            return max(0, min(self._wt.extent(seq.session, rel), cap) - rel)
        rng = self._host.get(seq.session)
        if rng is None or not rng[0] <= rel < rng[1]:
            return 0
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
            if self._wt is None and seq.session in self._host:
                self._host.move_to_end(seq.session)
            # write-through: the loaded blocks were just re-stored by the allocation above (the newest rank)
        return ok

    def load_seconds(self, tokens: int) -> float:
        return self.latency_s + tokens / self.block_size * self.bytes_per_block / self.bandwidth

    def reset(self) -> bool:
        ok = super().reset()
        if ok:
            self._host.clear()
            self._host_used = 0
            if self._wt is not None:
                self._wt.clear()
        return ok
