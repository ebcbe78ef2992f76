"""The HTTP side of issue 10 on a real vLLM (the CPU build): pool discovery, the driver's records through a
gateway, and a client that disconnects mid-stream aborting the request upstream (vLLM 0.32 counts such an abort
under no ``finished_reason``: the request leaves its running set and stops generating).

One server for the module, in dev mode (``VLLM_SERVER_DEV_MODE=1``: vLLM then answers ``/server_info``, which
discovery must not take for SGLang's), a usable pool of 4,096 tokens in blocks of 128. Skips where vLLM is absent.
"""

from __future__ import annotations

import asyncio
import json
import re
import time
from collections.abc import Iterator
from pathlib import Path

import aiohttp
import pytest

from kvgate.gateway import Gateway, GatewayConfig
from kvgate.http.openai import discover
from kvgate.records import load_run
from kvgate.workload.shapes import Phase, Workload, synthetic
from support.aio import timed
from support.real_vllm import start_server

pytestmark = pytest.mark.real_vllm

POOL = 4096
BLOCK = 128
MODEL = "tiny-llama"
# sessions of 768 to ~1,600 tokens: a few fit the 4,096-token pool at once, the budgeter makes the rest wait
AGENTS = Workload("agents", phases=(Phase(0.0, synthetic(shared=256, unique=512, turns=4, output=8, append=256), 2.0),))


@pytest.fixture(scope="module")
def vllm(real_vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    tmp = tmp_path_factory.mktemp("http-real-vllm")
    srv = start_server(tmp, real_vllm_model, pool=POOL, name="dev", max_model_len=POOL, block_size=BLOCK,
                       env={"VLLM_SERVER_DEV_MODE": "1"})
    try:
        yield srv
    finally:
        srv.stop()


async def _get(session: aiohttp.ClientSession, url: str) -> tuple[int, bytes]:
    async with session.get(url, timeout=aiohttp.ClientTimeout(total=30)) as r:
        return r.status, await r.read()


def _metric(text: str, name: str, **labels: str) -> float:
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name):
            continue
        m = re.match(rf"^{re.escape(name)}(\{{[^}}]*\}})?\s+(\S+)$", line)
        if m and all(f'{k}="{v}"' in (m.group(1) or "") for k, v in labels.items()):
            total += float(m.group(2))
    return total


@timed(60)
async def test_discovery_on_vllm_in_dev_mode(vllm: object) -> None:
    url = vllm.url  # type: ignore[attr-defined]
    async with aiohttp.ClientSession() as s:
        status, body = await _get(s, url + "/server_info")
        assert status == 200 and "vllm_config" in json.loads(body)  # dev mode is on: the trap is armed
        info = await discover(lambda path: _get(s, url + path))
    assert info.kind == "vllm" and info.source == "/metrics"
    assert info.kv_pool == POOL == (info.num_gpu_blocks - 1) * BLOCK  # type: ignore[operator]
    assert info.block_size == BLOCK and info.kv_cache_size_tokens is not None


@timed(240)
async def test_driver_through_the_gateway_records_what_it_did(vllm: object, tmp_path: Path) -> None:
    from kvgate.drive import driver

    gw = Gateway(GatewayConfig(upstream=vllm.url, default_max_tokens=8))  # type: ignore[attr-defined]
    port = await gw.start("127.0.0.1", 0)
    try:
        assert gw.kv_pool == POOL and gw.upstream_info.kind == "vllm" and gw.upstream_info.block_size == BLOCK
        cfg = driver.DriveConfig(endpoint=f"http://127.0.0.1:{port}", lam=0.3, minutes=1.0, seed=11, retries=1,
                                 stream=True)
        res = await driver.drive(cfg, tmp_path / "run", workload=AGENTS, status=False, log=lambda _m: None,
                                 handle_signals=False)
        s, meta = res.summary, res.meta
        assert s["turns_error"] == 0 and s["turns_done"] > 10
        assert meta["server"]["kind"] == "vllm" and meta["server"]["via_gateway"] is True
        assert meta["kv_pool"] == POOL and meta["block_size"] == BLOCK
        rec = meta["gateway"]
        assert s["control"] == "budgeter" and s["parks"] == rec["turns_parked"]
        assert rec["parks_during_run"] == gw.policy.parks and rec["waits_during_run"] == gw.policy.waits
        assert rec["turns_waited"] > 0  # the pool is small: sessions waited for admission
        run = load_run(tmp_path / "run")
        ok = run.turns["status"] == "ok"
        waits = run.turns["park_wait_s"][ok]
        assert (waits > 0).sum() == rec["turns_parked"] + rec["turns_waited"]
        assert (run.turns["cached_tokens"][ok] > 0).any()  # the real prefix cache, read through the gateway
        assert (run.samples["admitted"] >= 0).all()
        assert s["gateway_wait_p90_min"] is not None
    finally:
        await gw.stop()


@timed(120)
async def test_a_client_gone_mid_stream_aborts_the_request_in_vllm(vllm: object) -> None:
    url = vllm.url  # type: ignore[attr-defined]
    gw = Gateway(GatewayConfig(upstream=url))
    port = await gw.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as s:
            _, raw = await _get(s, url + "/metrics")
            gen0 = _metric(raw.decode(), "vllm:generation_tokens_total")
            length0 = _metric(raw.decode(), "vllm:request_success_total", finished_reason="length")
            n = 3500
            body = {"model": MODEL, "prompt": [1000 + i for i in range(200)], "max_tokens": n, "ignore_eos": True,
                    "min_tokens": n, "stream": True}
            for attempt in range(3):  # (a loaded machine may read the first tokens only after vLLM wrote the last)
                r = await s.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                                 headers={"X-Session-ID": f"gone-{attempt}"})
                assert r.status == 200
                await r.content.readany()  # the first tokens arrived: vLLM is decoding
                _, raw = await _get(s, url + "/metrics")
                if _metric(raw.decode(), "vllm:request_success_total", finished_reason="length") == length0:
                    break
                await r.read()  # it ended before the client could leave: this attempt tests nothing
                r.close()
                gen0 = _metric(raw.decode(), "vllm:generation_tokens_total")
                length0 += 1
                await asyncio.sleep(0.2)
            r.close()  # the client goes away mid-stream
            deadline = time.monotonic() + 90
            while True:  # the request leaves vLLM's running set: aborted, or (if not) after all n tokens
                _, raw = await _get(s, url + "/metrics")
                m = raw.decode()
                if _metric(m, "vllm:num_requests_running") == 0:
                    break
                assert time.monotonic() < deadline, "the request is still running in vLLM"
                await asyncio.sleep(0.2)
            # vLLM counts a client's abort in no finished_reason; it stopped generating and did not finish by length
            assert _metric(m, "vllm:generation_tokens_total") - gen0 < n
            assert _metric(m, "vllm:request_success_total", finished_reason="length") == length0
        await asyncio.sleep(0.05)
        assert gw.turns["cancelled"] == 1 and gw.audit()["in_flight"] == 0, gw.turns
    finally:
        await gw.stop()
