"""Token sums of agent turns in time buckets: the gateway's sliding-window hit ratios (:mod:`kvgate.gateway.metrics`)
and each tenant's (:mod:`kvgate.gateway.tenants`)."""

from __future__ import annotations

import math
from collections import deque


class UsageWindows:
    """Token sums of agent turns in time buckets, for sliding windows of up to ``horizon_s`` seconds."""

    __slots__ = ("bucket_s", "horizon_s", "_buckets", "_older")

    def __init__(self, bucket_s: float = 5.0, horizon_s: float = 300.0) -> None:
        self.bucket_s = bucket_s
        self.horizon_s = horizon_s
        # [bucket start, turns, prompt tokens, prompt tokens of turns reporting cached, cached tokens]
        self._buckets: deque[list[float]] = deque()
        self._older: dict[float, tuple[list[float], int, int, tuple[float, float, float, float]]] = {}
        """Per span: (the last bucket, the buckets then, the first bucket in the span, the sums of the span's
        buckets but the last): the sums are kept while no bucket is added and the span still starts there."""

    def add(self, now: float, prompt: int, cached: int | None) -> None:
        b = self._buckets
        start = now - now % self.bucket_s
        if not b or b[-1][0] != start:
            b.append([start, 0, 0, 0, 0])
            limit = now - self.horizon_s - self.bucket_s
            while b[0][0] < limit:
                b.popleft()
        row = b[-1]
        row[1] += 1
        row[2] += prompt
        if cached is not None:
            row[3] += prompt
            row[4] += cached

    def totals(self, now: float, span_s: float) -> tuple[int, int, int, int]:
        """``(turns, prompt tokens, prompt tokens with cached reported, cached tokens)`` over the last ``span_s``.

        The turns of every bucket the span reaches (integers: the sums are exact, in any order); the sums of the
        buckets before the last are kept from one call to the next (O(1) a turn) while they stay the same."""
        since = now - span_s
        b = self._buckets
        size = self.bucket_s
        if not b or b[-1][0] + size <= since:
            return 0, 0, 0, 0
        last = b[-1]
        kept = self._older.get(span_s)
        if kept is not None and kept[0] is last and kept[1] == len(b):
            first = kept[2]
            if b[first][0] + size > since and (first == 0 or b[first - 1][0] + size <= since):
                n, p, pc, c = kept[3]
                return int(n + last[1]), int(p + last[2]), int(pc + last[3]), int(c + last[4])
        turns = prompt = prompt_c = cached = 0.0
        first = len(b) - 1
        while first > 0:
            row = b[first - 1]
            if row[0] + size <= since:
                break
            turns += row[1]
            prompt += row[2]
            prompt_c += row[3]
            cached += row[4]
            first -= 1
        self._older[span_s] = (last, len(b), first, (turns, prompt, prompt_c, cached))
        return int(turns + last[1]), int(prompt + last[2]), int(prompt_c + last[3]), int(cached + last[4])

    def hit_ratio(self, now: float, span_s: float) -> float:
        """Token-weighted hit ratio over the window; NaN without turns that reported cached tokens."""
        _, _, prompt_c, cached = self.totals(now, span_s)
        return cached / prompt_c if prompt_c else math.nan

    def mean_prompt(self, now: float, span_s: float) -> float:
        turns, prompt, _, _ = self.totals(now, span_s)
        return prompt / turns if turns else math.nan
