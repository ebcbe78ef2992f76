"""The driven run's counters, kept as turns come back (pure bookkeeping: no I/O, no clock)."""

from __future__ import annotations

import math
from collections import deque
from typing import Any

from kvgate.workload.trace import percentile

WINDOW_S = 60.0
"""The status line's window (virtual seconds) for the hit ratio and the turn rate."""


def rounded(x: float, nd: int) -> float | None:
    return None if math.isnan(x) else round(x, nd)


class Tally:
    """Turns done, failed and aborted, failed attempts by kind, and the last minute's turns and schedule lags (for
    the status line). The agents' timeouts and retries are the loop's (:class:`kvgate.workload.session.Sessions`)."""

    def __init__(self) -> None:
        self.turns_ok = 0
        self.turns_error = 0
        self.turns_aborted = 0
        self.attempts_failed = 0
        self.errors_by_kind: dict[str, int] = {}
        self.first_errors: list[str] = []
        self.recent: deque[tuple[float, int, int | None]] = deque()
        """``(end, prompt tokens, cached tokens)`` of the turns of the last :data:`WINDOW_S`."""
        self.lags_ms: deque[float] = deque(maxlen=2000)

    def turn_done(self, end: float, prompt_tokens: int, cached: int | None) -> None:
        self.turns_ok += 1
        self.recent.append((end, prompt_tokens, cached))
        while self.recent[0][0] < end - WINDOW_S:
            self.recent.popleft()

    def attempt_failed(self, kind: str, where: str, text: str) -> int:
        """Count one failed attempt; returns how many of its kind so far."""
        self.attempts_failed += 1
        n = self.errors_by_kind[kind] = self.errors_by_kind.get(kind, 0) + 1
        if len(self.first_errors) < 5:
            self.first_errors.append(f"{where}: {text}")
        return n

    def errors(self) -> dict[str, Any]:
        """The ``errors`` entry of ``run.json``."""
        return {
            "turns_failed": self.turns_error,
            "attempts_failed": self.attempts_failed,
            "by_kind": dict(self.errors_by_kind),
            "first": list(self.first_errors),
        }

    def status_text(self, now: float, horizon: float, in_system: int, running: int) -> str:
        """One line: progress, sessions, turns in flight, the last minute's hit ratio and rate, errors, lag p99."""
        while self.recent and self.recent[0][0] < now - WINDOW_S:
            self.recent.popleft()
        known = [(p, c) for _, p, c in self.recent if c is not None]
        p_sum = sum(p for p, _ in known)
        hit = f"{sum(c for _, c in known) / p_sum:.2f}" if p_sum else "-"
        rate = len(self.recent) / min(WINDOW_S, max(now, 1e-9))
        lag = percentile(list(self.lags_ms), 99)
        lag_s = f"{lag:.1f} ms" if not math.isnan(lag) else "-"
        errors = f"errors {self.turns_error}"
        if self.attempts_failed > self.turns_error:
            errors += f" (+{self.attempts_failed - self.turns_error} retried)"
        return (
            f"{min(now, horizon) / 60:.1f}/{horizon / 60:g} min | sessions {in_system} | "
            f"in flight {running} | hit 1m {hit} | {rate:.2f} turns/s | {errors} | lag p99 {lag_s}"
        )
