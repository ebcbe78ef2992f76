"""Run experiments (resumably, in parallel across cores) and write their pages and the index."""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvgate import __version__
from kvgate.errors import UsageError
from kvgate.experiments import findings
from kvgate.experiments.base import Context, Experiment, Result, load_runs
from kvgate.experiments.catalog import EXPERIMENTS
from kvgate.experiments.verdicts import CALIBRATED, DIFFERS, NOT_REPRODUCED, REPRODUCED, VERDICTS
from kvgate.page import Block, Bullets, Cell, Code, Em, Figure, Heading, Link, Page, Para, Pre, Span, Strong, Table
from kvgate.sim.batch import run_many


def get(name: str) -> Experiment:
    try:
        return EXPERIMENTS[name]
    except KeyError:
        raise UsageError(f"unknown experiment {name!r}; choose from {', '.join(EXPERIMENTS)}") from None


def run_experiments(
    names: Sequence[str],
    out: Path,
    *,
    quick: bool,
    jobs: int | None = None,
    progress: bool = True,
    rerun: bool = True,
) -> dict[str, dict[str, Any]]:
    """Plan every experiment, run all their runs in one pool (skipping finished ones), then evaluate."""
    exps = [get(n) for n in names]
    plans = {e.name: e.plan(quick) for e in exps}
    if rerun:
        jobs_list = [(cfg, str(out / e / "runs" / rid)) for e, plan in plans.items() for rid, cfg in plan]
        run_many(jobs_list, jobs=jobs, progress=progress, label="experiment runs")
    results = {}
    for e in exps:
        results[e.name] = evaluate(e, out, [rid for rid, _ in plans[e.name]], quick)
    write_index(out, results, quick)
    return results


def evaluate(e: Experiment, out: Path, ids: list[str], quick: bool) -> dict[str, Any]:
    d = out / e.name
    missing = [i for i in ids if not (d / "runs" / i / "run.json").exists()]
    if missing:
        raise UsageError(f"{d}: {len(missing)} run(s) missing (e.g. {missing[0]}); run `kvgate experiment {e.name}`")
    fig_dir = d / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)
    ctx = Context(load_runs(d / "runs", ids), fig_dir, quick)
    t0 = time.perf_counter()
    res = e.evaluate(ctx)
    page = {
        "name": e.name,
        "title": e.title,
        "section": e.section,
        "analysis": e.group == "analysis",
        "group": e.group,
        "setup": e.setup,
        "quick": quick,
        "runs": len(ids),
        "claims": [c.__dict__ for c in res.claims],
        "figures": res.figures,
        "tables": res.tables,
        "verdicts": _tally(res),
        "eval_s": round(time.perf_counter() - t0, 2),
        "kvgate_version": __version__,
    }
    (d / "result.json").write_text(json.dumps(page, indent=2) + "\n")
    rendered = experiment_page(page)
    (d / "index.md").write_text(rendered.markdown())
    (d / "index.html").write_text(rendered.html())
    return page


def group_of(name: str, page: dict[str, Any]) -> str:
    """An experiment's group by the registry (a page written before groups existed only says if it is an
    analysis)."""
    if name in EXPERIMENTS:
        return EXPERIMENTS[name].group
    return str(page.get("group") or ("analysis" if page.get("analysis") else "paper"))


def _tally(res: Result) -> dict[str, int]:
    t: dict[str, int] = {v: 0 for v in VERDICTS}
    for c in res.claims:
        if not c.baseline:
            t[c.verdict] = t.get(c.verdict, 0) + 1
    return t


_CSS = """body{font-family:system-ui,sans-serif;max-width:980px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;width:100%;margin:1em 0}td,th{border:1px solid #ccc;padding:.35em .5em;
vertical-align:top;font-size:.92em}th{background:#f3f3f3;text-align:left}.reproduced{color:#176c2b;font-weight:600}
.differs{color:#9a6200;font-weight:600}.not-reproduced{color:#b3261e;font-weight:600}.calibrated{color:#4a6a8a;font-weight:600}img{max-width:100%;
border:1px solid #ddd}pre{background:#f7f7f7;padding:.6em;overflow-x:auto}figure{margin:1.2em 0}"""


def _verdict(v: str, note: str = "", bold: bool = False) -> Cell:
    """A verdict's cell, in its colour (with its note)."""
    text: Span = Strong(v) if bold else v
    return Cell((text, f" ({note})") if note else text, v.replace(" ", "-"))


def experiment_page(p: dict[str, Any]) -> Page:
    """An experiment's page, from its ``result.json``: its claims with their verdicts, the baselines, its tables
    and figures."""
    own = p.get("group") == "fleet"
    blocks: list[Block] = [Para(f"Setup: {p['setup']}.")]
    if own:
        blocks.append(Para(Em("kvgate's own claims (the paper studied one replica): each judged by a rule that can "
                              "fail, counted apart from the paper's claims. The \"expected by\" column says whose "
                              "expectation a claim is.")))
    if p["quick"] and p["runs"]:
        blocks.append(Para(Em("Quick version: fewer seeds and shorter runs than the "
                              + ("full version" if own else "paper")
                              + "; claims that need the full sample size or run length are left out.")))
    claims = [c for c in p["claims"] if not c.get("baseline")]
    extra = [c for c in p["claims"] if c.get("baseline")]
    if claims:
        blocks.append(Table(["claim", "expected by" if own else "paper", "kvgate", "verdict", "rule"], [
            [c["claim"], c["paper"], c["kvgate"], _verdict(c["verdict"], c["note"], bold=True), c.get("rule", "")]
            for c in claims]))
    if extra:
        shown = "Baselines and context" if own else "Not claims of the paper"
        blocks += [Para(f"{shown} (shown, never counted):"),
                   Table(["result", "kvgate", "note"], [[c["claim"], c["kvgate"], c["note"]] for c in extra])]
    blocks += [Pre(t) for t in p["tables"]]
    blocks += [Figure(path, cap) for cap, path in p["figures"]]
    blocks.append(Para(f"{p['runs']} simulated runs; kvgate {p['kvgate_version']}."))
    return Page(f"{p['title']} ({p['section']})", blocks, head=f"{p['title']} — kvgate", css=_CSS,
                back=Link("← all experiments", "../index.md", "../index.html"))


OTHER_PAGES = (
    ("real-vllm", "The paper's phenomenon on a real vLLM (CPU build)", "kvgate experiment real-vllm"),
    ("real-sglang", "The paper's phenomenon on a real SGLang (CPU engine)", "kvgate experiment real-sglang"),
    ("real-vllm-heldout", "Held-out accuracy of the simulator against a real vLLM (CPU build)",
     "kvgate real-vllm heldout"),
    ("phase-map", "Phase map: λ × trigger size, with the drain and healthy-side bounds", "kvgate phase-map"),
    ("escape", "Escape times of the healthy regime", "kvgate escape"),
    ("engine-alternatives", "Engine-side alternatives: do they move the threshold?", "kvgate engine-alternatives"),
    ("retries", "Agent timeouts and retries", "kvgate paired --client-timeout 60 --client-retries 2"),
    ("pool-shrink", "A pool that shrinks for five minutes: a trigger that outlasts itself",
     "kvgate paired --shrink-at TOKENS@S+D"),
    ("compare-quick", "kvgate beside vllm-router and Dynamo's ThunderAgent (quick plan)",
     "kvgate compare run --plan quick"),
    ("compare-full", "kvgate beside vllm-router and Dynamo's ThunderAgent (full plan)",
     "kvgate compare run --plan full"),
)
"""Pages under docs/results that other commands write; the index links those present."""
VERDICT_COLUMNS = [REPRODUCED, DIFFERS, NOT_REPRODUCED, CALIBRATED]


def _link(n: str, p: dict[str, Any]) -> Link:
    return Link(p["title"], f"{n}/index.md", f"{n}/index.html")


def _verdict_table(names: list[str], pages: dict[str, dict[str, Any]]) -> tuple[Table, dict[str, int]]:
    """Experiments by verdict counts, with a total row; and the totals."""
    cols = VERDICT_COLUMNS
    tot = {c: 0 for c in cols}
    rows: list[list[Span | Cell]] = []
    for n in names:
        v = pages[n]["verdicts"]
        for c in cols:
            tot[c] += v.get(c, 0)
        rows.append([_link(n, pages[n]), pages[n]["section"], *(Cell(str(v.get(c, 0)), c.replace(" ", "-"))
                                                                 for c in cols)])
    rows.append([Strong("all"), "", *(Strong(str(tot[c])) for c in cols)])
    return Table(["experiment", "section", *cols], rows), tot


def _off(names: list[str], pages: dict[str, dict[str, Any]], paper: str) -> list[Span]:
    """Every claim of ``names`` that differs or is not reproduced, with what kvgate found."""
    return [(Em(c["verdict"]), f" — {pages[n]['title']}: {c['claim']} ({paper}{c['paper']}; kvgate {c['kvgate']})"
             + (f": {c['note']}" if c["note"] else ""))
            for n in names for c in pages[n]["claims"]
            if not c.get("baseline") and c["verdict"] in (DIFFERS, NOT_REPRODUCED)]


def index_page(out: Path, pages: dict[str, dict[str, Any]], quick: bool) -> Page:
    """The index of every experiment in ``pages``: the paper's claims by experiment with the four verdicts, the
    baselines not in the paper, kvgate's own fleet claims, the analyses, the other pages present under ``out``, and
    a closing note with the counts and every claim that differs or is not reproduced."""
    order = [n for n in EXPERIMENTS if n in pages]
    paper = [n for n in order if group_of(n, pages[n]) == "paper"]
    fleet = [n for n in order if group_of(n, pages[n]) == "fleet"]
    analyses = [n for n in order if group_of(n, pages[n]) == "analysis"]
    table, tot = _verdict_table(paper, pages)
    blocks: list[Block] = [
        Para("Each row of the paper's Table 1, simulated; every claim of the paper is a row on its experiment's "
             "page, with the paper's numbers beside kvgate's and the rule that judged it. *calibrated*: the paper's "
             "figure set (or is a target of) a calibrated constant -- shown, never counted as reproduced."),
        table, Heading("Baselines not in the paper"),
        Para("Shown for comparison; never counted among the paper's claims.")]
    base = [(n, c) for n in paper for c in pages[n]["claims"] if c.get("baseline")]
    if base:
        blocks.append(Table(["experiment", "baseline", "kvgate"],
                            [[_link(n, pages[n]), c["claim"], c["kvgate"]] for n, c in base]))
    else:
        blocks.append(Para("(none in this set of experiments)"))
    ftot = {c: 0 for c in VERDICT_COLUMNS}
    if fleet:
        ftable, ftot = _verdict_table(fleet, pages)
        blocks += [Heading("kvgate's own claims: a fleet"),
                   Para("The paper studied one replica. These experiments put its phenomenon and its controls on a "
                        "fleet of replicas behind a router; each claim is kvgate's expectation (or an operator's "
                        "report), judged by the same rules, and counted here only -- never among the paper's claims "
                        "above."), ftable]
    if analyses:
        blocks += [Heading("Analyses (not claims of the paper)"),
                   Bullets([(_link(n, pages[n]), f": {pages[n]['setup']}") for n in analyses])]
    others = [(d, title, cmd) for d, title, cmd in OTHER_PAGES if (out / d / "index.md").exists()]
    if others:
        blocks += [Heading("Other pages (made by their own commands, not by reproduce)"),
                   Bullets([(Link(title, f"{d}/index.md"), " — ", Code(cmd)) for d, title, cmd in others])]
    note = (f"Of {sum(tot.values())} claims: {tot[REPRODUCED]} reproduced, {tot[DIFFERS]} differ, "
            f"{tot[NOT_REPRODUCED]} not reproduced, {tot[CALIBRATED]} calibrated (not counted).")
    ft = findings.tally(paper, pages).values()
    nf, nr = sum(t[findings.FINDING] for t in ft), sum(t[REPRODUCED] for t in ft)
    note += f" Counted once: {nr} of {nf} independent findings testable here reproduced."
    if fleet:
        note += (f" Apart from them, kvgate's own fleet claims: of {sum(ftot.values())}, {ftot[REPRODUCED]} "
                 f"reproduced, {ftot[DIFFERS]} differ, {ftot[NOT_REPRODUCED]} not reproduced.")
    blocks += findings.section(paper, pages, lambda n: _link(n, pages[n]))
    blocks += [Heading("Closing note"), Para(note)]
    off, foff = _off(paper, pages, "paper "), _off(fleet, pages, "")
    if off:
        blocks += [Para(("Every claim that differs or is not reproduced, with what kvgate found (causes are "
                         "discussed in ", Link("docs/experiments.md", "../experiments.md"), "):")), Bullets(off)]
    if foff:
        blocks += [Para("kvgate's own fleet claims that differ or are not reproduced:"), Bullets(foff)]
    q = " (quick versions)" if quick else ""
    return Page(f"kvgate reproduces the paper{q}", blocks, head="kvgate reproduction", css=_CSS)


def write_index(out: Path, results: dict[str, dict[str, Any]], quick: bool) -> None:
    """Index of every experiment present under ``out`` (not only those just run): :func:`index_page`, as
    ``index.md`` and ``index.html``."""
    pages = {}
    for d in sorted(out.iterdir()) if out.exists() else []:
        r = d / "result.json"
        if r.exists():
            pages[d.name] = json.loads(r.read_text())
    pages.update(results)
    page = index_page(out, pages, quick)
    (out / "index.md").write_text(page.markdown())
    (out / "index.html").write_text(page.html())


def report(out: Path) -> dict[str, dict[str, Any]]:
    """Rebuild pages and figures from existing records without running anything."""
    if not out.is_dir():
        raise UsageError(f"{out}: no such directory")
    results = {}
    quick = False
    for d in sorted(out.iterdir()):
        if d.name in EXPERIMENTS and (d / "runs").is_dir():
            prev = d / "result.json"
            quick = json.loads(prev.read_text()).get("quick", False) if prev.exists() else _guess_quick(d)
            e = EXPERIMENTS[d.name]
            results[d.name] = evaluate(e, out, [rid for rid, _ in e.plan(quick)], quick)
    if not results:
        raise UsageError(f"{out}: no experiment records found")
    write_index(out, results, quick)
    return results


def _guess_quick(d: Path) -> bool:
    e = EXPERIMENTS[d.name]
    full = {rid for rid, _ in e.plan(False)}
    have = {str(p.parent.relative_to(d / "runs")) for p in (d / "runs").rglob("run.json")}
    return not full <= have
