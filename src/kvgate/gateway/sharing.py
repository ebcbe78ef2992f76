"""Gateways sharing one Redis (``--store redis://HOST:PORT/DB``): the books of every session and one budget.

Theory of operation. Each instance keeps a copy of every session's book (:mod:`kvgate.gateway.shared_books`), so any
instance takes any turn of any session, named or found by lineage; the budget is :class:`SharedBudget`'s (the
budgeter's rule, admit iff D + d_s <= C, decided in Redis for all instances; the local policy runs without a
control and keeps only this instance's view). A turn costs these round trips to Redis:

* **at its boundary** (2): the books changed since the last read (``SYNC``: one script, every change of every
  instance), then ``ASK`` with the version of the session's book the estimate used. ``ASK`` answers proceed, park
  (held in the shared FIFO: the pump of whichever instance ends a turn pushes it to this instance's notify list,
  popped by a blocking ``BLPOP`` task), busy (another instance holds a turn of the session: asked again every
  :data:`BUSY_POLL_S` until its lease ends) or moved (the book changed since it was read: it is read again, the
  turn estimated again, asked again);
* **at its end** (1): the lease goes and the book is written in one script (``BOOK_FINISH``; ``BOOK_END`` when the
  session ends), before the answer leaves for a whole response; a stream's end may reach its client first, and the
  next turn's ``ASK`` then finds the lease (busy) or the newer book (moved), never the old one.

A held turn's waiter is registered before its first ``ASK``: the pump's notice travels on another connection
and may be taken before the ``ASK`` that parked the turn has answered (the waiter then finds its future done). A
copy of a session that goes idle here (released, or forgotten) leaves the shared D only if no instance holds or
runs a turn of it and its book is still the one this instance has (``END`` with ``if_idle``).

A fleet (several upstreams): one budget per replica, named by its URL. ``ASK`` answers the session's engine
beside its decision (placed there by Redis, the engines this instance sees up offered, the engine of its last
turns as the hint); an admitted turn's session is placed on that replica here, so the sticky router sends it there
(:func:`kvgate.gateway.shared_books.move_to`). A held turn whose engine this instance sees down asks again at the
next heartbeat.

Faults (see :mod:`kvgate.gateway.shared`): an instance that dies leaves its leases to run out within the lease
(3 s); a Redis that goes away puts every instance on its local share within a heartbeat; after a recovery (a new
generation of the budget, without its FIFO) every held turn asks again from its waiter; a Redis that comes back
with no data (a new epoch of the books) is written again by the instances from their copies.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import secrets
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.core import Metric

from kvgate.errors import KvgateError, PolicyRefusal
from kvgate.gateway import shared
from kvgate.gateway.metrics import Histogram
from kvgate.gateway.sessions import GwSession
from kvgate.gateway.shared import BUSY, MOVED, PARK, PHASE, PROCEED, SharedBudget, Turn
from kvgate.gateway.shared_books import Books, SharedSessions, book_of, move_to
from kvgate.gateway.store_redis import PREFIX
from kvgate.http.prometheus import ScrapeCollector, counter, gauge

log = logging.getLogger("kvgate.gateway")

BUSY_POLL_S = 0.02
"""Real seconds between asks of a turn whose session another instance holds."""
HEARTBEAT_S = 0.25
SYNC_LIMIT = 1000
Estimate = tuple[int, str, int]


@dataclass
class Waiter:
    """A turn of this instance between its first ask and its admission."""

    turn: str
    fut: asyncio.Future[bool]
    """True: admitted; False: ask again (the budget recovered into a generation that does not hold it)."""
    d: int
    parked: bool = False
    """ASK answered park (held in the shared FIFO, or the local one)."""
    est: Estimate | None = None
    engine: str = ""
    """The engine it is held for (asked again when this instance sees that engine down)."""


class SharedHoldTimeout(PolicyRefusal):
    """Held by the shared budget (or behind another instance's turn of the session) for more than --max-park-s."""


def is_shared(url: str | None) -> bool:
    return bool(url) and url.startswith(("redis://", "rediss://", "unix://"))  # type: ignore[union-attr]


class Sharing:
    """This instance's side of the shared books and budget (see the module docstring)."""

    def __init__(self, url: str, sessions: SharedSessions, now: Callable[[], float], time_scale: float,
                 max_park_real: float | None, lease_s: float = 3.0) -> None:
        self.url = url
        self.sessions = sessions
        self.now = now
        self.owner = f"gw{os.getpid()}-{secrets.token_hex(3)}"
        """This instance's name in Redis (leases, notify list, live instances)."""
        self.books = Books(sessions, time_scale)
        self.max_park = max_park_real
        self.lease_s = lease_s
        self.budget: SharedBudget | None = None
        self.park_wait: Histogram | None = None
        self.client: Any = None
        self.waiting: dict[str, Waiter] = {}
        """Turns of this instance asking or held, by session key (registered before the first ask)."""
        self._outcomes: dict[str, str] = {}
        self.pending: set[str] = set()
        """Sessions whose book could not be written (Redis away): written when it answers again."""
        self._tasks: set[asyncio.Task[Any]] = set()
        self._turns = 0
        self.figures: dict[str, int] = {"demand_tokens": 0, "admitted": 0, "held": 0}
        """The shared books of the engine at the last heartbeat."""
        self.busy_waits = 0
        self.moved = 0
        self.fleet: Any = None
        sessions.lineage_tag = self.owner.split("-", 1)[1] + "-"
        sessions.on_out = self._out

    # -- lifecycle ---------------------------------------------------------------------------------------------
    async def start(self, fleet: Any, registry: Any) -> None:
        """Connect, read every book, start the heartbeat and the notify task (one budget per replica of
        ``fleet``, each named by its URL); the shared figures on ``registry`` (``/metrics``)."""
        self.fleet = fleet
        registry.register(SharedCollector(self))
        self.client = shared.connect(self.url)
        pools = {r.url: r.kv_pool for r in fleet.replicas}
        capacity = sum(pools.values())
        self.budget = SharedBudget(self.client, self.owner, pools, lease_s=self.lease_s)
        self.budget.up = lambda: [r.url for r in fleet.replicas if r.up]
        self.budget.parked = self._parked
        self.budget.on_recover = lambda: ask_again(self)
        await self.budget.heartbeat(_ms())
        await self.sync()
        books_read(self.url, self.owner, len(self.books.versions), capacity, self.budget.stats.store_up)
        for run in (beat_task, notify_task):
            self._spawn(run(self))

    async def stop(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        for task in list(self._tasks):
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self.client is not None:
            with contextlib.suppress(Exception):
                await self.client.zrem(f"{PREFIX}inst", self.owner)  # (the others count it out at once)
            with contextlib.suppress(Exception):
                await self.client.aclose()

    def _spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    # -- the books ---------------------------------------------------------------------------------------------
    def key(self, s: GwSession) -> str:
        """The session's name in Redis (a one-turn session's is this instance's own)."""
        return f"~{self.owner}.{s.sid}" if s.anonymous else str(s.sid)

    async def sync_turn(self) -> None:
        """:meth:`sync` at a turn's boundary (its round trips counted as the boundary's)."""
        phase = PHASE.set("boundary")
        try:
            await self.sync()
        finally:
            PHASE.reset(phase)

    async def sync(self) -> None:
        """Read the books changed since the last read (every one of a new epoch)."""
        b, books = self.budget, self.books
        assert b is not None
        while b.local is None:
            try:
                out = await b.script("SYNC", PREFIX, books.last, books.epoch, _fresh(), SYNC_LIMIT)
            except b.failures:
                b.fall_back()
                return
            if out[0] != books.epoch:
                books.new_epoch(out[0])
                self.pending |= books.mine
            now = self.now()
            for i in range(1, len(out), 3):
                books.apply(out[i], int(float(out[i + 1])), out[i + 2], now)
            if len(out) < 1 + 3 * SYNC_LIMIT:
                return

    # -- a turn ------------------------------------------------------------------------------------------------
    async def admit(self, s: GwSession, output: int, est: Estimate, estimate: Callable[[], Awaitable[Estimate]]
                    ) -> Estimate | KvgateError:
        """Wait until the shared budget admits the session's turn (``est``: its estimate); its estimate (made again
        by ``estimate`` if the book moved), or the error to answer (held too long, the gateway stopping)."""
        b = self.budget
        assert b is not None
        key = self.key(s)
        self._turns += 1
        turn = f"{self.owner}.{self._turns}"
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        until = None if self.max_park is None else t0 + self.max_park
        # The waiter is there before the first ask: the pump of another instance may admit the turn, and this
        # instance's notify task pop that, before the ask's own answer (park) is taken here.
        w = Waiter(turn, loop.create_future(), output, est=est)
        self.waiting[key] = w
        s.slot.future = w.fut  # type: ignore[assignment]  # (the gateway's stop answers it)
        phase = PHASE.set("boundary")
        try:
            error = await self._until_admitted(s, key, w, estimate, until)
        finally:
            PHASE.reset(phase)
            if self.waiting.get(key) is w:
                del self.waiting[key]
            s.slot.future = None
        if error is not None:
            return error
        on = b.running.get(key)
        move_to(self.sessions, s, on.engine if on is not None and on.engine else b.placed.get(key, ""), self.now())
        if self.park_wait is not None and loop.time() > t0 + 1e-4:
            self.park_wait.observe((loop.time() - t0) * self.books.time_scale)
        assert w.est is not None
        return w.est

    async def _until_admitted(self, s: GwSession, key: str, w: Waiter, estimate: Callable[[], Awaitable[Estimate]],
                              until: float | None) -> KvgateError | None:
        b = self.budget
        assert b is not None
        loop = asyncio.get_running_loop()
        output = w.d
        assert w.est is not None
        while True:
            w.d = w.est[0] + output
            hint = s.replica.url if s.replica is not None and s.est.turns else ""
            try:
                got = await b.ask(key, w.d, w.turn, _ms(), "" if s.anonymous else self.books.version(s), hint)
            except asyncio.CancelledError:
                if not s.slot.superseded:  # (parked or admitted, it is not known: the session leaves the books' D)
                    await asyncio.shield(self._leave_fifo(s, key))
                raise
            if w.fut.done():  # admitted by a pump whose notice came before this answer, or the gateway stopping
                error = None if w.fut.cancelled() else w.fut.exception()
                if isinstance(error, KvgateError):
                    await self._leave_fifo(s, key)
                    return error
                if w.fut.result():
                    return None
                self._renew(s, w)
                continue
            w.engine = b.placed.get(key, "")
            if got == PROCEED:
                return None
            if got == MOVED:
                self.moved += 1
                await read_again(self, s)
                w.est = await estimate()
                continue
            if until is not None and loop.time() >= until:
                if got == PARK:
                    await self._leave_fifo(s, key)
                return SharedHoldTimeout(f"held by the shared budget for more than {self.max_park:g} s; retry later")
            if got == BUSY:
                self.busy_waits += 1
                await asyncio.sleep(BUSY_POLL_S)
                continue
            w.parked = True
            error = await self._held(s, key, w, until)
            if error is not None or w.fut.result():
                return error
            self._renew(s, w)  # (asked again: the budget recovered into a generation without it)

    def _renew(self, s: GwSession, w: Waiter) -> None:
        w.fut, w.parked = asyncio.get_running_loop().create_future(), False
        s.slot.future = w.fut  # type: ignore[assignment]

    async def _held(self, s: GwSession, key: str, w: Waiter, until: float | None) -> KvgateError | None:
        """Parked: wait for the pump's notice (or the local share's), the hold's limit or the gateway's stop."""
        try:
            if until is None:
                await w.fut
            else:
                async with asyncio.timeout(max(0.0, until - asyncio.get_running_loop().time())):
                    await w.fut
        except TimeoutError:
            if not w.fut.done():
                await self._leave_fifo(s, key)
                return SharedHoldTimeout(f"held by the shared budget for more than {self.max_park:g} s; "
                                         "retry later")
        except KvgateError as e:  # (stopping)
            await self._leave_fifo(s, key)
            return e
        except asyncio.CancelledError:
            if not s.slot.superseded:  # (a retry of this turn takes over its place)
                await asyncio.shield(self._leave_fifo(s, key))
            raise
        return None

    async def _leave_fifo(self, s: GwSession, key: str) -> None:
        """A held turn that will not run: the session leaves the shared books' FIFO (ended, as with one
        gateway)."""
        b = self.budget
        assert b is not None
        if not s.slot.dropped:
            self.books.quiet.add(s.sid)
            self.sessions.end(s, "refused", self.now())
        self.books.versions.pop(s.sid, None)
        await b.ended(key, _ms(), None if s.anonymous else _fresh())
        self.pump_local()

    def _parked(self) -> list[Turn]:
        return [Turn(k, w.d, w.turn, w.engine) for k, w in self.waiting.items() if w.parked and not w.fut.done()]

    def outcome(self, s: GwSession, outcome: str) -> None:
        self._outcomes[self.key(s)] = outcome

    async def turn_over(self, s: GwSession, ending: bool) -> None:
        """The turn's handler is done: the lease goes and the book is written (or the session leaves the books)."""
        phase = PHASE.set("end")
        try:
            with contextlib.suppress(asyncio.CancelledError):
                await asyncio.shield(self._turn_over(s, ending))
        finally:
            PHASE.reset(phase)

    async def _turn_over(self, s: GwSession, ending: bool) -> None:
        b = self.budget
        assert b is not None
        key = self.key(s)
        outcome = self._outcomes.pop(key, None)
        if s.slot.dropped:
            return
        epoch = _fresh()
        if ending:
            self.books.quiet.add(s.sid)
            self.books.versions.pop(s.sid, None)
            await b.ended(key, _ms(), None if s.anonymous else epoch)
        elif key in b.running:
            aborted = outcome != "finished"
            book = None if s.anonymous else (book_of(s, time.time()), epoch)
            out = await b.finished(key, _ms(), aborted, book)
            if book is not None and not self.books.written(s, out):
                self.pending.add(s.sid)
        self.pump_local()

    def _out(self, s: GwSession, gone: bool) -> None:
        """A session left D here (ended, or released) outside a turn: the shared books are told."""
        if s.sid in self.books.quiet:
            self.books.quiet.discard(s.sid)
            return
        b = self.budget
        if b is None:
            return
        version = self.books.version(s)  # (only if no other instance serves it since: a copy went idle here)
        if gone:
            self.books.versions.pop(s.sid, None)
        book = _fresh() if gone and not s.anonymous else None
        self._spawn(self._ended(self.key(s), book, "" if s.anonymous else version))

    async def _ended(self, key: str, book: str | None, if_idle: str) -> None:
        assert self.budget is not None
        with contextlib.suppress(*self.budget.failures):
            await self.budget.ended(key, _ms(), book, if_idle)
        self.pump_local()

    # -- held turns: woken ---------------------------------------------------------------------------------------
    def wake(self, t: Turn) -> None:
        w = self.waiting.get(t.sid)
        if w is not None and w.turn == t.turn and not w.fut.done():
            w.fut.set_result(True)  # (its ask may not have answered yet: it finds the future done)
            return
        assert self.budget is not None  # a turn nobody waits for any more: its admission is given back
        self._spawn(self.budget.finished(t.sid, _ms(), True))

    def pump_local(self) -> None:
        b = self.budget
        if b is not None and b.local is not None:
            for t in b.pump_local(_ms()):
                self.wake(t)

    # -- what it shows ---------------------------------------------------------------------------------------
    def state(self) -> dict[str, Any]:
        """``/kvgate/info`` and ``GET /v1/sessions``: the shared books beside this instance's counters."""
        return shared_state(self)

    @property
    def turns_asked(self) -> int:
        """Turns that asked the shared budget (each counted once, however many times it asked)."""
        return self._turns



async def read_again(sh: Sharing, s: GwSession) -> None:
    """Read the session's book again (``ASK`` said moved)."""
    b = sh.budget
    assert b is not None
    with contextlib.suppress(*b.failures):
        version, raw = await b.script("READ", PREFIX, str(s.sid))
        v = int(float(version))
        if raw:
            sh.books.versions.pop(s.sid, None)
            sh.books.apply(str(s.sid), v, raw, sh.now())
        else:
            sh.books.versions[s.sid] = v


def ask_again(sh: Sharing) -> None:
    """The budget recovered (a new generation, or one this instance joined): every held turn of this instance
    asks again, those of the local FIFO first, in its order (each from its own waiter)."""
    b = sh.budget
    assert b is not None
    order = [*(b.local or ()), *sh.waiting]
    for k in dict.fromkeys(order):
        w = sh.waiting.get(k)
        if w is not None and w.parked and not w.fut.done():
            w.fut.set_result(False)


async def notify_task(sh: Sharing) -> None:
    """Take the notices of this instance's held turns admitted (by any instance's pump; on the local share, by
    its own)."""
    b = sh.budget
    assert b is not None
    key = f"{PREFIX}notify:{sh.owner}"
    while True:
        if b.local is not None or b.has_ready:
            for k, w in sh.waiting.items():  # (held in Redis when it went away)
                if b.local is not None and w.parked and not w.fut.done() and k not in b.local \
                        and k not in b.running:
                    b.local[k] = Turn(k, w.d, w.turn, w.engine)
            for t in await b.admitted(_ms()):
                sh.wake(t)
            await asyncio.sleep(0.05)
            continue
        try:
            got = await sh.client.blpop([key], timeout=0.5)
        except b.failures:
            b.fall_back()
            continue
        if got:
            t = b.notified(got[1])
            if t is not None:
                sh.wake(t)


def books_read(url: str, owner: str, sessions: int, capacity: int, store_up: bool) -> None:
    """Say that a gateway read the shared books at start, and warn when the store did not answer (a mistyped
    address looks like that too; the gateway admits on its local share of the budget meanwhile)."""
    log.info("shared books read", extra={"event": "shared", "store": url, "owner": owner, "sessions": sessions,
                                         "kv_pool": capacity, "store_up": store_up})
    if not store_up:
        log.warning(f"the store {url} does not answer: this gateway admits on its local share of the budget until "
                    "it does", extra={"event": "store_down", "store": url})


async def beat_task(sh: Sharing) -> None:
    b = sh.budget
    assert b is not None
    while True:
        await asyncio.sleep(HEARTBEAT_S)
        try:
            await heartbeat(sh, b)
        except Exception:  # never let a bug stop the heartbeat
            log.exception("shared heartbeat failed", extra={"event": "shared_error"})


async def heartbeat(sh: Sharing, b: SharedBudget) -> None:
    """One heartbeat: live, leases renewed; the figures and the books read again; the books Redis missed."""
    was_up = b.stats.store_up
    if sh.fleet is not None:
        b.pools = {r.url: r.kv_pool for r in sh.fleet.replicas}
        replica_down(sh, b)
    await b.heartbeat(_ms())
    if b.stats.store_up != was_up:
        log.warning("shared store " + ("up" if b.stats.store_up else "down"),
                    extra={"event": "shared_store", "store_up": b.stats.store_up,
                           "instances": b.stats.live_instances, "local_share": b.share(_ms())})
    if b.local is not None:
        sh.pump_local()
        return
    with contextlib.suppress(*b.failures):
        sh.figures = await shared.figures(b)
        await sh.sync()  # (what the instance lists stays within a heartbeat of the others' books)
        if sh.pending:
            await write_pending(sh, b)


def replica_down(sh: Sharing, b: SharedBudget) -> None:
    """Held turns of an engine this instance sees down ask again: the budget places them on another one."""
    up = set(b.up())
    for w in sh.waiting.values():
        if w.parked and w.engine and w.engine not in up and not w.fut.done():
            w.fut.set_result(False)


async def write_pending(sh: Sharing, b: SharedBudget) -> None:
    """Write the books Redis missed while away (or lost)."""
    pending, sh.pending = sh.pending, set()
    for sid in pending:
        s = sh.sessions.by_id.get(sid)
        if s is None or s.slot.busy or s.anonymous:
            continue
        out = await b.script("PUT", PREFIX, sid, book_of(s, time.time()), _fresh())
        sh.books.written(s, ["ok", *out])


def shared_state(sh: Sharing) -> dict[str, Any]:
    """What :meth:`Sharing.state` shows."""
    b = sh.budget
    if b is None:
        return {"store": sh.url}
    st = b.stats
    local = b.local is not None
    return {"store": sh.url, "owner": sh.owner, "store_up": st.store_up, "instances": st.live_instances,
            "local_share": local, "local_share_tokens": b.share(_ms()) if local else None,
            "kv_pool": b.capacity, **sh.figures, "sessions": len(sh.books.versions),
            "replicas": {e: {**f, "up": e in set(b.up())} for e, f in b.by_engine.items()},
            "generation": b.gen, "fallbacks": st.fallbacks, "recoveries": st.recoveries,
            "round_trips": st.round_trips, "round_trips_by_phase": dict(st.by_phase), "turns_asked": sh.turns_asked,
            "lost_leases": st.lost_leases, "busy_waits": sh.busy_waits,
            "moved": sh.moved, "books_applied": sh.books.applied, "held_here": len(sh.waiting)}


class SharedCollector(ScrapeCollector):
    """``/metrics``: the shared books and this instance's view of them."""

    def __init__(self, sharing: Sharing) -> None:
        self.sharing = sharing

    def collect(self) -> Iterator[Metric]:
        st = self.sharing.state()
        if "owner" not in st:
            return
        yield gauge("kvgate_shared_store_up", "1 while the shared store (Redis) answers.", float(st["store_up"]))
        yield gauge("kvgate_shared_instances", "Gateway instances live at the last heartbeat.", st["instances"])
        yield gauge("kvgate_shared_local_share", "1 while this instance admits on its local share (C / instances).",
                    float(st["local_share"]))
        yield gauge("kvgate_shared_demand_tokens", "D of the shared budget (every instance's admitted sessions).",
                    st["demand_tokens"])
        yield gauge("kvgate_shared_sessions_admitted", "Sessions admitted by the shared budget.", st["admitted"])
        yield gauge("kvgate_shared_sessions_held", "Sessions held in the shared FIFO.", st["held"])
        yield counter("kvgate_shared_round_trips", "Calls to the shared store.", st["round_trips"])
        yield counter("kvgate_shared_fallbacks", "Times the shared store went away.", st["fallbacks"])
        yield counter("kvgate_shared_recoveries", "Times the budget was resynced.", st["recoveries"])


def _ms() -> int:
    return int(time.time() * 1000)


def _fresh() -> str:
    """An epoch for the books of a Redis that has none (each write offers a new one: one that lost its data must
    not take an old epoch back)."""
    return secrets.token_hex(8)
