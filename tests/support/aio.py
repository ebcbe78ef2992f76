"""Helpers shared by the asyncio tests."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any, ParamSpec, TypeVar

import pytest

P = ParamSpec("P")
T = TypeVar("T")

STOP_S = 30.0
"""How long a timed-out test may take to stop once cancelled (its cleanup: servers, sessions, processes)."""


def waits_at(coro: Coroutine[Any, Any, Any]) -> str:
    """Where a suspended coroutine waits: its chain of awaits, outermost first, one ``file:line in name`` each."""
    out = []
    cur: Any = coro
    while cur is not None:
        frame = getattr(cur, "cr_frame", None) or getattr(cur, "gi_frame", None)
        if frame is None:
            out.append(f"  on {cur!r:.200}")
            break
        out.append(f"  {frame.f_code.co_filename}:{frame.f_lineno} in {frame.f_code.co_name}")
        cur = getattr(cur, "cr_await", None) or getattr(cur, "gi_yieldfrom", None)
    return "\n".join(out)


def timed(seconds: float = 10.0) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Awaitable[T]]]:
    """An asyncio test with a hard timeout: a hang fails the test instead of stalling the suite.

    The test runs as a task of its own. Past ``seconds`` it is cancelled and fails with :class:`TimeoutError`;
    if it has not stopped :data:`STOP_S` seconds later (a cleanup that waits on something that never comes, a
    cancellation swallowed on the way), it fails anyway, naming where it waits."""

    def deco(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
        @functools.wraps(fn)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
            coro = fn(*args, **kwargs)
            task: asyncio.Task[T] = asyncio.ensure_future(coro)
            try:
                await asyncio.wait({task}, timeout=seconds)
            except asyncio.CancelledError:
                task.cancel()
                raise
            if task.done():
                return task.result()
            task.cancel()
            await asyncio.wait({task}, timeout=STOP_S)
            if not task.done():
                where = waits_at(coro)  # type: ignore[arg-type]
                raise TimeoutError(f"the test ran past {seconds:g} s and had not stopped {STOP_S:g} s after being "
                                   f"cancelled; it waits at:\n{where}")
            if not task.cancelled() and task.exception() is not None:
                raise TimeoutError(f"the test ran past {seconds:g} s") from task.exception()
            raise TimeoutError(f"the test ran past {seconds:g} s")

        return pytest.mark.asyncio(wrapper)  # type: ignore[no-any-return]

    return deco
