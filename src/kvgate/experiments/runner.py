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
from kvgate.experiments.base import NOT_REPRODUCED, REPRODUCED, Context, Experiment, Result, load_runs
from kvgate.experiments.catalog import EXPERIMENTS
from kvgate.sim.batch import run_many


def get(name: str) -> Experiment:
    try:
        return EXPERIMENTS[name]
    except KeyError:
        raise UsageError(f"unknown experiment {name!r}; choose from {', '.join(EXPERIMENTS)}") from None


def run_experiments(
    names: Sequence[str], out: Path, *, quick: bool, jobs: int | None = None, progress: bool = True,
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


def _tally(res: Result) -> dict[str, int]:
    t: dict[str, int] = {}
    for c in res.claims:
        t[c.verdict] = t.get(c.verdict, 0) + 1
    return t


def _markdown(p: dict[str, Any]) -> str:
    lines = [f"# {p['title']} ({p['section']})", "", f"Setup: {p['setup']}.", ""]
    if p["quick"]:
        lines += ["*Quick version: fewer seeds and shorter runs than the paper.*", ""]
    lines += ["| claim | paper | kvgate | verdict |", "|---|---|---|---|"]
    for c in p["claims"]:
        v = c["verdict"] + (f" ({c['note']})" if c["note"] else "")
        lines.append(f"| {c['claim']} | {c['paper']} | {c['kvgate']} | {v} |")
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
.differs{color:#9a6200;font-weight:600}.not-reproduced{color:#b3261e;font-weight:600}img{max-width:100%;
border:1px solid #ddd}pre{background:#f7f7f7;padding:.6em;overflow-x:auto}figure{margin:1.2em 0}"""


def _vclass(v: str) -> str:
    return v.replace(" ", "-")


def _html(p: dict[str, Any]) -> str:
    e = html.escape
    rows = "".join(
        f"<tr><td>{e(c['claim'])}</td><td>{e(c['paper'])}</td><td>{e(c['kvgate'])}</td>"
        f"<td class='{_vclass(c['verdict'])}'>{e(c['verdict'])}{(' — ' + e(c['note'])) if c['note'] else ''}</td></tr>"
        for c in p["claims"]
    )
    tables = "".join(f"<pre>{e(t)}</pre>" for t in p["tables"])
    figs = "".join(
        f"<figure><img src='{e(path)}' alt='{e(cap)}'><figcaption>{e(cap)}</figcaption></figure>"
        for cap, path in p["figures"]
    )
    quick = "<p><em>Quick version: fewer seeds and shorter runs than the paper.</em></p>" if p["quick"] else ""
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>{e(p['title'])} — kvgate</title>"
        f"<style>{_CSS}</style></head><body><p><a href='../index.html'>← all experiments</a></p>"
        f"<h1>{e(p['title'])} <small>({e(p['section'])})</small></h1><p>Setup: {e(p['setup'])}.</p>{quick}"
        f"<table><tr><th>claim</th><th>paper</th><th>kvgate</th><th>verdict</th></tr>{rows}</table>"
        f"{tables}{figs}<p>{p['runs']} simulated runs; kvgate {e(p['kvgate_version'])}.</p></body></html>\n"
    )


def write_index(out: Path, results: dict[str, dict[str, Any]], quick: bool) -> None:
    """Index of every experiment present under ``out`` (not only those just run)."""
    pages = {}
    for d in sorted(out.iterdir()) if out.exists() else []:
        r = d / "result.json"
        if r.exists():
            pages[d.name] = json.loads(r.read_text())
    pages.update(results)
    order = [n for n in EXPERIMENTS if n in pages]
    e = html.escape
    md = ["# kvgate reproduces the paper", "",
          "Each row of the paper's Table 1, simulated; claims and verdicts on each experiment's page.", "",
          "| experiment | section | reproduced | differs | not reproduced |", "|---|---|---|---|---|"]  # fmt: skip
    rows = []
    for n in order:
        p = pages[n]
        v = p["verdicts"]
        md.append(f"| [{p['title']}]({n}/index.md) | {p['section']} | {v.get(REPRODUCED, 0)} | "
                  f"{v.get('differs', 0)} | {v.get(NOT_REPRODUCED, 0)} |")  # fmt: skip
        rows.append(
            f"<tr><td><a href='{n}/index.html'>{e(p['title'])}</a></td><td>{e(p['section'])}</td>"
            f"<td class='reproduced'>{v.get(REPRODUCED, 0)}</td><td class='differs'>{v.get('differs', 0)}</td>"
            f"<td class='not-reproduced'>{v.get(NOT_REPRODUCED, 0)}</td></tr>"
        )
    q = " (quick versions)" if quick else ""
    (out / "index.md").write_text("\n".join(md) + "\n")
    (out / "index.html").write_text(
        f"<!doctype html><html><head><meta charset='utf-8'><title>kvgate reproduction</title><style>{_CSS}</style>"
        f"</head><body><h1>kvgate reproduces the paper{q}</h1><p>Each row of the paper's Table 1, simulated. "
        f"Open an experiment for its claims, kvgate's results and figures.</p><table><tr><th>experiment</th>"
        f"<th>section</th><th>reproduced</th><th>differs</th><th>not reproduced</th></tr>{''.join(rows)}</table>"
        f"</body></html>\n"
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
