"""End to end on loopback: ``kvgate drive`` → ``kvgate gateway`` → ``kvgate engine``, all on one scaled clock.

The gateway reads the engine's KV pool from its ``/metrics`` (``vllm:cache_config_info``), parks sessions with
the budgeter on a pool small enough that it must, and every session the driver finished was ended at the
gateway by its ``X-Session-End`` turn. The driver's records say what the gateway did: its control, the turns
it held and for how long, and the engine's pool behind it.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path

import numpy as np
import pytest

from kvgate.gateway import Gateway, GatewayConfig
from support.aio import timed

pytest.importorskip("aiohttp")
driver = pytest.importorskip("kvgate.drive.driver")

from kvgate.records import load_run  # noqa: E402
from kvgate.serve.app import EngineServer  # noqa: E402
from kvgate.serve.config import ServerConfig  # noqa: E402
from kvgate.workload.shapes import Phase, Workload, synthetic  # noqa: E402

SCALE = 60.0
SMALL = Workload("small", phases=(Phase(0.0, synthetic(shared=64, unique=128, turns=4, output=16, append=32), 4.0),))


@pytest.mark.parametrize("api", ["completions", "chat"])
@timed(30)
async def test_driver_through_gateway_to_engine(tmp_path: Path, api: str) -> None:
    before = asyncio.all_tasks()
    eng = EngineServer(ServerConfig(kv_pool=2048, time_scale=SCALE))
    eng_port = await eng.start("127.0.0.1", 0)
    gw = Gateway(GatewayConfig(upstream=f"http://127.0.0.1:{eng_port}", time_scale=SCALE, default_max_tokens=16))
    try:
        port = await gw.start("127.0.0.1", 0)
        assert gw.kv_pool == 2048 and gw.control.name == "budgeter"
        cfg = driver.DriveConfig(endpoint=f"http://127.0.0.1:{port}", api=api, stream=api == "chat", lam=0.4,
                                 minutes=1.5, seed=3, time_scale=SCALE, retries=1, backoff_s=0.01)
        res = await driver.drive(cfg, tmp_path / "run", workload=SMALL, status=False, log=lambda _m: None,
                                 handle_signals=False)
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
        # the driver's records through the gateway: its control, its parks and waits, the engine's pool
        run = load_run(tmp_path / "run")
        meta, rec = run.meta, run.meta["gateway"]
        assert meta["server"]["kind"] == "vllm" and meta["server"]["via_gateway"] is True
        assert meta["kv_pool"] == 2048 and meta["block_size"] == 16
        assert rec["control"] == "budgeter" and rec["upstream"]["kv_pool"] == 2048
        assert s["control"] == "budgeter" and s["parks"] == meta["parks"] == rec["turns_parked"]
        assert rec["parks_during_run"] == gw.policy.parks and rec["waits_during_run"] == gw.policy.waits
        assert rec["turns_parked"] <= gw.policy.parks and 0 < rec["turns_waited"] <= gw.policy.waits
        t = run.turns
        ok = t["status"] == "ok"
        waits = t["park_wait_s"][ok]
        assert not np.isnan(waits).any() and (waits > 0).sum() == rec["turns_parked"] + rec["turns_waited"]
        assert np.allclose(t["sent_s"][ok] - waits, t["submit_s"][ok] + t["lag_s"][ok], atol=1e-6)
        # a session's first turn left the gateway after its wait: the summary's gateway wait is the gateway's
        first = ok & (t["turn"] == 0)
        by_sid = dict(zip(t["session"][first].tolist(), (t["sent_s"][first]).tolist(), strict=True))
        sess = run.sessions
        for sid, fs in zip(sess["session"].tolist(), sess["first_sent_s"].tolist(), strict=True):
            if sid in by_sid:
                assert fs == pytest.approx(by_sid[sid])
        assert s["gateway_wait_p90_min"] is not None and s["gateway_wait_p90_min"] >= 0
        assert max(w for w in waits) > 0
        # cached tokens came through (vLLM 0.32's usage with created_cache_tokens, streamed for chat)
        assert not np.isnan(t["cached_tokens"][ok]).any() and (t["cached_tokens"][ok] > 0).any()
        # the samples carry the gateway's sessions and D
        assert (run.samples["admitted"] >= 0).all() and (run.samples["admitted_demand_tokens"] >= 0).all()
        assert not math.isnan(float(np.nanmax(run.samples["admitted"])))
    finally:
        await gw.stop()
        await eng.stop()
    for _ in range(100):
        if not (asyncio.all_tasks() - before - {asyncio.current_task()}):
            break
        await asyncio.sleep(0.01)
    assert not (asyncio.all_tasks() - before - {asyncio.current_task()})


@timed(30)
async def test_driver_reads_the_engines_pool_and_block_size(tmp_path: Path) -> None:
    # directly against kvgate engine --block-size 128: C = (num_gpu_blocks - 1) x 128 = the engine's pool
    eng = EngineServer(ServerConfig(kv_pool=4096, time_scale=SCALE, block_size=128))
    port = await eng.start("127.0.0.1", 0)
    try:
        cfg = driver.DriveConfig(endpoint=f"http://127.0.0.1:{port}", lam=0.2, minutes=0.5, seed=3, time_scale=SCALE)
        res = await driver.drive(cfg, tmp_path / "run", workload=SMALL, status=False, log=lambda _m: None,
                                 handle_signals=False)
        meta = res.meta
        assert meta["server"]["kind"] == "vllm" and meta["server"]["via_gateway"] is False
        assert meta["kv_pool"] == eng.kv_pool == 4096 and meta["block_size"] == 128
        assert meta["server"]["pool"]["num_gpu_blocks"] == 33 and "gateway" not in meta
        assert res.summary["control"] == "none" and res.summary["parks"] == 0
        run = load_run(tmp_path / "run")
        assert np.isnan(run.turns["park_wait_s"]).all()  # no gateway: not observable
        assert (run.samples["kv_pool"] == 4096).all()
    finally:
        await eng.stop()


@timed(30)
async def test_a_controller_switched_on_mid_run_is_in_the_drivers_summary(tmp_path: Path) -> None:
    # gateway --control-at 0.5: the driver's summary reads it like a simulated run with control_at
    eng = EngineServer(ServerConfig(kv_pool=2048, time_scale=SCALE))
    eng_port = await eng.start("127.0.0.1", 0)
    gw = Gateway(GatewayConfig(upstream=f"http://127.0.0.1:{eng_port}", time_scale=SCALE, control_at=0.5,
                               default_max_tokens=16))
    try:
        port = await gw.start("127.0.0.1", 0)
        cfg = driver.DriveConfig(endpoint=f"http://127.0.0.1:{port}", lam=0.4, minutes=1.5, seed=5, time_scale=SCALE)
        res = await driver.drive(cfg, tmp_path / "run", workload=SMALL, status=False, log=lambda _m: None,
                                 handle_signals=False)
        s, rec = res.summary, res.meta["gateway"]
        assert rec["control"] == "none" and rec["scheduled"]["control"] == "budgeter"
        assert rec["summary_control"]["control"] == "budgeter"
        # the gateway's minute 0.5, on the driver's clock (which started when the gateway's read rec["now_s"])
        at = rec["summary_control"]["control_at"]
        assert at == pytest.approx((rec["scheduled"]["at_s"] - rec["now_s"]) / 60.0) and 0 < at <= 0.5
        # turns released before the switch saw "none" (none at all on a slow machine), the later ones the budgeter
        names = [c["spec"].split(":")[0] for c in rec["controls"]]
        assert names[-1] == "budgeter" and set(names[:-1]) <= {"none"}
        assert s["control"] == "budgeter" and "hit_before_control" in s and "recovered" in s
    finally:
        await gw.stop()
        await eng.stop()
