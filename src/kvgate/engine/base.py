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
from typing import Protocol

from kvgate.engine.blocks import SeqKey


class Request:
    __slots__ = (
        "rid", "seq", "prompt", "max_tokens", "num_tokens", "computed", "generated", "cached",
        "preemptions", "t_submit", "t_sched", "t_first", "t_end", "tag", "grow_at",
    )  # fmt: skip

    def __init__(self, rid: int, seq: SeqKey, prompt: int, max_tokens: int, now: float, tag: object) -> None:
        self.rid = rid
        self.seq = seq
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.num_tokens = prompt
        self.computed = 0
        self.generated = 0
        self.cached = (
            -1
        )  # prefix-cache hit at first scheduling (vLLM reports it, not a later re-admission), -1 until then
        self.preemptions = 0
        self.t_submit = now
        self.t_sched = -1.0
        self.t_first = -1.0
        self.t_end = -1.0
        self.tag = tag
        self.grow_at = 0  # allocations below this many tokens change nothing in the pool (see _grow_at)


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


class Engine(Protocol):
    """A prefix-cached engine in virtual time, driven by :meth:`add`, :meth:`abort` and :meth:`step`."""

    block_size: int
    kv_pool_tokens: int
    stats: EngineStats
    running: list[Request]
    waiting: Sequence[Request]

    def add(self, req: Request) -> None: ...

    def abort(self, req: Request) -> None: ...

    def has_work(self) -> bool: ...

    def usage(self) -> float: ...

    def flush(self, preempt: bool = True) -> bool: ...

    def step(self, now: float, horizon: float = math.inf) -> StepResult: ...
