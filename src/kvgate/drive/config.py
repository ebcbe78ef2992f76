"""The configuration of a driven run (``kvgate drive``) and its validation.

Time. All workload times (arrivals, think times, ``--minutes``, ``--flush-at``) are *virtual* seconds; the
driver runs them ``time_scale`` times faster than real time (1 against a real engine; e.g. 30 against
``kvgate engine --time-scale 30``). ``timeout_s`` and ``backoff_s`` are real seconds (the HTTP client's);
the agent's ``client_timeout_s`` and ``retry_backoff_s`` virtual ones (the simulator's).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from kvgate.errors import UsageError

if TYPE_CHECKING:
    from kvgate.workload.shapes import Workload


@dataclass(frozen=True)
class DriveConfig:
    """Everything that defines a driven run. Stored whole in ``run.json`` (the API key never is)."""

    endpoint: str
    model: str | None = None
    """None: the first model the endpoint lists."""
    api: str = "completions"
    """"completions" (token-id prompts) or "chat" (text messages)."""
    stream: bool = False
    preset: str = "paper-8b"
    trace: str | None = None
    """Trace-shape JSONL to replay instead of a preset; "bundled" for the packaged set."""
    max_context: int | None = None
    lam: float = 0.035
    minutes: float = 90.0
    seed: int = 501
    bursts: tuple[str, ...] = ()
    flush_at: float | None = None
    rate_at: tuple[str, ...] = ()
    time_scale: float = 1.0
    """Virtual seconds per real second."""
    session_header: str = "X-Session-ID"
    max_in_flight: int = 4096
    timeout_s: float = 3600.0
    """Real seconds one request attempt may take."""
    retries: int = 3
    backoff_s: float = 0.5
    """First retry backoff in real seconds (doubles per retry, at most 8 s)."""
    client_timeout_s: float | None = None
    """Agent-side timeout of one attempt of a turn (virtual seconds from sending it); None: wait for ever. As the
    simulator's: without a gateway the timed-out attempt is disconnected (the engine aborts it); through a gateway
    it stays open until its retry, which replaces it there (cancelled upstream, or its held place taken over)."""
    client_retries: int = 0
    """Attempts after the first before the agent gives up its session."""
    retry_backoff_s: float = 2.0
    """Virtual seconds before retry i (doubling per retry, times 1 ± ``retry_jitter`` drawn per attempt)."""
    retry_jitter: float = 0.5
    flush_retry_s: float = 1.0
    """Virtual seconds between /flush_cache attempts while SGLang answers 400 (the paper: every second)."""
    ignore_eos: bool = True
    """Send vLLM/SGLang's ``ignore_eos`` and ``min_tokens`` so every output has the shape's length."""
    append_role: str = "user"
    """Role of the appended (tool output) messages with --api chat: "user" or "tool"."""
    sample_s: float = 10.0
    label: str = ""

    def with_(self, **kw: Any) -> DriveConfig:
        return replace(self, **kw)

    @property
    def horizon_s(self) -> float:
        return self.minutes * 60.0

    def workload(self) -> Workload:
        if self.trace:
            from kvgate.workload.trace import PAPER_MAX_CONTEXT, trace_workload

            path = None if self.trace == "bundled" else self.trace
            return trace_workload(path, max_context=self.max_context or PAPER_MAX_CONTEXT)
        from kvgate.workload.shapes import preset

        return preset(self.preset)


def validate(cfg: DriveConfig) -> Workload:
    """Check a config before running; raises UsageError with a one-line message. Returns the workload."""
    check_fields(cfg)
    return cfg.workload()


def check_fields(cfg: DriveConfig) -> None:
    """Everything :func:`validate` checks except building the workload."""
    from kvgate.drive.client import normalize_endpoint
    from kvgate.workload.arrivals import parse_burst, parse_rate_at

    normalize_endpoint(cfg.endpoint)
    if cfg.api not in ("completions", "chat"):
        raise UsageError(f"--api {cfg.api!r}: choose completions or chat")
    if not cfg.lam >= 0:
        raise UsageError(f"negative arrival rate {cfg.lam}")
    if not cfg.minutes > 0:
        raise UsageError("--minutes must be positive")
    if not (cfg.time_scale > 0 and math.isfinite(cfg.time_scale)):
        raise UsageError("--time-scale must be a positive number")
    if cfg.max_in_flight < 1:
        raise UsageError("--max-in-flight must be at least 1")
    if not cfg.timeout_s > 0:
        raise UsageError("--timeout must be positive")
    if cfg.retries < 0:
        raise UsageError("--retries must be non-negative")
    if cfg.client_timeout_s is not None and not cfg.client_timeout_s > 0:
        raise UsageError("--client-timeout must be positive")
    if cfg.client_retries < 0 or cfg.retry_backoff_s < 0 or not 0 <= cfg.retry_jitter < 1:
        raise UsageError("--client-retries and --retry-backoff must be non-negative and --retry-jitter in [0, 1)")
    if cfg.flush_at is not None and cfg.flush_at < 0:
        raise UsageError("--flush-at must be non-negative")
    if not cfg.session_header.strip() or any(c in cfg.session_header for c in ": \r\n"):
        raise UsageError(f"--session-header {cfg.session_header!r} is not a header name")
    if cfg.append_role not in ("user", "tool"):
        raise UsageError(f"--append-role {cfg.append_role!r}: choose user or tool")
    for b in cfg.bursts:
        parse_burst(b)
    for r in cfg.rate_at:
        parse_rate_at(r)
