"""An instance's side of a held turn (:class:`kvgate.gateway.sharing.Sharing`) against a scripted budget: the
admission notice of a parked turn may reach the instance (its notify task, on another connection) before the
``ASK`` that parked it has answered; the turn must run, not give its admission back and wait on. A budget that
recovered into a generation without the held turns (Redis restarted) has each of them ask again."""

from __future__ import annotations

import asyncio
from typing import Any

from kvgate.gateway.sessions import GwSession
from kvgate.gateway.shared import PARK, PROCEED, Turn
from kvgate.gateway.shared_books import SharedSessions
from kvgate.gateway.sharing import Sharing, ask_again, replica_down


class ScriptedBudget:
    """What :class:`Sharing` calls of a :class:`kvgate.gateway.shared.SharedBudget`, answering as told."""

    def __init__(self, answer: str) -> None:
        self.answer = answer
        self.asks = 0
        self.asked = asyncio.Event()
        self.answer_now = asyncio.Event()
        self.given_back: list[str] = []
        self.ended: list[str] = []
        self.local = None
        self.running: dict[str, Turn] = {}
        self.placed: dict[str, str] = {}
        self.failures = (OSError,)
        self.engines_up = ["e1", "e2"]

    def up(self) -> list[str]:
        return self.engines_up

    async def ask(self, sid: str, d: int, turn: str, now_ms: int, version: str = "", hint: str = "") -> str:
        self.placed[sid] = "e1"
        self.asks += 1
        self.asked.set()
        await self.answer_now.wait()
        return self.answer

    async def finished(self, sid: str, now_ms: int, aborted: bool = False, book: Any = None) -> list[Any]:
        self.given_back.append(sid)
        return ["ok"]

    async def ended(self, sid: str, now_ms: int, book: Any = None, if_idle: str = "") -> list[Any]:
        self.ended.append(sid)
        return ["ok"]


def _sharing(budget: ScriptedBudget, max_park_s: float | None = None) -> tuple[Sharing, GwSession]:
    sessions = SharedSessions()
    sh = Sharing("redis://127.0.0.1:1/0", sessions, lambda: 0.0, 1.0, max_park_s)
    sh.budget = budget  # type: ignore[assignment]
    s = GwSession("lin-a-1", False)
    s.est.output = 16
    sessions.by_id[s.sid] = s
    return sh, s


async def _estimate() -> tuple[int, str, int]:
    return 100, "count", 100


def test_a_notice_before_the_park_answer_admits_the_turn() -> None:
    async def run() -> None:
        budget = ScriptedBudget(PARK)
        sh, s = _sharing(budget)
        task = asyncio.create_task(sh.admit(s, 16, (100, "count", 100), _estimate))
        await budget.asked.wait()
        sh.wake(Turn(sh.key(s), 116, next(iter(sh.waiting.values())).turn))  # the pump's notice, first
        budget.answer_now.set()  # then ASK's own answer: parked
        async with asyncio.timeout(10):  # (a hang guard)
            got = await task
        assert got == (100, "count", 100)
        assert budget.given_back == [] and budget.ended == []
        assert not sh.waiting and s.slot.future is None

    asyncio.run(run())


def test_a_notice_for_a_turn_nobody_waits_for_is_given_back() -> None:
    async def run() -> None:
        budget = ScriptedBudget(PROCEED)
        sh, s = _sharing(budget)
        budget.answer_now.set()
        assert await sh.admit(s, 16, (100, "count", 100), _estimate) == (100, "count", 100)
        sh.wake(Turn(sh.key(s), 116, "gw-x.1"))  # (a turn of this instance that left: its admission goes back)
        async with asyncio.timeout(10):
            while not budget.given_back:
                await asyncio.sleep(0.001)
        assert budget.given_back == [sh.key(s)]

    asyncio.run(run())


async def _held_turn() -> tuple[ScriptedBudget, Any, Any, asyncio.Task[Any]]:
    """A turn the scripted budget parks, once it waits in the instance's FIFO."""
    budget = ScriptedBudget(PARK)
    sh, s = _sharing(budget)
    budget.answer_now.set()
    task = asyncio.create_task(sh.admit(s, 16, (100, "count", 100), _estimate))
    async with asyncio.timeout(10):
        while not any(w.parked for w in sh.waiting.values()):
            await asyncio.sleep(0.001)
    return budget, sh, s, task


def test_a_held_turn_is_woken_by_its_notice() -> None:
    async def run() -> None:
        budget, sh, s, task = await _held_turn()
        assert not task.done()
        sh.wake(Turn(sh.key(s), 116, next(iter(sh.waiting.values())).turn))
        async with asyncio.timeout(10):
            assert await task == (100, "count", 100)
        assert budget.given_back == []

    asyncio.run(run())


def test_a_held_turn_asks_again_when_the_budget_recovers_without_it() -> None:
    async def run() -> None:
        budget, sh, s, task = await _held_turn()
        asks = budget.asks
        budget.answer = PROCEED  # (the new generation admits it when it asks again)
        ask_again(sh)  # what a recovery tells the instance: Redis restarted, its FIFO is gone
        async with asyncio.timeout(10):
            assert await task == (100, "count", 100)
        assert budget.asks == asks + 1 and budget.given_back == []

    asyncio.run(run())


def test_a_held_turn_asks_again_when_its_engine_is_seen_down() -> None:
    async def run() -> None:
        budget, sh, s, task = await _held_turn()
        assert next(iter(sh.waiting.values())).engine == "e1"
        asks = budget.asks
        replica_down(sh, budget)  # type: ignore[arg-type]  # (e1 up: nothing)
        await asyncio.sleep(0.01)
        assert budget.asks == asks and not task.done()
        budget.answer = PROCEED  # (placed on another engine when it asks again)
        budget.engines_up = ["e2"]
        replica_down(sh, budget)  # type: ignore[arg-type]  # the heartbeat's look: e1 is down here
        async with asyncio.timeout(10):
            assert await task == (100, "count", 100)
        assert budget.asks == asks + 1 and budget.given_back == []

    asyncio.run(run())


def test_a_fleet_on_redis_needs_a_sticky_router() -> None:
    import pytest

    from kvgate.errors import UsageError
    from kvgate.gateway.app import Gateway
    from kvgate.gateway.config import GatewayConfig

    def cfg(router: str) -> GatewayConfig:
        return GatewayConfig(upstream="http://127.0.0.1:1", upstreams=("http://127.0.0.1:2",), router=router,
                             store="redis://127.0.0.1:1/0")

    with pytest.raises(UsageError, match="sticky --router"):
        Gateway(cfg("round-robin"))
    Gateway(cfg("consistent-hash"))  # (a budget per replica: nothing is connected before start)
