"""Helpers shared by the asyncio tests."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import ParamSpec, TypeVar

import pytest

P = ParamSpec("P")
T = TypeVar("T")


def timed(seconds: float = 10.0) -> Callable[[Callable[P, Awaitable[T]]], Callable[P, Awaitable[T]]]:
    """An asyncio test with a hard timeout: a hang fails the test instead of stalling the suite."""

    def deco(fn: Callable[P, Awaitable[T]]) -> Callable[P, Awaitable[T]]:
        @functools.wraps(fn)
        async def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
            async with asyncio.timeout(seconds):
                return await fn(*args, **kwargs)

        return pytest.mark.asyncio(wrapper)  # type: ignore[no-any-return]

    return deco
