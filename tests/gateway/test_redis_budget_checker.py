"""The checker of the shared budget (:mod:`kvgate.gateway.shared`): randomized schedules of instances x sessions
x kills of instances x Redis outages and restarts, against a real redis-server of the test's own, asserting after
every step that

* admitted demand never exceeds C: D in Redis (and the demand of the turns the live instances run, what the engine
  holds) stays within C, except while turns already in flight at a Redis fault are still running;
* D in Redis is the true sum of the admitted sessions' d_s, and no session is both admitted and held, or held twice;
* no turn is admitted twice: a session's turn runs on at most one live instance;

and, once the faults are over and every session has ended, that D is back at 0 with nothing admitted, held or
leased. A deliberately broken admission (a read of D, then a write: not one decision) must fail it."""

from __future__ import annotations

import asyncio
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

import pytest

from kvgate.gateway.shared import BUSY, PARK, PROCEED, SharedBudget, connect
from support.redis_server import RedisServer, redis_server

C = 1000
LEASE_S = 3.0
SCHEDULES = 1000


@pytest.fixture(scope="module")
def srv() -> Iterator[RedisServer]:
    with redis_server() as s:
        yield s


@dataclass
class Sess:
    sid: str
    turn: int = 0
    where: str = "idle"  # idle | held | running
    on: int = -1
    d: int = 0


@dataclass
class World:
    rng: random.Random
    srv: RedisServer
    atomic: bool
    now: int = 0
    insts: list[SharedBudget | None] = field(default_factory=list)
    sessions: dict[str, Sess] = field(default_factory=dict)
    n_sessions: int = 0
    carry: set[tuple[str, int]] = field(default_factory=set)
    """Turns in flight at a Redis fault (they may hold more than the local shares while they run)."""
    redis_up: bool = True
    reader: Any = None
    """The checker's own client (it reconnects after a restart)."""
    steps: int = 0
    log: list[str] = field(default_factory=list)

    def live(self) -> list[int]:
        return [i for i, b in enumerate(self.insts) if b is not None]

    def add_instance(self) -> None:
        b = SharedBudget(connect(self.srv.url), f"i{len(self.insts)}", C, lease_s=LEASE_S, atomic=self.atomic)
        self.insts.append(b)

    def new_session(self) -> None:
        self.n_sessions += 1
        sid = f"s{self.n_sessions}"
        self.sessions[sid] = Sess(sid)

    def admit(self, i: int, sid: str, turn: str) -> None:
        s = self.sessions.get(sid)
        if s is None or f"{sid}:{s.turn}" != turn:
            return  # (a turn the client gave up: it ended since, or a dead instance's)
        if s.where == "running":
            assert s.on == i, f"turn {turn} admitted on i{i} while it runs on i{s.on}"
            return
        assert s.where == "held" and s.on == i, f"turn {turn} admitted on i{i}, held on i{s.on} ({s.where})"
        s.where = "running"


async def step(w: World) -> None:
    rng = w.rng
    w.steps += 1
    w.now += rng.randint(0, 500)
    live = w.live()
    # every live instance's heartbeat (every 250 ms in the gateway) and what it was told
    for i in live:
        b = w.insts[i]
        assert b is not None
        await b.heartbeat(w.now)
        for t in await b.admitted(w.now):
            w.admit(i, t.sid, t.turn)
    roll = rng.random()
    if roll < 0.04 and len(live) > 1:  # kill an instance: its clients retry their turn elsewhere
        i = rng.choice(live)
        b = w.insts[i]
        assert b is not None
        w.insts[i] = None
        await b.r.aclose()
        for s in w.sessions.values():
            if s.on == i and s.where != "idle":
                s.where, s.on = "idle", -1
        w.log.append(f"kill i{i}")
        return
    if roll < 0.06 and len(w.insts) < 4:
        w.add_instance()
        w.log.append("add")
        return
    if roll < 0.09:  # Redis away (killed: it comes back empty), or back
        if w.redis_up:
            w.srv.kill()
            w.redis_up = False
            w.carry = {(s.sid, s.turn) for s in w.sessions.values() if s.where == "running"}
            w.log.append("redis down")
        else:
            w.srv.start()
            w.redis_up = True
            w.log.append("redis up")
        return
    if roll < 0.11 and w.redis_up:  # a restart within one step: the instances see a Redis without their books
        w.srv.restart()
        w.carry |= {(s.sid, s.turn) for s in w.sessions.values() if s.where == "running"}
        w.log.append("redis restart")
        return
    if len(w.sessions) < 8 and rng.random() < 0.3:
        w.new_session()
    # a batch of concurrent calls, each from a random live instance
    calls = []
    for s in rng.sample(list(w.sessions.values()), min(len(w.sessions), rng.randint(1, 4))):
        i = rng.choice(live)
        b = w.insts[i]
        assert b is not None
        if s.where == "idle" and rng.random() < 0.12:
            calls.append(end(w, b, s))
        elif s.where == "idle":
            if s.turn == 0 or rng.random() < 0.8:  # (else: the client retries the same turn)
                s.turn += 1
            s.d = rng.randint(50, 450)
            calls.append(ask(w, i, b, s))
        elif s.where == "running" and rng.random() < 0.7:
            b = w.insts[s.on]
            assert b is not None
            calls.append(finish(w, b, s, rng.random() < 0.1))
    await asyncio.gather(*calls)


async def ask(w: World, i: int, b: SharedBudget, s: Sess) -> None:
    s.where, s.on = "held", i  # (asked: the client waits on this instance)
    got = await b.ask(s.sid, s.d, f"{s.sid}:{s.turn}", w.now)
    if got == PROCEED:
        w.admit(i, s.sid, f"{s.sid}:{s.turn}")
    elif got == BUSY:  # a turn of it is still leased to a dead instance: the client tries again later
        s.where, s.on = "idle", -1
    else:
        assert got == PARK, got


async def finish(w: World, b: SharedBudget, s: Sess, aborted: bool) -> None:
    s.where, s.on = "idle", -1
    w.carry.discard((s.sid, s.turn))
    await b.finished(s.sid, w.now, aborted)


async def end(w: World, b: SharedBudget, s: Sess) -> None:
    del w.sessions[s.sid]
    await b.ended(s.sid, w.now)


async def redis_books(w: World) -> dict[str, object] | None:
    """D, the admitted and the held sessions of engine 0, as Redis has them now (None: Redis away)."""
    if not w.redis_up:
        return None
    b = next(x for x in w.insts if x is not None)
    import redis

    r = w.reader
    for attempt in range(3):
        try:
            gen = (await r.get(b.prefix + "gen") or b"").decode()
            k = f"{b.prefix}{gen}:e:0:"
            d = int(await r.get(k + "D") or 0)
            adm = {x.decode(): int(v) for x, v in (await r.hgetall(k + "adm")).items()}
            held = {x.decode() for x in await r.hkeys(k + "held")}
            fifo = [x.decode() for x in await r.lrange(k + "fifo", 0, -1)]
            run = {x.decode() for x in await r.hkeys(f"{b.prefix}{gen}:run")}
            break
        except (OSError, redis.ConnectionError):  # (its connection from before a restart)
            if attempt == 2:
                raise
    return {"gen": gen, "D": d, "adm": adm, "held": held, "fifo": fifo, "run": run}


async def check(w: World) -> None:
    where = f"after step {w.steps} ({', '.join(w.log[-6:])})"
    running = [s for s in w.sessions.values() if s.where == "running"]
    engine = sum(s.d for s in running)
    if not w.carry:
        views = "; ".join(f"i{i} {'local' if b.local is not None else 'shared'} n={b.stats.live_instances} runs "
                          f"{sorted((t.sid, t.d) for t in b.running.values())}"
                          for i, b in enumerate(w.insts) if b is not None)
        assert engine <= C, f"the live instances run {engine} tokens of turns > C = {C} {where}: {views}"
    books = await redis_books(w)
    if books is None:
        return
    adm, held, fifo = books["adm"], books["held"], books["fifo"]
    assert isinstance(adm, dict) and isinstance(held, set) and isinstance(fifo, list)
    assert books["D"] == sum(adm.values()), f"D = {books['D']} is not the sum of d_s {sum(adm.values())} {where}"
    if not w.carry and len(adm) > 1:
        assert books["D"] <= C, f"D = {books['D']} > C = {C} with {len(adm)} admitted {where}"
    assert not (set(adm) & held), f"sessions both admitted and held: {set(adm) & held} {where}"
    assert len(fifo) == len(set(fifo)) and set(fifo) == held, f"the held FIFO {fifo} != {held} {where}"


async def heal_and_end(w: World) -> None:
    """The faults are over: Redis up, time past every lease, every turn finished, every session ended."""
    if not w.redis_up:
        w.srv.start()
        w.redis_up = True
    for _ in range(40):
        w.now += 1000
        for i in w.live():
            b = w.insts[i]
            assert b is not None
            await b.heartbeat(w.now)
            for t in await b.admitted(w.now):
                w.admit(i, t.sid, t.turn)
        for s in list(w.sessions.values()):
            b = w.insts[s.on] if s.on >= 0 else None
            if s.where == "running" and b is not None:
                await finish(w, b, s, False)
        await check(w)
        if all(s.where == "idle" for s in w.sessions.values()):
            break
    w.carry.clear()
    await check(w)
    b0 = w.insts[w.live()[0]]
    assert b0 is not None
    for s in list(w.sessions.values()):
        await end(w, b0, s)
    books = await redis_books(w)
    assert books is not None
    assert books["D"] == 0 and not books["adm"] and not books["held"] and not books["run"], books


async def schedule(seed: int, srv: RedisServer, atomic: bool = True, steps: int = 40) -> None:
    rng = random.Random(seed)
    if not srv.proc:
        srv.start()
    await connect(srv.url).flushall()
    import redis.asyncio

    w = World(rng, srv, atomic, reader=redis.asyncio.Redis.from_url(srv.url))
    for _ in range(rng.randint(2, 3)):
        w.add_instance()
    try:
        for _ in range(steps):
            await step(w)
            await check(w)
        await heal_and_end(w)
    finally:
        for b in w.insts:
            if b is not None:
                await b.r.aclose()
        await w.reader.aclose()


@pytest.mark.slow
def test_the_shared_budget_holds_over_a_thousand_schedules(srv: RedisServer) -> None:
    async def run() -> None:
        for seed in range(SCHEDULES):
            await schedule(seed, srv)

    asyncio.run(run())


def test_a_non_atomic_admission_fails_the_checker(srv: RedisServer) -> None:
    async def run() -> str:
        for seed in range(SCHEDULES):
            try:
                await schedule(seed, srv, atomic=False)
            except AssertionError as e:
                return str(e)
        return ""

    failure = asyncio.run(run())
    # (two instances admit on one read of D: over C, or one write of D lost under the other)
    assert "> C" in failure or "is not the sum" in failure, failure or "no schedule caught the read-then-write"
