"""The gateway's sizing on paper: how many sessions and replicas one ``kvgate gateway`` process can front,
from its measured turns per second on one core and the paper's per-replica load. An analysis, not a reproduced
claim: nothing is simulated and nothing is judged; every input is cited and the arithmetic is on the page.

Inputs (measured elsewhere, copied here with where they come from):

* the gateway on one core against an instant upstream (``benchmarks/bench_gateway.py``; ``docs/benchmarks.md``,
  section "Gateway", and ``docs/gateway.md``, section "Benchmark"): plain JSON 9,000–12,000 requests/s at
  concurrency 16–256, 0.08–0.12 ms of CPU per request; streamed (SSE) 6,948 requests/s at concurrency 64 and
  7,589 at 256, 0.145 and 0.134 ms of CPU per request. One agent turn is one request through the gateway;
* the paper's per-replica load: λ = 0.035 sessions/s on a 400K-token replica (§3, Table 2), each session
  the paper-8b shape (the workload preset: its turns, think time and contexts, read from
  :mod:`kvgate.workload.shapes`);
* a turn's time on the engine in the healthy regime, for Little's law: kvgate's calibrated R ≈ 4 s and the
  paper's ≈ 6 s (``docs/calibration.md``; the paired experiment's healthy-side rows).
"""

from __future__ import annotations

import math

from kvgate.experiments.base import Context, Experiment, Result
from kvgate.experiments.verdicts import baseline
from kvgate.sim.config import SimConfig
from kvgate.workload.shapes import preset

LAM = 0.035
"""Sessions/s per 400K-token replica: the paper's healthy load (§3, Table 2)."""
PRESET = "paper-8b"
BENCH = (
    ("streamed, c=64", 6_948, 0.145, "docs/gateway.md, Benchmark, second run (--concurrency 64,256 --rounds 8)"),
    ("streamed, c=256", 7_589, 0.134, "same run"),
    ("plain, c=64", 10_575, 0.096, "same run"),
    ("plain, c=16–256 (range)", 9_000, 0.12, "docs/benchmarks.md, Gateway: 9,000–12,000 req/s, 0.08–0.12 ms CPU"),
)
"""(mode, requests/s on one core, CPU ms per request, source); the plain range row takes the low ends."""
TURN_S = (("kvgate's calibrated engine", 4.0), ("the paper's", 6.0))
"""Seconds per turn on the engine, healthy regime (docs/calibration.md: R ≈ 4 s in kvgate, ≈ 6 s in the paper)."""
HEADROOM = 2.5
"""Load the gateway must absorb above the steady rate: the paper's burst adds 1.5λ, so arrivals run at 2.5λ for
its five minutes (and parked sessions re-admitted after it keep the rate near that). Sizing for 2.5× the steady
turn rate is the page's one assumption."""


def plan_sizing(quick: bool) -> list[tuple[str, SimConfig]]:
    return []


def _n(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:,.1f}" if x >= 10 else f"{x:,.3g}"


def eval_sizing(ctx: Context) -> Result:
    shape = preset(PRESET).shapes()[0]
    turns = shape.turns
    think = preset(PRESET).phases[0].think_mean_s
    per_rep = LAM * turns
    prompts = shape.prompt_tokens()
    mean_prompt = sum(prompts) / len(prompts)
    lines = [
        "Per replica (the paper's load):",
        f"  λ = {LAM} sessions/s per 400K-token replica; {PRESET}: T = {turns} turns per session, think "
        f"{think:.0f} s mean,",
        f"  prompts {prompts[0]:,}–{prompts[-1]:,} tokens (mean {mean_prompt:,.0f})",
        f"  turns/s per replica = λ × T = {LAM} × {turns} = {per_rep:.3f}",
    ]
    for who, r in TURN_S:
        dur = turns * (r + think)
        lines.append(f"  sessions in the system per replica (Little: λ × T × (R + think)), R = {r:.0f} s ({who}): "
                     f"{LAM} × {turns} × ({r:.0f} + {think:.0f}) = {LAM * dur:.1f}")
    lines += ["", f"One gateway process, one core, sized for {HEADROOM}× the steady turn rate (the paper's burst, "
              "+1.5λ):"]
    head = (f"  {'measured mode':<26} {'turns/s':>8} {'CPU ms':>7} {'turns/s by CPU':>15} {'replicas':>9} "
            f"{'new sessions/s':>15} {'sessions in system':>19}")
    lines.append(head)
    rows = []
    for mode, rps, cpu, _src in BENCH:
        by_cpu = 1000.0 / cpu
        cap = min(rps, by_cpu)
        reps = math.floor(cap / HEADROOM / per_rep)
        ins = [LAM * turns * (r + think) * reps for _, r in TURN_S]
        rows.append((mode, reps))
        lines.append(f"  {mode:<26} {rps:>8,} {cpu:>7.3f} {by_cpu:>15,.0f} {reps:>9,} {LAM * reps:>15,.0f} "
                     f"{_n(ins[0]):>8}–{_n(ins[1]):<10}")
    lines += ["", "  replicas = ⌊min(turns/s, 1000 / CPU ms) / " + f"{HEADROOM} / {per_rep:.3f}⌋; new sessions/s = "
              f"λ × replicas; sessions in the system = replicas × the per-replica figures above"]
    worst = min(r for _, r in rows)
    added = [(who, 0.2e-3 / r) for who, r in TURN_S]
    lines += ["", "Added latency: the gateway's 0.15–0.2 ms per turn (docs/benchmarks.md, concurrency 1) against "
              + ", ".join(f"{r:.0f} s per turn ({who}): {x:.4%}" for (who, r), (_, x) in zip(TURN_S, added,
                                                                                           strict=True))]
    ctx.claims += [
        baseline("turns/s per replica at the paper's load (λ × T)", f"{LAM} × {turns} = {per_rep:.3f}"),
        baseline(
            "replicas one gateway core can front at 2.5× the steady rate (the least of the measured modes)",
            f"{worst:,} ({LAM * worst:,.0f} new sessions/s)",
            "streamed turns, the costlier mode, set it; an upper bound, see the limits below",
        ),
    ]
    limits = [
        "What this does not include (not measured, so not assumed):",
        "- request size: the benchmark sends a one-line chat message; an agent turn carries its whole context "
        f"({prompts[0]:,}–{prompts[-1]:,} tokens of text, tens to hundreds of KB). The gateway reads the body whole "
        "and relays it; the cost per byte is not in the benchmark, so the figures above are upper bounds for "
        "turns with long prompts;",
        "- the fleet's own cost: measured apart, 8 upstreams against 1 on the same benchmark (docs/benchmarks.md, "
        "Gateway over a fleet): 0.94–1.05 of the requests per second and 0.99–1.04 of the CPU per request (medians "
        "per cell; geometric means 0.987 and 1.015), so the figures above hold for a fleet; the KV-events consumer "
        "is not in them;",
        "- memory: the soak test saw 58–61 MB RSS with the sessions of one replica at λ = 0.04 (docs/gateway.md, "
        "Soak); per-session memory at tens of thousands of sessions is not measured;",
        "- the engines: at the paper's load one replica does < 1 turn/s, so the gateway's core is never the first "
        "limit of a fleet of realistic size; the replicas' KV pools are (the rest of these pages).",
    ]
    return Result(ctx.claims, [], ["\n".join(lines), "\n".join(limits)])


GATEWAY_SIZING = Experiment(
    "gateway-sizing", "The gateway's sizing on paper",
    "turns/s per core from the gateway benchmark (docs/benchmarks.md, docs/gateway.md) → how many replicas and "
    f"sessions one gateway process fronts at the paper's load (λ = {LAM} sessions/s per 400K-token replica, "
    f"{PRESET} sessions); arithmetic only, nothing simulated or judged",
    plan_sizing, eval_sizing, "fleet, analysis", group="analysis",
)
