"""``kvgate real-vllm heldout``: how well the simulator predicts a real vLLM on runs it was not fitted to.

The engine profile (measured first on this machine, or one given with ``--profile``) is fitted by ``kvgate
calibrate --endpoint`` on micro-measurements (cold and incremental prefills, decode batches, mixed steps) and one
closed-loop c(L) load of all-miss requests. None of the runs here is among them: a matrix of closed-loop agent runs
on the real vLLM (the CPU build, the tiny model of ``realvllm/model.py``), each on a fresh server, over

    arrival rate lam  x  KV pool  x  session shape  x  trigger (none, a burst)

and beside each the simulator's prediction with the same workload, seed, pool, block size, step budget and
profile, never refitted. Per run, per metric, the error of the prediction:

* **E2E turn latency**: the run's mean of (last token - request sent) over its turns, relative error;
* **TTFT**: the run's mean of (first token - request sent), relative error;
* **throughput per minute**: turns completed per minute, mean absolute error relative to the real mean;
* **hit ratio per minute**: the token-weighted prefix hit ratio, mean and largest absolute error;
* **sessions in the system per minute**: mean absolute error relative to the real mean.

A run's hit ratio tests the eviction model only where the pool bound it: where no prefix was evicted before its
session's next turn, real and simulated hit ratios are both the workload's own (shared and appended tokens) and
agree by construction. So beside each prediction the simulator also plays the run on an unbounded pool (the
eviction-free hit ratio), and the page counts the runs whose real hit ratio departed from it by more than
``POOL_BOUND`` in some minute, with the largest hit-ratio error over those runs alone.

The page reports each run and the median over runs, beside BLIS's published held-out validation (36 experiments:
median E2E latency error 6.7%, TTFT 17.6%). Real runs on a shared machine are perturbed by its other load; every
run records the load average of each minute.
"""

from __future__ import annotations

import json
import math
import os
import statistics
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvgate.errors import UsageError
from kvgate.realvllm.experiment import FULL, Design, Progress, per_minute, run_arm, run_sim

BLIS = {"source": "BLIS (inference-sim), held-out validation over 36 experiments, as cited in kvgate's issue 24; "
                  "its blog: median 7-9% on E2E and inter-token latency",
        "e2e_median": 0.067, "ttft_median": 0.176}
TARGETS = {"e2e": 0.05, "ttft": 0.10, "hit_abs": 0.05}
"""The bar: median E2E error at most 5%, median TTFT error at most 10%, per-minute hit ratio within 0.05."""
POOL_BOUND = 0.01
"""A run's pool bound its hit ratio if the real one departed from the eviction-free one by more than this."""
UNBOUNDED_POOL = 64
"""The eviction-free prediction's pool, in multiples of the run's."""
DEFAULT_MINUTES = 3.0

SHAPES = {
    "agent": {"shared": 2000, "unique": 2000, "turns": 12, "output": 16, "append": 1000},
    "long-output": {"shared": 1000, "unique": 3000, "turns": 10, "output": 48, "append": 600},
}
"""Session shapes of the matrix: the real-vLLM experiment's scaled agent, and fewer turns with 3x the output."""


@dataclass(frozen=True)
class Cell:
    lam: float
    kv_pool: int
    shape: str
    trigger: str
    """'none' or a burst X@S+D (an extra Poisson stream at X * lam)."""
    seed: int

    @property
    def id(self) -> str:
        trig = self.trigger.replace("@", "at")
        return f"lam{self.lam:g}-pool{self.kv_pool // 1024}k-{self.shape}-{trig}-s{self.seed}"

    def design(self, minutes: float) -> Design:
        burst = self.trigger if self.trigger != "none" else FULL.burst
        return replace(FULL, lam=self.lam, minutes=minutes, burst=burst, kv_pool=self.kv_pool, seeds=(self.seed,),
                       arms=("twin", "burst"), stream=True, **SHAPES[self.shape])

    @property
    def arm(self) -> str:
        return "twin" if self.trigger == "none" else "burst"


def matrix(quick: bool = False) -> list[Cell]:
    """The retired table's 16 cells (2 x 2 x 2 x 2; scored before and after a model change, so no longer held out:
    :data:`kvgate.realvllm.protocol.RETIRED_HISTORY`), or 2 short ones for a check of the machinery."""
    if quick:
        return [Cell(0.1, 98_304, "agent", "none", 21), Cell(0.1, 98_304, "long-output", "2.5@0.5+1", 22)]
    out = []
    seed = 11
    for lam in (0.06, 0.1):
        for pool in (98_304, 147_456):
            for shape in SHAPES:
                for trig in ("none", "2.5@1+2"):
                    out.append(Cell(lam, pool, shape, trig, seed))
                    seed += 1
    return out


def load_cells(path: Path, minutes: float) -> list[Cell]:
    """The cells of a cells file (its form: :mod:`kvgate.realvllm.protocol`), checked: one line and UsageError on
    bad input, including a run that would not see ``AFTER_BURST_MIN`` minutes after its burst."""
    from kvgate.realvllm.protocol import AFTER_BURST_MIN, CELL_KEYS
    from kvgate.workload.arrivals import parse_burst

    try:
        raw = json.loads(path.read_text("utf-8"))
    except OSError as e:
        raise UsageError(f"cannot read cells file {str(path)!r}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise UsageError(f"cells file {path}: not JSON ({e.msg}, line {e.lineno})") from None
    if not isinstance(raw, list) or not raw:
        raise UsageError(f"cells file {path}: expected a non-empty JSON list of cells")
    cells = []
    for i, c in enumerate(raw):
        where = f"cells file {path}, cell {i}"
        if not isinstance(c, dict) or set(c) != set(CELL_KEYS):
            raise UsageError(f"{where}: expected exactly the keys {', '.join(CELL_KEYS)}")
        lam, pool, shape, trig, seed = (c[k] for k in CELL_KEYS)
        if not isinstance(lam, int | float) or isinstance(lam, bool) or not lam > 0:
            raise UsageError(f"{where}: 'lam' must be a positive number, got {lam!r}")
        for k, v in (("kv_pool", pool), ("seed", seed)):
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise UsageError(f"{where}: {k!r} must be a positive integer, got {v!r}")
        if shape not in SHAPES:
            raise UsageError(f"{where}: unknown shape {shape!r}; choose from {', '.join(SHAPES)}")
        if not isinstance(trig, str):
            raise UsageError(f"{where}: 'trigger' must be \"none\" or X@S+D")
        if trig != "none":
            b = parse_burst(trig)
            if b.end_s / 60.0 + AFTER_BURST_MIN > minutes + 1e-9:
                raise UsageError(f"{where}: its burst ends at minute {b.end_s / 60:g}; a {minutes:g}-minute run "
                                 f"would see less than {AFTER_BURST_MIN:g} minutes after it")
        cells.append(Cell(float(lam), pool, shape, trig, seed))
    ids = [c.id for c in cells]
    if len(set(ids)) != len(ids):
        raise UsageError(f"cells file {path}: a cell is listed twice")
    return cells


# -- errors of one run ------------------------------------------------------------------------------------------
def _turn_means(run_dir: Path) -> dict[str, float]:
    import numpy as np

    from kvgate.records import load_run

    t = load_run(run_dir).turns
    ok = t["status"] == "ok"
    e2e = (t["end_s"] - t["sent_s"])[ok]
    ttft = (t["first_token_s"] - t["sent_s"])[ok]
    return {"e2e_s": float(np.mean(e2e)) if len(e2e) else math.nan,
            "ttft_s": float(np.mean(ttft)) if len(ttft) else math.nan, "turns": int(ok.sum())}


def turn_errors(real_dir: Path, sim_dir: Path) -> dict[str, list[float]]:
    """Per turn, matched by (session, turn) among the turns both completed: the relative error of E2E and TTFT and
    the signed relative TTFT error (negative: the simulator early)."""
    from kvgate.records import load_run

    def by_turn(d: Path) -> dict[tuple[int, int], tuple[float, float]]:
        t = load_run(d).turns
        ok = t["status"] == "ok"
        keys = zip(t["session"][ok].tolist(), t["turn"][ok].tolist(), strict=True)
        vals = zip((t["end_s"] - t["sent_s"])[ok].tolist(), (t["first_token_s"] - t["sent_s"])[ok].tolist(),
                   strict=True)
        return dict(zip(keys, vals, strict=True))

    real, sim = by_turn(real_dir), by_turn(sim_dir)
    out: dict[str, list[float]] = {"e2e": [], "ttft": [], "ttft_signed": []}
    for k in sorted(real.keys() & sim.keys()):
        (re2e, rttft), (se2e, sttft) = real[k], sim[k]
        if re2e > 0 and rttft > 0 and math.isfinite(se2e) and math.isfinite(sttft):
            out["e2e"].append(abs(se2e - re2e) / re2e)
            out["ttft"].append(abs(sttft - rttft) / rttft)
            out["ttft_signed"].append((sttft - rttft) / rttft)
    return out


def quantile(xs: list[float], q: float) -> float:
    import numpy as np

    return float(np.quantile(xs, q)) if xs else math.nan


def peak_demand(run_dir: Path, kv_pool: int) -> float:
    """The run's largest demand (context + output budget over the sessions in the system) over its pool."""
    from kvgate.records import load_run

    d = load_run(run_dir).samples["demand_tokens"]
    d = d[d >= 0]
    return float(d.max()) / kv_pool if len(d) else math.nan


def _rel(sim: float, real: float) -> float:
    return abs(sim - real) / real if real and math.isfinite(real) and math.isfinite(sim) else math.nan


def _minute_err(real: list[float | None], sim: list[float | None], relative: bool) -> tuple[float, float]:
    """(mean, largest) absolute error over the minutes both have; relative to the real mean when asked."""
    pairs = [(a, b) for a, b in zip(real, sim, strict=True) if a is not None and b is not None]
    if not pairs:
        return math.nan, math.nan
    errs = [abs(b - a) for a, b in pairs]
    scale = statistics.fmean(a for a, _ in pairs) if relative else 1.0
    if relative and not scale:
        return math.nan, math.nan
    return statistics.fmean(errs) / scale, max(errs) / scale


def compare(real_dir: Path, sim_dir: Path, minutes: float) -> dict[str, Any]:
    """The prediction errors of one run (real records in ``real_dir``, simulated in ``sim_dir``)."""
    r, s = _turn_means(real_dir), _turn_means(sim_dir)
    pr, ps = per_minute(real_dir, minutes), per_minute(sim_dir, minutes)
    tp = _minute_err(pr["turns_per_s"], ps["turns_per_s"], relative=True)
    hit = _minute_err(pr["hit_ratio"], ps["hit_ratio"], relative=False)
    ins = _minute_err(pr["in_system"], ps["in_system"], relative=True)
    te = turn_errors(real_dir, sim_dir)
    bias = (s["ttft_s"] - r["ttft_s"]) / r["ttft_s"] if r["ttft_s"] and math.isfinite(s["ttft_s"]) else math.nan
    return {
        "real": r, "sim": s, "e2e": _rel(s["e2e_s"], r["e2e_s"]), "ttft": _rel(s["ttft_s"], r["ttft_s"]),
        "ttft_bias": bias, "throughput": tp[0], "hit_mean": hit[0], "hit_max": hit[1], "in_system": ins[0],
        "turns_matched": len(te["e2e"]), "e2e_turn_median": quantile(te["e2e"], 0.5),
        "e2e_turn_p90": quantile(te["e2e"], 0.9), "ttft_turn_median": quantile(te["ttft"], 0.5),
        "ttft_turn_p90": quantile(te["ttft"], 0.9), "ttft_turn_bias": quantile(te["ttft_signed"], 0.5),
        "minutes": {"real": pr, "sim": ps}, "_turns": te,
    }


def pool_bound(real: list[float | None], unbounded: list[float | None]) -> float:
    """The largest per-minute departure of the real hit ratio from the eviction-free one (nan: no minute has
    both)."""
    d = [abs(a - b) for a, b in zip(real, unbounded, strict=True) if a is not None and b is not None]
    return max(d) if d else math.nan


def turn_summary(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Over every matched turn of ``rows`` (pooled), and the signed TTFT bias of the run means."""
    pooled: dict[str, list[float]] = {"e2e": [], "ttft": [], "ttft_signed": []}
    for r in rows:
        for k, v in (r.get("_turns") or {}).items():
            pooled[k].extend(v)
    bias = [r["ttft_bias"] for r in rows if r.get("ttft_bias") is not None and math.isfinite(r["ttft_bias"])]
    return {"runs": len(rows), "turns": len(pooled["e2e"]),
            "e2e_median": quantile(pooled["e2e"], 0.5), "e2e_p90": quantile(pooled["e2e"], 0.9),
            "ttft_median": quantile(pooled["ttft"], 0.5), "ttft_p90": quantile(pooled["ttft"], 0.9),
            "ttft_turn_bias": quantile(pooled["ttft_signed"], 0.5),
            "ttft_bias_median": statistics.median(bias) if bias else math.nan,
            "runs_sim_early": sum(1 for b in bias if b < 0),
            "e2e_run_median": statistics.median([r["e2e"] for r in rows if math.isfinite(r["e2e"])] or [math.nan]),
            "ttft_run_median": statistics.median([r["ttft"] for r in rows if math.isfinite(r["ttft"])] or [math.nan])}


def summarize(rows: list[dict[str, Any]]) -> dict[str, Any]:
    def med(k: str) -> float:
        v = [r[k] for r in rows if r.get(k) is not None and math.isfinite(r[k])]
        return statistics.median(v) if v else math.nan

    def top(k: str) -> float:
        v = [r[k] for r in rows if r.get(k) is not None and math.isfinite(r[k])]
        return max(v) if v else math.nan

    s = {k: med(k) for k in ("e2e", "ttft", "throughput", "hit_mean", "hit_max", "in_system")}
    s["hit_max_all"] = top("hit_max")
    bound = [r for r in rows if r.get("pool_bound") is not None and r["pool_bound"] > POOL_BOUND]
    s["pool_bound_runs"] = len(bound)
    s["hit_max_bound"] = max((r["hit_max"] for r in bound if math.isfinite(r["hit_max"])), default=math.nan)
    s["runs"] = len(rows)
    s["turns"] = turn_summary(rows)
    over = [r for r in rows if r.get("peak_demand") is not None and r["peak_demand"] > 1.0]
    within = [r for r in rows if r not in over]
    s["oversubscribed"] = turn_summary(over)
    s["within_pool"] = turn_summary(within)
    s["meets"] = {"e2e": s["e2e"] <= TARGETS["e2e"], "ttft": s["ttft"] <= TARGETS["ttft"],
                  "hit": s["hit_max_all"] <= TARGETS["hit_abs"], "runs": len(rows) >= 12}
    return s


# -- the command ---------------------------------------------------------------------------------------------------
def run(out: Path, *, page_dir: Path | None = None, quick: bool = False, profile: str | None = None,
        minutes: float | None = None, cells_file: Path | None = None,
        progress: Progress | None = None) -> dict[str, Any]:
    """The cells' runs (resumable) under ``out``; ``result.json`` and ``index.md`` in ``page_dir`` (``out``).
    ``cells_file``: the committed cells (:mod:`kvgate.realvllm.protocol`; needed unless ``quick``). ``profile``:
    predict with this one; None: measure a fresh one first with ``kvgate calibrate --endpoint`` on a server of its
    own (``out/profile.json``, kept), so that fitting set and held-out runs share the machine's state. The cells, the
    profile and kvgate's commit are frozen in ``out/protocol.json`` before the first run."""
    from kvgate.engine.costmodel import profile as get_profile
    from kvgate.realvllm.protocol import freeze
    from kvgate.realvllm.server import vllm_available

    say = progress or (lambda _m: None)
    mins = minutes if minutes is not None else (1.5 if quick else DEFAULT_MINUTES)
    if cells_file is None and not quick:
        raise UsageError("--cells FILE is needed: the held-out cells come from a committed file (docs/real-vllm.md)")
    cells = matrix(True) if cells_file is None else load_cells(cells_file, mins)
    why = vllm_available()
    if why is not None:
        raise UsageError(why)
    out.mkdir(parents=True, exist_ok=True)
    if profile is None:
        profile = str(_calibrate(out, say))
    get_profile(profile)
    proto = freeze(out, cells_file, profile, mins) if cells_file is not None else None
    rows = []
    for cell in cells:
        d = cell.design(mins)
        base = out / "runs" / cell.id
        trace = base / "workload.jsonl"
        base.mkdir(parents=True, exist_ok=True)
        trace.write_text(json.dumps(d.trace_line()) + "\n")
        run_sim(d, cell.seed, cell.arm, trace, profile, base / "sim")  # always: the prediction of this profile
        free = replace(d, kv_pool=d.kv_pool * UNBOUNDED_POOL)
        run_sim(free, cell.seed, cell.arm, trace, profile, base / "sim-unbounded")
        if not (base / "real" / "arm.json").exists():
            run_arm(d, cell.seed, cell.arm, trace, base / "real", say)
        row = compare(base / "real" / "drive", base / "sim", mins)
        info = json.loads((base / "real" / "arm.json").read_text())
        row.update({"cell": asdict(cell), "id": cell.id, "loadavg_per_min": info.get("loadavg_per_min"),
                    "peak_demand": peak_demand(base / "real" / "drive", cell.kv_pool),
                    "pool_bound": pool_bound(row["minutes"]["real"]["hit_ratio"],
                                             per_minute(base / "sim-unbounded", mins)["hit_ratio"])})
        rows.append(row)
        say(f"{cell.id}: E2E error {row['e2e']:.1%}, TTFT {row['ttft']:.1%}, hit max {row['hit_max']:.3f}")
    res = {"profile": profile, "quick": quick, "minutes": mins, "summary": summarize(rows), "protocol": proto,
           "blis": BLIS, "targets": TARGETS, "loadavg_end": os.getloadavg()[0]}
    for r in rows:
        r.pop("_turns", None)
    res["rows"] = rows
    pd = page_dir or out
    pd.mkdir(parents=True, exist_ok=True)
    (pd / "result.json").write_text(json.dumps(res, indent=1, sort_keys=True, default=_nan_none))
    (pd / "index.md").write_text(page(res))
    return res


def _nan_none(x: Any) -> Any:
    return None if isinstance(x, float) and math.isnan(x) else str(x)


def _calibrate(out: Path, say: Progress) -> Path:
    """A fresh profile of this machine's real vLLM, measured before the held-out runs (the fitting set)."""
    import subprocess
    import sys

    from kvgate.realvllm.experiment import cli_env
    from kvgate.realvllm.server import RealVllm, ServerConfig

    path = out / "profile.json"
    if path.exists():
        return path
    cfg = ServerConfig(kv_pool=FULL.kv_pool, block_size=FULL.block_size, max_model_len=FULL.max_model_len,
                       extra_args=("--max-num-batched-tokens", str(FULL.max_num_batched_tokens), "--max-num-seqs",
                                   str(FULL.max_num_seqs)), log_path=out / "calibrate-vllm.log")
    with RealVllm(cfg) as srv:
        say(f"calibrating against {srv.url}")
        done = subprocess.run(
            [sys.executable, "-m", "kvgate.cli", "calibrate", "--endpoint", srv.url, "--out", str(path),
             "--max-num-batched-tokens", str(FULL.max_num_batched_tokens), "--max-num-seqs", str(FULL.max_num_seqs),
             "--note", "kvgate real-vllm heldout: the fitting set"],
            env=cli_env(), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
            stderr=open(out / "calibrate.log", "wb"),  # noqa: SIM115
        )
    if done.returncode != 0:
        raise UsageError(f"kvgate calibrate --endpoint failed (status {done.returncode}); see {out / 'calibrate.log'} "
                         f"and {out / 'calibrate-vllm.log'}")
    return path


# -- the page ------------------------------------------------------------------------------------------------------
def _p(x: float | None) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.1%}"


def _h(x: float | None) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:.3f}"


def _bound_note(res: dict[str, Any]) -> list[str]:
    s = res["summary"]
    if "pool_bound_runs" not in s:
        return []
    n = s["pool_bound_runs"]
    return [
        f"Where the pool bound the hit ratio: in {n} of {s['runs']} runs the real hit ratio departed from the "
        f"eviction-free one (the same run simulated on a {UNBOUNDED_POOL}x pool) by more than {POOL_BOUND} in some "
        f"minute (column *pool bound*); the largest hit-ratio error over those runs is {_h(s['hit_max_bound'])}. "
        "In the others no prefix was evicted before its next turn, so real and simulated hit ratios are both the "
        "workload's own and their agreement tests nothing but the accounting.", ""]


def _signed(x: float | None) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else f"{x:+.1%}"


def _turn_table(s: dict[str, Any]) -> list[str]:
    """Per-turn errors and the TTFT bias, over all runs and split by whether demand exceeded the pool."""
    if "turns" not in s:
        return []
    lines = ["## Per turn, and the TTFT bias", "",
             "Each turn's prediction against the same turn (session, turn) of the real run, over the turns both "
             "completed; the bias is signed (negative: the simulator early). *Oversubscribed*: the run's demand "
             "(context + output budget over the sessions in the system) exceeded the pool in some sample.", "",
             "| runs | n | turns | E2E per turn: median / p90 | TTFT per turn: median / p90 | TTFT bias: per turn "
             "(median) / of run means (median) | runs simulated early (TTFT) | E2E / TTFT run-mean error (median) |",
             "|---|---|---|---|---|---|---|---|"]
    for name, key in (("all", "turns"), ("oversubscribed", "oversubscribed"), ("within the pool", "within_pool")):
        g = s.get(key)
        if not g:
            continue
        lines.append(f"| {name} | {g['runs']} | {g['turns']} | {_p(g['e2e_median'])} / {_p(g['e2e_p90'])} | "
                     f"{_p(g['ttft_median'])} / {_p(g['ttft_p90'])} | {_signed(g['ttft_turn_bias'])} / "
                     f"{_signed(g['ttft_bias_median'])} | {g['runs_sim_early']} of {g['runs']} | "
                     f"{_p(g['e2e_run_median'])} / {_p(g['ttft_run_median'])} |")
    return [*lines, ""]


def _protocol(res: dict[str, Any]) -> list[str]:
    from kvgate.realvllm.protocol import AFTER_BURST_MIN, MODEL_HISTORY, RETIRED_HISTORY

    p = res.get("protocol")
    if not p:
        return []
    return ["## Protocol", "",
            f"The cells come from the committed `{p['cells_file']}` (SHA-256 `{p['cells_sha256']}`); the profile "
            f"`{Path(str(res['profile'])).name}` has SHA-256 `{p['profile_sha256']}`; the runs began at "
            f"{p['started']} on kvgate `{p['kvgate_commit']}`, and `protocol.json` refuses any later invocation on "
            "their directory with another cells file, profile or run length: no model change once they begin. Every "
            f"run sees at least {AFTER_BURST_MIN:g} minutes after its last burst.", "",
            "**What changed before.** " + MODEL_HISTORY, "", "**History.** " + RETIRED_HISTORY, ""]


def page(res: dict[str, Any]) -> str:
    s = res["summary"]
    t = res["targets"]
    lines = [
        "# Held-out accuracy against a real vLLM (CPU build)",
        "",
        "`kvgate real-vllm heldout` (`src/kvgate/realvllm/heldout.py`). The simulator with the engine profile "
        f"`{Path(str(res['profile'])).name}` fitted by `kvgate calibrate --endpoint` (micro-measurements and one "
        "all-miss c(L) load: none of these runs) predicts each run of a matrix λ × KV pool × session shape × trigger "
        "on the real vLLM 0.32.0 (CPU build, the tiny model), each on a fresh server; nothing is refitted. "
        f"{res['minutes']:g} minutes per run{' (quick check of the machinery)' if res['quick'] else ''}.",
        "",
        "## Summary: median over runs of each run's error",
        "",
        "| metric | kvgate (median) | bar | BLIS (median, 36 held-out experiments) |",
        "|---|---|---|---|",
        f"| E2E turn latency (run mean), relative error | {_p(s['e2e'])} | ≤ {t['e2e']:.0%} | "
        f"{res['blis']['e2e_median']:.1%} |",
        f"| TTFT (run mean), relative error | {_p(s['ttft'])} | ≤ {t['ttft']:.0%} | {res['blis']['ttft_median']:.1%} |",
        f"| throughput per minute, mean abs. error / real mean | {_p(s['throughput'])} | – | – |",
        f"| hit ratio per minute, mean abs. error | {_h(s['hit_mean'])} | – | – |",
        f"| hit ratio per minute, largest abs. error (largest over runs: {_h(s['hit_max_all'])}) | "
        f"{_h(s['hit_max'])} | ≤ {t['hit_abs']} | – |",
        f"| sessions in the system per minute, mean abs. error / real mean | {_p(s['in_system'])} | – | – |",
        "",
        f"{s['runs']} runs; the bar is met for E2E: **{'yes' if s['meets']['e2e'] else 'no'}**, TTFT: "
        f"**{'yes' if s['meets']['ttft'] else 'no'}**, hit ratio (every minute of every run): "
        f"**{'yes' if s['meets']['hit'] else 'no'}**, at least 12 runs: **{'yes' if s['meets']['runs'] else 'no'}**. "
        f"BLIS: {res['blis']['source']}.",
        "",
        *_bound_note(res),
        *_turn_table(s),
        *_protocol(res),
        "## Runs",
        "",
        "| run | turns (real / sim) | E2E real / sim (s) | error | TTFT real / sim (s) | error | TTFT bias | per turn "
        "E2E / TTFT (median) | tput | hit mean / max | in system | peak demand / pool | pool bound | load average |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in res["rows"]:
        la = r.get("loadavg_per_min") or []
        lines.append(
            f"| {r['id']} | {r['real']['turns']} / {r['sim']['turns']} | {r['real']['e2e_s']:.2f} / "
            f"{r['sim']['e2e_s']:.2f} | {_p(r['e2e'])} | {r['real']['ttft_s']:.3f} / {r['sim']['ttft_s']:.3f} | "
            f"{_p(r['ttft'])} | {_signed(r.get('ttft_bias'))} | {_p(r.get('e2e_turn_median'))} / "
            f"{_p(r.get('ttft_turn_median'))} | {_p(r['throughput'])} | {_h(r['hit_mean'])} / {_h(r['hit_max'])} | "
            f"{_p(r['in_system'])} | {_h(r.get('peak_demand'))} | {_h(r.get('pool_bound'))} | "
            f"{', '.join(f'{x:.1f}' for x in la)} |")
    lines += ["", "Run ids: `lam{λ}-pool{KiB-tokens}k-{shape}-{trigger}-s{seed}`; shapes: " + "; ".join(
        f"{k}: {v['shared']} shared + {v['unique']} unique tokens, {v['turns']} turns of {v['output']} output, "
        f"{v['append']} appended a turn" for k, v in SHAPES.items()) + ". Trigger `XatS+D`: an extra Poisson "
        "stream at X λ from minute S for D minutes.", ""]
    return "\n".join(lines)
