"""Run experiments (resumably, in parallel across cores) and write their pages and the index."""

from __future__ import annotations

import html
import json
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvgate import __version__
from kvgate.errors import UsageError
from kvgate.experiments.base import Context, Experiment, Result, load_runs
from kvgate.experiments.catalog import EXPERIMENTS
from kvgate.experiments.verdicts import CALIBRATED, DIFFERS, NOT_REPRODUCED, REPRODUCED, VERDICTS
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
    (d / "index.md").write_text(_markdown(page))
    (d / "index.html").write_text(_html(page))
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


def _md_cell(x: str) -> str:
    return str(x).replace("|", "\\|").replace("\n", " ")


def _markdown(p: dict[str, Any]) -> str:
    own = p.get("group") == "fleet"
    lines = [f"# {p['title']} ({p['section']})", "", f"Setup: {p['setup']}.", ""]
    if own:
        lines += [
            "*kvgate's own claims (the paper studied one replica): each judged by a rule that can fail, counted "
            'apart from the paper\'s claims. The "expected by" column says whose expectation a claim is.*',
            "",
        ]
    if p["quick"] and p["runs"]:
        lines += [
            "*Quick version: fewer seeds and shorter runs than the "
            + ("full version" if own else "paper")
            + "; claims that need the full sample size or run length are left out.*",
            "",
        ]
    claims = [c for c in p["claims"] if not c.get("baseline")]
    extra = [c for c in p["claims"] if c.get("baseline")]
    if claims:
        lines += [f"| claim | {'expected by' if own else 'paper'} | kvgate | verdict | rule |", "|---|---|---|---|---|"]
        for c in claims:
            v = f"**{c['verdict']}**" + (f" ({_md_cell(c['note'])})" if c["note"] else "")
            lines.append(f"| {_md_cell(c['claim'])} | {_md_cell(c['paper'])} | {_md_cell(c['kvgate'])} | {v} | "
                         f"{_md_cell(c.get('rule', ''))} |")
        lines.append("")
    if extra:
        shown = "Baselines and context" if own else "Not claims of the paper"
        lines += [
            f"{shown} (shown, never counted):",
            "",
            "| result | kvgate | note |",
            "|---|---|---|",
        ]
        for c in extra:
            lines.append(f"| {_md_cell(c['claim'])} | {_md_cell(c['kvgate'])} | {_md_cell(c['note'])} |")
        lines.append("")
    for t in p["tables"]:
        lines += ["```", t, "```", ""]
    for cap, path in p["figures"]:
        lines += [f"![{cap}]({path})", "", f"*{cap}*", ""]
    lines.append(f"{p['runs']} simulated runs; kvgate {p['kvgate_version']}.")
    return "\n".join(lines) + "\n"


_CSS = """body{font-family:system-ui,sans-serif;max-width:980px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;width:100%;margin:1em 0}td,th{border:1px solid #ccc;padding:.35em .5em;
vertical-align:top;font-size:.92em}th{background:#f3f3f3;text-align:left}.reproduced{color:#176c2b;font-weight:600}
.differs{color:#9a6200;font-weight:600}.not-reproduced{color:#b3261e;font-weight:600}.calibrated{color:#4a6a8a;font-weight:600}img{max-width:100%;
border:1px solid #ddd}pre{background:#f7f7f7;padding:.6em;overflow-x:auto}figure{margin:1.2em 0}"""


def _vclass(v: str) -> str:
    return v.replace(" ", "-")


def _html(p: dict[str, Any]) -> str:
    e = html.escape
    rows = "".join(
        f"<tr><td>{e(c['claim'])}</td><td>{e(c['paper'])}</td><td>{e(c['kvgate'])}</td>"
        f"<td class='{_vclass(c['verdict'])}'>{e(c['verdict'])}{(' — ' + e(c['note'])) if c['note'] else ''}</td>"
        f"<td><small>{e(c.get('rule', ''))}</small></td></tr>"
        for c in p["claims"]
        if not c.get("baseline")
    )
    extra = "".join(
        f"<tr><td>{e(c['claim'])}</td><td>{e(c['kvgate'])}</td><td>{e(c['note'])}</td></tr>"
        for c in p["claims"]
        if c.get("baseline")
    )
    table = (
        (
            f"<table><tr><th>claim</th><th>{'expected by' if p.get('group') == 'fleet' else 'paper'}</th>"
            f"<th>kvgate</th><th>verdict</th><th>rule</th></tr>{rows}</table>"
        )
        if rows
        else ""
    )
    if extra:
        table += (
            f"<p>{'Baselines and context' if p.get('group') == 'fleet' else 'Not claims of the paper'} (shown, never "
            "counted):</p><table><tr><th>result</th><th>kvgate</th>"
            f"<th>note</th></tr>{extra}</table>"
        )
    tables = "".join(f"<pre>{e(t)}</pre>" for t in p["tables"])
    figs = "".join(
        f"<figure><img src='{e(path)}' alt='{e(cap)}'><figcaption>{e(cap)}</figcaption></figure>"
        for cap, path in p["figures"]
    )
    quick = "<p><em>Quick version: fewer seeds and shorter runs.</em></p>" if p["quick"] and p["runs"] else ""
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{e(p['title'])} — kvgate</title>"
        f"<style>{_CSS}</style></head><body><p><a href='../index.html'>← all experiments</a></p>"
        f"<h1>{e(p['title'])} <small>({e(p['section'])})</small></h1><p>Setup: {e(p['setup'])}.</p>{quick}"
        f"{table}{tables}{figs}<p>{p['runs']} simulated runs; kvgate {e(p['kvgate_version'])}.</p></body></html>\n"
    )


OTHER_PAGES = (
    ("real-vllm", "The paper's phenomenon on a real vLLM (CPU build)", "kvgate experiment real-vllm"),
    ("real-sglang", "The paper's phenomenon on a real SGLang (CPU engine)", "kvgate experiment real-sglang"),
    ("real-vllm-heldout", "Held-out accuracy of the simulator against a real vLLM (CPU build)",
     "kvgate real-vllm heldout"),
    ("phase-map", "Phase map: λ × trigger size, with the drain and healthy-side bounds", "kvgate phase-map"),
    ("escape", "Escape times of the healthy regime", "kvgate escape"),
    ("engine-alternatives", "Engine-side alternatives: do they move the threshold?", "kvgate engine-alternatives"),
    ("retries", "Agent timeouts and retries", "kvgate paired --client-timeout 60 --client-retries 2"),
)
"""Pages under docs/results that other commands write; the index links those present."""


def write_index(out: Path, results: dict[str, dict[str, Any]], quick: bool) -> None:
    """Index of every experiment present under ``out`` (not only those just run): the paper's claims by
    experiment with the four verdicts, the baselines not in the paper, the analyses, and a closing note with the
    counts and, for every claim that differs or is not reproduced, its cause as far as it is known."""
    pages = {}
    for d in sorted(out.iterdir()) if out.exists() else []:
        r = d / "result.json"
        if r.exists():
            pages[d.name] = json.loads(r.read_text())
    pages.update(results)
    order = [n for n in EXPERIMENTS if n in pages]
    paper = [n for n in order if group_of(n, pages[n]) == "paper"]
    fleet = [n for n in order if group_of(n, pages[n]) == "fleet"]
    analyses = [n for n in order if group_of(n, pages[n]) == "analysis"]
    e = html.escape
    q = " (quick versions)" if quick else ""
    cols = [REPRODUCED, DIFFERS, NOT_REPRODUCED, CALIBRATED]
    md = [f"# kvgate reproduces the paper{q}", "",
          "Each row of the paper's Table 1, simulated; every claim of the paper is a row on its experiment's page, "
          "with the paper's numbers beside kvgate's and the rule that judged it. *calibrated*: the paper's figure "
          "set (or is a target of) a calibrated constant -- shown, never counted as reproduced.", "",
          "| experiment | section | " + " | ".join(cols) + " |", "|---|---|---|---|---|---|"]
    rows = []
    tot = {c: 0 for c in cols}
    for n in paper:
        p = pages[n]
        v = p["verdicts"]
        for c in cols:
            tot[c] += v.get(c, 0)
        md.append(f"| [{p['title']}]({n}/index.md) | {p['section']} | " + " | ".join(str(v.get(c, 0)) for c in cols)
                  + " |")
        rows.append(f"<tr><td><a href='{n}/index.html'>{e(p['title'])}</a></td><td>{e(p['section'])}</td>"
                    + "".join(f"<td class='{_vclass(c)}'>{v.get(c, 0)}</td>" for c in cols) + "</tr>")
    md.append("| **all** | | " + " | ".join(f"**{tot[c]}**" for c in cols) + " |")
    rows.append("<tr><th>all</th><th></th>" + "".join(f"<th>{tot[c]}</th>" for c in cols) + "</tr>")
    base = [(n, c) for n in paper for c in pages[n]["claims"] if c.get("baseline")]
    md += ["", "## Baselines not in the paper", "", "Shown for comparison; never counted among the paper's claims.", ""]
    bhtml = ""
    if base:
        md += ["| experiment | baseline | kvgate |", "|---|---|---|"]
        md += [f"| [{pages[n]['title']}]({n}/index.md) | {_md_cell(c['claim'])} | {_md_cell(c['kvgate'])} |"
               for n, c in base]
        bhtml = "".join(f"<tr><td><a href='{n}/index.html'>{e(pages[n]['title'])}</a></td><td>{e(c['claim'])}</td>"
                        f"<td>{e(c['kvgate'])}</td></tr>" for n, c in base)
    else:
        md.append("(none in this set of experiments)")
    ftot = {c: 0 for c in cols}
    fhtml = ""
    if fleet:
        md += ["", "## kvgate's own claims: a fleet", "",
               "The paper studied one replica. These experiments put its phenomenon and its controls on a fleet of "
               "replicas behind a router; each claim is kvgate's expectation (or an operator's report), judged by "
               "the same rules, and counted here only -- never among the paper's claims above.", "",
               "| experiment | section | " + " | ".join(cols) + " |", "|---|---|---|---|---|---|"]
        for n in fleet:
            v = pages[n]["verdicts"]
            for c in cols:
                ftot[c] += v.get(c, 0)
            md.append(f"| [{pages[n]['title']}]({n}/index.md) | {pages[n]['section']} | "
                      + " | ".join(str(v.get(c, 0)) for c in cols) + " |")
            cells = "".join(f"<td class='{_vclass(c)}'>{v.get(c, 0)}</td>" for c in cols)
            fhtml += (f"<tr><td><a href='{n}/index.html'>{e(pages[n]['title'])}</a></td>"
                      f"<td>{e(pages[n]['section'])}</td>{cells}</tr>")
        md.append("| **all** | | " + " | ".join(f"**{ftot[c]}**" for c in cols) + " |")
        fhtml = ("<h2>kvgate's own claims: a fleet</h2><p>The paper studied one replica; these claims "
                 "are kvgate's expectations, counted here only.</p><table><tr><th>experiment</th><th>section</th>"
                 + "".join(f"<th>{c}</th>" for c in cols) + f"</tr>{fhtml}<tr><th>all</th><th></th>"
                 + "".join(f"<th>{ftot[c]}</th>" for c in cols) + "</tr></table>")
    ahtml = ""
    if analyses:
        md += ["", "## Analyses (not claims of the paper)", ""]
        for n in analyses:
            md.append(f"- [{pages[n]['title']}]({n}/index.md): {pages[n]['setup']}")
            ahtml += f"<li><a href='{n}/index.html'>{e(pages[n]['title'])}</a>: {e(pages[n]['setup'])}</li>"
    others = [(d, title, cmd) for d, title, cmd in OTHER_PAGES if (out / d / "index.md").exists()]
    if others:
        md += ["", "## Other pages (made by their own commands, not by reproduce)", ""]
        for d, title, cmd in others:
            md.append(f"- [{title}]({d}/index.md) — `{cmd}`")
            ahtml += f"<li><a href='{d}/index.md'>{e(title)}</a> — <code>{e(cmd)}</code></li>"
    off = [(n, c) for n in paper for c in pages[n]["claims"]
           if not c.get("baseline") and c["verdict"] in (DIFFERS, NOT_REPRODUCED)]
    note = (
        f"Of {sum(tot.values())} claims: {tot[REPRODUCED]} reproduced, {tot[DIFFERS]} differ, "
        f"{tot[NOT_REPRODUCED]} not reproduced, {tot[CALIBRATED]} calibrated (not counted)."
    )
    if fleet:
        note += (
            f" Apart from them, kvgate's own fleet claims: of {sum(ftot.values())}, {ftot[REPRODUCED]} reproduced, "
            f"{ftot[DIFFERS]} differ, {ftot[NOT_REPRODUCED]} not reproduced."
        )
    foff = [(n, c) for n in fleet for c in pages[n]["claims"]
            if not c.get("baseline") and c["verdict"] in (DIFFERS, NOT_REPRODUCED)]
    md += ["", "## Closing note", "", note, ""]
    if off:
        md += [
            "Every claim that differs or is not reproduced, with what kvgate found (causes are discussed in "
            "[docs/experiments.md](../experiments.md)):",
            "",
        ]
        md += [
            f"- *{c['verdict']}* — {pages[n]['title']}: {_md_cell(c['claim'])} (paper {_md_cell(c['paper'])}; "
            f"kvgate {_md_cell(c['kvgate'])}){': ' + _md_cell(c['note']) if c['note'] else ''}"
            for n, c in off
        ]
    if foff:
        md += ([""] if off else []) + ["kvgate's own fleet claims that differ or are not reproduced:", ""]
        md += [
            f"- *{c['verdict']}* — {pages[n]['title']}: {_md_cell(c['claim'])} ("
            f"{_md_cell(c['paper'])}; kvgate {_md_cell(c['kvgate'])}){': ' + _md_cell(c['note']) if c['note'] else ''}"
            for n, c in foff
        ]
    ohtml = "".join(f"<li><em>{e(c['verdict'])}</em> — {e(pages[n]['title'])}: {e(c['claim'])} (paper "
                    f"{e(c['paper'])}; kvgate {e(c['kvgate'])}){': ' + e(c['note']) if c['note'] else ''}</li>"
                    for n, c in off + foff)
    (out / "index.md").write_text("\n".join(md) + "\n")
    (out / "index.html").write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>kvgate reproduction</title><style>{_CSS}</style>"
        f"</head><body><h1>kvgate reproduces the paper{q}</h1><p>Each row of the paper's Table 1, simulated. "
        f"Open an experiment for its claims, kvgate's results and figures. <em>calibrated</em>: the paper's figure "
        f"set a calibrated constant (shown, never counted).</p><table><tr><th>experiment</th><th>section</th>"
        + "".join(f"<th>{c}</th>" for c in cols)
        + f"</tr>{''.join(rows)}</table>"
        f"<h2>Baselines not in the paper</h2><table><tr><th>experiment</th><th>baseline</th><th>kvgate</th></tr>"
        f"{bhtml}</table>{fhtml}<h2>Analyses (not claims of the paper)</h2><ul>{ahtml}</ul>"
        f"<h2>Closing note</h2><p>{e(note)}</p><ul>{ohtml}</ul></body></html>\n"
    )


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
