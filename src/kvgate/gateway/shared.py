"""One budget across gateways (``--store redis://...``): per engine, admission and parking decided by atomic
scripts in Redis (:mod:`kvgate.gateway.shared_scripts`), one turn of a session in flight across instances (a lease
with a TTL, renewed by the holder's heartbeat), and a local share of each pool while Redis is away.

* **A fleet** (several engines): one budget per engine (replica r: D_r against C_r, its admitted set and its FIFO),
  each decision keyed by the session's engine. The session's engine lives in Redis (``place``): every instance sends
  its turns there. A new session (or one whose engine the asking instance sees down) is placed by the same atomic
  ``ASK`` on the engine up with the least D_r/C_r, so two instances placing at once cannot both fill one engine.
* **Admission** (:meth:`SharedBudget.ask`): a session at its turn boundary is admitted iff D + d_s <= C (or nothing
  is admitted) and nobody is held ahead of it, else held at the tail of the engine's FIFO; an admitted session whose
  new d_s no longer fits is parked (never the only admitted one). A turn's end (:meth:`finished`), an abort or a
  session's end pumps the FIFO from its head, whichever instance holds it: the pumped turn's instance is told on its
  notify list (:meth:`admitted`).
* **An instance dies**: its heartbeat stops, its leases run out within ``lease_s`` and any instance's heartbeat
  reaps them: those sessions go back to thinking (their d_s stays in D, as after a restart); their held turns keep
  their place, taken over by the client's retry on any instance.
* **Redis goes away**: a call that fails (a heartbeat every ``heartbeat_s``, so within a second) puts the instance
  on its local share: C divided by the instances live at its last heartbeat, counting its own turns in flight; held
  turns wait in a local FIFO. When Redis answers again the instance recovers (:data:`RECOVER`): the first one back
  starts a new generation of the budget from the turns the instances hold, and admission waits until every
  instance live before (or ``lease_s``) has brought its own; the held turns ask again (:attr:`on_recover`), and an
  answer given by the generation the instance has just left is asked for again in the new one. Thinking sessions of
  the old generation are not carried over: they are asked anew at their next boundary.

The clock is the caller's (``now_ms``): wall milliseconds in the gateway, a virtual clock in the checker."""

from __future__ import annotations

import contextlib
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable, Mapping
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import Any

from kvgate.gateway import shared_scripts as scripts
from kvgate.gateway.store_redis import PREFIX, redis_module

PHASE: ContextVar[str] = ContextVar("kvgate_shared_phase", default="background")
"""What a call to Redis is for: "boundary" (a turn's, until it is admitted), "end" (a turn's end), else
"background" (the heartbeat, the notify task)."""
PROCEED, PARK, BUSY, MOVED = "proceed", "park", "busy", "moved"
"""What :meth:`SharedBudget.ask` answers (MOVED: the caller's book of the session is not the last one written)."""


def connect(url: str) -> Any:
    """redis-py's asyncio client for the shared budget: a call to a Redis that is away fails at once (no retries,
    half a second to connect, a second to answer), so an instance is on its local share within a second."""
    redis = redis_module()
    from redis.asyncio.retry import Retry
    from redis.backoff import NoBackoff

    return redis.asyncio.Redis.from_url(url, retry=Retry(NoBackoff(), 0), socket_connect_timeout=0.5,
                                        socket_timeout=1.0)


@dataclass
class Turn:
    """A turn this instance asked for: its session, demand and id, and the engine it was placed on."""

    sid: str
    d: int
    turn: str
    engine: str = ""


@dataclass
class SharedStats:
    """What an instance counts of the shared budget (``/metrics``, ``/kvgate/info``)."""

    store_up: bool = True
    live_instances: int = 0
    """At the last heartbeat (0: none seen yet)."""
    fallbacks: int = 0
    recoveries: int = 0
    round_trips: int = 0
    by_phase: dict[str, int] = field(default_factory=dict)
    """Round trips by :data:`PHASE` (a turn's boundary, its end, the background tasks)."""
    lost_leases: int = 0
    local_share: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    def trip(self) -> None:
        self.round_trips += 1
        phase = PHASE.get()
        self.by_phase[phase] = self.by_phase.get(phase, 0) + 1


class SharedBudget:
    """One instance's side of one engine's shared budget (see the module docstring)."""

    def __init__(self, client: Any, owner: str, capacity: int | Mapping[str, int], *, engine: str = "0",
                 prefix: str = PREFIX, lease_s: float = 3.0, atomic: bool = True) -> None:
        self.r = client
        self.owner = owner
        self.pools: dict[str, int] = {engine: capacity} if isinstance(capacity, int) else dict(capacity)
        """C_r of each engine (replica) by name: one budget each."""
        self.engine = next(iter(self.pools))
        self.up: Callable[[], Iterable[str]] = lambda: self.pools
        """The engines this instance sees up (its health checks): the ones a session is placed on."""
        self.placed: dict[str, str] = {}
        """The engine of each session's last admission or park."""
        self.prefix = prefix
        self.lease_ms = int(lease_s * 1000)
        self.gen = "0"
        self.stats = SharedStats()
        self.running: dict[str, Turn] = {}
        """This instance's turns admitted and in flight (what it brings back to a recovered budget)."""
        self.local: OrderedDict[str, Turn] | None = None
        """On the local share (Redis away): the turns held here, oldest first; None while Redis answers."""
        self.peers: list[str] = []
        """The instances live at the last heartbeat."""
        self.joined_ms: int | None = None
        """When this instance's first heartbeat reached Redis."""
        self.last_beat_ms = 0
        self._beats: deque[tuple[int, int]] = deque()
        self._floor, self._floor_until = 0, 0
        self._ready: list[Turn] = []
        self.by_engine: dict[str, dict[str, int]] = {}
        self.missed: dict[str, tuple[str, str]] = {}
        """Sessions whose turn's end (FINISH) or end (END) Redis missed while away, with their engine."""
        """Each engine's shared books at the last :meth:`figures`."""
        """Held turns admitted when asked again after a recovery (:meth:`admitted` hands them out)."""
        self._redis = redis_module()
        self._scripts = {name: client.register_script(getattr(scripts, name))
                         for name in ("ASK", "FINISH", "END", "HEARTBEAT", "RECOVER", "BOOK_FINISH",
                                                                  "BOOK_END", "SYNC", "READ", "PUT")}
        self._atomic = atomic
        """False only in the checker's test of itself: admission as a read, then a write (not one decision)."""
        self.parked: Callable[[], list[Turn]] = list
        """This instance's turns held in the shared FIFO (their clients wait here): they join the local FIFO when
        Redis goes away (:meth:`pump_local` may admit them there)."""
        self.on_recover: Callable[[], None] | None = None
        """Told after every recovery: the new generation holds none of this instance's held turns, and their
        waiters ask again (in their order); without it (the checker) :meth:`heartbeat` asks the local FIFO's."""

    @property
    def capacity(self) -> int:
        """C of the fleet: every engine's pool."""
        return sum(self.pools.values())

    def _live(self) -> list[str]:
        pools = self.pools
        return [e for e in self.up() if e in pools] or list(pools)

    # -- calls ---------------------------------------------------------------------------------------------
    async def _call(self, name: str, *args: Any) -> list[Any]:
        self.stats.trip()
        out = await self._scripts[name](args=[self.prefix, self.gen, *args])
        return [x.decode() if type(x) is bytes else x for x in out]

    async def _guarded(self, name: str, now_ms: int, *args: Any) -> list[Any] | None:
        """A script's answer, recovering first if the budget moved on; None when Redis is away (the instance is
        then on its local share)."""
        if self.local is not None:
            return None
        try:
            for _ in range(3):
                gen = self.gen
                out = await self._call(name, *args)
                if self.gen != gen:  # (recovered by another call meanwhile: answered by a budget that is gone)
                    continue
                if out[0] != "stale":
                    return out
                await self._recover(now_ms)
            return None
        except (self._redis.RedisError, OSError):
            self._fall_back()
            return None

    async def script(self, name: str, *args: Any) -> list[Any]:
        """One of the books' scripts (no generation: the books outlive the budget's); raises :attr:`failures`."""
        self.stats.trip()
        out = await self._scripts[name](args=list(args))
        return [x.decode() if type(x) is bytes else x for x in out]

    @property
    def failures(self) -> tuple[type[BaseException], ...]:
        """What a call to a Redis that is away raises."""
        return (self._redis.RedisError, OSError)

    @property
    def has_ready(self) -> bool:
        """Held turns admitted when asked again after a recovery wait for :meth:`admitted`."""
        return bool(self._ready)

    def fall_back(self) -> None:
        """Redis is away: the local share from now on (until a heartbeat reaches it again)."""
        self._fall_back()

    def _fall_back(self) -> None:
        if self.local is None:
            self.local = OrderedDict((t.sid, t) for t in self.parked() if t.sid not in self.running)
            self.stats.store_up = False
            self.stats.fallbacks += 1

    def share(self, now_ms: int, engine: str | None = None) -> int:
        """C_r (of ``engine``; default: the first) divided by the instances live at the last heartbeat; 0 for an
        instance whose last heartbeat came less than a lease after its first (the others may not have counted it
        yet) or that has never seen Redis (it cannot know how many share the pool). (``now_ms``: when it is asked;
        the share is that of the fault.)"""
        n = self.stats.live_instances
        if not n or self.joined_ms is None or self.last_beat_ms - self.joined_ms < self.lease_ms:
            return 0
        return self.pools.get(engine or self.engine, 0) // n

    def _counted(self, n: int, now_ms: int) -> None:
        """The live instances, as the largest count of the last lease (a kill is counted out a lease late, which
        only makes the share smaller), and no fewer than before a recovery for a lease after it (a Redis that lost
        its data has lost who is live: the others register again at their next heartbeat)."""
        beats = self._beats
        beats.append((now_ms, n))
        while beats and beats[0][0] < now_ms - self.lease_ms:
            beats.popleft()
        n = max(c for _, c in beats)
        if now_ms < self._floor_until:
            n = max(n, self._floor)
        self.stats.live_instances = n

    async def _recover(self, now_ms: int) -> None:
        self._floor, self._floor_until = self.stats.live_instances, now_ms + self.lease_ms
        flat: list[Any] = []
        for t in self.running.values():
            flat += [t.sid, t.d, t.turn, t.engine or self.engine]
        expected = ",".join(p for p in self.peers if p != self.owner)
        self.stats.trip()
        out = await self._scripts["RECOVER"](args=[
            self.prefix, self.gen, self.owner, now_ms, self.lease_ms, self.lease_ms, expected, *flat])
        self.gen = out[0].decode() if type(out[0]) is bytes else str(out[0])
        self.stats.recoveries += 1
        for sid, e in zip(flat[::4], flat[3::4], strict=True):
            if sid not in self.running:  # (turns that ended while RECOVER was on its way: their leases go)
                await self._call("FINISH", e, self.pools.get(e, 0), sid, self.owner, now_ms, self.lease_ms, "0")
        if self.on_recover is not None:
            self.on_recover()

    # -- the turn's boundary and its end -------------------------------------------------------------------
    async def ask(self, sid: str, d: int, turn: str, now_ms: int, version: str = "", hint: str = "") -> str:
        """PROCEED (admitted: the turn may run), PARK (held: :meth:`admitted` says when) or BUSY (another
        instance holds a turn of the session); with the ``version`` of the caller's book of the session, MOVED when
        another one was written since (nothing decided: the caller reads it and asks again). The session's engine
        (:attr:`placed`): where it is placed, while up; else ``hint`` (the engine of its last turns) if up, else
        the least D_r/C_r of the engines up."""
        t = Turn(sid, d, turn)
        if not self._atomic and self.local is None:
            return await ask_racy(self, t, now_ms, hint)
        out = await self._guarded("ASK", now_ms, sid, d, self.owner, turn, now_ms, self.lease_ms, version, hint,
                                  *pairs(self))
        if out is None:  # (Redis away; else the budget moving on at every try: asked again in a moment)
            return self._ask_local(t, now_ms, hint) if self.local is not None else BUSY
        if out[0] in (PROCEED, PARK):
            self.placed[sid] = t.engine = str(out[1])
        if out[0] == PROCEED:
            self.running[sid] = t
        return str(out[0])

    def _ask_local(self, t: Turn, now_ms: int, hint: str = "") -> str:
        """On the local share: the session's engine as this instance knows it (else the one with the most room of
        its share), admitted iff nothing is held here for that engine and the turns run here on it fit C_r / n."""
        assert self.local is not None
        if t.sid in self.running:
            return BUSY
        live = self._live()
        e = next((x for x in (self.placed.get(t.sid), hint) if x in live), None)
        if e is None:
            e = min(live, key=lambda x: (used(self, x) + t.d) / max(1, self.pools[x]))
        self.placed[t.sid] = t.engine = e
        self.stats.local_share = share = self.share(now_ms, e)
        if all(x.engine != e for x in self.local.values()) and used(self, e) + t.d <= share:
            self.running[t.sid] = t
            return PROCEED
        self.local[t.sid] = t
        return PARK

    async def finished(self, sid: str, now_ms: int, aborted: bool = False, book: tuple[str, str] | None = None
                       ) -> list[Any] | None:
        """The session's turn ended (answered, or ``aborted``): its lease goes, the FIFO is pumped. With ``book``
        (its row, an epoch for a Redis without one) the session's book is written in the same step. The script's
        answer (``[status, version, epoch]`` with a book), None on the local share."""
        t = self.running.pop(sid, None)
        e = t.engine if t is not None and t.engine else self.placed.get(sid, self.engine)
        args = (e, self.pools.get(e, 0), sid, self.owner, now_ms, self.lease_ms, "1" if aborted else "0")
        out = await (self._guarded("FINISH", now_ms, *args) if book is None else
                     self._guarded("BOOK_FINISH", now_ms, *args, sid, *book))
        if out is not None and out[0] == "lost":
            self.stats.lost_leases += 1
        if out is None:
            self.missed[sid] = ("FINISH", e)
        return out

    async def ended(self, sid: str, now_ms: int, book: str | None = None, if_idle: str = "") -> list[Any] | None:
        """The session ended: out of D (or of the FIFO); with ``book`` (an epoch) its book goes too. With
        ``if_idle`` (the caller's version of its book) only a session idle on every instance whose book is still
        that one (``["busy"]``: nothing changed)."""
        e = self.placed.get(sid, self.engine)
        if not if_idle:
            self.running.pop(sid, None)
            self.placed.pop(sid, None)
            if self.local is not None:
                self.local.pop(sid, None)
        args = (e, self.pools.get(e, 0), sid, now_ms, self.lease_ms, if_idle)
        out = await (self._guarded("END", now_ms, *args) if book is None else
                     self._guarded("BOOK_END", now_ms, *args, sid, "", book))
        if out is None and not if_idle:
            self.missed[sid] = ("END", e)
        return out

    def pump_local(self, now_ms: int) -> list[Turn]:
        """On the local share: admit held turns from the head while they fit the share."""
        out: list[Turn] = []
        local = self.local
        if local is None:
            return out
        blocked: set[str] = set()  # (engines whose oldest held turn does not fit: the later ones wait behind it)
        for t in list(local.values()):
            e = t.engine or self.engine
            if e in blocked:
                continue
            if used(self, e) + t.d > self.share(now_ms, e):
                blocked.add(e)
                continue
            del local[t.sid]
            self.running[t.sid] = t
            out.append(t)
        return out

    async def admitted(self, now_ms: int) -> list[Turn]:
        """The held turns of this instance admitted since the last call (by any instance's pump, or locally)."""
        ready, self._ready = self._ready, []
        if self.local is not None:
            return ready + self.pump_local(now_ms)
        key = f"{self.prefix}notify:{self.owner}"
        try:
            self.stats.trip()
            got = await self.r.lpop(key, 1000) or []
        except (self._redis.RedisError, OSError):
            self._fall_back()
            return []
        out = ready
        for raw in got:
            t = self.notified(raw)
            if t is not None:
                out.append(t)
        return out

    def notified(self, raw: bytes) -> Turn | None:
        """One entry of this instance's notify list: the held turn the pump admitted (None: of an older
        generation)."""
        gen, rest = raw.decode().split(" ", 1)
        if gen != self.gen:
            return None
        sid, d, turn, engine = rest.rsplit(" ", 3)
        now = self.running.get(sid)
        if now is not None and now.turn == turn:  # (admitted by its own ask since, which undid this admission)
            return None
        t = Turn(sid, int(d), turn, engine)
        self.placed[sid] = engine
        self.running[sid] = t
        return t

    async def heartbeat(self, now_ms: int) -> None:
        """Say this instance is live, renew its leases, reap the dead ones'; back from the local share when Redis
        answers again (its held turns asked anew, in their order)."""
        if self.local is not None:
            held = list(self.local.values())
            try:
                await self._recover(now_ms)
            except (self._redis.RedisError, OSError):
                return
            self.local = None
            self.stats.store_up = True
            await replay(self, now_ms)
            for t in held if self.on_recover is None else ():  # (their place on the local share: asked again)
                if await self.ask(t.sid, t.d, t.turn, now_ms, hint=t.engine) == PROCEED:
                    self._ready.append(t)
        out = await self._guarded("HEARTBEAT", now_ms, self.owner, now_ms, self.lease_ms, self.lease_ms,
                                  *pairs(self))
        if out is None:
            return
        self._counted(int(out[0]), now_ms)
        if self.joined_ms is None:
            self.joined_ms = now_ms
        self.last_beat_ms = now_ms
        with contextlib.suppress(self._redis.RedisError, OSError):
            self.peers = [p.decode() for p in await self.r.zrange(f"{self.prefix}inst", 0, -1)]


async def ask_racy(b: SharedBudget, t: Turn, now_ms: int, hint: str) -> str:
    """(The checker's broken admission: place, read D, decide here, write: two instances may both admit.)"""
    try:
        e = (await b.r.hget(f"{b.prefix}place", t.sid) or b"").decode()
        live = b._live()
        if not e:
            e = hint if hint in live else live[0]
            await b.r.hset(f"{b.prefix}place", t.sid, e)
        k = f"{b.prefix}{b.gen}:e:{e}:"
        d_now = int(await b.r.get(k + "D") or 0)
        n_adm, n_fifo = await b.r.hlen(k + "adm"), await b.r.llen(k + "fifo")
        if e in live and n_fifo == 0 and (n_adm == 0 or d_now + t.d <= b.pools[e]):
            pipe = b.r.pipeline(transaction=False)
            pipe.hset(k + "adm", t.sid, t.d).set(k + "D", d_now + t.d)
            pipe.hset(f"{b.prefix}{b.gen}:run", t.sid, f"{b.owner} {e} {t.turn}")
            await pipe.execute()
            b.placed[t.sid] = t.engine = e
            b.running[t.sid] = t
            return PROCEED
    except (b._redis.RedisError, OSError):
        b._fall_back()
        return b._ask_local(t, now_ms, hint)
    b._atomic = True
    try:
        return await b.ask(t.sid, t.d, t.turn, now_ms, hint=hint)
    finally:
        b._atomic = False


async def replay(b: SharedBudget, now_ms: int) -> None:
    """The ends of turns and sessions Redis missed while away: told now (a budget this instance joined again,
    in the same generation, still holds them)."""
    missed, b.missed = b.missed, {}
    for sid, (name, e) in missed.items():
        if sid in b.running or (b.local is not None and sid in b.local):
            continue  # (its next turn is here already)
        c = b.pools.get(e, 0)
        if name == "END":
            await b._guarded("END", now_ms, e, c, sid, now_ms, b.lease_ms, "")
        else:
            await b._guarded("FINISH", now_ms, e, c, sid, b.owner, now_ms, b.lease_ms, "0")


async def figures(b: SharedBudget) -> dict[str, int]:
    """The engines' shared books now, summed: D, the sessions admitted and held (one round trip);
    :attr:`by_engine` has each engine's."""
    pipe = b.r.pipeline(transaction=False)
    engines = list(b.pools)
    for e in engines:
        k = f"{b.prefix}{b.gen}:e:{e}:"
        pipe.get(k + "D").hlen(k + "adm").llen(k + "fifo")
    b.stats.trip()
    got = await pipe.execute()
    b.by_engine = {e: {"kv_pool": b.pools[e], "demand_tokens": int(got[3 * i] or 0),
                          "admitted": int(got[3 * i + 1]), "held": int(got[3 * i + 2])}
                      for i, e in enumerate(engines)}
    return {k: sum(f[k] for f in b.by_engine.values()) for k in ("demand_tokens", "admitted", "held")}


def pairs(b: SharedBudget) -> list[Any]:
    """``engine C_r ...`` of the engines up (all when none is: a turn then finds no replica)."""
    return [x for e in b._live() for x in (e, b.pools[e])]


def used(b: SharedBudget, engine: str) -> int:
    """The demand of this instance's turns running on ``engine``."""
    return sum(r.d for r in b.running.values() if r.engine == engine)
