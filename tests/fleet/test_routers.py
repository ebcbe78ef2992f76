"""Fleet routers: placement, stickiness, failover, headroom, determinism."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.fleet.routers import ROUTERS, STICKY, Kvgate, NoReplica, ReplicaView, make_router


def fleet(n: int, **kw: object) -> list[ReplicaView]:
    return [ReplicaView(i, kv_pool=400_000, **kw) for i in range(n)]  # type: ignore[arg-type]


def test_round_robin_cycles_over_up_replicas_per_turn() -> None:
    r = make_router("round-robin")
    reps = fleet(3)
    assert [r.route("s", reps) for _ in range(6)] == [0, 1, 2, 0, 1, 2]
    reps[1] = ReplicaView(1, up=False)
    assert [r.route("s", reps) for _ in range(4)] == [0, 2, 0, 2]


def test_random_is_deterministic_per_seed_and_spreads() -> None:
    a = [make_router("random", seed=3).route(i, fleet(4)) for i in range(1)]
    r1, r2 = make_router("random", seed=3), make_router("random", seed=3)
    seq1 = [r1.route(i, fleet(4)) for i in range(400)]
    assert seq1 == [r2.route(i, fleet(4)) for i in range(400)] and a[0] == seq1[0]
    assert min(Counter(seq1).values()) > 60  # every replica used


def test_least_loaded_picks_fewest_in_flight() -> None:
    reps = [ReplicaView(0, in_flight=5), ReplicaView(1, in_flight=2), ReplicaView(2, in_flight=2, up=False)]
    assert make_router("least-loaded").route("s", reps) == 1


def test_consistent_hash_is_sticky_and_moves_only_a_failed_replicas_sessions() -> None:
    r = make_router("consistent-hash")
    reps = fleet(4)
    before = {s: r.route(s, reps) for s in range(400)}
    assert min(Counter(before.values()).values()) > 40  # spread over all four
    assert all(r.route(s, reps) == at for s, at in before.items())
    down = list(reps)
    down[2] = ReplicaView(2, up=False)
    fresh = make_router("consistent-hash")  # the ring alone decides, not remembered placement
    after = {s: fresh.route(s, down) for s in range(400)}
    assert all(after[s] == before[s] for s in before if before[s] != 2)
    assert all(after[s] != 2 for s in after)


def test_prefix_affinity_prefers_resident_then_least_usage() -> None:
    r = make_router("prefix-affinity")
    held = {"a": 3000}
    reps = [ReplicaView(0, kv_usage=0.1), ReplicaView(1, kv_usage=0.9, resident=lambda s: held.get(s, 0)),
            ReplicaView(2, kv_usage=0.05)]
    assert r.route("a", reps) == 1  # most of it is there
    assert r.route("b", reps) == 2  # new: least KV usage
    reps[2] = ReplicaView(2, kv_usage=0.99)
    assert r.route("b", reps) == 2  # sticky while up


def test_kvgate_places_by_headroom_and_replaces_on_failure() -> None:
    r = make_router("kvgate")
    assert isinstance(r, Kvgate)
    reps = [ReplicaView(0, kv_pool=400_000, placed=300_000), ReplicaView(1, kv_pool=400_000, placed=100_000),
            ReplicaView(2, kv_pool=200_000, placed=0)]
    assert r.route("s", reps) == 1  # 280K headroom beats 190K and 80K
    reps[1] = ReplicaView(1, up=False, kv_pool=400_000)
    assert r.route("s", reps) == 2 and r.replica_of("s") == 2
    assert r.migration_target("s", 50_000, reps) == 0  # 80K headroom on 0
    assert r.migration_target("s", 90_000, reps) is None
    r.forget("s")
    assert r.replica_of("s") is None


@pytest.mark.parametrize("name", ROUTERS)
def test_no_replica_up_is_an_error(name: str) -> None:
    with pytest.raises(NoReplica):
        make_router(name).route("s", [ReplicaView(0, up=False), ReplicaView(1, up=False)])


def test_unknown_router() -> None:
    with pytest.raises(ValueError, match="unknown router"):
        make_router("sticky")


@settings(max_examples=100, deadline=None)
@given(st.sampled_from(ROUTERS), st.lists(st.tuples(st.integers(0, 30), st.integers(0, 3)), max_size=80),
       st.sets(st.integers(0, 3), max_size=3))
def test_routes_only_to_up_replicas_and_sticky_ones_stay(name: str, turns: list, down: set[int]) -> None:
    r = make_router(name, seed=1)
    reps = [ReplicaView(i, up=i not in down, kv_pool=100_000, in_flight=i) for i in range(4)]
    where: dict[int, int] = {}
    for session, _ in turns:
        at = r.route(session, reps)
        assert reps[at].up
        if name in STICKY:
            assert where.setdefault(session, at) == at


def test_routers_declare_what_they_read_and_the_registry_is_built_from_them() -> None:
    from kvgate.fleet.routers import REGISTRY, Router

    assert tuple(REGISTRY) == ROUTERS and all(issubclass(c, Router) and c.name == n for n, c in REGISTRY.items())
    assert {"consistent-hash", "prefix-affinity", "kvgate"} == STICKY
    assert [n for n, c in REGISTRY.items() if c.reads_kv_usage] == ["prefix-affinity"]
    for name in ROUTERS:
        assert type(make_router(name, seed=1)) is REGISTRY[name]
