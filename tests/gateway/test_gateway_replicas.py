"""``kvgate gateway`` over a fleet of fake upstreams (in the test's event loop): placement by the router, one policy
per replica for sticky routers (D_r against C_r) or one over the summed pools for per-turn ones, health checks,
a down replica's sessions placed anew, a turn retried on another replica, per-replica metrics and sessions.

Every test ends with the checks of :func:`fleet_stack`: per replica, D_r equals the true sum over the sessions
admitted there, no session is known to a policy other than its replica's, nothing is held, in flight or holding a
connection, and no task is left behind.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvgate.cli import main as cli_main
from kvgate.gateway import Gateway, GatewayConfig
from support.aio import timed
from support.fake_upstream import FakeUpstream, post, settle
from support.wait import until_async

URL = "/v1/completions"


def big(n: int = 200, out: int = 400) -> dict[str, Any]:
    """A turn of demand d = n + out (token-id prompt: L_s = n)."""
    return {"model": "m", "prompt": list(range(n)), "max_tokens": out}


def turns(up: FakeUpstream) -> int:
    """Completions the upstream served (its health checks are in ``seen`` too)."""
    return sum(1 for s in up.seen if s.get("path") == URL)


def check_fleet(gw: Gateway) -> None:
    a = gw.audit()
    for r in a["replicas"]:
        assert r["demand"] == r["admitted_demand"], a
    assert a["demand"] == a["admitted_demand"] and a["misplaced"] == 0 and a["orphans"] == 0, a
    assert a["unknown"] == [] and a["held"] == a["held_policy"] == 0 and a["in_flight"] == 0, a
    assert gw.upstream_connections()["acquired"] == 0


@contextlib.asynccontextmanager
async def fleet_stack(
    n: int, **cfg: Any
) -> AsyncIterator[tuple[list[FakeUpstream], Gateway, aiohttp.ClientSession, str]]:
    before = asyncio.all_tasks()
    ups = [FakeUpstream() for _ in range(n)]
    for up in ups:
        await up.start()
    urls = [u.url for u in ups]
    gw = Gateway(GatewayConfig(upstream=urls[0], upstreams=tuple(urls[1:]), **cfg))
    client = aiohttp.ClientSession()
    try:
        port = await gw.start("127.0.0.1", 0)
        yield ups, gw, client, f"http://127.0.0.1:{port}"
        idle = lambda: gw.audit()["in_flight"] == 0 and gw.upstream_connections()["acquired"] == 0  # noqa: E731
        await until_async(idle, "the handlers' clean-up")
        check_fleet(gw)
    finally:
        await client.close()
        await gw.stop()
        for up in ups:
            await up.stop()
    await settle(lambda: not (asyncio.all_tasks() - before - {asyncio.current_task()}))


async def sessions(client: aiohttp.ClientSession, base: str) -> dict[str, dict[str, Any]]:
    async with client.get(base + "/v1/sessions") as r:
        assert r.status == 200
        return {d["id"]: d for d in (await r.json())["data"]}


async def replica_metrics(client: aiohttp.ClientSession, base: str) -> dict[str, dict[str, float]]:
    """``{family: {replica url: value}}`` of the kvgate_replica_* gauges on /metrics."""
    async with client.get(base + "/metrics") as r:
        text = await r.text()
    out: dict[str, dict[str, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name.startswith("kvgate_replica_") and "state" not in s.labels:
                out.setdefault(s.name, {})[s.labels["replica"]] = s.value
    return out


async def check_books(client: aiohttp.ClientSession, base: str) -> dict[str, dict[str, Any]]:
    """Over HTTP: each replica's D_r on /metrics equals the sum over the admitted sessions /v1/sessions lists there."""
    listing = await sessions(client, base)
    metrics = await replica_metrics(client, base)
    for url, d in metrics["kvgate_replica_demand_tokens"].items():
        true = sum(s["demand_tokens"] for s in listing.values()
                   if s["replica"] == url and s["state"] in ("running", "thinking"))
        assert d == true, (url, d, true, listing)
    return listing


@timed(20)
async def test_kvgate_router_places_by_headroom_and_budgets_each_replica() -> None:
    # C_r = 1000 each: the budgeter admits while D_r + d <= 750 and parks when D_r > 950
    async with fleet_stack(3, kv_pool=1000, health_interval_s=0.05) as (ups, gw, client, base):
        urls = [u.url for u in ups]
        assert gw.kv_pool == 3000 and [r.kv_pool for r in gw.fleet.replicas] == [1000] * 3
        for sid in ("A", "B", "C"):
            status, _, _ = await post(client, base + URL, big(), sid)
            assert status == 200
        listing = await check_books(client, base)
        # each new session went to the replica with the most headroom (ties: the lowest index)
        assert [listing[s]["replica"] for s in "ABC"] == urls
        assert [turns(u) for u in ups] == [1, 1, 1]
        m = await replica_metrics(client, base)
        assert m["kvgate_replica_demand_tokens"] == dict.fromkeys(urls, 600.0)
        assert m["kvgate_replica_up"] == dict.fromkeys(urls, 1.0)
        assert m["kvgate_replica_kv_pool_tokens"] == dict.fromkeys(urls, 1000.0)
        # a fourth: every replica has 350 of headroom, replica 0 gets it and its budget makes it wait
        d_task = asyncio.create_task(post(client, base + URL, big(), "D"))
        await settle(lambda: gw.fleet.replicas[0].policy.counts()["waiting"] == 1)  # type: ignore[union-attr]
        listing = await check_books(client, base)
        assert listing["D"]["replica"] == urls[0] and listing["D"]["state"] == "waiting"
        assert (await replica_metrics(client, base))["kvgate_replica_sessions_waiting"][urls[0]] == 1
        # A ends: D is admitted on its replica; the others' books did not move
        status, _, _ = await post(client, base + URL, big(250), "A", **{"X-Session-End": "true"})
        assert status == 200
        status, _, _ = await d_task
        assert status == 200 and turns(ups[0]) == 3
        listing = await check_books(client, base)
        assert listing["D"]["state"] == "thinking" and "A" not in listing
        assert [r.demand for r in gw.fleet.replicas] == [600, 600, 600]


@timed(20)
async def test_kvgate_router_counts_the_sessions_held_on_a_replica_against_its_headroom() -> None:
    async with fleet_stack(3, kv_pool=1000, health_interval_s=0.05) as (ups, gw, client, base):
        urls = [u.url for u in ups]
        for sid in ("A", "B", "C"):
            status, _, _ = await post(client, base + URL, big(), sid)
            assert status == 200
        # D: 350 of headroom everywhere, so replica 0 (the lowest index), where it waits (600 + 600 > 750)
        d_task = asyncio.create_task(post(client, base + URL, big(), "D"))
        await settle(lambda: gw.fleet.replicas[0].policy.counts()["waiting"] == 1)  # type: ignore[union-attr]
        # E: admitted demand alone would leave replica 0 tied with the others (and first); D's 600 held there
        # counts, so E goes to replica 1
        assert [r.demand for r in gw.fleet.replicas] == [600, 600, 600]
        e_task = asyncio.create_task(post(client, base + URL, big(), "E"))
        await settle(lambda: gw.fleet.replicas[1].policy.counts()["waiting"] == 1)  # type: ignore[union-attr]
        listing = await check_books(client, base)
        assert listing["D"]["replica"] == urls[0] and listing["E"]["replica"] == urls[1]
        for sid in ("A", "B"):  # their ends release D and E
            status, _, _ = await post(client, base + URL, big(250), sid, **{"X-Session-End": "true"})
            assert status == 200
        assert (await d_task)[0] == 200 and (await e_task)[0] == 200


@timed(20)
async def test_a_down_replicas_sessions_are_placed_anew_and_it_comes_back() -> None:
    async with fleet_stack(3, kv_pool=1000, health_interval_s=0.05) as (ups, gw, client, base):
        urls = [u.url for u in ups]
        for sid in ("A", "B", "C"):
            assert (await post(client, base + URL, big(), sid))[0] == 200
        port1 = ups[1].port
        await ups[1].stop()  # replica 1 dies between B's turns
        await settle(lambda: not gw.fleet.replicas[1].up)
        m = await replica_metrics(client, base)
        assert m["kvgate_replica_up"][urls[1]] == 0 and m["kvgate_replica_downs_total"][urls[1]] == 1
        assert gw.kv_pool == 2000  # the fleet's C: the replicas up
        # B's admitted demand left replica 1's books; B is placed on replica 0 (most headroom, lowest index) and is
        # new there: its next turn waits for room (D_0 = 600)
        listing = await check_books(client, base)
        assert listing["B"]["replica"] == urls[0] and listing["B"]["state"] == "new"
        assert m["kvgate_replica_demand_tokens"][urls[1]] == 0 and gw.fleet.replacements == 1
        b_task = asyncio.create_task(post(client, base + URL, big(250), "B"))
        await settle(lambda: gw.fleet.replicas[0].policy.counts()["waiting"] == 1)  # type: ignore[union-attr]
        assert (await post(client, base + URL, big(250), "A", **{"X-Session-End": "true"}))[0] == 200
        status, _, _ = await b_task
        assert status == 200 and turns(ups[0]) == 3  # B's turn paid its miss on replica 0
        await check_books(client, base)
        # replica 1 comes back (same address): up again with fresh books, and the next new session goes there
        ups[1] = FakeUpstream()
        await ups[1].start(port1)
        await settle(lambda: gw.fleet.replicas[1].up)
        assert (await post(client, base + URL, big(), "E"))[0] == 200
        listing = await check_books(client, base)
        assert listing["E"]["replica"] == urls[1] and gw.kv_pool == 3000
        assert turns(ups[1]) == 1


@timed(20)
async def test_a_held_turn_on_a_down_replica_is_admitted_on_another() -> None:
    async with fleet_stack(2, kv_pool=1000, health_interval_s=0.05) as (ups, gw, client, base):
        urls = [u.url for u in ups]
        for sid in ("A", "B"):
            assert (await post(client, base + URL, big(), sid))[0] == 200
        c_task = asyncio.create_task(post(client, base + URL, big(), "C"))  # replica 0 (tie), waits there
        await settle(lambda: gw.fleet.replicas[0].policy.counts()["waiting"] == 1)  # type: ignore[union-attr]
        assert (await post(client, base + URL, big(250), "B", **{"X-Session-End": "true"}))[0] == 200
        assert not c_task.done()
        await ups[0].stop()
        status, body, _ = await c_task  # re-asked on replica 1, which has room: the client sees only latency
        assert status == 200 and body["choices"][0]["text"] == "ok ok ok "
        listing = await check_books(client, base)
        assert listing["C"]["replica"] == urls[1] and listing["C"]["state"] == "thinking"
        assert listing["A"]["replica"] == urls[1] and listing["A"]["state"] == "new"
        assert gw.fleet.replicas[1].demand == 600


@timed(20)
async def test_a_turn_in_flight_to_a_dying_replica_is_retried_on_another() -> None:
    async with fleet_stack(2, kv_pool=100_000, health_interval_s=30.0) as (ups, gw, client, base):
        urls = [u.url for u in ups]
        ups[0].mode = "hang"
        task = asyncio.create_task(post(client, base + URL, big(), "A"))
        await settle(lambda: turns(ups[0]) == 1)
        await ups[0].stop()  # the connection drops before any answer: no health check has run yet
        status, body, _ = await task
        assert status == 200 and body["usage"]["prompt_tokens"] == 200
        assert gw.retried == 1 and gw.turns["finished"] == 1 and gw.turns["failed"] == 0
        # (dropped on a kept-alive connection: the pool tries a new one, which is refused)
        assert gw.upstream_errors["disconnect"] + gw.upstream_errors["connect"] == 1 and not gw.fleet.replicas[0].up
        listing = await check_books(client, base)
        assert listing["A"]["replica"] == urls[1] and listing["A"]["state"] == "thinking"
        # with every replica down a turn is answered 503 (JSON), not hung
        await ups[1].stop()
        status, err, r = await post(client, base + URL, big(), "B")
        assert status in (502, 503) and err["error"]["message"]
        status, err, r = await post(client, base + URL, big(), "C")
        assert status == 503 and "no upstream replica is up" in err["error"]["message"]
        assert r.headers["Retry-After"] == "1"


@timed(20)
async def test_a_per_turn_router_shares_one_policy_over_the_live_pools() -> None:
    async with fleet_stack(2, kv_pool=1000, router="round-robin", health_interval_s=0.05) as (ups, gw, client, base):
        assert gw.policy.control.kv_pool == 2000 and gw.fleet.shared is gw.policy
        for k in range(4):
            assert (await post(client, base + URL, big(10 + k, 10), "A"))[0] == 200
        assert [turns(u) for u in ups] == [2, 2]  # turns alternate between the replicas
        await check_books(client, base)
        await ups[1].stop()
        await settle(lambda: not gw.fleet.replicas[1].up)
        assert gw.policy.control.kv_pool == 1000 and gw.kv_pool == 1000
        for k in range(2):
            assert (await post(client, base + URL, big(20 + k, 10), "A"))[0] == 200
        assert turns(ups[0]) == 4
        listing = await check_books(client, base)
        assert listing["A"]["replica"] == ups[0].url


@timed(20)
async def test_info_and_dashboard_show_the_replicas() -> None:
    async with fleet_stack(2, kv_pool=1000, health_interval_s=0.05) as (ups, gw, client, base):
        assert (await post(client, base + URL, big(), "A"))[0] == 200
        async with client.get(base + "/kvgate/info") as r:
            info = await r.json()
        assert info["router"] == "kvgate" and [x["replica"] for x in info["replicas"]] == [u.url for u in ups]
        assert info["upstream"]["kv_pool"] == 2000 and info["replicas"][0]["demand_tokens"] == 600
        assert info["tasks"] >= 2  # (the timer and the health checks, at least)
        async with client.get(base + "/kvgate/dashboard.json") as r:
            dash = await r.json()
        assert [x["demand_tokens"] for x in dash["replicas"]] == [600, 0]
        async with client.get(base + "/v1/models") as r:  # passed through to the first replica up
            assert r.status == 200 and (await r.json())["path"] == "/v1/models"


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "no upstream"),
        (["--upstream", "ftp://x"], "expected an http(s) URL"),
        (["--upstream", "http://127.0.0.1:9", "--upstream", "http://127.0.0.1:9/"], "given twice"),
        (["--upstream", "http://127.0.0.1:9", "--router", "sticky"], "'sticky' is not one of"),
        (["--upstreams", "/nonexistent/upstreams.txt"], "--upstreams /nonexistent/upstreams.txt"),
        (["--upstream", "http://127.0.0.1:9", "--health-interval", "0"], "--health-interval"),
    ],
)
def test_bad_fleet_options_are_one_line_errors(
    args: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        cli_main(["gateway", *args])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("kvgate: error:") and err.count("\n") == 1 and message in err, err


def test_upstreams_file(tmp_path: Any) -> None:
    from kvgate.gateway.config import read_upstreams

    f = tmp_path / "fleet.txt"
    f.write_text("# the fleet\nhttp://127.0.0.1:8101\n\n  http://127.0.0.1:8102  # second\n")
    assert read_upstreams(f)[0] == ("http://127.0.0.1:8101", "http://127.0.0.1:8102")
    cfg = GatewayConfig(upstreams=read_upstreams(f)[0])
    cfg.validate()
    assert cfg.urls == ("http://127.0.0.1:8101", "http://127.0.0.1:8102") and cfg.router_name == "kvgate"
    f.write_text("# nothing\n")
    with pytest.raises(Exception, match="no upstream URL"):
        read_upstreams(f)


def test_config_file_names_a_fleet(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    ups = tmp_path / "fleet.txt"
    ups.write_text("http://127.0.0.1:9\n")
    f = tmp_path / "gw.toml"
    f.write_text(f'upstream = "http://127.0.0.1:9"\nupstreams = "{ups}"\nrouter = "round-robin"\n')
    with pytest.raises(SystemExit) as e:
        cli_main(["gateway", "--config", str(f)])
    assert e.value.code == 2  # the file's upstream and the fleet file's: the same replica twice
    assert "given twice" in capsys.readouterr().err
