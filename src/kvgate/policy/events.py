"""Events a driver sends to the policy core, and the decisions it gets back.

Every event carries ``now`` in seconds, on whatever clock the driver owns (virtual time in the simulator,
``time.monotonic()`` in the HTTP gateway); the core never reads a clock. Times must not go backwards.
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass
from typing import TypeAlias

SessionId: TypeAlias = Hashable


@dataclass(slots=True)
class TurnRequested:
    """Session ``session`` reached a turn boundary and wants to send its next turn.

    The first one for a session the policy has not seen is the session's arrival. ``context_tokens`` is the
    prompt length of the turn (L_s) and ``output_tokens`` its output budget (o_s); the session's demand
    becomes d_s = L_s + o_s.
    """

    now: float
    session: SessionId
    context_tokens: int
    output_tokens: int
    tenant: Hashable = None
    """Who the session belongs to (a client key); read only by a policy with tenancy (``FairPolicy``)."""
    priority: int | None = None
    """The turn's priority band (higher is served first); None: its tenant's. Read only by ``FairPolicy``."""


@dataclass(slots=True)
class TurnFinished:
    """The session's in-flight turn completed. ``cached_tokens`` is None when the engine did not report it."""

    now: float
    session: SessionId
    latency_s: float
    prompt_tokens: int
    cached_tokens: int | None
    output_tokens: int


@dataclass(slots=True)
class TurnAborted:
    """The session's in-flight turn failed or was cancelled. Its demand is released (d_s = 0 until its next
    turn boundary); the session stays admitted and thinking."""

    now: float
    session: SessionId


@dataclass(slots=True)
class SessionEnded:
    """The session left, from any state. A held (parked or waiting) session leaving drops its pending turn."""

    now: float
    session: SessionId


@dataclass(slots=True)
class Timer:
    """The time asked for by ``next_deadline()`` has come (a spurious or early timer is harmless)."""

    now: float


Event: TypeAlias = TurnRequested | TurnFinished | TurnAborted | SessionEnded | Timer


@dataclass(slots=True)
class Proceed:
    """The session's pending turn may go to the engine now."""

    session: SessionId


@dataclass(slots=True)
class Park:
    """The session's pending turn is held: parked (it was admitted before) or waiting (a new session)."""

    session: SessionId


@dataclass(slots=True)
class OverQuota:
    """The turn is refused: its tenant's token budget for the current window would be exceeded. Nothing about
    the session changed (a new session was not recorded); ask again after ``retry_after_s`` seconds. Only a
    policy with tenant quotas (``FairPolicy``) decides it."""

    session: SessionId
    retry_after_s: float


Decision: TypeAlias = Proceed | Park | OverQuota
