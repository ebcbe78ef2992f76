"""The gateway in front of a real vLLM (CPU build, tiny random-weight Llama): pool discovery, the OpenAI API through
it, prefix-cache hits per session, parking under the budgeter, aborts on client disconnect, upstream restarts.

One shared server (``real_vllm_server``: 16,384 usable tokens in blocks of 128) serves every test; the restart test
starts one more. Prompts are token ids where exact lengths matter (the gateway then knows L_s exactly).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import random
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import openai
import pytest

from kvgate.gateway import Gateway, GatewayConfig
from kvgate.http.openai import parse_cache_config
from kvgate.realengine import free_port, live_group_members
from kvgate.realvllm.server import RealVllm
from support.aio import timed
from support.real_vllm import BLOCK, metric, usable_pool

pytestmark = pytest.mark.real_vllm
SRC = str(Path(__file__).resolve().parents[2] / "src")
MODEL = "tiny-llama"


@contextlib.asynccontextmanager
async def gateway(upstream: str, **cfg: Any) -> AsyncIterator[tuple[Gateway, str, aiohttp.ClientSession]]:
    gw = Gateway(GatewayConfig(upstream=upstream, **cfg))
    client = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))
    try:
        port = await gw.start("127.0.0.1", 0)
        yield gw, f"http://127.0.0.1:{port}", client
    finally:
        await client.close()
        await gw.stop()


async def get_json(client: aiohttp.ClientSession, url: str) -> Any:
    async with client.get(url) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def get_text(client: aiohttp.ClientSession, url: str) -> str:
    async with client.get(url) as r:
        assert r.status == 200
        return await r.text()


async def complete(
    client: aiohttp.ClientSession, base: str, prompt: list[int], max_tokens: int, session: str | None = None,
    headers: dict[str, str] | None = None, **kw: Any,
) -> tuple[int, dict[str, Any]]:
    """One completion with a token-id prompt; returns (status, body)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "return_token_ids": True,
            **kw}
    headers = {**({"X-Session-ID": session} if session else {}), **(headers or {})}
    async with client.post(base + "/v1/completions", json=body, headers=headers) as r:
        return r.status, await r.json(content_type=None)


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 30000) for _ in range(n)]


def cached(body: dict[str, Any]) -> int:
    return int(body["usage"]["prompt_tokens_details"]["cached_tokens"])


# -- pool discovery ------------------------------------------------------------------------------------------------
def test_gateway_command_discovers_the_real_servers_pool(real_vllm_server: RealVllm, tmp_path: Path) -> None:
    port = free_port()
    cmd = [sys.executable, "-m", "kvgate.cli", "gateway", "--upstream", real_vllm_server.url, "--port", str(port)]
    log = open(tmp_path / "gateway.log", "wb")  # noqa: SIM115
    proc = subprocess.Popen(cmd, env={**os.environ, "PYTHONPATH": SRC}, stdout=log, stderr=subprocess.STDOUT)
    try:

        async def control() -> dict[str, Any]:
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as c:
                for _ in range(300):
                    with contextlib.suppress(aiohttp.ClientError, OSError):
                        return await get_json(c, f"http://127.0.0.1:{port}/admin/control")  # type: ignore[no-any-return]
                    assert proc.poll() is None, (tmp_path / "gateway.log").read_text()
                    await asyncio.sleep(0.1)
            raise AssertionError("the gateway did not come up")

        state = asyncio.run(control())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
        log.close()
    assert state["kv_pool_source"] == "/metrics"
    assert state["control"] == "budgeter"
    # what vLLM's own cache_config_info says, read the way the gateway documents it
    assert state["kv_pool"] == _pool(real_vllm_server.metrics())


@timed(60)
async def test_gateway_pool_is_the_pool_vllm_can_fill(real_vllm_server: RealVllm) -> None:
    async with gateway(real_vllm_server.url) as (gw, _, _):
        assert gw.kv_pool == usable_pool(real_vllm_server)


# -- the OpenAI API through the gateway ------------------------------------------------------------------------------
@timed(120)
async def test_openai_client_completions_and_chat_streamed_and_not(real_vllm_server: RealVllm) -> None:
    async with gateway(real_vllm_server.url) as (gw, base, http):
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=60)
        try:
            hdr = {"X-Session-ID": "chat-1"}
            extra = {"ignore_eos": True}
            words = " ".join(random.Random(1).choices(["the", "file", "code", "test", "line", "value"], k=300))
            msgs: list[Any] = [{"role": "system", "content": words}, {"role": "user", "content": "run the test"}]
            chat = await client.chat.completions.create(
                model=MODEL, messages=msgs, max_tokens=8, extra_headers=hdr, extra_body=extra
            )
            reply = chat.choices[0].message.content
            assert reply and chat.usage is not None and chat.usage.completion_tokens == 8
            assert chat.usage.prompt_tokens > 300
            msgs += [{"role": "assistant", "content": reply}, {"role": "user", "content": "and the code " * 40}]

            # streamed chat without include_usage: the text arrives in chunks, no usage chunk reaches the client
            stream = await client.chat.completions.create(
                model=MODEL, messages=msgs, max_tokens=8, stream=True, extra_headers=hdr, extra_body=extra
            )
            chunks = [c async for c in stream]
            text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
            assert text and all(c.usage is None for c in chunks)
            msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "again " * 30}]

            # streamed chat with include_usage: the usage chunk comes last, with cached tokens of the history
            stream = await client.chat.completions.create(
                model=MODEL, messages=msgs, max_tokens=8, stream=True, stream_options={"include_usage": True},
                extra_headers=hdr, extra_body=extra,
            )
            chunks = [c async for c in stream]
            last = chunks[-1]
            assert last.choices == [] and last.usage is not None and last.usage.completion_tokens == 8
            assert last.usage.prompt_tokens_details is not None
            assert last.usage.prompt_tokens_details.cached_tokens >= BLOCK * (chat.usage.prompt_tokens // BLOCK)

            # completions with token ids, plain and streamed
            rng = random.Random(2)
            prompt = ids(rng, 300)
            chdr = {"X-Session-ID": "comp-1"}
            comp = await client.completions.create(
                model=MODEL, prompt=prompt, max_tokens=6, extra_headers=chdr, extra_body=extra
            )
            assert comp.usage is not None and comp.usage.prompt_tokens == 300 and comp.usage.completion_tokens == 6
            assert comp.choices[0].text
            prompt2 = prompt + ids(rng, 100)
            cstream = await client.completions.create(
                model=MODEL, prompt=prompt2, max_tokens=6, stream=True, extra_headers=chdr,
                stream_options={"include_usage": True}, extra_body=extra,
            )
            parts = [c async for c in cstream]
            assert "".join(c.choices[0].text for c in parts if c.choices)
            usage = parts[-1].usage
            assert usage is not None and usage.prompt_tokens == 400
            assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == 2 * BLOCK
        finally:
            await client.close()
        listing = await get_json(http, base + "/v1/sessions")
        by_id = {s["id"]: s for s in listing["data"]}
        assert by_id["chat-1"]["turns"] == 3 and by_id["comp-1"]["turns"] == 2
        assert by_id["comp-1"]["context_tokens"] == 400 and by_id["comp-1"]["demand_tokens"] == 400 + 6
        assert by_id["comp-1"]["last_cached_tokens"] == 2 * BLOCK
        assert gw.turns["finished"] == 5


@timed(120)
async def test_cached_tokens_grow_turn_over_turn_within_a_session(real_vllm_server: RealVllm) -> None:
    rng = random.Random(3)
    async with gateway(real_vllm_server.url) as (_, base, http):
        prompt = ids(rng, 500)
        seen = []
        for k in range(4):
            status, body = await complete(http, base, prompt, 8, session="grow")
            assert status == 200, body
            assert body["usage"]["prompt_tokens"] == len(prompt)
            seen.append((len(prompt), cached(body)))
            out = body["choices"][0]["token_ids"]
            assert len(out) == 8
            prompt = prompt + out + ids(rng, 200 + 50 * k)
        # turn k+1 hits at least every full block of turn k's prompt (nothing else runs: no eviction), never more
        # than its own prompt less one token
        for (n_prev, c_prev), (n, c) in zip(seen, seen[1:], strict=False):
            assert c > c_prev
            assert BLOCK * (n_prev // BLOCK) <= c <= n - 1 and c % BLOCK == 0


@timed(120)
async def test_session_id_header_is_honoured(real_vllm_server: RealVllm) -> None:
    rng = random.Random(4)
    async with gateway(real_vllm_server.url) as (gw, base, http):
        prompts = {"alpha": ids(rng, 300), "beta": ids(rng, 260)}
        for _ in range(3):  # interleaved turns of two sessions
            for sid in ("alpha", "beta"):
                status, body = await complete(http, base, prompts[sid], 4, session=sid)
                assert status == 200, body
                prompts[sid] = prompts[sid] + body["choices"][0]["token_ids"] + ids(rng, 150)
        status, _ = await complete(http, base, ids(rng, 100), 4)  # no session: one the gateway infers (lineage)
        assert status == 200
        listing = await get_json(http, base + "/v1/sessions")
        by_id = {s["id"]: s for s in listing["data"]}
        inferred = {k for k in by_id if k not in ("alpha", "beta")}
        assert len(inferred) == 1 and by_id[inferred.pop()]["turns"] == 1
        by_id = {k: v for k, v in by_id.items() if k in ("alpha", "beta")}
        assert set(by_id) == {"alpha", "beta"}
        for sid, s in by_id.items():
            assert s["turns"] == 3 and s["state"] == "thinking"
            # the last turn's exact context: the prompt sent (its 150 appended ids not sent yet) and its output
            assert s["context_tokens"] == len(prompts[sid]) - 150 - 4 and s["demand_tokens"] == s["context_tokens"] + 4
            assert s["last_cached_tokens"] >= BLOCK
        # ending a session by header
        async with http.post(
            base + "/v1/completions",
            json={"model": MODEL, "prompt": prompts["alpha"], "max_tokens": 4},
            headers={"X-Session-ID": "alpha", "X-Session-End": "true"},
        ) as r:
            assert r.status == 200
        listing = await get_json(http, base + "/v1/sessions")
        assert {s["id"] for s in listing["data"]} & {"alpha", "beta"} == {"beta"}
    # told to name sessions by header only, an unnamed request is a one-turn session, never listed
    async with gateway(real_vllm_server.url, session_from=("header",)) as (gw, base, http):
        status, _ = await complete(http, base, ids(rng, 100), 4)
        assert status == 200
        assert (await get_json(http, base + "/v1/sessions"))["data"] == []
        assert gw.session_ends["one-turn"] == 1


@timed(120)
async def test_with_two_keys_one_key_never_reads_the_others_prompt_from_the_cache(real_vllm_server: RealVllm) -> None:
    """The gateway's per-key ``cache_salt`` on vLLM's own prefix cache: key 2 sending key 1's exact prompt hits
    nothing, key 1 sending it again hits every full block (then ``--shared-prefix-cache``: key 2 hits it too)."""
    rng = random.Random(7)
    prompt = ids(rng, 3 * BLOCK + 50)
    keys = ("tenant-one", "tenant-two")
    seen: dict[str, int] = {}

    async def turn(base: str, http: aiohttp.ClientSession, key: str, name: str) -> None:
        status, body = await complete(http, base, prompt, 4, session=name, headers={"Authorization": f"Bearer {key}"})
        assert status == 200, body
        seen[name] = cached(body)

    async with gateway(real_vllm_server.url, api_keys=keys, admin_token="adm") as (_, base, http):
        await turn(base, http, keys[0], "first")
        await turn(base, http, keys[1], "other key")
        await turn(base, http, keys[0], "same key")
    async with gateway(real_vllm_server.url, api_keys=keys, admin_token="adm", shared_prefix_cache=True) as (
            _, base, http):
        await turn(base, http, keys[0], "shared, first")
        await turn(base, http, keys[1], "shared, other key")
    print(f"cached_tokens through the gateway on real vLLM: {seen}")
    assert seen["first"] == 0 and seen["other key"] == 0
    assert seen["same key"] == 3 * BLOCK
    assert seen["shared, other key"] == 3 * BLOCK  # without salts: the tenants share (and can time) the cache


# -- parking -----------------------------------------------------------------------------------------------------------
@timed(300)
async def test_budgeter_parks_sessions_and_keeps_demand_under_the_high_water_mark(real_vllm_server: RealVllm) -> None:
    async with gateway(real_vllm_server.url, control="budgeter") as (gw, base, http):
        state = await get_json(http, base + "/admin/control")
        C, high = state["kv_pool"], state["opts"]["high"]
        n_sessions, turns, out = 6, 4, 8
        first, append = C // 12, C // 16  # every session ends near 0.27 C: together ~1.6 C, far over the pool
        demand: list[int] = []
        parked_seen = 0
        done = asyncio.Event()

        async def watch() -> None:
            nonlocal parked_seen
            async with aiohttp.ClientSession() as c:
                while not done.is_set():
                    s = (await get_json(c, base + "/v1/sessions"))["summary"]
                    demand.append(s["demand_tokens"])
                    parked_seen = max(parked_seen, s["parked"])
                    await asyncio.sleep(0.05)

        async def agent(i: int) -> list[int]:
            rng = random.Random(100 + i)
            prompt = ids(rng, first)
            hits = []
            for k in range(turns):
                headers = {"X-Session-ID": f"agent-{i}"}
                if k == turns - 1:
                    headers["X-Session-End"] = "true"
                body = {"model": MODEL, "prompt": prompt, "max_tokens": out, "ignore_eos": True,
                        "return_token_ids": True}
                async with http.post(base + "/v1/completions", json=body, headers=headers) as r:
                    assert r.status == 200, await r.text()
                    res = await r.json()
                hits.append(cached(res))
                prompt = prompt + res["choices"][0]["token_ids"] + ids(rng, append)
                await asyncio.sleep(0.2)  # think
            return hits

        watcher = asyncio.create_task(watch())
        try:
            results = await asyncio.gather(*(agent(i) for i in range(n_sessions)))
        finally:
            done.set()
            await watcher
        metrics = await get_text(http, base + "/metrics")
    parks = metric(metrics, "kvgate_parks_total")
    assert parks > 0 and parked_seen > 0  # the sessions did exceed the budget
    assert demand and max(demand) <= high * C  # D was never seen above the high-water mark
    assert max(demand) > 0.5 * C  # and the budget was used
    assert gw.summary()["in_system"] == 0
    assert all(len(h) == turns for h in results)


# -- disconnects ------------------------------------------------------------------------------------------------------
@timed(120)
async def test_client_disconnect_mid_stream_aborts_the_request_upstream(real_vllm_server: RealVllm) -> None:
    srv = real_vllm_server
    rng = random.Random(5)
    async with gateway(srv.url) as (gw, base, http):
        for _ in range(600):  # the shared server idle first: an earlier test's request may still be finishing
            m0 = srv.metrics()
            if metric(m0, "vllm:num_requests_running") == 0 and metric(m0, "vllm:num_requests_waiting") == 0:
                break
            await asyncio.sleep(0.1)
        body = {"model": MODEL, "prompt": ids(rng, 200), "max_tokens": 7000, "ignore_eos": True, "stream": True}
        async with http.post(base + "/v1/completions", json=body, headers={"X-Session-ID": "leaver"}) as r:
            assert r.status == 200
            got = 0
            async for line in r.content:
                if line.startswith(b"data: {"):
                    got += 1
                    if got == 3:
                        break
            assert got == 3
            for _ in range(50):  # (the engine's gauges can lag its steps on a loaded machine)
                if metric(srv.metrics(), "vllm:num_requests_running") == 1:
                    break
                await asyncio.sleep(0.1)
            assert metric(srv.metrics(), "vllm:num_requests_running") == 1
            r.close()  # the client goes away mid-stream
        for _ in range(300):
            m = srv.metrics()
            if metric(m, "vllm:num_requests_running") == 0:
                break
            await asyncio.sleep(0.1)
        assert metric(m, "vllm:num_requests_running") == 0
        # it stopped early (aborted): no request finished, far fewer than 7,000 tokens were generated
        assert metric(m, "vllm:request_success_total") == metric(m0, "vllm:request_success_total")
        assert metric(m, "vllm:generation_tokens_total") - metric(m0, "vllm:generation_tokens_total") < 7000
        for _ in range(100):
            if gw.turns["cancelled"] + gw.turns["failed"] >= 1:
                break
            await asyncio.sleep(0.05)
        assert gw.turns["finished"] == 0 and gw.policy.demand == 0  # its demand was released


# -- upstream restarts ------------------------------------------------------------------------------------------------
class Doorway:
    """A TCP port that forwards to one real server, closed while "down": an engine restarting behind a fixed URL.

    The restart test stops its own server and brings the doorway back up in front of the shared one (another
    pool), which costs one server start-up instead of two."""

    def __init__(self) -> None:
        self.port = free_port()
        self.target = 0
        self._server: asyncio.Server | None = None
        self._conns: set[asyncio.Task[None]] = set()

    async def up(self, target_port: int) -> None:
        self.target = target_port
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", self.port, reuse_address=True)

    async def down(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()
            self._server = None
        for t in list(self._conns):
            t.cancel()
        await asyncio.gather(*self._conns, return_exceptions=True)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._conns.add(task)
        try:
            up_r, up_w = await asyncio.open_connection("127.0.0.1", self.target)
        except OSError:
            writer.close()
            self._conns.discard(task)
            return

        async def pipe(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
            with contextlib.suppress(OSError):
                while data := await r.read(65536):
                    w.write(data)
                    await w.drain()
            w.close()

        try:
            await asyncio.gather(pipe(reader, up_w), pipe(up_r, writer))
        finally:
            writer.close()
            up_w.close()
            self._conns.discard(task)


@timed(300)
async def test_upstream_restart_with_another_pool_is_read_again(
    real_vllm_model: Path, real_vllm_server: RealVllm, tmp_path: Path
) -> None:
    """The first engine is ``kvgate real-vllm serve`` (its command line under test too); SIGTERM stops it."""
    rng = random.Random(6)
    loop = asyncio.get_running_loop()
    cmd = [sys.executable, "-m", "kvgate.cli", "real-vllm", "serve", "--kv-pool", "2048", "--max-model-len",
           "1024", "--port", "0", "--model-dir", str(real_vllm_model), "--log", str(tmp_path / "first.log"),
           "--startup-timeout", "240", "--json"]
    serve = subprocess.Popen(cmd, stdout=subprocess.PIPE, env={**os.environ, "PYTHONPATH": SRC})
    door = Doorway()
    try:
        assert serve.stdout is not None
        line = await loop.run_in_executor(None, serve.stdout.readline)  # the JSON line once vLLM is up
        assert line, (tmp_path / "first.log").read_text()[-3000:]
        info = json.loads(line)
        assert info["kv_pool"] == 2048 and info["num_gpu_blocks"] == 2048 // BLOCK + 1
        assert info["block_size"] == BLOCK and info["max_model_len"] == 1024
        first_url = info["url"]
        await door.up(int(first_url.rsplit(":", 1)[1]))
        async with aiohttp.ClientSession() as c:
            c_first = _pool(await get_text(c, first_url + "/metrics"))
        c_then = _pool(real_vllm_server.metrics())
        assert c_first != c_then
        async with gateway(f"http://127.0.0.1:{door.port}") as (gw, base, http):
            assert gw.kv_pool == c_first
            status, _ = await complete(http, base, ids(rng, 200), 4, session="s")
            assert status == 200
            # the engine goes down: SIGTERM to the command stops vLLM's whole process group; its port closes
            serve.terminate()
            assert await loop.run_in_executor(None, lambda: serve.wait(timeout=90)) == 0
            assert live_group_members(info["pid"]) == []
            await door.down()
            status, body = await complete(http, base, ids(rng, 200), 4, session="s")
            assert status in (502, 503), body  # the upstream is down
            # ... and comes back at the same URL with another pool
            await door.up(real_vllm_server.port)
            status, body = await complete(http, base, ids(rng, 200), 4, session="s")
            assert status == 200, body
            for _ in range(200):
                if gw.kv_pool == c_then:
                    break
                await asyncio.sleep(0.05)
            assert gw.kv_pool == c_then
            state = await get_json(http, base + "/admin/control")
            assert state["kv_pool"] == c_then and state["control"] == "budgeter"
    finally:
        await door.down()
        if serve.poll() is None:
            serve.terminate()
            try:
                await loop.run_in_executor(None, lambda: serve.wait(timeout=90))
            except subprocess.TimeoutExpired:  # killed, so its stdout closes and no reader thread is left behind
                serve.kill()
                serve.wait(timeout=30)


def _pool(metrics: str) -> int | None:
    info = parse_cache_config(metrics)
    return None if info is None else info.kv_pool
