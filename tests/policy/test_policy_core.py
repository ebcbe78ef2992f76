"""Unit tests of the policy core: the actuator, the limits by hand-computed expectations, the state table."""

from __future__ import annotations

import numpy as np
import pytest

from kvgate.errors import ClientError
from kvgate.policy import (
    AIMD,
    CONTROLS,
    TRANSITIONS,
    Action,
    AdaptiveCap,
    Control,
    Decision,
    Event,
    Park,
    Policy,
    PolicyError,
    PolicyView,
    Proceed,
    Resume,
    SessionEnded,
    SessionState,
    SessionView,
    Suspend,
    Timer,
    TurnAborted,
    TurnFinished,
    TurnRequested,
    make_control,
    parse_control,
)

S = SessionState
C = 1_000  # a small pool: budgeter admits while D + d <= 750, parks when D > 950


def req(p: Policy, s: str, demand: int, now: float | None = None) -> list[Decision]:
    return p.handle(TurnRequested(p.now if now is None else now, s, demand, 0))


def fin(p: Policy, s: str, latency: float = 1.0, now: float | None = None) -> list[Decision]:
    return p.handle(TurnFinished(p.now if now is None else now, s, latency, 0, None, 0))


def end(p: Policy, s: str, now: float | None = None) -> list[Decision]:
    return p.handle(SessionEnded(p.now if now is None else now, s))


def tick(p: Policy, now: float) -> list[Decision]:
    return p.handle(Timer(now))


def admit_all(p: Policy, demands: dict[str, int], finish: bool = True) -> None:
    """Arrive every session (they must all be admitted) and, by default, finish their first turns."""
    for s, d in demands.items():
        assert req(p, s, d) == [Proceed(s)]
    if finish:
        for s in demands:
            assert fin(p, s) == []


# -- the budgeter --------------------------------------------------------------------------------------------


def test_budgeter_admits_parks_and_readmits_by_hand() -> None:
    p = Policy(make_control("budgeter", kv_pool=C))
    assert req(p, "s1", 300) == [Proceed("s1")]  # 0 + 300 <= 750
    assert req(p, "s2", 300) == [Proceed("s2")]  # 300 + 300 <= 750
    assert req(p, "s3", 200) == [Park("s3")]  # 600 + 200 > 750: waits
    assert p.counts()["waiting"] == 1 and p.waits == 1 and p.parks == 0
    assert fin(p, "s1") == []  # head s3: 600 + 200 > 750
    assert req(p, "s1", 400) == [Proceed("s1")]  # D = 700 <= 950
    assert fin(p, "s2") == []
    assert req(p, "s2", 560) == [Park("s2")]  # D = 400 + 560 = 960 > 950: parked at its boundary
    assert p.demand == 400 and p.parks == 1
    assert p.state_of("s2") is S.PARKED and p.parked_order() == ["s2"]
    # s3 (new, 200) would fit (400 + 200 <= 750) but parked sessions go first and the head s2 does not fit
    assert fin(p, "s1") == []
    assert p.state_of("s3") is S.WAITING
    assert end(p, "s1") == [Proceed("s2")]  # D = 0: s2 fits (560); then s3: 560 + 200 > 750
    assert p.demand == 560 and p.readmissions == 1
    assert fin(p, "s2") == []
    assert end(p, "s2") == [Proceed("s3")]
    assert p.demand == 200
    assert fin(p, "s3") == [] and end(p, "s3") == []
    assert p.demand == 0 and p.counts()["in_system"] == 0 and p.counts()["done"] == 3


def test_budgeter_readmits_one_at_a_time_in_fifo_order_without_skipping() -> None:
    p = Policy(make_control("none", kv_pool=C))
    admit_all(p, {"a": 200, "b": 300, "x": 50, "c": 500, "d": 500})  # D = 1550, all thinking
    assert p.set_control(p.now, make_control("budgeter", kv_pool=C)) == []
    assert req(p, "a", 200) == [Park("a")]  # D 1550 > 950 -> 1350
    assert req(p, "b", 300) == [Park("b")]  # 1350 > 950 -> 1050
    assert req(p, "x", 50) == [Park("x")]  # 1050 > 950 -> 1000
    assert p.parked_order() == ["a", "b", "x"] and p.demand == 1000 and p.parks == 3
    assert req(p, "c", 350) == [Proceed("c")]  # demand shrinks: D = 850
    assert fin(p, "c") == []  # head a: 850 + 200 > 750
    assert end(p, "c") == [Proceed("a")]  # D = 500: a fits (700); b does not (1000); x would, but no skipping
    assert p.parked_order() == ["b", "x"] and p.demand == 700
    assert end(p, "d") == [Proceed("b"), Proceed("x")]  # D = 200: b (500), then x (550)
    assert p.readmissions == 3 and p.demand == 550


def test_budgeter_counts_in_flight_turns_and_never_parks_them() -> None:
    p = Policy(make_control("budgeter", kv_pool=C))
    assert req(p, "a", 700) == [Proceed("a")]
    assert req(p, "b", 40) == [Proceed("b")]  # 740 <= 750
    assert fin(p, "b") == []
    assert req(p, "b", 300) == [Park("b")]  # D = 700 + 300 > 950; a stays running
    assert p.state_of("a") is S.RUNNING and p.demand == 700


def test_budgeter_thresholds_are_options() -> None:
    p = Policy(make_control("budgeter", kv_pool=C, low=0.5, high=0.6))
    assert req(p, "a", 500) == [Proceed("a")]
    assert req(p, "b", 1) == [Park("b")]  # 501 > 500
    assert fin(p, "a") == []
    assert req(p, "a", 500) == [Proceed("a")]  # 500 <= 600


def test_a_session_larger_than_the_pool_still_runs_alone() -> None:
    p = Policy(make_control("budgeter", kv_pool=C))
    assert req(p, "big", 5_000) == [Proceed("big")]  # nothing admitted: the head is admitted whatever its size
    assert req(p, "small", 10) == [Park("small")]
    assert fin(p, "big") == []
    assert req(p, "big", 6_000) == [Proceed("big")]  # alone: never parked
    assert fin(p, "big") == []
    assert end(p, "big") == [Proceed("small")]


# -- caps ----------------------------------------------------------------------------------------------------


def test_cap_defaults_and_parking_above_k_hi() -> None:
    cap = make_control("cap", kv_pool=C)
    assert cap.params() == {"K": 14, "K_hi": 17}
    p = Policy(make_control("none", kv_pool=C))
    admit_all(p, {s: 10 for s in "abcde"})
    p.set_control(p.now, make_control("cap", kv_pool=C, K=2, K_hi=3))
    assert req(p, "a", 10) == [Park("a")]  # 5 admitted > 3
    assert req(p, "b", 10) == [Park("b")]  # 4 > 3
    assert req(p, "c", 10) == [Proceed("c")]  # 3 is not > 3
    assert req(p, "n", 10) == [Park("n")]  # new: parked sessions ahead
    assert fin(p, "c") == []  # 3 admitted, not < 2
    assert end(p, "c") == []  # 2 admitted
    assert end(p, "d") == [Proceed("a")]  # 1 < 2: a; then 2, full
    assert end(p, "e") == [Proceed("b")]
    assert end(p, "a") == [Proceed("n")]


def test_admission_cap_never_parks() -> None:
    p = Policy(make_control("none", kv_pool=C))
    admit_all(p, {s: 400 for s in "abcde"})
    p.set_control(p.now, make_control("admission-cap", kv_pool=C, K=2))
    for s in "abcde":
        assert req(p, s, 900) == [Proceed(s)]
    assert req(p, "n1", 1) == [Park("n1")]
    assert req(p, "n2", 1) == [Park("n2")]
    for s in "abc":
        assert fin(p, s) == []
        assert end(p, s) == []  # 4, 3, 2 admitted
    assert end(p, "d") == [Proceed("n1")]  # 1 < 2
    assert end(p, "e") == [Proceed("n2")]
    assert p.parks == 0 and make_control("admission-cap", kv_pool=C).params() == {"K": 16}


def test_none_never_parks_nor_waits() -> None:
    p = Policy(make_control("none", kv_pool=C))
    for i in range(50):
        assert req(p, f"s{i}", 10_000) == [Proceed(f"s{i}")]
    assert p.demand == 500_000 and p.parks == 0 and p.waits == 0 and p.next_deadline() is None


def test_adaptive_cap_ewma_by_hand() -> None:
    limit = make_control("adaptive-cap", kv_pool=C, alpha=0.5)
    assert isinstance(limit, AdaptiveCap)
    p = Policy(limit)
    for i in range(7):
        assert req(p, f"s{i}", 100) == [Proceed(f"s{i}")]  # d_hat = 100: K = 7, K_hi = 9
    assert (limit.d_hat, limit.K, limit.K_hi) == (100.0, 7, 9)
    assert req(p, "s7", 100) == [Park("s7")]  # 7 admitted, not < 7
    assert fin(p, "s0") == []
    assert req(p, "s0", 300) == [Park("s0")]  # d_hat = 200: K = 3, K_hi = 4; 7 admitted > 4
    assert (limit.d_hat, limit.K, limit.K_hi) == (200.0, 3, 4)
    assert fin(p, "s1") == []
    assert req(p, "s1", 200) == [Park("s1")]  # d_hat 200, 6 > 4
    assert make_control("adaptive-cap", kv_pool=C).params() == {
        "alpha": 0.02,
        "low": 0.75,
        "high": 0.95,
    }


def test_aimd_by_hand() -> None:
    limit = make_control("aimd", kv_pool=C, K0=2)
    assert isinstance(limit, AIMD)
    assert limit.params() == {"K0": 2, "interval_s": 10.0, "latency_s": 15.0, "min_K": 1}
    p = Policy(limit, now=0.0)
    assert p.next_deadline() == 10.0
    assert req(p, "a", 1, now=0.0) == [Proceed("a")]
    assert req(p, "b", 1) == [Proceed("b")]
    assert req(p, "c", 1) == [Park("c")]  # 2 admitted, not < K = 2
    assert fin(p, "a", latency=20.0, now=5.0) == []
    assert fin(p, "b", latency=20.0) == []
    assert tick(p, 9.0) == [] and limit.K == 2  # early timer: nothing
    assert tick(p, 10.0) == [] and limit.K == 1  # median 20 > 15: halve
    assert p.next_deadline() == 20.0
    assert req(p, "a", 1, now=11.0) == [Park("a")]  # 2 admitted > K = 1
    assert req(p, "b", 1) == [Proceed("b")]  # alone
    assert fin(p, "b", latency=1.0, now=12.0) == []
    assert tick(p, 20.0) == [Proceed("a")] and limit.K == 2  # median 1 <= 15: K + 1; a re-admitted
    assert tick(p, 30.0) == [] and limit.K == 2  # no turn finished in the interval: K kept
    assert fin(p, "a", latency=100.0, now=31.0) == []
    assert tick(p, 55.0) == [] and limit.K == 1  # a late timer acts once ...
    assert p.next_deadline() == 65.0  # ... and the missed tick is skipped
    assert req(p, "b", 1, now=56.0) == [Park("b")]  # 2 admitted > K = 1
    assert req(p, "a", 1, now=57.0) == [Proceed("a")]  # alone
    assert fin(p, "a", latency=100.0, now=58.0) == []
    assert tick(p, 65.0) == [] and limit.K == 1  # halving stops at min_K


def test_set_limit_restarts_timers_and_releases_sessions() -> None:
    p = Policy(make_control("cap", kv_pool=C, K=1, K_hi=1))
    assert req(p, "a", 1) == [Proceed("a")]
    assert req(p, "b", 1) == [Park("b")]
    assert req(p, "c", 1) == [Park("c")]
    assert p.next_deadline() is None
    assert p.set_control(100.0, make_control("aimd", kv_pool=C)) == [Proceed("b"), Proceed("c")]
    assert p.next_deadline() == 110.0 and p.now == 100.0
    limit = make_control("none", kv_pool=C)
    p.set_control(100.0, limit)
    with pytest.raises(PolicyError, match="already installed"):
        Policy(limit)
    with pytest.raises(PolicyError, match="backwards"):
        p.set_control(99.0, make_control("none", kv_pool=C))


# -- thunder -------------------------------------------------------------------------------------------------


def test_thunder_pauses_thinking_smallest_first_and_resumes_smallest_first() -> None:
    limit = make_control("thunder", kv_pool=C)  # pause above 950 down to 800, resume while <= 850
    assert limit.params() == {"interval_s": 5.0, "high": 0.95, "low": 0.8, "resume": 0.85}
    p = Policy(limit, now=0.0)
    assert p.next_deadline() == 5.0
    admit_all(p, {"a": 400, "b": 300, "c": 200, "d": 100}, finish=False)  # thunder admits; D = 1000
    assert fin(p, "a", now=1.0) == [] and fin(p, "c") == []
    assert tick(p, 5.0) == []  # c (200) is the smallest thinking: 1000 - 200 = 800 <= 800, stop
    assert p.state_of("c") is S.SUSPENDED and p.state_of("a") is S.THINKING
    assert p.demand == 800 and p.parks == 1 and p.counts()["parked"] == 1 and p.counts()["suspended"] == 1
    assert req(p, "e", 50, now=6.0) == [Park("e")]  # new sessions wait while any is paused
    assert req(p, "c", 250) == [Park("c")]  # its next turn is held; not a second park
    assert p.parks == 1 and p.state_of("c") is S.PARKED and p.demand_of("c") == 250
    assert tick(p, 10.0) == []  # 800 + 250 > 850
    assert end(p, "a", now=11.0) == []  # thunder resumes only on its timer
    assert tick(p, 15.0) == [Proceed("c"), Proceed("e")]  # 400 + 250 <= 850; then e (none paused)
    assert p.demand == 700 and p.readmissions == 1


def test_thunder_marks_running_sessions_to_pause_at_their_boundary() -> None:
    p = Policy(make_control("thunder", kv_pool=C), now=0.0)
    admit_all(p, {"a": 500, "b": 480}, finish=False)  # D = 980 > 950, nobody thinking
    assert tick(p, 5.0) == []  # mark b (smallest): projected 500 <= 800
    assert fin(p, "b", now=6.0) == []
    assert req(p, "b", 480) == [Park("b")]  # marked, D = 980 > 800 still
    assert fin(p, "a") == []
    assert req(p, "a", 500) == [Proceed("a")]  # not marked
    assert tick(p, 10.0) == []  # 500 + 480 > 850
    assert end(p, "a", now=11.0) == []
    assert tick(p, 15.0) == [Proceed("b")]  # nothing admitted: the smallest paused resumes


def test_thunder_mark_lapses_when_no_longer_needed() -> None:
    p = Policy(make_control("thunder", kv_pool=C), now=0.0)
    admit_all(p, {"a": 500, "b": 480}, finish=False)
    assert tick(p, 5.0) == []
    assert end(p, "a", now=6.0) == []
    assert fin(p, "b") == []
    assert req(p, "b", 480) == [Proceed("b")]  # D = 480 <= 800: the pause is no longer needed


def test_switching_away_from_thunder_keeps_paused_sessions_in_fifo_order() -> None:
    p = Policy(make_control("thunder", kv_pool=C), now=0.0)
    admit_all(p, {"a": 300, "b": 200, "c": 250, "d": 300})  # D = 1050, all thinking
    assert tick(p, 5.0) == []  # b (200), then c (250): 600 <= 800
    assert p.parked_order() == ["b", "c"]
    assert p.set_control(5.0, make_control("budgeter", kv_pool=C)) == []  # 600 + 200 > 750
    assert end(p, "a") == []  # D = 300: b fits (500) but is suspended (no pending turn); c: 750 <= 750
    assert p.state_of("b") is S.THINKING and p.state_of("c") is S.THINKING and p.readmissions == 2


class Scripted(Control):
    """A limit whose timer returns the actions a test gives it, and records what it saw of the policy."""

    name = "scripted"
    fifo_readmit = False  # held sessions move only by the script

    def __init__(self, kv_pool: int, actions: list[Action]) -> None:
        super().__init__(kv_pool)
        self.actions = actions
        self.seen: list[tuple[int, int, list[SessionView], list[SessionView]]] = []

    def next_deadline(self) -> float | None:
        return 0.0

    def on_timer(self, now: float, policy: PolicyView) -> list[Action]:
        self.seen.append((policy.demand, policy.n_admitted, policy.admitted_sessions(), policy.held_sessions()))
        actions, self.actions = self.actions, []
        return actions


def test_a_limit_sees_snapshots_and_its_actions_go_through_the_table() -> None:
    limit = Scripted(C, [Suspend("t"), Resume("p")])
    p = _policy_with_every_state()
    p.set_control(p.now, limit)
    demand, parks, readmissions = p.demand, p.parks, p.readmissions
    assert tick(p, p.now + 1.0) == [Proceed("p")]  # p's held turn proceeds; t (thinking) is paused
    (seen_demand, seen_admitted, admitted, held) = limit.seen[0]
    assert (seen_demand, seen_admitted) == (demand, 2)
    assert [(v.session, v.state) for v in admitted] == [("r", S.RUNNING), ("t", S.THINKING)]
    assert [(v.session, v.state, v.demand) for v in held] == [("s", S.SUSPENDED, 100), ("p", S.PARKED, 200)]
    assert admitted[1].state is S.THINKING  # a snapshot: it does not follow the session
    assert p.state_of("t") is S.SUSPENDED and p.state_of("p") is S.RUNNING
    assert p.demand == demand - 300 + 200 and p.parks == parks + 1 and p.readmissions == readmissions + 1
    assert p.parked_order() == ["s", "t"]  # t joins the tail


@pytest.mark.parametrize(
    ("action", "message"),
    [
        (Suspend("r"), "illegal suspend for session 'r' in state RUNNING"),
        (Suspend("nobody"), "illegal suspend for unknown session"),
        (Resume("w"), "resumed 'w', which is not held"),
        (Resume("r"), "illegal admit for session 'r' in state RUNNING"),
        (Resume("d"), "illegal admit for session 'd' in state DONE"),
    ],
)
def test_an_illegal_limit_action_raises(action: Action, message: str) -> None:
    p = _policy_with_every_state()
    p.set_control(p.now, Scripted(C, [action]))
    before = _snapshot(p)
    with pytest.raises(PolicyError, match=message):
        tick(p, p.now + 1.0)
    assert _snapshot(p) == before


# -- the state table and illegal transitions -----------------------------------------------------------------


def _policy_with_every_state() -> Policy:
    """w WAITING, r RUNNING, t THINKING, p PARKED, s SUSPENDED, d DONE."""
    p = Policy(make_control("thunder", kv_pool=C), now=0.0)
    admit_all(p, {"r": 400, "t": 300, "p": 200, "s": 100}, finish=False)
    for x in "tps":
        fin(p, x)
    req(p, "d", 1)
    fin(p, "d")
    end(p, "d")
    tick(p, 5.0)  # D = 1000 > 950: pause the smallest thinking: s (100) -> 900, p (200) -> 700
    assert req(p, "p", 200) == [Park("p")]
    assert req(p, "w", 1) == [Park("w")]
    states = {x: p.state_of(x) for x in "wrtpsd"}
    assert states == {
        "w": S.WAITING,
        "r": S.RUNNING,
        "t": S.THINKING,
        "p": S.PARKED,
        "s": S.SUSPENDED,
        "d": S.DONE,
    }
    return p


def _snapshot(p: Policy) -> tuple[object, ...]:
    return (p.demand, p.counts(), p.parked_order(), p.waiting_order(), p.parks, p.readmissions, p.now)


@pytest.mark.parametrize("session", list("wrtpsd") + ["unknown"])
@pytest.mark.parametrize("kind", ["TurnRequested", "TurnFinished", "TurnAborted", "SessionEnded"])
def test_every_event_in_every_state_follows_the_table(kind: str, session: str) -> None:
    p = _policy_with_every_state()
    state = p.state_of(session) if session != "unknown" else None
    legal = (state, kind) in TRANSITIONS
    events: dict[str, Event] = {
        "TurnRequested": TurnRequested(6.0, session, 10, 1),
        "TurnFinished": TurnFinished(6.0, session, 1.0, 10, 0, 1),
        "TurnAborted": TurnAborted(6.0, session),
        "SessionEnded": SessionEnded(6.0, session),
    }
    ev = events[kind]
    before = _snapshot(p)
    if legal:
        p.handle(ev)
        assert p.state_of(session) in TRANSITIONS[(state, kind)]
    else:
        with pytest.raises(PolicyError, match=f"illegal {kind}"):
            p.handle(ev)
        assert _snapshot(p) == before  # an illegal event changes nothing


def test_illegal_transitions_named_in_the_brief() -> None:
    p = Policy(make_control("budgeter", kv_pool=C))
    with pytest.raises(PolicyError, match="unknown session"):
        fin(p, "ghost")
    req(p, "a", 10)
    with pytest.raises(PolicyError, match="already in flight"):
        req(p, "a", 10)
    fin(p, "a")
    with pytest.raises(PolicyError, match="no turn in flight"):
        fin(p, "a")
    end(p, "a")
    with pytest.raises(PolicyError, match="ended"):
        req(p, "a", 10)
    with pytest.raises(PolicyError, match="ended"):
        end(p, "a")


def test_bad_events_raise_and_change_nothing() -> None:
    p = Policy(make_control("budgeter", kv_pool=C))
    req(p, "a", 10, now=5.0)
    before = _snapshot(p)
    for bad in (
        TurnRequested(4.0, "b", 1, 1),  # time went backwards
        TurnRequested(5.0, "b", -1, 1),
        TurnRequested(5.0, "b", 1.5, 1),  # type: ignore[arg-type]
        TurnRequested(5.0, "b", True, 1),
        "not an event",
    ):
        with pytest.raises(PolicyError):
            p.handle(bad)  # type: ignore[arg-type]
        assert _snapshot(p) == before
    assert req(p, "b", np.int64(7)) == [Proceed("b")]  # type: ignore[arg-type]
    assert p.demand == 17 and type(p.demand) is int
    assert issubclass(PolicyError, ClientError) and issubclass(PolicyError, ValueError)


def test_abort_releases_demand_and_keeps_the_session_thinking() -> None:
    p = Policy(make_control("budgeter", kv_pool=C))
    req(p, "a", 700)
    assert req(p, "b", 100) == [Park("b")]  # 800 > 750
    assert p.handle(TurnAborted(1.0, "a")) == [Proceed("b")]
    assert p.state_of("a") is S.THINKING and p.demand_of("a") == 0 and p.demand == 100
    assert req(p, "a", 700) == [Proceed("a")]  # 800 <= 950
    assert p.demand == 800


def test_session_ended_from_every_state_releases_its_demand_and_queue_place() -> None:
    p = _policy_with_every_state()
    assert p.demand == 700 and p.parked_order() == ["s", "p"] and p.waiting_order() == ["w"]
    assert end(p, "s") == [] and p.parked_order() == ["p"]
    assert end(p, "w") == [] and p.waiting_order() == []
    assert end(p, "p") == [] and p.parked_order() == []
    assert end(p, "t") == [] and p.demand == 400
    assert end(p, "r") == [] and p.demand == 0
    assert p.counts() == {
        "in_system": 0,
        "admitted": 0,
        "parked": 0,
        "waiting": 0,
        "running": 0,
        "thinking": 0,
        "suspended": 0,
        "done": 6,
    }
    p.forget("d")
    with pytest.raises(PolicyError, match="unknown"):
        p.state_of("d")
    assert req(p, "d", 1) == [Proceed("d")]  # a forgotten id is a new arrival
    with pytest.raises(PolicyError, match="not ended"):
        p.forget("d")


def test_spurious_timers_are_harmless() -> None:
    p = Policy(make_control("budgeter", kv_pool=C))
    assert p.next_deadline() is None
    req(p, "a", 10)
    assert tick(p, 3.0) == [] and p.now == 3.0


# -- construction and parsing --------------------------------------------------------------------------------


def test_limits_registry_and_spec_round_trip() -> None:
    assert CONTROLS == (
        "none",
        "budgeter",
        "budgeter-resident",
        "cap",
        "adaptive-cap",
        "aimd",
        "admission-cap",
        "thunder",
    )
    for name in CONTROLS:
        limit = make_control(name, kv_pool=400_000)
        assert limit.name == name
        parsed_name, opts = parse_control(limit.spec())
        assert parsed_name == name and opts == limit.params()
        assert make_control(parsed_name, 400_000, **opts).params() == limit.params()


def test_parse_arm_types_values() -> None:
    assert parse_control("cap:K=22:K_hi=25") == ("cap", {"K": 22, "K_hi": 25})
    assert parse_control("budgeter:low=0.65:high=0.85") == ("budgeter", {"low": 0.65, "high": 0.85})
    name, opts = parse_control(" aimd : K0=8 : interval_s=5 ")
    assert name == "aimd" and opts == {"K0": 8, "interval_s": 5.0} and type(opts["interval_s"]) is float
    assert parse_control("none") == ("none", {})
    # a placeholder name types a bare option list by spelling; make_control is the one that rejects the name
    assert parse_control("x:K=22:low=0.5") == ("x", {"K": 22, "low": 0.5})
    with pytest.raises(PolicyError, match="unknown limit 'x'"):
        make_control("x", 400_000)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ("budget", "unknown limit 'budget'; choose from none, budgeter"),
        ("cap:k=3", "unknown option 'k' for limit 'cap'; its options: K, K_hi"),
        ("cap:K=2.5", "takes an integer"),
        ("cap:K", "expected option=value"),
        ("cap:K=3:K=4", "given twice"),
        ("budgeter:low=lots", "takes a number"),
        ("budgeter:low=0.9:high=0.8", "low=0.9 must be <= high=0.8"),
        ("none:K=3", "its options: none"),
    ],
)
def test_parse_arm_and_make_limit_reject_bad_input(spec: str, message: str) -> None:
    with pytest.raises(PolicyError, match=message.replace(".", r"\.")):
        name, opts = parse_control(spec)
        make_control(name, 400_000, **opts)


@pytest.mark.parametrize(
    ("name", "opts", "message"),
    [
        ("cap", {"K": 5, "K_hi": 4}, "K_hi=4 must be >= K=5"),
        ("cap", {"K": True}, "bool"),
        ("cap", {"K": 0}, "positive integer"),
        ("adaptive-cap", {"alpha": 0.0}, "alpha"),
        ("aimd", {"K0": 1, "min_K": 2}, "K0=1 must be >= min_K=2"),
        ("aimd", {"interval_s": -1.0}, "interval_s must be a positive number"),
        ("thunder", {"resume": 0.99}, "resume=0.99 must be <= high=0.95"),
        ("budgeter", {"low": float("nan")}, "finite"),
        ("budgeter", {"lo": 0.5}, "unknown option 'lo'"),
        # a count past 2^53 (no JSON reader keeps it exact; the control's state could not be answered) and a
        # tick too short to move the clock (a timer firing for ever)
        ("cap", {"K": 1e20}, "at most 2"),
        ("cap", {"K": 10**30}, "at most 2"),
        ("aimd", {"K0": 2**53 + 1}, "at most 2"),
        ("aimd", {"interval_s": 1e-300}, "at least 0.01"),
        ("thunder", {"interval_s": 5e-324}, "at least 0.01"),
    ],
)
def test_make_limit_rejects_bad_options(name: str, opts: dict[str, object], message: str) -> None:
    with pytest.raises(PolicyError, match=message):
        make_control(name, 400_000, **opts)  # type: ignore[arg-type]


def test_make_limit_coerces_and_checks_capacity() -> None:
    assert make_control("cap", 400_000, K=22.0).params() == {"K": 22, "K_hi": 25}
    assert type(make_control("budgeter", 400_000, low=1, high=2).params()["high"]) is float
    with pytest.raises(PolicyError, match="kv_pool"):
        make_control("budgeter", 0)
    with pytest.raises(ValueError):
        make_control("nope", 400_000)
