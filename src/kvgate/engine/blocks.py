"""What the engine asks of a paged, prefix-cached KV pool, in the vocabulary of vLLM v1's KVCacheManager.

Token identity. kvgate's workloads reuse tokens only as exact prefixes: a shared system prompt common to a
*group* of sessions, then tokens unique to the session, append-only across its turns. So the content of block
``i`` of a request is named by a :class:`SeqKey` without hashing tokens::

    block index:   0 ........ group_blocks-1 | group_blocks ........................
    content key:   (group, i)                | (session, i)
                   '-- shared by the group --'-- unique to the session, grows per turn --'

Two blocks with the same content key hold the same KV, exactly as two vLLM blocks with the same chained hash.

Semantics every implementation follows, exactly those of vLLM 0.32 (``vllm/v1/core/block_pool.py``,
``kv_cache_manager.py``, ``single_type_kv_cache_manager.py``; ``tests/engine/test_vllm_pool_oracle.py`` drives vLLM's
own ``KVCacheManager`` beside both of kvgate's pools and finds no difference in hits, admissions, free
blocks, evictions or eviction order):

* the pool has ``num_blocks`` blocks of ``block_size`` tokens that requests can hold. vLLM reserves one more,
  its null block (block 0, a placeholder never free), so kvgate's ``num_blocks`` is vLLM's
  ``num_gpu_blocks - 1``, the usable pool is ``num_blocks * block_size = (num_gpu_blocks - 1) * block_size``
  tokens, and ``1 - free / num_blocks`` is vLLM's ``kv_cache_usage`` (which excludes the null block too);
* only full blocks are cached; a block is cached when it is allocated for tokens that fill it (vLLM caches at
  ``allocate_slots`` time), generated tokens included;
* lookup walks the request's blocks from 0 and stops at the first block not cached (chained prefix); the hit is
  capped at ``num_tokens - 1`` tokens, rounded down to whole blocks;
* free blocks sit in one queue in reuse order. A request's blocks are released tail first; a block that
  holds no cached content (a partial last block; every block when caching is off) goes to the *front*
  (reused first), a cached one to the back, so cached blocks are evicted in LRU order, a request's last
  block first; a block still referenced by another request is not released;
* cached blocks are touched (ref count up, taken out of the free queue) only when a request is admitted;
* allocation pops blocks from the front of the free queue, evicting their cached content;
* the index keeps every copy of a content key (vLLM never de-duplicates) and a hit touches the oldest.
  Copies arise when requests miss the same group block at once, and when a request recomputes blocks of its
  session whose older copies are still cached (the group prefix in front of them was evicted, or the hit was
  capped); the old copy stays hittable, e.g. by the same request after a preemption or an abort mid-prefill;
* running out of blocks is normal and answered with ``False`` (nothing changes); misuse raises.

Block size and hash blocks. ``block_size`` is any positive size (vLLM's default is 16 on GPUs, 128 in its CPU
build). vLLM 0.32 can hash a request's tokens at a ``hash_block_size`` finer than the allocation block, but
only for hybrid models with several KV-cache groups (it is the gcd of the groups' block sizes), and hits
inside a block only when a Mamba group runs in "align" cache mode; with one full-attention group, which is
every model kvgate simulates, ``hash_block_size == block_size`` (``resolve_kv_cache_block_sizes``; the
``UnitaryKVCacheCoordinator`` asserts it) and every hit is whole blocks. So kvgate models no finer unit.
"""

from __future__ import annotations

from typing import NamedTuple, Protocol


class SeqKey(NamedTuple):
    """Names the token content of a request's blocks (see module docstring)."""

    group: int
    group_blocks: int
    session: int


class KVPool(Protocol):
    """A prefix-cached paged KV pool. ``rid`` identifies a request holding blocks (at most one allocation each)."""

    num_blocks: int
    block_size: int
    evictions: int
    """Cached blocks evicted by allocation so far."""

    def num_free_blocks(self) -> int:
        """Blocks with no reference: empty, or cached and evictable."""
        ...

    def lookup(self, seq: SeqKey, num_tokens: int) -> int:
        """Tokens of a new ``num_tokens``-token request already cached (a multiple of ``block_size``). Pure."""
        ...

    def admit(
        self, rid: int, seq: SeqKey, num_tokens: int, hit_tokens: int, upto_tokens: int, fit_tokens: int = 0
    ) -> bool:
        """Admit a request that holds nothing: touch the ``hit_tokens`` cached prefix found by ``lookup``, then
        allocate blocks to hold ``upto_tokens`` (``hit_tokens < upto_tokens <= num_tokens``), caching the full
        ones. False, with nothing changed, when the free queue cannot supply the blocks (counting the hit blocks
        it must give up), or could not supply blocks for ``fit_tokens`` tokens (vLLM's admission gate
        ``scheduler_reserve_full_isl``: the whole prompt must fit, not just its first chunk)."""
        ...

    def grow(self, rid: int, upto_tokens: int) -> bool:
        """Extend an admitted request's allocation to hold ``upto_tokens`` tokens, caching full blocks.
        False, with nothing changed, when there are not enough free blocks."""
        ...

    def free(self, rid: int) -> None:
        """Release every block of the request, tail first."""
        ...

    def reset(self) -> bool:
        """Drop all cached content (vLLM's ``reset_prefix_cache``). False, with nothing changed, while any block
        is held by a request."""
        ...

    def holds(self, rid: int) -> bool:
        """Whether ``rid`` currently holds blocks."""
        ...

    @property
    def loaded_tokens(self) -> int:
        """Tokens of the last successful ``admit``'s hit loaded from a slower tier rather than found in the pool
        (the offload tier's host memory); always 0 for a pool of one tier."""
        ...

    def load_seconds(self, tokens: int) -> float:
        """The time to load ``tokens`` tokens from the slower tier."""
        ...

    def set_session_low(self, sid: int, low: bool) -> None:
        """Session-aware eviction: the session is parked or ended (``low``), or admitted again. A pool without
        that eviction order ignores the report."""
        ...


def blocks_for(tokens: int, block_size: int) -> int:
    """Blocks needed to hold ``tokens`` tokens."""
    return -(-tokens // block_size)
