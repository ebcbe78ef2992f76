"""Analysis functions on hand-built records with known answers."""

from __future__ import annotations

import math

import numpy as np
import pytest

from kvgate.analysis import metrics as m
from kvgate.analysis.drain import ColdCost, fit_cold_cost
from kvgate.analysis.stats import sign_test_p
from kvgate.records import Run


def turns(end, prompt, cached, status=None):
    n = len(end)
    return {
        "end_s": np.asarray(end, dtype=float),
        "prompt_tokens": np.asarray(prompt, dtype=np.int64),
        "cached_tokens": np.asarray(cached, dtype=float),
        "status": np.asarray(status or ["ok"] * n, dtype=object),
    }


def test_hit_ratio_is_token_weighted_and_skips_unknown_and_errors() -> None:
    t = turns([10, 20, 30, 40], [1000, 3000, 5000, 100], [900, 300, np.nan, 100], ["ok", "ok", "ok", "error"])
    # (900 + 300) / (1000 + 3000): the unknown-cached turn and the failed turn are left out
    assert m.hit_ratio(t, 0, 100) == pytest.approx(0.3)
    assert math.isnan(m.hit_ratio(t, 50, 60))  # no turn in the window


def test_series_handles_empty_windows_and_partial_end() -> None:
    t = turns([30, 90, 95], [100, 100, 200], [50, 100, 0])
    samples = {"t_s": np.array([0.0, 60.0, 120.0]), "in_system": np.array([1, 2, 3])}
    s = m.series(t, samples, 150.0, 60.0)
    assert list(s["t_min"]) == [0.0, 1.0]  # the partial last window is dropped
    assert s["hit_ratio"][0] == pytest.approx(0.5)
    assert s["hit_ratio"][1] == pytest.approx(100 / 300)
    assert s["turns_per_s"][1] == pytest.approx(2 / 60)
    s2 = m.series(turns([], [], []), samples, 150.0, 60.0)
    assert np.isnan(s2["hit_ratio"]).all()


def _windows(hits: list[float]) -> tuple[dict, dict]:
    """One turn per 5-minute window, in the middle, with the given hit ratios."""
    end = [300 * i + 150 for i in range(len(hits))]
    t = turns(end, [1000] * len(hits), [h * 1000 for h in hits])
    samples = {"t_s": np.arange(0, 300 * len(hits) + 1, 10.0)}
    samples["in_system"] = np.ones_like(samples["t_s"])
    return t, samples


def test_persistent_degradation_needs_every_later_window_degraded() -> None:
    t, s = _windows([0.95, 0.9, 0.3, 0.2, 0.1, 0.1])
    assert m.persistent_degradation(t, s, 0.0, 1800.0) == (True, 600.0)
    t, s = _windows([0.95, 0.3, 0.2, 0.8, 0.1, 0.1])  # a healthy window in between: the later stretch counts
    assert m.persistent_degradation(t, s, 0.0, 1800.0) == (False, None)
    t, s = _windows([0.95, 0.3, 0.2, 0.9, 0.95, 0.95])
    assert m.persistent_degradation(t, s, 0.0, 1800.0) == (False, None)
    t, s = _windows([0.95] * 6)
    assert m.persistent_degradation(t, s, 0.0, 1800.0) == (False, None)


def _windows_gaps(hits: list[float | None]) -> tuple[dict, dict]:
    """Like ``_windows``, but None is a window in which no turn completes (sessions are in the system)."""
    keep = [(i, h) for i, h in enumerate(hits) if h is not None]
    end = [300 * i + 150 for i, _ in keep]
    t = turns(end, [1000] * len(keep), [h * 1000 for _, h in keep])
    samples = {"t_s": np.arange(0, 300 * len(hits) + 1, 10.0)}
    samples["in_system"] = np.full_like(samples["t_s"], 50.0)
    return t, samples


def test_a_window_without_turns_is_no_evidence_of_degradation() -> None:
    # a stall with sessions in the system does not start a degraded stretch ...
    t, s = _windows_gaps([0.95, 0.95, None, None, 0.95, 0.95])
    assert m.persistent_degradation(t, s, 0.0, 1800.0) == (False, None)
    # ... and does not end one either
    t, s = _windows_gaps([0.95, 0.3, None, 0.2, None, 0.1])
    assert m.persistent_degradation(t, s, 0.0, 1800.0) == (True, 300.0)
    # a degraded window followed only by windows without turns shows nothing persisting
    t, s = _windows_gaps([0.95, 0.95, 0.95, 0.3, None, None])
    assert m.persistent_degradation(t, s, 0.0, 1800.0) == (False, None)


def test_only_the_last_window_degraded_is_not_persistent() -> None:
    t, s = _windows([0.95, 0.95, 0.95, 0.95, 0.95, 0.3])
    assert m.persistent_degradation(t, s, 0.0, 1800.0) == (False, None)
    t, s = _windows([0.95, 0.95, 0.95, 0.95, 0.3, 0.3])
    assert m.persistent_degradation(t, s, 0.0, 1800.0) == (True, 1200.0)


def test_window_alignment_and_no_trigger() -> None:
    t, s = _windows([0.95, 0.95, 0.95, 0.3, 0.3, 0.3])
    ok, since = m.persistent_degradation(t, s, 300.0, 1800.0)  # aligned to a trigger ending at minute 5
    assert ok and since == 900.0


def test_recovery_time_first_window_after_which_all_recover() -> None:
    # hit ratio per minute: degraded until minute 23, healthy afterwards; control at minute 20
    end = np.arange(0, 60 * 60, 30.0) + 15
    hit = np.where(end < 23 * 60, 0.1, 0.95)
    t = turns(end, [1000] * len(end), hit * 1000)
    rt = m.recovery_time(t, 20 * 60.0, 60 * 60.0)
    assert rt == pytest.approx(3.0)  # window [23, 28) is the first fully healthy one
    assert m.recovery_time(t, 20 * 60.0, 29 * 60.0) is None  # less than 10 minutes of follow-up


def test_cohort_completion_and_latency() -> None:
    sess = {"arrival_s": np.array([0.0, 100.0, 200.0, 1300.0]), "end_s": np.array([600.0, np.nan, 500.0, 1400.0])}
    assert m.cohort_completion(sess, 0, 1200) == pytest.approx(2 / 3)
    assert sorted(m.cohort_latency_min(sess, 0, 1200)) == pytest.approx([5.0, 10.0])
    assert math.isnan(m.cohort_completion(sess, 5000, 6000))


def test_sign_test_matches_the_paper() -> None:
    assert sign_test_p(9, 0) == pytest.approx(0.00390625)
    assert sign_test_p(7, 1) == pytest.approx(0.0703125)
    assert sign_test_p(0, 0) == 1.0


def test_cold_cost_fit_recovers_a_known_line() -> None:
    true = ColdCost(-0.1, 0.15e-3, 0)
    rng = np.random.default_rng(0)
    t_s, running, end, prompt, status = [], [], [], [], []
    for w in range(40):  # 40 busy 2-minute windows filled with cold turns of random contexts
        t0 = 120.0 * w
        t = t0
        while True:
            L = int(rng.integers(6000, 37000))
            if t + true(L) > t0 + 120:
                break
            t += true(L)
            end.append(t - 1e-6)
            prompt.append(L)
            status.append("ok")
        # pad the window so its turns exactly fill it (the regression assumes a busy engine)
        end[-1] = t0 + 120 - 1e-6
        t_s += list(np.arange(t0, t0 + 120, 10.0))
        running += [5] * 12
    run = Run(None, {"config": {"minutes": 80.0}},
              turns(end, prompt, [0] * len(end), status),
              {"arrival_s": np.array([]), "end_s": np.array([])},
              {"t_s": np.array(t_s), "running": np.array(running)})
    fit = fit_cold_cost([run])
    assert fit.windows == 40
    assert fit.slope_ms_per_token == pytest.approx(0.15, rel=0.15)
