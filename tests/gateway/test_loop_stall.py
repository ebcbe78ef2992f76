"""No request body holds the gateway's event loop for long (docs/security.md#limits): a large body's pure pass
(its parse, lineage's read of every item, the context estimate) runs on a worker thread, a small body's inline,
and turns still reach the session index, lineage and the upstream in the order they arrived.

The pure pass is instrumented: every chat item read (``chat_parts``) and every item the estimator counts
(``item_chars``) notes the thread it ran on; a ``Pause`` holds the first read of a large body's items until the
test lets it go, so the test can see what the gateway does meanwhile (no wall-clock thresholds: only order and
progress, with hang guards)."""

from __future__ import annotations

import asyncio
import json
import threading
from collections.abc import Callable, Iterator
from typing import Any

import aiohttp
import orjson
import pytest

from kvgate.gateway import estimate
from kvgate.http.dialect import APIS, base
from kvgate.http.limits import NodeCounter, ServerLimits
from support.aio import timed
from support.fake_upstream import FakeUpstream, settle, stack

LARGE = 2000
"""Items of a large body (~600 KB with :func:`chat`: over the default --offload-body-bytes)."""


def chat(n: int, tag: str, size: int = 300) -> bytes:
    """A chat body: a system prompt naming ``tag`` and ``n`` messages of ``size`` characters."""
    msgs = [{"role": "system", "content": f"conversation {tag}"}]
    msgs += [{"role": "user" if i % 2 == 0 else "assistant", "content": f"{tag} {i} ".ljust(size, "x")}
             for i in range(n)]
    return json.dumps({"model": "m", "messages": msgs, "max_tokens": 4}).encode()


def tiny(n: int) -> bytes:
    msgs = [{"role": "system", "content": "conversation cap"}] + [{"role": "user", "content": "a"}] * n
    return json.dumps({"model": "m", "messages": msgs}, separators=(",", ":")).encode()


def at_cap(cap: int) -> bytes:
    """A body of one-character messages with as many nodes as ``cap`` allows (less two messages' worth)."""
    def nodes(n: int) -> int:
        c = NodeCounter(1 << 60, exact=True)
        c.feed(tiny(n))
        return c.nodes

    a = (nodes(8000) - nodes(0)) / 8000  # (nodes a message)
    return tiny(int((cap - nodes(0)) / a) - 2)


class Threads:
    """The threads the instrumented reads ran on, and an optional pause of the first read after :meth:`arm`."""

    def __init__(self) -> None:
        self.parts: set[str] = set()
        self.estimate: set[str] = set()
        self.armed = False
        self.paused = threading.Event()
        self.go = threading.Event()
        self.waited_out = False
        """The pause ended by its hang guard, not by the test: nothing could run while the read held."""

    def arm(self) -> None:
        self.armed = True

    def wrap(self, fn: Callable[..., Any], seen: set[str]) -> Callable[..., Any]:
        def read(*args: Any) -> Any:
            seen.add(threading.current_thread().name)
            if self.armed:
                self.armed = False
                self.paused.set()
                self.waited_out = not self.go.wait(10)  # (a hang guard: the test lets it go)
            return fn(*args)

        return read

    def clear(self) -> None:
        self.parts.clear()
        self.estimate.clear()


@pytest.fixture
def threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[Threads]:
    t = Threads()
    monkeypatch.setattr(base, "chat_parts", t.wrap(base.chat_parts, t.parts))
    monkeypatch.setattr(estimate, "item_chars", t.wrap(estimate.item_chars, t.estimate))
    yield t
    t.go.set()


def turns(up: FakeUpstream) -> list[dict[str, Any]]:
    """The chat turns the upstream was sent (not the estimator's ``/tokenize`` asks), in order."""
    return [s for s in up.seen if s.get("path") == "/v1/chat/completions"]


async def send(client: aiohttp.ClientSession, base_url: str, body: bytes, sid: str | None = None) -> int:
    headers = {"Content-Type": "application/json", **({"X-Session-ID": sid} if sid else {})}
    async with client.post(base_url + "/v1/chat/completions", data=body, headers=headers) as r:
        await r.read()
        return r.status


async def info(client: aiohttp.ClientSession, base_url: str) -> int:
    async with client.get(base_url + "/kvgate/info", timeout=aiohttp.ClientTimeout(total=10)) as r:
        await r.read()
        return r.status


async def paused(t: Threads) -> None:
    """Until the instrumented read is paused (polled off the loop: the read may hold it)."""
    assert await asyncio.to_thread(t.paused.wait, 20), "the large body's items were never read"


@timed(60)
async def test_a_large_body_is_read_and_estimated_on_a_worker_thread(threads: Threads) -> None:
    async with stack(kv_pool=10**9) as (up, _, client, url):
        assert await send(client, url, chat(LARGE, "big"), "s") == 200
        loop_thread = threading.current_thread().name
        assert threads.parts and loop_thread not in threads.parts, threads.parts
        assert threads.estimate and loop_thread not in threads.estimate, threads.estimate
        assert [len(s["body"]["messages"]) for s in turns(up)] == [LARGE + 1]


@timed(60)
async def test_a_small_body_is_read_inline(threads: Threads) -> None:
    async with stack(kv_pool=10**9) as (_, _, client, url):
        body = chat(3, "small")
        assert len(body) < 2048
        assert await send(client, url, body, "s") == 200
        assert threads.parts == {threading.current_thread().name} == threads.estimate


@timed(60)
async def test_the_gateway_answers_while_a_body_at_the_node_cap_is_read(threads: Threads) -> None:
    """A body just under --max-body-nodes: /kvgate/info is answered while its items are being read, before it
    is sent upstream (with its read on the loop, the info request would wait behind it)."""
    cap = ServerLimits().max_body_nodes
    body = at_cap(cap)
    assert NodeCounter(cap).feed(body)  # (just under it)
    n = len(json.loads(body)["messages"])
    async with stack(kv_pool=10**9) as (up, _, client, url):
        threads.arm()
        big = asyncio.create_task(send(client, url, body))
        await paused(threads)
        try:
            assert await info(client, url) == 200
            assert not up.seen  # (the big body is still being read)
        finally:
            threads.go.set()
        assert await big == 200
        assert not threads.waited_out  # (the answer came while the read was held, not after)
        assert [len(s["body"]["messages"]) for s in turns(up)] == [n]


@timed(60)
async def test_turns_of_one_session_go_upstream_in_the_order_they_arrived(threads: Threads) -> None:
    """A large turn then a small one of the same session: the small one is read at once but waits for the large
    one to enter the session first (as when both were read on the loop)."""
    async with stack(kv_pool=10**9) as (up, gw, client, url):
        threads.arm()
        first = asyncio.create_task(send(client, url, chat(LARGE, "one"), "s"))
        await paused(threads)
        second = asyncio.create_task(send(client, url, chat(2, "two"), "s"))
        gate = gw._path.bodies.gate
        try:
            await settle(lambda: gate.queued == 2)  # (both arrived; the second waits for the first)
            assert not up.seen
        finally:
            threads.go.set()
        assert await first == 200 and await second == 200
        assert [len(s["body"]["messages"]) for s in turns(up)] == [LARGE + 1, 3]


@timed(60)
async def test_lineage_resolves_turns_in_the_order_they_arrived(threads: Threads) -> None:
    """No session ids: a conversation's first turn (large) and, while it is being read, its next turn. The next
    is resolved after the first entered its session (a fork: that session is busy upstream), never before it
    (when it would start the conversation's session itself)."""
    up = FakeUpstream()
    up.delay_s = 0.5  # (the first turn is still upstream when the second resolves)
    first_body = chat(LARGE, "lin")
    msgs = json.loads(first_body)["messages"]
    second_body = json.dumps({"model": "m", "messages": [*msgs, {"role": "assistant", "content": "ok"},
                                                          {"role": "user", "content": "more"}]}).encode()
    async with stack(up, kv_pool=10**9) as (_, gw, client, url):
        threads.arm()
        first = asyncio.create_task(send(client, url, first_body))
        await paused(threads)
        second = asyncio.create_task(send(client, url, second_body))
        try:
            await settle(lambda: gw._path.bodies.gate.queued == 2)
        finally:
            threads.go.set()
        assert await first == 200 and await second == 200
        counts = gw._sessions.lineage.counts
        assert (counts["new"], counts["fork"]) == (1, 1), counts
        assert [len(s["body"]["messages"]) for s in turns(up)] == [LARGE + 1, LARGE + 3]


@timed(60)
async def test_a_refused_or_malformed_large_body_lets_the_next_turn_in() -> None:
    async with stack(kv_pool=10**9, server_limits=ServerLimits()) as (_, gw, client, url):
        bad = b'{"model": "m", "messages": [' + b'{"role": "user", "content": "aaaa"},' * 20000 + b"]"
        assert len(bad) > 256 << 10
        async with client.post(url + "/v1/chat/completions", data=bad,
                               headers={"Content-Type": "application/json"}) as r:
            assert r.status == 400 and "malformed JSON" in (await r.json())["error"]["message"]
        assert await send(client, url, chat(2, "after"), "s") == 200
        assert gw._path.bodies.gate.queued == 0


def test_the_tokenize_ask_is_encoded_as_one_call_would() -> None:
    """The ``/tokenize`` ask of a start-over, encoded a few hundred messages at a time off the loop, is the bytes
    ``orjson.dumps`` makes of it in one call."""
    from kvgate.gateway.bodies import ENCODE_ITEMS, tokenize_ask  # (here: the other tests run on any version)

    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    for n in (1, ENCODE_ITEMS - 1, ENCODE_ITEMS, ENCODE_ITEMS + 1, 3 * ENCODE_ITEMS + 7):
        items = [{"role": "user" if i % 2 else "assistant", "content": f"m{i}"} for i in range(n)]
        body = {"model": "m", "messages": items, "input": items, "tools": tools}
        for api in (APIS["chat"], APIS["responses"], APIS["messages"]):
            ask = estimate.tokenize_body(api, body)
            assert ask is not None
            assert tokenize_ask(api, body) == orjson.dumps(ask), (api.name, n)


def _script() -> list[tuple[str, dict[str, Any], str | None]]:
    """Turns of every API, named and not: conversations that go on, a compaction, a fork, a replay, prompts."""
    def grow(msgs: list[dict[str, Any]], k: int) -> list[dict[str, Any]]:
        return [*msgs, {"role": "assistant", "content": f"answer {k} " * 20}, {"role": "user", "content": f"go on {k}"}]

    a = [{"role": "system", "content": "You are an agent. " * 30}, {"role": "user", "content": "task A " * 40}]
    turns: list[tuple[str, dict[str, Any], str | None]] = []
    for k in range(3):
        turns.append(("/v1/chat/completions", {"model": "m", "messages": a, "max_tokens": 4}, None))
        a = grow(a, k)
    turns.append(("/v1/chat/completions", {"model": "m", "messages": a[:2] + a[-2:], "max_tokens": 4}, None))
    turns.append(("/v1/chat/completions", {"model": "m", "messages": grow(a[:4], 9), "max_tokens": 4}, None))
    turns.append(("/v1/chat/completions", {"model": "m", "messages": a[:2], "max_tokens": 4}, None))
    n = [{"role": "user", "content": "named task " * 30}]
    for k in range(2):
        turns.append(("/v1/chat/completions", {"model": "m", "messages": n, "max_tokens": 4}, "n1"))
        n = grow(n, k)
    r: list[dict[str, Any]] = [{"role": "user", "content": "responses task " * 30}]
    for k in range(2):
        turns.append(("/v1/responses", {"model": "m", "instructions": "Be brief. " * 20, "input": r,
                                        "max_output_tokens": 4}, None))
        r = [*r, {"type": "function_call", "call_id": f"c{k}", "name": "bash", "arguments": "{}"},
             {"type": "function_call_output", "call_id": f"c{k}", "output": f"out {k} " * 30}]
    m: list[dict[str, Any]] = [{"role": "user", "content": [{"type": "text", "text": "messages task " * 30}]}]
    for k in range(2):
        turns.append(("/v1/messages", {"model": "m", "system": "Be exact. " * 20, "messages": m,
                                       "max_tokens": 4}, None))
        m = [*m, {"role": "assistant", "content": [{"type": "text", "text": f"done {k}"}]},
             {"role": "user", "content": [{"type": "text", "text": f"next {k} " * 10}]}]
    p = "Once upon a time " * 40
    for k in range(2):
        turns.append(("/v1/completions", {"model": "m", "prompt": p, "max_tokens": 4}, None))
        p += f" and then {k} " * 30
    return turns


async def _run_script(offload: int) -> tuple[Any, ...]:
    async with stack(kv_pool=10**9, offload_body_bytes=offload) as (up, gw, client, url):
        for path, body, sid in _script():
            headers = {"Content-Type": "application/json", **({"X-Session-ID": sid} if sid else {})}
            async with client.post(url + path, data=json.dumps(body).encode(), headers=headers) as r:
                assert r.status == 200, await r.text()
                await r.read()
        sessions = sorted((str(s.sid), s.name.source, s.name.label, s.name.parent, s.est.turns, s.est.context,
                           s.est.known_tokens, s.est.sent_len, s.cache.rewrites, s.est.kind, s.cache.note)
                          for s in gw.sessions.values())
        sent = [(s["path"], s.get("raw", s["body"])) for s in up.seen]
        return dict(gw._sessions.lineage.counts), sessions, sent, gw._path.bodies.offloaded


@timed(120)
async def test_every_body_read_off_the_loop_resolves_and_estimates_as_inline() -> None:
    """The same turns (every API, named and not, a compaction, a fork, a replay, prompts), one gateway reading every
    body off the loop (``--offload-body-bytes 0``), one reading every body inline: the same sessions, the same
    lineage verdicts, the same estimates, the same requests upstream."""
    off = await _run_script(0)
    inline = await _run_script(1 << 30)
    assert off[3] == len(_script()) and inline[3] == 0
    assert off[:3] == inline[:3]
    assert off[0]["continue"] >= 3 and off[0]["rewrite"] >= 1 and off[0]["fork"] + off[0]["replay"] >= 1, off[0]


@timed(60)
async def test_a_flat_array_of_numbers_counts_against_the_node_cap() -> None:
    """Scalars count 1/8 of a node: a flat array of small numbers (no object or array in it but one) of 8 x the cap
    is 413 as it arrives, never parsed; a 128k-token id prompt is served."""
    cap = ServerLimits().max_body_nodes
    async with stack(kv_pool=10**9) as (up, _, client, url):
        ids = json.dumps({"model": "m", "prompt": [7] * (8 * cap + 80), "max_tokens": 1}).encode()
        async with client.post(url + "/v1/completions", data=ids, headers={"Content-Type": "application/json"}) as r:
            assert r.status == 413 and "JSON objects and arrays" in (await r.json())["error"]["message"]
        assert not up.seen
        prompt = json.dumps({"model": "m", "prompt": list(range(128_000)), "max_tokens": 1}).encode()
        async with client.post(url + "/v1/completions", data=prompt,
                               headers={"Content-Type": "application/json"}) as r:
            assert r.status == 200
        assert len(up.seen[0]["body"]["prompt"]) == 128_000
