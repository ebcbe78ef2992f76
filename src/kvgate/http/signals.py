"""Shared by the HTTP servers: run until the process is asked to stop."""

from __future__ import annotations

import asyncio
import signal
from collections.abc import Callable


async def until_signalled(ready: Callable[[], None] | None = None) -> None:
    """Return on SIGINT or SIGTERM; ``ready`` runs once the handlers are installed (so a signal sent by whoever
    it notifies is never missed); the handlers are removed again before returning."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    if ready is not None:
        ready()
    try:
        await stop.wait()
    finally:
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.remove_signal_handler(sig)
