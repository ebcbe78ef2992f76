"""Two tenants, one bursting: does the other keep what it had? (kvgate's own claim, not the paper's.)

The paper's paired burst (λ = 0.035, +1.5λ for 5 min at minute 15, one 400K-token replica, the budgeter) with the
arrivals split between two tenant classes A and B (half each, drawn per session from its own random stream), and
the burst's sessions all A's. Each seed runs four times: with and without the burst (the paired twin: the same base
sessions, the same tenants), under the budgeter with fair share (``--fair-share``) and without it (one FIFO for
everyone). Tenant B's turns from the burst's start to the end are compared with its own no-burst twin's under the
same policy: its hit ratio (cached over prompt tokens) and its mean wait per turn at the gateway (``park_wait_s``).

What "stays" means is stated once, here and in ``fleet_tenants.toml``: the hit ratio within 0.01 of the twin's and
the mean wait per turn within 2 s of it (half a healthy turn's time on the engine, R ≈ 4 s, docs/calibration.md).
"""

from __future__ import annotations

import numpy as np

from kvgate.experiments.base import Context, Experiment, Result, rng
from kvgate.experiments.common import B8, paired_plan
from kvgate.records import Run

SEEDS = list(range(501, 509))
BURST_MIN = 15.0
TENANTS = B8.with_(lam=0.035, bursts=("1.5@15+5",), tenants="A=0.5,B=0.5", burst_tenant="A", control="budgeter",
                   minutes=60)
ARMS = {"fair": True, "fifo": False}
"""Arm -> ``fair_share``."""
HIT_TOL = 0.01
WAIT_TOL_S = 2.0


def plan_tenants(quick: bool) -> list[tuple[str, object]]:
    out = []
    for arm, fair in ARMS.items():
        out += paired_plan(TENANTS.with_(fair_share=fair, label=arm), SEEDS, tag=f"{arm}/")
    return out  # type: ignore[return-value]


def tenant_turns(run: Run, tenant: str, t0: float) -> tuple[float, float, int]:
    """Hit ratio, mean wait per turn (s) and turns of ``tenant``'s finished turns submitted from ``t0``."""
    s, t = run.sessions, run.turns
    if "tenant" not in s:
        return float("nan"), float("nan"), 0
    mine = np.isin(t["session"], s["session"][s["tenant"] == tenant])
    ok = mine & (t["submit_s"] >= t0) & (t["status"] == "ok")
    if not ok.any():
        return float("nan"), float("nan"), 0
    cached = np.nan_to_num(t["cached_tokens"][ok].astype(float))
    return float(cached.sum() / t["prompt_tokens"][ok].sum()), float(t["park_wait_s"][ok].mean()), int(ok.sum())


def eval_tenants(ctx: Context) -> Result:
    t0 = BURST_MIN * 60.0
    lines = ["tenant B from minute 15 (hit ratio, mean wait per turn in s), burst arm against its no-burst twin",
             f"{'seed':<6}" + "".join(f"{arm + ': twin':>22}{'burst':>18}{'stays':>7}" for arm in ARMS)]
    stays: dict[str, list[bool]] = {arm: [] for arm in ARMS}
    deltas: dict[str, list[float]] = {arm: [] for arm in ARMS}
    for seed in SEEDS:
        row = f"{seed:<6}"
        for arm in ARMS:
            twin = ctx.runs.get(f"{arm}/seed-{seed}/twin")
            burst = ctx.runs.get(f"{arm}/seed-{seed}/trigger")
            if twin is None or burst is None:
                row += f"{'n/a':>22}{'n/a':>18}{'':>7}"
                continue
            (h0, w0, _), (h1, w1, _) = tenant_turns(twin, "B", t0), tenant_turns(burst, "B", t0)
            ok = bool(h1 >= h0 - HIT_TOL and w1 <= w0 + WAIT_TOL_S)
            stays[arm].append(ok)
            deltas[arm].append(w1 - w0)
            row += f"{h0:>14.3f} {w0:>6.2f}{h1:>11.3f} {w1:>6.2f}{'yes' if ok else 'NO':>7}"
        lines.append(row)
    n = len(SEEDS)
    fair, fifo = stays["fair"], stays["fifo"]
    ctx.judge("fleet_tenants.fair", (len(fair) == n and all(fair)) if fair else None,
              f"{sum(fair)} of {len(fair)} seeds; B's added wait per turn {rng(deltas['fair'])} s")
    ctx.judge("fleet_tenants.fifo", (not all(fifo)) if fifo else None,
              f"{len(fifo) - sum(fifo)} of {len(fifo)} seeds leave the bounds; B's added wait per turn "
              f"{rng(deltas['fifo'])} s")
    return Result(ctx.claims, [], ["\n".join(lines)])


FLEET_TENANTS = Experiment(
    "fleet-tenants",
    "Two tenants, one bursting: fair share keeps the other's cache and waits",
    "one 400K-token replica (paper-8b) at λ = 0.035, tenants A and B half each, +1.5λ for 5 min at minute 15 all "
    "A's, 60 min, seeds 501–508; the budgeter with fair share and without it, each with its no-burst twin; tenant "
    f"B's hit ratio within {HIT_TOL} and mean wait per turn within {WAIT_TOL_S:g} s of its twin's from minute 15",
    plan_tenants, eval_tenants, "fleet", group="fleet",
)
