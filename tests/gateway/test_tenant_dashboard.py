"""Per-tenant rows through HTTP: ``/kvgate/dashboard.json`` shows the top tenants and ``other`` (the rows add up),
``/metrics`` the ``kvgate_tenant_*`` series, and the page has the table they fill."""

from __future__ import annotations

from kvgate.gateway.dashboard import PAGE, TOP_TENANTS
from support.aio import timed
from support.fake_upstream import FakeUpstream, post, stack

END = {"X-Session-End": "true"}


@timed(30)
async def test_dashboard_and_metrics_show_bounded_tenant_rows() -> None:
    n = TOP_TENANTS + 4
    async with stack(FakeUpstream(), kv_pool=100_000, tenant_header="X-Tenant") as (_, gw, client, base):
        body = {"model": "m", "prompt": list(range(400)), "max_tokens": 10}
        for i in range(n):
            for turn in range(1 + (i < 3)):  # the first three tenants send two turns each
                headers = {"X-Tenant": f"team-{i}", **(END if turn or i >= 3 else {})}
                status, _, _ = await post(client, base + "/v1/completions", body, f"s{i}", **headers)
                assert status == 200
        async with client.get(base + "/kvgate/dashboard.json") as r:
            assert r.status == 200
            d = await r.json()
        async with client.get(base + "/metrics") as r:
            text = await r.text()
    rows = d["tenants"]
    assert len(rows) == TOP_TENANTS + 1 and rows[-1]["tenant"] == "other"
    assert [r["tenant"] for r in rows[:3]] == ["team-0", "team-1", "team-2"]  # the most tokens first
    assert sum(r["turns"] for r in rows) == n + 3 and rows[-1]["turns"] == n + 3 - sum(r["turns"] for r in rows[:-1])
    assert sum(r["sessions"] for r in rows) == d["sessions"]["in_system"] == 0  # every session ended
    assert all(r["hit_ratio"] == 0.5 for r in rows)  # the fake engine reports half the prompt cached
    assert rows[-1]["agent_prompt_tokens"] == 400 * (n + 3 - sum(r["turns"] for r in rows[:-1]))
    assert 'kvgate_tenant_turns_total{tenant="team-11"} 1.0' in text
    assert 'kvgate_tenant_agent_cached_tokens_total{tenant="team-0"} 400.0' in text
    assert "kvgate_tenant_sessions{" in text
    assert 'id="tenants"' in PAGE
