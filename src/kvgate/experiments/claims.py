"""Every claim of the paper that kvgate checks, once, with the paper's numbers and the rule that judges it; and,
apart from them, kvgate's own claims about a fleet (the paper studied one replica).

The claims are declared as data beside the experiment that judges them: ``experiments/<module>.toml`` for
``experiments/<module>.py``. The paper's are in ``sec*.toml`` (:data:`PAPER_CLAIMS`), kvgate's own in
``fleet*.toml`` (:data:`FLEET_CLAIMS`: their ``paper`` key says whose expectation the claim is); the two sets are
counted apart everywhere. Ids are ``experiment.claim`` (a TOML table ``[experiment.claim]``). A table names
its rule by the key that holds the claim's text (``figure``, ``count``, ``holds``, ``prevents``, ``twin_effect``,
``calibrated``: the rules of :mod:`kvgate.experiments.verdicts`), then ``paper`` (the paper's figure as printed)
and the rule's numbers; ``qual = "degraded"`` or ``"healthy"`` stands for the bands below. Tolerances are stated
there and nowhere else; they are set from the paper's own ranges (and how its figures are rounded), never from
kvgate's results. ``cause`` holds what is known about why kvgate differs where it does (``same_cause_as = ID``
where one explanation covers several claims); a cause is printed only beside a verdict other than "reproduced".
``population = ID`` marks a claim judged on a subset of runs (the runs collapsed when control began, the seeds
collapsed in every arm): ID is the row that holds kvgate's subset against the paper's, a count, so a row that is
"reproduced" on another population of runs than the paper's says so on its own page.
"""

from __future__ import annotations

import tomllib
from importlib.resources import files
from typing import Any

from kvgate.experiments.verdicts import Calibrated, Count, Figure, Holds, Prevents, Rule, TwinEffect

HIT_DEGRADED = (0.0, 0.35)
"""Where a degraded-regime hit ratio still means "near the shared prompt" (qualitative band)."""
HIT_HEALTHY = (0.85, 1.0)
"""Where a healthy-regime hit ratio still means "cache-efficient"."""
BANDS = {"degraded": HIT_DEGRADED, "healthy": HIT_HEALTHY}

RULES: dict[str, type[Rule]] = {
    "figure": Figure,
    "count": Count,
    "holds": Holds,
    "prevents": Prevents,
    "twin_effect": TwinEffect,
    "calibrated": Calibrated,
}
"""The key that holds a claim's text, by the rule that judges it."""


def parse_rule(cid: str, spec: dict[str, Any]) -> Rule:
    """One claim's table to its rule."""
    kinds = [k for k in spec if k in RULES]
    if len(kinds) != 1:
        raise ValueError(f"claim {cid}: expected exactly one of {', '.join(RULES)} (the claim's text)")
    kind = kinds[0]
    numbers = {k: v for k, v in spec.items() if k not in (kind, "paper", "cause", "same_cause_as", "population")}
    if "qual" in numbers:
        q = numbers["qual"]
        numbers["qual"] = BANDS[q] if isinstance(q, str) else tuple(q)
    return RULES[kind](spec[kind], spec["paper"], **numbers)


POPULATIONS: dict[str, str] = {}
"""For a claim judged on a subset of runs, the id of the row that counts that subset against the paper's."""


def load_claims(prefix: str) -> tuple[dict[str, Rule], dict[str, str]]:
    """The claims of every ``PREFIX*.toml`` file of this package, and their known causes, by claim id (their
    populations go to :data:`POPULATIONS`)."""
    rules: dict[str, Rule] = {}
    causes: dict[str, str] = {}
    same: dict[str, str] = {}
    for f in sorted(
        (p for p in files("kvgate.experiments").iterdir() if p.name.startswith(prefix) and p.name.endswith(".toml")),
        key=lambda p: p.name,
    ):
        for experiment, table in tomllib.loads(f.read_text(encoding="utf-8")).items():
            for name, spec in table.items():
                cid = f"{experiment}.{name}"
                if cid in rules:
                    raise ValueError(f"duplicate claim id {cid} ({f.name})")
                rules[cid] = parse_rule(cid, spec)
                if "cause" in spec:
                    causes[cid] = spec["cause"]
                if "same_cause_as" in spec:
                    same[cid] = spec["same_cause_as"]
                if "population" in spec:
                    POPULATIONS[cid] = spec["population"]
    for cid, other in same.items():
        causes[cid] = causes[other]
    return rules, causes


PAPER_CLAIMS, CAUSES = load_claims("sec")
"""``CAUSES``: known or suspected cause of a difference, by claim id (docs/experiments.md has the discussion)."""
FLEET_CLAIMS, FLEET_CAUSES = load_claims("fleet")
"""kvgate's own claims about a fleet, never counted among the paper's."""
if PAPER_CLAIMS.keys() & FLEET_CLAIMS.keys():
    raise ValueError(f"claim ids both the paper's and kvgate's: {sorted(PAPER_CLAIMS.keys() & FLEET_CLAIMS.keys())}")
ALL_CLAIMS: dict[str, Rule] = {**PAPER_CLAIMS, **FLEET_CLAIMS}


def cause(cid: str) -> str:
    return CAUSES.get(cid) or FLEET_CAUSES.get(cid, "")
