"""The checker of the shared budget (:mod:`kvgate.gateway.shared`): randomized schedules of instances x sessions
x kills of instances x Redis outages and restarts x fleets of 1-3 engines (replicas) going down and up as each
instance's health checks see them, against a real redis-server of the test's own, asserting after every step that

* admitted demand never exceeds C_r on any engine: D_r in Redis (and the demand of the turns the live instances run
  on engine r, what it holds) stays within C_r, except while turns already in flight at a Redis fault are still
  running;
* D_r in Redis is the true sum of the d_s admitted on r, no session is both admitted and held, or held twice, or in
  the books of two engines;
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
FLEETS = ({"0": C}, {"e0": C, "e1": 600}, {"e0": 800, "e1": C, "e2": 500})
"""The engines of a schedule (C_r by name): one, or a fleet."""
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
    e: str = ""
    """The engine of its turn (its last one, between turns)."""


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
    pools: dict[str, int] = field(default_factory=lambda: {"0": C})
    down: list[set[str]] = field(default_factory=list)
    """The engines each instance sees down."""

    def live(self) -> list[int]:
        return [i for i, b in enumerate(self.insts) if b is not None]

    def add_instance(self) -> None:
        b = SharedBudget(connect(self.srv.url), f"i{len(self.insts)}", self.pools, lease_s=LEASE_S,
                         atomic=self.atomic)
        down: set[str] = set()
        b.up = lambda: [e for e in self.pools if e not in down]
        self.insts.append(b)
        self.down.append(down)

    def new_session(self) -> None:
        self.n_sessions += 1
        sid = f"s{self.n_sessions}"
        self.sessions[sid] = Sess(sid)

    def admit(self, i: int, sid: str, turn: str, engine: str) -> None:
        s = self.sessions.get(sid)
        if s is None or f"{sid}:{s.turn}" != turn:
            return  # (a turn the client gave up: it ended since, or a dead instance's)
        if s.where == "running":
            assert s.on == i, f"turn {turn} admitted on i{i} while it runs on i{s.on}"
            return
        assert s.where == "held" and s.on == i, f"turn {turn} admitted on i{i}, held on i{s.on} ({s.where})"
        assert engine in self.pools, f"turn {turn} admitted on an unknown engine {engine!r}"
        s.where, s.e = "running", engine

    def engine_event(self) -> None:
        """An engine goes down (seen by every instance, or by some: their health checks differ), or back up."""
        rng = self.rng
        e = rng.choice(list(self.pools))
        if any(e in d for d in self.down):
            for d in self.down:
                d.discard(e)
            self.log.append(f"{e} up")
            return
        seen = [d for d in self.down if rng.random() < 0.7] or self.down[:1]
        for d in seen:
            if len(d) + 1 < len(self.pools):  # (one engine stays up for each instance)
                d.add(e)
        self.log.append(f"{e} down")


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
            w.admit(i, t.sid, t.turn, t.engine)
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
    if roll < 0.16 and len(w.pools) > 1:
        w.engine_event()
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
        elif s.where == "held" and s.e in w.down[s.on]:  # held for an engine its instance sees down: asked again
            b = w.insts[s.on]
            assert b is not None
            calls.append(ask(w, s.on, b, s))
    await asyncio.gather(*calls)


async def ask(w: World, i: int, b: SharedBudget, s: Sess) -> None:
    s.where, s.on = "held", i  # (asked: the client waits on this instance)
    got = await b.ask(s.sid, s.d, f"{s.sid}:{s.turn}", w.now, hint=s.e)
    if got == PROCEED:
        w.admit(i, s.sid, f"{s.sid}:{s.turn}", b.running[s.sid].engine)
    elif got == BUSY:  # a turn of it is still leased to a dead instance: the client tries again later
        s.where, s.on = "idle", -1
    else:
        assert got == PARK, got
        s.e = b.placed[s.sid]


async def finish(w: World, b: SharedBudget, s: Sess, aborted: bool) -> None:
    s.where, s.on = "idle", -1
    w.carry.discard((s.sid, s.turn))
    await b.finished(s.sid, w.now, aborted)


async def end(w: World, b: SharedBudget, s: Sess) -> None:
    del w.sessions[s.sid]
    await b.ended(s.sid, w.now)


async def redis_books(w: World) -> dict[str, dict[str, Any]] | None:
    """D, the admitted and the held sessions of each engine, as Redis has them now (None: Redis away)."""
    if not w.redis_up:
        return None
    b = next(x for x in w.insts if x is not None)
    import redis

    r = w.reader
    for attempt in range(3):
        try:
            gen = (await r.get(b.prefix + "gen") or b"").decode()
            run = {x.decode() for x in await r.hkeys(f"{b.prefix}{gen}:run")}
            out: dict[str, dict[str, Any]] = {}
            for e in w.pools:
                k = f"{b.prefix}{gen}:e:{e}:"
                out[e] = {"gen": gen, "D": int(await r.get(k + "D") or 0), "run": run,
                          "adm": {x.decode(): int(v) for x, v in (await r.hgetall(k + "adm")).items()},
                          "held": {x.decode() for x in await r.hkeys(k + "held")},
                          "fifo": [x.decode() for x in await r.lrange(k + "fifo", 0, -1)]}
            return out
        except (OSError, redis.ConnectionError):  # (its connection from before a restart)
            if attempt == 2:
                raise
    return None


async def check(w: World) -> None:
    where = f"after step {w.steps} ({', '.join(w.log[-6:])})"
    running = [s for s in w.sessions.values() if s.where == "running"]
    for e, cap in w.pools.items():
        engine = sum(s.d for s in running if s.e == e)
        if not w.carry:
            views = "; ".join(f"i{i} {'local' if b.local is not None else 'shared'} n={b.stats.live_instances} runs "
                              f"{sorted((t.sid, t.d, t.engine) for t in b.running.values())}"
                              for i, b in enumerate(w.insts) if b is not None)
            assert engine <= cap, f"the live instances run {engine} tokens of turns on {e} > C = {cap} {where}: {views}"
    books = await redis_books(w)
    if books is None:
        return
    seen: dict[str, str] = {}
    for e, bk in books.items():
        adm, held, fifo = bk["adm"], bk["held"], bk["fifo"]
        cap = w.pools[e]
        assert bk["D"] == sum(adm.values()), f"D = {bk['D']} is not the sum of d_s {sum(adm.values())} on {e} {where}"
        if not w.carry and len(adm) > 1:
            assert bk["D"] <= cap, f"D = {bk['D']} > C = {cap} on {e} with {len(adm)} admitted {where}"
        assert not (set(adm) & held), f"sessions both admitted and held on {e}: {set(adm) & held} {where}"
        assert len(fifo) == len(set(fifo)) and set(fifo) == held, f"the held FIFO {fifo} != {held} on {e} {where}"
        for sid in set(adm) | held:
            assert sid not in seen, f"{sid} in the books of {seen[sid]} and {e} {where}"
            seen[sid] = e


async def heal_and_end(w: World) -> None:
    """The faults are over: Redis up, time past every lease, every turn finished, every session ended."""
    if not w.redis_up:
        w.srv.start()
        w.redis_up = True
    for d in w.down:
        d.clear()
    for _ in range(40):
        w.now += 1000
        for i in w.live():
            b = w.insts[i]
            assert b is not None
            await b.heartbeat(w.now)
            for t in await b.admitted(w.now):
                w.admit(i, t.sid, t.turn, t.engine)
        for s in list(w.sessions.values()):
            b = w.insts[s.on] if s.on >= 0 else None
            if s.where == "running" and b is not None:
                await finish(w, b, s, False)
        await check(w)
        if all(s.where == "idle" for s in w.sessions.values()) and all(
                b.local is None for b in w.insts if b is not None):  # (every instance back on the shared budget)
            break
    w.carry.clear()
    await check(w)
    b0 = w.insts[w.live()[0]]
    assert b0 is not None
    for s in list(w.sessions.values()):
        await end(w, b0, s)
    books = await redis_books(w)
    assert books is not None
    for bk in books.values():
        assert bk["D"] == 0 and not bk["adm"] and not bk["held"] and not bk["run"], books


async def schedule(seed: int, srv: RedisServer, atomic: bool = True, steps: int = 40) -> None:
    rng = random.Random(seed)
    if not srv.proc:
        srv.start()
    await connect(srv.url).flushall()
    import redis.asyncio

    w = World(rng, srv, atomic, reader=redis.asyncio.Redis.from_url(srv.url), pools=dict(rng.choice(FLEETS)))
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
