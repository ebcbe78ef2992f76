"""The comparison's designs and its plan of runs: which stack, how many replicas, which arm, which seed.

Designs (virtual minutes; the workload is paper-8b, λ per replica):

* ``burst`` (prevention): λ = 0.035 per replica, +1.5λ for 5 minutes from minute 15, 90 minutes; every stack's
  burst arm, and the no-burst twin of every uncontrolled baseline (the burst, not the stack, is the cause).
* ``recovery``: λ = 0.04, +1.0λ (2x) for 4 minutes from minute 10, the control switched on at minute 20, 60
  minutes: kvgate's gateway (``--control-at 20``), vllm-router (started without program scheduling, restarted
  with it at minute 20 on the same port: it keeps no state the engine needs, and it has no runtime switch) and the
  uncontrolled engine. Dynamo's ThunderAgent is a start-up option of the frontend too, but a frontend restart
  takes ~10 s of real time (minutes of virtual time at x30) and drops its KV index: not run, the page says so.
* ``failure``: 4 replicas at 3.2λ = 0.112, replica 0 killed at minute 20 (its in-flight turns fail, its cache is
  gone, its sessions go elsewhere), 90 minutes: vllm-router's policies against kvgate's per-replica budgets; beside
  every uncontrolled stack, its twin with no replica killed (the failure, not the placement, is the cause).
* ``real-burst``: the real vLLM (CPU build, tiny Llama) in real time, the scaled-down sessions and burst of
  ``kvgate experiment real-vllm`` (λ 0.12, +2.5λ for 2 minutes from minute 1, 5 minutes, seeds 1-3): the engine
  alone and vllm-router's program scheduling in front of it.

``QUICK`` is a subset for one command of at most ~30 minutes on 2 cores: one seed, 60-minute runs, the stacks
that show each competitor acting beside kvgate and the baseline. A run is one directory; a directory whose
``compare.json`` exists is done and is not run again, so the full plan resumes where it stopped.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.compare.stacks import STACKS


@dataclass(frozen=True)
class Design:
    name: str
    title: str
    lam_per_replica: float
    burst: str
    minutes: float
    control_at: float | None = None
    fail_at: float | None = None
    """Minute replica 0 is killed."""
    real: bool = False
    """On the real vLLM in real time: the scaled-down agent sessions of ``kvgate experiment real-vllm``."""
    seeds: tuple[int, ...] = ()
    """This design's own seeds (else the plan's)."""


DESIGNS = {d.name: d for d in (
    Design("burst", "paired burst (prevention)", 0.035, "1.5@15+5", 90.0),
    Design("recovery", "control on after the collapse (recovery)", 0.04, "1.0@10+4", 60.0, control_at=20.0),
    Design("failure", "a replica fails", 0.028, "", 90.0, fail_at=20.0),
    Design("real-burst", "paired burst on the real vLLM (CPU build), scaled down", 0.12, "2.5@1+2", 5.0, real=True,
           seeds=(1, 2, 3)),
)}


@dataclass(frozen=True)
class Run:
    design: str
    stack: str
    replicas: int
    arm: str
    """"burst", "twin" (no trigger: no burst, or no replica killed) or "fail"."""
    seed: int
    minutes: float

    @property
    def key(self) -> str:
        return f"{self.design}/{self.stack}-r{self.replicas}-{self.arm}-s{self.seed}"

    @property
    def lam(self) -> float:
        return round(DESIGNS[self.design].lam_per_replica * self.replicas, 6)


@dataclass(frozen=True)
class Plan:
    name: str
    seeds: tuple[int, ...]
    minutes: float | None
    """None: each design's own length."""
    rows: tuple[tuple[str, int, tuple[str, ...]], ...]
    """(design, replicas, stacks)."""
    time_scale: float = 30.0
    twins: bool = True
    fleet_time_scale: float = 15.0
    """Four engines, a router and a gateway on 2 cores: half the scale, so none falls behind its clock."""
    notes: tuple[str, ...] = field(default=())

    def runs(self) -> list[Run]:
        out: list[Run] = []
        for design, reps, stacks in self.rows:
            d = DESIGNS[design]
            minutes = self.minutes if self.minutes is not None and not d.real else d.minutes
            for seed in d.seeds or self.seeds:
                for s in stacks:
                    arm = "fail" if d.fail_at is not None else "burst"
                    out.append(Run(design, s, reps, arm, seed, minutes))
                    paired = (d.burst and d.control_at is None) or d.fail_at is not None
                    if self.twins and paired and not STACKS[s].acts:
                        out.append(Run(design, s, reps, "twin", seed, minutes))
        return out

    def scale(self, r: Run) -> float:
        if DESIGNS[r.design].real:
            return 1.0
        return self.time_scale if r.replicas == 1 else self.fleet_time_scale


ONE = ("direct", "vr-ps", "kvgate", "kvgate+vr")
FLEET = ("vr-cache", "vr-hash", "vr-ps", "kvgate", "kvgate+vr")
DYNAMO = ("dyn", "dyn-ta", "kvgate+dyn")
RECOVERY = ("direct", "vr-ps", "kvgate")

FULL = Plan(
    "full", seeds=tuple(range(501, 509)), minutes=None,
    rows=(("burst", 1, ONE), ("burst", 1, DYNAMO), ("burst", 4, FLEET), ("recovery", 1, RECOVERY),
          ("failure", 4, FLEET), ("real-burst", 1, ("real", "real-vr-ps"))),
)
QUICK = Plan(
    "quick", seeds=(501,), minutes=60.0, twins=False,
    rows=(("burst", 1, ("direct", "vr-ps", "kvgate")), ("burst", 1, DYNAMO), ("recovery", 1, RECOVERY),
          ("failure", 4, ("vr-ps", "kvgate"))),
    notes=("quick: one seed, 60-minute runs, no twins; the failure row: program scheduling and kvgate",),
)
SMOKE = Plan(
    "smoke", seeds=(501,), minutes=12.0, twins=False,
    rows=(("burst", 1, ("vr-ps",)), ("burst", 1, ("dyn-ta",))),
    notes=("smoke: each competitor's one arm, 12 minutes: the harness runs (CI), no claim",),
)
ENVOY_STACKS = ("envoy", "envoy+kvgate", "kvgate")
ENVOY = Plan(
    "envoy", seeds=tuple(range(501, 509)), minutes=None,
    rows=(("burst", 1, ENVOY_STACKS), ("burst", 4, ENVOY_STACKS), ("recovery", 1, ENVOY_STACKS),
          ("recovery", 4, ENVOY_STACKS)),
    notes=("envoy: Envoy 1.40 alone (round robin) and Envoy calling kvgate epp, beside kvgate gateway",
           "every run here was made with the engine profile before the fitted mixed step (a constant mixed-step "
           "factor of 11; docs/calibration.md)"),
)
ENVOY_SMOKE = Plan(
    "envoy-smoke", seeds=(501,), minutes=12.0, twins=False,
    rows=(("burst", 1, ("envoy", "envoy+kvgate")),),
    notes=("envoy-smoke: each Envoy stack once, 12 minutes: the harness runs, no claim",),
)
PLANS = {p.name: p for p in (FULL, QUICK, SMOKE, ENVOY, ENVOY_SMOKE)}
