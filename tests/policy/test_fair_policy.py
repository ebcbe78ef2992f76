"""FairPolicy: one tenant decides exactly as Policy; several share by weight, bands, a guard and quotas."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.policy import (
    CONTROLS,
    FairPolicy,
    OverQuota,
    Park,
    Policy,
    PolicyError,
    Proceed,
    SessionEnded,
    SessionState,
    Tenancy,
    TurnAborted,
    TurnFinished,
    TurnRequested,
    make_control,
    make_policy,
    parse_assignments,
)
from kvgate.policy.events import Decision, Event

S = SessionState
C = 10_000
FIFO_CONTROLS = [name for name in CONTROLS if name != "thunder"]
OPTS: dict[str, dict[str, float]] = {
    "budgeter": {"low": 0.5, "high": 0.6},
    "budgeter-resident": {"low": 0.5, "high": 0.6},
    "cap": {"K": 3, "K_hi": 4},
    "adaptive-cap": {"alpha": 0.3},
    "aimd": {"K0": 4, "interval_s": 2.0, "latency_s": 1.5},
    "admission-cap": {"K": 3},
}
FAST = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])

steps = st.lists(
    st.tuples(
        st.sampled_from(["arrive", "arrive", "request", "request", "finish", "finish", "finish", "end", "abort"]),
        st.integers(0, 10_000),
        st.integers(0, 6_000),
        st.floats(0.0, 3.0, allow_nan=False),
    ),
    min_size=10,
    max_size=80,
)


def control(name: str):  # noqa: ANN201
    return make_control(name, C, **OPTS.get(name, {}))


class Driver:
    """A legal driver over one or more policies fed the same events; states are read from the first."""

    def __init__(self, *policies: Policy, tenants: int = 1) -> None:
        self.policies = policies
        self.now = 0.0
        self.n = 0
        self.demand: dict[int, int] = {}
        self.tenant_of: dict[int, str] = {}
        self.tenants = tenants
        self.decisions: list[list[Decision]] = []

    def send(self, ev: Event) -> list[Decision]:
        outs = [p.handle(ev) for p in self.policies]
        for other in outs[1:]:
            assert other == outs[0], ev
        self.decisions.append(outs[0])
        return outs[0]

    def live(self, *states: S) -> list[int]:
        p = self.policies[0]
        return [s for s in self.demand if p._sessions.get(s) is not None and p.state_of(s) in states]

    def step(self, kind: str, pick: int, tokens: int, dt: float) -> None:
        self.now += dt
        p = self.policies[0]
        while (dl := p.next_deadline()) is not None and dl <= self.now:
            from kvgate.policy import Timer

            self.send(Timer(max(dl, p.now)))
        if kind == "arrive":
            sid, self.n = self.n, self.n + 1
            tenant = f"t{pick % self.tenants}"
            self.demand[sid], self.tenant_of[sid] = tokens, tenant
            if isinstance(self.send(TurnRequested(self.now, sid, tokens, 100, tenant=tenant))[0], OverQuota):
                del self.demand[sid]
            return
        pool = {
            "request": self.live(S.THINKING),
            "finish": self.live(S.RUNNING),
            "abort": self.live(S.RUNNING),
            "end": self.live(S.WAITING, S.RUNNING, S.THINKING, S.PARKED),
        }[kind]
        if not pool:
            return
        sid = pool[pick % len(pool)]
        if kind == "request":
            self.demand[sid] += tokens // 2
            self.send(TurnRequested(self.now, sid, self.demand[sid], 100, tenant=self.tenant_of[sid]))
        elif kind == "finish":
            self.send(TurnFinished(self.now, sid, dt * 2, self.demand[sid], None, 100))
        elif kind == "abort":
            self.send(TurnAborted(self.now, sid))
        else:
            self.send(SessionEnded(self.now, sid))

    def drain(self) -> None:
        """Finish and end every session; everything held must be admitted on the way."""
        for _ in range(10 * len(self.demand) + 10):
            running = self.live(S.RUNNING)
            if running:
                self.step("finish", 0, 0, 0.5)
                continue
            thinking = self.live(S.THINKING)
            if not thinking:
                break
            self.send(SessionEnded(self.now, thinking[0]))
        assert not self.live(S.WAITING, S.PARKED, S.RUNNING, S.THINKING)
        assert self.policies[0].demand == 0


def check_books(p: FairPolicy) -> None:
    admitted = [s for s in p._sessions.values() if s.state in (S.RUNNING, S.THINKING)]
    assert p.demand == sum(s.demand for s in admitted)
    for key, stats in p.tenant_stats().items():
        assert stats["demand"] == sum(s.demand for s in admitted if s.tenant.key == key)
    held = p.counts()["parked"] + p.counts()["waiting"]
    assert held == p._held == len(p.parked_order()) + len(p.waiting_order())
    if held:
        assert p.n_admitted > 0  # the liveness guard: nothing held with nobody admitted


@pytest.mark.parametrize("name", FIFO_CONTROLS)
@FAST
@given(script=steps)
def test_one_tenant_decides_exactly_as_the_policy(name: str, script: list[tuple[str, int, int, float]]) -> None:
    d = Driver(Policy(control(name)), FairPolicy(control(name), tenancy=Tenancy()))
    for step in script:
        d.step(*step)
        base, fair = d.policies
        assert (base.demand, base.counts(), base.parked_order(), base.waiting_order()) == (
            fair.demand,
            fair.counts(),
            fair.parked_order(),
            fair.waiting_order(),
        )
        assert (base.parks, base.readmissions, base.waits) == (fair.parks, fair.readmissions, fair.waits)
    d.drain()


@pytest.mark.parametrize("name", ["budgeter", "cap", "aimd"])
@FAST
@given(script=steps, weights=st.lists(st.sampled_from([0.5, 1, 3]), min_size=3, max_size=3))
def test_several_tenants_keep_the_books_and_drain(
    name: str, script: list[tuple[str, int, int, float]], weights: list[float]
) -> None:
    tenancy = Tenancy(weights={f"t{i}": w for i, w in enumerate(weights)}, priorities={"t2": 1}, starve_after=2)
    p = FairPolicy(control(name), tenancy=tenancy)
    d = Driver(p, tenants=3)
    for step in script:
        d.step(*step)
        check_books(p)
    d.drain()
    check_books(p)


def flood(p: FairPolicy, now: float, n_a: int, n_b: int, tokens: int = 2_900) -> Driver:
    """Tenant A sends ``n_a`` one-turn sessions, then B ``n_b``; returns the driver (A's ids first)."""
    d = Driver(p, tenants=1)
    for i in range(n_a + n_b):
        tenant = "A" if i < n_a else "B"
        d.demand[i], d.tenant_of[i] = tokens, tenant
        d.send(TurnRequested(now, i, tokens, 100, tenant=tenant))
    d.n = n_a + n_b
    return d


def completion_order(d: Driver) -> list[int]:
    """Finish running turns one at a time, in the order they proceeded, ending each session; the order they ended."""
    queue = d.live(S.RUNNING)
    order: list[int] = []
    while queue:
        sid = queue.pop(0)
        d.now += 1
        released = d.send(TurnFinished(d.now, sid, 1.0, d.demand[sid], None, 100))
        released += d.send(SessionEnded(d.now, sid))
        queue += [x.session for x in released if isinstance(x, Proceed)]
        order.append(sid)
    return order


def test_a_light_tenant_is_not_queued_behind_a_flooding_one() -> None:
    # 20K pool, ~3K sessions: A's 16 fill the budget; B's 4 arrive behind them
    fair = flood(FairPolicy(make_control("budgeter", 20_000)), 0.0, 16, 4)
    order = completion_order(fair)
    b_done = sorted(order.index(i) for i in range(16, 20))
    a_done = sorted(order.index(i) for i in range(16))
    assert b_done[1] < a_done[7]  # B's median session completes before A's
    # the same stream through the plain policy: B only after all of A
    plain = Driver(Policy(make_control("budgeter", 20_000)))
    for i in range(20):
        plain.demand[i] = 2_900
        plain.send(TurnRequested(0.0, i, 2_900, 100))
    plain_order = completion_order(plain)
    assert sorted(plain_order.index(i) for i in range(16, 20))[1] >= 16  # B's median: after all of A's


@pytest.mark.parametrize("wa,wb", [(1, 1), (3, 1)])
def test_readmissions_split_tokens_by_weight(wa: int, wb: int) -> None:
    p = FairPolicy(make_control("cap", C, K=2, K_hi=2), tenancy=Tenancy(weights={"A": wa, "B": wb}))
    d = flood(p, 0.0, 200, 200, tokens=1_000)
    order = completion_order(d)[:200]  # while both are backlogged
    share_a = sum(1 for i in order if i < 200) / len(order)
    assert share_a == pytest.approx(wa / (wa + wb), abs=0.02)


def test_a_share_nobody_uses_goes_to_the_others() -> None:
    p = FairPolicy(make_control("cap", C, K=4, K_hi=4), tenancy=Tenancy(weights={"A": 1, "B": 9}))
    d = flood(p, 0.0, 12, 0, tokens=1_000)
    assert p.n_admitted == 4  # B is absent: A takes the whole limit
    assert len(completion_order(d)) == 12


def test_parking_spares_a_tenant_under_its_share() -> None:
    p = FairPolicy(make_control("budgeter", 10_000, low=0.5, high=0.6))
    for i, (t, tok) in enumerate([("A", 2_000), ("A", 2_000), ("B", 900)]):
        assert p.handle(TurnRequested(0, i, tok, 0, tenant=t)) == [Proceed(i)]
    for i in range(3):
        p.handle(TurnFinished(1, i, 1, 0, None, 0))
    # D = 4900 + growth; both tenants' next boundaries push D over 0.6 C
    assert p.handle(TurnRequested(2, 2, 2_500, 0, tenant="B")) == [Proceed(2)]  # B: 2500 of 6500 < its half
    assert p.handle(TurnRequested(2, 0, 2_100, 0, tenant="A")) == [Park(0)]  # A: 4100 of 6600, over its half


def test_bands_are_served_first_and_the_lowest_is_not_starved() -> None:
    tenancy = Tenancy(priorities={"hi": 1}, starve_after=3)
    p = FairPolicy(make_control("cap", C, K=1, K_hi=1), tenancy=tenancy)
    d = Driver(p)
    for i in range(40):
        t = "hi" if i % 2 else "lo"
        d.demand[i], d.tenant_of[i] = 100, t
        d.send(TurnRequested(0, i, 100, 0, tenant=t))
    order = completion_order(d)[1:]  # the first was admitted at arrival
    first_20 = [d.tenant_of[i] for i in order[:20]]
    assert first_20.count("hi") == 15  # three of every four go to the high band while it is backlogged
    assert first_20[:4] == ["hi", "hi", "hi", "lo"]
    # a per-request priority overrides the tenant's
    q = FairPolicy(make_control("cap", C, K=1, K_hi=1), tenancy=tenancy)
    q.handle(TurnRequested(0, "x", 1, 0, tenant="lo"))
    q.handle(TurnRequested(0, "y", 1, 0, tenant="hi"))
    q.handle(TurnRequested(0, "z", 1, 0, tenant="lo", priority=5))
    assert q.handle(SessionEnded(1, "x")) == [Proceed("z")]


def test_quota_reserves_refunds_and_refuses_with_retry_after() -> None:
    p = FairPolicy(make_control("none", C), tenancy=Tenancy(quotas={"A": 10_000}, window_s=60))
    assert p.handle(TurnRequested(0, "a", 6_000, 1_000, tenant="A")) == [Proceed("a")]
    assert p.handle(TurnRequested(10, "b", 2_500, 1_000, tenant="A")) == [OverQuota("b", 50.0)]
    with pytest.raises(PolicyError):
        p.state_of("b")  # refused: not recorded
    assert p.handle(TurnRequested(10, "c", 3_000, 0, tenant="other")) == [Proceed("c")]  # no quota
    p.handle(TurnFinished(12, "a", 1, 6_000, 0, 200))  # used 6200 of the 7000 reserved: 800 back
    assert p.tenant_stats()["A"]["used"] == 6_200
    assert p.handle(TurnRequested(13, "b", 2_800, 1_000, tenant="A")) == [Proceed("b")]
    p.handle(TurnAborted(14, "b"))  # an aborted turn is refunded
    assert p.tenant_stats()["A"]["used"] == 6_200
    assert p.handle(TurnRequested(61, "a", 9_000, 1_000, tenant="A")) == [Proceed("a")]  # a new window


def test_construction_and_parsing() -> None:
    with pytest.raises(PolicyError):
        FairPolicy(make_control("thunder", C))
    with pytest.raises(PolicyError):
        Tenancy(weights={"A": 0})
    with pytest.raises(PolicyError):
        parse_assignments("A3", float, "--tenant-weight")
    assert parse_assignments("A=3, B=0.5", float, "w") == {"A": 3.0, "B": 0.5}
    assert type(make_policy(make_control("none", C))) is Policy
    assert type(make_policy(make_control("none", C), tenancy=Tenancy())) is FairPolicy
