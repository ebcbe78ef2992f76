"""The pool's KV-event hooks (``RunKVPool.observe``) against its own state (``cached_blocks``), step by step.

The simulated vLLM engine drives the pool with agent sessions (a group prefix shared by some, turns that extend
the previous prompt and output), a pool small enough to evict and preempt, resets, and the tiered eviction
orders; an observer that counts copies per content key from the hooks alone must agree with the pool after
every step. ``kvgate engine``'s capped continuations (``forget``) are covered by tests/serve/test_kv_events.py.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from kvgate.engine.base import Request
from kvgate.engine.blocks import SeqKey
from kvgate.engine.cache import RunKVPool
from kvgate.engine.costmodel import QWEN3_8B_MI300X as P
from kvgate.engine.vllm import VllmEngine

Key = tuple[str, int, int, int]


class Counting:
    """Copies per content key, from the hooks alone."""

    def __init__(self) -> None:
        self.copies: Counter[Key] = Counter()
        self.stores = self.evictions = self.clears = 0

    def stored(self, seq: SeqKey, first: int, last: int) -> None:
        assert 0 <= first < last
        self.stores += 1
        gb = seq.group_blocks
        for i in range(first, last):
            self.copies[("g", seq.group, gb, i) if i < gb else ("s", seq.session, 0, i - gb)] += 1

    def evicted(self, sid: int, lo: int, hi: int) -> None:
        assert 0 <= lo < hi
        for i in range(lo, hi):
            self._drop(("s", sid, 0, i))

    def evicted_group(self, key: tuple[int, int], idx: int) -> None:
        self._drop(("g", key[0], key[1], idx))

    def _drop(self, k: Key) -> None:
        assert self.copies[k] > 0, f"evicted {k} that was never stored"
        self.evictions += 1
        self.copies[k] -= 1
        if not self.copies[k]:
            del self.copies[k]

    def forgot(self, sid: int, rel: int, orphan: int | None) -> None:
        raise AssertionError("an uncapped pool never forgets")

    def cleared(self) -> None:
        self.clears += 1
        self.copies.clear()


def pool_state(pool: RunKVPool) -> Counter[Key]:
    groups, sessions = pool.cached_blocks()
    out: Counter[Key] = Counter()
    for (g, gb), idx, n in groups:
        out[("g", g, gb, idx)] += n
    for sid, lo, hi in sessions:
        for i in range(lo, hi):
            out[("s", sid, 0, i)] += 1
    return out


@pytest.mark.parametrize("order", ["lru", "session_aware", "retention"])
@pytest.mark.parametrize("seed", range(4))
def test_hooks_follow_the_pool_through_evictions_preemptions_and_resets(seed: int, order: str) -> None:
    rng = random.Random(seed)
    bs = rng.choice([16, 128])
    pool = RunKVPool(rng.randint(40, 120), bs, session_aware=order == "session_aware", retention=order == "retention")
    seen = Counting()
    pool.observe(seen)
    eng = VllmEngine(P, pool.num_blocks * bs, block_size=bs, pool=pool, max_num_batched_tokens=4 * bs)
    groups = [(g, rng.randint(1, 6)) for g in range(1, 4)]
    context: dict[int, int] = {}  # session -> tokens of its previous prompt + output
    keys: dict[int, SeqKey] = {}
    busy: set[int] = set()
    rid, now = 0, 0.0
    for _ in range(400):
        for s in range(12):
            if s not in busy and rng.random() < 0.3:
                g, gb = groups[s % 3] if s % 4 else (0, 0)
                prompt = context.get(s, gb * bs) + rng.randint(1, 5 * bs)
                if prompt + 64 > pool.num_blocks * bs:
                    context.pop(s, None)  # the session ends; a new one takes its place
                    continue
                rid += 1
                if s not in context:
                    keys[s] = SeqKey(g, gb, rid)
                eng.add(Request(rid, keys[s], prompt, 64, now, s))
                busy.add(s)
            elif s not in busy and order == "session_aware" and rng.random() < 0.2:
                eng.session_status(s, rng.choice(["parked", "admitted"]))
        res = eng.step(now, now + 1.0)
        now += max(res.duration, 0.001)
        for req in res.finished:
            s = req.tag
            assert isinstance(s, int)
            busy.discard(s)
            context[s] = req.num_tokens
        if rng.random() < 0.02:
            eng.flush(preempt=rng.random() < 0.5)
        assert seen.copies == pool_state(pool)
    assert seen.stores and seen.evictions and seen.evictions == pool.evictions
