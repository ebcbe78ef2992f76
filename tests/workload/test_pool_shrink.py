"""The pool-shrink trigger (kvgate.workload.triggers.PoolShrink), a class and nothing more: in the simulator (its
blocks taken as they are free, given back at its end), in kvgate paired (the twin runs without it), and over HTTP
(kvgate drive plays it on kvgate engine, which applies it to its engine)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvgate.engine.factory import EngineConfig, build_engine
from kvgate.errors import UsageError
from kvgate.records import load_run, numpy_columns
from kvgate.serve.app import EngineServer
from kvgate.serve.config import ServerConfig
from kvgate.sim.config import SimConfig
from kvgate.sim.paired import arms
from kvgate.sim.runner import simulate
from kvgate.workload.triggers import PoolShrink, parse_trigger, trigger_end_min, triggers_of
from support.aio import timed
from support.fake_engine import drive_config, drive_run


def test_parsed_from_its_option_and_written_back() -> None:
    t = parse_trigger("shrink:150_000@15+5")
    assert t == PoolShrink(15.0, 150_000, 5.0) and t.spec() == "150000@15+5" and t.end_min() == 20.0
    assert PoolShrink.parse("1000@3") == PoolShrink(3.0, 1000, None) and PoolShrink(3.0, 1000).engine_acts() == (3.0,)
    for bad in ("x@3", "1000", "0@3", "1000@3+0", "-5@1"):
        with pytest.raises(UsageError):
            PoolShrink.parse(bad)


def test_on_an_engine_it_takes_free_blocks_only_and_gives_them_back() -> None:
    eng = build_engine(EngineConfig(kv_pool=16 * 100, block_size=16))
    pool = eng.pool
    t = PoolShrink(1.0, 16 * 30, 1.0)
    assert t.on_engine(eng, 1.0) and pool.num_free_blocks() == 70 and eng.usage() == pytest.approx(0.3)
    assert t.on_engine(eng, 1.0) and pool.num_free_blocks() == 70  # again: nothing more to take
    assert t.on_engine(eng, 2.0) and pool.num_free_blocks() == 100
    big = PoolShrink(1.0, 16 * 150)  # more than the pool: all it can, then not done
    assert not big.on_engine(eng, 1.0) and pool.num_free_blocks() == 0
    with pytest.raises(UsageError):
        PoolShrink(1.0, 16).on_engine(build_engine(EngineConfig(engine="sglang", kv_pool=1600)), 1.0)


def test_two_shrinks_at_one_minute_hold_blocks_of_their_own() -> None:
    eng = build_engine(EngineConfig(kv_pool=16 * 100, block_size=16))
    a, b = PoolShrink(1.0, 16 * 20, 1.0), PoolShrink(1.0, 16 * 30, 2.0)
    assert a.on_engine(eng, 1.0) and b.on_engine(eng, 1.0) and eng.pool.num_free_blocks() == 50
    assert a.on_engine(eng, 2.0) and eng.pool.num_free_blocks() == 70  # a's end gives back a's blocks only
    assert b.on_engine(eng, 3.0) and eng.pool.num_free_blocks() == 100


def test_in_the_simulator_it_hurts_while_it_holds_and_the_twin_runs_without_it() -> None:
    cfg = SimConfig(minutes=30, seed=501, triggers=("shrink:340000@10+5",))
    twin, trig = arms(cfg, 501)
    assert twin.triggers == () and trig.triggers == cfg.triggers and twin.align_min == trig.align_min == 15.0
    assert trigger_end_min(cfg) == 15.0 and [t.kind for t in triggers_of(cfg)] == ["shrink"]
    a, b = simulate(twin), simulate(trig)
    sa, sb = numpy_columns(a.tables["samples"]), numpy_columns(b.tables["samples"])
    ta, tb = numpy_columns(a.tables["turns"]), numpy_columns(b.tables["turns"])
    during = (sb["t_s"] > 11 * 60) & (sb["t_s"] < 15 * 60)
    before = sb["t_s"] < 10 * 60
    assert (sb["kv_usage"][during] >= 0.7).all() and not (sa["kv_usage"][during] >= 0.7).all()
    assert np.array_equal(sa["kv_usage"][before], sb["kv_usage"][before])  # the same run until the shrink

    def hit(t: dict[str, np.ndarray], lo: float, hi: float) -> float:
        w = (t["end_s"] >= lo * 60) & (t["end_s"] < hi * 60)
        return float(t["cached_tokens"][w].sum() / t["prompt_tokens"][w].sum())

    assert hit(tb, 10, 16) < hit(ta, 10, 16) - 0.2  # the blocks it holds are misses for the sessions
    assert sb["kv_usage"][sb["t_s"] >= 25 * 60].max() < 0.7  # given back (λ 0.035: the run recovers)


@timed(60)
async def test_an_engine_it_cannot_act_on_refuses_it_with_a_json_400() -> None:
    import aiohttp

    server = EngineServer(ServerConfig(engine="sglang", time_scale=120.0, kv_pool=16 * 2000, block_size=16))
    port = await server.start("127.0.0.1", 0)
    try:
        async with aiohttp.ClientSession() as http:
            for body, why in (({"trigger": "shrink:16000@0.25"}, "simulated vLLM"),
                              ({"trigger": "burst:1.0@10+4"}, "does nothing to an engine")):
                async with http.post(f"http://127.0.0.1:{port}/kvgate/trigger", json=body) as r:
                    assert r.status == 400 and why in (await r.json())["error"]["message"]
    finally:
        await server.stop()


@timed(60)
async def test_kvgate_drive_plays_it_on_kvgate_engine(tmp_path: Path) -> None:
    server = EngineServer(ServerConfig(time_scale=120.0, kv_pool=16 * 2000, block_size=16))
    port = await server.start("127.0.0.1", 0)
    try:
        cfg = drive_config(f"http://127.0.0.1:{port}", minutes=1.0, triggers=("shrink:16000@0.25",))
        logs: list[str] = []
        res = await drive_run(cfg, tmp_path / "run", logs)
        assert res.summary["turns_done"] > 0
        assert any("trigger shrink:16000@0.25" in m for m in logs), logs
        pool = server.loop.engine.pool  # type: ignore[attr-defined]
        assert pool.num_free_blocks() <= 2000 - 1000  # its 1000 blocks are held (for good: no +D)
        assert load_run(tmp_path / "run").meta["config"]["triggers"] == ["shrink:16000@0.25"]
    finally:
        await server.stop()
