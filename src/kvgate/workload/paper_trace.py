"""The paper's trace shapes, as far as its statistics describe them: the bundled sessions, reweighted.

The paper replays 200 mini-SWE-agent trajectories of six 2026 models on SWE-bench Verified (§3): a median of 42
calls per session, a 16K-token median context per call, ~350 tokens appended per turn, 26% of sessions exceeding
38K tokens (truncated there, removing 14% of turns), tool gaps of median 0.1-0.2 s. The trace itself is not public.
kvgate ships 500 sessions of one of those agents (mini-swe-agent with Gemini 3 Pro, ``docs/trace-format.md``):
shorter (median 36 calls, 10% exceed 38K, 5% of turns removed).

``trace = "paper"`` keeps those real sessions -- their per-turn outputs, growth and gaps -- and changes only how
often each is drawn: session i gets weight ``exp(a * [its context exceeds 38K] + b * ln(its calls))``, an
exponential tilt of two constants set so that the drawn population has the paper's **26% of sessions exceeding
38K** and its **median of 42 calls** (both *calibrated*: :func:`fit_tilt` finds them; ``b`` is the middle of the
range that gives a median of 42 with 26% truncated, ``a`` then follows). Everything else is a consequence and is
held against the paper as a check (``trace-32b``): the median context per call (16.7K against 16K), the share of
turns removed by truncation (12.5% against 14%) and the median growth per turn (323 against ~350 tokens). The
draw is deterministic: the pool lists every session ``round(POOL * weight)`` times (largest remainders), and the
workload draws uniformly from it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from kvgate.workload.shapes import SessionShape, Workload

PAPER_TRUNCATED_SESSIONS = 0.26
"""§3: 26% of sessions exceed 38K tokens and are truncated there."""
PAPER_MEDIAN_CALLS = 42
"""§2 and §3: a session makes a median of 42 calls."""
TRUNCATE_AT = 38_000
"""The paper's truncation limit (``PAPER_MAX_CONTEXT``)."""

TILT_EXCEEDS = 0.78
"""``a``: log-weight of a session whose context exceeds 38K (set by :func:`fit_tilt`; see the module header)."""
TILT_LOG_CALLS = 0.49
"""``b``: log-weight per unit of ln(calls)."""
POOL = 2_000
"""Entries of the pool the workload draws from uniformly (each session ``round(POOL * weight)`` times)."""


def tilt_weights(shapes: Sequence[SessionShape], a: float = TILT_EXCEEDS, b: float = TILT_LOG_CALLS) -> list[float]:
    """Normalized weights of the untruncated ``shapes``."""
    w = [math.exp(a * (s.max_context() > TRUNCATE_AT) + b * math.log(s.turns)) for s in shapes]
    tot = sum(w)
    return [x / tot for x in w]


def _weighted_median(values: Sequence[float], weights: Sequence[float]) -> float:
    pairs = sorted(zip(values, weights, strict=True))
    half = sum(weights) / 2.0
    acc = 0.0
    for v, w in pairs:
        acc += w
        if acc >= half:
            return v
    return pairs[-1][0]


def _removed(s: SessionShape) -> int:
    """Turns truncation at 38K removes from a session: the first whose prompt plus output exceeds it, and later."""
    for k, (p, o) in enumerate(zip(s.prompt_tokens(), s.outputs, strict=True)):
        if p + o > TRUNCATE_AT:
            return s.turns - k
    return 0


@dataclass(frozen=True)
class TraceStatistics:
    """The paper's trace statistics of a weighted set of (untruncated) shapes."""

    truncated_sessions: float
    median_calls: float
    median_context: float
    """Median prompt over all calls of all sessions (before truncation)."""
    turns_removed: float
    median_growth: float
    """Median tokens appended per turn (the model's output plus the tool's)."""
    median_gap_s: float


def statistics(shapes: Sequence[SessionShape], weights: Sequence[float] | None = None) -> TraceStatistics:
    w = list(weights) if weights is not None else [1.0 / len(shapes)] * len(shapes)
    calls = [w_ * s.turns for s, w_ in zip(shapes, w, strict=True)]
    ctx_v, ctx_w, gro_v, gro_w, gap_v, gap_w = [], [], [], [], [], []
    for s, w_ in zip(shapes, w, strict=True):
        ctx_v += s.prompt_tokens()
        ctx_w += [w_] * s.turns
        gro_v += [o + a for o, a in zip(s.outputs, s.appends, strict=False)]
        gro_w += [w_] * (s.turns - 1)
        if s.gaps is not None:
            gap_v += list(s.gaps)
            gap_w += [w_] * len(s.gaps)
    return TraceStatistics(
        truncated_sessions=sum(w_ for s, w_ in zip(shapes, w, strict=True) if s.max_context() > TRUNCATE_AT),
        median_calls=_weighted_median([float(s.turns) for s in shapes], w),
        median_context=_weighted_median([float(x) for x in ctx_v], ctx_w),
        turns_removed=sum(w_ * _removed(s) for s, w_ in zip(shapes, w, strict=True)) / sum(calls),
        median_growth=_weighted_median([float(x) for x in gro_v], gro_w),
        median_gap_s=_weighted_median(gap_v, gap_w) if gap_v else math.nan,
    )


def _a_for(ex: Sequence[bool], logn: Sequence[float], b: float) -> float:
    """The ``a`` that gives the paper's share of truncated sessions for this ``b`` (bisection; it is monotone)."""
    base = [math.exp(b * x) for x in logn]
    lo, hi = -5.0, 5.0
    for _ in range(50):
        a = (lo + hi) / 2
        ea = math.exp(a)
        w = [y * (ea if e else 1.0) for y, e in zip(base, ex, strict=True)]
        frac = sum(x for x, e in zip(w, ex, strict=True) if e) / sum(w)
        lo, hi = (a, hi) if frac < PAPER_TRUNCATED_SESSIONS else (lo, a)
    return (lo + hi) / 2


def fit_tilt(shapes: Sequence[SessionShape], step: float = 0.01) -> tuple[float, float]:
    """The two constants from the paper's two figures: ``b`` the middle of the range (scanned in ``step``) over which
    the median of calls is the paper's 42 once ``a`` gives 26% truncated sessions; ``a`` for that ``b``."""
    ex = [s.max_context() > TRUNCATE_AT for s in shapes]
    calls = [float(s.turns) for s in shapes]
    logn = [math.log(c) for c in calls]
    ok = []
    for i in range(int(1.5 / step) + 1):
        b = i * step
        a = _a_for(ex, logn, b)
        if _weighted_median(calls, tilt_weights(shapes, a, b)) == PAPER_MEDIAN_CALLS:
            ok.append(b)
    if not ok:
        raise ValueError("no tilt gives the paper's median of calls")
    b = round((ok[0] + ok[-1]) / 2, 2)
    return round(_a_for(ex, logn, b), 2), b


def multiplicities(weights: Sequence[float], total: int = POOL) -> list[int]:
    """Integer copies of each session summing to ``total`` (largest remainders; ties by index)."""
    raw = [w * total for w in weights]
    base = [math.floor(x) for x in raw]
    rest = sorted(range(len(raw)), key=lambda i: (-(raw[i] - base[i]), i))
    for i in rest[: total - sum(base)]:
        base[i] += 1
    return base


def paper_trace_workload(max_context: int | None = TRUNCATE_AT, think_mean_s: float = 5.0) -> Workload:
    """The bundled sessions drawn with the paper's trace statistics, truncated at ``max_context``."""
    from kvgate.workload.trace import bundled_shapes_path, load_trace

    full = load_trace(bundled_shapes_path()).shapes
    pool: list[SessionShape] = []
    for s, k in zip(full, multiplicities(tilt_weights(full)), strict=True):
        t = s if max_context is None else s.truncated(max_context)
        if t is not None:
            pool += [t] * k
    return Workload(name="trace:paper", pool=tuple(pool), think_mean_s=think_mean_s)
