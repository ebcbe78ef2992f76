"""``kvgate engine``: the simulated engine over HTTP, driven with the official ``openai`` client on loopback.

Servers run in-process on a free port (one test starts ``kvgate engine`` as a subprocess and stops it with
SIGTERM); every test is bounded by ``asyncio.timeout``. High time scales keep the simulated seconds cheap.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import signal
import subprocess
import sys
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families

from kvgate.engine.base import Request
from kvgate.engine.blocks import SeqKey
from kvgate.engine.costmodel import QWEN3_8B_MI300X as P
from kvgate.engine.sglang import SglangEngine
from kvgate.engine.vllm import VllmEngine
from kvgate.errors import UsageError
from kvgate.http.openai import parse_cache_config
from kvgate.serve.app import EngineServer
from kvgate.serve.command import command
from kvgate.serve.config import ServerConfig
from kvgate.serve.tokenizer import BLOCK, Tokenizer, filler_ids, filler_text
from support.ports import free_port

MODEL = "Qwen/Qwen3-8B"
FAST = 2000.0  # time scale of tests that do not watch the clock


@contextlib.asynccontextmanager
async def served(cfg: ServerConfig | None = None, engine: Any = None) -> AsyncIterator[tuple[EngineServer, str]]:
    server = EngineServer(cfg or ServerConfig(time_scale=FAST), engine)
    port = await server.start("127.0.0.1", 0)
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        await server.stop()


def client(base: str) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=20.0)


async def get_json(base: str, path: str) -> Any:
    async with aiohttp.ClientSession() as s, s.get(base + path) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def post(base: str, path: str, body: Any = None, raw: bytes | None = None) -> tuple[int, Any]:
    data = raw if raw is not None else (json.dumps(body).encode() if body is not None else b"")
    async with aiohttp.ClientSession() as s, s.post(base + path, data=data) as r:
        text = await r.text()
        try:
            return r.status, json.loads(text)
        except ValueError:
            return r.status, text


async def metrics(base: str) -> dict[str, float]:
    async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
        text = await r.text()
    out = {}
    for fam in text_string_to_metric_families(text):
        for smp in fam.samples:
            out[smp.name] = smp.value
    return out


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(100_000) for _ in range(n)]


def in_process(make: Callable[[], Any], seq: SeqKey, turns: list[tuple[int, int]]) -> list[int]:
    """Cached tokens of consecutive turns (prompt, output) of one session on an in-process engine."""
    eng = make()
    now = 0.0
    out = []
    for i, (p, o) in enumerate(turns):
        req = Request(i + 1, seq, p, o, now, None)
        eng.add(req)
        while eng.has_work():
            now += eng.step(now).duration
        out.append(req.cached)
    return out


# -- the OpenAI surface ---------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_completions_stream_and_not() -> None:
    async with asyncio.timeout(20), served() as (_, base):
        c = client(base)
        r = await c.completions.create(model=MODEL, prompt="Hello there, engine!", max_tokens=7,
                                       extra_body={"ignore_eos": True, "min_tokens": 7})
        u = r.usage
        assert u is not None and u.completion_tokens == 7 and u.total_tokens == u.prompt_tokens + 7
        assert u.prompt_tokens_details is not None and u.prompt_tokens_details.cached_tokens == 0
        assert r.choices[0].finish_reason == "length" and r.choices[0].text == filler_text(0, 7, False)
        tok = Tokenizer()
        assert len(tok.encode(r.choices[0].text)) == 7
        assert u.prompt_tokens == len(tok.encode("Hello there, engine!"))
        # a list of token ids, and a list holding one prompt; no ignore_eos: still max_tokens
        r2 = await c.completions.create(model=MODEL, prompt=[5, 6, 7, 8], max_tokens=3)
        assert r2.usage is not None and r2.usage.prompt_tokens == 4 and r2.usage.completion_tokens == 3
        r3 = await c.completions.create(model=MODEL, prompt=["Hello there, engine!"], max_tokens=2)
        assert r3.usage is not None and r3.usage.prompt_tokens == u.prompt_tokens
        # streamed: one event per token, in order, then the usage chunk
        chunks = []
        stream = await c.completions.create(model=MODEL, prompt="Hello there, engine!", max_tokens=40, stream=True,
                                            stream_options={"include_usage": True})
        async for ch in stream:
            chunks.append(ch)
        text = "".join(ch.choices[0].text for ch in chunks if ch.choices)
        assert text == filler_text(0, 40, False)
        assert [ch.choices[0].finish_reason for ch in chunks if ch.choices][-1] == "length"
        last = chunks[-1]
        assert not last.choices and last.usage is not None and last.usage.completion_tokens == 40
        assert last.usage.prompt_tokens_details is not None and last.usage.prompt_tokens_details.cached_tokens == 0
        # without include_usage no usage chunk
        stream = await c.completions.create(model=MODEL, prompt=[1, 2, 3], max_tokens=5, stream=True)
        got = [ch async for ch in stream]
        assert len(got) == 5 and all(ch.choices for ch in got)


@pytest.mark.asyncio
async def test_chat_stream_and_not() -> None:
    async with asyncio.timeout(20), served() as (_, base):
        c = client(base)
        msgs: list[Any] = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "ls -la"}]
        r = await c.chat.completions.create(model=MODEL, messages=msgs, max_completion_tokens=12)
        u = r.usage
        assert u is not None and u.completion_tokens == 12
        content = r.choices[0].message.content
        assert content == filler_text(0, 12, True) and not content.startswith(" ")
        assert len(Tokenizer().encode(content)) == 12
        status, tk = await post(base, "/tokenize", {"model": MODEL, "messages": msgs})
        assert status == 200 and tk["count"] == u.prompt_tokens and tk["max_model_len"] == P.max_model_len
        other: list[Any] = [{"role": "user", "content": "something else"}]
        stream = await c.chat.completions.create(model=MODEL, messages=other, max_tokens=9, stream=True,
                                                 stream_options={"include_usage": True})
        chunks = [ch async for ch in stream]
        assert chunks[0].choices[0].delta.role == "assistant"
        text = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
        assert text == filler_text(0, 9, True)
        assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 9
        # the next turn extends the conversation: what the first turn computed is cached, as in-process
        msgs2 = [*msgs, {"role": "assistant", "content": content}, {"role": "user", "content": "and now? " * 20}]
        r2 = await c.chat.completions.create(model=MODEL, messages=msgs2, max_tokens=4)
        assert r2.usage is not None and r2.usage.prompt_tokens_details is not None
        want = in_process(lambda: VllmEngine(P), SeqKey(0, 0, 1), [(u.prompt_tokens, 12), (r2.usage.prompt_tokens, 4)])
        assert r2.usage.prompt_tokens_details.cached_tokens == want[1] == (u.prompt_tokens + 12 - 1) // BLOCK * BLOCK


@pytest.mark.asyncio
async def test_return_token_ids() -> None:
    async with asyncio.timeout(20), served() as (_, base):
        req = {"model": MODEL, "prompt": [9, 8, 7], "max_tokens": 6, "return_token_ids": True}
        status, body = await post(base, "/v1/completions", req)
        assert status == 200
        assert body["choices"][0]["token_ids"] == filler_ids(6, False)
        assert body["choices"][0]["prompt_token_ids"] == [9, 8, 7]


# -- cache semantics ------------------------------------------------------------------------------------------
@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.asyncio
async def test_second_turn_cached_equals_in_process(engine: str) -> None:
    """paper-8b's first two turns: 2000 shared + 4000 unique tokens, 300 out, 1000 appended."""
    rng = random.Random(7)
    turn0 = ids(rng, 6000)
    turn1 = turn0 + filler_ids(300, False) + ids(rng, 1000)
    async with asyncio.timeout(20), served(ServerConfig(time_scale=FAST, engine=engine)) as (_, base):
        c = client(base)
        cached = []
        for prompt in (turn0, turn1):
            r = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=300,
                                           extra_body={"ignore_eos": True})
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            cached.append(r.usage.prompt_tokens_details.cached_tokens)
    if engine == "vllm":
        want = in_process(lambda: VllmEngine(P), SeqKey(0, 125, 1), [(6000, 300), (7300, 300)])
    else:
        want = in_process(lambda: SglangEngine(P), SeqKey(0, 2000, 1), [(6000, 300), (7300, 300)])
    assert cached == want
    assert want[1] > 6000


@pytest.mark.asyncio
async def test_sessions_share_only_their_common_prefix() -> None:
    rng = random.Random(11)
    shared = ids(rng, 2000)
    a0, b0, c0 = (shared + ids(rng, 3000) for _ in range(3))
    async with asyncio.timeout(20), served() as (server, base):
        c = client(base)

        async def turn(prompt: list[int], session: str | None = None) -> int:
            hdrs = {"X-Session-ID": session} if session else None
            r = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=50, extra_headers=hdrs)
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            return r.usage.prompt_tokens_details.cached_tokens or 0

        assert await turn(a0, "a") == 0
        # the shared prefix is seen a second time: it becomes a group (this session still computes it)
        assert await turn(b0, "b") == 0
        assert await turn(c0, "c") == 2000  # shares exactly the block-aligned common prefix, no more
        a1 = a0 + filler_ids(50, False) + ids(rng, 500)
        assert await turn(a1, "a") == 5040  # all of a's 5050 tokens, in whole blocks
        # a prompt that extends nothing: only what it really shares
        assert await turn(ids(rng, 3000)) == 0
        # a's turn-0 prompt edited at token 4000 (a client rewriting history): with a's session id the
        # hit is the common prefix (the cap), never more
        edited = a0[:4000] + ids(rng, 900)
        assert await turn(edited, "a") == 4000
        # and a request that continues the edited branch continues it
        assert await turn(edited + filler_ids(50, False) + ids(rng, 10), "a") == 4944
        assert server.bridge.counts["groups"] == 1


@pytest.mark.asyncio
async def test_retry_of_the_same_prompt_hits_it() -> None:
    prompt = ids(random.Random(3), 3000)
    async with asyncio.timeout(20), served() as (_, base):
        c = client(base)
        got = []
        for _ in range(2):
            r = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=30)
            assert r.usage is not None and r.usage.prompt_tokens_details is not None
            got.append(r.usage.prompt_tokens_details.cached_tokens)
    assert got == in_process(lambda: VllmEngine(P), SeqKey(0, 0, 1), [(3000, 30), (3000, 30)])
    assert got[1] == 2992


@pytest.mark.asyncio
async def test_reset_prefix_cache_drops_hits() -> None:
    rng = random.Random(5)
    t0 = ids(rng, 4000)
    t1 = t0 + filler_ids(20, False) + ids(rng, 100)
    async with asyncio.timeout(20), served() as (_, base):
        c = client(base)
        await c.completions.create(model=MODEL, prompt=t0, max_tokens=20)
        status, _ = await post(base, "/reset_prefix_cache")
        assert status == 200
        r = await c.completions.create(model=MODEL, prompt=t1, max_tokens=20)
        assert r.usage is not None and r.usage.prompt_tokens_details is not None
        assert r.usage.prompt_tokens_details.cached_tokens == 0
        m = await metrics(base)
        assert m["vllm:prefix_cache_hits_total"] == 0


@pytest.mark.asyncio
async def test_reset_prefix_cache_while_running() -> None:
    async with asyncio.timeout(20), served(ServerConfig(time_scale=20.0)) as (_, base):
        c = client(base)
        task = asyncio.create_task(c.completions.create(model=MODEL, prompt=ids(random.Random(1), 2000),
                                                        max_tokens=400))
        while (await metrics(base))["vllm:num_requests_running"] < 1:
            await asyncio.sleep(0.01)
        status, body = await post(base, "/reset_prefix_cache")
        assert status == 409 and body["error"]["code"] == 409
        status, _ = await post(base, "/reset_prefix_cache", {"reset_running_requests": True})
        assert status == 200
        r = await task  # preempted, recomputed, finished
        assert r.usage is not None and r.usage.completion_tokens == 400
        m = await metrics(base)
        assert m["vllm:num_preemptions_total"] == 1


@pytest.mark.asyncio
async def test_engine_fields_reach_the_engine() -> None:
    """ServerConfig is the engine's config plus serving's: with max_num_seqs 1 the engine runs one at a time."""
    async with asyncio.timeout(20), served(ServerConfig(time_scale=20.0, max_num_seqs=1)) as (_, base):
        c = client(base)
        tasks = [asyncio.create_task(c.completions.create(model=MODEL, prompt=ids(random.Random(i), 500),
                                                          max_tokens=3000)) for i in range(2)]
        try:
            while True:
                m = await metrics(base)
                if m["vllm:num_requests_running"] + m["vllm:num_requests_waiting"] >= 2:
                    break
                await asyncio.sleep(0.01)
            assert m["vllm:num_requests_running"] == 1 and m["vllm:num_requests_waiting"] == 1
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


@pytest.mark.asyncio
async def test_client_disconnect_aborts() -> None:
    async with asyncio.timeout(20), served(ServerConfig(time_scale=2.0)) as (_, base):
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL, "prompt": [1] * 500, "max_tokens": 5000, "stream": True}
            async with s.post(base + "/v1/completions", json=body) as r:
                assert r.status == 200
                first = await r.content.readuntil(b"\n\n")
                assert first.startswith(b"data: {")
                assert (await metrics(base))["vllm:num_requests_running"] == 1
        for _ in range(200):
            m = await metrics(base)
            if m["vllm:num_requests_running"] == 0:
                break
            await asyncio.sleep(0.01)
        assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0.0


# -- the rest of the surface --------------------------------------------------------------------------------------
@pytest.mark.asyncio
async def test_metrics_names_and_models() -> None:
    async with asyncio.timeout(20), served() as (_, base):
        await client(base).completions.create(model=MODEL, prompt=[3] * 40, max_tokens=5)
        async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
            assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
            text = await r.text()
        fams = {f.name: f for f in text_string_to_metric_families(text)}
        for name in ("vllm:num_requests_running", "vllm:num_requests_waiting", "vllm:kv_cache_usage_perc",
                     "vllm:prefix_cache_queries", "vllm:prefix_cache_hits", "vllm:num_preemptions",
                     "vllm:prompt_tokens", "vllm:generation_tokens", "vllm:cache_config_info"):
            assert name in fams, name
            assert fams[name].samples[0].labels["model_name"] == MODEL
        for name in ("vllm:prefix_cache_queries_total", "vllm:prefix_cache_hits_total", "vllm:num_preemptions_total",
                     "vllm:prompt_tokens_total", "vllm:generation_tokens_total"):
            assert f"\n{name}{{" in text, name
        info = fams["vllm:cache_config_info"].samples[0]
        assert info.value == 1.0
        # as vLLM reports it: the usable blocks plus its null block, so (num_gpu_blocks - 1) x block_size is the pool
        assert info.labels["block_size"] == "16" and info.labels["num_gpu_blocks"] == "25001"
        assert info.labels["hash_block_size"] == "16"
        found = parse_cache_config(text)
        assert found is not None and found.kv_pool == 400_000 == P.kv_pool
        # kv_cache_size_tokens is vLLM's max_model_len x (whole max-length requests that fit), not the pool
        assert int(info.labels["kv_cache_size_tokens"]) == int(25001 / -(-P.max_model_len // 16) * P.max_model_len)
        m = await metrics(base)
        assert m["vllm:prompt_tokens_total"] == 40 and m["vllm:generation_tokens_total"] == 5
        assert m["vllm:prefix_cache_queries_total"] == 40
        models = await get_json(base, "/v1/models")
        assert models["data"][0]["id"] == MODEL and models["data"][0]["max_model_len"] == P.max_model_len
        async with aiohttp.ClientSession() as s, s.get(base + "/health") as r:
            assert r.status == 200
        async with aiohttp.ClientSession() as s, s.get(base + "/server_info") as r:
            assert r.status == 404  # SGLang's endpoints only with --engine sglang


@pytest.mark.parametrize("block", [16, 128, 8])
@pytest.mark.asyncio
async def test_block_size_sets_the_pool_its_hashing_and_its_report(block: int) -> None:
    # --block-size: the pool's blocks, the cached prefix's granularity, vllm:cache_config_info and the usage
    cfg = ServerConfig(time_scale=FAST, kv_pool=100_000, block_size=block)
    async with asyncio.timeout(20), served(cfg) as (server, base):
        async with aiohttp.ClientSession() as s, s.get(base + "/metrics") as r:
            found = parse_cache_config(await r.text())
        assert found is not None and found.block_size == block
        assert found.kv_pool == server.kv_pool == 100_000 // block * block
        c = client(base)
        rng = random.Random(block)
        prompt = ids(rng, 1000)
        first = await c.completions.create(model=MODEL, prompt=prompt, max_tokens=4)
        # the next turn: the previous prompt, its output, 300 new tokens; cached = whole blocks of what it shares
        nxt = prompt + filler_ids(4, False) + ids(rng, 300)
        second = await c.completions.create(model=MODEL, prompt=nxt, max_tokens=4)
        assert first.usage is not None and second.usage is not None
        details = second.usage.prompt_tokens_details
        assert details is not None and details.cached_tokens == 1004 // block * block
        # vLLM 0.32's created_cache_tokens: prompt tokens computed into full (cached) blocks
        dump = second.usage.model_dump()
        assert dump["prompt_tokens_details"]["created_cache_tokens"] == 1304 // block * block - 1004 // block * block
        want = in_process(lambda: VllmEngine(P, 100_000, block_size=block), SeqKey(0, 0, 1), [(1000, 4), (1304, 4)])
        assert details.cached_tokens == want[1]


def test_block_size_is_checked() -> None:
    for bad in (0, 24, 100):
        with pytest.raises(UsageError, match="--block-size"):
            ServerConfig(block_size=bad).validate()
    ServerConfig(block_size=256).validate()
    ServerConfig(engine="sglang").validate()  # the engine config's block size; SGLang's page is 1 token whatever


def test_block_size_with_sglang_is_refused_on_the_command_line() -> None:
    from click.testing import CliRunner

    res = CliRunner().invoke(command, ["--engine", "sglang", "--block-size", "16"])
    assert res.exit_code != 0 and isinstance(res.exception, UsageError) and "SGLang" in str(res.exception)


@pytest.mark.asyncio
async def test_errors_are_json() -> None:
    async with asyncio.timeout(20), served() as (_, base):
        c = client(base)
        with pytest.raises(openai.BadRequestError) as ei:
            await c.completions.create(model=MODEL, prompt=[1] * 40_000, max_tokens=1000)
        assert ei.value.status_code == 400
        status, body = await post(base, "/v1/completions", {"model": MODEL, "prompt": [1] * 40_000, "max_tokens": 1000})
        assert status == 400 and body["error"]["type"] == "BadRequestError" and body["error"]["code"] == 400
        assert "maximum context length is 40960 tokens" in body["error"]["message"]
        long_chat = {"model": MODEL, "messages": [{"role": "user", "content": "x " * 41_000}]}
        status, body = await post(base, "/v1/chat/completions", long_chat)
        assert status == 400 and "maximum context length" in body["error"]["message"]
        status, body = await post(base, "/v1/completions", raw=b'{"model": "x", "prompt": ')
        assert status == 400 and body["error"]["code"] == 400
        bad: Any
        for bad in ({"model": MODEL}, {"model": MODEL, "prompt": [1.5, 2]}, {"model": MODEL, "prompt": [-1]},
                    {"model": MODEL, "prompt": "hi", "max_tokens": 0}, {"model": MODEL, "prompt": "hi", "n": 2},
                    {"model": MODEL, "prompt": ["a", "b"]}, [1, 2],
                    {"model": MODEL, "prompt": "hi", "max_tokens": 5, "min_tokens": 6}):
            status, body = await post(base, "/v1/completions", bad)
            assert status == 400 and body["error"]["type"] == "BadRequestError", bad
        for bad in ({"model": MODEL}, {"model": MODEL, "messages": []}, {"model": MODEL, "messages": [{"x": 1}]}):
            status, body = await post(base, "/v1/chat/completions", bad)
            assert status == 400 and body["error"]["code"] == 400, bad
        with pytest.raises(openai.NotFoundError):
            await c.completions.create(model="gpt-4", prompt="hi", max_tokens=1)
        status, body = await post(base, "/v1/completions", {"model": "gpt-4", "prompt": "hi"})
        assert status == 404 and body["error"]["type"] == "NotFoundError"
        status, body = await post(base, "/v1/nothing", {})
        assert status == 404 and body == {"detail": "Not Found"}


@settings(max_examples=200, deadline=None)
@given(
    x=st.text(alphabet=st.characters(exclude_characters="<"), max_size=60),
    y=st.text(alphabet=st.characters(exclude_characters="<"), max_size=30),
    z=st.text(alphabet=st.characters(exclude_characters="<"), max_size=30),
)
def test_tokenizer_equal_prefixes_give_equal_token_prefixes(x: str, y: str, z: str) -> None:
    tok = Tokenizer()
    tx = tok.encode(x)
    keep = tx[:-1]
    assert tok.encode(x + y)[: len(keep)] == keep
    assert tok.encode(x + z)[: len(keep)] == keep
    # the filler output appended to any prompt tokenizes to prompt + output
    assert tok.encode(x + filler_text(0, 9, False)) == tx + filler_ids(9, False)


@pytest.mark.asyncio
async def test_tokenize_endpoint_equal_prefix() -> None:
    rng = random.Random(2)
    words = ["alpha", "beta", "gamma", "12345", ", ", "\n", "  ", "déjà", "vu!", "x_y"]
    async with asyncio.timeout(20), served() as (_, base):
        for _ in range(10):
            x = "".join(rng.choice(words) for _ in range(30))
            y, z = ("".join(rng.choice(words) for _ in range(5)) for _ in range(2))
            _, a = await post(base, "/tokenize", {"prompt": x + y})
            _, b = await post(base, "/tokenize", {"prompt": x + z})
            _, p = await post(base, "/tokenize", {"prompt": x})
            k = p["count"] - 1
            assert a["tokens"][:k] == b["tokens"][:k] == p["tokens"][:k]
            assert a["max_model_len"] == P.max_model_len and a["count"] == len(a["tokens"])


@pytest.mark.asyncio
async def test_sglang_surface() -> None:
    async with asyncio.timeout(20), served(ServerConfig(engine="sglang", time_scale=2.0)) as (_, base):
        info = await get_json(base, "/server_info")
        assert info["max_total_num_tokens"] == 400_000 and info["page_size"] == 1
        status, _ = await post(base, "/flush_cache")
        assert status == 200
        async with aiohttp.ClientSession() as s:
            body = {"model": MODEL, "messages": [{"role": "user", "content": "go"}], "max_tokens": 5000,
                    "stream": True}
            async with s.post(base + "/v1/chat/completions", json=body) as r:
                await r.content.readuntil(b"\n\n")
                status, text = await post(base, "/flush_cache")
                assert status == 400 and "failed" in text
        for _ in range(200):  # the disconnect aborted the request
            status, _ = await post(base, "/flush_cache")
            if status == 200:
                break
            await asyncio.sleep(0.01)
        assert status == 200
        m = await metrics(base)
        assert "sglang:num_running_reqs" in m and "vllm:num_requests_running" in m


@pytest.mark.asyncio
async def test_sglang_surface_over_the_vllm_engine() -> None:
    """The API flavour and the engine model are independent: SGLang's endpoints over the vLLM engine."""
    cfg = ServerConfig(engine="sglang", time_scale=FAST)
    async with asyncio.timeout(20), served(cfg, VllmEngine(P)) as (_, base):
        info = await get_json(base, "/server_info")
        assert info["page_size"] == 16
        r = await client(base).completions.create(model=MODEL, prompt=[4] * 100, max_tokens=3)
        assert r.usage is not None and r.usage.completion_tokens == 3
        status, _ = await post(base, "/flush_cache")
        assert status == 200


@pytest.mark.asyncio
async def test_engine_failure_is_a_json_error() -> None:
    eng = VllmEngine(P)

    def boom(now: float, horizon: float = 0.0) -> Any:
        raise RuntimeError("simulated bug")

    eng.step = boom  # type: ignore[method-assign]
    async with asyncio.timeout(20), served(engine=eng) as (_, base):
        status, body = await post(base, "/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": 3})
        assert status == 503 and body["error"]["type"] == "ServiceUnavailableError"
        assert "simulated bug" in body["error"]["message"] and "Traceback" not in body["error"]["message"]
        async with aiohttp.ClientSession() as s, s.get(base + "/health") as r:
            assert r.status == 503


@pytest.mark.asyncio
async def test_shutdown_answers_requests_in_flight() -> None:
    async with asyncio.timeout(20), served(ServerConfig(time_scale=1.0)) as (server, base):
        task = asyncio.create_task(post(base, "/v1/completions", {"model": MODEL, "prompt": [1] * 50,
                                                                  "max_tokens": 3000}))
        while (await metrics(base))["vllm:num_requests_running"] < 1:
            await asyncio.sleep(0.01)
        await server.stop()
        status, body = await task
        assert status == 503 and "shutting down" in body["error"]["message"]


# -- the command ----------------------------------------------------------------------------------------------------


@pytest.mark.asyncio
async def test_command_subprocess_sigterm() -> None:
    port = free_port()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvgate.cli", "engine", "--port", str(port), "--time-scale", "1000",
         "--kv-pool", "100000", "--model", "sim"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )
    base = f"http://127.0.0.1:{port}"
    try:
        async with asyncio.timeout(25):
            while True:
                try:
                    async with aiohttp.ClientSession() as s, s.get(base + "/health") as r:
                        if r.status == 200:
                            break
                except aiohttp.ClientConnectionError:
                    assert proc.poll() is None, proc.stderr.read() if proc.stderr else ""
                    await asyncio.sleep(0.05)
            done = await client(base).completions.create(model="sim", prompt="one two three", max_tokens=4)
            assert done.usage is not None and done.usage.completion_tokens == 4
            m = await metrics(base)
            assert m["vllm:cache_config_info"] == 1.0
            proc.send_signal(signal.SIGTERM)
            while proc.poll() is None:
                await asyncio.sleep(0.05)
        assert proc.returncode == 0
        err = proc.stderr.read().decode() if proc.stderr else ""
        assert "serving sim at http://127.0.0.1" in err and "stopped" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_command_help_and_bad_flags() -> None:
    from click.testing import CliRunner

    res = CliRunner().invoke(command, ["--help"])
    assert res.exit_code == 0 and "--time-scale" in res.output and "--no-prefix-cache" in res.output
    res = CliRunner().invoke(command, ["--time-scale", "0"])
    assert res.exit_code != 0
