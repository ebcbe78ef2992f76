"""The session record split by owner (:class:`kvgate.gateway.sessions.GwSession` and its parts): a book row as the
store kept it before the split restores into the parts and is written back the same, and the turn slot serialises
a session's turns."""

from __future__ import annotations

import asyncio
from typing import Any

from kvgate.gateway.books import FIELDS, restore, row_of
from kvgate.gateway.sessions import Sessions
from kvgate.gateway.slot import TurnSlot

# A book row as the gateway wrote it while the record was one class of 41 fields (flat: one key per field).
OLD_ROW: dict[str, Any] = {
    "sid": "agent-1", "label": "agent-1", "client": 2, "source": "header", "parent": "root-0", "turns": 3,
    "kind": "chat", "known_tokens": 1500, "reply_tokens": 40, "sent_len": 7, "context": 1460, "output": 256,
    "prompt_tokens": 1460, "cached_tokens": 1200, "last_active": 12.5, "breaks": 1, "last_break": "head",
    "rewrites": 2, "response_id": "resp_9", "side_requests": 1, "offers_tools": True, "demand": 1716,
    "state": "thinking", "replica": 0,
}


def test_an_older_row_restores_into_the_parts_and_is_written_back_the_same() -> None:
    sessions = Sessions()
    sessions.fleet.replicas[0].kv_pool = 100_000
    sessions.fleet.start(0.0)
    assert restore(sessions, {"now_s": 12.5}, [OLD_ROW], 12.5) == 1
    s = sessions.by_id["agent-1"]
    assert (s.name.label, s.name.client, s.name.source, s.name.parent) == ("agent-1", 2, "header", "root-0")
    assert (s.est.turns, s.est.context, s.est.output, s.est.cached_tokens) == (3, 1460, 256, 1200)
    assert (s.cache.breaks, s.cache.last_break, s.cache.rewrites) == (1, "head", 2)
    assert (s.lin.response_id, s.lin.side_requests, s.lin.offers_tools) == ("resp_9", 1, True)
    assert sessions.by_response("resp_9") == "agent-1" and s.known_to_policy and s.demand == 1716
    row = row_of(s)
    assert set(FIELDS) <= set(row)
    assert {k: row[k] for k in OLD_ROW} == OLD_ROW


def test_the_slot_hands_the_turn_to_the_next_waiter_in_order() -> None:
    async def run() -> None:
        slot = TurnSlot()
        slot.take()
        loop = asyncio.get_running_loop()
        a, b = loop.create_future(), loop.create_future()
        slot.wait(a)
        slot.wait(b)
        a.cancel()  # its request went away: the turn skips it
        assert slot.hand_on() and b.done() and slot.busy
        assert not slot.hand_on() and not slot.busy
        slot.unwait(a)  # (no longer queued: nothing to do)

    asyncio.run(run())


def test_a_retry_supersedes_only_the_attempt_with_its_body() -> None:
    async def run() -> None:
        slot = TurnSlot()
        task = asyncio.create_task(asyncio.sleep(10))
        slot.begin(task, 7)
        assert not slot.supersede(8)
        assert slot.supersede(7) and slot.superseded
        assert not slot.supersede(7)  # once
        await asyncio.sleep(0)
        assert task.cancelled()
        slot.over()
        assert slot.attempt is None and slot.attempt_key is None

    asyncio.run(run())
