"""The comparison's pages, from the run directories alone (``compare.json`` + the driver's records).

Per row (design x replicas x engine) a table with one line per stack and arm: runs, persistently degraded runs,
hit ratio of the last 10 minutes, sessions in the system at the end, turn latency p50/p90/p99 (virtual seconds,
held time included), throughput of the last 10 minutes, and each system's own count of what it held. Then whether
every competitor acted in its burst arms, the configurations used, and the commands that made the page.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np

from kvgate.analysis import metrics as m
from kvgate.compare.plan import DESIGNS, PLANS
from kvgate.compare.stacks import STACKS
from kvgate.page import Block, Bullets, Code, Details, Em, Heading, Image, Page, Para, Pre, Span, Strong, Table

DEGRADED = m.DEGRADED_HIT


def load(out: Path, kept: Path | None = None, plan_name: str = "full") -> list[dict[str, Any]]:
    """Every finished run under ``out`` with its measures; with ``kept`` (a page's ``result.json``), also the runs
    recorded there whose directories are not under ``out``, as recorded (marked ``"kept": True``)."""
    runs = []
    for path in sorted(out.glob("*/*/compare.json")):
        info = json.loads(path.read_text())
        refresh(info, path.parent)
        info["measures"] = measures(info, path.parent)
        runs.append(info)
    have = {r["key"] for r in runs}
    runs += [r for r in recorded(kept, plan_name) if r["key"] not in have]
    return sorted(runs, key=lambda r: r["key"])


def recorded(result: Path | None, plan_name: str = "full") -> list[dict[str, Any]]:
    """The runs a page's ``result.json`` holds, in the shape :func:`load` gives (``run`` from the key, as the plan
    ``plan_name`` has it, when an older page did not keep it); [] when there is no such file."""
    if result is None or not result.exists():
        return []
    by_key = {r.key: r for r in PLANS[plan_name].runs()}
    out = []
    for row in json.loads(result.read_text()):
        run = row.get("run") or (by_key[row["key"]].__dict__ if row["key"] in by_key else None)
        if run is None:
            continue  # a run of a plan that no longer exists
        out.append({**row, "run": run, "summary": {"lag_p99_ms": row.get("lag_p99_ms")},
                    "config": row.get("config") or {}, "kept": True})
    return out


def recorded_keys(pages: Path | None, plan_name: str = "full") -> set[str]:
    """The keys of the plan's runs recorded on the page in ``pages`` (they count as done)."""
    return {r["key"] for r in recorded(pages / "result.json" if pages is not None else None, plan_name)}


def refresh(info: dict[str, Any], rdir: Path) -> None:
    """Re-read what the competitors logged (so a page made later counts with the current parsers)."""
    from kvgate.compare import diag

    dg = info.setdefault("diagnostics", {})
    log = rdir / "logs" / "vllm-router.log"
    if "vllm_router" in dg and log.exists():
        dg["vllm_router"]["events"] = diag.router_log_events(log)
    log = rdir / "logs" / "frontend.log"
    if "thunderagent" in dg and log.exists():
        dg["thunderagent"] = diag.thunderagent_log(log)


def measures(info: dict[str, Any], rdir: Path) -> dict[str, Any]:
    """What the page shows of one run, computed from its records."""
    from kvgate.records import load_run

    r = load_run(rdir / "drive")
    s = info["summary"]
    end = float(r.meta.get("stopped_at_s") or info["run"]["minutes"] * 60.0)
    t = r.turns
    ok = (t["status"] == "ok") if "status" in t else np.ones(len(t["end_s"]), bool)
    lat = (t["end_s"] - t["submit_s"])[ok]
    d = DESIGNS[info["run"]["design"]]
    out: dict[str, Any] = {
        "hit_last10": s.get("hit_ratio_last10"),
        "in_system_end": s.get("sessions_in_system_last5"),
        "turns_per_s": s.get("turns_per_s_last10"),
        "lat": [float(np.percentile(lat, q)) if len(lat) else math.nan for q in (50, 90, 99)],
        "errors": s.get("turns_error", 0),
        "degraded": bool(s.get("persistently_degraded")),
        "recovery_min": None,
    }
    if d.burst and d.control_at is None and d.fail_at is None and not d.real:
        # the paired design: both arms judged on the same windows, aligned at the burst's end (the paper's rule;
        # the simulator's twins keep their trigger's alignment the same way). A twin judged from minute 0 would
        # take a dip in its first windows as its "first degraded window" and miss a collapse that came later.
        from kvgate.workload.triggers import trigger_end_min

        align = 60.0 * float(trigger_end_min({"bursts": [d.burst]}) or 0.0)
        out["degraded"] = bool(m.persistent_degradation(t, r.samples, align, end)[0])
    if d.control_at is not None:
        on = info.get("switched_at_s") or d.control_at * 60.0
        out["recovery_min"] = m.recovery_time(t, float(on), end)
        out["hit_before_control"] = m.hit_ratio(t, float(on) - m.WINDOW_S, float(on))
    if d.real:
        # five minutes hold no complete 5-minute window after the burst: the real-vLLM experiment's own rule,
        # every minute from minute 3 below 0.5 (kvgate experiment real-vllm, regime)
        from kvgate.realvllm.experiment import FULL as REAL
        from kvgate.realvllm.experiment import per_minute, regime

        state, mean = regime(per_minute(rdir / "drive", d.minutes), REAL)
        out["degraded"] = state == "degraded"
        out["regime"] = state
        out["hit_last10"] = mean
    failed = info.get("failed_at_s")
    if d.fail_at is not None:
        align = float(failed) if failed is not None else d.fail_at * 60.0
        out["degraded"] = bool(m.persistent_degradation(t, r.samples, align, end)[0])
        out["hit_after_fail"] = m.hit_ratio(t, align, end)
        out["survivors"] = survivors(info.get("polls") or [], end)
    return out


def survivors(polls: list[dict[str, Any]], end_s: float, last_s: float = 600.0) -> list[float | None]:
    """Each replica's hit ratio over the last ``last_s`` virtual seconds, from its own counters (None: down)."""
    series = [p for p in polls if p.get("engines")]
    if not series:
        return []
    n = len(series[0]["engines"])
    first = next((p for p in series if p["t_s"] >= end_s - last_s), series[0])
    final = series[-1]
    out: list[float | None] = []
    for i in range(n):
        a, b = first["engines"][i], final["engines"][i]
        if a is None or b is None or b[1] <= a[1]:
            out.append(None)
        else:
            out.append((b[0] - a[0]) / (b[1] - a[1]))
    return out


def held(info: dict[str, Any]) -> str:
    """The system's own count of what it held in this run."""
    dg = info.get("diagnostics") or {}
    parts = []
    if "vllm_router" in dg and STACKS[info["run"]["stack"]].program_scheduling:
        v = dg["vllm_router"]
        ev = v.get("events") or {}
        parts.append(f"vllm-router: held ≤{v['max_queued_requests']} requests, paused ≤{v['max_paused_programs']} "
                     f"programs; {ev.get('program_pause', 0)} pauses ({ev.get('program_pause:capacity_repair', 0)} "
                     f"capacity repairs), {ev.get('program_admit:forced', 0)} forced admissions"
                     + (f"; its token ledger ≤{v['max_ledger_tokens']:,}" if v.get("max_ledger_tokens") else ""))
    if "thunderagent" in dg:
        ta = dg["thunderagent"]
        parts.append(f"ThunderAgent: held ≤{ta['max_waiting_requests']} requests, paused ≤{ta['max_paused_programs']} "
                     f"programs; {ta['forced_resumes']} forced resumes")
    if "kvgate" in dg:
        parts.append(f"kvgate: parked {dg['kvgate']['turns_parked']} turns")
    return "; ".join(parts) or "—"


def acted(info: dict[str, Any]) -> bool | None:
    """Did the run's controlling system hold anything (None: nobody controls this stack)?"""
    dg = info.get("diagnostics") or {}
    who = STACKS[info["run"]["stack"]].acts
    if who == "vllm-router":
        v = dg.get("vllm_router") or {}
        return bool(v.get("max_queued_requests") or (v.get("events") or {}).get("program_pause"))
    if who == "dynamo":
        ta = dg.get("thunderagent") or {}
        return bool(ta.get("max_waiting_requests") or ta.get("max_paused_programs"))
    if who == "kvgate":
        return bool((dg.get("kvgate") or {}).get("turns_parked"))
    return None


def _rng(xs: list[float], nd: int = 2) -> str:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    if not xs:
        return "–"
    lo, hi = min(xs), max(xs)
    a, b = f"{lo:.{nd}f}", f"{hi:.{nd}f}"
    return a if a == b else f"{a}–{b}"


def _med(xs: list[float]) -> str:
    xs = [x for x in xs if x is not None and not math.isnan(x)]
    return f"{float(np.median(xs)):.1f}" if xs else "–"


def row_table(runs: list[dict[str, Any]]) -> Table:
    fail = DESIGNS[runs[0]["run"]["design"]].fail_at is not None
    head = ["stack", "arm", "runs", "persistently degraded", "hit, last 10 min", "sessions in system (end)",
            "turn latency p50 / p90 / p99 (s, median over runs)", "turns/s, last 10 min",
            *(["survivors collapsed"] if fail else []), "held (its own count, per run)"]
    rows: list[list[Span]] = []
    groups: dict[tuple[str, str], list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        groups[(r["run"]["stack"], r["run"]["arm"])].append(r)
    order = list(STACKS)
    for (stack, arm), rs in sorted(groups.items(), key=lambda kv: (order.index(kv[0][0]), kv[0][1])):
        ms = [r["measures"] for r in rs]
        lat = " / ".join(_med([x["lat"][i] for x in ms]) for i in range(3))
        degraded = Strong(f"{sum(x['degraded'] for x in ms)} of {len(rs)}")
        row: list[Span] = [STACKS[stack].title, arm, str(len(rs)), degraded,
                           _rng([x["hit_last10"] for x in ms]), _rng([x["in_system_end"] for x in ms], 0), lat,
                           _rng([x["turns_per_s"] for x in ms])]
        if fail:
            surv = [h for x in ms for h in (x.get("survivors") or [])[1:]]
            bad = sum(1 for h in surv if h is not None and h < DEGRADED)
            row.append(f"{bad} of {len(surv)}")
        row.append("<br>".join(f"s{r['run']['seed']}: {held(r)}" for r in rs))
        rows.append(row)
    return Table(head, rows)


def figure(rs: list[dict[str, Any]], out: Path, pages: Path, title: str) -> Image | None:
    """The row's first seed, every stack's arm that counts, as Figure 1 draws it; the image that shows it."""
    from kvgate.analysis.figures import figure_timeseries
    from kvgate.records import load_run

    seed = min(r["run"]["seed"] for r in rs)
    pick = [r for r in rs if r["run"]["seed"] == seed and r["run"]["arm"] != "twin"]
    d = DESIGNS[pick[0]["run"]["design"]]
    name = f"{pick[0]['run']['design']}-r{pick[0]['run']['replicas']}-{STACKS[pick[0]['run']['stack']].engine}"
    md = Image(f"figures/{name}.png", f"{title}, seed {seed}")
    here = [r for r in pick if not r.get("kept")]
    if len(here) < len(pick) and (pages / "figures" / f"{name}.png").exists():
        return md  # some records are not at hand: the figure drawn from them
    if not here:
        return None
    pick = here  # (else the stacks whose records are at hand)
    shade = []
    if d.burst:
        start, dur = d.burst.split("@")[1].split("+")
        shade = [(float(start), float(start) + float(dur))]
    mark = d.fail_at if d.fail_at is not None else d.control_at
    figure_timeseries([load_run(out / r["key"] / "drive") for r in pick],
                      [STACKS[r["run"]["stack"]].title for r in pick], pages / "figures" / name,
                      title=f"{title} (seed {seed})", shade=shade, vline=mark)
    return md


def page(out: Path, plan_name: str, pages: Path | None, notes: tuple[str, ...], runs: list[dict[str, Any]]) -> str:
    """The page's Markdown, of ``runs`` (:func:`load`'s)."""
    plan = PLANS[plan_name]
    blocks: list[Block] = []
    kept = sum(1 for r in runs if r.get("kept"))
    if kept:
        notes = (*notes, f"{kept} of the {len(runs)} runs are as this page recorded them before (its result.json); "
                 "their run directories were not at hand when it was rewritten, so their measures were not "
                 "recomputed and their figures are the ones drawn then.")
    notes = (*plan.notes, *notes)
    if notes:  # one paragraph, a line each
        blocks.append(Para(tuple(x for i, n in enumerate(notes) for x in ((Em(n),) if i == 0 else ("\n", Em(n))))))
    rows: dict[tuple[str, int, str], list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        rows[(r["run"]["design"], r["run"]["replicas"], STACKS[r["run"]["stack"]].engine)].append(r)
    for (design, reps, engine), rs in rows.items():
        blocks += row_blocks(design, reps, engine, rs, out, pages)
    blocks += acting_section(runs) + configs_section(runs) + made_by(runs, plan_name, commands(out, pages))
    return Page(f"kvgate beside vllm-router and Dynamo's ThunderAgent ({plan_name})", blocks).markdown()


def row_blocks(design: str, reps: int, engine: str, rs: list[dict[str, Any]], out: Path,
               pages: Path | None) -> list[Block]:
    """One row of the page (design x replicas x engine): its load, table, lags, verdicts, figure, recovery."""
    d = DESIGNS[design]
    minutes, lam = rs[0]["run"]["minutes"], DESIGNS[design].lam_per_replica * reps
    load = (f"λ = {lam:g}/s, {minutes:g} min, time scale ×{rs[0]['time_scale']:g}"
            + (f", burst {d.burst}" if d.burst else "")
            + (f", control at minute {d.control_at:g}" if d.control_at is not None else "")
            + (f", replica 0 killed at minute {d.fail_at:g}" if d.fail_at is not None else "") + ".")
    blocks: list[Block] = [Heading(f"{d.title}: {reps} × {engine}"), Para(load), row_table(rs), *lag_line(rs)]
    if d.real:
        blocks.append(Para(Em(("The real vLLM's five minutes hold no complete 5-minute window after the burst: "
                               "here \"persistently degraded\" is ", Code("kvgate experiment real-vllm"),
                               "'s rule (every minute from minute 3 below 0.5) and the hit column is the mean of "
                               "minutes 3–5."))))
    blocks += side_by_side(rs)
    if pages is not None and (fig := figure(rs, out, pages, f"{d.title}, {reps} × {engine}")):
        blocks.append(fig)
    if d.control_at is not None:
        rec = [f"{STACKS[r['run']['stack']].title} s{r['run']['seed']}: {_recovery(r['measures'])}" for r in rs]
        blocks += [Para("Recovery (from the control minute; the uncontrolled engine from the same minute): "
                        + "; ".join(rec) + "."), Para(RECOVERY_NOTE)]
    return blocks


def commands(out: Path | None, pages: Path | None = None) -> list[str]:
    """The run commands that made the page: those the page kept (``pages/commands.txt``), then those logged under
    ``out``, each once, in order."""
    cmds: list[str] = []
    for f in (pages / "commands.txt" if pages is not None else None, out / "commands.txt" if out is not None else None):
        if f is not None and f.exists():
            cmds += f.read_text().splitlines()
    return list(dict.fromkeys(c for c in cmds if c.strip()))


def lag_line(runs: list[dict[str, Any]]) -> list[Block]:
    """Under a row's table: how far each stack's kvgate engines fell behind their clocks (a loaded machine shows
    there first, and a stack whose engines lag is served slower than the cost model says)."""
    by: dict[str, list[float]] = defaultdict(list)
    n: dict[str, int] = defaultdict(int)
    for r in runs:
        n[r["run"]["stack"]] += 1
        if (x := engine_lag(r)) is not None:
            by[r["run"]["stack"]].append(x)
    if not by:
        return []
    order = list(STACKS)
    parts = [f"{STACKS[s].title} {_rng(v, 2)} s ({len(v)} of {n[s]} runs)" for s, v in sorted(by.items(),
             key=lambda kv: order.index(kv[0]))]
    return [Para(Em("How far the kvgate engines fell behind their virtual clocks (p99 of the engine that lagged "
                    "most, per run; real s; of the runs that recorded it): " + "; ".join(parts) + "."))]


def engine_lag(run: dict[str, Any]) -> float | None:
    """The run's largest p99 lag of a kvgate engine behind its virtual clock (real s; None: no such engine, or not
    recorded): an engine that falls behind serves its turns later than its cost model says."""
    if "engine_lag_p99_s" in run:
        return run["engine_lag_p99_s"]
    lags = [e["lag_p99_s"] for e in run.get("engine_lag") or [] if e]
    return max(lags) if lags else None


def made_by(runs: list[dict[str, Any]], plan_name: str, cmds: list[str]) -> list[Block]:
    from kvgate import __version__

    if not cmds:
        cmds = [f"kvgate compare run --plan {plan_name} --out runs/compare-{plan_name}"]

    loads = [r.get("loadavg_end") for r in runs if r.get("loadavg_end") is not None]
    lags = [r["summary"].get("lag_p99_ms") for r in runs if r["summary"].get("lag_p99_ms") is not None]
    some = f" (the {len(lags)} runs that recorded it)" if len(lags) < len(runs) else ""
    eng = [x for r in runs if (x := engine_lag(r)) is not None]
    eng_text = (f"; each kvgate engine's lag behind its virtual clock p99 {_rng(eng, 2)} s (real, the largest per run, "
                f"{len(eng)} runs)") if eng else ""
    wall = sum(r.get("wall_s", 0.0) for r in runs) / 60.0
    return [
        Heading("How this page was made"),
        Pre("\n".join(["bash .ci/install-competitors.sh", *cmds,
                       f"kvgate compare report OUT --plan {plan_name} --pages PAGES"])),
        Para("(the run commands as given, in order: a run already done is kept, so each command ran only what was "
             "not)"),
        Para(f"{len(runs)} runs, {wall:.0f} minutes of wall time; kvgate {__version__}, vllm-router 0.1.17, "
        "Dynamo 1.6.1. "
        f"Load average at the end of the runs {_rng(loads, 1)} on 2 cores; the driver's schedule lag p99 "
        f"{_rng(lags, 0)} ms (real){some}{eng_text}. What the stacks are and how their timers are scaled: "
        "docs/compare.md."),
    ]


RECOVERY_NOTE = (
    "How each control is switched on: kvgate's gateway runs uncontrolled and starts its budgeter at the minute "
    "(`--control-at`). vllm-router has no runtime switch for program scheduling: it starts without it and is "
    "restarted at the minute with it, on the same port (it keeps no state the engine needs; the turns in flight "
    "through it are cut and the driver resends them). Dynamo's ThunderAgent is a start-up option of the frontend "
    "as well, but a frontend restart takes ~10 s of real time (five virtual minutes at x30) and drops the "
    "router's KV index, an outage larger than the burst: not run."
)


def side_by_side(runs: list[dict[str, Any]]) -> list[Block]:
    """Each competitor against the row's uncontrolled baseline and kvgate, in the arm that counts (burst or
    failure): the statement a reader needs, computed, so it can come out either way."""
    arm = "fail" if DESIGNS[runs[0]["run"]["design"]].fail_at is not None else "burst"
    by: dict[str, list[dict[str, Any]]] = defaultdict(list)
    twins: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in runs:
        if r["run"]["arm"] == arm:
            by[r["run"]["stack"]].append(r["measures"])
        elif r["run"]["arm"] == "twin":
            twins[r["run"]["stack"]].append(r["measures"])

    def deg(stack: str) -> tuple[int, int]:
        return sum(x["degraded"] for x in by[stack]), len(by[stack])

    def base_text(b: str) -> str:
        t = twins.get(b)
        twin = f" (its twin without the {'failure' if arm == 'fail' else 'burst'}: " \
               f"{sum(x['degraded'] for x in t)} of {len(t)})" if t else ""
        return f"; {STACKS[b].title}: {deg(b)[0]} of {deg(b)[1]}{twin}"

    def p90(stack: str) -> float:
        return float(np.median([x["lat"][1] for x in by[stack]]))

    base = [s for s in by if not STACKS[s].acts]
    ours = [s for s in by if STACKS[s].acts == "kvgate"]
    out: list[Span] = []
    for s in by:
        if STACKS[s].acts in ("", "kvgate"):
            continue
        d, n = deg(s)
        text = f": persistently degraded in {d} of {n}"
        text += "".join(base_text(b) for b in base)
        for k in ours:
            kd, kn = deg(k)
            verdict = "as well as or better than" if d / n <= kd / kn else "worse than"
            text += (f"; {STACKS[k].title}: {kd} of {kn} (the competitor {verdict} it on collapse, turn latency "
                     f"p90 {p90(s):.1f} s against its {p90(k):.1f} s)")
        out.append((Strong(STACKS[s].title), text + "."))
    return [Bullets(out)] if out else []


def _recovery(ms: dict[str, Any]) -> str:
    """Whether the run was collapsed when the control came on (hit ratio of the 5 minutes before), and after."""
    before = ms.get("hit_before_control")
    state = "" if before is None or math.isnan(before) else (
        f"{'collapsed' if before < DEGRADED else 'not collapsed'} at the control minute (hit {before:.2f}), ")
    t = ms.get("recovery_min")
    return state + ("not recovered" if t is None else f"recovered in {t:.0f} min")


def acting_section(runs: list[dict[str, Any]]) -> list[Block]:
    by: dict[str, list[bool]] = defaultdict(list)
    for r in runs:
        a = acted(r)
        if a is not None and r["run"]["arm"] in ("burst", "fail"):
            by[r["run"]["stack"]].append(a)
    items: list[Span] = [f"{STACKS[stack].title}: held or paused in {sum(flags)} of {len(flags)} burst/failure runs."
                         for stack, flags in by.items()]
    return [Heading("Did each competitor act?"), *([Bullets(items)] if items else [])]


def configs_section(runs: list[dict[str, Any]]) -> list[Block]:
    blocks: list[Block] = [Heading("Configurations")]
    seen: set[str] = set()
    for r in runs:
        key = f"{r['run']['stack']}-r{r['run']['replicas']}"
        if key in seen or not r.get("config"):
            continue
        seen.add(key)
        body = [f"{k}: {_shown(v)}" for k, v in r["config"].items()]
        body.append("drive: kvgate " + " ".join(str(a) for a in r.get("drive_argv") or []))
        blocks.append(Details(f"{STACKS[r['run']['stack']].title}, {r['run']['replicas']} replica(s)",
                              [Pre("\n".join(body))]))
    return blocks


def _shown(v: Any) -> str:
    """A configuration value on one line: a command line as the shell has it, anything else as compact JSON."""
    if isinstance(v, list) and all(isinstance(x, str) for x in v):
        return " ".join(x if x and " " not in x else json.dumps(x) for x in v)
    if isinstance(v, str):
        return v
    return json.dumps(v, separators=(", ", ": "))


def write_pages(out: Path, pages: Path, plan_name: str, notes: tuple[str, ...] = ()) -> list[Path]:
    """``index.md``, ``result.json`` (every run the page shows, with what the page needs of it, so a later
    rewrite keeps runs whose directories are gone) and ``commands.txt`` in ``pages``."""
    pages.mkdir(parents=True, exist_ok=True)
    res = pages / "result.json"
    runs = load(out, res, plan_name)
    cmds = commands(out, pages)
    p = pages / "index.md"
    p.write_text(page(out, plan_name, pages, notes, runs))
    rows = [{"key": r["key"], "run": r["run"], "measures": r["measures"], "diagnostics": r.get("diagnostics"),
             "wall_s": r.get("wall_s"), "time_scale": r.get("time_scale"), "loadavg_end": r.get("loadavg_end"),
             "lag_p99_ms": (r.get("summary") or {}).get("lag_p99_ms"), "engine_lag_p99_s": engine_lag(r),
             "config": r.get("config") or {},
             "drive_argv": r.get("drive_argv")} for r in runs]
    res.write_text(json.dumps(rows, indent=1, sort_keys=True, default=str) + "\n")
    (pages / "commands.txt").write_text("".join(c + "\n" for c in cmds))
    return [p, res]
