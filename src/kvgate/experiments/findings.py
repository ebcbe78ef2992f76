"""What each of the paper's claims is (``findings.toml``): an independent finding, a consequence or a duplicate of
another row, a statistic of the setup, or untestable here — so that the index counts each finding of the paper once,
and leaves out of its denominator what cannot be observed in kvgate. Calibrated rows are marked by their rule."""

from __future__ import annotations

import tomllib
from collections.abc import Callable
from dataclasses import dataclass
from importlib.resources import files
from typing import Any

from kvgate.experiments.claims import PAPER_CLAIMS
from kvgate.experiments.verdicts import CALIBRATED, DIFFERS, NOT_REPRODUCED, REPRODUCED, Calibrated
from kvgate.page import Block, Bullets, Cell, Code, Heading, Para, Span, Strong, Table

FINDING, CONSEQUENCE, DUPLICATE, SETUP, UNTESTABLE = "finding", "consequence", "duplicate", "setup", "untestable"
KINDS = (FINDING, CONSEQUENCE, DUPLICATE, SETUP, UNTESTABLE, CALIBRATED)


@dataclass(frozen=True, slots=True)
class Kind:
    kind: str
    of: str = ""
    """The row this one follows from or repeats (consequence, duplicate)."""
    why: str = ""


def load_kinds(text: str, claims: dict[str, object]) -> dict[str, Kind]:
    """Every claim id of ``claims`` to its :class:`Kind`; raises ValueError where ``text`` leaves one out, lists one
    twice, names an unknown id, or points ``of`` at a row that is not itself a finding or a consequence (a
    consequence may also follow from a calibrated row)."""
    d = tomllib.loads(text)
    out: dict[str, Kind] = {}

    def put(cid: str, k: Kind) -> None:
        if cid in out:
            raise ValueError(f"findings.toml: {cid} is listed twice")
        if cid not in claims:
            raise ValueError(f"findings.toml: {cid} is not a claim of the paper")
        out[cid] = k

    for cid in d.get(FINDING, {}).get("ids", []):
        put(cid, Kind(FINDING))
    for kind in (CONSEQUENCE, DUPLICATE):
        for cid, spec in d.get(kind, {}).items():
            put(cid, Kind(kind, spec["of"], spec["why"]))
    for kind in (SETUP, UNTESTABLE):
        for cid, why in d.get(kind, {}).items():
            put(cid, Kind(kind, "", why))
    for cid, rule in claims.items():
        if isinstance(rule, Calibrated):
            if cid in out:
                raise ValueError(f"findings.toml: {cid} is calibrated (its rule says so); leave it out")
            out[cid] = Kind(CALIBRATED)
        elif cid not in out:
            raise ValueError(f"findings.toml: {cid} has no kind")
    for cid, k in out.items():
        # a consequence may follow from a calibrated row (a value the fitted constant implies); a duplicate repeats
        # an observation, so it must repeat a finding's
        roots = (FINDING, CONSEQUENCE, DUPLICATE) + ((CALIBRATED,) if k.kind == CONSEQUENCE else ())
        if k.of and (k.of not in out or out[k.of].kind not in roots):
            raise ValueError(f"findings.toml: {cid} follows {k.of!r}, which is not a finding of the paper "
                             "(or a row that comes down to one)")
    return out


KIND_OF = load_kinds(files("kvgate.experiments").joinpath("findings.toml").read_text(encoding="utf-8"), PAPER_CLAIMS)
"""The kind of every claim of the paper, by id."""


def root(cid: str) -> str:
    """The finding (or calibrated row) a consequence or a duplicate comes down to (itself for a finding)."""
    seen = {cid}
    while KIND_OF[cid].of:
        cid = KIND_OF[cid].of
        if cid in seen:
            raise ValueError(f"findings.toml: {cid} follows itself")
        seen.add(cid)
    return cid


def tally(names: list[str], pages: dict[str, dict[str, Any]]) -> dict[str, dict[str, int]]:
    """Per experiment: its independent findings by verdict, and its other rows by kind."""
    out: dict[str, dict[str, int]] = {}
    for n in names:
        t = {v: 0 for v in (REPRODUCED, DIFFERS, NOT_REPRODUCED)} | {k: 0 for k in KINDS}
        for c in pages[n]["claims"]:
            k = KIND_OF.get(c.get("id", ""))
            if c.get("baseline") or k is None:
                continue
            t[k.kind] += 1
            if k.kind == FINDING and c["verdict"] in t:
                t[c["verdict"]] += 1
        out[n] = t
    return out


def section(names: list[str], pages: dict[str, dict[str, Any]], link: Callable[[str], Span]) -> list[Block]:
    """The index's account of independent findings: a table by experiment, the total, and the untestable rows."""
    t = tally(names, pages)
    cols = [REPRODUCED, DIFFERS, NOT_REPRODUCED]
    other = [CONSEQUENCE, DUPLICATE, SETUP, UNTESTABLE]
    tot = {k: sum(r[k] for r in t.values()) for k in [FINDING, *cols, *other]}
    rows: list[list[Span | Cell]] = [
        [link(n), str(r[FINDING]), *(Cell(str(r[c]), c.replace(" ", "-")) for c in cols),
         *(str(r[k]) for k in other)] for n, r in t.items()]
    rows.append([Strong("all"), *(Strong(str(tot[k])) for k in [FINDING, *cols, *other])])
    share = f"{tot[REPRODUCED] / tot[FINDING]:.0%}" if tot[FINDING] else "—"
    blocks: list[Block] = [
        Heading("Findings counted once"),
        Para(("Rows are not independent: a hit ratio of runs selected as degraded follows from their selection, one "
              "observation can be judged twice, some rows are statistics of the input. Each row of the paper's is "
              "marked (", Code("experiments/findings.toml"), ", fixed by the paper's structure, not by verdicts): a "
              "finding, a consequence or duplicate of another row, a setup statistic, or untestable here (out of "
              "the denominator). Independent findings testable here, by verdict; the other rows by kind:")),
        Table(["experiment", "findings", *cols, *other], rows),
        Para((Strong(f"{tot[REPRODUCED]} of {tot[FINDING]} independent findings reproduced ({share})"),
              f"; {tot[DIFFERS]} differ, {tot[NOT_REPRODUCED]} not reproduced.")),
    ]
    untestable = [(Code(cid), f": {KIND_OF[cid].why}") for n in names for c in pages[n]["claims"]
                  if KIND_OF.get(cid := c.get("id", "")) is not None and KIND_OF[cid].kind == UNTESTABLE]
    if untestable:
        blocks += [Para("Untestable here, and why:"), Bullets(untestable)]
    return blocks
