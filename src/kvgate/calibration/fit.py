"""``kvgate calibrate --endpoint URL``: measure a live vLLM-compatible engine and fit the cost model's constants.

This module is the pure half: what is measured (:class:`Plan`, the measurement records), how each measurement is
predicted and how the constants are fitted (the load is replayed in kvgate's simulated vLLM, so it lives beside
the simulator, as ``calibration/paper.py`` does for the profiles' simulated targets). The requests are made by
:mod:`kvgate.calibration.measure` (``measure``, ``run``).

The simulator predicts an engine through one :class:`~kvgate.engine.costmodel.Profile` (``docs/calibration.md``).
This module measures a running server and fits that profile, so the simulator predicts *that* engine:

1. **probe**: the server must answer ``/v1/models`` and expose vLLM's ``/metrics``; the pool and block size come
   from ``vllm:cache_config_info`` (usable pool = (num_gpu_blocks - 1) x block_size: block 0 is vLLM's null
   block), the step budget from ``/server_info`` where the server serves it, and the server must report
   ``usage.prompt_tokens_details.cached_tokens`` (vLLM: ``--enable-prompt-tokens-details``).
2. **request overhead**: the round trip of ``POST /tokenize`` (HTTP, parsing; no engine step), taken as the
   fixed latency every request adds to its engine time. It is measured, not fitted.
3. **cold prefill**: one request of L unique tokens and one output token; time to the first token (the
   least of ``reps`` tries, as for 4 and 6: on a shared machine noise only ever adds time).
4. **incremental prefill**: a prefix of P tokens is warmed, then P + n tokens are sent; the reported cached
   tokens give the hit, the time to the first token the cost of the n new tokens on the cached prefix.
5. **decode**: B distinct prompts of C tokens are warmed, then run at once with 1 and with N output tokens;
   the difference of the two batch times over N - 1 is the step time of a batch of B decoders at C + N/2 (a
   server may coalesce streamed tokens, so the stream's own timestamps are not used).
6. **mixed step**: a cold prompt of n tokens is sent while B warmed requests of context C decode; its time
   to the first token is one mixed step (plus, on average, half a decode step of waiting to join the batch),
   where the decoders' KV read costs ``mixed_decode_factor`` times a pure decode step's.
7. **c(L) load**: W closed-loop workers send unique prompts (all misses, lengths uniform in a range) with 16
   output tokens for a while: a cache-disabled-like load whose turn time regressed on the prompt length is the
   paper's c(L).

The fit, in the order of ``docs/calibration.md``: ``overhead, weights, per_token, attn, kv_read, per_seq`` (and a
first ``mixed_decode_factor``) by least squares on the relative error of measurements 3-6, each predicted with
the cost model exactly as ``engine/vllm.py`` charges steps (chunks of the step budget, decode attention bound
by the KV read; a robust loss, so one stray slow measurement on a busy machine does not drag the fit). Then
``mixed_decode_factor``, the one load-level constant, again with the c(L) load: the load is replayed
closed-loop in kvgate's simulated vLLM (same prompts and client gaps, same pool, block size and budget) over a
grid of factors, and the factor is the one that best matches the load's mean turn time and the mixed steps
together (the factor the mixed steps alone give is recorded beside it). The profile file records every
measurement, its prediction and the errors (``calibration``), so a reader can judge the fit.

Against ``kvgate engine --time-scale X`` pass ``time_scale=X``: measured real seconds are multiplied by it.
"""

from __future__ import annotations

import math
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from kvgate.engine.costmodel import Profile
from kvgate.errors import UsageError

TOKEN_ID_RANGE = (1000, 30000)
LOAD_OUTPUT = 16
MIXED_DECODE_TOKENS = 1024
"""Output budget of the decoders of a mixed measurement (they are cancelled once it is taken)."""
FACTORS = tuple(round(64.0 ** (i / 48), 3) for i in range(49))
"""The grid ``mixed_decode_factor`` is chosen on: 1 to 64 in steps of 9%."""
PARAMS = ("overhead_s", "weights_s", "per_token_s", "attn_s", "kv_read_s", "per_seq_s", "mixed_decode_factor")

Progress = Callable[[str], None]


@dataclass(frozen=True)
class Plan:
    """What to measure. :func:`plan` scales it to the server's context limit and pool."""

    cold: tuple[int, ...] = (256, 1024, 2048, 4096, 8192, 12288)
    incremental: tuple[tuple[int, int], ...] = ((2048, 512), (4096, 1024), (8192, 1024), (8192, 2048), (4096, 4096))
    decode_batches: tuple[int, ...] = (1, 2, 4, 8, 16, 32)
    decode_contexts: tuple[int, ...] = (512, 4096)
    decode_tokens: int = 64
    mixed: tuple[tuple[int, int, int], ...] = ((4, 2048, 1024), (16, 2048, 1024), (8, 8192, 512), (32, 4096, 1024))
    """(decoders B, their context C, cold chunk n): a cold prompt of n tokens joins B running decoders."""
    reps: int = 2
    load_workers: int = 6
    load_seconds: float = 60.0
    load_prompt: tuple[int, int] = (512, 6144)


QUICK = Plan(
    cold=(256, 2048, 4096, 8192),
    incremental=((4096, 1024), (8192, 2048)),
    decode_batches=(1, 4, 16),
    decode_contexts=(512, 4096),
    decode_tokens=32,
    mixed=((4, 4096, 1024), (16, 4096, 1024)),
    reps=1,
    load_workers=4,
    load_seconds=30.0,
)


@dataclass(frozen=True)
class ServerFacts:
    endpoint: str
    model: str
    block_size: int
    num_gpu_blocks: int
    kv_pool: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    budget_source: str
    kv_bytes_per_token: int
    version: str = ""
    engine: str = "vllm"
    """vllm or sglang: which of kvgate's engines replays the load (SGLang's runs prefill and decode apart)."""


@dataclass
class Sample:
    """One measurement in virtual seconds; ``kind`` is cold, incremental or decode."""

    kind: str
    prompt: int
    cached: int
    batch: int
    output: int
    seconds: float
    predicted: float = math.nan


@dataclass
class LoadTurn:
    worker: int
    prompt: int
    cached: int
    sent: float
    end: float


@dataclass
class Measured:
    facts: ServerFacts
    request_s: float
    """The way to the engine and back apart from the prompt's length (:attr:`Profile.request_s`)."""
    samples: list[Sample] = field(default_factory=list)
    load: list[LoadTurn] = field(default_factory=list)
    wall_s: float = 0.0
    request_per_token_s: float = 0.0
    front: list[tuple[int, float]] = field(default_factory=list)
    """(prompt tokens, seconds of its time to first token outside the engine) of each request the engine timed."""


def request_time(front: list[tuple[int, float]], fallback_s: float) -> tuple[float, float]:
    """``(request_s, request_per_token_s)``: a line through the requests' time outside the engine against their
    prompt's length (least absolute deviations: a request delayed by the machine must not tilt it), neither part
    negative; with fewer than 3 requests timed, ``fallback_s`` and 0."""
    if len(front) < 3:
        return fallback_s, 0.0
    import numpy as np
    from scipy.optimize import minimize

    x = np.array([float(n) for n, _ in front])
    y = np.array([t for _, t in front])
    a0, b0 = regress(list(x), list(y))
    scale = max(float(np.median(y)), 1e-6)
    res = minimize(lambda z: float(np.mean(np.sqrt(1.0 + ((y - z[0] - z[1] * x) / (0.1 * scale)) ** 2))),
                   np.array([max(a0, 0.0), max(b0, 0.0)]), method="L-BFGS-B", bounds=[(0.0, None), (0.0, None)])
    return float(res.x[0]), float(res.x[1])


# -- measuring ---------------------------------------------------------------------------------------------------
def scaled_plan(p: Plan, facts: ServerFacts) -> Plan:
    """Drop what the server cannot hold: prompts above its context limit or a third of its pool."""
    cap = min(facts.max_model_len - max(p.decode_tokens, LOAD_OUTPUT) - 8, facts.kv_pool // 3)
    if cap < 256:
        raise UsageError(f"the server's pool ({facts.kv_pool} tokens) or context limit is too small to calibrate")
    cold = tuple(x for x in p.cold if x <= cap) or (cap,)
    inc = tuple((a, b) for a, b in p.incremental if a + b <= cap) or ((cap // 2, cap // 4),)
    ctx = tuple(c for c in p.decode_contexts if c <= cap) or (cap // 2,)
    room = facts.kv_pool * 0.8
    batches = tuple(b for b in p.decode_batches if b * (min(ctx) + p.decode_tokens) <= room)
    mixed = tuple((b, c, n) for b, c, n in p.mixed if c <= cap and b * (c + MIXED_DECODE_TOKENS) + n <= room)
    if not mixed:
        mixed = ((2, cap // 4, cap // 8),)
    lo, hi = p.load_prompt
    hi = min(hi, cap)
    return replace(p, cold=cold, incremental=inc, decode_contexts=ctx, decode_batches=batches or (1,), mixed=mixed,
                   load_prompt=(min(lo, hi // 2), hi))


# -- predicting and fitting --------------------------------------------------------------------------------------
def predict(p: Profile, s: Sample, budget: int) -> float:
    """The cost model's time for a measurement, charged as ``engine/vllm.py`` charges its steps, after the
    request's way to the engine (:meth:`Profile.request_time`)."""
    request_s = p.request_time(s.prompt)
    if s.kind == "decode":
        tot = 0.0
        for j in range(s.output - 1):
            c = s.prompt + j
            tot += p.step_time(s.batch, s.batch, s.batch * p.chunk_attn(c, 1))
        return tot / max(1, s.output - 1)
    if s.kind == "mixed":
        # ``output`` holds the decoders' context; the chunk waits on average half a decode step to join
        dec = p.step_time(s.batch, s.batch, s.batch * p.chunk_attn(s.output, 1))
        new = s.prompt - s.cached
        attn = p.chunk_attn(s.cached, new) + p.mixed_penalty(new, budget) * s.batch * p.chunk_attn(s.output, 1)
        return request_s + 0.5 * dec + p.step_time(new + s.batch, s.batch + 1, attn)
    done = s.cached
    t = request_s
    while done < s.prompt:
        n = min(budget, s.prompt - done)
        t += p.step_time(n, 1, p.chunk_attn(done, n))
        done += n
    return t


def _with(p: Profile, x: list[float]) -> Profile:
    return replace(p, **dict(zip(PARAMS, x, strict=True)))


def fit_constants(m: Measured, start: Profile) -> Profile:
    """Least squares on the relative errors of the single-request and decode measurements (log-parameters)."""
    import numpy as np
    from scipy.optimize import least_squares

    budget = m.facts.max_num_batched_tokens
    samples = m.samples

    def resid(z: Any) -> Any:
        p = _with(start, [math.exp(v) for v in z])
        return np.array([(predict(p, s, budget) - s.seconds) / s.seconds for s in samples])

    z0 = np.array([math.log(max(getattr(start, k), 1e-14)) for k in PARAMS])
    lo = np.full(len(PARAMS), -46.0)
    hi = np.full(len(PARAMS), 3.0)
    lo[-1], hi[-1] = 0.0, math.log(64.0)  # mixed_decode_factor in [1, 64]
    if not any(s.kind == "mixed" for s in samples):
        lo[-1], hi[-1], z0[-1] = 0.0, 1e-9, 0.0
    best = None
    # a few starts: the roofline's max() terms make the surface piecewise, so one start can stall on a face
    for shift in (0.0, 2.0, -2.0, 4.0, -4.0):
        z = np.clip(z0 + shift, lo + 1e-12, hi - 1e-12)
        z[-1] = z0[-1]
        # soft_l1: a stray slow measurement (a busy machine) must not drag the whole fit
        r = least_squares(resid, z, bounds=(lo, hi), method="trf", loss="soft_l1", f_scale=0.1, max_nfev=4000)
        if best is None or r.cost < best.cost:
            best = r
    assert best is not None
    return _with(start, [math.exp(v) for v in best.x])


def closed_loop(
    p: Profile,
    facts: ServerFacts,
    workers: dict[int, list[tuple[int, float]]],
    starts: dict[int, float],
) -> dict[tuple[int, int], tuple[float, float]]:
    """Closed-loop workers in the simulated vLLM with profile ``p``: worker ``w`` sends its turns ``(prompt, gap
    before the next)`` one after another from ``starts[w]``; returns ``(sent, last token)`` per ``(w, k)`` as a
    client would see them (each request reaching the engine :meth:`Profile.request_time` after it was sent, as
    in the simulator)."""
    import heapq

    from kvgate.engine.base import Request
    from kvgate.engine.blocks import SeqKey
    from kvgate.engine.sglang import SglangEngine
    from kvgate.engine.vllm import VllmEngine

    eng: VllmEngine | SglangEngine
    if facts.engine == "sglang":
        eng = SglangEngine(p, facts.kv_pool, max_num_batched_tokens=facts.max_num_batched_tokens,
                           max_num_seqs=facts.max_num_seqs)
    else:
        eng = VllmEngine(
            p, facts.kv_pool, block_size=facts.block_size, max_num_batched_tokens=facts.max_num_batched_tokens,
            max_num_seqs=facts.max_num_seqs,
        )
    way = p.request_time
    pending: list[tuple[float, int, int]] = [(starts[w] + way(workers[w][0][0]), w, 0) for w in workers if workers[w]]
    heapq.heapify(pending)
    out: dict[tuple[int, int], tuple[float, float]] = {}
    now = 0.0
    rid = 0
    while pending or eng.has_work():
        if not eng.has_work():
            now = max(now, pending[0][0])
        while pending and pending[0][0] <= now:
            t_sub, w, k = heapq.heappop(pending)
            rid += 1
            eng.add(Request(rid, SeqKey(0, 0, rid), workers[w][k][0], LOAD_OUTPUT, t_sub, (w, k, t_sub)))
        horizon = pending[0][0] if pending else math.inf
        res = eng.step(now, horizon)
        if res.duration <= 0 and not res.finished:
            if not pending:
                break
            now = max(now, pending[0][0])
            continue
        now += res.duration
        for r in res.finished:
            w, k, t_sub = r.tag  # type: ignore[misc]
            out[(w, k)] = (t_sub - way(workers[w][k][0]), now)
            if k + 1 < len(workers[w]):
                heapq.heappush(pending, (now + workers[w][k][1] + way(workers[w][k + 1][0]), w, k + 1))
    return out


def replay_load(p: Profile, m: Measured) -> list[float]:
    """Turn times of the c(L) load replayed closed-loop in the simulated vLLM with profile ``p`` (same prompts, same
    client gaps between turns), in the order of ``m.load`` sorted by send time."""
    by_worker: dict[int, list[LoadTurn]] = {}
    for t in sorted(m.load, key=lambda t: t.sent):
        by_worker.setdefault(t.worker, []).append(t)
    workers = {
        w: [(t.prompt, max(0.0, ts[k + 1].sent - t.end) if k + 1 < len(ts) else 0.0) for k, t in enumerate(ts)]
        for w, ts in by_worker.items()
    }
    out = closed_loop(p, m.facts, workers, {w: ts[0].sent for w, ts in by_worker.items()})
    index = {id(t): (w, k) for w, ts in by_worker.items() for k, t in enumerate(ts)}
    res = []
    for t in sorted(m.load, key=lambda t: t.sent):
        key = index[id(t)]
        if key in out:
            res.append(out[key][1] - out[key][0])
    return res


def fit_mixed_factor(p: Profile, m: Measured) -> tuple[float, dict[float, float]]:
    """``mixed_decode_factor`` from the mixed steps and the c(L) load together: the grid factor minimising the mean
    squared relative error of the mixed-step measurements plus the squared relative error of the replayed load's
    mean turn time (docs/calibration.md, step 3). Where the load hardly depends on the factor the mixed steps
    decide it; where it does, the load weighs as much as all mixed steps together."""
    meas = _mean([t.end - t.sent for t in m.load])
    budget = m.facts.max_num_batched_tokens
    mixed = [s for s in m.samples if s.kind == "mixed"]
    means: dict[float, float] = {}
    best, best_err = 1.0, math.inf
    for fct in FACTORS:
        q = replace(p, mixed_decode_factor=fct)
        means[fct] = _mean(replay_load(q, m))
        err = ((means[fct] - meas) / meas) ** 2
        if mixed:
            err += _mean([((predict(q, s, budget) - s.seconds) / s.seconds) ** 2 for s in mixed])
        if err < best_err:
            best, best_err = fct, err
    return best, means


def _mean(xs: list[float]) -> float:
    return sum(xs) / len(xs) if xs else math.nan


def regress(xs: list[float], ys: list[float]) -> tuple[float, float]:
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx if sxx > 0 else 0.0
    return my - b * mx, b


def fit(m: Measured, name: str, note: str = "") -> tuple[Profile, dict[str, Any]]:
    """The fitted profile and the ``calibration`` record (measurements, predictions, errors) for its file."""
    f = m.facts
    if len(m.load) < 8:
        raise UsageError(f"the c(L) load finished only {len(m.load)} turns; run it longer")
    start = Profile(
        name=name, kv_pool=f.kv_pool, kv_bytes_per_token=max(1, f.kv_bytes_per_token),
        overhead_s=0.005, weights_s=0.005, per_token_s=1e-4, attn_s=1e-9, kv_read_s=1e-7, per_seq_s=1e-4,
        mixed_decode_factor=2.0, max_model_len=f.max_model_len, note=note, request_s=m.request_s,
        request_per_token_s=m.request_per_token_s,
    )
    p = fit_constants(m, start)
    micro_factor = p.mixed_decode_factor
    factor, means = fit_mixed_factor(p, m)
    p = replace(p, mixed_decode_factor=factor)
    for s in m.samples:
        s.predicted = predict(p, s, f.max_num_batched_tokens)
    errs = [abs(s.predicted - s.seconds) / s.seconds for s in m.samples]
    meas_t = [t.end - t.sent for t in m.load]
    pred_t = replay_load(p, m)
    a_m, b_m = regress([float(t.prompt) for t in m.load], meas_t)
    by_order = sorted(m.load, key=lambda t: t.sent)
    a_p, b_p = (math.nan, math.nan)
    if len(pred_t) == len(by_order):
        a_p, b_p = regress([float(t.prompt) for t in by_order], pred_t)
    mean_m = sum(meas_t) / len(meas_t)
    mean_p = sum(pred_t) / len(pred_t)
    cal: dict[str, Any] = {
        "endpoint": f.endpoint,
        "model": f.model,
        "server_version": f.version,
        "engine": f.engine,
        "block_size": f.block_size,
        "num_gpu_blocks": f.num_gpu_blocks,
        "max_num_batched_tokens": f.max_num_batched_tokens,
        "max_num_batched_tokens_source": f.budget_source,
        "max_num_seqs": f.max_num_seqs,
        "request_overhead_s": round(m.request_s, 6),
        "request_per_token_s": m.request_per_token_s,
        "request_time_source": (f"time to first token less the engine's own time, {len(m.front)} requests"
                                if m.front else "POST /tokenize round trip (the server does not time its requests)"),
        "machine": f"{platform.machine()} {platform.processor() or ''}".strip() + f", {platform.system()}",
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wall_s": round(m.wall_s, 1),
        "samples": [
            {
                "kind": s.kind,
                "prompt": s.prompt,
                "cached": s.cached,
                "batch": s.batch,
                "output": s.output,
                "measured_s": round(s.seconds, 6),
                "predicted_s": round(s.predicted, 6),
                "error": round((s.predicted - s.seconds) / s.seconds, 4),
            }
            for s in m.samples
        ],
        "median_abs_error": round(sorted(errs)[len(errs) // 2], 4),
        "max_abs_error": round(max(errs), 4),
        "load": {
            "workers": len({t.worker for t in m.load}),
            "turns": len(m.load),
            "mean_turn_s_measured": round(mean_m, 4),
            "mean_turn_s_predicted": round(mean_p, 4),
            "c_intercept_s_measured": round(a_m, 4),
            "c_slope_ms_per_token_measured": round(b_m * 1000, 5),
            "mean_turn_s_by_factor": {str(k): round(v, 4) for k, v in means.items()},
            "mixed_decode_factor_from_mixed_steps": round(micro_factor, 3),
        },
    }
    if not math.isnan(b_p):
        cal["load"]["c_slope_ms_per_token_replay"] = round(b_p * 1000, 5)
    return p, cal


def format_report(p: Profile, cal: dict[str, Any]) -> str:
    lines = [f"profile {p.name}: pool {p.kv_pool} tokens, block {cal['block_size']}, "
             f"budget {cal['max_num_batched_tokens']}, max_model_len {p.max_model_len}"]
    for k in PARAMS:
        lines.append(f"  {k:<20} {getattr(p, k):.4g}")
    lines.append(f"  request time         {p.request_s * 1000:.2f} ms + {p.request_per_token_s * 1e6:.3f} us per "
                 f"prompt token ({cal.get('request_time_source', 'measured')})")
    lines.append("measurement                               measured   predicted   error")
    for s in cal["samples"]:
        what = {
            "cold": f"cold prefill {s['prompt']}",
            "incremental": f"incremental {s['prompt'] - s['cached']} on {s['cached']}",
            "decode": f"decode batch {s['batch']} at {s['prompt']} (per step)",
            "mixed": f"cold {s['prompt']} beside {s['batch']} decoders at {s['output']}",
        }[s["kind"]]
        lines.append(f"  {what:<38} {s['measured_s']:>9.4f} s {s['predicted_s']:>9.4f} s {s['error']:>+7.1%}")
    ld = cal["load"]
    lines.append(
        f"c(L) load: {ld['turns']} turns on {ld['workers']} workers, mean turn {ld['mean_turn_s_measured']:.3f} s "
        f"measured, {ld['mean_turn_s_predicted']:.3f} s predicted; c(L) = {ld['c_intercept_s_measured']:+.3f} s + "
        f"{ld['c_slope_ms_per_token_measured']:.4f} ms x L"
    )
    lines.append(f"errors: median {cal['median_abs_error']:.1%}, max {cal['max_abs_error']:.1%}")
    return "\n".join(lines)
