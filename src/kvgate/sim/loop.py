"""The simulator's event loop, SimPy-shaped (``simpy/core.py``): events wait in heaps of ``(time, seq, handler,
payload)`` entries, ``seq`` a per-loop counter, so events at equal times keep their insertion order and a run is
deterministic; :meth:`EventLoop.step` handles the next event, :meth:`EventLoop.run` steps until a time.

An event is its handler (a bound method of the subclass, one per kind of event) and its payload: handling it is
``handler(payload, now)``. Three heaps, merged in ``(time, seq)`` order, because what an event may touch bounds
what an engine may run ahead of it (:mod:`kvgate.sim.fleet`):

* ``events``: what reaches every replica (samples, flushes, control switches and timers, failures, the end);
* ``routed``: what may send some replica work (arrivals, the ends of think times);
* ``steps``: the replicas' step ends.

A loop whose engines cannot leave a jump pending keeps all three in one heap (``split=False``).
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Callable
from typing import Any

Handler = Callable[[Any, float], None]
Entry = tuple[float, int, Handler, Any]


class EventLoop:
    """Three heaps of events, a counter, the time; subclasses add the handlers and :meth:`after` (what follows
    every event). ``stop()`` from a handler ends :meth:`run`."""

    def __init__(self, split: bool = True) -> None:
        self.events: list[Entry] = []
        self.routed: list[Entry] = self.events if not split else []
        self.steps: list[Entry] = self.events if not split else []
        self.split = split
        self.seq = 0
        self.now = 0.0
        self.running = True

    def push(self, t: float, handler: Handler, payload: Any = None) -> None:
        """An event that reaches every replica."""
        self.seq += 1
        heapq.heappush(self.events, (t, self.seq, handler, payload))

    def push_routed(self, t: float, handler: Handler, payload: Any) -> None:
        """An event that may send one replica work."""
        self.seq += 1
        heapq.heappush(self.routed, (t, self.seq, handler, payload))

    def horizon(self) -> float:
        """The time of the next event that reaches every replica: how far an engine may step ahead."""
        events = self.events
        return events[0][0] if events else math.inf

    def stop(self) -> None:
        self.running = False

    def after(self, now: float) -> None:
        """What follows every event handled (a subclass's timers and engines)."""

    def step(self, until: float = math.inf) -> bool:
        """Handle the next event if it comes by ``until``; False when there is none, or the loop stopped."""
        src: list[Entry] | None = self.events if self.events else None
        if self.split:
            routed, steps = self.routed, self.steps
            if routed and (src is None or routed[0] < src[0]):
                src = routed
            if steps and (src is None or steps[0] < src[0]):
                src = steps
        if src is None or src[0][0] > until:
            return False
        now, _, handler, payload = heapq.heappop(src)
        self.now = now
        handler(payload, now)
        if not self.running:
            return False
        self.after(now)
        return True

    def run(self, until: float = math.inf) -> None:
        """Handle events until none is left by ``until`` or a handler stops the loop."""
        while self.step(until):
            pass
