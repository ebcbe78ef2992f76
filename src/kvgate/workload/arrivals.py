"""Who arrives when: a base Poisson stream and independent trigger streams, each with its own random stream.

Determinism contract: every session is drawn from a random stream keyed by ``(seed, stream, index)``, where
stream 0 is the base stream and stream ``1 + j`` the j-th burst. Arrival times of a stream come from its own
generator. So two runs with the same seed have identical base sessions (arrival times, identities, shapes,
think times) whatever bursts, control or engine they use; a burst only adds sessions.

A rate change (``--rate-at MIN:LAM``) re-times the base stream through its integrated rate, so the base
sessions before the change are unaffected by it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

import numpy as np

from kvgate.errors import UsageError
from kvgate.workload.shapes import SessionShape, Workload

TRIGGER_ID_BASE = 1_000_000


@dataclass(frozen=True, slots=True)
class Burst:
    """Extra arrivals: ``rate_mult * lam`` (or ``count`` sessions spread over the burst) from ``start_s``."""

    start_s: float
    dur_s: float
    rate_mult: float | None = None
    count: float | None = None

    def rate(self, lam: float) -> float:
        if self.count is not None:
            return self.count / self.dur_s
        assert self.rate_mult is not None
        return self.rate_mult * lam

    @property
    def end_s(self) -> float:
        return self.start_s + self.dur_s

    def spec(self) -> str:
        head = f"+{self.count:g}" if self.count is not None else f"{self.rate_mult:g}"
        return f"{head}@{self.start_s / 60:g}+{self.dur_s / 60:g}"


_BURST_RE = re.compile(r"^(\+?)([0-9]*\.?[0-9]+)@([0-9]*\.?[0-9]+)\+([0-9]*\.?[0-9]+)$")


def parse_burst(text: str) -> Burst:
    """``X@S+D``: an extra Poisson stream at X times the base rate from minute S for D minutes;
    ``+N@S+D``: N extra sessions expected over those D minutes."""
    m = _BURST_RE.match(text.strip())
    if not m:
        raise UsageError(f"malformed burst {text!r}: expected MULT@START+DUR (e.g. 1.5@15+5) or +COUNT@START+DUR")
    plus, x, s, d = m.groups()
    val, start, dur = float(x), float(s) * 60, float(d) * 60
    if dur <= 0 or val <= 0:
        raise UsageError(f"malformed burst {text!r}: rate and duration must be positive")
    return Burst(start, dur, count=val) if plus else Burst(start, dur, rate_mult=val)


@dataclass(frozen=True, slots=True)
class RateChange:
    at_s: float
    lam: float


def parse_rate_at(text: str) -> RateChange:
    """``MIN:LAM``: from minute MIN the base stream arrives at LAM sessions/s."""
    try:
        a, b = text.split(":")
        rc = RateChange(float(a) * 60, float(b))
    except ValueError:
        raise UsageError(f"malformed --rate-at {text!r}: expected MIN:LAM (e.g. 30:0.01)") from None
    if not (rc.lam >= 0 and 0 <= rc.at_s < math.inf and rc.lam < math.inf):  # (NaN fails every comparison)
        raise UsageError(f"--rate-at {text!r}: minute and rate must be finite and non-negative")
    return rc


@dataclass(frozen=True, slots=True)
class SessionSpec:
    sid: int
    cohort: str  # "base" or "trigger"
    arrival_s: float
    shape: SessionShape
    think_s: tuple[float, ...]
    """Wait after each turn but the last, before the next turn is requested."""
    tenant: str = ""
    """The tenant class it belongs to ("" without tenants: ``--tenants``)."""


TENANT_STREAM = 7
"""Random stream of the tenant draws, keyed by (seed, stream, session id): tenants change no other draw."""


def tenant_of(sid: int, seed: int, tenants: Sequence[tuple[str, float]]) -> str:
    """The tenant of session ``sid``: drawn with probabilities proportional to ``tenants``' fractions."""
    if not tenants:
        return ""
    total = sum(f for _, f in tenants)
    u = float(np.random.default_rng([seed, TENANT_STREAM, sid]).uniform(0.0, total))
    for name, f in tenants:
        u -= f
        if u < 0:
            return name
    return tenants[-1][0]


def _session_rng(seed: int, stream: int, index: int) -> np.random.Generator:
    return np.random.default_rng([seed, stream, index])


def _poisson_times(rng: np.random.Generator, segments: Sequence[tuple[float, float, float]]) -> list[float]:
    """Arrival times of a Poisson process with piecewise-constant rate ``(start, end, rate)``, by time change of
    a unit-rate process (so earlier segments do not depend on later ones)."""
    out: list[float] = []
    u = float(rng.exponential())  # the unit-rate clock
    cum = 0.0  # integrated rate at the start of the segment
    for start, end, rate in segments:
        if rate <= 0 or end <= start:
            continue
        top = cum + (end - start) * rate
        while u <= top:
            out.append(start + (u - cum) / rate)
            u += float(rng.exponential())
        cum = top
    return out


def _base_segments(lam: float, horizon_s: float, changes: Sequence[RateChange]) -> list[tuple[float, float, float]]:
    pts = sorted(changes, key=lambda c: c.at_s)
    segs = []
    t, rate = 0.0, lam
    for c in pts:
        if c.at_s >= horizon_s:
            break
        if c.at_s > t:
            segs.append((t, c.at_s, rate))
        t, rate = c.at_s, c.lam
    if horizon_s > t:
        segs.append((t, horizon_s, rate))
    return segs


def _make_session(
    workload: Workload, sid: int, cohort: str, t: float, rng: np.random.Generator
) -> SessionSpec:
    if workload.pool:
        shape = workload.pool[int(rng.integers(len(workload.pool)))]
        think_mean = workload.think_mean_s
    else:
        ph = workload.phase_at(t)
        shape, think_mean = ph.shape, ph.think_mean_s
    n = shape.turns - 1
    if shape.gaps is not None:
        think = tuple(shape.gaps)
    else:
        think = tuple(float(x) for x in rng.exponential(think_mean, size=n)) if n else ()
    return SessionSpec(sid, cohort, t, shape, think)


def generate(
    workload: Workload,
    lam: float,
    horizon_s: float,
    seed: int,
    bursts: Sequence[Burst] = (),
    rate_changes: Sequence[RateChange] = (),
    tenants: Sequence[tuple[str, float]] = (),
    burst_tenant: str | None = None,
) -> list[SessionSpec]:
    """All sessions arriving before ``horizon_s``, sorted by arrival time. With ``tenants`` (name, fraction) each
    session is drawn a tenant (its own random stream); the bursts' sessions all belong to ``burst_tenant`` if given."""
    if lam < 0:
        raise UsageError("arrival rate must be non-negative")
    sessions: list[SessionSpec] = []
    base_rng = np.random.default_rng([seed, 0])
    for i, t in enumerate(_poisson_times(base_rng, _base_segments(lam, horizon_s, rate_changes))):
        sessions.append(_make_session(workload, i, "base", t, _session_rng(seed, 0, i)))
    for j, b in enumerate(bursts):
        stream = 1 + j
        rng = np.random.default_rng([seed, stream])
        end = min(b.end_s, horizon_s)
        for i, t in enumerate(_poisson_times(rng, [(b.start_s, end, b.rate(lam))])):
            sid = TRIGGER_ID_BASE * stream + i
            sessions.append(_make_session(workload, sid, "trigger", t, _session_rng(seed, stream, i)))
    if tenants:
        own = burst_tenant or None
        sessions = [
            replace(sp, tenant=own if own and sp.cohort == "trigger" else tenant_of(sp.sid, seed, tenants))
            for sp in sessions
        ]
    sessions.sort(key=lambda s: (s.arrival_s, s.sid))
    return sessions
