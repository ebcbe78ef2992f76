"""What every simulated engine is: the request it serves, the result of a step, its counters, the Engine protocol.

Both engines (``kvgate.engine.vllm.VllmEngine``, ``kvgate.engine.sglang.SglangEngine``) implement
:class:`Engine`; drivers (the simulator, ``kvgate engine``) see only this module. An engine reads no clock: the
driver passes ``now`` and a ``horizon`` (its next event) to :meth:`Engine.step` and receives the step's duration
and what happened in it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Final, Literal, Protocol

from kvgate.engine.blocks import SeqKey

if TYPE_CHECKING:
    from kvgate.engine.costmodel import Profile


class Request:
    __slots__ = (
        "rid", "seq", "prompt", "max_tokens", "num_tokens", "computed", "generated", "cached",
        "preemptions", "t_submit", "t_sched", "t_first", "t_end", "tag", "grow_at",
    )

    def __init__(self, rid: int, seq: SeqKey, prompt: int, max_tokens: int, now: float, tag: object) -> None:
        self.rid = rid
        self.seq = seq
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.num_tokens = prompt
        self.computed = 0
        self.generated = 0
        # prefix-cache hit at first scheduling (vLLM reports it, not a later re-admission), -1 until then
        self.cached = -1
        self.preemptions = 0
        self.t_submit = now
        self.t_sched = -1.0
        self.t_first = -1.0
        self.t_end = -1.0
        self.tag = tag
        self.grow_at = 0  # allocations below this many tokens change nothing in the pool (see _grow_at)

    def sample(self, k: int, t_end: float, out: StepResult) -> bool:
        """The request's prompt is done and it samples ``k`` tokens by ``t_end``: count them, note its first
        token in ``out``; True when it has all its output (``t_end`` is then its end)."""
        self.num_tokens += k
        self.generated += k
        if self.t_first < 0:
            self.t_first = t_end
            out.first_token.append(self)
        if self.generated >= self.max_tokens:
            self.t_end = t_end
            return True
        return False


@dataclass(slots=True)
class StepResult:
    duration: float
    steps: int
    finished: list[Request] = field(default_factory=list)
    first_token: list[Request] = field(default_factory=list)
    prefill_tokens: int = 0
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    """The requests the step ran and the new tokens of each (per single step of a jump), in vLLM's order."""
    preempted: Sequence[Request] = ()
    """Requests preempted by recompute in this step, in order."""
    deferred: bool = False
    """A jump left pending by ``step(..., defer=True)``: its steps and duration are planned, its effect (and its
    finished requests) come with :meth:`Engine.settle`."""


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    busy_s: float = 0.0
    preemptions: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_tokens: int = 0
    queries: int = 0
    hits: int = 0


SessionStatus = Literal["admitted", "parked", "ended"]
"""A session's status as the driver reports it (the policy's transitions, see :meth:`Engine.session_status`)."""
SESSION_STATUSES: Final = ("admitted", "parked", "ended")


class Engine(Protocol):
    """A prefix-cached engine in virtual time, driven by :meth:`add`, :meth:`abort` and :meth:`step`."""

    @property
    def profile(self) -> Profile:
        """Its cost model's constants."""
        ...

    @property
    def block_size(self) -> int:
        """Tokens per KV block (SGLang's page: 1)."""
        ...

    @property
    def kv_pool(self) -> int:
        """The KV pool C in tokens."""
        ...

    @property
    def num_blocks(self) -> int:
        """Blocks requests can fill on the empty pool (``kv_pool // block_size``)."""
        ...

    @property
    def stats(self) -> EngineStats: ...

    @property
    def running(self) -> Sequence[Request]:
        """Requests in the running batch, in admission order."""
        ...

    @property
    def waiting(self) -> Sequence[Request]:
        """Requests waiting to be scheduled, in queue order."""
        ...

    @property
    def tracks_sessions(self) -> bool:
        """Whether :meth:`session_status` changes anything (an engine-side alternative uses it); a driver may
        skip its reports otherwise."""
        ...

    @property
    def hit_caps(self) -> dict[int, int] | None:
        """Per-session caps on the next prefix hit, in tokens, that the driver may set (``kvgate engine``'s
        content bridge); None when the engine's pool does not cap hits."""
        ...

    def add(self, req: Request) -> None:
        """Queue a request; ``ValueError`` if it cannot fit the model's context."""
        ...

    def abort(self, req: Request) -> None:
        """Drop a request wherever it is (a no-op for one the engine does not hold)."""
        ...

    def has_work(self) -> bool: ...

    def usage(self) -> float:
        """Fraction of the pool held by requests, as the engine reports it."""
        ...

    def queue_lengths(self) -> tuple[int, int]:
        """Requests holding KV (running, or mid-way through a chunked prefill), and requests waiting."""
        ...

    def session_status(self, session: int, status: SessionStatus) -> None:
        """The driver's report of a session's status; ``ValueError`` for an unknown status."""
        ...

    def flush(self, preempt: bool = True) -> bool:
        """Drop the prefix cache; False (nothing changed) where the engine refuses."""
        ...

    def step(self, now: float, horizon: float = math.inf, defer: bool = False) -> StepResult:
        """Run one step (or a jump of identical decode steps) at ``now``, not past ``horizon`` when it can
        be helped (the driver's next event). With ``defer`` an engine that can (:attr:`defers_jumps`) leaves a
        jump pending (``StepResult.deferred``): nothing changes until :meth:`settle`, which may still cut it short
        at an event the driver did not foresee (work sent to this engine mid-jump)."""
        ...

    @property
    def defers_jumps(self) -> bool:
        """Whether ``step(..., defer=True)`` may leave a jump pending."""
        ...

    def settle(self, until: float | None = None) -> StepResult:
        """Carry out the pending jump, cut to the step containing ``until`` (whole when None): what a jump whose
        horizon had been ``until`` does. Nothing else may be asked of the engine while a jump is pending."""
        ...


def check_fits(req: Request, max_model_len: int) -> None:
    """``ValueError`` if the request's prompt and output budget exceed the model's context."""
    if req.prompt + req.max_tokens > max_model_len:
        raise ValueError(f"request of {req.prompt}+{req.max_tokens} tokens exceeds max_model_len {max_model_len}")


def check_session_status(status: str) -> None:
    if status not in SESSION_STATUSES:
        raise ValueError(f"unknown session status {status!r}")


# -- the decode jump ---------------------------------------------------------------------------------------
# A step in which only decoding requests run and nothing can change is repeated ``n`` times in one jump. Each
# step's duration grows by ``grow_per_step`` (every context grows by one token a step, each read costs
# ``kv_read_s``), so the jump's duration is an arithmetic series.


def jump_steps(n_max: int, dt1: float, grow_per_step: float, span: float) -> int:
    """At most ``n_max`` steps, fewer if the driver's next event (``span`` seconds away) falls inside an
    earlier step: the jump then ends with the step that contains it."""
    if math.isfinite(span):
        a = grow_per_step / 2.0
        bb = dt1 - a
        n_time = math.ceil((-bb + math.sqrt(bb * bb + 4 * a * span)) / (2 * a)) if a > 0 else math.ceil(span / dt1)
        n_max = min(n_max, max(1, n_time))
    return n_max


def jump_duration(n: int, dt1: float, grow_per_step: float) -> float:
    """The duration of ``n`` decode steps, the first taking ``dt1``."""
    return n * dt1 + grow_per_step * n * (n - 1) / 2.0
