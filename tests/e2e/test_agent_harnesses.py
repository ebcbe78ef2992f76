"""Real agent SDKs at the front door, naming no session: ``kvgate gateway --control budgeter`` in front of
``kvgate engine``, on loopback, with the clients agent harnesses use — the OpenAI Python SDK (chat with tools, and
Responses as Codex sends it: store false, the whole input every turn), the Anthropic Python SDK (Messages with
tools) and LiteLLM's ``acompletion()`` — each running 8 concurrent conversations of 5 turns that share one system
prompt, then:

* ``GET /v1/sessions`` lists exactly one session per conversation (found by lineage), with all its turns, its
  context and its demand;
* two continuations of one conversation's history are two sessions (a fork: the second a child of the first);
* a compaction turn (the history rewritten to the task and a summary) keeps its session, which says so;
* conversations that stop without an end marker leave D within the bound learnt from their think times, and a
  conversation parked behind them (the budget full) is admitted once they have.

Every harness ends with D equal to the true admitted sum and no turn held or in flight.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import openai
import pytest

from kvgate.gateway import Gateway, GatewayConfig
from kvgate.serve.app import EngineServer
from kvgate.serve.config import ServerConfig
from support.aio import timed

SCALE = 100.0
MODEL = "Qwen/Qwen3-8B"
CONVERSATIONS, TURNS = 8, 5
SYSTEM = "You are a careful software engineer working in a large repository. " * 60
BASH = {"name": "bash", "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}


class Convo:
    """One conversation as its harness keeps it: the history it resends whole every turn."""

    def __init__(self, api: str, i: int) -> None:
        self.api = api
        self.task = f"Task {i}: make test_module_{i} pass; the failure is in parser_{i}.py. " * 4
        self.history: list[Any] = [{"role": "user", "content": self.task}]
        if api == "chat":
            self.history.insert(0, {"role": "system", "content": SYSTEM})

    def compacted(self) -> list[Any]:
        """The history rewritten to the task and a summary (what a compaction sends next)."""
        head = [self.history[0]] if self.api == "chat" else []
        return [*head, {"role": "user", "content": self.task},
                {"role": "user", "content": "Summary of the work so far: ran the tests, read the parser."}]


Turn = Callable[[Convo, list[Any] | None], Awaitable[None]]


def openai_chat(base: str) -> tuple[Turn, Callable[[], Awaitable[None]]]:
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30)

    async def turn(c: Convo, history: list[Any] | None = None) -> None:
        msgs = history if history is not None else c.history
        r = await client.chat.completions.create(model=MODEL, messages=msgs, tools=[{"type": "function",
                                                 "function": BASH}], max_tokens=16)
        msg = r.choices[0].message
        call = (msg.tool_calls or [None])[0]
        assert call is not None and call.function.name == "bash"  # type: ignore[union-attr]
        if history is None:
            c.history += [msg.model_dump(exclude_none=True),
                          {"role": "tool", "tool_call_id": call.id, "content": "ok: 3 passed"}]

    return turn, client.close


def openai_responses(base: str) -> tuple[Turn, Callable[[], Awaitable[None]]]:
    client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0, timeout=30)
    tool = {"type": "function", **BASH}

    async def turn(c: Convo, history: list[Any] | None = None) -> None:
        inp = history if history is not None else c.history
        r = await client.responses.create(model=MODEL, instructions=SYSTEM, input=inp, tools=[tool],  # type: ignore
                                          max_output_tokens=16, store=False)
        calls = [o for o in r.output if o.type == "function_call"]
        assert calls and r.usage is not None
        if history is None:
            c.history += [o.model_dump(exclude_none=True) for o in r.output]
            c.history.append({"type": "function_call_output", "call_id": calls[0].call_id,  # type: ignore
                              "output": "ok: 3 passed"})

    return turn, client.close


def anthropic_messages(base: str) -> tuple[Turn, Callable[[], Awaitable[None]]]:
    anthropic = pytest.importorskip("anthropic", reason="the Anthropic SDK is not installed (pip install anthropic)")
    client = anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0, timeout=30)
    tool = {"name": BASH["name"], "description": BASH["description"], "input_schema": BASH["parameters"]}

    async def turn(c: Convo, history: list[Any] | None = None) -> None:
        msgs = history if history is not None else c.history
        m = await client.messages.create(model=MODEL, max_tokens=16, system=SYSTEM, messages=msgs, tools=[tool])
        use = [b for b in m.content if b.type == "tool_use"]
        assert m.stop_reason == "tool_use" and use
        if history is None:
            c.history += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                          {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use[0].id,
                                                        "content": "ok: 3 passed"}]}]

    return turn, client.close


def litellm_completion(base: str) -> tuple[Turn, Callable[[], Awaitable[None]]]:
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no fetch of its price list
    litellm = pytest.importorskip("litellm", reason="LiteLLM is not installed (pip install litellm)")

    async def turn(c: Convo, history: list[Any] | None = None) -> None:
        msgs = history if history is not None else c.history
        r = await litellm.acompletion(model=f"openai/{MODEL}", api_base=base + "/v1", api_key="x", messages=msgs,
                                      tools=[{"type": "function", "function": BASH}], max_tokens=16,
                                      num_retries=0, timeout=30)
        msg = r.choices[0].message
        assert msg.tool_calls
        if history is None:
            call = msg.tool_calls[0]
            c.history += [{"role": "assistant", "content": msg.content, "tool_calls": [
                {"id": call.id, "type": "function", "function": {"name": call.function.name,
                                                                 "arguments": call.function.arguments}}]},
                          {"role": "tool", "tool_call_id": call.id, "content": "ok: 3 passed"}]

    async def close() -> None:
        return None

    return turn, close


HARNESSES: dict[str, tuple[str, Callable[[str], tuple[Turn, Callable[[], Awaitable[None]]]]]] = {
    "openai-chat-tools": ("chat", openai_chat),
    "openai-responses": ("responses", openai_responses),
    "anthropic-messages": ("messages", anthropic_messages),
    "litellm-completion": ("chat", litellm_completion),
}


async def sessions(http: aiohttp.ClientSession, base: str) -> dict[str, dict[str, Any]]:
    async with http.get(base + "/v1/sessions") as r:
        assert r.status == 200
        return {d["id"]: d for d in (await r.json())["data"]}


@pytest.mark.parametrize("harness", list(HARNESSES))
@timed(180)
async def test_agent_harness_without_session_ids(harness: str) -> None:
    api, make = HARNESSES[harness]
    before = asyncio.all_tasks()
    eng = EngineServer(ServerConfig(kv_pool=400_000, time_scale=SCALE))
    eng_port = await eng.start("127.0.0.1", 0)
    gw = Gateway(GatewayConfig(upstream=f"http://127.0.0.1:{eng_port}", control="budgeter", time_scale=SCALE,
                               idle_timeout_s=100_000.0))
    http = aiohttp.ClientSession()
    close: Callable[[], Awaitable[None]] | None = None
    try:
        base = f"http://127.0.0.1:{await gw.start('127.0.0.1', 0)}"
        turn, close = make(base)
        convos = [Convo(api, i) for i in range(CONVERSATIONS)]

        async def agent(c: Convo) -> None:
            for _ in range(TURNS):
                await turn(c, None)

        await asyncio.gather(*(agent(c) for c in convos))
        rows = await sessions(http, base)
        assert len(rows) == CONVERSATIONS, rows
        assert all(d["source"] == "lineage" and d["turns"] == TURNS for d in rows.values()), rows
        assert all(d["context_tokens"] > 1000 and d["demand_tokens"] > d["context_tokens"] or d["state"] == "released"
                   for d in rows.values()), rows
        by_context = {d["id"]: d for d in rows.values()}

        # a fork: the latest history of conversation 0, continued two ways
        fork_a = convos[0].history + [{"role": "user", "content": "Now try approach A."}]
        fork_b = convos[0].history + [{"role": "user", "content": "Now try approach B instead."}]
        await turn(convos[0], fork_a)
        await turn(convos[0], fork_b)
        rows = await sessions(http, base)
        assert len(rows) == CONVERSATIONS + 1
        child = [d for d in rows.values() if d["id"] not in by_context]
        assert len(child) == 1 and child[0]["parent"] in by_context and child[0]["turns"] == 1
        assert rows[child[0]["parent"]]["turns"] == TURNS + 1

        # a compaction keeps its session and says so
        await turn(convos[1], convos[1].compacted())
        rows = await sessions(http, base)
        assert len(rows) == CONVERSATIONS + 1
        rewritten = [d for d in rows.values() if d["rewrites"] == 1]
        assert len(rewritten) == 1 and rewritten[0]["turns"] == TURNS + 1

        # silence: the budget is set to what the silent sessions hold; a newcomer waits for them to leave D
        d_now = gw.policy.demand
        c_pool = gw.kv_pool
        async with http.post(base + "/admin/control", json={"control": "budgeter", "opts": {
                "low": (d_now + 200) / c_pool, "high": min(0.99, 2 * (d_now + 200) / c_pool)}}) as r:
            assert r.status == 200
        bound = gw.summary()["release_after_s"]
        assert bound < 10_000.0  # learnt from the think times, far below the idle timeout
        newcomer = Convo(api, 99)
        waits = gw.fleet.waits
        released_before = gw.session_ends["released"]  # (a loaded machine may reach the bound before the newcomer)
        t0 = gw.now()
        await turn(newcomer, None)
        waited = gw.now() - t0
        # it was held: the silent sessions filled the budget (unless one had left D before it came)
        assert gw.fleet.waits == waits + 1 or released_before > 0, (waits, released_before)
        assert gw.summary()["released"] >= 1 and gw.session_ends["released"] >= 1
        assert waited <= bound + 0.5 * SCALE  # admitted within the bound (plus a timer tick of real time)
        rows = await sessions(http, base)
        assert len(rows) == CONVERSATIONS + 2
        a = gw.audit()
        assert a["demand"] == a["admitted_demand"] and a["held"] == a["in_flight"] == 0, a
    finally:
        if close is not None:
            await close()
        await http.close()
        await gw.stop()
        await eng.stop()
    for _ in range(500):
        if not (asyncio.all_tasks() - before - {asyncio.current_task()}):
            break
        await asyncio.sleep(0.01)


def test_the_history_a_harness_resends_is_json() -> None:
    c = Convo("messages", 1)
    assert json.loads(json.dumps(c.compacted()))[0]["content"] == c.task
