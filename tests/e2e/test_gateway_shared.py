"""Three ``kvgate gateway --store redis://`` processes in front of one ``kvgate engine`` (in-process), with a
redis-server of the test's own: one set of books and one budget across instances.

* Eight agents that name no session (lineage finds them), each turn sent to another instance, one instance
  SIGKILLed midway: every surviving instance lists the 8 sessions with all their turns.
* A burst of 24 sessions on a small pool, spread over the instances: the shared budget holds the excess (parked
  across instances) and the engine never queues (0 waiting, 0 preemptions), D within C at every look.
* Redis restarted during a burst: the instances go to their local share (C / instances), the engine still never
  queues, they resync when Redis is back and every turn finishes.
* The same three in front of a fleet of three engines (one budget per replica): the eight agents, one instance
  killed, are 8 sessions of all their turns on every survivor, each session's turns all on one engine (as the
  engines saw them); the burst of 24 parks across instances, D_r within C_r on every engine, none ever queues.

No timing assertions: waits are bounded, never measured.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import signal
import subprocess
import sys
import urllib.request
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
import pytest_asyncio

from support.ports import free_port, wait_health
from support.redis_server import RedisServer, redis_server
from support.wait import until_async

aiohttp = pytest.importorskip("aiohttp")
redis = pytest.importorskip("redis")
from kvgate.serve.app import EngineServer  # noqa: E402
from kvgate.serve.config import ServerConfig  # noqa: E402

pytestmark = [pytest.mark.slow, pytest.mark.asyncio]
SCALE = 20.0
PY = [sys.executable, "-m", "kvgate.cli"]
SYSTEM = "You are a coding agent. Use the tools to finish the task."


@pytest.fixture(scope="module")
def srv() -> Iterator[RedisServer]:
    with redis_server() as s:
        yield s


def _get(port: int, path: str) -> Any:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=10) as r:
        return json.loads(r.read())


class Instances:
    """Gateway processes sharing one Redis, in front of one engine."""

    def __init__(self, upstream: str | list[str], store: str, n: int, *extra: str) -> None:
        ups = [x for u in ([upstream] if isinstance(upstream, str) else upstream) for x in ("--upstream", u)]
        redis.Redis.from_url(store).flushall()  # (each test's own books: the agents' bodies repeat across tests)
        self.ports = [free_port() for _ in range(n)]
        self.procs = [subprocess.Popen(
            [*PY, "gateway", *ups, "--port", str(p), "--store", store, "--time-scale", str(SCALE),
             "--log-level", "warning", *extra], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for p in self.ports]
        self.live = list(range(n))

    def wait(self) -> None:
        for p, proc in zip(self.ports, self.procs, strict=True):
            wait_health(p, proc)

    def kill(self, i: int) -> None:
        self.procs[i].send_signal(signal.SIGKILL)
        self.procs[i].wait(10)
        self.live.remove(i)

    def stop(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.terminate()
        for proc in self.procs:
            try:
                proc.wait(15)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)

    def shared(self, i: int) -> dict[str, Any]:
        return _get(self.ports[i], "/kvgate/info")["resolution"]["shared"]


@pytest_asyncio.fixture
async def engine() -> AsyncIterator[tuple[EngineServer, str]]:
    eng = EngineServer(ServerConfig(kv_pool=4096, time_scale=SCALE, model="m"))
    port = await eng.start("127.0.0.1", 0)
    try:
        yield eng, f"http://127.0.0.1:{port}"
    finally:
        await eng.stop()


@contextlib.asynccontextmanager
async def _fleet(pool: int, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[list[EngineServer], list[str],
                                                                                     dict[str, set[str]]]]:
    """Three engines of ``pool`` tokens each; the engines each session's requests reached (by its X-Session-ID, as
    the engines see it)."""
    import kvgate.serve.generate as generate

    seen: dict[str, set[str]] = {}
    hint = generate.session_hint

    def recording(req: Any, body: dict[str, Any]) -> str | None:
        sid = hint(req, body)
        if sid is not None:
            seen.setdefault(sid, set()).add(req.host)
        return sid

    monkeypatch.setattr(generate, "session_hint", recording)
    engs = [EngineServer(ServerConfig(kv_pool=pool, time_scale=SCALE, model="m")) for _ in range(3)]
    urls = [f"http://127.0.0.1:{await e.start('127.0.0.1', 0)}" for e in engs]
    try:
        yield engs, urls, seen
    finally:
        for e in engs:
            await e.stop()


async def _turn(http: Any, ports: list[int], pick: int, messages: list[dict[str, Any]], max_tokens: int = 16,
                last: bool = False) -> tuple[dict[str, Any], int]:
    """One turn, sent to ``ports[pick % len]``; a connection error (a killed instance) retries on the next one.
    ``last``: the session's last turn (``X-Session-End``)."""
    body = {"model": "m", "messages": messages, "max_tokens": max_tokens}
    headers = {"X-Session-End": "true"} if last else {}
    for k in range(2 * len(ports)):
        port = ports[(pick + k) % len(ports)]
        try:
            async with http.post(f"http://127.0.0.1:{port}/v1/chat/completions", json=body, headers=headers) as r:
                got = await r.json()
                if r.status == 200:
                    return got, port
                assert r.status in (502, 503), got
        except aiohttp.ClientConnectionError:
            pass
        await asyncio.sleep(0.1)
    raise AssertionError("no instance answered the turn")


def _agent_start(i: int, words: int = 20) -> list[dict[str, Any]]:
    task = f"Task {i}: " + " ".join(f"w{i}x{k}" for k in range(words))
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]


async def test_agents_round_robin_survive_a_killed_instance(srv: RedisServer,
                                                            engine: tuple[EngineServer, str]) -> None:
    await _agents(Instances(engine[1], srv.url, 3))


async def test_agents_on_a_fleet_each_on_one_engine(srv: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    async with _fleet(4096, monkeypatch) as (_, urls, seen):
        await _agents(Instances(urls, srv.url, 3))
    assert len(seen) == 8, seen  # (the 8 sessions by their ids, as the gateways sent them)
    assert all(len(hosts) == 1 for hosts in seen.values()), seen  # each session's turns on one engine
    assert len(set().union(*seen.values())) >= 2, seen  # placed over the fleet, not all on one


async def _agents(gws: Instances) -> None:
    """Eight agents that name nothing, each turn to another instance, instance 1 SIGKILLed at turn 3: every
    survivor lists the 8 sessions with all their turns."""
    turns, kill_after = 6, 3
    try:
        await asyncio.to_thread(gws.wait)
        killed = asyncio.Event()
        at_kill = asyncio.Barrier(8)

        async def agent(i: int, http: Any) -> None:
            messages = _agent_start(i)
            for t in range(turns):
                if t == kill_after:
                    if await at_kill.wait() == 0:
                        gws.kill(1)
                        killed.set()
                    await killed.wait()
                ports = [gws.ports[j] for j in gws.live]
                got, _ = await _turn(http, ports, i + t, messages)
                messages = [*messages, {"role": "assistant", "content": got["choices"][0]["message"]["content"]},
                            {"role": "user", "content": f"tool result {t} of agent {i}"}]

        async with aiohttp.ClientSession() as http:
            await asyncio.gather(*(agent(i, http) for i in range(8)))

        def books(j: int) -> list[dict[str, Any]]:
            return _get(gws.ports[j], "/v1/sessions")["data"]

        for j in gws.live:  # (a survivor reads the others' last books within a heartbeat)
            await until_async(lambda j=j: sorted(s["turns"] for s in books(j)) == [turns] * 8,
                              f"8 sessions of {turns} turns on instance {j}")
            listed = books(j)
            assert all(s["source"] == "lineage" for s in listed), listed
            assert len({s["id"] for s in listed}) == 8
        ids = [sorted(s["id"] for s in books(j)) for j in gws.live]
        assert ids[0] == ids[1]  # the same sessions, by the same ids, everywhere
        await until_async(lambda: gws.shared(0)["instances"] == 2, "the killed instance counted out")
        st = gws.shared(0)
        assert st["store_up"] and st["held"] == 0 and st["admitted"] == 8, st
        j = gws.live[-1]  # the dashboard shows the instances, this one's id and the store beside the metrics
        await until_async(lambda: _get(gws.ports[j], "/kvgate/dashboard.json")["shared"]["instances"] == 2,
                          "the killed instance counted out on the dashboard")
        dash = _get(gws.ports[j], "/kvgate/dashboard.json")["shared"]
        assert dash["instances"] == 2 and dash["store_up"] is True and dash["owner"] == gws.shared(j)["owner"], dash
        with urllib.request.urlopen(f"http://127.0.0.1:{gws.ports[j]}/dashboard", timeout=10) as r:
            assert b'id="shared"' in r.read()
        with urllib.request.urlopen(f"http://127.0.0.1:{gws.ports[j]}/metrics", timeout=10) as r:
            metrics = r.read().decode()
        assert "kvgate_shared_instances 2.0" in metrics and "kvgate_shared_store_up 1.0" in metrics, metrics[-800:]
    finally:
        gws.stop()


async def test_a_burst_on_a_fleet_parks_across_instances_no_engine_queues(
        srv: RedisServer, monkeypatch: pytest.MonkeyPatch) -> None:
    pool = 2048
    async with _fleet(pool, monkeypatch) as (engs, urls, seen):
        await _fleet_burst(srv, pool, engs, urls, seen)


async def _fleet_burst(srv: RedisServer, pool: int, engs: list[EngineServer], urls: list[str],
                       seen: dict[str, set[str]]) -> None:
    gws = Instances(urls, srv.url, 3, "--max-park-s", "6000")
    top = {"waiting": 0, "held": 0}
    reader = redis.Redis.from_url(srv.url)
    try:
        await asyncio.to_thread(gws.wait)

        def watch() -> None:
            top["waiting"] = max(top["waiting"], *(_queued(e) for e in engs))
            for url in urls:
                books = _redis_books(reader, url)
                top["held"] = max(top["held"], books["held"])
                assert books["D"] == books["sum"], (url, books)
                assert books["D"] <= pool or books["admitted"] == 1, (url, books)

        await _burst(gws, 24, watch)
        stats = [_get_stats(e) for e in engs]
        assert top["waiting"] == 0 and all(st["preemptions"] == 0 for st in stats), (top, stats)
        assert top["held"] > 0, top  # the burst did not fit the fleet: parked in the engines' shared FIFOs
        assert sum(sum(_get(p, "/kvgate/info")["turns"].values()) for p in gws.ports) == 48
        assert len(seen) == 24 and all(len(h) == 1 for h in seen.values()), seen
        assert all(sum(1 for h in seen.values() if f"127.0.0.1:{u.rsplit(':', 1)[1]}" in h) > 0 for u in urls), seen
        for url in urls:  # (every session ended: nothing left in any engine's shared books)
            books = _redis_books(reader, url)
            assert books["D"] == 0 and books["admitted"] == 0 and books["held"] == 0, (url, books)
    finally:
        gws.stop()


async def _burst(gws: Instances, n: int, watch: Any, turns: int = 2) -> None:
    """``n`` sessions (found by lineage) of ``turns`` turns each at once, session k's turns round-robin over the
    instances, each ended by its last turn (its demand leaves D then, not an idle bound later)."""
    async def session(k: int, http: Any) -> None:
        messages = _agent_start(k, words=120)
        for t in range(turns):
            got, _ = await _turn(http, [gws.ports[j] for j in gws.live], k + t, messages, max_tokens=64,
                                 last=t == turns - 1)
            messages = [*messages, {"role": "assistant", "content": got["choices"][0]["message"]["content"]},
                        {"role": "user", "content": f"result {t}"}]

    async with aiohttp.ClientSession() as http:
        runs = asyncio.gather(*(session(k, http) for k in range(n)))
        deadline = asyncio.get_running_loop().time() + 30.0
        while not runs.done():
            watch()
            await asyncio.sleep(0.01)
            if asyncio.get_running_loop().time() > deadline:  # (a hang guard, not a measurement)
                runs.cancel()
                raise AssertionError(f"the burst did not finish: {[gws.shared(j) for j in gws.live]}")
        await runs


async def test_a_burst_parks_across_instances_and_the_engine_never_queues(
        srv: RedisServer, engine: tuple[EngineServer, str]) -> None:
    eng, url = engine
    gws = Instances(url, srv.url, 3, "--max-park-s", "6000")
    seen = {"waiting": 0, "held": 0, "demand": 0}
    reader = redis.Redis.from_url(srv.url)
    try:
        await asyncio.to_thread(gws.wait)

        def watch() -> None:
            seen["waiting"] = max(seen["waiting"], _queued(eng))
            books = _redis_books(reader, url)  # (Redis's own books: an instance's figures are a heartbeat old)
            seen["held"] = max(seen["held"], books["held"])
            seen["demand"] = max(seen["demand"], books["D"])
            assert books["D"] == books["sum"], books
            assert books["D"] <= 4096 or books["admitted"] == 1, books

        await _burst(gws, 24, watch)
        st = _get_stats(eng)
        assert seen["waiting"] == 0 and st["preemptions"] == 0, (seen, st)
        assert seen["held"] > 0, seen  # the burst did not fit: parked in the shared FIFO
        turns = sum(sum(_get(p, "/kvgate/info")["turns"].values()) for p in gws.ports)
        assert turns == 48
        books = _redis_books(reader, url)  # (every session ended: nothing left in the shared books)
        assert books["D"] == 0 and books["admitted"] == 0 and books["held"] == 0, books
    finally:
        gws.stop()


async def test_redis_restarted_mid_burst_local_share_then_resync(
        srv: RedisServer, engine: tuple[EngineServer, str]) -> None:
    eng, url = engine
    gws = Instances(url, srv.url, 3, "--max-park-s", "6000")
    seen = {"waiting": 0, "local": 0}
    try:
        await asyncio.to_thread(gws.wait)
        await until_async(lambda: all(gws.shared(j)["instances"] == 3 for j in gws.live), "3 instances counted")
        restarted = False

        def watch() -> None:
            nonlocal restarted
            st = _get_stats(eng)
            seen["waiting"] = max(seen["waiting"], _queued(eng))
            if not restarted and st["running"] >= 2:
                restarted = True
                srv.restart()
            seen["local"] += sum(1 for j in gws.live if gws.shared(j)["local_share"])

        await _burst(gws, 24, watch, turns=3)
        assert restarted
        assert seen["local"] > 0, seen  # the instances noticed, and admitted on their local share
        assert seen["waiting"] == 0 and _get_stats(eng)["preemptions"] == 0, seen
        await until_async(lambda: all(gws.shared(j)["store_up"] for j in gws.live), "back on the shared store")
        assert all(gws.shared(j)["recoveries"] >= 2 for j in gws.live)
    finally:
        gws.stop()


def _redis_books(r: Any, engine: str) -> dict[str, int]:
    """The shared budget of ``engine`` as Redis holds it now: D, the sum of the admitted d_s, how many are admitted
    and held."""
    gen = (r.get("kvgate:gen") or b"").decode()
    k = f"kvgate:{gen}:e:{engine}:"
    d, adm, held = r.pipeline(transaction=True).get(k + "D").hgetall(k + "adm").llen(k + "fifo").execute()  # (one read)
    return {"D": int(d or 0), "sum": sum(int(v) for v in adm.values()), "admitted": len(adm), "held": int(held)}


def _queued(eng: EngineServer) -> int:
    """Requests in the engine's queue: joined and not running (for want of KV). Not ``/kvgate/stats``'s
    ``waiting``, which also counts a request still being parsed, about to join at the next step boundary."""
    return eng.engine.queue_lengths()[1]


def _get_stats(eng: EngineServer) -> dict[str, Any]:
    from kvgate.serve.admin import stats

    return stats(eng)
