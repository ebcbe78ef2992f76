"""Verdict rules, written once: how a kvgate result is judged against one of the paper's claims.

Every claim of the paper that kvgate checks is declared once, with the paper's numbers, as a *rule* (see
``claims.py``); an experiment only measures and hands the rule its observation. Four verdicts:

* **reproduced** -- kvgate's result agrees with the paper's within the rule's stated tolerance;
* **differs** -- the qualitative claim holds but the numbers do not (the note gives direction and size);
* **not reproduced** -- the qualitative claim fails, or kvgate has no value to judge;
* **calibrated** -- the paper's figure set (or is a target of) a calibrated constant: shown, never counted.

Rules (each can come out negative; ``contradiction()`` builds an observation that must not be reproduced, which the
mutation test feeds to every declared claim):

* :class:`Figure` -- values against the paper's value or range ``[lo, hi]`` widened by a stated tolerance; values
  inside the (wider) qualitative band ``qual`` are "differs", outside it "not reproduced". A contradiction is a value
  the quantity can take (a fraction stays in [0, 1], a count or a time is not negative): a qualitative band that
  covers every such value could never give "not reproduced", and the mutation test refuses it. With ``spread``, the
  paper's range is the spread of its runs across regimes (Table 3's admission-only cap: hit 0.07-0.93): kvgate's
  lowest and highest runs must each reach the paper's end within the tolerance; runs on both sides of the range's
  middle that miss an end "differ", runs all on one side are "not reproduced".
* :class:`Count` -- "k of n" against the paper's count. A universal claim (0 of n, n of n) is reproduced only by the
  same universal; an intermediate one by a fraction within ``band`` of the paper's *and* a two-sided Fisher exact
  test that does not reject equality at 5%; k = 0 against an intermediate count is "not reproduced" (the paper's
  "it happened in some runs" is not shown), and so is k = n against a count of at most one half ("in some, not
  in the others"); otherwise a fraction on the same side of one half as the paper's (or any other, when the
  paper's is one half) is "differs", one on the other side "not reproduced". A universal count on fewer runs than
  the paper's (1 of 1 against its 3 of 3) "differs": the denominator is part of the claim.
* :class:`Prevents` -- a policy against ``none`` on the seeds that collapse without it: with no such seed the claim
  is untestable ("not reproduced"); reproduced only if the policy run collapsed on none of them.
* :class:`TwinEffect` -- a trigger's effect against its own twin: more pairs in which only the trigger arm
  degraded than the reverse, at least ``min_only_trigger`` of them, and never only the twin.
* :class:`Holds` -- a qualitative statement measured as a boolean (an ordering, a bracket); None is untestable.
* :class:`Calibrated` -- shown beside the paper, verdict "calibrated".
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from math import comb
from typing import Any

REPRODUCED = "reproduced"
DIFFERS = "differs"
NOT_REPRODUCED = "not reproduced"
CALIBRATED = "calibrated"
SHOWN = "shown"
"""Verdict of a baseline that is not in the paper (never counted)."""

VERDICTS = (REPRODUCED, DIFFERS, NOT_REPRODUCED, CALIBRATED)


def _clean(vals: Sequence[float | None]) -> list[float]:
    return [float(x) for x in vals if x is not None and not (isinstance(x, float) and math.isnan(x))]


def fisher_p(k1: int, n1: int, k2: int, n2: int) -> float:
    """Two-sided Fisher exact test of equal proportions k1/n1 and k2/n2 (sum of tables no more likely)."""
    if n1 <= 0 or n2 <= 0:
        return 1.0
    k = k1 + k2
    n = n1 + n2
    denom = comb(n, k)

    def pr(a: int) -> float:
        return comb(n1, a) * comb(n2, k - a) / denom

    lo, hi = max(0, k - n2), min(k, n1)
    p0 = pr(k1)
    return min(1.0, sum(pr(a) for a in range(lo, hi + 1) if pr(a) <= p0 * (1 + 1e-9)))


@dataclass(frozen=True)
class Rule:
    """A claim of the paper: what it says, the paper's numbers as text, and how kvgate's result is judged."""

    claim: str
    paper: str

    def judge(self, obs: Any) -> tuple[str, str]:  # pragma: no cover - abstract
        raise NotImplementedError

    def contradiction(self) -> Any:  # pragma: no cover - abstract
        raise NotImplementedError

    def contradictions(self) -> list[Any]:
        """Results that must not reproduce the claim (the mutation test feeds each)."""
        return [self.contradiction()]

    def describe(self) -> str:
        return ""


@dataclass(frozen=True)
class Figure(Rule):
    lo: float = 0.0
    hi: float = 0.0
    tol: float = 0.0
    """Absolute tolerance added on both sides of the paper's range."""
    rel: float = 0.0
    """Relative tolerance (of the range's ends) added on both sides."""
    qual: tuple[float, float] | None = None
    """Band in which the qualitative claim still holds ("differs"); default: the range widened by its own size
    or half its magnitude, whichever is larger."""
    unit: str = ""
    spread: bool = False
    """The paper's range is the spread of its runs: kvgate's lowest and highest runs are held against its ends."""

    def band(self) -> tuple[float, float]:
        return self.lo - self.tol - self.rel * abs(self.lo), self.hi + self.tol + self.rel * abs(self.hi)

    def domain(self) -> tuple[float, float]:
        """The values the quantity can take, as far as the rule tells: not negative when the paper's figure is not,
        within [0, 1] when its figure and qualitative band are (a fraction, a hit ratio)."""
        if self.lo < 0:
            return -math.inf, math.inf
        q = self.qual_band()
        return 0.0, 1.0 if self.hi <= 1.0 and q[1] <= 1.0 else math.inf

    def qual_band(self) -> tuple[float, float]:
        if self.qual is not None:
            return self.qual
        w = max(self.hi - self.lo, 0.5 * max(abs(self.lo), abs(self.hi)))
        lo, hi = self.band()
        return lo - w, hi + w

    def judge(self, obs: Sequence[float | None]) -> tuple[str, str]:
        v = _clean(obs)
        if not v:
            return NOT_REPRODUCED, "no value to judge"
        if self.spread:
            return self._judge_spread(v)
        lo, hi = self.band()
        if all(lo - 1e-12 <= x <= hi + 1e-12 for x in v):
            return REPRODUCED, ""
        qlo, qhi = self.qual_band()
        below = [lo - x for x in v if x < lo]
        above = [x - hi for x in v if x > hi]
        parts = []
        if below:
            parts.append(f"below the paper's range by up to {_fmt(max(below))}{self.unit}")
        if above:
            parts.append(f"above the paper's range by up to {_fmt(max(above))}{self.unit}")
        note = "; ".join(parts)
        if all(qlo <= x <= qhi for x in v):
            return DIFFERS, note
        return NOT_REPRODUCED, note + f" (outside {_fmt(qlo)}–{_fmt(qhi)}, where the claim would still hold)"

    def _ends(self) -> tuple[tuple[float, float], tuple[float, float]]:
        """Where kvgate's lowest and highest runs reproduce the paper's ends (``spread``)."""
        tl, th = self.tol + self.rel * abs(self.lo), self.tol + self.rel * abs(self.hi)
        return (self.lo - tl, self.lo + tl), (self.hi - th, self.hi + th)

    def _judge_spread(self, v: list[float]) -> tuple[str, str]:
        (a, b), (c, d) = self._ends()
        low, high, mid = min(v), max(v), (self.lo + self.hi) / 2
        if a - 1e-12 <= low <= b + 1e-12 and c - 1e-12 <= high <= d + 1e-12:
            return REPRODUCED, ""
        parts = []
        if not a - 1e-12 <= low <= b + 1e-12:
            parts.append(f"lowest run {_fmt(low)}{self.unit} against the paper's {_fmt(self.lo)}{self.unit}")
        if not c - 1e-12 <= high <= d + 1e-12:
            parts.append(f"highest run {_fmt(high)}{self.unit} against the paper's {_fmt(self.hi)}{self.unit}")
        if low < mid < high:
            return DIFFERS, "; ".join(parts)
        return NOT_REPRODUCED, "; ".join(parts) + f" (every run on one side of {_fmt(mid)}{self.unit}: no spread)"

    def _beyond(self) -> tuple[float | None, float | None]:
        """A value the quantity can take below the qualitative band and one above it (None where there is none)."""
        qlo, qhi = self.qual_band()
        dlo, dhi = self.domain()
        far = 10 * (abs(qhi) + abs(qlo) + 1)
        below = None if qlo <= dlo else (qlo - far if dlo == -math.inf else (dlo + qlo) / 2)
        above = None if qhi >= dhi else (qhi + far if dhi == math.inf else (qhi + dhi) / 2)
        return below, above

    def contradiction(self) -> list[float]:
        if self.spread:
            return [(self.lo + self.hi) / 2]
        below, above = self._beyond()
        return [above if above is not None else below if below is not None else math.nan]

    def contradictions(self) -> list[list[float]]:
        """Values the quantity can take that must not reproduce the claim: beyond the qualitative band on either side
        the domain leaves room (none at all: the rule could never fail, and the mutation test says so), and the paper's
        own value beside one of them; for a spread, runs all at its middle, all at its low end, all at its high end."""
        if self.spread:
            return [[(self.lo + self.hi) / 2], [self.lo, self.lo], [self.hi, self.hi]]
        mid = (self.lo + self.hi) / 2
        out = [[x] for x in self._beyond() if x is not None]
        return out + [[mid, out[0][0]]] if out else []

    def describe(self) -> str:
        if self.spread:
            (a, b), (c, d) = self._ends()
            return (f"reproduced when the lowest run is in {_fmt(a)}–{_fmt(b)} and the highest in {_fmt(c)}–{_fmt(d)}; "
                    f"differs when they straddle {_fmt((self.lo + self.hi) / 2)}")
        lo, hi = self.band()
        qlo, qhi = self.qual_band()
        return f"reproduced in {_fmt(lo)}–{_fmt(hi)}; differs in {_fmt(qlo)}–{_fmt(qhi)}"


@dataclass(frozen=True)
class Count(Rule):
    k: int = 0
    n: int = 1
    band: float = 0.2

    def judge(self, obs: tuple[int, int]) -> tuple[str, str]:
        k, n = obs
        if n <= 0:
            return NOT_REPRODUCED, "no runs to count"
        f0, f = self.k / self.n, k / n
        diff = f - f0
        size = f"{'more' if diff > 0 else 'fewer'}: {f:.0%} vs the paper's {f0:.0%} ({diff * 100:+.0f} points)"
        if self.k in (0, self.n):
            if (k == 0) == (self.k == 0) and (k == n) == (self.k == self.n):
                if n < self.n:
                    return DIFFERS, f"on {n} run{'s' if n != 1 else ''} only, where the paper's count is of {self.n}"
                return REPRODUCED, ""
            return (DIFFERS if abs(diff) <= self.band + 1e-9 else NOT_REPRODUCED), size
        if k == 0:
            return NOT_REPRODUCED, size + "; the event never happened here"
        if k == n and f0 <= 0.5:
            return NOT_REPRODUCED, size + "; it happened in every run, where the paper's happened in at most half"
        p = fisher_p(k, n, self.k, self.n)
        if abs(diff) <= self.band + 1e-9 and p >= 0.05:
            return REPRODUCED, ""
        if (f - 0.5) * (f0 - 0.5) > 0 or f0 == 0.5:
            return DIFFERS, size + f"; Fisher exact p = {p:.3f}"
        return NOT_REPRODUCED, size

    def contradiction(self) -> tuple[int, int]:
        return (0, self.n) if self.k / self.n >= 0.5 else (self.n, self.n)

    def contradictions(self) -> list[tuple[int, int]]:
        """Every kind of result that must not reproduce the claim: the other universal, and for an intermediate
        count both universals and a fraction across one half; for a universal, the same universal on a smaller
        denominator than the paper's (``n`` runs where the paper counted more) -- not reproduced in full."""
        out = [self.contradiction()]
        if 0 < self.k < self.n:
            out += [(0, self.n)] + ([(self.n, self.n)] if self.k / self.n <= 0.5 else [])
        elif self.n > 1:
            out.append((0, self.n - 1) if self.k == 0 else (self.n - 1, self.n - 1))
        return out

    def describe(self) -> str:
        if self.k in (0, self.n):
            return (f"reproduced only by {'none' if self.k == 0 else 'all'} of at least the paper's {self.n} runs; "
                    f"differs within {self.band:.0%}")
        return (f"reproduced within {self.band:.0%} of {self.k}/{self.n} and Fisher p ≥ 0.05; never by none"
                + (" or by all" if self.k / self.n <= 0.5 else ""))


@dataclass(frozen=True)
class Prevents(Rule):
    """obs: (runs with the policy that collapsed, seeds that collapsed without it)."""

    def judge(self, obs: tuple[int, int]) -> tuple[str, str]:
        bad, n = obs
        if n <= 0:
            return NOT_REPRODUCED, "untestable: no seed collapsed without control"
        if bad == 0:
            return REPRODUCED, ""
        return (DIFFERS if bad < n / 2 else NOT_REPRODUCED), f"the policy collapsed on {bad} of {n} such seeds"

    def contradiction(self) -> tuple[int, int]:
        return 3, 3

    def describe(self) -> str:
        return "on the seeds that collapse without control, no collapse with it"


@dataclass(frozen=True)
class TwinEffect(Rule):
    """obs: dict with only_trigger, only_twin, both, neither."""

    min_only_trigger: int = 1

    def judge(self, obs: dict[str, int]) -> tuple[str, str]:
        a, b = obs["only_trigger"], obs["only_twin"]
        if a >= self.min_only_trigger and b == 0:
            return REPRODUCED, ""
        if a > b and a >= 1:
            return DIFFERS, f"{a} pairs only the trigger arm vs {b} only the twin"
        if a == 0 and obs.get("both", 0):
            return NOT_REPRODUCED, "every degraded trigger arm's twin degraded as well"
        return NOT_REPRODUCED, f"{a} pairs only the trigger arm vs {b} only the twin"

    def contradiction(self) -> dict[str, int]:
        return {"only_trigger": 0, "only_twin": 0, "both": 3, "neither": 1}

    def contradictions(self) -> list[dict[str, int]]:
        out = [self.contradiction(), {"only_trigger": self.min_only_trigger, "only_twin": 1, "both": 0, "neither": 1}]
        if self.min_only_trigger > 1:
            out.append({"only_trigger": self.min_only_trigger - 1, "only_twin": 0, "both": 0, "neither": 3})
        return out

    def describe(self) -> str:
        return f"≥ {self.min_only_trigger} pairs with only the trigger arm degraded, none with only the twin"


@dataclass(frozen=True)
class Holds(Rule):
    """obs: True, False, or None (untestable)."""

    def judge(self, obs: bool | None) -> tuple[str, str]:
        if obs is None:
            return NOT_REPRODUCED, "untestable here"
        return (REPRODUCED, "") if obs else (NOT_REPRODUCED, "")

    def contradiction(self) -> bool:
        return False


@dataclass(frozen=True)
class Calibrated(Rule):
    sets: str = ""
    """The constant this figure set, or the calibration it is a target of."""

    def judge(self, obs: Any) -> tuple[str, str]:
        return CALIBRATED, self.sets

    def contradiction(self) -> Any:
        return None

    def describe(self) -> str:
        return "a calibration target (docs/calibration.md): shown, not counted"


@dataclass
class Claim:
    claim: str
    paper: str
    kvgate: str
    verdict: str
    note: str = ""
    id: str = ""
    rule: str = ""
    baseline: bool = False
    extra: dict[str, Any] = field(default_factory=dict)


def judge(cid: str, rule: Rule, obs: Any, kvgate: str, note: str = "") -> Claim:
    v, why = rule.judge(obs)
    return Claim(rule.claim, rule.paper, kvgate, v, "; ".join(x for x in (why, note) if x), cid, rule.describe())


def baseline(claim: str, kvgate: str, note: str = "") -> Claim:
    """A result of a baseline the paper did not run: shown apart, never a verdict."""
    return Claim(claim, "—", kvgate, SHOWN, note, baseline=True)


def _fmt(x: float) -> str:
    if x == 0:
        return "0"
    a = abs(x)
    if a >= 100:
        return f"{x:.0f}"
    if a >= 10:
        return f"{x:.1f}"
    if a >= 1:
        return f"{x:.2f}"
    return f"{x:.3g}"
