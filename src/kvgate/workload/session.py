"""The closed loop of agent sessions, written once for every driver (no I/O, no clock).

A session arrives and asks for turn 0; after each finished turn it thinks for its think time and asks for the
next, until its last turn ends it. While it is in the system it adds its *demand* (the current turn's prompt plus
its output budget) to the run's total; leaving removes it. An agent-side timeout abandons an attempt of a turn:
the agent retries after a backoff or, out of retries, gives up its session (it leaves unfinished).

The simulator's event heap and the HTTP driver's asyncio tasks drive the same objects. Each method of
:class:`Sessions` says what happens next and the driver makes it happen at its own times (it passes ``now`` in
where a record needs it; nothing here reads a clock)::

    arrive(s) -> request(s): the Turn to send -> finish(s, now): think seconds -> request(s) -> ...
                                                                 '- None: that was the last turn; s has left
              timed_out(s): backoff seconds -> retry(s): the Turn to send again
                            '- None: out of retries, the agent gave up; s has left (abandoned)

A driver keeps its own per-session state (the simulator's engine request, the HTTP driver's prompt text and task)
in a subclass of :class:`Session`.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from kvgate.records import SessionRow
from kvgate.workload.arrivals import SessionSpec
from kvgate.workload.config import AgentRetries
from kvgate.workload.shapes import SessionShape


class Turn(NamedTuple):
    """A turn to send: its index, prompt and output lengths in tokens, and whether it is the session's last.
    (A named tuple: one is built per turn in the simulator's hot loop.)"""

    index: int
    prompt_tokens: int
    output_tokens: int
    last: bool
    attempt: int = 0
    """0 for the first attempt; i for retry i."""

    @property
    def demand(self) -> int:
        return self.prompt_tokens + self.output_tokens


@dataclass(eq=False)
class Session:
    """One agent session's place in the loop. Drivers read it; only :class:`Sessions` changes it."""

    spec: SessionSpec
    prompts: list[int]
    """Prompt length of every turn (``spec.shape.prompt_tokens()``)."""
    turn: int = 0
    """The current turn (the number of turns done)."""
    demand: int = 0
    """What the session adds to the run's demand: its current turn's prompt plus output (0 once it left)."""
    attempt: int = 0
    """Attempt of the current turn (0: the first)."""
    first_sent: float = math.nan
    """When its first turn was sent (NaN: not yet)."""
    end: float = math.nan
    """When its last turn ended (NaN: unfinished)."""
    left: bool = False
    abandoned: bool = False
    """The agent gave up its session (out of retries after timeouts)."""

    @property
    def sid(self) -> int:
        return self.spec.sid

    def current(self) -> Turn:
        """The current turn, at its current attempt."""
        k = self.turn
        outputs = self.spec.shape.outputs
        return Turn(k, self.prompts[k], outputs[k], k == len(outputs) - 1, self.attempt)

    def is_attempt(self, turn: int, attempt: int) -> bool:
        """Whether ``attempt`` of ``turn`` is still the session's live attempt (a timer for it is not stale)."""
        return not self.left and self.turn == turn and self.attempt == attempt

    def mark_sent(self, now: float) -> None:
        """The driver sent a turn at ``now`` (only the first one counts: ``first_sent``)."""
        if math.isnan(self.first_sent):
            self.first_sent = now

    def row(self) -> SessionRow:
        sp = self.spec
        return SessionRow(
            sp.sid, sp.cohort, sp.arrival_s, None if math.isnan(self.end) else self.end, sp.shape.turns, self.turn,
            None if math.isnan(self.first_sent) else self.first_sent, sp.shape.source, sp.tenant,
        )


class Sessions(Mapping[int, Session]):
    """Every session of a run by id, the closed loop's transitions, and its totals: sessions in the system, their
    demand, the agents' timeouts, retries and abandoned sessions."""

    def __init__(self, retries: AgentRetries | None = None) -> None:
        self.retries = retries if retries is not None else AgentRetries()
        self._by_sid: dict[int, Session] = {}
        self._prompts: dict[int, tuple[SessionShape, list[int]]] = {}
        self.in_system = 0
        self.demand = 0
        """Sum of the demand of the sessions in the system (the samples' ``demand_tokens``)."""
        self.timeouts = 0
        self.retries_sent = 0
        self.abandoned = 0

    # -- the mapping ------------------------------------------------------------------------------------------
    def __getitem__(self, sid: int) -> Session:
        return self._by_sid[sid]

    def __iter__(self) -> Iterator[int]:
        return iter(self._by_sid)

    def __len__(self) -> int:
        return len(self._by_sid)

    def prompts_of(self, shape: SessionShape) -> list[int]:
        """``shape.prompt_tokens()``, computed once per shape (presets and trace pools share shapes)."""
        hit = self._prompts.get(id(shape))
        if hit is None:
            hit = self._prompts[id(shape)] = (shape, shape.prompt_tokens())
        return hit[1]

    def new(self, spec: SessionSpec) -> Session:
        """A :class:`Session` for ``spec`` (drivers with their own state build their subclass the same way)."""
        return Session(spec, self.prompts_of(spec.shape))

    # -- the loop ---------------------------------------------------------------------------------------------
    def arrive(self, s: Session) -> Session:
        """``s`` enters the system (then :meth:`request` its first turn)."""
        self._by_sid[s.spec.sid] = s
        self.in_system += 1
        return s

    def request(self, s: Session) -> Turn:
        """``s`` reaches its current turn (arrived, or done thinking): its demand becomes that turn's; the first
        attempt. Returns the turn to send."""
        s.attempt = 0
        turn = s.current()
        demand = turn.prompt_tokens + turn.output_tokens
        self.demand += demand - s.demand
        s.demand = demand
        return turn

    def finish(self, s: Session, now: float) -> float | None:
        """``s``'s current turn ended well at ``now``. Returns the think time (seconds) before its next turn, or
        None when that was its last turn: the session ended at ``now`` and has left."""
        s.turn += 1
        if s.turn < len(s.spec.shape.outputs):
            return s.spec.think_s[s.turn - 1]
        s.end = now
        self.leave(s)
        return None

    def timed_out(self, s: Session) -> float | None:
        """The agent's current attempt timed out (the driver abandons it). Returns the backoff (seconds) before the
        retry, or None when the agent is out of retries: it gave up its session, which has left."""
        self.timeouts += 1
        if s.attempt >= self.retries.retries:
            s.abandoned = True
            self.abandoned += 1
            self.leave(s)
            return None
        s.attempt += 1
        return self.retries.backoff(s.spec.sid, s.turn, s.attempt)

    def retry(self, s: Session) -> Turn:
        """The backoff is over: the agent sends its current turn again. Returns it (at its new attempt)."""
        self.retries_sent += 1
        return s.current()

    def leave(self, s: Session) -> None:
        """``s`` leaves the system (finished, gave up, or failed): its demand goes with it."""
        if s.left:
            return
        s.left = True
        self.in_system -= 1
        self.demand -= s.demand
        s.demand = 0

    def rows(self) -> list[SessionRow]:
        """The ``sessions`` table's rows, by session id."""
        return [self._by_sid[sid].row() for sid in sorted(self._by_sid)]
