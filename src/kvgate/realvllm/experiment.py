"""``kvgate experiment real-vllm``: the paper's phenomenon on a real vLLM (the CPU build), beside the simulator.

The scaled paired design (issue 10): agent sessions of a 2,000-token shared prefix plus 2,000 unique tokens, 12
turns of 16 output tokens, 1,000 tokens appended per turn, 5 s mean think time, arriving at lambda sessions/s
against a tiny random-weight Llama served by ``python -m vllm.entrypoints.openai.api_server`` (one OpenMP
thread, block size 128, vLLM's CPU step budget of 2,048 tokens, a KV pool of ~147K tokens). Per seed, four
arms on identical base arrivals, each on a **fresh server** (fresh cache), each driven by ``kvgate drive``:

* ``twin``: the base arrivals only;
* ``burst``: plus an extra +2 lambda stream for a few minutes;
* ``budgeter``: the burst arm through ``kvgate gateway --control budgeter`` from the start;
* ``budgeter-late``: the burst arm through ``kvgate gateway --control none``, switched to the budgeter with
  ``POST /admin/control`` a few minutes after the burst (recovery).

Beside every arm, the simulator's prediction: the same workload, seed, pool, block size, step budget and
control, with the engine profile fitted by ``kvgate calibrate --endpoint`` against this server
(``tiny-llama-cpu-vllm032``), minute by minute. The page (``index.md`` + figures) states the claims with
verdicts that can come out negative.

Every process is a subprocess (``python3 -m kvgate.cli ...`` and vLLM's server) on 127.0.0.1; one server at a
time. A run directory per arm makes the experiment resumable: an arm whose ``run.json`` exists is not rerun.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from kvgate.errors import UsageError

Progress = Callable[[str], None]

PROFILE = "tiny-llama-cpu-vllm032"
ARMS = ("twin", "burst", "budgeter", "budgeter-late")
HEALTHY_HIT = 0.7
"""A minute with a hit ratio at or above this is healthy; DEGRADED_HIT (0.5) and below is degraded."""
PREDICTION_TOLERANCE = 0.1
"""Largest per-minute hit-ratio error of the simulator on a healthy arm for the claim to hold."""


@dataclass(frozen=True)
class Design:
    lam: float = 0.12
    minutes: float = 5.0
    burst: str = "2.5@1+2"
    control_at_min: float = 2.5
    """Minute the budgeter is switched on in the budgeter-late arm."""
    seeds: tuple[int, ...] = (1, 2, 3)
    arms: tuple[str, ...] = ARMS
    kv_pool: int = 147_456
    block_size: int = 128
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 128
    max_model_len: int = 16_384
    shared: int = 2000
    unique: int = 2000
    turns: int = 12
    output: int = 16
    append: int = 1000
    judge_from_min: float = 3.0
    """Regimes are judged on the minutes from here to the end."""
    stream: bool = False
    """Drive with streamed responses (``kvgate drive --stream``: records each turn's first-token time)."""

    def trace_line(self) -> dict[str, Any]:
        return {
            "id": "scaled-agent",
            "shared": self.shared,
            "initial": self.shared + self.unique,
            "outputs": [self.output] * self.turns,
            "appends": [self.append] * (self.turns - 1),
        }


FULL = Design()
QUICK = Design(
    minutes=2.0, burst="5.0@0.2+0.8", control_at_min=1.5, seeds=(1,), arms=("twin", "burst"), judge_from_min=1.0
)
"""For CI: one seed, the twin and the burst arm, 2 minutes each (about 6 minutes with two server start-ups)."""


def arm_runs(d: Design) -> list[tuple[int, str]]:
    """Pairs first (twin and burst of every seed), then the control arms: a run cut short still has pairs."""
    pairs = [(s, a) for s in d.seeds for a in d.arms if a in ("twin", "burst")]
    return pairs + [(s, a) for a in d.arms if a not in ("twin", "burst") for s in d.seeds]


# -- running one arm -----------------------------------------------------------------------------------------------
def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "kvgate.cli", *args]


def cli_env() -> dict[str, str]:
    """The environment of the kvgate subprocesses: this source tree first on PYTHONPATH."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


def _get_json(url: str, timeout: float = 3.0) -> Any:
    with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (loopback only)
        return json.loads(r.read())


def _post_json(url: str, body: dict[str, Any], timeout: float = 10.0) -> Any:
    req = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:  # noqa: S310 (loopback only)
        return json.loads(r.read())


def _wait_gateway(url: str, proc: subprocess.Popen[bytes], timeout: float = 60.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise UsageError(f"the gateway exited with status {proc.returncode} at start-up")
        try:
            _get_json(url + "/admin/control")
            return
        except OSError:
            time.sleep(0.3)
    raise UsageError("the gateway did not answer /admin/control within 60 s")


def _stop(proc: subprocess.Popen[bytes] | None, grace: float = 30.0) -> None:
    if proc is None or proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(timeout=10)


def vllm_server(d: Design, out: Path) -> Any:
    """A fresh real vLLM for one arm (a context manager), logging to ``out/vllm.log``."""
    from kvgate.realvllm.server import RealVllm, ServerConfig

    return RealVllm(ServerConfig(
        kv_pool=d.kv_pool, block_size=d.block_size, max_model_len=d.max_model_len,
        extra_args=("--max-num-batched-tokens", str(d.max_num_batched_tokens), "--max-num-seqs", str(d.max_num_seqs)),
        log_path=out / "vllm.log",
    ))


def run_arm(
    d: Design, seed: int, arm: str, trace: Path, out: Path, say: Progress,
    server: Callable[[Design, Path], Any] = vllm_server, name: str = "real-vllm",
) -> dict[str, Any]:
    """One arm on a fresh server (``server(d, out)``, a context manager with ``url``, ``kv_pool`` and
    ``startup_s``: a real vLLM by default); writes ``out`` (drive records + ``arm.json``)."""
    from kvgate.realengine import free_port

    out.mkdir(parents=True, exist_ok=True)
    info: dict[str, Any] = {"seed": seed, "arm": arm, "design": asdict(d)}
    gw: subprocess.Popen[bytes] | None = None
    t_start = time.time()
    with server(d, out) as srv:
        info["server_startup_s"] = round(srv.startup_s or 0.0, 1)
        info["kv_pool"] = srv.kv_pool
        endpoint = srv.url
        if arm in ("budgeter", "budgeter-late"):
            port = free_port()
            control = "budgeter" if arm == "budgeter" else "none"
            gw = subprocess.Popen(
                _cli("gateway", "--upstream", srv.url, "--control", control, "--port", str(port),
                     "--log-level", "warning"),
                stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=open(out / "gateway.log", "wb"),  # noqa: SIM115
                env=cli_env(),
            )
            endpoint = f"http://127.0.0.1:{port}"
            try:
                _wait_gateway(endpoint, gw)
            except BaseException:
                _stop(gw)
                raise
        args = ["drive", "--endpoint", endpoint, "--trace", str(trace), "--lam", str(d.lam), "--minutes",
                str(d.minutes), "--seed", str(seed), "--out", str(out / "drive"), "--force", "--json",
                "--label", f"{name} {arm} seed {seed}"]
        if arm != "twin":
            args += ["--burst", d.burst]
        if d.stream:
            args.append("--stream")
        say(f"seed {seed} {arm}: server up in {info['server_startup_s']} s, driving {d.minutes:g} min")
        load: list[float] = []
        drv = subprocess.Popen(
            _cli(*args), stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=open(out / "drive.log", "wb"),  # noqa: SIM115
            env=cli_env(),
        )
        t0 = time.monotonic()
        switched = None
        try:
            while drv.poll() is None:
                time.sleep(1.0)
                el = time.monotonic() - t0
                if len(load) < el / 60.0:
                    load.append(round(os.getloadavg()[0], 2))
                if arm == "budgeter-late" and switched is None and el >= d.control_at_min * 60.0:
                    _post_json(endpoint + "/admin/control", {"control": "budgeter"})
                    switched = round(el / 60.0, 2)
                    say(f"seed {seed} {arm}: budgeter on at minute {switched}")
            stdout = drv.stdout.read() if drv.stdout else b""
        finally:
            _stop(drv, grace=60.0)
            if gw is not None:
                with contextlib.suppress(OSError):
                    info["gateway_control"] = _get_json(endpoint + "/admin/control")
                _stop(gw)
        with contextlib.suppress(OSError, RuntimeError, ValueError):
            info["engine_counters"] = engine_counters(srv.metrics())
    if drv.returncode != 0:
        raise UsageError(
            f"kvgate drive failed for seed {seed} {arm} (status {drv.returncode}); see {out / 'drive.log'}"
        )
    info["drive_summary"] = json.loads(stdout.decode().strip().splitlines()[-1])
    info["switched_at_min"] = switched
    info["loadavg_per_min"] = load
    info["wall_s"] = round(time.time() - t_start, 1)
    (out / "arm.json").write_text(json.dumps(info, indent=1, sort_keys=True))
    return info


ENGINE_COUNTERS = (
    "vllm:num_preemptions_total", "sglang:num_retracted_requests_total", "sglang:num_retracted_input_tokens_total",
    "sglang:evicted_tokens_total",
)
"""The server's own counters kept per arm: preemptions (vLLM), retractions and evicted tokens (SGLang)."""


def engine_counters(metrics: str) -> dict[str, float]:
    """The :data:`ENGINE_COUNTERS` a server's /metrics exposes (each summed over its label sets)."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(metrics):
        for smp in fam.samples:
            if smp.name in ENGINE_COUNTERS:
                out[smp.name] = out.get(smp.name, 0.0) + smp.value
    return out


# -- the simulator beside it ---------------------------------------------------------------------------------------
def sim_config(d: Design, seed: int, arm: str, trace: Path, profile: str, engine: str = "vllm") -> Any:
    """The simulated arm: ``engine`` vllm (blocks of ``d.block_size``) or sglang (pages of one token)."""
    from kvgate.sim.config import SimConfig

    return SimConfig(
        trace=str(trace), lam=d.lam, minutes=d.minutes, seed=seed, bursts=() if arm == "twin" else (d.burst,),
        profile=profile, kv_pool=d.kv_pool, block_size=d.block_size if engine == "vllm" else 1, engine=engine,
        max_num_batched_tokens=d.max_num_batched_tokens, max_num_seqs=d.max_num_seqs,
        control="budgeter" if arm in ("budgeter", "budgeter-late") else "none",
        control_at=d.control_at_min if arm == "budgeter-late" else None, label=f"real-{engine} sim {arm} seed {seed}",
    )


def run_sim(d: Design, seed: int, arm: str, trace: Path, profile: str, out: Path, engine: str = "vllm") -> None:
    from kvgate.records import write_run
    from kvgate.sim.config import validate
    from kvgate.sim.runner import simulate

    cfg = sim_config(d, seed, arm, trace, profile, engine)
    validate(cfg)
    res = simulate(cfg)
    write_run(out, res.meta, res.tables)


# -- analysis -------------------------------------------------------------------------------------------------------
def per_minute(run_dir: Path, minutes: float) -> dict[str, list[float | None]]:
    from kvgate.analysis.metrics import series
    from kvgate.records import load_run

    r = load_run(run_dir)
    s = series(r.turns, r.samples, minutes * 60.0)

    def clean(xs: Any) -> list[float | None]:
        return [None if (x is None or not math.isfinite(float(x))) else round(float(x), 4) for x in xs]

    return {
        "t_min": clean(s["t_min"]),
        "hit_ratio": clean(s["hit_ratio"]),
        "in_system": clean(s.get("in_system", [math.nan] * len(s["t_min"]))),
        "turns_per_s": clean(s["turns_per_s"]),
    }


def regime(series_: dict[str, list[float | None]], d: Design) -> tuple[str, float | None]:
    """'degraded' if every judged minute is below DEGRADED_HIT, 'healthy' if every one is at or above
    HEALTHY_HIT, else 'mixed'; with the judged stretch's hit ratio (mean of its minutes)."""
    from kvgate.analysis.metrics import DEGRADED_HIT

    hs = [h for t, h in zip(series_["t_min"], series_["hit_ratio"], strict=True)
          if t is not None and t >= d.judge_from_min]
    known = [h for h in hs if h is not None]
    if not known:
        return "idle", None
    mean = sum(known) / len(known)
    if all(h < DEGRADED_HIT for h in known):
        return "degraded", mean
    if all(h >= HEALTHY_HIT for h in known):
        return "healthy", mean
    return "mixed", mean


def analyse(d: Design, out: Path) -> dict[str, Any]:
    rows = []
    for seed, arm in arm_runs(d):
        real_dir = out / "runs" / f"s{seed}-{arm}"
        sim_dir = out / "sim" / f"s{seed}-{arm}"
        if not (real_dir / "arm.json").exists() or not (sim_dir / "run.json").exists():
            continue
        info = json.loads((real_dir / "arm.json").read_text())
        real = per_minute(real_dir / "drive", d.minutes)
        sim = per_minute(sim_dir, d.minutes)
        rg, rh = regime(real, d)
        sg, sh = regime(sim, d)
        errs = [None if (a is None or b is None) else round(b - a, 4)
                for a, b in zip(real["hit_ratio"], sim["hit_ratio"], strict=True)]
        judged = [e for t, e in zip(real["t_min"], errs, strict=True) if t is not None and t >= 1.0 and e is not None]
        before = _hit_between(real_dir / "drive", (d.control_at_min - 1.0) * 60.0, d.control_at_min * 60.0)
        ds = info["drive_summary"]
        rows.append({
            "seed": seed, "arm": arm, "real_regime": rg, "real_hit_judged": None if rh is None else round(rh, 3),
            "sim_regime": sg, "sim_hit_judged": None if sh is None else round(sh, 3),
            "max_abs_minute_error": round(max(abs(e) for e in judged), 3) if judged else None,
            "real": real, "sim": sim, "error": errs,
            "sessions_arrived": ds.get("sessions_arrived"), "sessions_finished": ds.get("sessions_finished"),
            "in_system_last": real["in_system"][-1], "sim_in_system_last": sim["in_system"][-1],
            "switched_at_min": info.get("switched_at_min"), "loadavg_per_min": info.get("loadavg_per_min"),
            "server_startup_s": info.get("server_startup_s"), "wall_s": info.get("wall_s"),
            "parks": (info.get("gateway_control") or {}).get("parks"),
            "engine_counters": info.get("engine_counters"),
            "hit_minute_before_switch": None if math.isnan(before) else round(before, 3),
        })
    return {"design": asdict(d), "rows": rows, "claims": claims(d, rows)}


def _hit_between(run_dir: Path, t0: float, t1: float) -> float:
    from kvgate.analysis.metrics import hit_ratio
    from kvgate.records import load_run

    return hit_ratio(load_run(run_dir).turns, t0, t1)


def claims(d: Design, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    by = {(r["seed"], r["arm"]): r for r in rows}
    seeds = list(d.seeds)
    out = []

    def verdict(ok: bool | None) -> str:
        return "not run" if ok is None else ("holds" if ok else "fails")

    paired = [s for s in seeds if (s, "burst") in by and (s, "twin") in by]
    good = [s for s in paired if by[(s, "burst")]["real_regime"] == "degraded" and by[(s, "twin")]["real_regime"]
            == "healthy"]
    need = 2 if len(seeds) >= 3 else len(seeds)
    out.append({
        "claim": f"the burst arm is persistently degraded and its twin healthy in at least {need} of {len(seeds)} "
                 "seeds",
        "measured": f"{len(good)} of {len(paired)} seeds ({', '.join(map(str, good)) or 'none'})",
        "verdict": verdict(None if len(paired) < len(seeds) else len(good) >= need),
    })
    bud = [by[(s, "budgeter")] for s in seeds if (s, "budgeter") in by]
    out.append({
        "claim": "the budgeter from the start keeps every burst arm healthy",
        "measured": ", ".join(f"seed {r['seed']}: {r['real_regime']} ({r['real_hit_judged']})" for r in bud) or "-",
        "verdict": verdict(None if len(bud) < len(seeds) else all(r["real_regime"] == "healthy" for r in bud)),
    })
    late = [by[(s, "budgeter-late")] for s in seeds if (s, "budgeter-late") in by]
    rec = []
    for r in late:
        hs = [h for t, h in zip(r["real"]["t_min"], r["real"]["hit_ratio"], strict=True)
              if t is not None and h is not None and t >= d.minutes - 2]
        recovered = bool(hs) and min(hs) >= HEALTHY_HIT
        twin = by.get((r["seed"], "burst"))
        stays = twin is not None and twin["real_regime"] == "degraded"
        rec.append((r["seed"], r.get("hit_minute_before_switch"), hs, recovered, stays))
    out.append({
        "claim": f"the budgeter switched on at minute {d.control_at_min:g}, as the burst arm collapses, brings it "
                 f"back (each of the last 2 minutes at a hit ratio >= {HEALTHY_HIT}) while the same arrivals without "
                 "the switch (the burst arm) stay degraded",
        "measured": "; ".join(
            f"seed {s}: hit {_f2(b)} in the minute before the switch, last 2 min {_fmt(h)}, burst arm "
            f"{'degraded' if st else 'not degraded'}" for s, b, h, _, st in rec) or "-",
        "verdict": verdict(None if len(late) < len(seeds) else all(ok and st for _, _, _, ok, st in rec)),
    })
    reg = [(r["seed"], r["arm"], r["real_regime"], r["sim_regime"]) for r in rows]
    out.append({
        "claim": "the simulator with the calibrated profile predicts each arm's regime",
        "measured": f"{sum(a == b for *_, a, b in reg)} of {len(reg)} arms match" + (
            "; differ: " + ", ".join(f"seed {s} {a} (real {x}, sim {y})" for s, a, x, y in reg if x != y)
            if any(x != y for *_, x, y in reg) else ""),
        "verdict": verdict(None if not reg else all(x == y for *_, x, y in reg)),
    })
    healthy = [r for r in rows if r["real_regime"] == "healthy" and r["max_abs_minute_error"] is not None]
    out.append({
        "claim": f"on the healthy arms the simulator's per-minute hit ratio is within {PREDICTION_TOLERANCE} of the "
                 "real one (every minute from minute 1)",
        "measured": ", ".join(f"seed {r['seed']} {r['arm']}: max {r['max_abs_minute_error']}" for r in healthy) or "-",
        "verdict": verdict(None if not healthy else all(r["max_abs_minute_error"] <= PREDICTION_TOLERANCE
                                                        for r in healthy)),
    })
    return out


def _f2(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}"


def _fmt(xs: list[float]) -> str:
    return "[" + ", ".join(f"{x:.2f}" for x in xs) + "]" if xs else "-"


# -- the whole experiment -------------------------------------------------------------------------------------------
def chosen(quick_design: Design, full_design: Design, quick: bool, seeds: tuple[int, ...] | None) -> Design:
    """The design a run asks for: the quick or the full one, on ``seeds`` when given."""
    d = quick_design if quick else full_design
    return replace(d, seeds=seeds) if seeds else d


def run_design(out: Path, d: Design, profile: str, unavailable: str | None, say: Progress, engine: str = "vllm",
               **arm: Any) -> dict[str, Any]:
    """Every arm of ``d`` on the real engine (resumable: an arm whose ``arm.json`` exists is kept) and in the
    simulated ``engine``, analysed; ``unavailable``: why the real engine cannot run (None: it can); ``arm``: what
    :func:`run_arm` runs it with."""
    from kvgate.engine.costmodel import profile as get_profile

    get_profile(profile)
    if unavailable is not None:
        raise UsageError(unavailable)
    out.mkdir(parents=True, exist_ok=True)
    trace = out / "workload.jsonl"
    trace.write_text(json.dumps(d.trace_line()) + "\n")
    for seed, a in arm_runs(d):
        sim_dir = out / "sim" / f"s{seed}-{a}"
        if not (sim_dir / "run.json").exists():
            run_sim(d, seed, a, trace, profile, sim_dir, engine=engine)
    for seed, a in arm_runs(d):
        real_dir = out / "runs" / f"s{seed}-{a}"
        if (real_dir / "arm.json").exists():
            say(f"seed {seed} {a}: done before, kept")
            continue
        info = run_arm(d, seed, a, trace, real_dir, say, **arm)
        ds = info["drive_summary"]
        say(f"seed {seed} {a}: hit ratio last 10 min {ds.get('hit_ratio_last10')}, sessions "
            f"{ds.get('sessions_finished')}/{ds.get('sessions_arrived')} finished, {info['wall_s']} s")
    res = analyse(d, out)
    res["profile"] = profile
    return res


def run(
    out: Path, *, quick: bool = False, profile: str = PROFILE, progress: Progress | None = None,
    seeds: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    from kvgate.realvllm.server import vllm_available

    res = run_design(out, chosen(QUICK, FULL, quick, seeds), profile, vllm_available(),
                     progress or (lambda _m: None))
    res["quick"] = quick
    (out / "result.json").write_text(json.dumps(res, indent=1, sort_keys=True))
    from kvgate.realvllm.page import write_page

    write_page(res, out)
    return res
