"""End to end on loopback: ``kvgate drive`` → ``kvgate gateway`` → ``kvgate engine``, all on one scaled clock.

The gateway reads the engine's KV pool from its ``/metrics`` (``vllm:cache_config_info``), parks sessions with
the budgeter on a pool small enough that it must, and every session the driver finished was ended at the
gateway by its ``X-Session-End`` turn.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import pytest

from aio import timed
from kvgate.http.gateway import Gateway, GatewayConfig

engine_server = pytest.importorskip("kvgate.http.engine_server")
driver = pytest.importorskip("kvgate.http.driver")

from kvgate.workload.shapes import Phase, Workload, synthetic  # noqa: E402

SCALE = 60.0
SMALL = Workload("small", phases=(Phase(0.0, synthetic(shared=64, unique=128, turns=4, output=16, append=32), 4.0),))


@pytest.mark.parametrize("api", ["completions", "chat"])
@timed(30)
async def test_driver_through_gateway_to_engine(tmp_path: Path, api: str) -> None:
    before = asyncio.all_tasks()
    eng = engine_server.EngineServer(engine_server.ServerConfig(kv_pool=2048, time_scale=SCALE))
    eng_port = await eng.start("127.0.0.1", 0)
    gw = Gateway(GatewayConfig(upstream=f"http://127.0.0.1:{eng_port}", time_scale=SCALE, default_max_tokens=16))
    try:
        port = await gw.start("127.0.0.1", 0)
        assert gw.capacity_tokens == 2048 and gw.limit.name == "budgeter"
        cfg = driver.DriveConfig(endpoint=f"http://127.0.0.1:{port}", api=api, stream=api == "chat", lam=0.4,
                                 minutes=1.5, seed=3, time_scale=SCALE, retries=1, backoff_s=0.01)  # fmt: skip
        res = await driver.drive(cfg, tmp_path / "run", workload=SMALL, status=False, log=lambda _m: None,
                                 handle_signals=False)  # fmt: skip
        s = res.summary
        assert s["turns_error"] == 0 and s["turns_done"] > 20
        assert gw.turns["finished"] >= s["turns_done"] and gw.turns["failed"] == 0
        assert gw.policy.waits > 0  # the pool is small: the budgeter made sessions wait
        # a last turn can complete at the gateway just before the driver's horizon and reach the driver after it
        assert s["sessions_finished"] <= gw.session_ends["client"] <= s["sessions_finished"] + 2
        # the engine's cached tokens reached the gateway's hit ratio
        summary = gw.summary()
        assert summary["hit_ratio_5m"] is not None and summary["hit_ratio_5m"] > 0.3
        # the driver's requests cut at the horizon left the gateway too: held ones ended, in-flight ones aborted
        for _ in range(200):
            a = gw.audit()
            if a["held"] == a["held_policy"] == a["in_flight"] == 0:
                break
            await asyncio.sleep(0.01)
        assert a["demand"] == a["admitted_demand"] and a["held"] == a["held_policy"] == a["in_flight"] == 0
        assert gw.policy.counts()["running"] == 0
    finally:
        await gw.stop()
        await eng.stop()
    for _ in range(100):
        if not (asyncio.all_tasks() - before - {asyncio.current_task()}):
            break
        await asyncio.sleep(0.01)
    assert not (asyncio.all_tasks() - before - {asyncio.current_task()})
