"""Session states and the table of legal transitions.

Rules of this file (read them before changing the table):

* Every change of a session's state goes through ``TRANSITIONS``. A key is ``(state before, cause)``; the
  value is the set of states the cause may lead to. A ``(state, cause)`` pair that is not in the table is
  illegal and the policy raises ``PolicyError`` *before* it changes anything.
* ``None`` is the state of a session the policy has never seen. Only a turn request (its arrival) leaves it.
* A cause is a driver event (``REQUEST`` = ``"TurnRequested"``, ``FINISH``, ``ABORT``, ``END``) or one of the
  policy's own actions (``ADMIT`` = ``"admit"``: re-admission from a queue; ``SUSPEND``: thunder's pause).

::

    (unknown) --REQUEST--> RUNNING                      (admitted at arrival)
    (unknown) --REQUEST--> WAITING --admit--> RUNNING   (waited in the new-session FIFO)
    RUNNING   --FINISH / ABORT--> THINKING
    THINKING  --REQUEST--> RUNNING                      (the turn proceeds)
    THINKING  --REQUEST--> PARKED  --admit--> RUNNING   (parked at the boundary; FIFO re-admission)
    THINKING  --suspend--> SUSPENDED                    (thunder's timer, between turns)
    SUSPENDED --REQUEST--> PARKED                       (its next turn is held in place)
    SUSPENDED --admit--> THINKING                       (resumed before it asked for a turn)
    any state but DONE --END--> DONE

Admitted sessions are RUNNING or THINKING; they count toward the demand D. WAITING (new, never admitted),
PARKED (pending turn held) and SUSPENDED (a thinking session paused by thunder; its next turn will be held)
do not.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping
from typing import Final

from kvgate.errors import ClientError


class PolicyError(ClientError, ValueError):
    """Misuse of the policy core: an illegal transition, a bad event, an unknown control or option.

    It is a ``ClientError`` (HTTP 400: in the gateway it means a client broke the session protocol, e.g. sent
    a second turn while one is in flight) and a ``ValueError`` (for callers that know only the builtins).
    """


class SessionState(enum.Enum):
    """Where a session is, as far as the policy is concerned."""

    WAITING = "waiting"
    """New session with a pending first turn, never admitted yet; in the new-session FIFO."""
    RUNNING = "running"
    """Admitted, a turn is in flight at the engine."""
    THINKING = "thinking"
    """Admitted, between turns (tool call / think time)."""
    PARKED = "parked"
    """Was admitted; its pending turn is held in the parked queue."""
    SUSPENDED = "suspended"
    """Thunder paused it while thinking: not admitted, no pending turn yet; its next turn will be held."""
    DONE = "done"
    """Ended."""

    # NOTE: members are singletons compared by identity, so identity hashing is consistent with equality; it
    # is a C slot, where Enum's default hashes the member's name in Python (states are hashed per event).
    __hash__ = object.__hash__


W, R, T, P, S, D = (
    SessionState.WAITING,
    SessionState.RUNNING,
    SessionState.THINKING,
    SessionState.PARKED,
    SessionState.SUSPENDED,
    SessionState.DONE,
)

# Causes: driver events (named after the event class) and the policy's own actions (lower case).
REQUEST: Final = "TurnRequested"
FINISH: Final = "TurnFinished"
ABORT: Final = "TurnAborted"
END: Final = "SessionEnded"
ADMIT: Final = "admit"
SUSPEND: Final = "suspend"

TRANSITIONS: Final[Mapping[tuple[SessionState | None, str], frozenset[SessionState]]] = {
    # arrival: admitted at once (its first turn proceeds) or waits in the new-session FIFO
    (None, REQUEST): frozenset({R, W}),
    # turn boundary of an admitted session: proceed, or park (park condition holds)
    (T, REQUEST): frozenset({R, P}),
    # turn boundary of a session thunder suspended: its turn is held
    (S, REQUEST): frozenset({P}),
    (R, FINISH): frozenset({T}),
    (R, ABORT): frozenset({T}),
    # re-admission from the queues (pending turns proceed; a suspended session just thinks again)
    (W, ADMIT): frozenset({R}),
    (P, ADMIT): frozenset({R}),
    (S, ADMIT): frozenset({T}),
    # thunder pauses a thinking session at its timer
    (T, SUSPEND): frozenset({S}),
    # leaving is legal from every state but DONE
    **{(state, END): frozenset({D}) for state in (W, R, T, P, S)},
}
"""The legal transitions; anything else raises ``PolicyError``."""

ADMITTED: Final = frozenset({R, T})
"""States that count toward the demand D."""
HELD: Final = frozenset({P, S})
"""States of sessions in the parked queue."""


def check(state: SessionState | None, cause: str, session: object) -> frozenset[SessionState]:
    """The states ``cause`` may lead to from ``state``; raise ``PolicyError`` if the pair is illegal."""
    allowed = TRANSITIONS.get((state, cause))
    if allowed is None:
        where = "unknown session" if state is None else f"session {session!r} in state {state.name}"
        if state is None:
            where += f" {session!r}"
        raise PolicyError(f"illegal {cause} for {where}{_hint(state, cause)}")
    return allowed


def _hint(state: SessionState | None, cause: str) -> str:
    if state is SessionState.DONE:
        return " (the session has ended)"
    if cause == REQUEST and state is R:
        return " (a turn is already in flight)"
    if cause == REQUEST and state in (W, P):
        return " (its previous turn is still held by the policy)"
    if cause in (FINISH, ABORT):
        return " (no turn in flight)"
    if state is None:
        return " (a session starts with TurnRequested)"
    return ""
