"""The workload's config: what arrives when, and how the agents behave (one config, composed by every program).

``WorkloadConfig`` is a frozen dataclass; each program composes it with the other concerns' configs by
inheritance (``SimConfig(WorkloadConfig, EngineConfig, ControlConfig)``, ``DriveConfig(WorkloadConfig, ...)``), so
every field stays flat: sweeps name fields as grid axes, experiments read ``cfg.lam``, ``run.json`` stores the
config as one flat object. :meth:`WorkloadConfig.from_dict` is the one loader of a config from ``run.json``
(for any of the composed classes: ``SimConfig.from_dict(run.config)``).
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Self

import numpy as np

from kvgate.errors import UsageError
from kvgate.workload.arrivals import Burst, RateChange, SessionSpec, generate, parse_burst, parse_rate_at
from kvgate.workload.shapes import Workload, preset
from kvgate.workload.triggers import parse_trigger

RETRY_STREAM = 4
"""Random stream of the agents' retry backoffs (the arrivals use the others; see :mod:`kvgate.workload.arrivals`)."""


@dataclass(frozen=True)
class AgentRetries:
    """The agent-side timeout and retry schedule of one run (the same in the simulator and over HTTP)."""

    timeout_s: float | None = None
    """Timeout of one attempt of a turn (virtual seconds from sending it); None: wait for ever."""
    retries: int = 0
    """Attempts after the first before the agent gives up its session."""
    backoff_s: float = 2.0
    """Wait before retry i: ``backoff_s * 2**(i-1) * (1 + jitter * u)``, u uniform in [-1, 1) drawn per attempt."""
    jitter: float = 0.5
    seed: int = 0

    def backoff(self, sid: int, turn: int, attempt: int) -> float:
        """Seconds before ``attempt`` (1 for the first retry) of turn ``turn`` of session ``sid``.

        The draw is keyed by (seed, stream, session, turn, attempt), so it does not depend on the order of events.
        """
        u = float(np.random.default_rng([self.seed, RETRY_STREAM, sid, turn, attempt]).uniform(-1.0, 1.0))
        return self.backoff_s * 2 ** (attempt - 1) * (1.0 + self.jitter * u)


@dataclass(frozen=True)
class WorkloadConfig:
    """What the workload needs: the session shapes, the arrival process, the trigger, the agents' retries."""

    preset: str = "paper-8b"
    trace: str | None = None
    """Trace-shape JSONL (kvgate format) to replay instead of a preset; "bundled" for the packaged set, "paper" for it
    drawn with the paper's trace statistics (``workload/paper_trace.py``)."""
    max_context: int | None = None
    """Truncate trace sessions at this context (None: the paper's 38,000)."""
    lam: float = 0.035
    minutes: float = 90.0
    seed: int = 501
    bursts: tuple[str, ...] = ()
    flush_at: float | None = None
    """Minute the prefix cache is flushed (the other trigger)."""
    rate_at: tuple[str, ...] = ()
    triggers: tuple[str, ...] = ()
    """Triggers of the kinds without a field of their own, ``KIND:SPEC`` each (:mod:`kvgate.workload.triggers`)."""
    client_timeout_s: float | None = None
    """Agent-side timeout of one attempt of a turn (virtual seconds from sending it); None: wait for ever."""
    client_retries: int = 0
    """Attempts after the first before the agent gives up its session."""
    retry_backoff_s: float = 2.0
    """Wait before retry i (doubling per retry, times 1 ± ``retry_jitter`` drawn per attempt)."""
    retry_jitter: float = 0.5
    tenants: str = ""
    """Tenant classes and their fractions of the arrivals, ``A=0.5,B=0.5`` ("": one tenant)."""
    burst_tenant: str | None = None
    """The tenant every burst's session belongs to (None: drawn like the base stream's)."""

    def with_(self, **kw: Any) -> Self:
        return replace(self, **kw)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Self:
        """The config stored flat in ``run.json`` (``run.config``): keys of other programs' configs are ignored,
        JSON lists become tuples, fields an older run did not store take their defaults."""
        names = {f.name for f in dataclasses.fields(cls) if f.init}
        kw = {k: (tuple(v) if isinstance(v, list) else v) for k, v in d.items() if k in names}
        return cls(**kw)

    # -- derived, validated pieces -------------------------------------------------------------------
    @property
    def horizon_s(self) -> float:
        return self.minutes * 60.0

    def parsed_bursts(self) -> list[Burst]:
        return [parse_burst(b) for b in self.bursts]

    def parsed_rates(self) -> list[RateChange]:
        return [parse_rate_at(r) for r in self.rate_at]

    def workload(self) -> Workload:
        if self.trace == "paper":
            from kvgate.workload.paper_trace import paper_trace_workload
            from kvgate.workload.trace import PAPER_MAX_CONTEXT

            return paper_trace_workload(self.max_context or PAPER_MAX_CONTEXT)
        if self.trace:
            from kvgate.workload.trace import PAPER_MAX_CONTEXT, trace_workload

            path = None if self.trace == "bundled" else self.trace
            return trace_workload(path, max_context=self.max_context or PAPER_MAX_CONTEXT)
        return preset(self.preset)

    def session_specs(self, workload: Workload | None = None) -> list[SessionSpec]:
        """Every session of the run (arrival, shape, think times): the same for the same config in every
        program. ``workload``: :meth:`workload` already built."""
        wl = workload if workload is not None else self.workload()
        return generate(wl, self.lam, self.horizon_s, self.seed, self.parsed_bursts(), self.parsed_rates(),
                        self.parsed_tenants(), self.burst_tenant)

    def parsed_tenants(self) -> list[tuple[str, float]]:
        """``tenants`` as (name, fraction) pairs; raises UsageError."""
        out: list[tuple[str, float]] = []
        for part in filter(None, (p.strip() for p in self.tenants.split(","))):
            name, sep, frac = part.partition("=")
            try:
                f = float(frac) if sep else math.nan
            except ValueError:
                f = math.nan
            if not name.strip() or not (f > 0 and math.isfinite(f)):
                raise UsageError(f"--tenants {self.tenants!r}: expected NAME=FRACTION,... with positive fractions")
            out.append((name.strip(), f))
        if len({n for n, _ in out}) != len(out):
            raise UsageError(f"--tenants {self.tenants!r}: a tenant is named twice")
        if self.burst_tenant is not None and self.burst_tenant not in {n for n, _ in out}:
            raise UsageError(f"--burst-tenant {self.burst_tenant!r} is not one of --tenants")
        return out

    def agent_retries(self) -> AgentRetries:
        return AgentRetries(self.client_timeout_s, self.client_retries, self.retry_backoff_s, self.retry_jitter,
                            self.seed)

    def check_workload(self) -> None:
        """Check the workload's fields (not the shapes: :meth:`workload` reads them); raises UsageError."""
        if not self.lam >= 0:
            raise UsageError(f"negative arrival rate {self.lam}")
        if not self.minutes > 0:
            raise UsageError("--minutes must be positive")
        if self.flush_at is not None and self.flush_at < 0:
            raise UsageError("--flush-at must be non-negative")
        if self.client_timeout_s is not None and not self.client_timeout_s > 0:
            raise UsageError("--client-timeout must be positive")
        if self.client_retries < 0 or self.retry_backoff_s < 0 or not 0 <= self.retry_jitter < 1:
            raise UsageError("--client-retries and --retry-backoff must be non-negative and --retry-jitter in [0, 1)")
        self.parsed_bursts()
        self.parsed_rates()
        self.parsed_tenants()
        for text in self.triggers:
            parse_trigger(text)
