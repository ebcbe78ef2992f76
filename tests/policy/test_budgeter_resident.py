"""``budgeter-resident``: the budgeter with D corrected by measured residency, against the plain budgeter."""

from __future__ import annotations

import random
from collections.abc import Callable

import pytest

from kvgate.errors import UsageError
from kvgate.policy import (
    Park,
    Policy,
    Proceed,
    SessionEnded,
    SessionState,
    Timer,
    TurnAborted,
    TurnFinished,
    TurnRequested,
    make_control,
)
from kvgate.policy.config import ControlConfig
from kvgate.policy.events import Event, SessionId

C = 10_000  # low*C = 7500, high*C = 9500


def _policy(name: str, residency: Callable[[SessionId], int | None] | None = None) -> Policy:
    p = Policy(make_control(name, kv_pool=C))
    p.residency = residency
    return p


def _thinking(p: Policy, sid: str, context: int, output: int, now: float = 0.0) -> None:
    """Admit ``sid`` with one finished turn: it is THINKING with demand context + output."""
    assert p.handle(TurnRequested(now, sid, context, output)) == [Proceed(sid)]
    p.handle(TurnFinished(now, sid, 1.0, context, 0, output))
    assert p.state_of(sid) is SessionState.THINKING


def test_a_thinking_session_with_nothing_resident_frees_its_context() -> None:
    resident: dict[SessionId, int] = {"a": 6_000}
    plain, corrected = _policy("budgeter"), _policy("budgeter-resident", resident.get)
    for p in (plain, corrected):
        _thinking(p, "a", 6_000, 500)  # D = 6500
    # b (d = 2000): D + d = 8500 > 7500: both wait while a is resident
    assert plain.handle(TurnRequested(1.0, "b", 1_500, 500)) == [Park("b")]
    assert corrected.handle(TurnRequested(1.0, "b", 1_500, 500)) == [Park("b")]
    # a's prefix is evicted (a flush): it counts its output budget alone, 500 + 2000 <= 7500
    resident["a"] = 0
    assert plain.handle(Timer(2.0)) == []
    assert corrected.handle(Timer(2.0)) == [Proceed("b")]
    assert corrected.state_of("b") is SessionState.RUNNING
    assert corrected.demand == plain.demand + 2_000  # D itself is not corrected: D_meas is the control's
    # a comes back: it counts in full at its boundary; D_meas = 6500 + 2000 (b) + its growth, under 0.95 C
    assert corrected.handle(TurnRequested(3.0, "a", 6_600, 500)) == [Proceed("a")]


def test_partial_residency_frees_only_what_is_gone() -> None:
    resident: dict[SessionId, int] = {"a": 6_000}
    p = _policy("budgeter-resident", resident.get)
    _thinking(p, "a", 6_000, 500)
    assert p.handle(TurnRequested(1.0, "b", 1_500, 500)) == [Park("b")]  # needs 1000 of a's 6000 gone
    resident["a"] = 5_100  # 900 gone: 6500 - 900 + 2000 = 7600 > 7500
    assert p.handle(Timer(2.0)) == []
    resident["a"] = 5_000  # 1000 gone: 7500
    assert p.handle(Timer(3.0)) == [Proceed("b")]


def test_the_session_at_its_boundary_counts_in_full() -> None:
    """Parking: D_meas > 0.95 C with the session at its boundary counted whole, others by their residency."""
    resident: dict[SessionId, int] = {"a": 0, "b": 0}
    p = _policy("budgeter-resident", resident.get)
    _thinking(p, "a", 5_000, 500)
    _thinking(p, "b", 1_500, 500)  # D = 7500: b was admitted at 0.75 C exactly
    # a grows to 8000 + 500: D = 10500 > 9500; b holds nothing (it counts 500): 9000 <= 9500, a proceeds
    assert p.handle(TurnRequested(1.0, "a", 8_000, 500)) == [Proceed("a")]
    plain = _policy("budgeter")
    _thinking(plain, "a", 5_000, 500)
    _thinking(plain, "b", 1_500, 500)
    assert plain.handle(TurnRequested(1.0, "a", 8_000, 500)) == [Park("a")]
    # a's own (empty) residency is not a credit at its own boundary: alone past 0.95 C with b resident, it parks
    resident.update(a=0, b=2_000)
    q = _policy("budgeter-resident", resident.get)
    _thinking(q, "a", 5_000, 500)
    _thinking(q, "b", 1_500, 500)
    assert q.handle(TurnRequested(1.0, "a", 8_000, 500)) == [Park("a")]


def test_running_sessions_are_never_discounted() -> None:
    p = _policy("budgeter-resident", lambda _s: 0)
    assert p.handle(TurnRequested(0.0, "a", 6_000, 500)) == [Proceed("a")]  # running: its blocks are in use
    assert p.handle(TurnRequested(0.0, "b", 1_500, 500)) == [Park("b")]
    p.handle(TurnFinished(1.0, "a", 1.0, 6_000, 0, 500))  # thinking with nothing resident: b fits
    assert p.state_of("b") is SessionState.RUNNING


def _drive(p: Policy, seed: int) -> list[object]:
    """300 random legal events for 12 sessions with demands around the band, chosen from the policy's own states
    (so two policies that decide alike get the same events); every event with its decisions, D and counts."""
    rng = random.Random(seed)
    out: list[object] = []
    now = 0.0
    for _ in range(300):
        now += rng.random()
        sid = f"s{rng.randrange(12)}"
        try:
            st: SessionState | None = p.state_of(sid)
        except ValueError:
            st = None
        ev: Event | None = None
        if st is None or st is SessionState.THINKING:
            ev = TurnRequested(now, sid, rng.randrange(200, 4_000), rng.randrange(0, 800))
            if st is not None and rng.random() < 0.05:
                ev = SessionEnded(now, sid)
        elif st is SessionState.RUNNING:
            ev = TurnFinished(now, sid, 1.0, 10, 0, 1) if rng.random() < 0.85 else TurnAborted(now, sid)
        elif st is not SessionState.DONE and rng.random() < 0.05:
            ev = SessionEnded(now, sid)
        elif rng.random() < 0.3:
            ev = Timer(now)
        if ev is not None:
            out.append((ev, p.handle(ev), p.demand, p.counts()))
    return out


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("residency", ["unknown", "none injected", "fully resident"])
def test_unknown_or_full_residency_is_the_plain_budgeter(seed: int, residency: str) -> None:
    """Same decisions, D and counts at every event as the plain budgeter when residency is unknown (None), not
    injected at all, or covers every session's context."""
    feed: Callable[[SessionId], int | None] | None = {
        "unknown": lambda _s: None, "none injected": None, "fully resident": lambda _s: 10**9,
    }[residency]
    plain = _drive(_policy("budgeter"), seed)
    corrected = _drive(_policy("budgeter-resident", feed), seed)
    assert corrected == plain
    assert any(isinstance(d, Park) for _, ds, _, _ in plain for d in ds)  # the band was reached: a real check


def test_the_correction_changes_decisions_when_residency_is_gone() -> None:
    """The same random scripts with nothing resident: some decision differs from the plain budgeter (so the
    equality above is not vacuous)."""
    differs = 0
    for seed in range(6):
        plain = _drive(_policy("budgeter"), seed)
        corrected = _drive(_policy("budgeter-resident", lambda _s: 0), seed)
        differs += plain != corrected
    assert differs > 0


def test_the_control_spec_and_the_simulator_refusal() -> None:
    c = make_control("budgeter-resident", kv_pool=C, low=0.7, high=0.9)
    assert c.spec() == "budgeter-resident:low=0.7:high=0.9" and c.needs_residency
    assert not make_control("budgeter", kv_pool=C).needs_residency
    with pytest.raises(UsageError, match="measured residency"):
        ControlConfig(control="budgeter-resident").check_control(C)
    ControlConfig(control="budgeter").check_control(C)
