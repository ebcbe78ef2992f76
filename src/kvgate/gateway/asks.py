"""A session's turn told to its policy: the request path's policy calls, in one place.

* :meth:`PolicyCalls.ask`: the turn is at its boundary (``TurnRequested``); held or let run;
* :meth:`PolicyCalls.finished`: the upstream answered it (``TurnFinished``);
* :meth:`PolicyCalls.aborted`: it failed or its client left while it ran (``TurnAborted``);
* :meth:`PolicyCalls.abandon`: its handler leaves early: whatever the turn holds in the policy is let go.

Each tells the session's policy (:attr:`~kvgate.gateway.sessions.GwSession.policy`, set by
:mod:`kvgate.gateway.placement`) and hands its decisions to :meth:`~kvgate.gateway.sessions.Sessions.apply` (a held
turn let proceed wakes in its slot: :meth:`~kvgate.gateway.slot.TurnSlot.wake`). A session's end and release
(``SessionEnded``) are its lifecycle's (:mod:`kvgate.gateway.sessions`). No I/O and no clock: every call is given
``now``.
"""

from __future__ import annotations

from kvgate.gateway.sessions import GwSession, Sessions
from kvgate.gateway.tenants import over_quota
from kvgate.policy import OverQuota, Park, SessionState, TurnAborted, TurnFinished, TurnRequested

_RUNNING = SessionState.RUNNING
_HELD = frozenset({SessionState.WAITING, SessionState.PARKED})
_PLACED = _HELD | {_RUNNING}


class PolicyCalls:
    """The policy calls of the turns of ``sessions`` (it counts the resumed sessions and the pool's pressure)."""

    __slots__ = ("sessions",)

    def __init__(self, sessions: Sessions) -> None:
        self.sessions = sessions

    def ask(self, s: GwSession, now: float, context: int, budget: int) -> bool:
        """Tell the session's policy its turn is at its boundary (placed first); True if it is held.

        A retry that took over a replaced attempt's place (``reattach``) keeps it: no new ``TurnRequested``.
        Raises ``PolicyError`` for a request the policy refuses, ``OverQuota`` (nothing changed) over quota."""
        policy = s.policy
        assert policy is not None, "ask before place"
        sid = s.sid
        sessions = self.sessions
        reattached = s.slot.reattach and s.known_to_policy and policy.state_of(sid) in _PLACED
        s.slot.keep_place(False)
        if reattached:  # the replaced attempt's place: still held, or admitted since
            return policy.state_of(sid) in _HELD
        if s.released:  # it came back after its release: the policy sees a new session
            s.released, sessions.resumed = False, sessions.resumed + 1
        decisions = policy.handle(TurnRequested(now, sid, context, budget, s.tenant, s.priority))
        if type(decisions[0]) is OverQuota:
            raise over_quota(s, decisions[0])
        s.known_to_policy = True
        s.replaced = False
        self._pressed(s)
        sessions.mark(s)
        if len(decisions) > 1:
            sessions.apply(decisions, 1)
        return type(decisions[0]) is Park

    def finished(
        self, s: GwSession, now: float, latency: float, prompt: int, cached: int | None, completion: int
    ) -> None:
        p = s.policy
        if p is not None and s.known_to_policy:
            self.sessions.apply(p.handle(TurnFinished(now, s.sid, latency, prompt, cached, completion)))
            self._pressed(s)

    def aborted(self, s: GwSession, now: float) -> None:
        p = s.policy
        if p is not None and s.known_to_policy:
            self.sessions.apply(p.handle(TurnAborted(now, s.sid)))

    def abandon(self, s: GwSession, reason: str, now: float) -> None:
        """The turn's handler is leaving early: release whatever the turn holds in the policy."""
        policy = s.policy
        if s.slot.dropped or not s.known_to_policy or policy is None:
            return
        state = policy.state_of(s.sid)
        if s.slot.superseded and state in _HELD:
            s.slot.keep_place(True)  # a retry of this turn takes over its place in the policy
            return
        if state is _RUNNING:
            self.aborted(s, now)
        elif state in _HELD:
            self.sessions.end(s, reason, now)

    @staticmethod
    def hold_kind(s: GwSession) -> str:
        """ "parked" (an admitted session parked at its turn boundary) or "waiting" (a new session)."""
        p = s.policy
        return "parked" if p is not None and p.state_of(s.sid) is SessionState.PARKED else "waiting"

    @staticmethod
    def is_running(s: GwSession) -> bool:
        """The policy lets the session's turn run (checked when a hold times out at the instant of admission)."""
        p = s.policy
        return p is not None and s.known_to_policy and p.state_of(s.sid) is _RUNNING

    def _pressed(self, s: GwSession) -> None:
        """Count an event after which the session's policy holds more than its pool (D > C)."""
        p = s.policy
        if p is None:
            return
        sessions = self.sessions
        fleet = sessions.fleet
        if fleet.single:  # (C: its one replica's pool while it is up)
            rep = fleet.replicas[0]
            pool = rep.kv_pool if rep.up else 0
        else:
            pool = fleet.live_pool() if fleet.shared is not None or s.replica is None else s.replica.kv_pool
        if p.demand > pool > 0:
            sessions.pressure += 1
