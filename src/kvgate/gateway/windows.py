"""Token sums of agent turns in time buckets: the gateway's sliding-window hit ratios (:mod:`kvgate.gateway.metrics`)
and each tenant's (:mod:`kvgate.gateway.tenants`)."""

from __future__ import annotations

import math
from collections import deque


class UsageWindows:
    """Token sums of agent turns in time buckets, for sliding windows of up to ``horizon_s`` seconds."""

    __slots__ = ("bucket_s", "horizon_s", "_buckets")

    def __init__(self, bucket_s: float = 5.0, horizon_s: float = 300.0) -> None:
        self.bucket_s = bucket_s
        self.horizon_s = horizon_s
        # [bucket start, turns, prompt tokens, prompt tokens of turns reporting cached, cached tokens]
        self._buckets: deque[list[float]] = deque()

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
        """``(turns, prompt tokens, prompt tokens with cached reported, cached tokens)`` over the last ``span_s``."""
        since = now - span_s
        turns = prompt = prompt_c = cached = 0.0
        for start, n, p, pc, c in reversed(self._buckets):
            if start + self.bucket_s <= since:
                break
            turns += n
            prompt += p
            prompt_c += pc
            cached += c
        return int(turns), int(prompt), int(prompt_c), int(cached)

    def hit_ratio(self, now: float, span_s: float) -> float:
        """Token-weighted hit ratio over the window; NaN without turns that reported cached tokens."""
        _, _, prompt_c, cached = self.totals(now, span_s)
        return cached / prompt_c if prompt_c else math.nan

    def mean_prompt(self, now: float, span_s: float) -> float:
        turns, prompt, _, _ = self.totals(now, span_s)
        return prompt / turns if turns else math.nan
