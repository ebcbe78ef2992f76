"""``kvgate calibrate --endpoint URL``: measure a live vLLM-compatible engine and fit the cost model's constants.

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

import asyncio
import json
import math
import platform
import random
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
    pool_tokens: int
    max_model_len: int
    max_num_batched_tokens: int
    max_num_seqs: int
    budget_source: str
    kv_bytes_per_token: int
    version: str = ""


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
    samples: list[Sample] = field(default_factory=list)
    load: list[LoadTurn] = field(default_factory=list)
    wall_s: float = 0.0


# -- HTTP --------------------------------------------------------------------------------------------------------
class _Http:
    """The few requests calibration needs, on one aiohttp session, with per-token stream timestamps."""

    def __init__(self, base: str, api_key: str | None, timeout_s: float) -> None:
        import aiohttp

        self.base = base
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        hdrs = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.session = aiohttp.ClientSession(headers=hdrs, timeout=self.timeout)
        self.model = ""
        self.max_model_len = 0

    async def close(self) -> None:
        await self.session.close()

    async def get(self, path: str) -> tuple[int, bytes]:
        import aiohttp

        try:
            async with self.session.get(self.base + path, timeout=aiohttp.ClientTimeout(total=10)) as r:
                return r.status, await r.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise UsageError(f"cannot reach the endpoint {self.base}: {str(e) or type(e).__name__}") from None

    async def tokenize_rtt(self) -> float:
        body = {"model": self.model, "prompt": "hello"}
        t0 = time.perf_counter()
        async with self.session.post(self.base + "/tokenize", json=body) as r:
            await r.read()
            if r.status != 200:
                raise _NoTokenize()
        return time.perf_counter() - t0

    async def complete(
        self, prompt: list[int], max_tokens: int, on_token: Callable[[], None] | None = None
    ) -> tuple[float, float, float, int, int | None]:
        """Stream one completion: (sent, first token, last token) loop times, completion tokens, cached tokens."""
        import aiohttp

        body = {
            "model": self.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "min_tokens": max_tokens,
            "ignore_eos": True,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        data = json.dumps(body).encode()
        loop = asyncio.get_running_loop()
        sent = loop.time()
        first = last = math.nan
        usage: dict[str, Any] | None = None
        try:
            async with self.session.post(
                self.base + "/v1/completions", data=data, headers={"Content-Type": "application/json"}
            ) as r:
                if r.status != 200:
                    text = (await r.read()).decode("utf-8", "replace")
                    raise UsageError(f"POST /v1/completions answered {r.status}: {' '.join(text.split())[:300]}")
                buf = b""
                async for chunk in r.content.iter_any():
                    buf += chunk
                    while b"\n" in buf:
                        line, buf = buf.split(b"\n", 1)
                        line = line.strip()
                        if not line.startswith(b"data:"):
                            continue
                        payload = line[5:].strip()
                        if payload == b"[DONE]":
                            continue
                        ev = json.loads(payload)
                        ch = ev.get("choices") or []
                        if ch and (ch[0].get("text") or ch[0].get("token_ids")):
                            now = loop.time()
                            if math.isnan(first):
                                first = now
                            last = now
                            if on_token is not None:
                                on_token()
                        if ev.get("usage"):
                            usage = ev["usage"]
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise UsageError(f"request to {self.base} failed: {str(e) or type(e).__name__}") from None
        if math.isnan(first):
            raise UsageError("the endpoint streamed no tokens")
        completion = int((usage or {}).get("completion_tokens") or 0)
        details = (usage or {}).get("prompt_tokens_details") or {}
        cached = details.get("cached_tokens") if isinstance(details, dict) else None
        return sent, first, last, completion, (int(cached) if cached is not None else None)


class _NoTokenize(Exception):
    pass


_CACHE_INFO = "vllm:cache_config_info{"


def _labels(metrics: str, family: str) -> dict[str, str] | None:
    import re

    for line in metrics.splitlines():
        if line.startswith(family):
            return dict(re.findall(r'(\w+)="([^"]*)"', line[len(family) :].split("}", 1)[0]))
    return None


async def probe(
    http: _Http, endpoint: str, max_num_batched_tokens: int | None, max_num_seqs: int | None = None
) -> ServerFacts:
    status, body = await http.get("/v1/models")
    if status in (401, 403):
        raise UsageError(f"the endpoint {endpoint} refused the request ({status}); pass --api-key")
    if status != 200:
        raise UsageError(f"the endpoint {endpoint} is not an OpenAI server: GET /v1/models answered {status}")
    try:
        cards = [m for m in json.loads(body).get("data", []) if isinstance(m, dict) and "id" in m]
    except (ValueError, AttributeError):
        cards = []
    if not cards:
        raise UsageError(f"the endpoint {endpoint} lists no model at /v1/models")
    model = str(cards[0]["id"])
    status, body = await http.get("/metrics")
    text = body.decode("utf-8", "replace") if status == 200 else ""
    info = _labels(text, _CACHE_INFO)
    if "vllm:" not in text or info is None:
        raise UsageError(
            f"the endpoint {endpoint} is not vLLM: its /metrics has no vllm:cache_config_info "
            "(calibration reads the pool and block size from it)"
        )
    try:
        block = int(info["block_size"])
        blocks = int(info["num_gpu_blocks"])
    except (KeyError, ValueError):
        raise UsageError("vllm:cache_config_info lacks block_size or num_gpu_blocks") from None
    if str(info.get("enable_prefix_caching", "True")).lower() != "true":
        raise UsageError(f"prefix caching is off on {endpoint}; calibration needs it (incremental prefill)")
    max_len = int(cards[0].get("max_model_len") or 0) or 32_768
    budget, seqs, source = 8192, 1024, "assumed (vLLM's GPU default)"
    st, sbody = await http.get("/server_info")
    if st == 200:
        found = _find_keys(_json_or_none(sbody), ("max_num_batched_tokens", "max_num_seqs"))
        if "max_num_batched_tokens" in found:
            budget, source = int(found["max_num_batched_tokens"]), "/server_info"
        if "max_num_seqs" in found:
            seqs = int(found["max_num_seqs"])
    if max_num_batched_tokens is not None:
        budget, source = max_num_batched_tokens, "--max-num-batched-tokens"
    if max_num_seqs is not None:
        seqs = max_num_seqs
    mem = info.get("kv_cache_memory_bytes") or info.get("cache_memory_bytes")
    per_tok = int(int(mem) / (blocks * block)) if mem and mem.isdigit() and blocks else 0
    st, vbody = await http.get("/version")
    version = str((_json_or_none(vbody) or {}).get("version", "")) if st == 200 else ""
    return ServerFacts(
        endpoint=endpoint, model=model, block_size=block, num_gpu_blocks=blocks, pool_tokens=(blocks - 1) * block,
        max_model_len=max_len, max_num_batched_tokens=budget, max_num_seqs=seqs, budget_source=source,
        kv_bytes_per_token=per_tok, version=version,
    )  # fmt: skip


def _json_or_none(b: bytes) -> Any:
    try:
        return json.loads(b)
    except ValueError:
        return None


def _find_keys(obj: Any, keys: tuple[str, ...]) -> dict[str, Any]:
    """The first value of each key anywhere in a JSON tree (vLLM's /server_info nests its config)."""
    out: dict[str, Any] = {}
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, dict):
            for k, v in o.items():
                if k in keys and k not in out and isinstance(v, int) and not isinstance(v, bool):
                    out[k] = v
                elif isinstance(v, dict | list):
                    stack.append(v)
        elif isinstance(o, list):
            stack.extend(o)
        elif isinstance(o, str) and o.startswith("{"):
            stack.append(_json_or_none(o.encode()))
    return out


# -- measuring ---------------------------------------------------------------------------------------------------
def scaled_plan(p: Plan, facts: ServerFacts) -> Plan:
    """Drop what the server cannot hold: prompts above its context limit or a third of its pool."""
    cap = min(facts.max_model_len - max(p.decode_tokens, LOAD_OUTPUT) - 8, facts.pool_tokens // 3)
    if cap < 256:
        raise UsageError(f"the server's pool ({facts.pool_tokens} tokens) or context limit is too small to calibrate")
    cold = tuple(x for x in p.cold if x <= cap) or (cap,)
    inc = tuple((a, b) for a, b in p.incremental if a + b <= cap) or ((cap // 2, cap // 4),)
    ctx = tuple(c for c in p.decode_contexts if c <= cap) or (cap // 2,)
    room = facts.pool_tokens * 0.8
    batches = tuple(b for b in p.decode_batches if b * (min(ctx) + p.decode_tokens) <= room)
    mixed = tuple((b, c, n) for b, c, n in p.mixed if c <= cap and b * (c + MIXED_DECODE_TOKENS) + n <= room)
    if not mixed:
        mixed = ((2, cap // 4, cap // 8),)
    lo, hi = p.load_prompt
    hi = min(hi, cap)
    return replace(p, cold=cold, incremental=inc, decode_contexts=ctx, decode_batches=batches or (1,), mixed=mixed,
                   load_prompt=(min(lo, hi // 2), hi))  # fmt: skip


async def measure(
    endpoint: str,
    *,
    plan: Plan = Plan(),
    time_scale: float = 1.0,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    api_key: str | None = None,
    seed: int | None = None,
    progress: Progress | None = None,
    timeout_s: float = 600.0,
) -> Measured:
    from kvgate.http.client import normalize_endpoint

    base = normalize_endpoint(endpoint)
    say = progress or (lambda _m: None)
    rng = random.Random(seed if seed is not None else random.SystemRandom().getrandbits(64))  # fresh content
    http = _Http(base, api_key, timeout_s)
    t_start = time.perf_counter()
    try:
        facts = await probe(http, base, max_num_batched_tokens, max_num_seqs)
        http.model = facts.model
        http.max_model_len = facts.max_model_len
        plan = scaled_plan(plan, facts)
        say(
            f"{base}: {facts.model}, pool {facts.pool_tokens} tokens ({facts.num_gpu_blocks} blocks of "
            f"{facts.block_size}), max_model_len {facts.max_model_len}, step budget {facts.max_num_batched_tokens} "
            f"({facts.budget_source})"
        )

        def uniq(n: int) -> list[int]:
            return [rng.randrange(*TOKEN_ID_RANGE) for _ in range(n)]

        # cached-token reporting, and a warm-up of the engine (first requests compile and allocate)
        probe_prompt = uniq(4 * facts.block_size + 8)
        for _ in range(2):
            _, _, _, _, cached = await http.complete(probe_prompt, 2)
        if cached is None:
            raise UsageError(
                f"{base} does not report cached tokens (usage.prompt_tokens_details.cached_tokens); "
                "start vLLM with --enable-prompt-tokens-details"
            )
        if cached <= 0:
            raise UsageError(f"{base} reported no cached tokens for a repeated prompt: prefix caching is not working")
        for n in sorted({*plan.cold, 512, 2048}):  # first sight of a shape is slow on some backends (oneDNN)
            await http.complete(uniq(n), 4)
        try:
            rtts = [await http.tokenize_rtt() for _ in range(7)]
            request_s = sorted(rtts)[len(rtts) // 2] * time_scale
        except _NoTokenize:
            request_s = 0.0
            say("no /tokenize: request overhead taken as 0")
        m = Measured(facts=facts, request_s=request_s)
        say(f"request overhead (POST /tokenize round trip): {request_s * 1000:.1f} ms")

        for L in plan.cold:
            ts = []
            for _ in range(plan.reps):
                sent, first, _, _, cached = await http.complete(uniq(L), 1)
                ts.append((first - sent) * time_scale)
            m.samples.append(Sample("cold", L, int(cached or 0), 1, 1, min(ts)))
            say(f"cold prefill   {L:>6} tokens: {min(ts):.3f} s ({L / min(ts):,.0f} tok/s)")
            if cached:
                say(f"  note: {cached} of the {L} 'cold' tokens were cached")
        for P, n in plan.incremental:
            ts = []
            for _ in range(plan.reps):
                base_prompt = uniq(P)
                await http.complete(base_prompt, 1)
                sent, first, _, _, cached = await http.complete(base_prompt + uniq(n), 1)
                c = int(cached or 0)
                ts.append((first - sent) * time_scale)
            m.samples.append(Sample("incremental", P + n, c, 1, 1, min(ts)))
            say(f"incremental    {n:>6} new on {P:>6} (hit {c}): {min(ts):.3f} s")
        for C in plan.decode_contexts:
            for B in plan.decode_batches:
                if B * (C + plan.decode_tokens) > facts.pool_tokens * 0.8:
                    continue  # the batch would not fit in the pool
                prompts = [uniq(C) for _ in range(B)]
                for pr in prompts:
                    await http.complete(pr, 1)
                # a server may coalesce streamed tokens, so time whole batches: N tokens less 1 token, over N - 1
                steps = []
                for _ in range(plan.reps):
                    one = await _batch(http, prompts, 1)
                    many = await _batch(http, prompts, plan.decode_tokens)
                    steps.append((many - one) / (plan.decode_tokens - 1) * time_scale)
                step = max(min(steps), 1e-6)
                m.samples.append(Sample("decode", C, C, B, plan.decode_tokens, step))
                say(f"decode         batch {B:>3} at {C:>6}: {step * 1000:.2f} ms/step ({B / step:,.0f} tok/s)")
        for B, C, n in plan.mixed:
            reps = [await _mixed(http, B, C, n, uniq, time_scale) for _ in range(plan.reps)]
            sample = min(reps, key=lambda x: x.seconds)
            m.samples.append(sample)
            say(f"mixed          {n:>6} cold beside {B:>3} decoders at {C:>6}: {sample.seconds:.3f} s to first token")
        say(f"c(L) load: {plan.load_workers} workers, unique prompts of {plan.load_prompt[0]}-{plan.load_prompt[1]} "
            f"tokens, {plan.load_seconds:g} s")  # fmt: skip
        m.load = await _load(http, plan, rng, time_scale)
        m.wall_s = time.perf_counter() - t_start
        return m
    finally:
        await http.close()


async def _batch(http: _Http, prompts: list[list[int]], n: int) -> float:
    """Loop seconds from sending every prompt at once to the last one's last token."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    res = await asyncio.gather(*(http.complete(pr, n) for pr in prompts))
    if any(k != n for _, _, _, k, _ in res):
        raise UsageError("the endpoint returned another number of output tokens than asked (ignore_eos unsupported?)")
    return max(last for _, _, last, _, _ in res) - t0


async def _mixed(http: _Http, B: int, C: int, n: int, uniq: Callable[[int], list[int]], scale: float) -> Sample:
    """A cold prompt of ``n`` tokens sent while ``B`` warmed requests of context ``C`` are decoding."""
    prompts = [uniq(C) for _ in range(B)]
    for pr in prompts:
        await http.complete(pr, 1)
    counts = [0] * B
    ready = asyncio.Event()

    def tick(i: int) -> Callable[[], None]:
        def f() -> None:
            counts[i] += 1
            if min(counts) >= 3:
                ready.set()

        return f

    long = max(64, min(MIXED_DECODE_TOKENS, http.max_model_len - C - 8))
    tasks = [asyncio.ensure_future(http.complete(pr, long, tick(i))) for i, pr in enumerate(prompts)]
    try:
        await asyncio.wait_for(ready.wait(), timeout=http.timeout.total)
        sent, first, _, _, cached = await http.complete(uniq(n), 1)
        for t in tasks:
            if t.done():
                exc = t.exception()
                if exc is not None:
                    raise UsageError(f"a decoder of the mixed measurement failed: {exc}")
                raise UsageError("the decoders finished before the mixed measurement; the context limit is too small")
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return Sample("mixed", n, int(cached or 0), B, C, (first - sent) * scale)


async def _load(http: _Http, plan: Plan, rng: random.Random, scale: float) -> list[LoadTurn]:
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    stop = t0 + plan.load_seconds / scale
    lo, hi = plan.load_prompt
    turns: list[LoadTurn] = []
    lengths = [[rng.randint(lo, hi) for _ in range(10_000)] for _ in range(plan.load_workers)]

    async def worker(w: int) -> None:
        k = 0
        while loop.time() < stop:
            L = lengths[w][k]
            prompt = [rng.randrange(*TOKEN_ID_RANGE) for _ in range(L)]
            sent, _, last, _, cached = await http.complete(prompt, LOAD_OUTPUT)
            turns.append(LoadTurn(w, L, int(cached or 0), (sent - t0) * scale, (last - t0) * scale))
            k += 1

    await asyncio.gather(*(worker(w) for w in range(plan.load_workers)))
    return turns


# -- predicting and fitting --------------------------------------------------------------------------------------
def predict(p: Profile, s: Sample, budget: int, request_s: float) -> float:
    """The cost model's time for a measurement, charged as ``engine/vllm.py`` charges its steps."""
    if s.kind == "decode":
        tot = 0.0
        for j in range(s.output - 1):
            c = s.prompt + j
            tot += p.step_time(s.batch, s.batch, s.batch * p.chunk_attn(c, 1))
        return tot / max(1, s.output - 1)
    if s.kind == "mixed":
        # ``output`` holds the decoders' context; the chunk waits on average half a decode step to join
        dec = p.step_time(s.batch, s.batch, s.batch * p.chunk_attn(s.output, 1))
        attn = p.chunk_attn(s.cached, s.prompt - s.cached) + p.mixed_decode_factor * s.batch * p.chunk_attn(s.output, 1)
        return request_s + 0.5 * dec + p.step_time(s.prompt - s.cached + s.batch, s.batch + 1, attn)
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
        return np.array([(predict(p, s, budget, m.request_s) - s.seconds) / s.seconds for s in samples])

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
    request_s: float,
    workers: dict[int, list[tuple[int, float]]],
    starts: dict[int, float],
) -> dict[tuple[int, int], tuple[float, float]]:
    """Closed-loop workers in the simulated vLLM with profile ``p``: worker ``w`` sends its turns ``(prompt, gap
    before the next)`` one after another from ``starts[w]``; returns ``(sent, last token)`` per ``(w, k)`` as a
    client would see them (half the request overhead each way)."""
    import heapq

    from kvgate.engine.base import Request
    from kvgate.engine.blocks import SeqKey
    from kvgate.engine.vllm import VllmEngine

    eng = VllmEngine(
        p, facts.pool_tokens, block_size=facts.block_size, max_num_batched_tokens=facts.max_num_batched_tokens,
        max_num_seqs=facts.max_num_seqs,
    )  # fmt: skip
    half = request_s / 2
    pending: list[tuple[float, int, int]] = [(starts[w] + half, w, 0) for w in workers if workers[w]]
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
            out[(w, k)] = (t_sub - half, now + half)
            if k + 1 < len(workers[w]):
                heapq.heappush(pending, (now + half + workers[w][k][1] + half, w, k + 1))
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
    out = closed_loop(p, m.facts, m.request_s, workers, {w: ts[0].sent for w, ts in by_worker.items()})
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
            err += _mean([((predict(q, s, budget, m.request_s) - s.seconds) / s.seconds) ** 2 for s in mixed])
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
        name=name, kv_pool_tokens=f.pool_tokens, kv_bytes_per_token=max(1, f.kv_bytes_per_token),
        overhead_s=0.005, weights_s=0.005, per_token_s=1e-4, attn_s=1e-9, kv_read_s=1e-7, per_seq_s=1e-4,
        mixed_decode_factor=2.0, max_model_len=f.max_model_len, note=note,
    )  # fmt: skip
    p = fit_constants(m, start)
    micro_factor = p.mixed_decode_factor
    factor, means = fit_mixed_factor(p, m)
    p = replace(p, mixed_decode_factor=factor)
    for s in m.samples:
        s.predicted = predict(p, s, f.max_num_batched_tokens, m.request_s)
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
        "block_size": f.block_size,
        "num_gpu_blocks": f.num_gpu_blocks,
        "max_num_batched_tokens": f.max_num_batched_tokens,
        "max_num_batched_tokens_source": f.budget_source,
        "max_num_seqs": f.max_num_seqs,
        "request_overhead_s": round(m.request_s, 6),
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
        ],  # fmt: skip
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
    lines = [f"profile {p.name}: pool {p.kv_pool_tokens} tokens, block {cal['block_size']}, "
             f"budget {cal['max_num_batched_tokens']}, max_model_len {p.max_model_len}"]  # fmt: skip
    for k in PARAMS:
        lines.append(f"  {k:<20} {getattr(p, k):.4g}")
    lines.append(f"  request overhead     {cal['request_overhead_s'] * 1000:.2f} ms (measured, not in the profile)")
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


def run(
    endpoint: str,
    *,
    name: str | None = None,
    quick: bool = False,
    time_scale: float = 1.0,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    api_key: str | None = None,
    note: str = "",
    seed: int | None = None,
    progress: Progress | None = None,
) -> tuple[Profile, dict[str, Any]]:
    if not math.isfinite(time_scale) or time_scale <= 0:
        raise UsageError("--time-scale must be a positive number")
    if max_num_batched_tokens is not None and max_num_batched_tokens <= 0:
        raise UsageError("--max-num-batched-tokens must be positive")
    m = asyncio.run(
        measure(
            endpoint, plan=QUICK if quick else Plan(), time_scale=time_scale,
            max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs, api_key=api_key, seed=seed,
            progress=progress,
        )
    )  # fmt: skip
    if progress:
        progress("fitting")
    return fit(m, name or f"calibrated-{m.facts.model.replace('/', '-')}", note)
