"""The policy core: may this session take its next turn? No I/O, no clock, no awaiting.

Theory of operation (the paper's actuator, §5). A driver (the in-process simulator, or the HTTP gateway)
feeds events carrying ``now`` into ``Policy.handle`` and gets decisions back; timers work as in aioquic: the
driver asks ``next_deadline()`` and sends ``Timer(now)`` when it is reached.

At each turn boundary of session s (``TurnRequested``):

1. s's demand becomes d_s = context + output budget (D follows if s is admitted);
2. a new session is admitted if the control admits it and nobody is queued ahead of it (parked sessions, then
   waiting new ones); otherwise it waits (``Park``) at the tail of the new-session FIFO;
3. an admitted session is parked (``Park``, tail of the parked FIFO) if the control's park condition holds, else
   its turn proceeds. Only the session at its boundary can be parked: nothing in flight is interrupted.

Whenever a turn finishes or aborts, a session ends, a timer fires or the control is switched, the *pump*
re-admits from the heads of the queues, parked sessions before new ones, one at a time while the control admits
the head, stopping at the first head that does not fit (no skipping). Each re-admitted session's pending turn
gets ``Proceed``.

Demand: D = sum of d_s over admitted (running or thinking) sessions, in-flight turns counted with their full
context and output budget; held sessions do not count. D is a running sum: every event costs O(1) (plus O(1)
amortised per session the pump admits); only thunder's timer, once per interval, looks at all sessions.

Two guards keep the actuator live whatever the control (a session alone can exceed any band):

* NOTE: when no session is admitted, the head of the queue is admitted whatever the control says;
* NOTE: a session that is the only admitted one is never parked.
"""

from __future__ import annotations

import operator
from collections.abc import Callable, Hashable
from itertools import count
from typing import Any

import kvgate.policy.events as events
from kvgate.policy.events import Decision, Event, Park, Proceed, SessionId, TurnRequested
from kvgate.policy.fifo import Fifo
from kvgate.policy.limits import Control
from kvgate.policy.state import (
    ABORT,
    ADMIT,
    END,
    FINISH,
    HELD,
    REQUEST,
    SUSPEND,
    TRANSITIONS,
    PolicyError,
    SessionState,
    check,
)
from kvgate.policy.view import Action, Resume, SessionView, Suspend

_WAITING = SessionState.WAITING
_RUNNING = SessionState.RUNNING
_THINKING = SessionState.THINKING
_PARKED = SessionState.PARKED
_SUSPENDED = SessionState.SUSPENDED
_DONE = SessionState.DONE


class SessionRecord:
    """What the policy keeps per session."""

    __slots__ = ("sid", "state", "demand", "output", "ticket")

    def __init__(self, sid: Hashable) -> None:
        self.sid = sid
        self.state: SessionState | None = None
        self.demand = 0
        """d_s = L_s + o_s as of the session's last turn boundary (0 after an aborted turn)."""
        self.output = 0
        """o_s, the output budget of d_s (0 after an aborted turn)."""
        self.ticket = 0
        """Ticket of the session's queue entry; 0 when it is in no queue (see ``fifo``)."""


class Policy:
    """Park sessions at turn boundaries against a control's limit. See the module docstring."""

    def __init__(self, control: Control, *, now: float = 0.0) -> None:
        """``now`` is the time the control's timers start from (the driver's clock at startup)."""
        self._now = float(now)
        self._sessions: dict[SessionId, SessionRecord] = {}
        self._admitted: dict[SessionId, SessionRecord] = {}
        tickets = count(1)
        self._parked: Fifo[SessionRecord] = Fifo(tickets)
        self._waiting: Fifo[SessionRecord] = Fifo(tickets)
        self._demand = 0
        self._in_state: dict[SessionState, int] = dict.fromkeys(SessionState, 0)
        self.parks = 0
        """Times an admitted session was parked (park decisions at a boundary, and thunder's pauses)."""
        self.readmissions = 0
        """Times a parked or suspended session was admitted again."""
        self.waits = 0
        """New sessions that had to wait for admission (their first ``Park``)."""
        self._handlers: dict[type, Callable[[Any], list[Decision]]] = {
            events.TurnRequested: self._on_requested,
            events.TurnFinished: self._on_finished,
            events.TurnAborted: self._on_aborted,
            events.SessionEnded: self._on_ended,
            events.Timer: self._on_timer,
        }
        self.residency: Callable[[SessionId], int | None] | None = None
        """A session's measured resident tokens (None: unknown), injected by a driver for ``budgeter-resident``."""
        self._control = control
        control.bind(self, self._now)

    # -- the interface ---------------------------------------------------------------------------------------
    def handle(self, event: Event) -> list[Decision]:
        """Feed one event; return the decisions it causes.

        For ``TurnRequested`` the decision is about that session (``Proceed`` or ``Park``; it is the first
        and, in this implementation, the only one: re-admission waits for a completion, as in the paper). The
        other events may release held sessions: one ``Proceed`` each, in re-admission order. An illegal event
        raises ``PolicyError`` and leaves the policy unchanged.
        """
        handler = self._handlers.get(type(event))
        if handler is None:
            raise PolicyError(f"not a policy event: {event!r}")
        if event.now < self._now:
            raise PolicyError(f"time went backwards: {event!r} after now={self._now}")
        decisions = handler(event)
        self._now = event.now
        return decisions

    def next_deadline(self) -> float | None:
        """When the control next needs ``Timer``; None if it has no timer."""
        return self._control.next_deadline()

    def set_control(self, now: float, control: Control) -> list[Decision]:
        """Switch control at ``now``; sessions it admits at once get ``Proceed``.

        Held sessions keep their queue and their order. The new control's timers start at ``now``; sessions
        above its band are parked at their next boundary, never interrupted.
        """
        if now < self._now:
            raise PolicyError(f"time went backwards: set_control at {now} after now={self._now}")
        control.bind(self, now)
        self._control = control
        self._now = now
        return self._pump()

    @property
    def control(self) -> Control:
        return self._control

    @property
    def now(self) -> float:
        """The time of the last event handled."""
        return self._now

    @property
    def demand(self) -> int:
        """D: the sum of d_s over admitted sessions."""
        return self._demand

    @property
    def n_admitted(self) -> int:
        """Sessions admitted (running or thinking)."""
        return len(self._admitted)

    def counts(self) -> dict[str, int]:
        """Sessions by situation. ``parked`` includes ``suspended`` (paused by thunder while thinking)."""
        n = self._in_state
        running, thinking = n[_RUNNING], n[_THINKING]
        parked, suspended, waiting = n[_PARKED], n[_SUSPENDED], n[_WAITING]
        return {
            "in_system": running + thinking + parked + suspended + waiting,
            "admitted": running + thinking,
            "parked": parked + suspended,
            "waiting": waiting,
            "running": running,
            "thinking": thinking,
            "suspended": suspended,
            "done": n[_DONE],
        }

    def state_of(self, session: SessionId) -> SessionState:
        """The session's state; ``PolicyError`` if the policy has never seen it (or it was forgotten)."""
        rec = self._sessions.get(session)
        if rec is None or rec.state is None:
            raise PolicyError(f"unknown session {session!r}")
        return rec.state

    def demand_of(self, session: SessionId) -> int:
        """The session's demand d_s as of its last turn boundary."""
        self.state_of(session)
        return self._sessions[session].demand

    def parked_order(self) -> list[SessionId]:
        """Held sessions in the parked queue, oldest first (O(n); for inspection and tests)."""
        return [rec.sid for rec in self._parked]

    def waiting_order(self) -> list[SessionId]:
        """New sessions waiting for admission, oldest first (O(n); for inspection and tests)."""
        return [rec.sid for rec in self._waiting]

    def forget(self, session: SessionId) -> None:
        """Drop an ended session's record (a long-running gateway calls this to bound memory). Afterwards the
        id is unknown, so a ``TurnRequested`` for it would be a new arrival."""
        if self.state_of(session) is not _DONE:
            raise PolicyError(f"cannot forget session {session!r}: it has not ended")
        del self._sessions[session]
        self._in_state[_DONE] -= 1

    # -- event handlers --------------------------------------------------------------------------------------
    def _on_requested(self, ev: TurnRequested) -> list[Decision]:
        sid = ev.session
        ctx, out = ev.context_tokens, ev.output_tokens
        if type(ctx) is not int or type(out) is not int or ctx < 0 or out < 0:
            ctx, out = checked_tokens(ev)
        demand = ctx + out
        rec = self._sessions.get(sid)
        control = self._control
        if rec is None:  # arrival
            rec = SessionRecord(sid)
            self._sessions[sid] = rec
            control.observe_boundary(demand)
            rec.demand, rec.output = demand, out
            queued = self._parked.live or self._waiting.live
            if not queued and (not self._admitted or control.admits(self, demand)):
                self._move(rec, REQUEST, _RUNNING)
                self._admitted[sid] = rec
                self._demand += demand
                return [Proceed(sid)]
            self._move(rec, REQUEST, _WAITING)
            self._waiting.push(rec)
            self.waits += 1
            return [Park(sid)]
        state = rec.state
        if state is _THINKING:
            control.observe_boundary(demand)
            self._demand += demand - rec.demand
            rec.demand, rec.output = demand, out
            if len(self._admitted) > 1 and control.parks(self, sid):
                self._move(rec, REQUEST, _PARKED)
                del self._admitted[sid]
                self._demand -= demand
                self._parked.push(rec)
                self.parks += 1
                return [Park(sid)]
            self._move(rec, REQUEST, _RUNNING)
            return [Proceed(sid)]
        if state is _SUSPENDED:  # paused by thunder while thinking: the turn is held where it stands
            control.observe_boundary(demand)
            rec.demand, rec.output = demand, out
            self._move(rec, REQUEST, _PARKED)
            return [Park(sid)]
        check(state, REQUEST, sid)
        raise AssertionError("unreachable")  # pragma: no cover

    def _on_finished(self, ev: events.TurnFinished) -> list[Decision]:
        rec = self._sessions.get(ev.session)
        if rec is None or rec.state is not _RUNNING:
            rec = self._known(ev.session, FINISH)
        self._move(rec, FINISH, _THINKING)
        self._control.observe_finished(ev.now, ev.latency_s)
        return self._pump()

    def _on_aborted(self, ev: events.TurnAborted) -> list[Decision]:
        rec = self._known(ev.session, ABORT)
        self._move(rec, ABORT, _THINKING)
        self._demand -= rec.demand
        rec.demand = rec.output = 0
        return self._pump()

    def _on_ended(self, ev: events.SessionEnded) -> list[Decision]:
        rec = self._known(ev.session, END)
        state = rec.state
        if state is _RUNNING or state is _THINKING:
            del self._admitted[rec.sid]
            self._demand -= rec.demand
        elif state is _WAITING:
            self._waiting.remove(rec)
        else:  # PARKED or SUSPENDED
            self._parked.remove(rec)
        self._move(rec, END, _DONE)
        return self._pump()

    def _on_timer(self, ev: events.Timer) -> list[Decision]:
        control = self._control
        deadline = control.next_deadline()
        out: list[Decision] = []
        if deadline is not None and ev.now >= deadline:
            self._apply(control.on_timer(ev.now, self), out)
        out.extend(self._pump())
        return out

    # -- the actuator ----------------------------------------------------------------------------------------
    def _pump(self) -> list[Decision]:
        """Re-admit from the queue heads, parked before new, one at a time while the control admits the head."""
        out: list[Decision] = []
        parked, waiting = self._parked, self._waiting
        if not parked.live and not waiting.live:
            return out
        control = self._control
        if parked.live:
            if not control.fifo_readmit:
                return out  # thunder resumes parked sessions on its timer; new ones wait behind them
            while (rec := parked.head()) is not None:
                if self._admitted and not control.admits(self, rec.demand):
                    return out
                parked.remove(rec)
                self._resume(rec, out)
        while (rec := waiting.head()) is not None:
            if self._admitted and not control.admits(self, rec.demand):
                break
            waiting.remove(rec)
            self._move(rec, ADMIT, _RUNNING)
            self._admitted[rec.sid] = rec
            self._demand += rec.demand
            out.append(Proceed(rec.sid))
        return out

    def _move(self, rec: SessionRecord, cause: str, new: SessionState) -> None:
        allowed = TRANSITIONS.get((rec.state, cause))
        if allowed is None or new not in allowed:
            check(rec.state, cause, rec.sid)
            raise PolicyError(f"illegal {cause}: {rec.state} -> {new} for session {rec.sid!r}")
        n = self._in_state
        if rec.state is not None:
            n[rec.state] -= 1
        n[new] += 1
        rec.state = new

    def _known(self, sid: SessionId, cause: str) -> SessionRecord:
        rec = self._sessions.get(sid)
        state = None if rec is None else rec.state
        check(state, cause, sid)
        assert rec is not None
        return rec

    # -- the read-only view controls decide over (see ``view``) -----------------------------------------------
    def admitted_sessions(self) -> list[SessionView]:
        """Snapshots of the admitted sessions, in admission order (O(n))."""
        return [_snapshot(rec) for rec in self._admitted.values()]

    def held_sessions(self) -> list[SessionView]:
        """Snapshots of the sessions in the parked queue (parked or suspended), oldest first (O(n))."""
        return [_snapshot(rec) for rec in self._parked]

    # -- the controls' actions, applied through the transition table -------------------------------------------
    def _apply(self, actions: list[Action], out: list[Decision]) -> None:
        """Apply a control's actions in order; an illegal one raises ``PolicyError`` (a bug in the control)."""
        for action in actions:
            if type(action) is Suspend:
                self._suspend(self._known(action.session, SUSPEND))
            elif type(action) is Resume:
                rec = self._known(action.session, ADMIT)
                if rec.state not in HELD:
                    raise PolicyError(f"control {self._control.name!r} resumed {action.session!r}, which is not held")
                self._resume(rec, out)
            else:
                raise PolicyError(f"not a control action: {action!r}")

    def _suspend(self, rec: SessionRecord) -> None:
        """Pause a thinking session: it leaves the admitted set and joins the parked queue."""
        self._move(rec, SUSPEND, _SUSPENDED)
        del self._admitted[rec.sid]
        self._demand -= rec.demand
        self._parked.push(rec)
        self.parks += 1

    def _resume(self, rec: SessionRecord, out: list[Decision]) -> None:
        """Admit a held session again (removing it from the parked queue if it is still there)."""
        if rec.ticket:
            self._parked.remove(rec)
        if rec.state is _PARKED:
            self._move(rec, ADMIT, _RUNNING)
            out.append(Proceed(rec.sid))
        else:
            self._move(rec, ADMIT, _THINKING)
        self._admitted[rec.sid] = rec
        self._demand += rec.demand
        self.readmissions += 1


def _snapshot(rec: SessionRecord) -> SessionView:
    assert rec.state is not None
    return SessionView(rec.sid, rec.state, rec.demand, rec.output)


def checked_tokens(ev: TurnRequested) -> tuple[int, int]:
    """The slow path of token validation: accept integer-like values (numpy), reject the rest."""
    values = []
    for name in ("context_tokens", "output_tokens"):
        value = getattr(ev, name)
        try:
            if isinstance(value, bool):
                raise TypeError
            number = operator.index(value)
        except TypeError:
            raise PolicyError(f"{name} must be a non-negative int, got {value!r} in {ev!r}") from None
        if number < 0:
            raise PolicyError(f"{name} must be a non-negative int, got {value!r} in {ev!r}")
        values.append(int(number))
    return values[0], values[1]
