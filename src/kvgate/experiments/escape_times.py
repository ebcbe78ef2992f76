"""Running ``kvgate escape``: many untriggered simulated runs per λ; the estimators and the page are
:mod:`kvgate.analysis.escape`."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np

from kvgate.analysis.escape import (
    EscapeSpec,
    escape_figure,
    escape_page,
    escape_text,
    exponential_mean,
    kaplan_meier,
    poisson_estimate,
    round_min,
)


def plan(spec: EscapeSpec) -> list[tuple[str, float, Any]]:
    from kvgate.sim.config import SimConfig

    base = SimConfig(preset=spec.preset, profile=spec.profile, engine=spec.engine, kv_pool=spec.kv_pool,
                     minutes=spec.minutes, align_min=0.0)
    return [(f"lam={lam:g}/seed={spec.seed0 + i}", lam, base.with_(lam=lam, seed=spec.seed0 + i))
            for lam in spec.lams for i in range(spec.runs)]


def run_escape(spec: EscapeSpec, out: Path, *, progress: bool = True, jobs: int | None = None) -> dict[str, Any]:
    from kvgate.engine.costmodel import profile
    from kvgate.sim.batch import run_many
    from kvgate.workload.shapes import preset

    runs = plan(spec)
    out.mkdir(parents=True, exist_ok=True)
    metas = run_many([(cfg, str(out / "runs" / rid), False) for rid, _, cfg in runs], jobs=jobs, progress=progress,
                     label=f"escape ({len(runs)} runs)")
    end = spec.minutes
    wl = preset(spec.preset)
    c = spec.kv_pool or profile(spec.profile).kv_pool
    n_star = c / wl.mean_turn_context()
    rows = []
    curves = []
    for lam in spec.lams:
        times, events = [], []
        for (_, lam_r, _), meta in zip(runs, metas, strict=True):
            if lam_r != lam:
                continue
            s = meta["summary"]
            if s["persistently_degraded"] and s["degraded_from_min"] is not None:
                times.append(max(float(s["degraded_from_min"]), spec.warmup))
                events.append(True)
            else:
                times.append(end)
                events.append(False)
        mean, lo, hi, d, exposure = exponential_mean(times, events, spec.warmup)
        xs, ys = kaplan_meier(times, events)
        curves.append((lam, xs, ys))
        r0 = healthy_response(spec, lam)
        occ = float(np.mean([sum(ph.think_mean_s + r0 for _ in range(ph.shape.turns - 1)) + r0
                             for ph in wl.phases]))
        est = poisson_estimate(lam, occ, n_star) / 60.0
        km_median = float(xs[np.argmax(ys <= 0.5)]) if len(ys) and ys.min() <= 0.5 else None
        rows.append({"lam": lam, "runs": len(times), "collapsed": d, "exposure_min": round(exposure, 1),
                     "mean_escape_min": round_min(mean), "ci95_min": [round_min(lo), round_min(hi)],
                     "km_median_min": round_min(km_median), "poisson_estimate_min": round_min(est),
                     "R0_s": round(r0, 2)})
    fig = escape_figure(curves, spec, out / "escape.png")
    text = escape_text(rows, spec, n_star)
    (out / "index.md").write_text(escape_page(rows, spec, n_star, fig.name))
    return {"rows": rows, "N_star": round(n_star, 1), "text": text}


def healthy_response(spec: EscapeSpec, lam: float) -> float:
    """R0: mean turn response time of a short healthy run at ``lam`` (kvgate's own, not the paper's)."""
    from kvgate.records import from_tables
    from kvgate.sim.config import SimConfig
    from kvgate.sim.runner import simulate

    cfg = SimConfig(preset=spec.preset, profile=spec.profile, engine=spec.engine, kv_pool=spec.kv_pool,
                    lam=lam, minutes=30.0, seed=spec.seed0 - 1, control="budgeter")
    res = simulate(cfg)
    run = from_tables(res.meta, res.tables)
    ok = run.turns["status"] == "ok"
    lat = run.turns["end_s"][ok] - run.turns["sent_s"][ok]
    return float(np.mean(lat)) if len(lat) else math.nan
