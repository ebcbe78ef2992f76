"""What the paper's experiments share: base configurations, run selectors and the paired and arm designs."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from kvgate.analysis import metrics as m
from kvgate.experiments.base import Context, rng
from kvgate.records import Run
from kvgate.sim.config import SimConfig

B8 = SimConfig(preset="paper-8b")
TRACE32 = SimConfig(trace="paper", profile="qwen3-32b-mi300x", max_context=38_000)
"""The 32B world: the bundled sessions drawn with the paper's trace statistics (``workload/paper_trace.py``)."""
RECOVERY_ARMS = ["none", "admission-cap", "aimd", "cap", "budgeter"]
HOST_TOKENS = 900_000
"""The paper's 128 GiB host tier at 144 KiB per token."""


def degraded(s: dict[str, Any]) -> bool:
    """A run's summary says it ended persistently degraded."""
    return bool(s["persistently_degraded"])


def fig_path(ctx: Context, name: str) -> Any:
    """Where an evaluation draws figure ``name``."""
    return ctx.fig_dir / name


def figure_link(paths: list[Any]) -> str:
    """The page's link to a drawn figure."""
    return f"figures/{paths[0].name}"


def run_end(run: Run) -> float:
    return float(run.config["minutes"]) * 60.0


def onset_min(run: Run, from_min: float = 5.0) -> float | None:
    """Start (minutes) of the persistently degraded stretch with windows aligned at ``from_min`` (no trigger)."""
    ok, since = m.persistent_degradation(run.turns, run.samples, from_min * 60.0, run_end(run))
    return since / 60.0 if ok and since is not None else None


def stayed_healthy(run: Run, from_min: float = 5.0) -> bool:
    """No 5-minute window (from ``from_min``) with a hit ratio below 0.5."""
    hs = [h for _, h in m.window_hits(run.turns, from_min * 60.0, run_end(run))]
    return all(math.isnan(h) or h >= m.DEGRADED_HIT for h in hs)


def sample_at(run: Run, col: str, t_min: float, width_min: float = 1.0) -> float:
    return m.sample_mean(run.samples, col, (t_min - width_min) * 60.0, t_min * 60.0)


def unfinished(s: dict[str, Any]) -> int:
    return int(s["sessions_arrived"] - s["sessions_finished"])


def mean_of(v: Sequence[float]) -> float:
    x = [a for a in v if a is not None and not math.isnan(a)]
    return float(np.mean(x)) if x else math.nan


def session_prompts(run: Run) -> dict[int, list[int]]:
    """Every session's prompt lengths by session id, regenerated from the run's config (the workload is
    deterministic per seed): what :func:`kvgate.analysis.drain.remaining_cold_work` needs."""
    from kvgate.workload.config import WorkloadConfig

    return {s.sid: s.shape.prompt_tokens() for s in WorkloadConfig.from_dict(run.config).session_specs()}


def seeds_of(ctx: Context, prefix: str) -> list[int]:
    return sorted({int(k[len(prefix) :].split("seed-")[1].split("/")[0]) for k in ctx.runs if k.startswith(prefix)})


# -- the paired design (sim.paired): a burst arm and its no-burst twin on each seed ----------------------------------
def paired_plan(base: SimConfig, seeds: list[int], tag: str = "") -> list[tuple[str, SimConfig]]:
    from kvgate.sim.paired import arms

    out = []
    for s in seeds:
        twin, trig = arms(base, s)
        out.append((f"{tag}seed-{s}/twin", twin))
        out.append((f"{tag}seed-{s}/trigger", trig))
    return out


def pair_counts(
    ctx: Context, seeds: list[int], tag: str = "", bad: Callable[[Run], bool] | None = None
) -> dict[str, int]:
    """How the paired design's seeds split: only the burst arm degraded, only the twin, both, neither."""
    bad = bad or (lambda r: degraded(r.summary))
    c = {"only_trigger": 0, "only_twin": 0, "both": 0, "neither": 0}
    for s in seeds:
        a, b = bad(ctx.runs[f"{tag}seed-{s}/trigger"]), bad(ctx.runs[f"{tag}seed-{s}/twin"])
        c["both" if a and b else "only_trigger" if a else "only_twin" if b else "neither"] += 1
    return c


PAIRED = B8.with_(lam=0.035, bursts=("1.5@15+5",))


PARTIAL_HIT = 0.88
"""End hit ratio (last 10 min) below which a run that is not persistently degraded is *partially* degraded: midway
between the paper's partially degraded 32B run (0.81) and its lowest no-burst run (0.95), so that any cut between
the two classifies the paper's runs as it did (§3, Figure 2)."""


def partially_degraded(r: Run) -> bool:
    """Not persistently degraded, but ending below :data:`PARTIAL_HIT` (the paper's "partially degraded at the end of
    the window")."""
    return not degraded(r.summary) and (r.summary["hit_ratio_last10"] or 1.0) < PARTIAL_HIT


def degraded_or_partial(r: Run) -> bool:
    return degraded(r.summary) or partially_degraded(r)


def arms_plan(base: SimConfig, arms: list[str], seeds: list[int]) -> list[tuple[str, SimConfig]]:
    from kvgate.sim.arms import arm_config

    return [(f"{a.replace(':', '_')}/seed-{s}", arm_config(base, a, s)) for a in arms for s in seeds]


def arm_stats(ctx: Context, arm: str, seeds: list[int], prefix: str = "") -> dict[str, Any]:
    key = prefix + arm.replace(":", "_")
    runs = {s: ctx.runs[f"{key}/seed-{s}"] for s in seeds if f"{key}/seed-{s}" in ctx.runs}
    rs = {s: r.summary for s, r in runs.items()}
    col = [s for s in rs if rs[s].get("collapsed_at_control")]
    return {
        "collapsed": col,
        "recovered": [s for s in col if rs[s].get("recovered")],
        "time": [rs[s]["recovery_min"] for s in col if rs[s].get("recovered")],
        "hit": [rs[s]["hit_ratio_last10"] for s in col],
        "cohort": [rs[s]["cohort_done"] for s in col],
        "tput": [rs[s]["turns_per_s_last10"] for s in col],
        "all": rs,
        "runs": runs,
    }


def recovery_time(v: list[float]) -> str:
    if not v:
        return "–"
    return "<5" if max(v) < 5 else f"≤{max(v):.0f}" if min(v) < 5 else rng(v, "{:.0f}")


def percent_range(v: Sequence[float | None]) -> str:
    return rng([x * 100 for x in v if x is not None], "{:.0f}%")


def whole_cohorts(done: Sequence[float | None], empty: bool = False) -> tuple[int, int]:
    """(runs whose whole cohort completed -- or, with ``empty``, none of it --, runs): the paper's 100% and 0% of
    a cohort are every run's, counted run by run, not a mean."""
    return sum(1 for c in done if c is not None and (c <= 0.0 if empty else c >= 1.0)), len(done)


def count_against_twins(trig: dict[int, Run], twin: dict[int, Run]) -> tuple[int, int, list[int], list[int]]:
    """The seeds whose run with the trigger degrades, among those whose twin (the same arrivals without it) stays
    healthy: (that count, those seeds, the degraded ones, the seeds left out because their twin degraded)."""
    spont = [s for s in trig if degraded(twin[s].summary)]
    kept = [s for s in trig if s not in spont]
    dn = [s for s in kept if degraded(trig[s].summary)]
    return len(dn), len(kept), dn, spont


def left_out(spont: list[int]) -> str:
    return f"; left out, the twin degraded without the trigger: seeds {spont}" if spont else ""
