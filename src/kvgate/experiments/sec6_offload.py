"""§6: a CPU KV offload tier under the paired and the recovery designs."""

from __future__ import annotations

import math
from typing import Any

from kvgate.experiments.base import Context, Experiment, Result, rng
from kvgate.experiments.common import B8, HOST_TOKENS, PAIRED, degraded, pair_counts, paired_plan, seeds_of
from kvgate.sim.config import SimConfig


# -- CPU offload (§6) -----------------------------------------------------------------------------------------------
def _off_seeds(quick: bool) -> tuple[list[int], list[int]]:
    return ([501, 502, 503], [1, 2]) if quick else (list(range(501, 507)), [1, 2, 3])


def offload_paired_plan(quick: bool, bandwidth_gbs: float | None = None, tag: str = "p/") -> list[tuple[str, Any]]:
    cfg = PAIRED.with_(minutes=90, cpu_offload_tokens=HOST_TOKENS)
    if bandwidth_gbs is not None:
        cfg = cfg.with_(offload_bandwidth_gbs=bandwidth_gbs)
    return paired_plan(cfg, _off_seeds(quick)[0], tag)


def plan_offload(quick: bool) -> list[tuple[str, SimConfig]]:
    p, rs = _off_seeds(quick)
    out = offload_paired_plan(quick)
    out += [(f"base/seed-{s}/trigger", PAIRED.with_(seed=s, minutes=90, align_min=20.0)) for s in p]
    r = B8.with_(lam=0.04, minutes=60 if quick else 90, bursts=("1.0@10+4",), cpu_offload_tokens=HOST_TOKENS)
    for s in rs:
        out.append((f"rec/none/seed-{s}", r.with_(seed=s)))
        out.append((f"rec/budgeter/seed-{s}", r.with_(seed=s, control="budgeter", control_at=20.0)))
    return out


def _demand_at(r: Any, t_min: float) -> float:
    """Resident demand relative to the GPU pool over the minute before ``t_min``."""
    from kvgate.analysis import metrics as m

    t0, t1 = (t_min - 1) * 60.0, t_min * 60.0
    return m.sample_mean(r.samples, "demand_tokens", t0, t1) / m.sample_mean(r.samples, "kv_pool", t0, t1)


def eval_offload(ctx: Context) -> Result:
    seeds = seeds_of(ctx, "p/")
    n = len(seeds)
    c = pair_counts(ctx, seeds, "p/")
    bd = c["only_trigger"] + c["both"]
    td = c["only_twin"] + c["both"]
    bw = ctx.runs[f"p/seed-{seeds[0]}/trigger"].config["offload_bandwidth_gbs"]
    ctx.judge("off.burst", (bd, n), f"{bd} of {n} (host tier at {bw:g} GB/s)")
    ctx.judge("off.twins", c, f"{c['only_trigger']} only burst, {c['only_twin']} only twin, {c['both']} both, "
              f"{c['neither']} neither ({td} of {n} twins degraded)")
    deg = [ctx.runs[f"p/seed-{s}/trigger"] for s in seeds if degraded(ctx.runs[f"p/seed-{s}/trigger"].summary)]
    h = [r.summary["hit_ratio_last10"] for r in deg]
    ctx.judge("off.hit", h, rng(h) if h else "no burst arm degraded")
    ss = [r.summary["sessions_in_system_last5"] for r in deg]
    ctx.judge("off.sessions", ss, rng(ss, "{:.0f}") if ss else "no burst arm degraded")
    out_ = [_demand_at(r, r.summary["degraded_from_min"]) for r in deg]
    pool = float(deg[0].samples["kv_pool"][-1]) if deg else math.nan
    tier = (HOST_TOKENS + pool) / pool
    ctx.judge("off.outgrows", (min(out_) > tier) if out_ else None,
              f"resident demand {rng(out_)} × the pool when the collapse set in, vs pool + host tier = {tier:.2f}×"
              if out_ else "no burst arm degraded")
    on = [r.summary["degraded_from_min"] for r in deg]
    ctx.judge("off.onset", on, f"from minute {rng(on, '{:.0f}')}" if on else "no collapse")
    base = [ctx.runs[f"base/seed-{s}/trigger"] for s in seeds]
    ob = [r.summary["degraded_from_min"] for r in base if degraded(r.summary)]
    ctx.judge("off.onset_base", ob, f"from minute {rng(ob, '{:.0f}')}" if ob else "no collapse")
    rs = seeds_of(ctx, "rec/none/")
    rn = {s: degraded(ctx.runs[f"rec/none/seed-{s}"].summary) for s in rs}
    rb = {s: degraded(ctx.runs[f"rec/budgeter/seed-{s}"].summary) for s in rs}
    k = sum(rn.values())
    ctx.judge("off.rec_none", (k, len(rs)), f"{k} of {len(rs)}")
    col = [s for s in rs if rn[s]]
    kb = sum(rb[s] for s in col)
    ctx.judge("off.rec_budgeter", (kb, len(col)), f"{kb} of the {len(col)} seeds that collapse without it")
    return Result(ctx.claims)


CPU_OFFLOAD_SETUP = "a 0.9M-token host tier at the default (published) bandwidth; paired design and recovery design"
CPU_OFFLOAD = Experiment("cpu-offload", "CPU KV offload", CPU_OFFLOAD_SETUP, plan_offload, eval_offload, "§6")
