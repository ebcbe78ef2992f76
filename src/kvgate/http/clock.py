"""The one scaled clock of the HTTP programs: virtual seconds on the event loop's clock."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any


class Clock:
    """Virtual seconds on the event loop's clock: ``virtual = (loop.time() - t0) * scale``.

    Every deadline is absolute (``t0 + virtual / scale``) and goes to the loop's timer heap via ``call_at``: the
    heap is the one scheduler of arrivals, think-time expiries, samples, the flush and the horizon.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop, scale: float) -> None:
        self.loop = loop
        self.scale = scale
        self.t0 = loop.time()

    def now(self) -> float:
        return (self.loop.time() - self.t0) * self.scale

    def virtual(self, loop_time: float) -> float:
        return (loop_time - self.t0) * self.scale

    def deadline(self, v: float) -> float:
        return self.t0 + v / self.scale

    def call_at(self, v: float, cb: Callable[..., object], *args: Any) -> asyncio.TimerHandle:
        return self.loop.call_at(self.deadline(v), cb, *args)

    async def sleep_until(self, v: float) -> None:
        fut: asyncio.Future[None] = self.loop.create_future()
        h = self.loop.call_at(self.deadline(v), _wake, fut)
        try:
            await fut
        finally:
            h.cancel()


def _wake(fut: asyncio.Future[None]) -> None:
    if not fut.done():
        fut.set_result(None)
