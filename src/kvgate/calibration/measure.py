"""``kvgate calibrate --endpoint URL``, the measuring half: probe a live vLLM-compatible server and time the requests
:mod:`kvgate.calibration.fit` fits the cost model's constants to (what is measured and how it is fitted
are described there).
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvgate.calibration.fit import (
    LOAD_OUTPUT,
    MIXED_DECODE_TOKENS,
    QUICK,
    TOKEN_ID_RANGE,
    LoadTurn,
    Measured,
    Plan,
    Progress,
    Sample,
    ServerFacts,
    fit,
    request_time,
    scaled_plan,
)
from kvgate.engine.costmodel import Profile
from kvgate.errors import UsageError
from kvgate.http.dialect import COMPLETIONS, kind_of
from kvgate.http.openai import cache_config_labels, parse_cache_config, parse_server_info


# -- HTTP --------------------------------------------------------------------------------------------------------
class _Http:
    """The few requests calibration needs, on one aiohttp session, with per-token stream timestamps."""

    def __init__(self, base: str, api_key: str | None, timeout_s: float) -> None:
        import aiohttp

        self.base = base
        self.timeout = aiohttp.ClientTimeout(total=timeout_s)
        hdrs = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        # An idle pooled connection is dropped after 2 s, before a server's own keep-alive timeout (uvicorn's 5 s)
        # closes it under a request just sent on it.
        self.session = aiohttp.ClientSession(headers=hdrs, timeout=self.timeout,
                                             connector=aiohttp.TCPConnector(keepalive_timeout=2.0))
        self.model = ""
        self.max_model_len = 0
        self.kv_pool = 0

    async def close(self) -> None:
        await self.session.close()

    async def get(self, path: str) -> tuple[int, bytes]:
        import aiohttp

        try:
            async with self.session.get(self.base + path, timeout=aiohttp.ClientTimeout(total=10)) as r:
                return r.status, await r.read()
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise UsageError(f"cannot reach the endpoint {self.base}: {str(e) or type(e).__name__}") from None

    async def engine_seconds(self, names: tuple[str, ...]) -> float | None:
        """The sum of the histograms ``names`` on ``/metrics`` (the engine's own time of the requests so far), None
        when the server exports none of them."""
        from prometheus_client.parser import text_string_to_metric_families

        if not names:
            return None
        st, body = await self.get("/metrics")
        if st != 200:
            return None
        total, seen = 0.0, False
        try:
            for fam in text_string_to_metric_families(body.decode("utf-8", "replace")):
                for smp in fam.samples:
                    if smp.name.endswith("_sum") and smp.name.removesuffix("_sum") in names:
                        total += smp.value
                        seen = True
        except ValueError:
            return None
        return total if seen else None

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
        for attempt in (1, 2):
            try:
                return await self._complete(json.dumps(body).encode(), on_token)
            except aiohttp.ServerDisconnectedError:
                # before any token: most likely the server closed a kept-alive connection as the request went
                # out on it (nothing read, nothing computed), so once more, on a new connection
                if attempt == 2:
                    raise UsageError(f"request to {self.base} failed: the server disconnected, twice") from None
        raise AssertionError("unreachable")

    async def _complete(
        self, data: bytes, on_token: Callable[[], None] | None
    ) -> tuple[float, float, float, int, int | None]:
        import aiohttp

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
        except aiohttp.ServerDisconnectedError:
            if math.isnan(first):
                raise
            raise UsageError(f"request to {self.base} failed: the server disconnected mid-stream") from None
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            raise UsageError(f"request to {self.base} failed: {str(e) or type(e).__name__}") from None
        if math.isnan(first):
            raise UsageError("the endpoint streamed no tokens")
        got = COMPLETIONS.usage(usage)
        return sent, first, last, 0 if got is None else got.completion, None if got is None else got.cached


class _NoTokenize(Exception):
    pass


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
    info = parse_cache_config(text)
    if "vllm:" not in text or info is None:
        sglang = await _sglang_facts(http, endpoint, model, cards[0], max_num_batched_tokens, max_num_seqs)
        if sglang is not None:
            return sglang
        raise UsageError(
            f"the endpoint {endpoint} is neither vLLM (its /metrics has no vllm:cache_config_info) nor SGLang (no "
            "max_total_num_tokens on /server_info): calibration reads the pool from them"
        )
    if info.block_size is None or info.num_gpu_blocks is None or info.kv_pool is None:
        raise UsageError("vllm:cache_config_info lacks block_size or num_gpu_blocks")
    block, blocks = info.block_size, info.num_gpu_blocks
    labels = cache_config_labels(text) or {}  # the gauge's raw labels: prefix caching and the KV cache's bytes
    if str(labels.get("enable_prefix_caching", "True")).lower() != "true":
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
    mem = labels.get("kv_cache_memory_bytes") or labels.get("cache_memory_bytes")
    per_tok = int(int(mem) / (blocks * block)) if mem and mem.isdigit() and blocks else 0
    st, vbody = await http.get("/version")
    version = str((_json_or_none(vbody) or {}).get("version", "")) if st == 200 else ""
    return ServerFacts(
        endpoint=endpoint, model=model, block_size=block, num_gpu_blocks=blocks, kv_pool=info.kv_pool,
        max_model_len=max_len, max_num_batched_tokens=budget, max_num_seqs=seqs, budget_source=source,
        kv_bytes_per_token=per_tok, version=version,
    )


async def _sglang_facts(
    http: _Http, endpoint: str, model: str, card: dict[str, Any], budget: int | None, seqs: int | None
) -> ServerFacts | None:
    """SGLang's facts from ``/server_info``: the pool (``max_total_num_tokens``, page size 1), the prefill chunk
    (``chunked_prefill_size``) as the step budget, ``max_running_requests``; None when it is not SGLang."""
    st, body = await http.get("/server_info")
    obj = _json_or_none(body) if st == 200 else None
    info = parse_server_info(obj) if obj is not None else None
    if info is None or info.kv_pool is None:
        return None
    if obj.get("disable_radix_cache"):
        raise UsageError(f"the radix cache is off on {endpoint}; calibration needs it (incremental prefill)")
    found = _find_keys(obj, ("chunked_prefill_size", "max_running_requests", "context_length"))
    source = "--max-num-batched-tokens" if budget is not None else "/server_info: chunked_prefill_size"
    budget = budget if budget is not None else int(found.get("chunked_prefill_size") or 8192)
    st, vbody = await http.get("/version")
    version = str((_json_or_none(vbody) or {}).get("version", "")) if st == 200 else ""
    # SGLang's KV size is in GB to 3 decimals: from 0.1 GB on that is within 0.5%, and a KV cache's bytes per
    # token is a multiple of 64 (K and V x layers x heads x head dim x 2 bytes); below it, unknown (0)
    kv_gb = _kv_gb(obj)
    per_tok = 64 * round(kv_gb * 1e9 / info.kv_pool / 64) if kv_gb is not None and kv_gb >= 0.1 else 0
    return ServerFacts(
        endpoint=endpoint, model=model, block_size=1, num_gpu_blocks=info.kv_pool, kv_pool=info.kv_pool,
        max_model_len=int(card.get("max_model_len") or found.get("context_length") or 32_768),
        max_num_batched_tokens=budget, max_num_seqs=seqs or int(found.get("max_running_requests") or 1024),
        budget_source=source, kv_bytes_per_token=per_tok,
        version=version, engine="sglang",
    )


def _kv_gb(info: Any) -> float | None:
    """SGLang's KV cache size in GB (``memory_usage.kvcache`` of its internal state), if it says."""
    states = info.get("internal_states") if type(info) is dict else None
    for st in states if type(states) is list else [info]:
        mem = st.get("memory_usage") if type(st) is dict else None
        kv = mem.get("kvcache") if type(mem) is dict else None
        if isinstance(kv, int | float) and not isinstance(kv, bool) and kv > 0:
            return float(kv)
    return None


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


async def measure(
    endpoint: str,
    *,
    plan: Plan | None = None,
    time_scale: float = 1.0,
    max_num_batched_tokens: int | None = None,
    max_num_seqs: int | None = None,
    api_key: str | None = None,
    seed: int | None = None,
    progress: Progress | None = None,
    timeout_s: float = 600.0,
) -> Measured:
    from kvgate.drive.client import normalize_endpoint

    base = normalize_endpoint(endpoint)
    say = progress or (lambda _m: None)
    rng = random.Random(seed if seed is not None else random.SystemRandom().getrandbits(64))  # fresh content
    http = _Http(base, api_key, timeout_s)
    t_start = time.perf_counter()
    try:
        facts = await probe(http, base, max_num_batched_tokens, max_num_seqs)
        http.model = facts.model
        http.max_model_len = facts.max_model_len
        http.kv_pool = facts.kv_pool
        plan = scaled_plan(plan or Plan(), facts)
        say(
            f"{base}: {facts.model}, pool {facts.kv_pool} tokens ({facts.num_gpu_blocks} blocks of "
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

        await _prefills(http, plan, m, uniq, time_scale, say)
        for C in plan.decode_contexts:
            for B in plan.decode_batches:
                if B * (C + plan.decode_tokens) > facts.kv_pool * 0.8:
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
        for B, C, n in plan.mixed if facts.engine == "vllm" else ():  # SGLang never mixes prefill and decode
            reps = [await _mixed(http, B, C, n, uniq, time_scale) for _ in range(plan.reps)]
            sample = min(reps, key=lambda x: x.seconds)
            m.samples.append(sample)
            say(f"mixed          {n:>6} cold beside {B:>3} decoders at {C:>6}: {sample.seconds:.3f} s to first token")
        say(f"c(L) load: {plan.load_workers} workers, unique prompts of {plan.load_prompt[0]}-{plan.load_prompt[1]} "
            f"tokens, {plan.load_seconds:g} s")
        m.load = await _load(http, plan, rng, time_scale)
        m.wall_s = time.perf_counter() - t_start
        return m
    finally:
        await http.close()


async def _prefills(http: _Http, plan: Plan, m: Measured, uniq: Callable[[int], list[int]], time_scale: float,
                    say: Progress) -> None:
    """Cold and incremental prefills, one request at a time; beside each, where the server times its requests, the
    part of its time to first token spent outside the engine, and from those the request time of the profile."""
    names = kind_of(m.facts.engine).metrics.engine_time
    timed = await http.engine_seconds(names) is not None

    async def ttft(prompt: list[int]) -> tuple[float, int | None]:
        """A request's time to first token; beside it, the part outside the engine, when the server says."""
        e0 = await http.engine_seconds(names) if timed else None
        sent, first, _, _, cached = await http.complete(prompt, 1)
        e1 = await http.engine_seconds(names) if timed else None
        t = (first - sent) * time_scale
        if e0 is not None and e1 is not None:
            m.front.append((len(prompt), max(0.0, t - (e1 - e0) * time_scale)))
        return t, cached

    for L in plan.cold:
        ts = []
        for _ in range(plan.reps):
            t, cached = await ttft(uniq(L))
            ts.append(t)
        m.samples.append(Sample("cold", L, int(cached or 0), 1, 1, min(ts)))
        say(f"cold prefill   {L:>6} tokens: {min(ts):.3f} s ({L / min(ts):,.0f} tok/s)")
        if cached:
            say(f"  note: {cached} of the {L} 'cold' tokens were cached")
    for P, n in plan.incremental:
        ts = []
        for _ in range(plan.reps):
            base_prompt = uniq(P)
            await http.complete(base_prompt, 1)
            t, cached = await ttft(base_prompt + uniq(n))
            c = int(cached or 0)
            ts.append(t)
        m.samples.append(Sample("incremental", P + n, c, 1, 1, min(ts)))
        say(f"incremental    {n:>6} new on {P:>6} (hit {c}): {min(ts):.3f} s")
    m.request_s, m.request_per_token_s = request_time(m.front, m.request_s)
    say(f"the way to the engine and back: {m.request_s * 1000:.1f} ms + {m.request_per_token_s * 1e6:.2f} us "
        f"per prompt token ({len(m.front)} requests timed by the engine too)" if m.front else
        "the server does not time its requests (no engine-time histograms): the way to the engine is taken as "
        f"the /tokenize round trip, {m.request_s * 1000:.1f} ms")


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
    # Decode for as long as the context and the pool allow (the decoders are cancelled once the sample is taken):
    # on a busy machine the cold request may reach the engine late, and decoders that finished first spoil it.
    room = int(0.8 * http.kv_pool - n) // B - C if http.kv_pool else 0
    long = max(long, min(http.max_model_len - C - 8, room))
    tasks = [asyncio.ensure_future(http.complete(pr, long, tick(i))) for i, pr in enumerate(prompts)]
    waiter = asyncio.ensure_future(ready.wait())
    try:
        # every decoder streaming, or one of them ended first (failed: say why at once, not after the timeout)
        await asyncio.wait([waiter, *tasks], timeout=http.timeout.total, return_when=asyncio.FIRST_COMPLETED)
        if not ready.is_set():
            _decoders_ended(tasks)
            raise UsageError(f"a decoder of the mixed measurement streamed {min(counts)} tokens in "
                             f"{http.timeout.total:g} s (3 needed): the server is stalled or overloaded")
        sent, first, _, _, cached = await http.complete(uniq(n), 1)
        _decoders_ended(tasks)
    finally:
        for t in (waiter, *tasks):
            t.cancel()
        await asyncio.gather(waiter, *tasks, return_exceptions=True)
    return Sample("mixed", n, int(cached or 0), B, C, (first - sent) * scale)


def _decoders_ended(tasks: Sequence[asyncio.Future[Any]]) -> None:
    """Raise if a decoder of a mixed measurement has ended (it must still be decoding when the sample is taken)."""
    for t in tasks:
        if t.done():
            exc = t.exception()
            if exc is not None:
                raise UsageError(f"a decoder of the mixed measurement failed: {exc}")
            raise UsageError("the decoders finished before the mixed measurement; the context limit is too small")


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
    )
    if progress:
        progress("fitting")
    return fit(m, name or f"calibrated-{m.facts.model.replace('/', '-')}", note)
