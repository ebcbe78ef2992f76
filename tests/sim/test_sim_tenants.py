"""Tenants in the simulator: tenant classes drawn per session, a burst of one tenant, fair share, the records'
tenant column, and the two-tenant experiment's verdicts (which can come out either way)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.experiments.base import Context
from kvgate.experiments.fleet_tenants import SEEDS, TENANTS, eval_tenants, plan_tenants, tenant_turns
from kvgate.experiments.verdicts import NOT_REPRODUCED, REPRODUCED
from kvgate.policy import FairPolicy, Policy
from kvgate.records import from_tables
from kvgate.sim.config import SimConfig
from kvgate.sim.fleet import FleetSim
from kvgate.sim.runner import simulate

BASE = SimConfig(preset="paper-8b", lam=0.035, minutes=30, bursts=("1.5@10+5",), control="budgeter")


def test_tenants_are_drawn_per_session_and_change_no_other_draw() -> None:
    plain = BASE.session_specs()
    two = BASE.with_(tenants="A=0.5,B=0.5", burst_tenant="A").session_specs()
    assert [(s.sid, s.arrival_s, s.think_s) for s in plain] == [(s.sid, s.arrival_s, s.think_s) for s in two]
    assert {s.tenant for s in plain} == {""}
    assert {s.tenant for s in two if s.cohort == "trigger"} == {"A"}
    base = [s.tenant for s in two if s.cohort == "base"]
    assert set(base) == {"A", "B"} and 0.3 < base.count("A") / len(base) < 0.7
    # the no-burst twin: the same base sessions with the same tenants
    twin = BASE.with_(tenants="A=0.5,B=0.5", burst_tenant="A", bursts=()).session_specs()
    assert [(s.sid, s.tenant) for s in twin] == [(s.sid, s.tenant) for s in two if s.cohort == "base"]
    skewed = BASE.with_(tenants="A=9,B=1", minutes=120).session_specs()
    assert [s.tenant for s in skewed].count("B") / len(skewed) < 0.2


def test_the_records_carry_the_tenant_and_fair_share_makes_a_fair_policy() -> None:
    cfg = BASE.with_(tenants="A=0.5,B=0.5", burst_tenant="A", fair_share=True)
    sim = FleetSim(cfg)
    assert type(sim.fleet.shared) is FairPolicy
    assert type(FleetSim(BASE).fleet.shared) is Policy
    run = from_tables((res := simulate(cfg)).meta, res.tables)
    assert set(run.sessions["tenant"]) == {"A", "B"}
    hit, wait, n = tenant_turns(run, "B", 0.0)
    assert n > 0 and 0.0 < hit <= 1.0 and wait >= 0.0


def test_fair_share_with_one_tenant_changes_nothing() -> None:
    a, b = simulate(BASE.with_(fair_share=True)), simulate(BASE)
    for table in ("turns", "sessions", "samples"):
        assert a.tables[table].equals(b.tables[table]), table


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgate.cli", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.parametrize(
    "args, needle",
    [
        (["--tenants", "A=0.5,B"], "--tenants"),
        (["--tenants", "A=1,A=2"], "named twice"),
        (["--tenants", "A=1,B=1", "--burst-tenant", "C"], "--burst-tenant"),
        (["--fair-share", "--control", "thunder"], "fair share"),
        (["--fair-share", "--tenant-weight", "A=0"], "weight"),
    ],
)
def test_bad_tenant_options_are_one_line_and_exit_2(args: list[str], needle: str) -> None:
    p = _cli("sim", "--minutes", "1", *args)
    assert p.returncode == 2, p.stderr
    lines = p.stderr.strip().splitlines()
    assert len(lines) == 1 and needle in lines[0], p.stderr


def test_the_experiment_can_come_out_either_way(tmp_path: Path) -> None:
    """The fair claim holds on the fair runs; given the one-FIFO runs in their place it must not."""
    assert len(SEEDS) >= 8
    plan = dict(plan_tenants(False))
    assert len(plan) == 4 * len(SEEDS) and all(c.tenants == TENANTS.tenants for c in plan.values())
    runs = {}
    for rid, cfg in plan.items():
        res = simulate(cfg)  # type: ignore[arg-type]
        runs[rid] = from_tables(res.meta, res.tables)
    verdicts = {c.id: c.verdict for c in eval_tenants(Context(runs, tmp_path, quick=False)).claims}
    assert verdicts == {"fleet_tenants.fair": REPRODUCED, "fleet_tenants.fifo": REPRODUCED}
    swapped = {rid.replace("fifo/", "fair/") if rid.startswith("fifo/") else rid.replace("fair/", "fifo/"): r
               for rid, r in runs.items()}
    verdicts = {c.id: c.verdict for c in eval_tenants(Context(swapped, tmp_path, quick=False)).claims}
    assert verdicts == {"fleet_tenants.fair": NOT_REPRODUCED, "fleet_tenants.fifo": NOT_REPRODUCED}
