"""A FIFO of session records with O(1) push, head and removal from anywhere.

Removal is lazy: a record carries the ticket of its queue entry, and removing it only clears the ticket; stale
entries are dropped when they reach the head, or all at once when they outnumber live ones (amortised O(1)).
Tickets come from one counter shared by all queues of a policy, so a stale entry can never look live again
after its record moves to another queue and back.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from itertools import count
from typing import Generic, Protocol, TypeVar


class Ticketed(Protocol):
    ticket: int


T = TypeVar("T", bound="Ticketed")


class Fifo(Generic[T]):
    __slots__ = ("_entries", "live", "_tickets")

    def __init__(self, tickets: count[int]) -> None:
        self._entries: deque[tuple[int, T]] = deque()
        self.live = 0
        """How many live records the queue holds (read it; only ``push`` and ``remove`` change it)."""
        self._tickets = tickets

    def __len__(self) -> int:
        return self.live

    def __bool__(self) -> bool:
        return self.live > 0

    def push(self, rec: T) -> None:
        ticket = next(self._tickets)
        rec.ticket = ticket
        self._entries.append((ticket, rec))
        self.live += 1

    def head(self) -> T | None:
        """The oldest live record, or None."""
        entries = self._entries
        while entries:
            ticket, rec = entries[0]
            if rec.ticket == ticket:
                return rec
            entries.popleft()
        return None

    def remove(self, rec: T) -> None:
        """Remove ``rec``, which must be in this queue."""
        rec.ticket = 0
        self.live -= 1
        if len(self._entries) > 2 * self.live + 64:
            self._compact()

    def __iter__(self) -> Iterator[T]:
        """Live records, oldest first (O(n); not for the per-event path)."""
        return (rec for ticket, rec in self._entries if rec.ticket == ticket)

    def _compact(self) -> None:
        self._entries = deque((t, r) for t, r in self._entries if r.ticket == t)
