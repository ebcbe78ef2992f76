"""The held-out accuracy table's pure parts (realvllm/heldout.py): the matrix, the errors, the summary, the page.
The real runs themselves need the real vLLM and a quiet machine (``kvgate real-vllm heldout``)."""

from __future__ import annotations

import json
import math
from pathlib import Path

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


# -- the protocol: cells from a committed file, frozen before the runs ------------------------------------------
CELLS = Path(__file__).resolve().parents[2] / "docs" / "results" / "real-vllm-heldout" / "cells.json"


def _cells(tmp_path: Path, cells: list[dict]) -> Path:
    p = tmp_path / "cells.json"
    p.write_text(json.dumps(cells))
    return p


def test_a_cells_file_is_checked_with_one_line_errors(tmp_path: Path) -> None:
    from kvgate.errors import UsageError
    from kvgate.realvllm.heldout import load_cells

    good = {"lam": 0.1, "kv_pool": 98_304, "shape": "agent", "trigger": "2@1+1", "seed": 3}
    assert load_cells(_cells(tmp_path, [good]), 5.0) == [Cell(0.1, 98_304, "agent", "2@1+1", 3)]
    with pytest.raises(UsageError, match="less than 3 minutes after it"):  # the burst ends at minute 2
        load_cells(_cells(tmp_path, [good]), 4.0)
    for bad, why in (({**good, "shape": "x"}, "unknown shape"), ({**good, "seed": 0}, "'seed'"),
                     ({k: v for k, v in good.items() if k != "lam"}, "exactly the keys"),
                     ({**good, "trigger": "soon"}, "malformed burst")):
        with pytest.raises(UsageError, match=why):
            load_cells(_cells(tmp_path, [bad]), 5.0)
    with pytest.raises(UsageError, match="listed twice"):
        load_cells(_cells(tmp_path, [good, good]), 5.0)


def test_the_protocol_is_frozen_when_the_runs_begin(tmp_path: Path) -> None:
    from kvgate.errors import UsageError
    from kvgate.realvllm.protocol import freeze

    cells = _cells(tmp_path, [{"lam": 0.1, "kv_pool": 98_304, "shape": "agent", "trigger": "none", "seed": 3}])
    first = freeze(tmp_path / "out", cells, "tiny-llama-cpu-vllm032", 5.0)
    assert freeze(tmp_path / "out", cells, "tiny-llama-cpu-vllm032", 5.0) == first  # a resumed run
    with pytest.raises(UsageError, match="profile_sha256 changed"):
        freeze(tmp_path / "out", cells, "qwen3-8b-mi300x", 5.0)
    with pytest.raises(UsageError, match="minutes changed"):
        freeze(tmp_path / "out", cells, "tiny-llama-cpu-vllm032", 6.0)
    cells.write_text(cells.read_text().replace("0.1", "0.12"))
    with pytest.raises(UsageError, match="cells_sha256 changed"):
        freeze(tmp_path / "out", cells, "tiny-llama-cpu-vllm032", 5.0)


def test_the_committed_cells_are_fresh() -> None:
    from kvgate.realvllm.heldout import load_cells

    cells = load_cells(CELLS, 6.0)
    retired = {(c.lam, c.kv_pool, c.shape, c.trigger, c.seed) for c in matrix()}
    assert len(cells) >= 12 and not retired & {(c.lam, c.kv_pool, c.shape, c.trigger, c.seed) for c in cells}
    assert not {c.seed for c in cells} & {c.seed for c in matrix()}


def test_per_turn_errors_match_turns_and_sign_the_ttft_bias(tmp_path: Path) -> None:
    from dataclasses import replace

    from kvgate.engine.costmodel import profile, save_profile
    from kvgate.realvllm.experiment import run_sim
    from kvgate.realvllm.heldout import compare, peak_demand, summarize, turn_errors

    cell = Cell(0.1, 98_304, "agent", "2@0.5+0.5", 5)
    d = cell.design(2.0)
    trace = tmp_path / "w.jsonl"
    trace.write_text(json.dumps(d.trace_line()) + "\n")
    base = profile("tiny-llama-cpu-vllm032")
    slow = tmp_path / "slow.json"
    save_profile(replace(base, name="slow", request_s=base.request_s + 0.05), slow)
    run_sim(d, cell.seed, cell.arm, trace, "tiny-llama-cpu-vllm032", tmp_path / "a")
    run_sim(d, cell.seed, cell.arm, trace, str(slow), tmp_path / "b")
    same = turn_errors(tmp_path / "a", tmp_path / "a")
    assert same["e2e"] and max(same["e2e"]) == 0.0 and max(same["ttft"]) == 0.0
    row = compare(tmp_path / "a", tmp_path / "b", 2.0)  # "real" the fast one: the simulator late
    assert row["ttft_bias"] > 0 and row["ttft_turn_bias"] > 0 and row["ttft_turn_p90"] >= row["ttft_turn_median"] > 0
    assert 0 < peak_demand(tmp_path / "a", cell.kv_pool) < 10
    s = summarize([{**row, "peak_demand": 1.5, "pool_bound": 0.0}, {**row, "peak_demand": 0.5, "pool_bound": 0.0}])
    assert s["oversubscribed"]["runs"] == 1 and s["within_pool"]["runs"] == 1
    assert s["turns"]["turns"] == 2 * row["turns_matched"] and s["turns"]["runs_sim_early"] == 0
