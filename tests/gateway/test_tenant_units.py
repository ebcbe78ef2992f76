"""The gateway's tenant options and books without a server: what builds FairPolicy, names, bounds, bad input."""

from __future__ import annotations

import pytest

from kvgate.errors import UsageError
from kvgate.gateway import GatewayConfig
from kvgate.gateway.tenants import NAMED_MAX, OTHER, TenantBook, TenantOf, parse_quotas

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
