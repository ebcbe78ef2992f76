"""The simulator's event loop: events in (time, seq) order across its three heaps, run(until) resumable, and a run
handled one step() at a time equal to run() (run is step in a loop with its lookups hoisted)."""

from __future__ import annotations

import heapq
from typing import Any

from kvgate.sim.config import SimConfig
from kvgate.sim.fleet import FleetSim
from kvgate.sim.fleet_records import result
from kvgate.sim.loop import EventLoop


class Log(EventLoop):
    def __init__(self, split: bool = True) -> None:
        super().__init__(split)
        self.seen: list[tuple[float, Any]] = []
        self.afters = 0

    def note(self, payload: Any, now: float) -> None:
        self.seen.append((now, payload))

    def halt(self, payload: Any, now: float) -> None:
        self.seen.append((now, payload))
        self.stop()

    def after(self, now: float) -> None:
        self.afters += 1


def test_events_come_in_time_then_insertion_order_across_the_heaps() -> None:
    for split in (True, False):
        loop = Log(split)
        loop.push(2.0, loop.note, "every-2")
        loop.push_routed(1.0, loop.note, "routed-1")
        loop.push(1.0, loop.note, "every-1")  # same time, pushed later: after routed-1
        loop.seq += 1
        heapq.heappush(loop.steps, (1.0, loop.seq, loop.note, "step-1"))
        loop.push_routed(0.5, loop.note, "routed-0.5")
        loop.run(1.5)
        assert loop.seen == [(0.5, "routed-0.5"), (1.0, "routed-1"), (1.0, "every-1"), (1.0, "step-1")]
        assert loop.now == 1.0 and loop.afters == 4 and loop.horizon() == 2.0
        loop.push(3.0, loop.halt, "stop")
        loop.push(4.0, loop.note, "never")
        loop.run()  # resumes where it stopped; the handler that stops it ends the run (no after())
        assert loop.seen[-2:] == [(2.0, "every-2"), (3.0, "stop")] and loop.afters == 5
        assert not loop.step()


def test_a_run_one_step_at_a_time_is_the_run() -> None:
    cfg = SimConfig(replicas=2, lam=0.09, minutes=12, router="least-loaded", control="budgeter",
                    bursts=("1.0@3+3",), fail_at=("1@8",), seed=5)
    whole = FleetSim(cfg)
    whole.run(cfg.horizon_s)
    stepped = FleetSim(cfg)
    steps = 0
    while stepped.step(cfg.horizon_s):
        steps += 1
    assert steps > 1000
    a, b = result(whole, 0.0), result(stepped, 0.0)
    for t in ("turns", "samples", "sessions"):
        assert a.tables[t].equals(b.tables[t]), t
    assert a.meta["engine_steps"] == b.meta["engine_steps"]
