"""The engine loop: one asyncio task owns the simulated engine and steps it on the scaled clock.

A step is computed when it starts (``eng.step(now, horizon)``) and its results are delivered when its real
deadline (:meth:`kvgate.http.clock.Clock.deadline` of ``now + duration``) has come, so a client sees tokens when
the simulated GPU would have produced them. Steps follow each other back to back in virtual time; an idle engine
resumes at the arrival time of the request that woke it. A request is stamped with the virtual time it reached
the server and joins the engine at the first step boundary at or after that stamp, as in the simulator: at a
boundary the loop waits a little (3 ms real at most) for requests still being parsed that arrived before it, so
parsing costs no virtual time. The horizon is ``now`` plus ``slice_ms`` of real time (or the next known
arrival), so a decode jump (many identical decode steps in one call) ends soon enough for a new arrival to join
the batch. A client that disconnects aborts its request (``eng.abort``: its blocks are freed).
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
from collections import deque
from collections.abc import Callable
from typing import Any

from kvgate.engine.base import Engine, Request, StepResult
from kvgate.http.clock import Clock
from kvgate.serve.bridge import Content, ContentBridge
from kvgate.serve.kvevents import KVEventPublisher
from kvgate.workload.triggers import Trigger

log = logging.getLogger("kvgate.serve")


class EngineFailed(RuntimeError):
    """The simulated engine raised: every request fails (as vLLM's EngineDeadError), new ones are refused."""


class Turn:
    """One request in flight: what its handler waits for."""

    __slots__ = ("req", "content", "stream", "visible", "done", "error", "wake")

    def __init__(self, req: Request, content: Content, stream: bool) -> None:
        self.req = req
        self.content = content
        self.stream = stream
        self.visible = 0  # output tokens delivered (produced by steps whose real deadline has passed)
        self.done = False
        self.error: str | None = None
        self.wake = asyncio.Event()


class EngineLoop:
    """Owns the engine; steps it in scaled real time and delivers what each step did (module docstring).

    Arrivals. A request is stamped with the virtual time it reached the server (:meth:`expect`) and joins the
    engine at the first step boundary at or after that stamp, as in the simulator, however long parsing and
    hashing it took: at a boundary the loop waits (at most ``MAX_WAIT_S`` real seconds) for requests still
    being parsed that arrived before it, and a jump never runs past a known arrival. The wait delays that
    step's delivery, not its virtual time; the following steps catch up."""

    MAX_WAIT_S = 0.003

    def __init__(self, engine: Engine, bridge: ContentBridge, time_scale: float, slice_s: float) -> None:
        self.engine = engine
        self.bridge = bridge
        self.scale = time_scale
        self.slice_v = slice_s * time_scale
        self.vt = 0.0  # engine's virtual time: the end of the last step, or the clock when idle
        self.clock: Clock | None = None
        """The scaled clock, from :meth:`start` (virtual 0 is the moment the loop started)."""
        self._wake: asyncio.Event | None = None
        self._changed: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._stalled = False
        self._expected: dict[int, float] = {}  # requests being parsed: token -> arrival (virtual)
        self._token = 0
        self._pending: list[tuple[float, int, Turn]] = []  # submitted, not yet in the engine (heap by arrival)
        self.active: set[Turn] = set()
        self._streams: set[Turn] = set()
        self.dead: str | None = None
        self.lag = 0.0  # virtual seconds the engine was behind the clock at the last step
        self.lag_max = 0.0
        self.lags: deque[float] = deque(maxlen=4096)  # lag at the last steps
        self.late = 0  # arrivals not ready within MAX_WAIT_S of their step boundary
        self.prompt_tokens = 0
        self.generation_done = 0
        self.finished = 0
        self.aborted = 0
        self.events: KVEventPublisher | None = None
        """Publishes the pool's KV events after every step and reset (``--kv-events-config``)."""
        self._acts: set[asyncio.Task[None]] = set()
        """Triggers' acts waiting for their minute (:meth:`play`)."""

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self.clock = Clock(loop, self.scale)
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._task = loop.create_task(self._run(), name="kvgate-engine-loop")

    async def stop(self, reason: str = "the server is shutting down") -> None:
        for act in list(self._acts):
            act.cancel()
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._fail_all(reason)

    def expect(self) -> tuple[int, float]:
        """A request reached the server: a token for :meth:`submit` or :meth:`forget`, and its arrival time."""
        assert self.clock is not None
        t = self.clock.now()
        self._token += 1
        self._expected[self._token] = t
        return self._token, t

    def forget(self, token: int) -> None:
        """The request ``token`` will not be submitted (it was refused, or the client left)."""
        if self._expected.pop(token, None) is not None:
            assert self._changed is not None
            self._changed.set()

    def submit(self, turn: Turn, token: int) -> None:
        """Queue a parsed request; it joins the engine at the first step boundary at or after its arrival plus the
        profile's :meth:`~kvgate.engine.costmodel.Profile.request_time` (the way to a real engine's queue)."""
        if self.dead is not None:
            raise EngineFailed(f"engine failed: {self.dead}")
        self._expected.pop(token, None)
        prof = self.engine.profile  # its way to the engine's queue (0 in the paper's profiles)
        heapq.heappush(self._pending, (turn.req.t_submit + prof.request_time(turn.req.prompt), token, turn))
        self.active.add(turn)
        if turn.stream:
            self._streams.add(turn)
        assert self._wake is not None and self._changed is not None
        self._changed.set()
        self._wake.set()

    def abort(self, turn: Turn) -> None:
        """The client went away: take the request out of the engine, freeing its blocks."""
        if turn.done:
            return
        self.engine.abort(turn.req)  # a no-op while it is still pending
        self.aborted += 1
        self._close(turn)
        assert self._wake is not None
        self._wake.set()

    def flush(self, preempt: bool) -> bool:
        return bool(self.act(lambda engine: engine.flush(preempt)))

    def act(self, fn: Callable[[Engine], Any]) -> Any:
        """``fn(engine)`` between two steps (a flush, a trigger's act); its KV events published, the loop woken."""
        out = fn(self.engine)
        if self.events is not None:
            self.events.publish()
        assert self._wake is not None
        self._wake.set()
        return out

    def play(self, trigger: Trigger) -> None:
        """A trigger's acts on the engine (:meth:`kvgate.workload.triggers.Trigger.on_engine`), from now: each at
        its offset from the trigger's minute, again every virtual second until done."""
        for minute in trigger.engine_acts():
            task = asyncio.get_running_loop().create_task(self._act_at(trigger, minute))
            self._acts.add(task)
            task.add_done_callback(self._act_done)

    def _act_done(self, task: asyncio.Task[None]) -> None:
        self._acts.discard(task)
        if not task.cancelled() and (e := task.exception()) is not None:
            log.error("a trigger's act on the engine failed: %s", e)

    async def _act_at(self, trigger: Trigger, minute: float) -> None:
        clock = self.clock
        assert clock is not None
        await clock.sleep_until(clock.now() + (minute - trigger.at_min) * 60.0)
        while not self.act(lambda engine: trigger.on_engine(engine, minute)):
            await clock.sleep_until(clock.now() + 1.0)

    def pending(self) -> int:
        return sum(1 for _, _, t in self._pending if not t.done)

    def _close(self, turn: Turn) -> None:
        turn.done = True
        self.active.discard(turn)
        self._streams.discard(turn)
        self.generation_done += turn.req.generated
        if self.events is not None:
            self.events.untrack(turn.req.seq)
        self.bridge.release(turn.content)
        turn.wake.set()

    def _fail_all(self, reason: str) -> None:
        for turn in list(self.active):
            turn.error = reason
            self._close(turn)

    async def _await_parsing(self, now: float) -> None:
        """Wait (bounded) for the requests being parsed that arrived by ``now``."""
        clock, changed = self.clock, self._changed
        assert clock is not None and changed is not None
        loop = clock.loop
        deadline = loop.time() + self.MAX_WAIT_S
        while True:
            early = [k for k, t in self._expected.items() if t <= now]
            if not early:
                return
            rem = deadline - loop.time()
            if rem <= 0:
                for k in early:  # they join at the boundary after they are ready
                    del self._expected[k]
                self.late += len(early)
                return
            changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(rem):
                    await changed.wait()

    def _admit(self, now: float) -> None:
        pending = self._pending
        while pending and pending[0][0] <= now:
            turn = heapq.heappop(pending)[2]
            if not turn.done:
                self.engine.add(turn.req)
                self._stalled = False

    async def _run(self) -> None:
        eng = self.engine
        clock, wake = self.clock, self._wake
        assert clock is not None and wake is not None
        loop = clock.loop
        try:
            while True:
                now = self.vt
                if self._expected and min(self._expected.values()) <= now:
                    await self._await_parsing(now)
                self._admit(now)
                if self._stalled or not eng.has_work():
                    if self._pending:  # arrivals after the engine's clock (it ran ahead, or nothing can run)
                        self.vt = max(now, self._pending[0][0])
                        continue
                    wake.clear()
                    await wake.wait()
                    self._stalled = False
                    v = clock.now()
                    if self._pending and self._pending[0][0] < v:
                        v = self._pending[0][0]  # an idle engine starts a request from its arrival
                    if v > self.vt:
                        self.vt = v
                    continue
                horizon = now + self.slice_v
                if self._pending and self._pending[0][0] < horizon:
                    horizon = self._pending[0][0]
                for t in self._expected.values():
                    if now < t < horizon:
                        horizon = t
                res: StepResult = eng.step(now, horizon)
                if res.duration <= 0:
                    self._stalled = True  # nothing can run until a request arrives, leaves or the cache resets
                    if self.events is not None:
                        self.events.publish()
                    continue
                end = now + res.duration
                delay = clock.deadline(end) - loop.time()
                if delay > 0.001:
                    await clock.sleep_until(end)
                    lag = 0.0
                else:  # NOTE: asyncio sleeps at least 1 ms; within that the engine runs ahead of the clock
                    lag = max(0.0, -delay * self.scale)
                    if lag > self.lag_max:
                        self.lag_max = lag
                    await asyncio.sleep(0)
                self.lag = lag
                self.lags.append(lag)
                self.vt = end
                if self.events is not None:  # as vLLM: the step's KV events once the step is done
                    self.events.publish()
                self._deliver(res)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug in the engine: fail every request, as vLLM's EngineDeadError does
            log.exception("the simulated engine failed")
            self.dead = f"{type(e).__name__}: {e}"
            self._fail_all(f"engine failed: {self.dead}")

    def _deliver(self, res: StepResult) -> None:
        for req in res.first_token:
            self.prompt_tokens += req.prompt
        for req in res.finished:
            turn: Turn = req.tag  # type: ignore[assignment]
            if not turn.done:
                turn.visible = req.generated
                self.finished += 1
                self._close(turn)
        for turn in self._streams:
            g = turn.req.generated
            if g > turn.visible:
                turn.visible = g
                turn.wake.set()
