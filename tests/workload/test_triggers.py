"""Triggers as types in one home (kvgate.workload.triggers): parsed from their config fields, written back, removed
for the paired twin, their end aligning the judged windows, and one option each, the same in every program."""

from __future__ import annotations

from dataclasses import asdict

import click
import pytest

from kvgate.errors import UsageError
from kvgate.sim.config import SimConfig
from kvgate.workload import triggers as T


def cfg() -> SimConfig:
    return SimConfig(bursts=("1.5@15+5", "+20@40+2"), flush_at=30.0, rate_at=("50:0.01",), control_at=10.0,
                     replicas=2, fail_at=("1@20",), join_at=(25.0, 35.0), migrate_after_s=90.0)


def test_every_field_is_read_as_its_kind_and_written_back() -> None:
    ts = T.triggers_of(cfg())
    assert [t.kind for t in ts] == ["burst", "burst", "rate", "flush", "control", "fail", "join", "join", "migrate"]
    burst, _, rate, flush, control, fail, join1, join2, migrate = ts
    assert (burst.at_min, burst.end_min(), burst.spec()) == (15.0, 20.0, "1.5@15+5")
    assert (rate.at_min, rate.lam, rate.spec()) == (50.0, 0.01, "50:0.01")  # type: ignore[attr-defined]
    assert (flush.at_min, control.at_min) == (30.0, 10.0)
    assert (fail.replica, fail.at_min) == (1, 20.0)  # type: ignore[attr-defined]
    assert (join1.replica, join2.replica) == (2, 3)  # type: ignore[attr-defined]  (after the 2 initial replicas)
    assert migrate.spec() == 90.0
    for t in ts:
        assert type(t).parse(t.spec()) == t or isinstance(t, T.Join)
    assert T.triggers_of(asdict(cfg())) == ts  # run.json's flat dict reads the same


def test_the_twin_runs_without_the_triggers_under_test_only() -> None:
    c = cfg().with_(triggers=("shrink:1000@5+1",))
    twin = T.twin_of(c)
    assert twin.bursts == () and twin.flush_at is None and twin.triggers == ()
    assert (twin.rate_at, twin.control_at, twin.fail_at, twin.join_at) == (c.rate_at, c.control_at, c.fail_at,
                                                                            c.join_at)
    assert T.trigger_end_min(c) == 42.0  # the last burst's end
    assert T.trigger_end_min(twin) is None and T.trigger_end_min(SimConfig(flush_at=8.0)) == 8.0


def test_the_generic_field_and_bad_specs() -> None:
    @T.register
    class Tick(T.Trigger):  # a new kind: a class, nothing more
        kind = "tick-test"
        concern = "engine"
        option, metavar, help = "--tick-at", "MIN", "A test trigger."

    try:
        kw = T.config_values({"tick_at": ("3", "4.5"), "bursts": ["1@1+1"]})
        assert kw["triggers"] == ("tick-test:3.0", "tick-test:4.5") and kw["bursts"] == ("1@1+1",)
        got = T.triggers_of(SimConfig(triggers=kw["triggers"]))
        assert got == [Tick(3.0), Tick(4.5)] and T.trigger_end_min(SimConfig(triggers=kw["triggers"])) is None
    finally:
        del T.REGISTRY["tick-test"]
    for bad in ("nope:1", "flush", "burst:1.5@x+5"):
        with pytest.raises(UsageError):
            T.parse_trigger(bad)
    with pytest.raises(UsageError):
        T.ReplicaFailure.parse("2-20")


def test_one_option_per_kind_shared_by_the_simulator_and_the_driver() -> None:
    from kvgate.cli import cli

    def options(name: str) -> dict[str, click.Option]:
        cmd = cli.get_command(click.Context(cli), name)
        assert cmd is not None
        return {o.opts[0]: o for o in cmd.params if isinstance(o, click.Option)}

    sim, drive, paired = options("sim"), options("drive"), options("paired")
    for kind in T.REGISTRY.values():
        assert kind.option in sim and kind.option in paired, kind
        assert sim[kind.option].help == kind.help
    for kind in T.kinds(over_http=True):
        assert kind.option in drive and drive[kind.option].help == sim[kind.option].help
    for name in ("--preset", "--lam", "--minutes", "--client-timeout"):
        assert drive[name].help == sim[name].help
