"""The gateway's observability: cheap accumulators on the request path, Prometheus families at scrape time, JSON logs.

On the request path every turn costs a few additions (:class:`Histogram.observe`, :meth:`UsageWindows.add`,
counter increments); nothing takes a lock and nothing scans sessions. Gauges (sessions by state, D, C, hit
ratios, the regime alarm) are computed when Prometheus scrapes ``/metrics``, from the policy core's O(1) counts.

Hit ratio. Token-weighted over agent turns (requests that named a session) finished in the last 1 and 5
minutes of gateway time (virtual seconds with ``--time-scale``): sum(cached_tokens) / sum(prompt_tokens) over the
turns whose usage reported ``cached_tokens``. Turns are kept in 5-second buckets, so a window is exact to a
bucket.

Regime alarm (the paper's degraded regime, §3-4): 1 while the 5-minute agent hit ratio < 0.5 and either D > C or
the sessions in the system exceed N* = C / (mean prompt tokens of the agent turns of the last 5 minutes).
"""

from __future__ import annotations

import json
import logging
import math
import time
from bisect import bisect_left
from collections import deque
from collections.abc import Iterable, Sequence
from typing import Any

from prometheus_client.core import HistogramMetricFamily

PARK_WAIT_BUCKETS = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1800.0, 3600.0)
"""Seconds (gateway time) a turn was held by the policy."""
LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Seconds (gateway time) from sending a turn upstream to its last byte."""
ALARM_HIT_RATIO = 0.5


class Histogram:
    """A Prometheus histogram without locks (the gateway is one event loop)."""

    __slots__ = ("bounds", "counts", "total")

    def __init__(self, bounds: Sequence[float]) -> None:
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)
        self.total = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect_left(self.bounds, value)] += 1
        self.total += value

    def family(self, name: str, doc: str) -> HistogramMetricFamily:
        buckets = []
        acc = 0
        for bound, n in zip((*self.bounds, math.inf), self.counts, strict=True):
            acc += n
            buckets.append(("+Inf" if bound == math.inf else repr(float(bound)), acc))
        return HistogramMetricFamily(name, doc, buckets=buckets, sum_value=self.total)


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


def regime_alarm(hit5: float, demand: int, capacity: int, in_system: int, mean_context: float) -> tuple[bool, float]:
    """``(alarm, N*)``: see the module docstring. N* is NaN without recent turns."""
    n_star = capacity / mean_context if mean_context and mean_context > 0 else math.nan
    if math.isnan(hit5) or hit5 >= ALARM_HIT_RATIO:
        return False, n_star
    over = demand > capacity or (not math.isnan(n_star) and in_system > n_star)
    return over, n_star


# -- structured logs -------------------------------------------------------------------------------------------
_RESERVED = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (RFC 3339, UTC), ``level``, ``logger``, ``msg``, then any ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        t = record.created
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in _RESERVED and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, separators=(",", ":"))


def setup_logging(level: str, loggers: Iterable[str] = ("kvgate", "aiohttp")) -> None:
    """Send the named loggers to stderr as JSON lines at ``level`` (others than kvgate's at warning and above)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    for name in loggers:
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.propagate = False
        lg.setLevel(level.upper() if name == "kvgate" else max(logging.WARNING, logging.getLevelName(level.upper())))
