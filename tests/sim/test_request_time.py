"""A profile's request time (``request_s`` + ``request_per_token_s`` x prompt): a request reaches the engine's queue
that long after it was sent. It is latency beside the engine's steps: every turn's time to first token grows by it,
the engine's own work does not; a request on its way when its replica fails or its attempt times out is dropped."""

from __future__ import annotations

import asyncio
import time
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest

from kvgate.engine.costmodel import QWEN3_8B_MI300X, load_profile, profile_to_dict, save_profile
from kvgate.records import numpy_columns
from kvgate.sim.config import SimConfig
from kvgate.sim.fleet import simulate_fleet
from kvgate.sim.runner import simulate


def _profile(tmp: Path, request_s: float, per_token_s: float = 0.0) -> str:
    path = tmp / "p.json"
    save_profile(replace(QWEN3_8B_MI300X, name="slow-front", request_s=request_s, request_per_token_s=per_token_s),
                 path)
    return str(path)


def _turns(res: object) -> dict[str, np.ndarray]:
    return numpy_columns(res.tables["turns"])  # type: ignore[attr-defined]


def test_each_turn_waits_its_request_time_and_the_engine_does_no_more(tmp_path: Path) -> None:
    base = SimConfig(lam=0.01, minutes=20, seed=3)  # light: turns rarely wait for each other
    plain = simulate(base)
    slow = simulate(base.with_(profile=_profile(tmp_path, 0.25, 2e-5)))
    a, b = _turns(plain), _turns(slow)
    ok_a, ok_b = a["status"] == "ok", b["status"] == "ok"
    ttft_a = np.median((a["first_token_s"] - a["sent_s"])[ok_a])
    ttft_b = (b["first_token_s"] - b["sent_s"])[ok_b]
    want = 0.25 + 2e-5 * b["prompt_tokens"][ok_b]
    assert (ttft_b >= want - 1e-9).all()  # never before it reached the engine
    assert np.median(ttft_b - want) == pytest.approx(ttft_a, rel=0.05, abs=0.01)
    # the engine's work per turn is unchanged: the same hits, the same decode after the first token
    sa, sb = plain.meta["summary"], slow.meta["summary"]
    assert sb["hit_ratio_all"] == pytest.approx(sa["hit_ratio_all"], abs=0.02)
    dec_a = np.median((a["end_s"] - a["first_token_s"])[ok_a])
    dec_b = np.median((b["end_s"] - b["first_token_s"])[ok_b])
    assert dec_b == pytest.approx(dec_a, rel=0.05)


def test_zero_request_time_is_the_paper_profiles_run(tmp_path: Path) -> None:
    """A profile file that spells the request time out as 0 gives the run of the built-in profile, bit for bit."""
    cfg = SimConfig(lam=0.04, minutes=15, bursts=("1.0@5+3",), seed=8)
    got = simulate(cfg.with_(profile=_profile(tmp_path, 0.0)))
    ref = simulate(cfg)
    ga, ra = _turns(got), _turns(ref)
    for k in ("first_token_s", "end_s", "cached_tokens"):
        assert np.array_equal(ga[k], ra[k])


def test_a_request_on_its_way_to_a_failed_replica_is_sent_again(tmp_path: Path) -> None:
    """Requests still on their way (a second here) when their replica fails are errors the agent re-sends
    elsewhere, as those in the engine are; none reaches the dead or the next engine of that replica."""
    cfg = SimConfig(replicas=3, lam=0.08, minutes=60, router="kvgate", fail_at=("1@10.5",), rate_at=("18:0",),
                    control="budgeter", seed=31, profile=_profile(tmp_path, 1.0))
    res = simulate_fleet(cfg)
    t = _turns(res)
    failed = t["status"] == "error"
    assert failed.any()
    assert not ((t["replica"] == 1) & (t["end_s"] > 630.0)).any()
    s = numpy_columns(res.tables["sessions"])
    assert not np.isnan(s["end_s"]).any() and (s["turns_done"] == s["turns"]).all()
    assert res.meta["summary"]["fleet"]["sessions_unfinished"] == 0


def test_timed_out_attempts_on_their_way_are_dropped(tmp_path: Path) -> None:
    """An agent's timeout shorter than the way to the engine: every attempt is given up before it arrives, none
    runs, and the run ends with nothing in the engine."""
    cfg = SimConfig(lam=0.02, minutes=10, client_timeout_s=0.5, client_retries=1, seed=5,
                    profile=_profile(tmp_path, 1.0))
    res = simulate(cfg)
    t = _turns(res)
    assert len(t["status"]) and (t["status"] != "ok").all()
    assert res.meta["engine_steps"] == 0


def test_profile_files_without_the_request_time_still_load(tmp_path: Path) -> None:
    obj = profile_to_dict(QWEN3_8B_MI300X)
    del obj["request_s"], obj["request_per_token_s"]
    path = tmp_path / "old.json"
    import json

    path.write_text(json.dumps(obj))
    p = load_profile(path)
    assert p.request_s == 0.0 and p.request_time(30_000) == 0.0


@pytest.mark.asyncio
async def test_the_served_engine_waits_the_request_time(tmp_path: Path) -> None:
    """``kvgate engine`` with such a profile: no first token before the request time has passed on its clock."""
    import openai

    from kvgate.serve.app import EngineServer
    from kvgate.serve.config import ServerConfig

    scale = 40.0
    cfg = ServerConfig(time_scale=scale, profile=_profile(tmp_path, 4.0))
    server = EngineServer(cfg, None)
    port = await server.start("127.0.0.1", 0)
    try:
        async with asyncio.timeout(30):
            c = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
            t0 = time.monotonic()
            r = await c.completions.create(model=cfg.model_name(), prompt=[5, 6, 7], max_tokens=1)
            waited = time.monotonic() - t0
        assert r.usage is not None and r.usage.completion_tokens == 1
        assert waited >= 4.0 / scale * 0.99  # a lower bound only: a busy machine can make it later, never sooner
    finally:
        await server.stop()
