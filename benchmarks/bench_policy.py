"""Per-event cost of the policy core with 10 to 10,000 sessions in the system.

The core keeps D as a running sum and its queues as FIFOs with lazy removal, so the cost of an event should
not depend on how many sessions are in the system. This benchmark checks that. For each limit and population
N it

1. *records* a closed-loop workload: N paper-8b sessions (6K-token first prompt, +1,300 tokens a turn, 25
   turns) cycle through turns (request -> proceed -> finish); a session that ends is replaced by a new
   arrival, so N stay in the system; held sessions move only when the policy releases them. As in the paper's
   recovery runs, the system first runs without control (everyone admitted, D about 1.25 C), then the limit is
   switched on, scaled to N so that it binds (the budgeter's pool is 0.8 N mean demands, so it admits about
   0.6 N; the cap is K = 0.6 N, K_hi = 0.7 N). The timed events then see mass parking at boundaries,
   re-admissions as sessions end, and new sessions waiting behind parked ones;
2. *replays* the recorded events into a fresh policy (same events, same decisions: the core is deterministic)
   and times only ``Policy.handle`` over the events after the switch, best of ``--repeat`` replays taken
   round-robin over the populations, garbage collector paused, in CPU time of the process (so that other load
   on a shared machine distorts little).

Usage::

    python3 benchmarks/bench_policy.py                       # budgeter and cap at 10, 100, 1000, 10000
    python3 benchmarks/bench_policy.py --limits budgeter,cap,aimd,thunder --json bench-policy.json
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import random
import sys
import time
from collections import deque
from dataclasses import asdict, dataclass
from typing import Any

from kvgate.policy import (
    CONTROLS,
    Policy,
    Proceed,
    SessionEnded,
    Timer,
    TurnFinished,
    TurnRequested,
    make_control,
)
from kvgate.policy.events import Decision, Event

# The paper-8b session: 6K-token first prompt, +1,300 tokens a turn (300 output, 1,000 tool), 25 turns.
FIRST, GROWTH, OUTPUT, TURNS = 6_000, 1_300, 300, 25
MEAN_DEMAND = FIRST + GROWTH * (TURNS - 1) / 2 + OUTPUT  # about 21.9K tokens


def limit_for(name: str, n: int) -> tuple[int, dict[str, Any]]:
    """Capacity and options that make ``name`` bind with ``n`` sessions in the system."""
    capacity = int(n * MEAN_DEMAND * 0.8)  # the budgeter admits up to 0.75 C: about 0.6 n sessions
    k = max(1, round(0.6 * n))
    opts: dict[str, dict[str, Any]] = {
        "cap": {"K": k, "K_hi": k + max(1, round(0.1 * n))},
        "aimd": {"K0": k},
        "admission-cap": {"K": k},
    }
    return capacity, opts.get(name, {})


@dataclass
class Result:
    limit: str
    sessions: int
    in_system: int
    events: int
    ns_per_event: float
    events_per_s: float
    admitted: int
    parked: int
    waiting: int
    parks: int
    readmissions: int
    waits: int


def record(name: str, n: int, steady_events: int, seed: int) -> tuple[list[Event], float, list[Event], Policy]:
    """Drive a policy with the closed-loop workload.

    Returns the warm-up events (under ``none``), the time of the switch to ``name``, the timed events, and the
    policy that recorded them.
    """
    policy = Policy(make_control("none", kv_pool=1), now=0.0)
    rng = random.Random(seed)
    turn: dict[int, int] = {}
    todo: deque[tuple[str, int]] = deque()  # ("req", sid): next turn of a thinking session; ("fin", sid)
    events: list[Event] = []
    now = 0.0
    next_sid = 0

    def send(ev: Event) -> None:
        events.append(ev)
        release(policy.handle(ev))

    def release(decisions: list[Decision]) -> None:
        for d in decisions:
            if type(d) is Proceed:
                todo.append(("fin", d.session))  # type: ignore[arg-type]

    def arrive(first_turn: int = 0) -> None:
        nonlocal next_sid
        sid = next_sid
        next_sid += 1
        turn[sid] = first_turn
        send(TurnRequested(now, sid, FIRST + GROWTH * first_turn, OUTPUT))

    def run(until_events: int) -> None:
        nonlocal now
        while len(events) < until_events:
            now += 0.001
            while (deadline := policy.next_deadline()) is not None and deadline <= now:
                send(Timer(deadline))
            if not todo:  # everything held until a timer (thunder): jump to it
                deadline = policy.next_deadline()
                assert deadline is not None, "the workload stalled"
                now = max(now, deadline)
                send(Timer(now))
                continue
            kind, sid = todo.popleft()
            if kind == "req":
                send(TurnRequested(now, sid, FIRST + GROWTH * turn[sid], OUTPUT))
                continue
            k = turn[sid]
            send(TurnFinished(now, sid, 1.0 + rng.random(), FIRST + GROWTH * k, None, OUTPUT))
            if k + 1 < TURNS:
                turn[sid] = k + 1
                todo.append(("req", sid))
            else:
                del turn[sid]
                send(SessionEnded(now, sid))
                arrive()  # a new session takes its place: N stays in the system

    # warm-up without control: N sessions at random turns (so that they end, and new ones arrive, all the
    # time), each taking about one more turn
    for _ in range(n):
        arrive(rng.randrange(TURNS))
    run(3 * n)
    warm = len(events)
    switch_at = now
    capacity, opts = limit_for(name, n)
    release(policy.set_control(now, make_control(name, kv_pool=capacity, **opts)))
    run(warm + steady_events)
    return events[:warm], switch_at, events[warm:], policy


def replay(name: str, n: int, warm: list[Event], switch_at: float, steady: list[Event]) -> tuple[float, Policy, int]:
    """Replay and time the steady events (CPU time of this process, so other load on the machine matters
    little); return the seconds, the policy, and its park count at the switch."""
    policy = Policy(make_control("none", kv_pool=1), now=0.0)
    handle = policy.handle
    for ev in warm:
        handle(ev)
    capacity, opts = limit_for(name, n)
    policy.set_control(switch_at, make_control(name, kv_pool=capacity, **opts))
    parks0 = policy.parks
    gc.collect()
    gc.disable()
    try:
        t0 = time.process_time()
        for ev in steady:
            handle(ev)
        elapsed = time.process_time() - t0
    finally:
        gc.enable()
    return elapsed, policy, parks0


def bench(name: str, sizes: list[int], steady_events: int, repeat: int, seed: int) -> list[Result]:
    """Record each population, then replay them round-robin ``repeat`` times (so that a burst of load from
    elsewhere on the machine hits every population alike) and keep the best time of each."""
    recorded = {n: record(name, n, steady_events, seed) for n in sizes}
    best = dict.fromkeys(sizes, float("inf"))
    last: dict[int, tuple[Policy, int]] = {}
    for _ in range(repeat):
        for n in sizes:
            warm, switch_at, steady, _ = recorded[n]
            elapsed, policy, parks0 = replay(name, n, warm, switch_at, steady)
            best[n] = min(best[n], elapsed)
            last[n] = (policy, parks0)
    results = []
    for n in sizes:
        steady, rec_policy = recorded[n][2], recorded[n][3]
        policy, parks0 = last[n]
        assert policy.demand == rec_policy.demand and policy.counts() == rec_policy.counts(), "replay diverged"
        c = policy.counts()
        results.append(
            Result(
                limit=name,
                sessions=n,
                in_system=c["in_system"],
                events=len(steady),
                ns_per_event=best[n] / len(steady) * 1e9,
                events_per_s=len(steady) / best[n],
                admitted=c["admitted"],
                parked=c["parked"],
                waiting=c["waiting"],
                parks=policy.parks - parks0,
                readmissions=policy.readmissions,
                waits=policy.waits,
            )
        )
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--limits", default="budgeter,cap", help=f"comma-separated, from: {', '.join(CONTROLS)}")
    ap.add_argument("--sessions", default="10,100,1000,10000", help="populations in the system (comma-separated)")
    ap.add_argument("--events", type=int, default=200_000, help="timed events per run (after warm-up)")
    ap.add_argument("--repeat", type=int, default=3, help="replays per point; the best is reported")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    args = ap.parse_args(argv)
    limits = [x.strip() for x in args.limits.split(",") if x.strip()]
    unknown = [x for x in limits if x not in CONTROLS]
    if unknown:
        ap.error(f"unknown limit(s) {', '.join(unknown)}; choose from {', '.join(CONTROLS)}")
    sizes = [int(x) for x in args.sessions.split(",")]

    results: list[Result] = []
    header = (
        f"{'limit':<13} {'sessions':>8} {'events':>8} {'ns/event':>9} {'events/s':>10} "
        f"{'admitted':>8} {'parked':>7} {'waiting':>7} {'parks':>7} {'readmit':>7}"
    )
    print("admitted/parked/waiting: at the end; parks/readmit: after the switch to the limit")
    print(header)
    print("-" * len(header))
    for name in limits:
        for r in bench(name, sizes, args.events, args.repeat, args.seed):
            results.append(r)
            print(
                f"{r.control:<13} {r.sessions:>8} {r.events:>8} {r.ns_per_event:>9.0f} "
                f"{r.events_per_s:>10,.0f} {r.admitted:>8} {r.parked:>7} {r.waiting:>7} {r.parks:>7} "
                f"{r.readmissions:>7}",
                flush=True,
            )
        own = [r for r in results if r.control == name]
        ratio = max(r.ns_per_event for r in own) / min(r.ns_per_event for r in own)
        print(f"{'':<13} max/min ns per event over populations: {ratio:.2f}")
    if args.json:
        doc = {
            "benchmark": "policy per-event cost",
            "python": sys.version.split()[0],
            "platform": platform.platform(),
            "events_per_point": args.events,
            "repeat": args.repeat,
            "results": [asdict(r) for r in results],
        }
        with open(args.json, "w") as fh:
            json.dump(doc, fh, indent=2)
            fh.write("\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
