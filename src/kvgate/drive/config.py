"""The configuration of a driven run (``kvgate drive``) and its validation.

:class:`DriveConfig` is the workload's config (:class:`kvgate.workload.config.WorkloadConfig`: the sessions, the
arrivals, the trigger, the agents' timeouts and retries, as the simulator has them) plus how to reach and talk to
the endpoint. Stored whole and flat in ``run.json`` (the API key never is).

Time. All workload times (arrivals, think times, ``--minutes``, ``--flush-at``, the agent's ``client_timeout_s``
and ``retry_backoff_s``) are *virtual* seconds; the driver runs them ``time_scale`` times faster than real time
(1 against a real engine; e.g. 30 against ``kvgate engine --time-scale 30``). ``timeout_s`` and ``backoff_s`` are
the HTTP client's, in real seconds.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from kvgate.errors import UsageError
from kvgate.http.dialect import APIS
from kvgate.workload.config import WorkloadConfig

if TYPE_CHECKING:
    from kvgate.workload.shapes import Workload


@dataclass(frozen=True, kw_only=True)
class DriveConfig(WorkloadConfig):
    """Everything that defines a driven run: the workload's fields and the endpoint's.

    Through a gateway a timed-out attempt (``client_timeout_s``) stays open until its retry, which replaces it
    there (cancelled upstream, or its held place taken over); without one it is disconnected (the engine aborts it),
    as in the simulator."""

    endpoint: str
    model: str | None = None
    """None: the first model the endpoint lists."""
    api: str = "completions"
    """"completions" (token-id prompts), or a conversation: "chat", "responses" or "messages"."""
    session_id: str = "header"
    """"header": every turn names its session (``session_header``) and the last says so (``X-Session-End``);
    "none": nothing names it, as agents that leave it to the gateway's lineage."""
    tools: bool = False
    """Offer one tool; answer the model's calls with the appended text as their results."""
    system_nonce: bool = False
    """Open the system prompt with a per-request nonce (Claude Code's first system block)."""
    compact_every: int = 0
    """Rewrite the history to the task and a summary after every this many turns (0: never)."""
    stream: bool = False
    time_scale: float = 1.0
    """Virtual seconds per real second."""
    session_header: str = "X-Session-ID"
    session_end_header: str = "X-Session-End"
    """Header set to ``true`` on a session's last turn (Dynamo: ``x-dynamo-session-final``)."""
    session_field: str | None = None
    """Dotted body path that also carries the session id, e.g. ``vllm_xargs.agentic_context.program_id``."""
    token_ids: bool = True
    """Ask for vLLM's ``return_token_ids`` with --api completions (servers that refuse it: off)."""
    max_in_flight: int = 4096
    timeout_s: float = 3600.0
    """Real seconds one request attempt may take."""
    retries: int = 3
    backoff_s: float = 0.5
    """First retry backoff in real seconds (doubles per retry, at most 8 s)."""
    flush_retry_s: float = 1.0
    """Virtual seconds between /flush_cache attempts while SGLang answers 400 (the paper: every second)."""
    ignore_eos: bool = True
    """Send vLLM/SGLang's ``ignore_eos`` and ``min_tokens`` so every output has the shape's length."""
    append_role: str = "user"
    """Role of the appended (tool output) messages with --api chat: "user" or "tool"."""
    sample_s: float = 10.0
    label: str = ""


def validate(cfg: DriveConfig) -> Workload:
    """Check a config before running; raises UsageError with a one-line message. Returns the workload."""
    check_fields(cfg)
    return cfg.workload()


def check_fields(cfg: DriveConfig) -> None:
    """Everything :func:`validate` checks except building the workload."""
    from kvgate.drive.client import normalize_endpoint

    normalize_endpoint(cfg.endpoint)
    if cfg.api not in APIS:
        raise UsageError(f"--api {cfg.api!r}: choose completions, chat, responses or messages")
    if cfg.session_id not in ("header", "none"):
        raise UsageError(f"--session-id {cfg.session_id!r}: choose header or none")
    if cfg.compact_every < 0:
        raise UsageError("--compact-every must be non-negative")
    if not APIS[cfg.api].chat_like and (cfg.tools or cfg.system_nonce or cfg.compact_every):
        raise UsageError("--tools, --system-nonce and --compact-every shape a conversation: use --api chat, "
                         "responses or messages")
    cfg.check_workload()
    if not (cfg.time_scale > 0 and math.isfinite(cfg.time_scale)):
        raise UsageError("--time-scale must be a positive number")
    if cfg.max_in_flight < 1:
        raise UsageError("--max-in-flight must be at least 1")
    if not cfg.timeout_s > 0:
        raise UsageError("--timeout must be positive")
    if cfg.retries < 0:
        raise UsageError("--retries must be non-negative")
    if not cfg.session_header.strip() or any(c in cfg.session_header for c in ": \r\n"):
        raise UsageError(f"--session-header {cfg.session_header!r} is not a header name")
    if not cfg.session_end_header.strip() or any(c in cfg.session_end_header for c in ": \r\n"):
        raise UsageError(f"--session-end-header {cfg.session_end_header!r} is not a header name")
    if cfg.session_field is not None and not all(cfg.session_field.split(".")):
        raise UsageError(f"--session-field {cfg.session_field!r} is not a dotted body path")
    if cfg.append_role not in ("user", "tool"):
        raise UsageError(f"--append-role {cfg.append_role!r}: choose user or tool")
