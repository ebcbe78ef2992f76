"""kvgate's own fleet claims: counted apart from the paper's, and each one can come out "not reproduced".

The mutation test feeds every fleet experiment's evaluation records in which kvgate's expectation holds (every
claim reproduced: the records are well-formed), then, claim by claim, records that contradict that one claim (a
kvgate router that leaves a replica degraded, a sticky router that does not, a premise that fails, a budget that
recovers nothing...), and requires that claim not to be reproduced. The records are built by hand (each run's
fleet summary, the one thing the evaluations read), so the test runs no simulation.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvgate.experiments.base import Context, Experiment
from kvgate.experiments.catalog import EXPERIMENTS, FLEET_EXPERIMENTS, PAPER_EXPERIMENTS
from kvgate.experiments.claims import FLEET_CLAIMS, PAPER_CLAIMS
from kvgate.experiments.fleet import FAILED, OPERATORS, REPLICAS
from kvgate.experiments.runner import write_index
from kvgate.experiments.verdicts import NOT_REPRODUCED, REPRODUCED, Calibrated
from kvgate.records import Run

Spec = dict[str, Any]


def fake_run(spec: Spec) -> Run:
    """A fleet run whose summary says what ``spec`` says: ``deg`` (replicas persistently degraded), ``alone_deg``
    (a one-replica run that degraded), ``long`` (long sessions per replica), ``rec`` (per replica: collapsed at
    control, recovered, recovery minutes, hit ratio), ``turns`` (turns done)."""
    deg = set(spec.get("deg", ()))
    rec = spec.get("rec")
    rows = []
    for r in range(REPLICAS):
        row: dict[str, Any] = {"replica": r, "persistently_degraded": r in deg,
                               "hit_ratio_last10": 0.1 if r in deg else 0.94}
        if rec is not None:
            col, ok, minutes, hit = rec
            row.update(collapsed_at_control=col, recovered=ok, recovery_min=minutes if ok else None,
                       hit_ratio_last10=hit)
        rows.append(row)
    hit = 0.3 if deg else 0.94
    fleet = {"replicas_degraded": len(deg), "parked_turns": 0, "parked_sessions": 0, "park_wait_p50_min": None,
             "park_wait_p90_min": None, "park_wait_max_min": None, "sessions_unfinished": 10}
    fs = {"replicas": rows, "fleet": fleet, "hit_ratio_all": hit, "hit_ratio_last10": hit,
          "sessions_in_system_last5": 20.0, "turns_done": spec.get("turns", 14_000)}
    long = spec.get("long", [10] * REPLICAS)
    source = np.array([x for n in long for x in ["paper-shift/long"] * n + ["paper-shift/short"]], dtype=object)
    replica = np.array([r for r, n in enumerate(long) for _ in range(n + 1)])
    turns = {"end_s": np.array([1500.0]), "cached_tokens": np.array([1000.0 * hit]),
             "prompt_tokens": np.array([1000]), "status": np.array(["ok"], dtype=object)}
    meta = {"config": {}, "summary": {"persistently_degraded": bool(spec.get("alone_deg"))}, "_fleet": fs}
    sessions = {"source": source, "replica": replica}
    if "wait" in spec:  # fleet-tenants: one turn of tenant B's after the burst's start, waiting ``wait`` s
        turns.update(session=np.array([1]), submit_s=np.array([1000.0]), park_wait_s=np.array([spec["wait"]]))
        sessions.update(session=np.array([1]), tenant=np.array(["B"], dtype=object))
    return Run(None, meta, turns, sessions, {})


def _seed(rid: str) -> int:
    return int(rid.rsplit("seed-", 1)[1])


# What each run looks like where kvgate's expectation holds, and under the mutation ``mut`` (a claim id).
def burst_spec(rid: str, mut: str) -> Spec:
    arm = rid.split("/")[-2]
    if arm == "kvgate":
        return {"deg": [0] if mut == "fleet_burst.kvgate" else []}
    if arm in ("round-robin", "consistent-hash") and not rid.startswith("twin/"):
        if mut == f"fleet_burst.{arm.replace('-', '_')}":
            return {}
        return {"deg": [1]}
    return {}


def failure_spec(rid: str, mut: str) -> Spec:
    arm = rid.split("/")[-2]
    if rid.startswith("alone/"):
        return {"alone_deg": _seed(rid) == 701 and mut != "fleet_failure.premise"}
    if rid.startswith("nofail/"):
        return {}
    if arm == "kvgate":
        return {"deg": [FAILED + 1] if mut == "fleet_failure.kvgate" else []}
    if arm in OPERATORS and mut != "fleet_failure.others":
        return {"deg": [FAILED + 1]}
    return {}


def thrash_spec(rid: str, mut: str) -> Spec:
    arm = rid.split("/")[-2]
    if rid.startswith("alone/"):
        return {"alone_deg": mut == "fleet_thrash.premise"}
    if arm == "kvgate":
        return {"deg": [0] if mut == "fleet_thrash.kvgate" else []}
    if arm == "consistent-hash":
        if mut == "fleet_thrash.spiral":
            return {}
        long = [5, 2, 5, 5] if mut == "fleet_thrash.concentration" else [5, 9, 5, 5]
        return {"deg": [1], "long": long}
    return {}


def prevention_spec(rid: str, mut: str) -> Spec:
    trigger, arm = rid.split("/")[:2]
    s = _seed(rid)
    if trigger == "twin":
        return {}
    if trigger == "healthy":
        tp = 14_000 + 150 * s
        return {"turns": tp // 2 if arm == "budgeter" and mut == "fleet_prevention.tput" else tp}
    if arm == "none":
        return {} if mut == "fleet_prevention.premise" else {"deg": [0]}
    return {"deg": [2]} if mut in (f"fleet_prevention.{trigger}", f"fleet_prevention.{trigger}_vs_none") else {}


def recovery_spec(rid: str, mut: str) -> Spec:
    arm = rid.split("/")[0]
    collapsed = mut != "fleet_recovery.premise"
    if arm == "none":
        return {"rec": (collapsed, mut == "fleet_recovery.none", 0.0, 0.94 if mut == "fleet_recovery.none" else 0.1)}
    if mut == "fleet_recovery.budgeter":
        return {"rec": (True, False, None, 0.1)}
    minutes = 15.0 if mut == "fleet_recovery.time" else 0.0
    return {"rec": (True, True, minutes, 0.3 if mut == "fleet_recovery.hit" else 0.94)}


def tenants_spec(rid: str, mut: str) -> Spec:
    arm, seed, kind = rid.split("/")
    if kind == "twin":
        return {"wait": 0.0}
    if arm == "fair":
        return {"wait": 5.0 if mut == "fleet_tenants.fair" and seed == "seed-501" else 0.5}
    return {"wait": 0.5 if mut == "fleet_tenants.fifo" else 5.0}


SPECS: dict[str, Callable[[str, str], Spec]] = {
    "fleet-burst": burst_spec,
    "fleet-failure": failure_spec,
    "fleet-thrash": thrash_spec,
    "fleet-prevention": prevention_spec,
    "fleet-recovery": recovery_spec,
    "fleet-tenants": tenants_spec,
}


def verdicts(e: Experiment, mut: str, tmp_path: Path) -> dict[str, str]:
    runs = {rid: fake_run(SPECS[e.name](rid, mut)) for rid, _ in e.plan(False)}
    return {c.id: c.verdict for c in e.evaluate(Context(runs, tmp_path, False, draw=False)).claims if not c.baseline}


def test_every_fleet_experiment_has_records_for_the_mutation_test() -> None:
    assert sorted(SPECS) == sorted(e.name for e in FLEET_EXPERIMENTS)


@pytest.mark.parametrize("name", sorted(SPECS))
def test_records_as_kvgate_expects_reproduce_every_claim(name: str, tmp_path: Path) -> None:
    got = verdicts(EXPERIMENTS[name], "", tmp_path)
    assert got and all(v == REPRODUCED for v in got.values()), got
    assert set(got) == {c for c in FLEET_CLAIMS if c.startswith(name.replace("-", "_") + ".")}


@pytest.mark.parametrize("cid", sorted(FLEET_CLAIMS))
def test_a_contradicting_observation_is_not_reproduced(cid: str, tmp_path: Path) -> None:
    name = cid.split(".")[0].replace("_", "-")
    got = verdicts(EXPERIMENTS[name], cid, tmp_path)
    assert got[cid] == NOT_REPRODUCED, got


@pytest.mark.parametrize("cid", sorted(FLEET_CLAIMS))
def test_every_fleet_rule_rejects_its_contradiction(cid: str) -> None:
    rule = FLEET_CLAIMS[cid]
    assert not isinstance(rule, Calibrated)
    assert rule.judge(rule.contradiction())[0] == NOT_REPRODUCED


def test_fleet_claims_are_not_the_papers() -> None:
    assert FLEET_CLAIMS and not FLEET_CLAIMS.keys() & PAPER_CLAIMS.keys()
    assert all("paper" not in c.split(".")[0] for c in FLEET_CLAIMS)
    assert {e.group for e in FLEET_EXPERIMENTS} == {"fleet"} and {e.group for e in PAPER_EXPERIMENTS} == {"paper"}
    assert len(PAPER_EXPERIMENTS) == 13  # the paper's Table 1


def _page(name: str, group: str, verdict: str) -> dict[str, Any]:
    claim = {"claim": f"{name} claim", "paper": "p", "kvgate": "k", "verdict": verdict, "note": "", "id": "x",
             "rule": "r", "baseline": False, "extra": {}}
    t = {"reproduced": 0, "differs": 0, "not reproduced": 0, "calibrated": 0}
    t[verdict] += 1
    return {"name": name, "title": name, "section": "s", "analysis": False, "group": group, "setup": "x",
            "quick": True, "runs": 1, "claims": [claim], "figures": [], "tables": [], "verdicts": t}


def test_the_index_counts_fleet_claims_apart_from_the_papers(tmp_path: Path) -> None:
    pages = {"flush": _page("flush", "paper", "reproduced"),
             "fleet-burst": _page("fleet-burst", "fleet", "not reproduced")}
    for n, p in pages.items():
        (tmp_path / n).mkdir()
        (tmp_path / n / "result.json").write_text(json.dumps(p))
    write_index(tmp_path, {}, quick=True)
    md = (tmp_path / "index.md").read_text()
    paper, own = md.split("## kvgate's own claims")
    assert "Of 1 claims: 1 reproduced, 0 differ, 0 not reproduced" in md  # the fleet's failure is not the paper's
    assert "fleet-burst/index.md" not in paper and "fleet-burst/index.md" in own
    assert "of 1, 0 reproduced, 0 differ, 1 not reproduced" in md
    assert "*not reproduced* — fleet-burst" in own
