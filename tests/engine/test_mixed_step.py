"""The mixed step's penalty: a decoder sharing its step with prefill pays more the larger the step's prefill share,
and the profile's two constants are the joint fit's minimum (docs/results/calibration-mixed/grid.json)."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest

from kvgate.calibration.mixed import objective
from kvgate.engine.base import Request
from kvgate.engine.blocks import SeqKey
from kvgate.engine.costmodel import PROFILES, QWEN3_8B_MI300X, Profile, profile_from_dict, profile_to_dict
from kvgate.engine.vllm import VllmEngine

GRID = Path(__file__).resolve().parents[2] / "docs" / "results" / "calibration-mixed" / "grid.json"
P = replace(QWEN3_8B_MI300X, mixed_decode_factor=11.0, mixed_share_exponent=2.0)


def test_penalty_is_the_whole_factor_on_a_full_budget_and_falls_with_the_share() -> None:
    assert P.mixed_penalty(8192, 8192) == 11.0
    assert P.mixed_penalty(4096, 8192) == pytest.approx(1.0 + 10.0 * 0.25)
    shares = [P.mixed_penalty(n, 8192) for n in (64, 512, 2048, 6000, 8192)]
    assert shares == sorted(shares) and shares[0] < 1.01
    const = replace(P, mixed_share_exponent=0.0)  # the model before the exponent: the factor whatever the prefill
    assert {const.mixed_penalty(n, 8192) for n in (1, 1300, 8192)} == {11.0}


def _mixed_step(p: Profile, new: int) -> tuple[float, float]:
    """The duration of one step of 8 decoders at ~20K context beside ``new`` tokens of a prompt's prefill, and
    the decoders' KV read in it without the penalty."""
    eng = VllmEngine(p, 1_000_000)
    for i in range(8):
        eng.add(Request(i, SeqKey(0, 0, i), 20_000, 100, 0.0, None))
    t = 0.0
    while any(r.t_first < 0 for r in eng.running) or eng.waiting:
        t += eng.step(t).duration
    dec = sum(p.chunk_attn(r.computed, 1) for r in eng.running)
    eng.add(Request(99, SeqKey(0, 0, 99), new, 1, t, None))
    return eng.step(t).duration, dec


@pytest.mark.parametrize("new", [512, 1300, 6000])
def test_engine_charges_the_decoders_the_penalty_of_the_step_s_prefill(new: int) -> None:
    got, dec = _mixed_step(P, new)
    want = P.step_time(new + 8, 9, P.chunk_attn(0, new) + P.mixed_penalty(new, 8192) * dec)
    assert got == pytest.approx(want, rel=1e-9)
    assert got < _mixed_step(replace(P, mixed_share_exponent=0.0), new)[0]


def test_profile_file_carries_the_exponent_and_older_files_mean_the_constant_factor() -> None:
    obj = profile_to_dict(P)
    assert profile_from_dict(obj) == P
    del obj["mixed_share_exponent"]
    assert profile_from_dict(obj).mixed_share_exponent == 0.0


def test_profiles_carry_the_joint_fit_s_minimum() -> None:
    fit = json.loads(GRID.read_text())
    grid = fit["grid"]
    for g in grid:  # each point's J is the objective of its own figures
        assert g["objective"] == pytest.approx(objective(g["slope_ms_per_token"], g["capacity_turns_s"]), abs=1e-4)
    best = min(grid, key=lambda g: g["objective"])
    assert fit["best"] == best
    assert len({g["mixed_decode_factor"] for g in grid}) >= 5 and len({g["mixed_share_exponent"] for g in grid}) >= 5
    for p in PROFILES.values():  # the 32B profile is derived from the 8B's constants
        assert (p.mixed_decode_factor, p.mixed_share_exponent) == (best["mixed_decode_factor"],
                                                                   best["mixed_share_exponent"])
