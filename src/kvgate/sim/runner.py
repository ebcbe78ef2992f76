"""The in-process simulator: owns virtual time and drives the three cores (workload, policy, engine).

The event loop is SimPy-shaped: a heap of ``(time, seq, kind, payload)`` with a per-run counter, so events at
equal times keep their insertion order and a run is deterministic per seed. The engine is stepped whenever
it is idle and has work; each step (or jump of identical decode steps) is bounded by the next pending event,
so arrivals and think-time expiries are seen at the next step boundary, as in a real engine.

Session life cycle (closed loop, :mod:`kvgate.workload.session`: the same objects the HTTP driver drives)::

    arrive -> [gateway: proceed | park] -> engine -> turn done -> think -> [gateway] -> ... -> last turn -> end
"""

from __future__ import annotations

from kvgate.sim.config import SimConfig, SimResult


def simulate(cfg: SimConfig) -> SimResult:
    """Run one simulated experiment (one engine, or a fleet of them); returns its records (as Arrow tables) and
    metadata with the summary. The event loop is :func:`kvgate.sim.fleet.simulate_fleet`."""
    from kvgate.sim.fleet import simulate_fleet

    return simulate_fleet(cfg)
