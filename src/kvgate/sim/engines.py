"""The simulator's replicas' engines in the event loop: a replica steps when it is idle with work, up to the next
event that reaches every replica; a jump left pending is cut when something reaches its replica."""

from __future__ import annotations

import heapq
import math
from dataclasses import replace
from typing import Any

from kvgate.engine.base import Engine, Request
from kvgate.engine.blocks import SeqKey
from kvgate.engine.factory import build_engine
from kvgate.sim.config import GROUP_ID
from kvgate.sim.loop import EventLoop, Handler
from kvgate.sim.replicas import SimReplica, replica_index


class EngineLoop(EventLoop):
    """The event loop with the engine replicas of ``cfg`` (those that start up: started); the subclass handles a
    step's end (``on_step_end``)."""

    on_step_end: Handler
    by_sid: dict[int, Any]
    timed: list[Any]
    """Policies with timers, whose deadlines :meth:`timers` turns into events after every event (the subclass's)."""

    def timers(self, now: float) -> None:
        """Timer events for the deadlines of ``timed`` (the subclass's)."""

    def after(self, now: float) -> None:
        """After every event: the timers, then the replicas woken, in index order."""
        if self.timed:
            self.timers(now)
        woken = self.woken
        if woken:
            if len(woken) == 1:
                self.look(woken.pop(), now)
            else:
                self.look_woken(now)

    def run(self, until: float = math.inf) -> None:
        """:meth:`step` in a loop with :meth:`after` inline and the lookups hoisted: the simulator's hot path
        (``tests/sim/test_loop.py`` checks a run stepped one event at a time is the same run)."""
        events, routed, steps, split, woken = self.events, self.routed, self.steps, self.split, self.woken
        pop, look = heapq.heappop, self.look
        while True:
            src = events if events else None
            if split:
                if routed and (src is None or routed[0] < src[0]):
                    src = routed
                if steps and (src is None or steps[0] < src[0]):
                    src = steps
            if src is None or src[0][0] > until:
                return
            now, _, handler, payload = pop(src)
            self.now = now
            handler(payload, now)
            if not self.running:
                return
            if self.timed:
                self.timers(now)
            if woken:
                if len(woken) == 1:
                    look(woken.pop(), now)
                else:
                    self.look_woken(now)

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        self.pools: list[int] = cfg.pools()
        self.reps = reps = [SimReplica(i, p) for i, p in enumerate(self.pools)]
        self.one_pool = not cfg.replica_pools
        for r in reps[: cfg.replicas]:
            r.start(self.engine_for(r))
            r.up = True
        self.block_size: int = reps[0].engine.block_size  # type: ignore[union-attr]
        prof = reps[0].engine.profile  # type: ignore[union-attr]
        self.request_time = prof.request_time if prof.request_s or prof.request_per_token_s else None
        """A request's way to its engine's queue (:meth:`kvgate.engine.costmodel.Profile.request_time`); None: none."""
        self.group_blocks: dict[int, int] = {}
        # Engines that can leave a jump pending (vLLM's): arrivals and think times' ends, and step ends, wait in heaps
        # of their own and bound no step (see kvgate.sim.fleet); otherwise (SGLang's) one heap bounds every step.
        self.defer: bool = reps[0].engine.defers_jumps  # type: ignore[union-attr]
        super().__init__(split=self.defer)
        self.woken: list[SimReplica] = [r for r in reps if r.wake]
        """Replicas to look at after the event, in index order (as a scan of every replica would)."""

    def on_engines(self, act: tuple[Any, float], now: float) -> None:
        """A trigger acts on every live replica's engine (``act``: the trigger and the minute of its act); again
        every second on those where it is not done yet (e.g. blocks it takes are not free yet)."""
        trigger, minute = act
        again = False
        for rep in self.reps:
            if rep.up and rep.engine is not None:
                self.settle(rep, now)
                if not trigger.on_engine(rep.engine, minute):
                    again = True
                if not rep.wake:  # what it did may let the engine start work (or stop it)
                    rep.wake = True
                    self.woken.append(rep)
        if again:
            self.push(now + 1.0, self.on_engines, act)

    def seq_key(self, s: Any) -> SeqKey:
        """The engine's key of session ``s``'s token sequence (its group's shared prefix, then its own)."""
        shared = s.spec.shape.shared_tokens
        gb = self.group_blocks.get(shared)
        if gb is None:
            gb = self.group_blocks[shared] = shared // self.block_size
        return SeqKey(GROUP_ID, gb, s.spec.sid)

    def refresh_usage(self) -> None:
        """Every engine's KV usage, read now for a router that reads it (jumps left pending are cut here)."""
        now = self.now
        for r in self.reps:
            self.settle(r, now)
            if r.up:
                r.kv_usage = r.engine.usage()  # type: ignore[union-attr]

    def engine_for(self, r: SimReplica) -> Engine:
        return build_engine(self.cfg if self.one_pool else replace(self.cfg, kv_pool=r.kv_pool))

    def reach(self, rep: SimReplica, req: Request, now: float) -> None:
        """``req`` joins ``rep``'s engine now."""
        if rep.pending is not None:
            self.settle(rep, now)
        rep.engine.add(req)  # type: ignore[union-attr]
        if not rep.wake and not rep.busy:  # (a stepping replica looks at its work when its step ends)
            rep.wake = True
            self.woken.append(rep)

    def settle(self, rep: SimReplica, now: float) -> None:
        """Cut ``rep``'s pending jump, if any, at ``now`` (something reaches the replica): its step ends with the
        step containing ``now``, as if ``now`` had been the jump's horizon."""
        if rep.pending is None:
            return
        start, sq, planned = rep.pending
        rep.pending = None
        res = rep.engine.settle(now)  # type: ignore[union-attr]
        if res.steps != planned:  # the step ends earlier: the event already queued for it is stale
            rep.gen += 1
            heapq.heappush(self.steps, (start + res.duration, sq, self.on_step_end, (rep, rep.gen, res)))

    def look(self, rep: SimReplica, now: float) -> None:
        """``rep`` was woken: if it is idle with work, its next step (or jump) starts now."""
        eng = rep.engine
        if not (rep.up and not rep.busy and eng.has_work()):  # type: ignore[union-attr]
            rep.wake = False  # until work arrives or its step ends
            return
        events = self.events
        res = eng.step(now, events[0][0] if events else math.inf, self.defer)  # type: ignore[union-attr]
        if res.steps and res.duration > 0:
            rep.busy = True
            rep.wake = False
            self.seq += 1
            heapq.heappush(self.steps, (now + res.duration, self.seq, self.on_step_end, (rep, rep.gen, res)))
            if res.deferred:
                rep.pending = (now, self.seq, res.steps)
        else:  # it stays awake: work it could not start may start later (pins expire, a load completes)
            self.woken.append(rep)

    def report(self, rep: SimReplica, sid: int, status: str, now: float) -> None:
        """The session's status, to an engine that tracks sessions (it may change its pool)."""
        self.settle(rep, now)
        rep.status(sid, status)

    def look_woken(self, now: float) -> None:
        """Look at the replicas woken by the event, in index order (as a scan of every replica would); the callers
        look at a lone woken replica themselves."""
        woken = self.woken
        batch = sorted(woken, key=replica_index)
        woken.clear()
        for rep in batch:
            if rep.wake:
                self.look(rep, now)

    def resident(self, sid: Any) -> int | None:
        """``sid``'s resident prefix on its replica (its next turn's hit there, as KV events would tell a gateway)."""
        s = self.by_sid.get(sid)
        rep = s.replica if s is not None else None
        if rep is None or not rep.up:
            return None
        self.settle(rep, self.now)  # (now: the event being handled)
        return rep.engine.pool.lookup(s.key, 1 << 40)  # type: ignore[union-attr, arg-type]
