"""Findings counted once: every claim of the paper has one kind, a consequence or duplicate comes down to a finding,
and the index counts findings by verdict and nothing else."""

from __future__ import annotations

import pytest

from kvgate.experiments.claims import PAPER_CLAIMS
from kvgate.experiments.findings import (
    CALIBRATED,
    CONSEQUENCE,
    FINDING,
    KIND_OF,
    UNTESTABLE,
    load_kinds,
    root,
    tally,
)
from kvgate.experiments.verdicts import Calibrated, Figure, Holds


def test_every_claim_of_the_paper_has_one_kind() -> None:
    assert set(KIND_OF) == set(PAPER_CLAIMS)
    for cid, rule in PAPER_CLAIMS.items():
        assert (KIND_OF[cid].kind == CALIBRATED) == isinstance(rule, Calibrated), cid
        if KIND_OF[cid].kind not in (FINDING, CALIBRATED):
            assert KIND_OF[cid].why, f"{cid}: a row that is not a finding says why"


def test_a_consequence_comes_down_to_a_finding_or_a_calibrated_row() -> None:
    for cid, k in KIND_OF.items():
        if k.of:
            assert KIND_OF[root(cid)].kind in (FINDING, CALIBRATED), cid
            assert root(cid).split(".")[0] != "" and root(cid) != cid


def test_the_rows_a_strict_reading_found_vacuous_are_not_counted_as_findings() -> None:
    """The seed-4242 reading (docs/results/strict-reading.md): each follows from the row it names."""
    follows = {"anatomy.kv_usage": "paired.degraded_backlog", "anatomy.running": "paired.degraded_backlog",
               "r32b.none_sessions": "r32b.none", "sg.paired_burst": "sg.large_collapses",
               "nocache.peak": "nocache.throughput", "nocache.drains": "nocache.throughput",
               "nocache.at_twin": "nocache.throughput", "nocache.prop_same": "nocache.throughput"}
    for cid, of in follows.items():
        assert KIND_OF[cid].kind != FINDING and KIND_OF[cid].of == of, cid
    assert KIND_OF["nocache.throughput"].kind == CALIBRATED


def test_the_rows_the_reading_on_the_fitted_mixed_step_found_are_not_counted_as_findings() -> None:
    """The seed-4244 reading: the capacity fraction divides by a figure the joint fit targets (in-sample), and a
    degraded run's end backlog follows from its selection and the fitted degraded throughput (vacuous)."""
    assert KIND_OF["paired.lam_fraction"].kind == CALIBRATED
    assert isinstance(PAPER_CLAIMS["paired.lam_fraction"], Calibrated)
    assert KIND_OF["paired.degraded_backlog"].kind == CONSEQUENCE
    assert root("paired.degraded_backlog") == root("anatomy.kv_usage") == "paired.only_burst"
    assert KIND_OF["paired.healthy_side"].of == "paired.lam_fraction"


CLAIMS = {"a.x": Holds("x", "yes"), "a.y": Holds("y", "yes"), "a.c": Calibrated("c", "1"),
          "a.z": Figure("z", "1", lo=1, hi=1)}


@pytest.mark.parametrize(("text", "msg"), [
    ('[finding]\nids = ["a.x", "a.y"]\n', "a.z has no kind"),
    ('[finding]\nids = ["a.x", "a.y", "a.z", "a.x"]\n', "listed twice"),
    ('[finding]\nids = ["a.x", "a.y", "a.z", "a.c"]\n', "calibrated"),
    ('[finding]\nids = ["a.x", "a.y", "a.z", "b.q"]\n', "not a claim"),
    ('[finding]\nids = ["a.x", "a.y"]\n[setup]\n"a.z" = "input"\n[consequence]\n', ""),
    ('[finding]\nids = ["a.x"]\n[setup]\n"a.z" = "input"\n[consequence]\n"a.y" = { of = "a.z", why = "w" }\n',
     "not a finding"),
    ('[finding]\nids = ["a.x", "a.z"]\n[duplicate]\n"a.y" = { of = "a.c", why = "w" }\n', "not a finding"),
])
def test_a_kinds_file_that_leaves_out_repeats_or_points_wrong_is_refused(text: str, msg: str) -> None:
    if not msg:
        assert load_kinds(text, CLAIMS)["a.z"].kind == "setup"
        return
    with pytest.raises(ValueError, match=msg):
        load_kinds(text, CLAIMS)


def test_a_consequence_may_follow_from_a_calibrated_row() -> None:
    k = load_kinds('[finding]\nids = ["a.x", "a.z"]\n[consequence]\n"a.y" = { of = "a.c", why = "w" }\n', CLAIMS)
    assert k["a.y"].kind == CONSEQUENCE and k["a.c"].kind == CALIBRATED


def test_the_index_counts_findings_by_verdict_and_other_rows_by_kind() -> None:
    finding = next(c for c, k in KIND_OF.items() if k.kind == FINDING)
    conseq = next(c for c, k in KIND_OF.items() if k.kind == CONSEQUENCE)
    untest = next(c for c, k in KIND_OF.items() if k.kind == UNTESTABLE)
    page = {"claims": [
        {"id": finding, "verdict": "reproduced"},
        {"id": conseq, "verdict": "reproduced"},
        {"id": untest, "verdict": "not reproduced"},
        {"id": "", "verdict": "shown", "baseline": True},
    ]}
    t = tally(["e"], {"e": page})["e"]
    assert t[FINDING] == 1 and t["reproduced"] == 1 and t["not reproduced"] == 0
    assert t[CONSEQUENCE] == 1 and t[UNTESTABLE] == 1
