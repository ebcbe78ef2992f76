"""Agent timeouts and retries in ``kvgate drive`` (the simulator's semantics): a timed-out attempt is abandoned, the
turn retried after a backoff, and an agent out of retries gives up its session; through a gateway each retry
replaces its earlier attempt there."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from kvgate.drive.config import validate
from kvgate.errors import UsageError
from kvgate.gateway import Gateway, GatewayConfig
from kvgate.records import load_run
from support.aio import timed
from support.fake_engine import FakeEngine, drive_config, drive_run
from support.fake_upstream import check_clean, settle


@timed(30)
async def test_every_attempt_timing_out_makes_each_agent_give_up_after_its_retries(tmp_path: Path) -> None:
    # each answer takes 0.3 real s = 36 virtual s at x120; the agent waits 6 virtual s per attempt
    async with FakeEngine(delay_s=0.3) as eng:
        cfg = drive_config(eng.url, client_timeout_s=6.0, client_retries=1, retry_backoff_s=1.0)
        res = await drive_run(cfg, tmp_path / "r")
        sent = len(eng.requests)
    s = res.summary
    run = load_run(tmp_path / "r")
    aborted = run.turns["status"] == "aborted"
    per_session = np.bincount(run.turns["session"][aborted])
    assert s["sessions_abandoned"] >= 1
    assert per_session.max() == 2  # the first attempt and one retry, then the agent gives up
    # (aborted rows also mark attempts cut by the end of the run)
    assert s["sessions_abandoned"] <= (per_session == 2).sum()
    assert 2 * s["sessions_abandoned"] <= s["client_timeouts"] <= int(aborted.sum())
    assert s["sessions_abandoned"] <= s["client_retries"] <= s["sessions_abandoned"] + (per_session == 1).sum()
    assert (run.turns["status"] == "ok").sum() == 0
    assert sent >= s["client_timeouts"]  # every attempt reached the engine
    assert s["sessions_finished"] == 0


@timed(30)
async def test_a_timeout_longer_than_every_turn_changes_nothing(tmp_path: Path) -> None:
    async with FakeEngine() as eng:
        # (4 virtual minutes, 2 real s: time for sessions to finish on a busy machine)
        res = await drive_run(drive_config(eng.url, client_timeout_s=1e6, client_retries=2, minutes=4.0),
                              tmp_path / "b")
        answered = sum(len(v) for v in eng.turns.values())
    s = res.summary
    assert s["client_timeouts"] == s["client_retries"] == s["sessions_abandoned"] == 0
    assert s["turns_done"] > 0 and s["sessions_finished"] > 0
    assert answered >= s["turns_done"]  # one request per turn: nothing sent twice
    assert len(eng.requests) == answered


@timed(40)
async def test_through_a_gateway_each_retry_replaces_its_attempt_and_d_stays_exact(tmp_path: Path) -> None:
    # (answers after 3 real s: a retry, 0.23 s after its attempt at x30, finds it still open even on a machine so
    # busy that the loop running driver, gateway and engine stalls for a second)
    async with FakeEngine(delay_s=3.0) as eng:
        gw = Gateway(GatewayConfig(upstream=eng.url, kv_pool=10_000_000))
        port = await gw.start("127.0.0.1", 0)
        try:
            res = await drive_run(
                drive_config(f"http://127.0.0.1:{port}", client_timeout_s=6.0, client_retries=2, retry_backoff_s=1.0,
                             time_scale=30.0),
                tmp_path / "g",
            )
            # the abandoned attempts' upstream requests end when the fake engine answers them (3 s after each)
            await settle(lambda: gw.audit()["in_flight"] == 0 and gw.upstream_connections()["acquired"] == 0, 15.0)
            s = res.summary
            assert s["client_retries"] >= 1
            # each retry replaced its open attempt (but a retry sent as the run ends, which may not reach the gateway)
            assert s["client_retries"] - 2 <= gw.replaced_attempts <= s["client_retries"]
            check_clean(gw)  # D is exactly the admitted demand: no turn counted twice
        finally:
            await gw.stop()


def test_bad_retry_options_are_usage_errors() -> None:
    for kw in ({"client_timeout_s": 0.0}, {"client_retries": -1}, {"retry_jitter": 1.0}, {"retry_backoff_s": -1}):
        with pytest.raises(UsageError):
            validate(drive_config("http://127.0.0.1:1", **kw))
