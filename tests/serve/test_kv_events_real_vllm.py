"""The KV-event consumer against a real vLLM (CPU build) started with ``--kv-events-config``: the events
``kvgate engine`` imitates, from the engine itself. One short server (its own, for the flag); ipc endpoints,
because vLLM binds only wildcard and ipc addresses (it connects to the others)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
from pathlib import Path

import aiohttp
import pytest

from kvgate.gateway.kvevents import KVEventSubscriber
from support.real_vllm import BLOCK, start_server

pytestmark = pytest.mark.real_vllm


async def _complete(http: aiohttp.ClientSession, url: str, model: str, prompt: list[int], session: str) -> None:
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0}
    async with http.post(url + "/v1/completions", json=body, headers={"X-Session-ID": session}) as r:
        assert r.status == 200, await r.text()


@pytest.mark.asyncio
async def test_consumer_sees_real_vllms_stores_and_clears(real_vllm_model: Path, tmp_path: Path) -> None:
    pub, replay = f"ipc://{tmp_path}/kv.pub", f"ipc://{tmp_path}/kv.replay"
    conf = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": pub, "replay_endpoint": replay}
    srv = await asyncio.to_thread(
        start_server, tmp_path, real_vllm_model, pool=8 * 1024, max_model_len=2048, block_size=BLOCK,
        name="vllm-kv-events", extra_args=("--kv-events-config", json.dumps(conf)),
        env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    sub = KVEventSubscriber(pub, replay_endpoint=replay)
    rng = random.Random(7)
    try:
        async with asyncio.timeout(180), aiohttp.ClientSession() as http:
            await sub.start()
            model = srv.config.served_model_name
            for i in range(100):  # until the subscription is live; its first message replays the rest
                await _complete(http, srv.url, model, [rng.randrange(100, 30000) for _ in range(BLOCK + 8)], f"w{i}")
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(sub.connected.wait(), 0.2)
                    break
            prompts = {f"s{k}": [rng.randrange(100, 30000) for _ in range(3 * BLOCK + 10)] for k in range(3)}
            for name, p in prompts.items():
                await _complete(http, srv.url, model, p, name)
            res = sub.residency
            while any(res.tokens_of(n) < 3 * BLOCK for n in prompts):
                await asyncio.sleep(0.05)
            assert res.gaps == 0 and sub.bad_messages == 0
            for name in prompts:  # three full prompt blocks each, stored under the request's X-Session-ID
                assert res.tokens_of(name) == 3 * BLOCK
            assert all(per == BLOCK for per, _, _ in res.blocks.values())
            async with http.post(srv.url + "/reset_prefix_cache") as r:
                assert r.status == 200, await r.text()
            seen = res.events
            while res.events == seen:  # the clear is published with the next engine step
                await _complete(http, srv.url, model, [5] * 8, "poke")
                await asyncio.sleep(0.05)
            while res.blocks and any(res.tokens_of(n) for n in prompts):
                await asyncio.sleep(0.05)
            assert not any(res.tokens_of(n) for n in prompts)
    finally:
        await sub.stop()
        await asyncio.to_thread(srv.stop)
