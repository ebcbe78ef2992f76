"""Sessions that end without saying so: how long a silent session may keep its demand in D, learnt from the think
times seen.

Agents rarely say they are done (no ``X-Session-End``, no ``DELETE``). A session that went quiet keeps its d_s in
D until the gateway gives up on it, and every session parked behind it waits for that ghost. A fixed retention
(ThunderAgent's 30 minutes) is far longer than any think time of a live agent: the gateway instead *releases* a
session from the policy once it has been idle longer than a bound learnt from the gaps it saw between a session's
turns (end of a turn to the next request of the same session)::

    bound = min(--idle-timeout, max(FLOOR_S, FACTOR x the 99th percentile of the gaps seen))

with :data:`MIN_GAPS` gaps seen first (until then: ``--idle-timeout``), recomputed every :data:`REFRESH`
gaps. The gaps are kept in log-spaced buckets
(:data:`PER_DECADE` per decade, so the percentile is exact to ~15%), halved every :data:`HALF_LIFE` gaps so that
the bound follows a workload that changes. A released session leaves D (``SessionEnded``) but the gateway keeps
its record (its id, its lineage) until ``--idle-timeout``: if it comes back it is the same session, asked to the
policy as a new one (it may wait), and its long gap is one more sample (the bound grows when sessions come back
after release). No I/O, no clock.
"""

from __future__ import annotations

import math

FACTOR = 2.0
QUANTILE = 0.99
FLOOR_S = 1.0
"""The shortest bound, gateway seconds."""
MIN_GAPS = 32
HALF_LIFE = 2000
REFRESH = 16
PER_DECADE = 16
_LO = -2  # 10 ms
_HI = 6  # 10^6 s
_N = (_HI - _LO) * PER_DECADE + 2


class ThinkTimes:
    """The gaps between a session's turns, as a decaying log histogram; :meth:`bound` is the release bound."""

    __slots__ = ("counts", "total", "seen", "_q")

    def __init__(self) -> None:
        self.counts = [0.0] * _N
        self.total = 0.0
        self.seen = 0
        """Gaps observed (not decayed)."""
        self._q: float | None = None
        """The percentile, recomputed every :data:`REFRESH` gaps (a scan of the buckets)."""

    def observe(self, gap_s: float) -> None:
        if not gap_s >= 0 or math.isinf(gap_s):
            return
        self.counts[_bucket(gap_s)] += 1.0
        self.total += 1.0
        self.seen += 1
        if self.seen % HALF_LIFE == 0:
            self.counts = [c * 0.5 for c in self.counts]
            self.total *= 0.5
        if self.seen % REFRESH == 0 or self.seen == MIN_GAPS:
            self._q = self.quantile(QUANTILE)

    def refresh(self) -> None:
        """Recompute the percentile now (after the counts were put back from the books)."""
        self._q = self.quantile(QUANTILE) if self.seen >= MIN_GAPS else None

    def quantile(self, q: float) -> float | None:
        """The gap below which a fraction ``q`` of the (decayed) gaps fall: its bucket's upper edge."""
        if self.total <= 0:
            return None
        need = q * self.total
        acc = 0.0
        for i, c in enumerate(self.counts):
            acc += c
            if acc >= need:
                return _upper(i)
        return _upper(_N - 1)

    def bound(self, idle_s: float) -> float:
        """How long an idle session keeps its demand (gateway seconds): see the module docstring."""
        q = self._q
        if self.seen < MIN_GAPS or q is None:
            return idle_s
        return min(idle_s, max(FLOOR_S, FACTOR * q))

    def state(self) -> dict[str, float | int | None]:
        q = self.quantile(QUANTILE)
        return {"gaps": self.seen, "p50_s": _round(self.quantile(0.5)), "p99_s": _round(q)}


def _bucket(x: float) -> int:
    if x <= 10.0**_LO:
        return 0
    i = int((math.log10(x) - _LO) * PER_DECADE) + 1
    return min(i, _N - 1)


def _upper(i: int) -> float:
    return 10.0 ** (_LO + i / PER_DECADE)


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
