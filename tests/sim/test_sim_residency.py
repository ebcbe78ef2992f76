"""``budgeter-resident`` in the simulator: each session's measured residency is its resident prefix in its
replica's pool (what its KV events would tell a gateway), and held sessions are reconsidered once a pool loses
blocks. After a cache flush the sessions between turns hold nothing, so the measured budget admits sessions the
plain budgeter keeps parked."""

from __future__ import annotations

import numpy as np
import pytest

from kvgate.errors import UsageError
from kvgate.records import numpy_columns
from kvgate.sim.config import SimConfig, validate
from kvgate.sim.fleet import simulate_fleet

FLUSHED = SimConfig(preset="paper-8b", lam=0.05, kv_pool=250_000, minutes=24, seed=2, flush_at=20.0)


def _after_flush(cfg: SimConfig) -> tuple[float, float]:
    """Mean sessions admitted and held (parked or waiting) in the minute after the flush (later, the sessions the
    measured budget admitted have prefilled their contexts again and count as much as the plain budgeter's)."""
    res = simulate_fleet(cfg)
    assert res.meta["flushed_at_s"] == [1200.0]
    s = numpy_columns(res.tables["samples"])
    after = (s["t_s"] >= 1200.0) & (s["t_s"] < 1260.0)
    return float(s["admitted"][after].mean()), float((s["parked"] + s["gateway_waiting"])[after].mean())


def test_after_a_flush_the_measured_budget_admits_what_the_budgeter_keeps_parked() -> None:
    plain_admitted, plain_held = _after_flush(FLUSHED.with_(control="budgeter"))
    assert plain_held > 5  # the premise: the budgeter is holding sessions when the cache goes
    admitted, held = _after_flush(FLUSHED.with_(control="budgeter-resident"))
    assert admitted > plain_admitted + 1 and held < plain_held


def test_held_sessions_are_reconsidered_the_moment_the_cache_is_flushed() -> None:
    def sent_at_the_flush(control: str) -> int:
        t = numpy_columns(simulate_fleet(FLUSHED.with_(control=control)).tables["turns"])
        return int(((t["sent_s"] == 1200.0) & (t["park_wait_s"] > 0)).sum())

    assert sent_at_the_flush("budgeter") == 0  # nothing a plain budgeter counts changes at a flush
    assert sent_at_the_flush("budgeter-resident") > 0  # the sessions between turns hold nothing now


def test_the_measured_budget_needs_the_simulated_vllm_pool() -> None:
    validate(FLUSHED.with_(control="budgeter-resident"))
    with pytest.raises(UsageError, match="--engine vllm"):
        validate(FLUSHED.with_(control="budgeter-resident", engine="sglang"))


def test_a_fleet_feeds_every_replica_its_own_pool() -> None:
    cfg = FLUSHED.with_(control="budgeter-resident", replicas=2, router="kvgate", lam=0.1, kv_pool=250_000)
    res = simulate_fleet(cfg)
    turns = numpy_columns(res.tables["turns"])
    assert set(np.unique(turns["replica"])) == {0, 1} and res.meta["parks"] > 0
