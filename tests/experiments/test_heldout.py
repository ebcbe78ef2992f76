"""The held-out accuracy table's pure parts (realvllm/heldout.py): the matrix, the errors, the summary, the page.
The real runs themselves need the real vLLM and a quiet machine (``kvgate real-vllm heldout``)."""

from __future__ import annotations

import math

import pytest

from kvgate.realvllm.heldout import BLIS, SHAPES, TARGETS, Cell, _minute_err, matrix, page, summarize


def test_the_matrix_is_at_least_twelve_distinct_runs_over_four_axes() -> None:
    cells = matrix()
    assert len(cells) >= 12 and len({c.id for c in cells}) == len(cells)
    assert len({c.seed for c in cells}) == len(cells)
    for axis in ("lam", "kv_pool", "shape", "trigger"):
        assert len({getattr(c, axis) for c in cells}) >= 2, axis
    assert {c.shape for c in cells} <= set(SHAPES)
    d = cells[0].design(4.0)
    assert d.stream and d.minutes == 4.0 and d.kv_pool == cells[0].kv_pool and d.seeds == (cells[0].seed,)
    assert Cell(0.1, 98_304, "agent", "none", 1).arm == "twin" and Cell(0.1, 98_304, "agent", "2@1+1", 1).arm == "burst"


def test_minute_errors_skip_minutes_without_a_value() -> None:
    mean, top = _minute_err([0.5, None, 0.9, 0.8], [0.6, 0.7, None, 0.7], relative=False)
    assert mean == pytest.approx(0.1) and top == pytest.approx(0.1)
    mean, _ = _minute_err([2.0, 2.0], [1.0, 3.0], relative=True)
    assert mean == pytest.approx(0.5)
    assert all(math.isnan(x) for x in _minute_err([None], [1.0], relative=False))


def _row(e2e: float, ttft: float, hit: float) -> dict:
    return {"id": "r", "e2e": e2e, "ttft": ttft, "throughput": 0.1, "hit_mean": hit / 2, "hit_max": hit,
            "in_system": 0.05, "real": {"turns": 10, "e2e_s": 1.0, "ttft_s": 0.1},
            "sim": {"turns": 10, "e2e_s": 1.0 + e2e, "ttft_s": 0.1}, "loadavg_per_min": [0.4]}


def test_the_summary_holds_the_bar_and_can_fail() -> None:
    good = summarize([_row(0.03, 0.05, 0.02)] * 12)
    assert all(good["meets"].values())
    bad = summarize([_row(0.03, 0.05, 0.02)] * 11 + [_row(0.5, 0.5, 0.2)])
    assert bad["meets"]["e2e"] and not bad["meets"]["hit"]  # the median holds, one run's worst minute does not
    few = summarize([_row(0.03, 0.05, 0.02)] * 3)
    assert not few["meets"]["runs"]
    assert not summarize([_row(0.2, 0.3, 0.02)] * 12)["meets"]["e2e"]


def test_the_page_shows_the_medians_beside_blis() -> None:
    rows = [_row(0.03, 0.05, 0.02)] * 12
    md = page({"profile": "p.json", "quick": False, "minutes": 4.0, "rows": rows, "summary": summarize(rows),
               "blis": BLIS, "targets": TARGETS})
    assert "| E2E turn latency (run mean), relative error | 3.0% | ≤ 5% | 6.7% |" in md
    assert md.count("| r |") == 12 and "at least 12 runs: **yes**" in md


def test_runs_where_the_pool_bound_the_hit_ratio_are_counted_apart() -> None:
    from kvgate.realvllm.heldout import POOL_BOUND, pool_bound

    assert pool_bound([0.8, 0.7, None], [0.8, 0.85, 0.9]) == pytest.approx(0.15)
    assert math.isnan(pool_bound([None], [0.5]))
    free = {**_row(0.03, 0.05, 0.0), "pool_bound": 0.0}
    bound = {**_row(0.03, 0.05, 0.04), "pool_bound": POOL_BOUND * 10}
    s = summarize([free] * 10 + [bound] * 2)
    assert s["pool_bound_runs"] == 2 and s["hit_max_bound"] == pytest.approx(0.04)
    md = page({"profile": "p.json", "quick": False, "minutes": 3.0, "rows": [free] * 10 + [bound] * 2, "summary": s,
               "blis": BLIS, "targets": TARGETS})
    assert "in 2 of 12 runs the real hit ratio departed" in md and "0.040" in md
