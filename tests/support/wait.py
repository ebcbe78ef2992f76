"""Bounded waits for tests: poll a condition until it holds. The bound is a hang guard, not a measurement (the
suite does not time things), so it is generous."""

from __future__ import annotations

import asyncio
import inspect
import time
from collections.abc import Callable
from typing import Any


def until(cond: Callable[[], bool], what: str, timeout: float = 30.0, interval: float = 0.05) -> None:
    """Wait until ``cond()`` holds; ``AssertionError`` naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(interval)


async def until_async(cond: Callable[[], Any], what: str, timeout: float = 10.0, interval: float = 0.02) -> None:
    """:func:`until` on the event loop; ``cond`` may be a plain function or a coroutine function."""
    deadline = time.monotonic() + timeout
    while True:
        held = cond()
        if inspect.isawaitable(held):
            held = await held
        if held:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(interval)
