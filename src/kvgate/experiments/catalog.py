"""The registry of kvgate's experiments: every row of the paper's Table 1, kvgate's own fleet experiments
(the paper studied one replica; their claims are kvgate's expectations, counted apart from the paper's), then the
analyses around the claims.

Each row lives in the module of the paper's section it reproduces (``sec3_*``, ``sec4_*``, ``sec6_*``; the
framework is in ``base``, what they share in ``common``).
Run lengths and seed counts follow the paper; ``quick`` keeps the claims with fewer seeds and, where a claim
allows, shorter runs (claims that need the paper's sample size or run length are left out of quick pages). No
constant is tuned per experiment: all runs use the calibrated engine profiles and the paper's control
defaults. Claims are declared once, with the paper's numbers and their rule (``claims``); an evaluation only
measures and hands each rule its observation. Seeds 9001 and above are reserved for ``kvgate calibrate``. Where
several seeds are run beyond the paper's count, it is to find seeds that collapse without control, against which
a policy's effect is judged.
"""

from __future__ import annotations

from kvgate.experiments.analyses import OFFLOAD_SWEEP, sensitivity
from kvgate.experiments.base import Experiment
from kvgate.experiments.fleet import FLEET_BURST, FLEET_FAILURE, FLEET_THRASH
from kvgate.experiments.fleet_control import FLEET_PREVENTION, FLEET_RECOVERY
from kvgate.experiments.fleet_tenants import FLEET_TENANTS
from kvgate.experiments.gateway_sizing import GATEWAY_SIZING
from kvgate.experiments.sec3_engines import SGLANG, TRACE_32B
from kvgate.experiments.sec3_paired import PAIRED_8B
from kvgate.experiments.sec3_triggers import FLUSH, NO_CACHE, TRIGGER_SIZE
from kvgate.experiments.sec4_drain import DRAIN
from kvgate.experiments.sec6_offload import CPU_OFFLOAD
from kvgate.experiments.sec6_prevention import MIX_SHIFT, PREVENTION
from kvgate.experiments.sec6_recovery import RECOVERY_8B, RECOVERY_32B, THRESHOLDS

PAPER_EXPERIMENTS: list[Experiment] = [
    PAIRED_8B,
    NO_CACHE,
    FLUSH,
    TRIGGER_SIZE,
    TRACE_32B,
    SGLANG,
    RECOVERY_8B,
    RECOVERY_32B,
    MIX_SHIFT,
    THRESHOLDS,
    PREVENTION,
    CPU_OFFLOAD,
    DRAIN,
]
"""The paper's Table 1, in its order."""

FLEET_EXPERIMENTS: list[Experiment] = [FLEET_BURST, FLEET_FAILURE, FLEET_THRASH, FLEET_PREVENTION, FLEET_RECOVERY,
                                       FLEET_TENANTS]
"""kvgate's own claims about a fleet, never counted among the paper's."""

ANALYSES: list[Experiment] = [OFFLOAD_SWEEP, sensitivity(PAPER_EXPERIMENTS), GATEWAY_SIZING]
"""Analyses around the claims (shown, never counted)."""

EXPERIMENTS: dict[str, Experiment] = {e.name: e for e in PAPER_EXPERIMENTS + FLEET_EXPERIMENTS + ANALYSES}
