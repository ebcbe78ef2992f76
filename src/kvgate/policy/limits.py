"""The limits: how each control decides admission and parking. The actuator itself lives in ``core``.

Every limit answers two questions for the actuator, both O(1):

* ``admits(policy, d)``: may the session at the head of a queue, whose demand is ``d``, be admitted now? (For
  a new session reaching its first boundary with nobody queued ahead of it, the same question.)
* ``parks(policy, session)``: the admitted session ``session`` has just reached a turn boundary and its demand
  has been updated (``policy.demand`` already includes it); must it be parked?

and may observe turn boundaries and finished turns, ask for a timer (``next_deadline``), and act on it
(``on_timer``). A limit sees the policy only through the read-only ``view.PolicyView`` (D, the admitted count,
snapshots of the admitted and held sessions) and never changes a session's state itself: ``on_timer`` returns
actions (``Suspend``, ``Resume``) that the core applies through its transition table. Defaults are the
paper's (§5); every parameter can be set by name, see ``make_control`` and
``parse_control`` (``"budgeter:low=0.65:high=0.85"``).

A limit instance holds state (AIMD's K, the adaptive cap's EWMA, thunder's marks) and belongs to one policy.
"""

from __future__ import annotations

import math
import operator
import statistics
from collections.abc import Mapping
from typing import ClassVar, Final, SupportsFloat, SupportsIndex

from kvgate.policy.events import SessionId
from kvgate.policy.state import PolicyError, SessionState
from kvgate.policy.view import Action, PolicyView, Resume, SessionView, Suspend

Number = int | float


class Control:
    """Base class: always admit, never park, no timer (which is exactly the ``none`` control)."""

    name: ClassVar[str] = ""
    OPTIONS: ClassVar[Mapping[str, type]] = {}
    """Option name -> type (int or float) accepted by the constructor as keyword arguments."""
    needs_residency: ClassVar[bool] = False
    """Whether the control reads measured residency (``PolicyView.residency``), which a driver must feed."""
    fifo_readmit: ClassVar[bool] = True
    """Whether the actuator re-admits parked sessions from the head of the parked FIFO. Thunder resumes them
    itself, smallest footprint first, on its timer."""

    def __init__(self, kv_pool: int) -> None:
        self.kv_pool = _positive_int("kv_pool", kv_pool)
        self._policy: PolicyView | None = None

    # -- lifecycle -------------------------------------------------------------------------------------------
    def bind(self, policy: PolicyView, now: float) -> None:
        """Called by the policy when the limit is installed (at construction or by ``set_control``)."""
        if self._policy is not None:
            raise PolicyError(f"limit {self.spec()!r} is already installed in a policy; make a new one")
        self._policy = policy
        self.start(now, policy)

    def start(self, now: float, policy: PolicyView) -> None:
        """Reset state and start timers at ``now``."""

    # -- the two questions -----------------------------------------------------------------------------------
    def admits(self, policy: PolicyView, demand: int) -> bool:
        return True

    def parks(self, policy: PolicyView, session: SessionId) -> bool:
        return False

    # -- observations and timers -----------------------------------------------------------------------------
    def observe_boundary(self, demand: int) -> None:
        """A session reached a turn boundary with this demand (every TurnRequested, before any check)."""

    def observe_finished(self, now: float, latency_s: float) -> None:
        """A turn finished after ``latency_s`` seconds."""

    def next_deadline(self) -> float | None:
        return None

    def on_timer(self, now: float, policy: PolicyView) -> list[Action]:
        """Act at a deadline (called only when ``now >= next_deadline()``); the actions returned are applied
        by the policy, in order (a resumed parked session's turn gets ``Proceed``)."""
        return []

    # -- description -----------------------------------------------------------------------------------------
    def params(self) -> dict[str, Number]:
        """The option values, by name."""
        return {k: getattr(self, k) for k in self.OPTIONS}

    def spec(self) -> str:
        """An arm string that ``parse_control`` reads back into this limit's name and options."""
        return ":".join([self.name, *(f"{k}={v!r}" for k, v in self.params().items())])

    def __repr__(self) -> str:
        opts = ", ".join(f"{k}={v!r}" for k, v in self.params().items())
        return f"{type(self).__name__}(kv_pool={self.kv_pool}{', ' if opts else ''}{opts})"


class NoControl(Control):
    """``none``: always admit, never park."""

    name = "none"


class Budgeter(Control):
    """``budgeter``: admit while D + d_s <= low*C; park when D > high*C (D includes s's updated demand)."""

    name = "budgeter"
    OPTIONS = {"low": float, "high": float}

    def __init__(self, kv_pool: int, *, low: float = 0.75, high: float = 0.95) -> None:
        super().__init__(kv_pool)
        self.low, self.high = _band(low, high)
        self._admit_tokens = low * self.kv_pool
        self._park_tokens = high * self.kv_pool

    def admits(self, policy: PolicyView, demand: int) -> bool:
        return policy.demand + demand <= self._admit_tokens

    def parks(self, policy: PolicyView, session: SessionId) -> bool:
        return policy.demand > self._park_tokens


class BudgeterResident(Budgeter):
    """``budgeter-resident``: the budgeter, with D corrected by measured residency (KV events).

    The paper's D counts every admitted session at d_s = L_s + o_s: "a conservative proxy [...] it bounds the
    active working set rather than the physical residency of the cache" (§5). Between turns (THINKING) that
    overstates what a session holds once its prefix is gone: after a cache flush, a restart of the engine, or at
    recovery, when the degraded regime has evicted it. Such a session pays its one miss at its next turn whatever
    the gateway does, so counting its whole context only keeps others out of space nobody holds. Here a THINKING
    session whose resident tokens r_s are known counts ``min(d_s, r_s + o_s)`` (its resident prefix and the output
    budget of its coming turn); RUNNING sessions, and THINKING ones of unknown residency, count d_s as before::

        D_meas = D - sum over THINKING s with r_s known of max(0, L_s - r_s)

    and the budgeter's band applies to D_meas: admit while D_meas + d_s <= low*C, park at a boundary when
    D_meas > high*C, where the session at its boundary counts in full (its turn is about to run and recompute what
    it lost). What stays bounded is the measured working set (resident prefixes of thinking sessions, plus whole
    running ones), so admitted sessions still fit and do not evict each other: a session that lost its cache comes
    back through the same band, and parks if there is no room for it (parked sessions stay first in line).
    D_meas <= D, so the correction only ever admits more or parks less, and it is computed only when the plain
    budgeter would refuse or park (O(admitted sessions) then, O(1) otherwise).

    Fully resident sessions (r_s >= L_s) count as today and unknown residency falls back to the plain budgeter
    exactly: its answers are then the plain budgeter's. Residency comes in through the policy
    (``Policy.residency``, injected by the driver; the core does no I/O): a driver with no measurement makes this
    the plain budgeter. It is a separate name rather than a ``budgeter`` option so that ``budgeter`` keeps its
    meaning (and its records) everywhere, and so that a run that used measurements says so in its control spec.
    Measurements lag (events are published after each engine step) and, after a lost event, are approximate: the
    gateway reports unknown for a replica whose event stream has an unfilled gap.
    """

    name = "budgeter-resident"
    needs_residency = True

    def admits(self, policy: PolicyView, demand: int) -> bool:
        total = policy.demand + demand
        if total <= self._admit_tokens:
            return True
        return total - _resident_credit(policy, None) <= self._admit_tokens

    def parks(self, policy: PolicyView, session: SessionId) -> bool:
        total = policy.demand
        if total <= self._park_tokens:
            return False
        return total - _resident_credit(policy, session) > self._park_tokens


def _resident_credit(policy: PolicyView, skip: SessionId | None) -> int:
    """Tokens of D that THINKING sessions (but ``skip``) no longer hold: sum of max(0, L_s - r_s), r_s known."""
    feed = policy.residency
    if feed is None:
        return 0
    credit = 0
    for view in policy.admitted_sessions():
        if view.state is not SessionState.THINKING or view.session == skip:
            continue
        resident = feed(view.session)
        if resident is None:
            continue
        missing = view.demand - view.output - resident
        if missing > 0:
            credit += missing
    return credit


class Cap(Control):
    """``cap``: admit while fewer than K sessions are admitted; park when more than K_hi are. K_hi defaults to
    K + 3 (the paper's pair is K = 14, K_hi = 17)."""

    name = "cap"
    OPTIONS = {"K": int, "K_hi": int}

    def __init__(self, kv_pool: int, *, K: int = 14, K_hi: int | None = None) -> None:
        super().__init__(kv_pool)
        self.K = _positive_int("K", K)
        self.K_hi = self.K + 3 if K_hi is None else _positive_int("K_hi", K_hi)
        if self.K_hi < self.K:
            raise PolicyError(f"cap: K_hi={K_hi} must be >= K={K}")

    def admits(self, policy: PolicyView, demand: int) -> bool:
        return policy.n_admitted < self.K

    def parks(self, policy: PolicyView, session: SessionId) -> bool:
        return policy.n_admitted > self.K_hi


class AdaptiveCap(Control):
    """``adaptive-cap``: a cap K = floor(low*C / d_hat), parking above floor(high*C / d_hat), where d_hat is
    an EWMA (weight ``alpha`` per turn boundary) of the demand L_s + o_s seen at turn boundaries, initialised
    with the first boundary it observes. Until then a candidate's own demand stands in for d_hat."""

    name = "adaptive-cap"
    OPTIONS = {"alpha": float, "low": float, "high": float}

    def __init__(self, kv_pool: int, *, alpha: float = 0.02, low: float = 0.75, high: float = 0.95) -> None:
        super().__init__(kv_pool)
        if not 0.0 < alpha <= 1.0:
            raise PolicyError(f"adaptive-cap: alpha={alpha} must be in (0, 1]")
        self.alpha = alpha
        self.low, self.high = _band(low, high)
        self.d_hat: float | None = None
        self.K: int | None = None
        self.K_hi: int | None = None

    def start(self, now: float, policy: PolicyView) -> None:
        self.d_hat = self.K = self.K_hi = None

    def observe_boundary(self, demand: int) -> None:
        d_hat = self.d_hat
        d_hat = float(demand) if d_hat is None else d_hat + self.alpha * (demand - d_hat)
        self.d_hat = d_hat
        self.K, self.K_hi = self._caps(d_hat)

    def _caps(self, d_hat: float) -> tuple[int, int]:
        d = max(d_hat, 1.0)
        c = self.kv_pool
        return math.floor(self.low * c / d), math.floor(self.high * c / d)

    def admits(self, policy: PolicyView, demand: int) -> bool:
        k = self.K if self.K is not None else self._caps(float(demand))[0]
        return policy.n_admitted < k

    def parks(self, policy: PolicyView, session: SessionId) -> bool:
        return self.K_hi is not None and policy.n_admitted > self.K_hi


class AIMD(Control):
    """``aimd``: a cap K adapted every ``interval_s`` seconds: halved (not below ``min_K``) when the median
    latency of the turns that finished in the interval exceeds ``latency_s``, else increased by one. An
    interval in which no turn finished leaves K unchanged (no evidence either way: the engine is idle, or
    every turn in flight is older than the interval, which the next interval with completions will show). No
    upper bound on K (as in the paper). Admit while admitted < K; park when admitted > K."""

    name = "aimd"
    OPTIONS = {"K0": int, "interval_s": float, "latency_s": float, "min_K": int}

    def __init__(
        self,
        kv_pool: int,
        *,
        K0: int = 32,
        interval_s: float = 10.0,
        latency_s: float = 15.0,
        min_K: int = 1,
    ) -> None:
        super().__init__(kv_pool)
        self.K0 = _positive_int("K0", K0)
        self.min_K = _positive_int("min_K", min_K)
        if self.min_K > self.K0:
            raise PolicyError(f"aimd: K0={K0} must be >= min_K={min_K}")
        self.interval_s = _interval(interval_s)
        self.latency_s = _positive_float("latency_s", latency_s)
        self.K = self.K0
        self._latencies: list[float] = []
        self._deadline: float | None = None

    def start(self, now: float, policy: PolicyView) -> None:
        self.K = self.K0
        self._latencies = []
        self._deadline = now + self.interval_s

    def admits(self, policy: PolicyView, demand: int) -> bool:
        return policy.n_admitted < self.K

    def parks(self, policy: PolicyView, session: SessionId) -> bool:
        return policy.n_admitted > self.K

    def observe_finished(self, now: float, latency_s: float) -> None:
        self._latencies.append(latency_s)

    def next_deadline(self) -> float | None:
        return self._deadline

    def on_timer(self, now: float, policy: PolicyView) -> list[Action]:
        if self._latencies:
            if statistics.median(self._latencies) > self.latency_s:
                self.K = max(self.min_K, self.K // 2)
            else:
                self.K += 1
            self._latencies = []
        self._deadline = _next_tick(self._deadline, now, self.interval_s)
        return []


class AdmissionCap(Control):
    """``admission-cap``: new sessions wait while K sessions are admitted; admitted ones are never parked."""

    name = "admission-cap"
    OPTIONS = {"K": int}

    def __init__(self, kv_pool: int, *, K: int = 16) -> None:
        super().__init__(kv_pool)
        self.K = _positive_int("K", K)

    def admits(self, policy: PolicyView, demand: int) -> bool:
        return policy.n_admitted < self.K


class Thunder(Control):
    """``thunder``: an approximation of the ThunderAgent program scheduler (Kang et al. 2026, arXiv
    2602.13692, as ported to NVIDIA Dynamo), not a reimplementation. See docs/policy.md for what differs.

    A session's footprint is its demand d_s, so the summed footprint of admitted sessions is D. Every
    ``interval_s`` seconds:

    * if D > high*C: pause thinking sessions, smallest footprint first, until D <= low*C (they become
      SUSPENDED: no longer admitted, their next turn will be held); if that is not enough, mark running
      sessions, smallest first, until the projected sum is <= low*C. A marked session is parked at its next
      turn boundary if D > low*C still holds there. Marks last until the next tick.
    * otherwise: resume paused sessions, smallest footprint first, while D + d_s <= resume*C.

    New sessions wait while any session is paused. At least one session always stays admitted, and when none
    is admitted the smallest paused session is resumed whatever its size (so a session larger than the band
    still runs).
    """

    name = "thunder"
    OPTIONS = {"interval_s": float, "high": float, "low": float, "resume": float}
    fifo_readmit = False

    def __init__(
        self,
        kv_pool: int,
        *,
        interval_s: float = 5.0,
        high: float = 0.95,
        low: float = 0.80,
        resume: float = 0.85,
    ) -> None:
        super().__init__(kv_pool)
        self.interval_s = _interval(interval_s)
        self.low, self.high = _band(low, high)
        self.resume = _positive_float("resume", resume)
        if self.resume > self.high:
            raise PolicyError(f"thunder: resume={resume} must be <= high={high}")
        c = self.kv_pool
        self._high_tokens = high * c
        self._low_tokens = low * c
        self._resume_tokens = resume * c
        self._marked: set[SessionId] = set()
        self._deadline: float | None = None
        self.pauses = 0
        """Thinking sessions paused by the timer."""
        self.marks = 0
        """Running sessions marked to pause at their next boundary."""

    def start(self, now: float, policy: PolicyView) -> None:
        self._marked = set()
        self._deadline = now + self.interval_s

    def parks(self, policy: PolicyView, session: SessionId) -> bool:
        marked = self._marked
        if session not in marked:
            return False
        marked.discard(session)
        return policy.demand > self._low_tokens

    def next_deadline(self) -> float | None:
        return self._deadline

    def on_timer(self, now: float, policy: PolicyView) -> list[Action]:
        # NOTE: scans admitted and paused sessions. This runs once per interval, never per event.
        self._deadline = _next_tick(self._deadline, now, self.interval_s)
        self._marked = set()
        actions: list[Action] = []
        total = policy.demand
        if total > self._high_tokens:
            admitted = policy.admitted_sessions()
            n_admitted = len(admitted)
            thinking = sorted((s for s in admitted if s.state is SessionState.THINKING), key=_by_demand)
            for view in thinking:
                if total <= self._low_tokens or n_admitted <= 1:
                    break
                actions.append(Suspend(view.session))
                total -= view.demand
                n_admitted -= 1
                self.pauses += 1
            if total > self._low_tokens:
                running = sorted((s for s in admitted if s.state is SessionState.RUNNING), key=_by_demand)
                for view in running:
                    if total <= self._low_tokens:
                        break
                    self._marked.add(view.session)
                    total -= view.demand
                    self.marks += 1
        else:
            n_admitted = policy.n_admitted
            for view in sorted(policy.held_sessions(), key=_by_demand):
                if n_admitted > 0 and total + view.demand > self._resume_tokens:
                    break
                actions.append(Resume(view.session))
                total += view.demand
                n_admitted += 1
        return actions


def _by_demand(view: SessionView) -> int:
    return view.demand


# -- registry, construction and parsing ----------------------------------------------------------------------

_REGISTRY: Final[dict[str, type[Control]]] = {
    cls.name: cls for cls in (NoControl, Budgeter, BudgeterResident, Cap, AdaptiveCap, AIMD, AdmissionCap, Thunder)
}
CONTROLS: Final[tuple[str, ...]] = tuple(_REGISTRY)
"""Names of the limits, for ``make_control`` and ``parse_control``."""


def control_class(name: str) -> type[Control]:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise PolicyError(f"unknown limit {name!r}; choose from {', '.join(CONTROLS)}") from None


def make_control(name: str, kv_pool: int, **opts: Number) -> Control:
    """Build the control ``name`` for a KV pool of ``kv_pool`` tokens, with options by name.

    Raises ``PolicyError`` (a ``ValueError``) for an unknown limit or option, a value of the wrong type
    (a float where an integer is expected, a bool, NaN) or out of range.
    """
    cls = control_class(name)
    typed = {key: _coerce(cls, key, value) for key, value in opts.items()}
    return cls(kv_pool, **typed)


def parse_control(spec: str) -> tuple[str, dict[str, Number]]:
    """Parse ``"name:opt=value:..."`` into the control's name and its options, typed (int or float).

    >>> parse_control("cap:K=22:K_hi=25")
    ('cap', {'K': 22, 'K_hi': 25})
    >>> parse_control("budgeter:low=0.65:high=0.85")
    ('budgeter', {'low': 0.65, 'high': 0.85})

    For a limit's name, options are checked and typed as the limit declares them (``PolicyError`` for an
    unknown option or a value of the wrong type); ranges are checked by ``make_control``. A name that is not a
    limit is left for ``make_control`` to reject, and its values are typed by their spelling (``22`` int,
    ``0.65`` float), so ``parse_control`` can also type a bare option list under a placeholder name.
    """
    name, *parts = (p.strip() for p in spec.strip().split(":"))
    if not name:
        raise PolicyError(f"arm {spec!r}: no limit name; choose from {', '.join(CONTROLS)}")
    cls = _REGISTRY.get(name)
    opts: dict[str, Number] = {}
    for part in parts:
        key, sep, text = (s.strip() for s in part.partition("="))
        if not sep or not key or not text:
            raise PolicyError(f"arm {spec!r}: expected option=value, got {part!r}")
        if key in opts:
            raise PolicyError(f"arm {spec!r}: option {key!r} given twice")
        kind = _option_type(cls, key) if cls is not None else (int if _is_int_literal(text) else float)
        try:
            value: Number = int(text) if kind is int else float(text)
        except ValueError:
            wanted = "an integer" if kind is int else "a number"
            raise PolicyError(f"arm {spec!r}: option {key!r} of {name!r} takes {wanted}, got {text!r}") from None
        opts[key] = _coerce(cls, key, value) if cls is not None else value
    return name, opts


def _is_int_literal(text: str) -> bool:
    try:
        int(text)
    except ValueError:
        return False
    return True


def _option_type(cls: type[Control], key: str) -> type:
    try:
        return cls.OPTIONS[key]
    except KeyError:
        known = ", ".join(cls.OPTIONS) or "none"
        raise PolicyError(f"unknown option {key!r} for limit {cls.name!r}; its options: {known}") from None


def _coerce(cls: type[Control], key: str, value: object) -> Number:
    kind = _option_type(cls, key)
    if isinstance(value, bool):
        raise PolicyError(f"option {key!r} of {cls.name!r}: a bool is not a number")
    if kind is int:
        if isinstance(value, float) and value.is_integer():
            value = int(value)
        if not isinstance(value, SupportsIndex):
            raise PolicyError(f"option {key!r} of {cls.name!r} takes an integer, got {value!r}")
        number = operator.index(value)
        if abs(number) > MAX_COUNT:  # (a count no pool holds; JSON readers lose integers past 2^53)
            raise PolicyError(f"option {key!r} of {cls.name!r} must be at most 2^53, got {value!r}")
        return number
    if isinstance(value, SupportsFloat):
        number = float(value)
        if not math.isfinite(number):
            raise PolicyError(f"option {key!r} of {cls.name!r} must be finite, got {value!r}")
        return number
    raise PolicyError(f"option {key!r} of {cls.name!r} takes a number, got {value!r}")


# -- validation helpers --------------------------------------------------------------------------------------


def _positive_int(what: str, value: object) -> int:
    if isinstance(value, bool):
        raise PolicyError(f"{what} must be a positive integer, got {value!r}")
    if not isinstance(value, SupportsIndex):
        raise PolicyError(f"{what} must be a positive integer, got {value!r}")
    number = operator.index(value)
    if number < 1:
        raise PolicyError(f"{what} must be a positive integer, got {value!r}")
    return int(number)


def _positive_float(what: str, value: float) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not (math.isfinite(value) and value > 0):
        raise PolicyError(f"{what} must be a positive number, got {value!r}")
    return float(value)


MAX_COUNT = 2**53
"""The largest integer option (sessions, tokens): exact in a double, as every JSON reader keeps it."""
MIN_INTERVAL_S = 0.01
"""The shortest timer interval of a control (seconds): a tick far shorter than a turn decides nothing, and one
that does not move the clock forward (1e-300 after a minute) would fire for ever."""


def _interval(value: float) -> float:
    interval = _positive_float("interval_s", value)
    if interval < MIN_INTERVAL_S:
        raise PolicyError(f"interval_s must be at least {MIN_INTERVAL_S} s, got {value!r}")
    return interval


def _band(low: float, high: float) -> tuple[float, float]:
    low = _positive_float("low", low)
    high = _positive_float("high", high)
    if low > high:
        raise PolicyError(f"low={low} must be <= high={high}")
    return low, high


def _next_tick(deadline: float | None, now: float, interval: float) -> float:
    """The deadline after ``deadline``; a tick that was missed entirely is skipped, not replayed."""
    nxt = (now if deadline is None else deadline) + interval
    return nxt if nxt > now else now + interval
