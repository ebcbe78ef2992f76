"""A session's turn slot: who holds the session's turn, who waits for it, and the future a held turn waits on.

The one part of a session record with asyncio in it (beside :mod:`kvgate.gateway.turns`, which awaits what it
holds). The slot's methods are its only writers; the session layer (:mod:`kvgate.gateway.sessions`) calls them at
the turn's events and the request path at its own.
"""

from __future__ import annotations

import asyncio
from collections import deque
from typing import Any


class TurnSlot:
    """The turn of one session (owner: this module; the turns of a session are serialised through it)."""

    __slots__ = (
        "busy", "queue", "future", "end_after", "dropped", "attempt", "attempt_key", "superseded", "reattach",
    )

    def __init__(self) -> None:
        self.busy = False
        """A request of this session holds the session's turn (held by the policy or in flight)."""
        self.queue: deque[asyncio.Future[None]] | None = None
        """Further requests of the session waiting for the current one (turns of a session are serialised)."""
        self.future: asyncio.Future[None] | None = None
        """Resolved when the policy lets the held turn proceed."""
        self.end_after = False
        """End the session when the current turn completes (DELETE while busy)."""
        self.dropped = False
        """The session ended and this record is no longer in the gateway's table."""
        self.attempt: asyncio.Task[Any] | None = None
        """The handler of the request holding the session's turn (a retry of the same turn cancels it)."""
        self.attempt_key: int | None = None
        """Hash of that request's body: a request of the session with the same body is a retry of it."""
        self.superseded = False
        """The holding attempt was replaced by a retry of its turn (its handler is being cancelled)."""
        self.reattach = False
        """The replaced attempt was held by the policy: its retry takes over its place (no new TurnRequested)."""

    # -- holding the turn ----------------------------------------------------------------------------------
    def take(self) -> None:
        """The caller now holds the turn."""
        self.busy = True

    def wait(self, fut: asyncio.Future[None]) -> None:
        """``fut`` waits for the turn (resolved when it is handed on: :meth:`hand_on`)."""
        if self.queue is None:
            self.queue = deque()
        self.queue.append(fut)

    def unwait(self, fut: asyncio.Future[None]) -> None:
        """``fut`` stopped waiting (cancelled before the turn came to it)."""
        if self.queue is not None and fut in self.queue:
            self.queue.remove(fut)

    def hand_on(self) -> bool:
        """Release the turn: hand it to the next waiter still waiting (True), else the turn is free (False)."""
        q = self.queue
        while q:
            fut = q.popleft()
            if not fut.done():
                fut.set_result(None)
                return True
        self.busy = False
        return False

    def drop(self) -> None:
        """The session ended: the record leaves the gateway's table."""
        self.dropped = True

    def end_when_done(self) -> None:
        """End the session when the current turn completes (DELETE while busy)."""
        self.end_after = True

    # -- the attempt holding it ----------------------------------------------------------------------------
    def begin(self, task: asyncio.Task[Any] | None, key: int) -> None:
        """The request handled by ``task``, its body's hash ``key``, holds the turn."""
        self.attempt, self.attempt_key, self.superseded = task, key, False

    def over(self) -> None:
        """The attempt holding the turn is done."""
        self.attempt = self.attempt_key = None

    def supersede(self, key: int) -> bool:
        """A request with body hash ``key`` arrived: if it retries the attempt holding the turn (same body), that
        attempt is cancelled (its upstream request with it). True if so."""
        if self.attempt is None or self.attempt_key != key or self.superseded:
            return False
        self.superseded = True
        self.attempt.cancel()
        return True

    def keep_place(self, keep: bool) -> None:
        """Whether the retry of a replaced, held attempt takes over its place in the policy."""
        self.reattach = keep

    # -- a turn the policy holds ---------------------------------------------------------------------------
    def hold(self, fut: asyncio.Future[None] | None) -> None:
        """The held turn waits on ``fut`` (None: it waits no more)."""
        self.future = fut

    def wake(self) -> None:
        """The policy lets the held turn proceed."""
        fut = self.future
        if fut is not None and not fut.done():
            fut.set_result(None)

    def fail(self, error: BaseException) -> None:
        """The held turn cannot proceed: it is answered ``error``."""
        fut = self.future
        if fut is not None and not fut.done():
            fut.set_exception(error)

    def held(self) -> asyncio.Future[None] | None:
        """The future of the turn held now, None if none is."""
        fut = self.future
        return fut if fut is not None and not fut.done() else None
