"""The fleet's books (kvgate.fleet.core), driven directly: placement, books per replica or one shared, a replica going
down (in-flight turns to the driver, held turns asked again in their order, the rest placed) and coming back, counts
per replica. The simulator and the gateway drive this same class (checked at the end)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import pytest

from kvgate.fleet.core import Fleet, Replica
from kvgate.fleet.routers import NoReplica, make_router
from kvgate.policy import Park, Policy, Proceed, SessionState, TurnFinished
from kvgate.policy.core import Decision


@dataclass(eq=False)
class S:
    """A session record, as a driver keeps one."""

    sid: str
    demand: int = 600
    replica: Replica | None = None
    policy: Policy | None = None


@dataclass
class Driver:
    fleet: Fleet
    sessions: dict[str, S] = field(default_factory=dict)
    log: list[tuple[str, str]] = field(default_factory=list)

    def ask(self, s: S, now: float = 0.0) -> list[Decision]:
        self.sessions[s.sid] = s
        return self.fleet.ask(s, now, s.demand - 100, 100)

    def apply(self, decisions: list[Decision], now: float) -> None:
        self.log += [("proceed" if type(d) is Proceed else "park", str(d.session)) for d in decisions]

    def turn_failed(self, s: S, now: float) -> None:
        self.log.append(("failed", s.sid))

    def ask_again(self, s: S, now: float) -> None:
        self.log.append(("asked", s.sid))
        self.apply(self.fleet.ask(s, now, s.demand - 100, 100), now)


def fleet(n: int, router: str = "kvgate", control: str = "budgeter", pool: int = 1000) -> tuple[Fleet, Driver]:
    f = Fleet([Replica(i, pool) for i in range(n)], make_router(router))
    f.active = (control, {})
    d = Driver(f)
    f.driver = d
    f.start(0.0)
    return f, d


def test_sticky_books_per_replica_and_placement_by_headroom() -> None:
    f, d = fleet(3)
    assert f.shared is None and len({id(r.policy) for r in f.replicas}) == 3
    for sid in "ABC":
        assert d.ask(S(sid)) == [Proceed(sid)]
    assert [r.demand for r in f.replicas] == [600, 600, 600]  # one session each: the most headroom, lowest index
    # D waits on replica 0; its demand counts against that replica's headroom, so E goes to replica 1
    assert d.ask(S("D")) == [Park("D")] and d.sessions["D"].replica is f.replicas[0]
    assert f.replicas[0].placed == 1200 and f.replicas[0].headroom == 0.95 * 1000 - 1200
    d.ask(S("E"))
    assert d.sessions["E"].replica is f.replicas[1]
    assert f.counts_of(f.replicas[0]) == (1, 0, 1, 600)
    # sticky: the next turn of A stays where A is
    a = d.sessions["A"]
    a.policy.handle(TurnFinished(1.0, "A", 1.0, 500, 0, 100))  # type: ignore[union-attr]
    assert d.ask(a, 2.0) == [Proceed("A")] and a.replica is f.replicas[0]


def test_a_replica_down_fails_its_turns_asks_its_held_ones_again_in_order_and_places_the_rest() -> None:
    f, d = fleet(3)
    for sid in "ABC":
        d.ask(S(sid))
    rep0 = f.replicas[0]
    for sid in ("D", "E"):  # placed on replica 0 (as a sticky router keeps them), where both wait behind A
        s = rep0.members[sid] = S(sid, replica=rep0)
        assert d.ask(s) == [Park(sid)] and s.replica is rep0
    old = rep0.policy
    assert old is not None and old.waiting_order() == ["D", "E"]
    d.log.clear()
    moved = f.fail(rep0, 5.0)
    assert not rep0.up and rep0.policy is None and rep0.downs == 1 and f.retired == [0, 0, old.waits] == [0, 0, 2]
    # A was running there: the driver hears of it; D and E are asked again, in the order they waited
    assert d.log[0] == ("failed", "A")
    assert [x for x in d.log if x[0] == "asked"] == [("asked", "D"), ("asked", "E")]
    assert all(d.sessions[x].replica is not rep0 for x in "DE") and moved == 2
    assert d.sessions["A"].replica is rep0 and d.sessions["A"].policy is None  # in flight: placed when re-sent
    assert f.replacements == 2 and f.fail(rep0, 6.0) == 0  # (down already: nothing)
    # back: fresh books, and the next new session goes there (the most headroom)
    f.revive(rep0, 10.0)
    assert rep0.up and rep0.policy is not None and rep0.policy.counts()["in_system"] == 0
    d.ask(S("F"), 10.0)
    assert d.sessions["F"].replica is rep0


def test_sessions_between_turns_are_placed_when_their_replica_goes_down() -> None:
    f, d = fleet(2, router="consistent-hash", control="none")
    ss = [S(f"s{i}") for i in range(12)]
    for s in ss:
        d.ask(s)
    for s in ss:
        s.policy.handle(TurnFinished(1.0, s.sid, 1.0, 500, 0, 100))  # type: ignore[union-attr]
    on1 = [s for s in ss if s.replica is f.replicas[1]]
    assert on1
    assert f.fail(f.replicas[1], 2.0) == len(on1)
    assert all(s.replica is f.replicas[0] and s.policy is None for s in on1)
    assert not f.replicas[1].members and len(f.replicas[0].members) == 12
    f.fail(f.replicas[0], 3.0)
    with pytest.raises(NoReplica):
        f.place(S("new"))


def test_a_per_turn_router_shares_one_policy_whose_control_follows_the_live_pools() -> None:
    f, d = fleet(2, router="round-robin")
    assert f.shared is not None and all(r.policy is f.shared and r.shared for r in f.replicas)
    assert f.shared.control.kv_pool == 2000
    a = S("A")
    d.ask(a)
    first = a.replica
    a.policy.handle(TurnFinished(1.0, "A", 1.0, 500, 0, 100))  # type: ignore[union-attr]
    d.ask(a, 2.0)
    assert a.replica is not first  # every turn to the next replica
    assert sum(f.counts_of(r)[0] for r in f.replicas) == 1 and f.counts()["admitted"] == 1
    d.log.clear()
    f.fail(f.replicas[1], 3.0)
    assert f.shared.control.kv_pool == 1000 and d.log == [("failed", "A")]
    assert f.shared.state_of("A") is SessionState.RUNNING  # the shared books stay (the driver aborts the turn)
    f.revive(f.replicas[1], 4.0)
    assert f.shared.control.kv_pool == 2000 and f.replicas[1].policy is f.shared


def test_one_replica_is_a_fleet_of_one_without_a_router() -> None:
    class Refuses:  # a router that must not be asked
        sticky = False
        reads_kv_usage = False

        def route(self, *a: Any) -> int:
            raise AssertionError("routed a fleet of one")

    f = Fleet([Replica(0, 1000)], Refuses())  # type: ignore[arg-type]
    f.active = ("budgeter", {})
    f.driver = Driver(f)
    f.start(0.0)
    s = S("A")
    assert f.ask(s, 0.0, 500, 100) == [Proceed("A")] and s.replica is f.replicas[0] and s.policy is f.shared


def test_a_control_switch_reaches_every_live_policy_over_its_own_pool() -> None:
    f, _ = fleet(3, control="none")
    f.fail(f.replicas[2], 1.0)
    f.set_control(2.0, "budgeter", {})
    assert [r.policy.control.name if r.policy else None for r in f.replicas] == ["budgeter", "budgeter", None]
    assert f.control.name == "budgeter"
    f.revive(f.replicas[2], 3.0)
    assert f.replicas[2].policy.control.name == "budgeter"  # type: ignore[union-attr]


def test_the_simulator_and_the_gateway_drive_this_fleet() -> None:
    from kvgate.gateway import fleet as gw_fleet
    from kvgate.sim.config import SimConfig
    from kvgate.sim.fleet import FleetSim

    sim = FleetSim(SimConfig(replicas=2, minutes=1, lam=0.05))
    assert type(sim.fleet) is Fleet
    assert issubclass(gw_fleet.Fleet, Fleet) and issubclass(gw_fleet.Replica, Replica)
    for name in ("place", "ask", "target", "fail", "revive", "leave", "set_control", "resize", "counts_of"):
        assert name not in vars(gw_fleet.Fleet), f"the gateway's fleet overrides {name}"
