"""The gateway's tenant options and books without a server: what builds FairPolicy, names, bounds, bad input, and
the bounded per-tenant rows of the dashboard and series of ``/metrics``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest

from kvgate.errors import UsageError
from kvgate.gateway import GatewayConfig
from kvgate.gateway.dashboard import TOP_TENANTS, tenant_rows
from kvgate.gateway.tenants import NAMED_MAX, OTHER, TenantBook, TenantOf, parse_quotas, tenant_families
from kvgate.policy import FairPolicy, Proceed, Tenancy, TurnFinished, TurnRequested, make_control

UP = "http://127.0.0.1:8100"


def test_no_tenant_option_is_the_plain_core() -> None:
    assert GatewayConfig(upstream=UP, api_keys=("k1", "k2")).tenancy() is None
    assert TenantOf(None, "X-Kvgate-Priority", False).of({"X-Kvgate-Priority": "5"}, 1) == (None, None)


def test_api_keys_in_the_options_become_their_tenant_names() -> None:
    cfg = GatewayConfig(upstream=UP, api_keys=("sk-a", "sk-b"), tenant_weights="sk-a=3", tenant_quotas="sk-b=10")
    t = cfg.tenancy()
    assert t is not None and t.weight("key-0") == 3.0 and t.quota("key-1") == 10 and "sk-a" not in t.weights
    assert GatewayConfig(upstream=UP, tenant_header="X-Tenant").tenancy() is not None  # a header alone: fair


def test_a_request_s_tenant_and_priority() -> None:
    of = TenantOf("X-Tenant", "X-P", True).of
    assert of({"X-Tenant": "team-1", "X-P": "2"}, 0) == ("team-1", 2)
    assert of({}, 1) == ("key-1", None) and of({}, None) == ("default", None)
    with pytest.raises(Exception, match="integer"):
        of({"X-P": "high"}, None)


def test_quota_windows() -> None:
    assert parse_quotas(("A=5/1m,B=6/60",)) == ("A=5,B=6", 60.0)
    assert parse_quotas(("A=5",)) == ("A=5", None)
    with pytest.raises(UsageError):
        parse_quotas(("A=5/1m", "B=6/2m"))
    with pytest.raises(UsageError):
        parse_quotas(("A=5/soon",))


def test_the_book_is_bounded_and_named_tenants_keep_their_rows() -> None:
    book = TenantBook(named={"vip"})
    for i in range(NAMED_MAX + 10):
        book.sent(f"t{i}", 100, None)
    book.sent("vip", 5, 1.0)
    names = {r["tenant"] for r in book.table()}
    assert len(names) == NAMED_MAX + 2 and OTHER in names and "vip" in names
    other = next(r for r in book.table() if r["tenant"] == OTHER)
    assert other["turns"] == 10 and other["tokens"] == 1000


def many_tenants(n_tenants: int) -> tuple[FairPolicy, TenantBook, float]:
    """A fair policy over a small pool and the gateway's book, driven the way the request path drives them: two
    sessions per tenant arrive (some wait), the ones let through finish (their cached tokens noted) and ask again
    (some are parked), all with quotas; what the books see is then summed over every tenant for the checks."""
    tenancy = Tenancy(default_quota=50_000, window_s=60.0)
    p = FairPolicy(make_control("budgeter", kv_pool=1_000 * n_tenants), tenancy=tenancy)  # about 3/4 fit
    book = TenantBook.of(tenancy)
    assert book is not None
    now = 0.0
    sids = [(f"t{i % n_tenants}", i) for i in range(2 * n_tenants)]
    running: list[tuple[str, int]] = []

    demand: dict[int, int] = {}

    def decided(decisions: list[Any], by_sid: dict[int, str]) -> None:
        for d in decisions:
            if isinstance(d, Proceed):
                book.sent(by_sid[d.session], demand[d.session], 0.5)
                running.append((by_sid[d.session], d.session))

    by_sid = {sid: tenant for tenant, sid in sids}
    for tenant, sid in sids:
        now += 0.01
        demand[sid] = 1_000
        decided(p.handle(TurnRequested(now, sid, 900, 100, tenant=tenant)), by_sid)
    for tenant, sid in list(running):
        now += 0.01
        running.remove((tenant, sid))
        book.hit(tenant, now, 900, 300 + sid % 7)
        decided(p.handle(TurnFinished(now, sid, 1.0, 900, 300, 100)), by_sid)
        demand[sid] = 2_000 + sid % 5
        decided(p.handle(TurnRequested(now, sid, demand[sid] - 100, 100, tenant=tenant)), by_sid)
    return p, book, now


@pytest.mark.parametrize("n_tenants", [3, 40, 300])
def test_dashboard_tenant_rows_are_bounded_and_other_holds_the_rest(n_tenants: int) -> None:
    p, book, now = many_tenants(n_tenants)
    stats = p.tenant_stats()
    rows = tenant_rows(book, [stats], now)
    names = [r["tenant"] for r in rows]
    assert len(rows) == min(n_tenants, TOP_TENANTS) + (n_tenants > TOP_TENANTS)
    assert (OTHER in names) is (n_tenants > TOP_TENANTS) and len(set(names)) == len(names)
    counts = p.counts()
    totals = {
        "sessions": counts["in_system"], "parked": counts["parked"], "waiting": counts["waiting"],
        "demand_tokens": p.demand, "admitted_tokens": sum(r.tokens for r in book.rows.values()),
        "turns": sum(r.turns for r in book.rows.values()), "held": sum(r.held for r in book.rows.values()),
        "cached_tokens": sum(r.cached for r in book.rows.values()),
        "agent_prompt_tokens": sum(r.prompt_c for r in book.rows.values()),
        "quota_used": sum(st["used"] for st in stats.values()), "quota": 50_000 * n_tenants,
    }
    for key, total in totals.items():
        assert sum(r[key] for r in rows) == total, key
    assert counts["parked"] + counts["waiting"] > 0 and totals["turns"] > 0  # the books saw something to bound
    ranked = [r["admitted_tokens"] for r in rows if r["tenant"] != OTHER]
    assert ranked == sorted(ranked, reverse=True)
    if n_tenants > TOP_TENANTS:  # "other" is every tenant not shown: its ratio from the summed tokens
        other = rows[-1]
        assert other["tenant"] == OTHER and other["sessions"] == counts["in_system"] - sum(
            r["sessions"] for r in rows[:-1])
        assert other["hit_ratio"] == round(other["cached_tokens"] / other["agent_prompt_tokens"], 6)
        hidden = [r.tokens for k, r in book.rows.items() if k not in names and k != OTHER]
        assert min(ranked) >= max(hidden, default=0)  # the ones shown are the top ones


def test_tenant_series_are_bounded_and_sum_to_the_policy() -> None:
    p, book, now = many_tenants(300)
    fleet = SimpleNamespace(replicas=[SimpleNamespace(policy=p), SimpleNamespace(policy=p)])  # shared: once
    fams = {f.name: f for f in tenant_families(book, fleet, now)}
    counts = p.counts()
    for name, fam in fams.items():
        labels = [s.labels["tenant"] for s in fam.samples]
        assert len(labels) == len(set(labels)) == NAMED_MAX + 1, name  # the first NAMED_MAX tenants and other
        assert OTHER in labels, name
    assert len(fams) == 13

    def total(family: str) -> float:
        return sum(s.value for s in fams[family].samples)
    assert total("kvgate_tenant_sessions") == counts["in_system"]
    assert total("kvgate_tenant_sessions_parked") == counts["parked"]
    assert total("kvgate_tenant_sessions_waiting") == counts["waiting"]
    assert total("kvgate_tenant_demand_tokens") == p.demand
    assert total("kvgate_tenant_agent_cached_tokens") == sum(r.cached for r in book.rows.values()) > 0


def test_tenants_only_the_policy_knows_share_the_bound() -> None:
    """Sessions of 50 tenants all waiting (nothing sent yet, so the gateway's own counters saw none of them): the
    gauges still have at most NAMED_MAX + 1 series, and sum to the policy's."""
    p = FairPolicy(make_control("budgeter", kv_pool=1_000), tenancy=Tenancy())
    for i in range(51):
        p.handle(TurnRequested(0.0, i, 900, 100, tenant=f"t{i}"))
    book = TenantBook.of(Tenancy())
    assert book is not None
    fams = {f.name: f for f in tenant_families(book, SimpleNamespace(replicas=[SimpleNamespace(policy=p)]), 0.0)}
    waiting = fams["kvgate_tenant_sessions_waiting"].samples
    assert len(waiting) == NAMED_MAX + 1 and sum(s.value for s in waiting) == p.counts()["waiting"] == 50
    assert len(tenant_rows(book, [p.tenant_stats()], 0.0)) == TOP_TENANTS + 1
