"""What defines a simulated run (:class:`SimConfig`, stored flat in ``run.json``), its checks, and its result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, ClassVar

from kvgate.engine.costmodel import profile as get_profile
from kvgate.engine.factory import EngineConfig
from kvgate.errors import UsageError
from kvgate.fleet.config import FleetConfig, check_fleet
from kvgate.policy.config import ControlConfig
from kvgate.workload.config import WorkloadConfig
from kvgate.workload.shapes import Workload

GROUP_ID = 0


@dataclass(frozen=True)
class SimConfig(WorkloadConfig, EngineConfig, ControlConfig, FleetConfig):
    """Everything that defines a simulated run: the workload, the engine, the control and the fleet, plus the
    simulator's own fields. Stored whole (flat) in ``run.json``; :meth:`from_dict` loads it back."""

    feeds_residency: ClassVar[bool] = True
    """The simulator feeds ``budgeter-resident`` each session's resident prefix, read from its replica's pool."""
    align_min: float | None = None
    """Start of the 5-minute windows of the persistent-degradation test; default: end of the trigger."""
    abandoned: str = "disconnect"
    """Without a gateway, what a timed-out attempt does on the engine: "disconnect" (the client closes the
    connection and the engine aborts it, as the OpenAI client does). "keep" (it runs on beside the retry) needs two
    requests of one session in the pool at once, which the simulated pool does not model yet."""
    sample_s: float = 10.0
    label: str = ""


@dataclass
class SimResult:
    config: SimConfig
    meta: dict[str, Any]
    tables: dict[str, Any] = field(default_factory=dict)


def validate(cfg: SimConfig) -> Workload:
    """Check a config before running; raises UsageError with a one-line message. Returns the workload."""
    cfg.check_workload()
    prof = get_profile(cfg.profile)
    wl = cfg.workload()
    pool = cfg.kv_pool or prof.kv_pool
    need = wl.max_context()
    if pool < need:
        raise UsageError(f"KV pool of {pool} tokens is smaller than one session's context ({need} tokens)")
    if need > prof.max_model_len:
        raise UsageError(f"sessions reach {need} tokens, over the engine's max_model_len {prof.max_model_len}")
    cfg.check_engine()
    if cfg.abandoned != "disconnect":
        raise UsageError(f"--abandoned {cfg.abandoned!r}: the simulator models only disconnect (an abandoned attempt "
                         "running on beside its retry needs two requests of one session in the simulated pool)")
    cfg.check_control(pool)
    if cfg.tenant_quotas:
        raise UsageError("--tenant-quota: the simulator does not model refused turns (quotas are the gateway's)")
    if cfg.engine != "vllm" and cfg.make_control(pool).needs_residency:
        raise UsageError(f"--control {cfg.control} reads residency from the simulated vLLM pool (--engine vllm)")
    check_fleet(cfg, need)
    return wl
