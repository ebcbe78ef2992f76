"""The paper's trace shapes: the bundled sessions reweighted to the paper's statistics (workload/paper_trace.py)."""

from __future__ import annotations

from collections import Counter

import pytest

from kvgate.workload.paper_trace import (
    PAPER_MEDIAN_CALLS,
    PAPER_TRUNCATED_SESSIONS,
    POOL,
    TILT_EXCEEDS,
    TILT_LOG_CALLS,
    fit_tilt,
    multiplicities,
    paper_trace_workload,
    statistics,
    tilt_weights,
)
from kvgate.workload.trace import PAPER_MAX_CONTEXT, bundled_shapes_path, load_trace


@pytest.fixture(scope="module")
def full() -> tuple:
    return load_trace(bundled_shapes_path()).shapes


def test_the_two_constants_come_from_the_papers_two_figures(full: tuple) -> None:
    assert fit_tilt(full) == (TILT_EXCEEDS, TILT_LOG_CALLS)
    st = statistics(full, tilt_weights(full))
    assert st.truncated_sessions == pytest.approx(PAPER_TRUNCATED_SESSIONS, abs=0.005)
    assert st.median_calls == PAPER_MEDIAN_CALLS


def test_the_checks_are_consequences_not_fits(full: tuple) -> None:
    """The figures not used for the fit: where they land (the trace-32b page holds them against the paper)."""
    raw, st = statistics(full), statistics(full, tilt_weights(full))
    assert raw.truncated_sessions == pytest.approx(0.10) and raw.median_calls == 36
    assert 15_000 < st.median_context < 18_000  # paper: 16K
    assert 0.10 < st.turns_removed < 0.16  # paper: 14%
    assert 280 < st.median_growth < 400  # paper: ~350
    assert st.median_context > raw.median_context and st.turns_removed > raw.turns_removed


def test_the_pool_realizes_the_weights(full: tuple) -> None:
    w = tilt_weights(full)
    k = multiplicities(w)
    assert sum(k) == POOL and all(abs(x - POOL * y) < 1 for x, y in zip(k, w, strict=True))
    wl = paper_trace_workload(PAPER_MAX_CONTEXT)
    assert len(wl.pool) == POOL and max(s.max_context() for s in wl.pool) <= PAPER_MAX_CONTEXT
    counts = Counter(s.source for s in wl.pool)
    heavy = max(full, key=lambda s: w[full.index(s)])
    assert counts[heavy.source] == max(counts.values())


def test_a_run_draws_the_paper_trace_by_name() -> None:
    from kvgate.sim.config import SimConfig

    cfg = SimConfig(trace="paper", lam=0.025, minutes=20, seed=3)
    specs = cfg.session_specs()
    assert specs and specs == SimConfig(trace="paper", lam=0.025, minutes=20, seed=3).session_specs()
    assert cfg.workload().name == "trace:paper"
