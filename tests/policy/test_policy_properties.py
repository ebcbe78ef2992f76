"""Property-based tests of the policy core: random event sequences under every limit, then a drain.

A harness plays a well-behaved driver (it only sends events that are legal for what the policy told it) and
keeps its own model of every session: state (from the decisions it got, plus the silent moves thunder makes on
its timer), demand (from the events it sent), and the two queues in the order the actuator must serve them.
After every event it checks:

* D equals the sum of the admitted sessions' demands, and the policy's counts and queues equal the model's;
* re-admission order equals park order (FIFO; thunder instead resumes smallest footprint first, on its timer),
  new sessions are admitted in arrival order, and never while a session is parked;
* a session with a turn in flight is never parked (``Park`` only ever answers the requesting session, and a
  running session never changes state silently);
* with the arrivals stopped and sessions driven to completion, every held session is eventually admitted and D
  returns to 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.policy import (
    AIMD,
    CONTROLS,
    AdaptiveCap,
    AdmissionCap,
    Budgeter,
    Cap,
    Control,
    Park,
    Policy,
    Proceed,
    SessionEnded,
    SessionState,
    Thunder,
    Timer,
    TurnAborted,
    TurnFinished,
    TurnRequested,
    make_control,
)
from kvgate.policy.events import Event, SessionId

S = SessionState
C = 10_000
# Small limits so that every one of them binds with a handful of sessions.
OPTS: dict[str, dict[str, float]] = {
    "none": {},
    "budgeter": {"low": 0.5, "high": 0.6},  # a narrow band: parks often
    "budgeter-resident": {"low": 0.5, "high": 0.6},  # no residency fed here: the plain budgeter
    "cap": {"K": 3, "K_hi": 4},
    "adaptive-cap": {"alpha": 0.3},
    "aimd": {"K0": 4, "interval_s": 2.0, "latency_s": 1.5},
    "admission-cap": {"K": 3},
    "thunder": {"interval_s": 2.0},
}
ADMITTED = (S.RUNNING, S.THINKING)


def admits(limit: Control, demand: int, n: int, d: int) -> bool:
    """The limit's admission condition, restated from the paper (with the empty-system guard)."""
    if n == 0:
        return True
    if isinstance(limit, Budgeter):
        return demand + d <= limit.low * limit.kv_pool
    if isinstance(limit, Cap | AIMD | AdmissionCap):
        return n < limit.K
    if isinstance(limit, AdaptiveCap):
        k = limit.K if limit.K is not None else math.floor(limit.low * limit.kv_pool / max(d, 1))
        return n < k
    return True  # none, thunder (whose new sessions wait only behind paused ones)


def parks(limit: Control, demand: int, n: int) -> bool | None:
    """The limit's park condition at a boundary (with the sole-session guard); None for thunder (marks)."""
    if n <= 1:
        return False
    if isinstance(limit, Budgeter):
        return demand > limit.high * limit.kv_pool
    if isinstance(limit, Cap):
        return n > limit.K_hi
    if isinstance(limit, AdaptiveCap):
        return limit.K_hi is not None and n > limit.K_hi
    if isinstance(limit, AIMD):
        return n > limit.K
    if isinstance(limit, Thunder):
        return None
    return False


@dataclass
class Model:
    state: S
    demand: int
    turns_left: int


class Harness:
    def __init__(self, name: str) -> None:
        self.policy = Policy(make_control(name, C, **OPTS[name]), now=0.0)
        self.now = 0.0
        self.sessions: dict[SessionId, Model] = {}
        self.live: dict[SessionId, Model] = {}  # the sessions not DONE
        self.done = 0
        self.held: list[SessionId] = []  # parked queue: PARKED and SUSPENDED, in park order
        self.waiting: list[SessionId] = []  # new sessions, in arrival order
        self.next_id = 0
        self.readmitted_total = 0

    # -- driving -------------------------------------------------------------------------------------------
    def advance(self, dt: float) -> None:
        """Move the clock, firing every timer that falls due on the way."""
        self.now += dt
        while (deadline := self.policy.next_deadline()) is not None and deadline <= self.now:
            self.send(Timer(max(deadline, self.policy.now)))

    def in_state(self, *states: S) -> list[SessionId]:
        return [sid for sid, m in self.live.items() if m.state in states]

    def arrive(self, demand: int, turns: int) -> None:
        sid = self.next_id
        self.next_id += 1
        self.send(TurnRequested(self.now, sid, demand, 100), turns=turns)

    def request(self, sid: SessionId, grow: int) -> None:
        # the driver does not know about thunder's pauses: a suspended session is thinking, to it
        self.send(TurnRequested(self.now, sid, self.sessions[sid].demand + grow, 100))

    def finish(self, sid: SessionId, latency: float) -> None:
        self.send(TurnFinished(self.now, sid, latency, self.sessions[sid].demand, None, 100))

    def switch(self, name: str) -> None:
        self.check_step(None, self.policy.set_control(self.now, make_control(name, C, **OPTS[name])))

    def send(self, ev: Event, turns: int = 1) -> None:
        decisions = self.policy.handle(ev)
        rest = decisions
        if isinstance(ev, TurnRequested):
            assert decisions and decisions[0].session == ev.session
            first, rest = decisions[0], decisions[1:]
            demand = ev.context_tokens + ev.output_tokens
            m = self.sessions.get(ev.session)
            limit, big_d, n = self.policy.control, self.policy.demand, self.policy.n_admitted
            if m is None:
                m = self.sessions[ev.session] = self.live[ev.session] = Model(S.WAITING, demand, turns - 1)
                if isinstance(first, Proceed):
                    assert not self.held and not self.waiting, "a new session skipped the queue"
                    assert admits(limit, big_d - demand, n - 1, demand)
                    m.state = S.RUNNING
                else:
                    assert self.held or self.waiting or not admits(limit, big_d, n, demand)
                    self.waiting.append(ev.session)
            else:
                assert m.state in (S.THINKING, S.SUSPENDED), "driver bug"
                m.demand = demand
                m.turns_left -= 1
                if m.state is S.THINKING:
                    # D and n at the check include the session, whether it was then parked or not
                    parked = isinstance(first, Park)
                    expected = parks(limit, big_d + demand if parked else big_d, n + 1 if parked else n)
                    assert expected is None or expected == parked, (limit, big_d, n, parked)
                if isinstance(first, Proceed):
                    assert m.state is S.THINKING, "a suspended session's turn must be held"
                    m.state = S.RUNNING
                elif m.state is S.SUSPENDED:
                    m.state = S.PARKED  # keeps its place in the queue
                else:
                    m.state = S.PARKED
                    self.held.append(ev.session)
        elif isinstance(ev, TurnFinished | TurnAborted):
            m = self.sessions[ev.session]
            assert m.state is S.RUNNING
            m.state = S.THINKING
            if isinstance(ev, TurnAborted):
                m.demand = 0
        elif isinstance(ev, SessionEnded):
            m = self.sessions[ev.session]
            for queue in (self.held, self.waiting):
                if ev.session in queue:
                    queue.remove(ev.session)
            m.state = S.DONE
            del self.live[ev.session]
            self.done += 1
            assert self.policy.state_of(ev.session) is S.DONE
        self.check_step(ev, rest)

    # -- checking ------------------------------------------------------------------------------------------
    def check_step(self, ev: Event | None, rest: list[Proceed | Park]) -> None:
        p = self.policy
        fifo = p.control.fifo_readmit
        # 1. thunder's silent pauses (at its timer only), in the order the policy queued them
        paused = [sid for sid in self.in_state(S.THINKING) if p.state_of(sid) is S.SUSPENDED]
        if paused:
            assert isinstance(ev, Timer) and p.control.name == "thunder"
            for sid in paused:
                self.sessions[sid].state = S.SUSPENDED
            order = p.parked_order()
            self.held.extend(sorted(paused, key=order.index))
        # 2. re-admissions: Proceed for held turns, silent for suspended sessions
        held_before, waiting_before = list(self.held), list(self.waiting)
        readmitted: list[SessionId] = []
        for d in rest:
            assert isinstance(d, Proceed), "Park only answers the requesting session"
            m = self.sessions[d.session]
            assert m.state in (S.PARKED, S.WAITING), f"Proceed for a session in {m.state}"
            m.state = S.RUNNING
            readmitted.append(d.session)
        for sid in self.in_state(S.SUSPENDED):
            if p.state_of(sid) is S.THINKING:
                self.sessions[sid].state = S.THINKING
                readmitted.append(sid)
        from_held = [sid for sid in readmitted if sid in held_before]
        from_new = [sid for sid in readmitted if sid in waiting_before]
        assert len(from_held) + len(from_new) == len(readmitted)
        if fifo or ev is None:
            # FIFO: the re-admitted held sessions are exactly the head of the queue, Proceeds in queue order
            assert sorted(from_held, key=held_before.index) == held_before[: len(from_held)]
            proceeds = [sid for sid in from_held if self.sessions[sid].state is S.RUNNING]
            assert proceeds == [sid for sid in held_before if sid in proceeds]
        else:  # thunder: on its timer only, smallest footprint first
            if from_held:
                assert isinstance(ev, Timer)
                remaining = [self.sessions[sid].demand for sid in held_before if sid not in from_held]
                if remaining:
                    assert max(self.sessions[sid].demand for sid in from_held) <= min(remaining)
        assert from_new == waiting_before[: len(from_new)], "new sessions out of arrival order"
        self.held = [sid for sid in held_before if sid not in from_held]
        self.waiting = [sid for sid in waiting_before if sid not in from_new]
        if from_new:
            assert not self.held, "a new session was admitted while a session was parked"
        self.readmitted_total += len(from_held)
        if fifo and not isinstance(ev, TurnRequested):
            # every admission was allowed when it happened (queue order), and the pump stopped at a head that
            # does not fit
            limit = p.control
            order = sorted(from_held, key=held_before.index) + from_new
            big_d = p.demand - sum(self.sessions[sid].demand for sid in order)
            n = p.n_admitted - len(order)
            for sid in order:
                d_s = self.sessions[sid].demand
                assert admits(limit, big_d, n, d_s), (limit, big_d, n, d_s)
                big_d, n = big_d + d_s, n + 1
            head = self.held[0] if self.held else self.waiting[0] if self.waiting else None
            if head is not None:
                assert not admits(limit, p.demand, p.n_admitted, self.sessions[head].demand)
        elif isinstance(p.control, Thunder) and not isinstance(ev, TurnRequested) and not self.held:
            assert not self.waiting, "thunder keeps new sessions waiting only behind paused ones"
        # 3. the policy agrees with the model, session by session (a running session never moves silently)
        for sid, m in self.live.items():
            assert p.state_of(sid) is m.state, (sid, p.state_of(sid), m.state, ev)
            assert p.demand_of(sid) == m.demand
        assert p.demand == sum(m.demand for m in self.live.values() if m.state in ADMITTED)
        assert p.parked_order() == self.held
        assert p.waiting_order() == self.waiting
        counts = p.counts()
        by_state = {s: 0 for s in S}
        for m in self.live.values():
            by_state[m.state] += 1
        assert counts["running"] == by_state[S.RUNNING] and counts["thinking"] == by_state[S.THINKING]
        assert counts["parked"] == by_state[S.PARKED] + by_state[S.SUSPENDED]
        assert counts["waiting"] == by_state[S.WAITING] and counts["done"] == self.done
        assert counts["admitted"] == p.n_admitted == by_state[S.RUNNING] + by_state[S.THINKING]
        assert counts["in_system"] == len(self.live)
        assert p.readmissions == self.readmitted_total
        if fifo and (self.held or self.waiting):
            assert p.n_admitted >= 1, "sessions held with nothing admitted: nothing would ever release them"

    # -- draining ------------------------------------------------------------------------------------------
    def drain(self, max_steps: int = 20_000) -> None:
        """No more arrivals: finish turns, take remaining turns, end sessions; fire timers when nothing else
        can happen. Every held session must eventually be admitted and every session end."""
        for step in range(max_steps):
            self.advance(0.25)
            running = self.in_state(S.RUNNING)
            if running:
                sid = running[0]
                self.finish(sid, latency=3.0 if step % 3 == 0 else 0.5)
                continue
            idle = self.in_state(S.THINKING, S.SUSPENDED)
            if idle:
                sid = idle[0]
                if self.sessions[sid].turns_left > 0:
                    self.request(sid, grow=500)
                else:
                    self.send(SessionEnded(self.now, sid))
                continue
            if not self.held and not self.waiting:
                break
            deadline = self.policy.next_deadline()
            assert deadline is not None, f"deadlock: held {self.held}, waiting {self.waiting}, nothing admitted"
            self.advance(max(0.0, deadline - self.now))
        else:
            raise AssertionError("drain did not finish")
        assert all(m.state is S.DONE for m in self.sessions.values())
        assert self.policy.demand == 0 and self.policy.counts()["in_system"] == 0


KINDS = ["arrive"] * 3 + ["request"] * 3 + ["finish"] * 3 + ["end", "abort", "wait"]
actions = st.lists(
    st.tuples(
        st.sampled_from(KINDS),
        st.integers(0, 10_000),  # which session
        st.one_of(st.integers(0, 4_000), st.integers(4_000, 12_000)),  # tokens: demand or growth; > C at times
        st.floats(0.0, 3.0, allow_nan=False),  # time step, and turn latency
    ),
    min_size=10,
    max_size=80,
)


def play(h: Harness, script: list[tuple[str, int, int, float]], switch_to: list[str] | None = None) -> None:
    for i, (kind, pick, tokens, dt) in enumerate(script):
        h.advance(dt)
        if switch_to and i % 10 == 9:
            h.switch(switch_to[(i // 10) % len(switch_to)])
        if kind == "arrive":
            h.arrive(demand=tokens, turns=1 + pick % 5)
            continue
        candidates = {
            "request": h.in_state(S.THINKING, S.SUSPENDED),
            "finish": h.in_state(S.RUNNING),
            "abort": h.in_state(S.RUNNING),
            "end": h.in_state(S.WAITING, S.RUNNING, S.THINKING, S.PARKED, S.SUSPENDED),
            "wait": [],
        }[kind]
        if not candidates:
            continue
        sid = candidates[pick % len(candidates)]
        if kind == "request":
            h.request(sid, grow=tokens // 2)
        elif kind == "finish":
            h.finish(sid, latency=dt * 2)
        elif kind == "abort":
            h.send(TurnAborted(h.now, sid))
        else:
            h.send(SessionEnded(h.now, sid))


FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@pytest.mark.parametrize("name", CONTROLS)
@FAST
@given(script=actions)
def test_random_events_keep_the_invariants_and_drain(name: str, script: list[tuple[str, int, int, float]]) -> None:
    h = Harness(name)
    play(h, script)
    h.drain()


@FAST
@given(script=actions, order=st.permutations(list(CONTROLS)))
def test_switching_limits_midway_keeps_the_invariants_and_drains(
    script: list[tuple[str, int, int, float]], order: list[str]
) -> None:
    h = Harness(order[0])
    play(h, script, switch_to=order[1:])
    h.drain()


@pytest.mark.parametrize("name", CONTROLS)
def test_a_burst_of_large_sessions_drains_under_every_limit(name: str) -> None:
    """Deterministic overload: 60 sessions of 1.5K-4K tokens (about 15 fit) arrive at once."""
    h = Harness(name)
    for i in range(60):
        h.arrive(demand=1_500 + (i * 377) % 2_500, turns=3)
    assert h.policy.counts()["in_system"] == 60
    h.drain()
    assert h.policy.counts()["done"] == 60
