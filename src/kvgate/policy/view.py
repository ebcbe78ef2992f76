"""The seam between the actuator (``core``) and the controls: what a control may see, and what it may ask for.

A control decides over a read-only ``PolicyView`` (the demand D, the admitted count, snapshots of the admitted
and held sessions) and returns ``Action`` values; the core applies them through its transition table, so
``core`` stays the only place a session's state changes. Nothing here imports ``core`` or ``limits``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol, TypeAlias

from kvgate.policy.events import SessionId
from kvgate.policy.state import SessionState


@dataclass(frozen=True, slots=True)
class SessionView:
    """A snapshot of one session as the policy keeps it."""

    session: SessionId
    state: SessionState
    demand: int
    """d_s as of the session's last turn boundary."""
    output: int = 0
    """o_s, the output budget in d_s."""


class PolicyView(Protocol):
    """What a control may read of the policy. ``demand`` and ``n_admitted`` are O(1); the snapshots are O(n)
    and meant for timers (thunder's, once per interval), never for the per-event questions."""

    @property
    def demand(self) -> int:
        """D: the sum of d_s over admitted sessions."""
        ...

    @property
    def n_admitted(self) -> int:
        """Sessions admitted (running or thinking)."""
        ...

    def admitted_sessions(self) -> list[SessionView]:
        """The admitted sessions, in admission order."""
        ...

    def held_sessions(self) -> list[SessionView]:
        """The sessions in the parked queue (parked or suspended), oldest first."""
        ...

    @property
    def residency(self) -> Callable[[SessionId], int | None] | None:
        """A session's measured resident tokens on its engine (KV events; None: unknown), when a driver feeds them."""
        ...


@dataclass(frozen=True, slots=True)
class SessionAction:
    """An action on one session (the base of ``Suspend`` and ``Resume``)."""

    session: SessionId


class Suspend(SessionAction):
    """Pause a thinking session: it leaves the admitted set and joins the parked queue (SUSPENDED)."""

    __slots__ = ()


class Resume(SessionAction):
    """Admit a held (parked or suspended) session again; a parked one's pending turn proceeds."""

    __slots__ = ()


Action: TypeAlias = Suspend | Resume
"""What a control's timer may ask the core to do, applied in order."""
