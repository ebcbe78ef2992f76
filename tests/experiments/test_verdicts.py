"""Verdict rules: every claim of the paper can come out negative, and calibration is kept apart from reproduction."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

import pytest

from kvgate.experiments.claims import CAUSES, HIT_HEALTHY, PAPER_CLAIMS, parse_rule
from kvgate.experiments.verdicts import (
    CALIBRATED,
    DIFFERS,
    NOT_REPRODUCED,
    REPRODUCED,
    Calibrated,
    Count,
    Figure,
    Holds,
    Prevents,
    TwinEffect,
    fisher_p,
)


@pytest.mark.parametrize("cid", sorted(PAPER_CLAIMS))
def test_every_claim_rejects_a_contradicting_result(cid: str) -> None:
    """Mutation test of the verdict logic: a result contradicting the paper is never 'reproduced' -- every kind of
    contradiction a rule knows (for a count: the other universal, both universals against "some", a universal on a
    smaller denominator than the paper's)."""
    rule = PAPER_CLAIMS[cid]
    contradictions = rule.contradictions()
    if not isinstance(rule, Calibrated):
        assert contradictions, "no result the quantity can take contradicts the claim: the rule cannot fail"
    for obs in contradictions:
        if isinstance(rule, Figure):
            lo, hi = rule.domain()
            assert all(lo <= x <= hi for x in obs), (obs, "not a value the quantity can take")
        verdict, _ = rule.judge(obs)
        assert verdict != REPRODUCED, obs
        if not isinstance(rule, Calibrated):
            assert verdict in (DIFFERS, NOT_REPRODUCED), obs


def _agreeing(rule: object) -> object:
    if isinstance(rule, Figure):
        return [rule.lo, rule.hi] if rule.spread else [(rule.lo + rule.hi) / 2]
    if isinstance(rule, Count):
        return (rule.k, rule.n)
    if isinstance(rule, Prevents):
        return (0, 3)
    if isinstance(rule, TwinEffect):
        return {"only_trigger": max(1, rule.min_only_trigger), "only_twin": 0, "both": 0, "neither": 1}
    if isinstance(rule, Holds):
        return True
    return None


@pytest.mark.parametrize("cid", sorted(PAPER_CLAIMS))
def test_every_claim_accepts_the_papers_own_result(cid: str) -> None:
    """...and the paper's own numbers are reproduced (a calibrated figure stays 'calibrated')."""
    rule = PAPER_CLAIMS[cid]
    verdict, _ = rule.judge(_agreeing(rule))
    assert verdict == (CALIBRATED if isinstance(rule, Calibrated) else REPRODUCED)


def test_counts_by_band_and_exact_test() -> None:
    offload = Count("c", "4 of 6", k=4, n=6, band=0.25)
    v, note = offload.judge((1, 6))  # the loosened check of old: "any collapse"
    assert v == NOT_REPRODUCED and "fewer" in note and "-50 points" in note
    assert offload.judge((4, 6))[0] == REPRODUCED and offload.judge((3, 4))[0] == REPRODUCED
    assert offload.judge((6, 6))[0] == DIFFERS  # same side of one half, but outside the band
    flush = Count("c", "1 of 5", k=1, n=5, band=0.2)
    assert flush.judge((0, 10))[0] == NOT_REPRODUCED  # "can leave a run degraded" is not shown by none
    assert flush.judge((2, 10))[0] == REPRODUCED
    universal = Count("c", "7 of 7", k=7, n=7)
    assert universal.judge((7, 7))[0] == REPRODUCED
    assert universal.judge((6, 7))[0] == DIFFERS and universal.judge((3, 7))[0] == NOT_REPRODUCED
    assert universal.judge((0, 0))[0] == NOT_REPRODUCED


def test_a_count_of_one_half_can_fail_and_a_universal_needs_the_papers_denominator() -> None:
    half = Count("c", "2 of 4", k=2, n=4, band=0.25)
    assert half.judge((4, 4))[0] == NOT_REPRODUCED  # "in two, not in the other two" is not shown by all four
    assert half.judge((0, 4))[0] == NOT_REPRODUCED and half.judge((2, 4))[0] == REPRODUCED
    assert half.judge((1, 8))[0] == DIFFERS
    most = Count("c", "9 of 12", k=9, n=12, band=0.25)
    assert most.judge((12, 12))[0] == REPRODUCED  # more of "most" is not a contradiction
    three = Count("c", "3 of 3", k=3, n=3)
    v, note = three.judge((1, 1))  # the 32B recovery of old: one collapsed seed, "recovered all"
    assert v == DIFFERS and "1 run only" in note
    assert three.judge((5, 5))[0] == REPRODUCED


def test_every_subset_row_names_a_population_row_that_can_fail() -> None:
    """A row judged on the runs collapsed when control began (or on seeds collapsed in every arm) names the count
    that holds that subset against the paper's; fed kvgate's population of old (11 of 16 collapsed per arm, 1 of 4
    seeds on 32B) or no collapsed seed, that count is not reproduced."""
    from kvgate.experiments.claims import POPULATIONS

    assert POPULATIONS, "no claim declares its population"
    recovery = [c for c in PAPER_CLAIMS if c.split(".")[0] in ("r8", "r32")]
    subset = [c for c in recovery if not c.endswith(("collapsed_at_control", "matched_count", "collapsed_every_arm"))]
    assert not [c for c in subset if c not in POPULATIONS]
    for cid, pop in POPULATIONS.items():
        rule = PAPER_CLAIMS[pop]
        assert isinstance(rule, Count), (cid, pop)
        assert rule.judge((0, rule.n))[0] != REPRODUCED, pop
    assert PAPER_CLAIMS["r8.collapsed_at_control"].judge((55, 80))[0] != REPRODUCED
    assert PAPER_CLAIMS["r32.collapsed_every_arm"].judge((1, 4))[0] != REPRODUCED


def test_a_row_on_another_population_says_so() -> None:
    from pathlib import Path

    from kvgate.experiments.base import Context

    ctx = Context({}, Path("."), quick=False, draw=False)
    ctx.judge("r32.collapsed_every_arm", (1, 4), "1 of 4 seeds")
    row = ctx.judge("r32.bud", (1, 1), "1 of 1")
    assert "another population" in row.note and "1 of 4 seeds" in row.note


def test_fisher_exact_matches_known_values() -> None:
    # [[7, 0], [1, 6]]: two-sided p = 0.004662 (R: fisher.test(matrix(c(7,1,0,6), 2)))
    assert fisher_p(7, 7, 1, 7) == pytest.approx(0.004662, abs=1e-5)
    assert fisher_p(3, 4, 9, 12) == pytest.approx(1.0)


def test_figure_gives_direction_and_size() -> None:
    f = Figure("c", "0.10-0.13", lo=0.10, hi=0.13, tol=0.02, qual=(0.0, 0.35))
    assert f.judge([0.11, 0.14])[0] == REPRODUCED
    v, note = f.judge([0.02])
    assert v == DIFFERS and "below" in note and "0.06" in note
    assert f.judge([0.6])[0] == NOT_REPRODUCED
    assert f.judge([None])[0] == NOT_REPRODUCED


def test_a_band_that_holds_every_value_the_quantity_can_take_is_refused() -> None:
    """Table 3's admission-only hit ratios (0.07-0.93) as a band every run must fall in hold any hit ratio from 0.05
    to 0.95, and a qualitative band of [0, 1] never says "not reproduced": such a rule has no contradiction left. Held
    as the spread of the runs instead, it fails when they do not reach both ends."""
    vacuous = Figure("hit", "0.07-0.93", lo=0.07, hi=0.93, tol=0.02, qual=(0.0, 1.0))
    assert vacuous.domain() == (0.0, 1.0) and vacuous.contradictions() == []
    assert Figure("min", "< 5 min", lo=0, hi=4.99, qual=(0, 10)).contradictions()[0][0] > 10
    spread = Figure("hit", "0.07-0.93", lo=0.07, hi=0.93, tol=0.02, spread=True)
    assert spread.judge([0.06, 0.12, 0.93])[0] == REPRODUCED
    v, note = spread.judge([0.06, 0.7])
    assert v == DIFFERS and "highest run 0.7" in note
    assert spread.judge([0.08, 0.1, 0.3])[0] == NOT_REPRODUCED  # none recovered: no spread
    assert spread.judge([0.85, 0.9])[0] == NOT_REPRODUCED
    assert spread.judge([])[0] == NOT_REPRODUCED


def test_policy_and_twin_rules_need_a_collapse_to_judge() -> None:
    p = Prevents("c", "0/3")
    assert p.judge((0, 0)) == (NOT_REPRODUCED, "untestable: no seed collapsed without control")
    assert p.judge((0, 2))[0] == REPRODUCED and p.judge((2, 2))[0] == NOT_REPRODUCED
    t = TwinEffect("c", "p")
    # the 32B case of old: the one degraded burst run's twin degraded at the same time
    assert t.judge({"only_trigger": 0, "only_twin": 0, "both": 1, "neither": 3})[0] == NOT_REPRODUCED


WHY = [  # every claim listed under "Why" in issue 11 has a row (the flush's prevention once, on the flush page)
    "ts.vllm_2x2", "ts.larger_more", "r8.lat_bud", "r8.lat_cap", "r8.aimd_time", "prev.tput", "flush.budgeter_count",
    "off.burst", "th.tput_alt", "th.tput_default", "drain.d010", "drain.d014", "t32.twin_effect", "drain.cl",
    "drain.inv_s", "paired.lam04_healthy", "drain.cl_degraded", "drain.no_reform", "nocache.load_fraction",
    "sg.dips", "sg.dip_depth", "r8.adm_low", "r32b.queue_growth", "r32b.bud_cohort", "paired.healthy_side_sessions",
    "paired.healthy_side_demand", "paired.healthy_side_R", "anatomy.half_cached", "paired.demand_25",
    "ts.larger_pool", "paired.cap_prevents", "r8.matched_states", "drain.s018_start", "drain.s018_end",
    "t32.lam035_onset", "t32.degraded_hit",
]


def test_every_claim_of_the_issue_has_a_row() -> None:
    assert not [c for c in WHY if c not in PAPER_CLAIMS]


def test_a_claims_table_names_exactly_one_rule_and_its_bands() -> None:
    rule = parse_rule("x.hit", {"figure": "hit ratio", "paper": "0.95", "lo": 0.95, "hi": 0.95, "qual": "healthy"})
    assert rule == Figure("hit ratio", "0.95", lo=0.95, hi=0.95, qual=HIT_HEALTHY)
    with pytest.raises(ValueError, match="exactly one"):
        parse_rule("x.none", {"paper": "1 of 2", "k": 1, "n": 2})
    with pytest.raises(ValueError, match="exactly one"):
        parse_rule("x.two", {"count": "runs", "holds": "runs", "paper": "1 of 2"})
    with pytest.raises(TypeError):
        parse_rule("x.typo", {"count": "runs", "paper": "1 of 2", "kk": 1})


def test_a_shared_cause_is_written_once_and_reaches_every_claim_that_names_it() -> None:
    assert CAUSES["off.hit"] == CAUSES["off.burst"] and "50 GB/s" in CAUSES["off.burst"]
    assert all(cid in PAPER_CLAIMS for cid in CAUSES)


def test_calibration_seeds_and_configs_are_not_used_by_any_experiment() -> None:
    from kvgate.calibration.paper import CALIBRATION_SEEDS, calibration_jobs
    from kvgate.experiments.catalog import EXPERIMENTS

    cal = [c for q in (True, False) for c in calibration_jobs("qwen3-8b-mi300x", quick=q)]
    assert {c.seed for c in cal} <= set(CALIBRATION_SEEDS)

    def key(c: object) -> tuple:
        d = asdict(c)  # type: ignore[call-overload]
        d.pop("label")
        return tuple(sorted((k, str(v)) for k, v in d.items()))

    cal_keys = {key(c) for c in cal}
    for e in EXPERIMENTS.values():
        for quick in (True, False):
            for rid, cfg in e.plan(quick):
                assert cfg.seed not in CALIBRATION_SEEDS, (e.name, rid)
                assert key(cfg) not in cal_keys, (e.name, rid)


def test_fixed_cap_from_a_lighter_load_follows_the_papers_rule() -> None:
    from kvgate.experiments.sec6_recovery import light_load_cap
    from kvgate.workload.shapes import preset

    # paper-8b: contexts 6K..30K+, mean turn context ~21.6K plus 300 output: K = floor(0.75 * 400K / d)
    k, khi = light_load_cap(preset("paper-8b"), 400_000)
    assert (k, khi) == (13, 17)
    assert light_load_cap(preset("paper-8b"), 800_000)[0] == 27  # twice the pool, twice the cap


def _quick_records(name: str, tmp_path: Path) -> tuple[Any, dict[str, Any]]:
    """The experiment ``name`` and the records of its quick plan, simulated into ``tmp_path``."""
    from kvgate.experiments.base import load_runs
    from kvgate.experiments.catalog import EXPERIMENTS
    from kvgate.sim.batch import run_many

    e = EXPERIMENTS[name]
    plan = e.plan(True)
    run_many([(cfg, str(tmp_path / "runs" / rid)) for rid, cfg in plan], jobs=1, progress=False)
    return e, load_runs(tmp_path / "runs", [rid for rid, _ in plan])


def test_an_experiment_fed_contradicting_records_does_not_reproduce(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """End to end: the prevention experiment's records with each budgeter run under the 2x/2-min burst replaced by
    the uncontrolled run of its seed -- a policy with no effect -- must not reproduce "budgeter from the start: no
    collapse under a 2x/2-min burst". (The flush experiment served here until the fitted mixed step left every
    uncontrolled quick flush run healthy: there a policy with no effect cannot be told from one that works.)"""
    from kvgate.experiments.base import Context

    e, runs = _quick_records("prevention", tmp_path)
    mutated = {k: (runs[k.replace("burst/budgeter/", "burst/none/")] if k.startswith("burst/budgeter/") else r)
               for k, r in runs.items()}
    got = {c.id: c.verdict for c in e.evaluate(Context(mutated, tmp_path, True, draw=False)).claims}
    assert any(r.summary["persistently_degraded"] for k, r in runs.items() if k.startswith("burst/none/")), (
        "no uncontrolled quick prevention run degrades: the mutation would prove nothing")
    assert got["prev.burst"] != REPRODUCED


def test_a_cohort_done_in_every_run_is_a_universal_count_not_a_range() -> None:
    """Table 3's 100% and 0% are every run's (and so are the mix shift's "every session" and "no wait"): one run
    with one counter-example does not reproduce them."""
    from kvgate.experiments.common import whole_cohorts

    assert whole_cohorts([1.0, 0.979, None, 1.0]) == (2, 4)
    for cid in ("r8.bud_cohort", "r8.cap_cohort", "th.cohort", "r8.none_cohort", "mix.good_done", "mix.good_wait"):
        rule = PAPER_CLAIMS[cid]
        assert rule.judge((rule.n, rule.n))[0] == REPRODUCED
        assert rule.judge(whole_cohorts([1.0] * 10 + [0.979]))[0] == DIFFERS, cid


def test_a_larger_pool_that_never_collapses_has_eliminated_the_failure(tmp_path: Path) -> None:
    """The paper: a larger pool "raises the trigger size needed rather than eliminating the failure". Records in
    which the larger pool collapses fewer runs but some (its runs replaced, seed by seed, by the same seed's
    smaller-pool 2x-4min run for one collapsed seed and by the twin without a burst for the others) do judge
    reproduced; records in which it collapses none (every run replaced by its twin) do not."""
    from kvgate.experiments.base import Context
    from kvgate.experiments.common import degraded

    e, runs = _quick_records("trigger-size", tmp_path)

    def verdict(swap: dict[str, str]) -> str:
        mutated = {k: (runs[swap[k]] if k in swap else r) for k, r in runs.items()}
        claims = e.evaluate(Context(mutated, tmp_path, True, draw=False)).claims
        return next(c.verdict for c in claims if c.id == "ts.larger_pool")

    def collapsed(prefix: str) -> int:
        return sum(degraded(r.summary) for k, r in runs.items() if k.startswith(prefix))

    assert collapsed("2x-4min/") >= 2 and collapsed("twin/") == 0, (
        "the quick records must give a burst that collapses runs and twins that stay healthy")
    larger = sorted(k for k in runs if k.startswith("pool600/2x-4min/"))
    to_twin = {k: k.replace("pool600/2x-4min/", "twin/") for k in larger}
    one = next(k for k in larger if degraded(runs[k.replace("pool600/", "")].summary))
    some = dict(to_twin, **{one: one.replace("pool600/", "")})
    assert 0 < sum(degraded(runs[v].summary) for v in some.values()) < collapsed("2x-4min/")
    assert verdict(some) == REPRODUCED
    assert verdict(to_twin) == NOT_REPRODUCED


def test_the_no_cache_pairs_are_judged_pair_by_pair(tmp_path: Path) -> None:
    """The paper: "both arms of all four pairs end with the same small backlog". Swapping the burst arms between
    two pairs with different backlogs keeps every arm in the range (nocache.prop_unfinished still reproduces) but
    breaks the pairs: nocache.prop_same must not reproduce."""
    from kvgate.experiments.base import Context
    from kvgate.experiments.common import unfinished

    e, runs = _quick_records("no-cache", tmp_path)
    arms = {k: unfinished(r.summary) for k, r in runs.items() if k.startswith("prop/")}
    seeds = sorted({k.split("/")[1] for k in arms})
    a, b = seeds[0], seeds[1]
    assert abs(arms[f"prop/{a}/twin"] - arms[f"prop/{b}/twin"]) > 1, "the quick pairs' backlogs must differ"
    swap = {f"prop/{a}/trigger": f"prop/{b}/trigger", f"prop/{b}/trigger": f"prop/{a}/trigger"}
    got = {c.id: c.verdict for c in e.evaluate(Context(runs, tmp_path, True, draw=False)).claims}
    assert got["nocache.prop_same"] == REPRODUCED
    mutated = {k: runs[swap.get(k, k)] for k in runs}
    got = {c.id: c.verdict for c in e.evaluate(Context(mutated, tmp_path, True, draw=False)).claims}
    assert got["nocache.prop_unfinished"] == REPRODUCED and got["nocache.prop_same"] == NOT_REPRODUCED
