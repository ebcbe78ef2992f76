"""What the driver tells its user while it runs: log lines and warnings, and the status line on stderr (live with
rich on a terminal, a plain log line every 30 s otherwise)."""

from __future__ import annotations

import asyncio
import sys
from collections.abc import Callable
from typing import Any

import click

from kvgate.http.signals import cancel

STATUS_EVERY_S = 0.5
PLAIN_STATUS_EVERY_S = 30.0


class DriveLog:
    """Log lines (``kvgate: ...`` on stderr, through the status console when there is one) and warnings, each
    warning once per run."""

    def __init__(self, fn: Callable[[str], None] | None = None) -> None:
        self.fn = fn
        self.console: Any = None
        self.warnings: list[str] = []
        self._warned: set[str] = set()

    def __call__(self, msg: str) -> None:
        if self.fn is not None:
            self.fn(msg)
        elif self.console is not None:
            self.console.print(f"kvgate: {msg}", markup=False, highlight=False, soft_wrap=True)
        else:
            click.echo(f"kvgate: {msg}", err=True)

    def warn_once(self, key: str, msg: str) -> None:
        if key in self._warned:
            return
        self._warned.add(key)
        self.warnings.append(msg)
        self(f"warning: {msg}")


class StatusLine:
    """The status line: ``mode`` True live, False none, None live on a terminal and plain lines otherwise."""

    def __init__(self, mode: bool | None, log: DriveLog, text: Callable[[], str]) -> None:
        self.mode = mode
        self.log = log
        self.text = text
        self._live: Any = None
        self._task: asyncio.Task[None] | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self.mode is False:
            return
        live = self.mode is True or (self.mode is None and sys.stderr.isatty())
        from rich.console import Console

        self.log.console = Console(stderr=True)
        if live:
            from rich.live import Live

            self._live = Live("", console=self.log.console, auto_refresh=False, transient=False)
            self._live.start()
        self._task = loop.create_task(self._loop(STATUS_EVERY_S if live else PLAIN_STATUS_EVERY_S))

    async def _loop(self, every: float) -> None:
        if self._live is None:
            await asyncio.sleep(every)  # a plain log line at t=0 would say nothing
        while True:
            if self._live is not None:
                self._show()
            else:
                self.log(self.text())
            await asyncio.sleep(every)

    def _show(self) -> None:
        from rich.text import Text

        self._live.update(Text(self.text(), no_wrap=True, overflow="ellipsis"), refresh=True)

    async def stop(self) -> None:
        """Stop the updates; a live line shows its final state."""
        await cancel(self._task)
        self._task = None
        if self._live is not None:
            self._show()
            self._live.stop()
            self._live = None
