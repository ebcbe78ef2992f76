"""Bad input at the front door: deep and huge message lists, 10,000 sessions sharing one system prompt, replayed
and reordered histories, malformed Responses and Messages bodies. Each gets a 4xx with a JSON body or a (new)
session — never a 500, a hang or a leak — and D equals the true admitted sum after each case."""

from __future__ import annotations

import asyncio
import json
from typing import Any

from kvgate.http.limits import ServerLimits
from support.aio import timed
from support.fake_upstream import check_clean, post, stack

SYSTEM = {"role": "system", "content": "You are a coding agent. " * 200}


def chat(msgs: list[Any]) -> dict[str, Any]:
    return {"model": "m", "messages": msgs, "max_tokens": 8}


@timed(60)
async def test_deep_and_huge_message_lists() -> None:
    limits = ServerLimits(max_body_nodes=200_000)  # (100,000 messages: over the default cap, read off the loop)
    async with stack(kv_pool=10**9, max_body_bytes=64 << 20, server_limits=limits) as (up, gw, client, base):
        url = base + "/v1/chat/completions"
        deep = b'{"model":"m","messages":[{"role":"user","content":' + b"[" * 5000 + b'"x"' + b"]" * 5000 + b"}]}"
        status, err, _ = await post(client, url, deep)
        assert status == 400 and "error" in err  # past the JSON parser's depth: malformed
        deep_ok: Any = "x"
        for _ in range(200):
            deep_ok = [{"type": "text", "text": deep_ok}] if isinstance(deep_ok, str) else [deep_ok]
        status, _, _ = await post(client, url, chat([{"role": "user", "content": deep_ok}]))
        assert status == 200  # odd content reads as empty text: a session, not an error
        huge = [SYSTEM] + [{"role": "user" if i % 2 else "assistant", "content": f"m{i}"} for i in range(100_000)]
        status, _, r = await post(client, url, chat(huge))
        assert status == 200 and r.headers["X-Kvgate-Lineage"] == "new"
        status, _, r = await post(client, url, chat(huge + [{"role": "user", "content": "next"}]))
        assert status == 200 and r.headers["X-Kvgate-Lineage"] == "continue"
        status, err, _ = await post(client, url, b"x" * (65 << 20))
        assert status == 413
        check_clean(gw)


@timed(240)
async def test_ten_thousand_sessions_sharing_one_system_prompt() -> None:
    async with stack(kv_pool=10**12, max_sessions=20_000) as (up, gw, client, base):
        url = base + "/v1/chat/completions"
        sem = asyncio.Semaphore(64)

        async def first(i: int) -> str:
            async with sem:
                status, _, r = await post(client, url, chat([SYSTEM, {"role": "user", "content": f"task {i}"}]))
                assert status == 200
                return r.headers["X-Kvgate-Lineage"]

        kinds = await asyncio.gather(*(first(i) for i in range(10_000)))
        assert kinds.count("new") == 10_000
        assert len(gw.sessions) == 10_000 and gw.summary()["admitted"] == 10_000
        state = gw.sessions_state()
        assert state["lineage"]["sessions"] == 10_000 and state["lineage"]["roots"] == 10_000
        # a second turn of some of them finds each its own session, not another that shares the system prompt
        for i in (0, 4999, 9999):
            msgs = [SYSTEM, {"role": "user", "content": f"task {i}"}, {"role": "assistant", "content": "ok"},
                    {"role": "user", "content": "go on"}]
            status, _, r = await post(client, url, chat(msgs))
            assert status == 200 and r.headers["X-Kvgate-Lineage"] == "continue"
            assert gw.sessions[r.headers["X-Kvgate-Session"]].est.turns == 2
        check_clean(gw)


@timed(60)
async def test_replayed_and_reordered_histories() -> None:
    async with stack(kv_pool=10**9) as (up, gw, client, base):
        url = base + "/v1/chat/completions"
        h: list[Any] = [SYSTEM, {"role": "user", "content": "fix the bug " * 20}]
        hist = [list(h)]
        for k in range(4):
            h += [{"role": "assistant", "content": f"step {k}"}, {"role": "user", "content": f"result {k}"}]
            hist.append(list(h))
        for m in hist:
            status, _, r = await post(client, url, chat(m))
            assert status == 200
        sid = r.headers["X-Kvgate-Session"]
        # the whole conversation replayed from the start: new sessions, never the first one's turns
        for m in hist:
            status, _, r = await post(client, url, chat(m))
            assert status == 200 and r.headers["X-Kvgate-Session"] != sid
        assert gw.sessions[sid].est.turns == 5
        # reordered: a new session
        swapped = [hist[-1][0], hist[-1][3], hist[-1][2], hist[-1][1], *hist[-1][4:]]
        status, _, r = await post(client, url, chat(swapped))
        assert status == 200 and r.headers["X-Kvgate-Session"] != sid
        check_clean(gw)
        a = gw.audit()
        assert a["demand"] == a["admitted_demand"]


@timed(60)
async def test_malformed_responses_and_messages_bodies() -> None:
    async with stack(kv_pool=10**9) as (up, gw, client, base):
        cases: list[tuple[str, Any]] = [
            ("/v1/responses", b"{not json"), ("/v1/responses", [1]), ("/v1/responses", "str"),
            ("/v1/messages", b"\xff\xfe"), ("/v1/messages", None),
        ]
        for path, body in cases:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            status, err, r = await post(client, base + path, data)
            assert status == 400 and r.content_type == "application/json" and err["error"]["message"], (path, err)
        odd: list[tuple[str, Any]] = [
            ("/v1/responses", {"input": 5}), ("/v1/responses", {"input": [None, 3, {"type": "odd"}]}),
            ("/v1/responses", {"input": "x", "instructions": ["not", "text"], "max_output_tokens": "9"}),
            ("/v1/messages", {"messages": "x", "max_tokens": -3}), ("/v1/messages", {"system": {"a": 1}, "messages": [
                {"role": "user", "content": [None, {"type": "tool_result", "content": [1, {"text": 2}]}]}]}),
            ("/v1/responses", {"input": [{"type": "function_call", "arguments": {"not": "a string"}}], "stream": True}),
        ]
        for path, body in odd:  # the gateway forwards what it cannot read as a conversation; never a 500
            status, _, _ = await post(client, base + path, body)
            assert status < 500, (path, body, status)
        check_clean(gw)
        a = gw.audit()
        assert a["demand"] == a["admitted_demand"]


@timed(30)
async def test_count_tokens_passes_through_and_is_no_turn() -> None:
    async with stack(kv_pool=10**9) as (up, gw, client, base):
        body = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
        status, echo, _ = await post(client, base + "/v1/messages/count_tokens", body)
        assert status == 200 and echo["path"] == "/v1/messages/count_tokens"  # the upstream's answer, as it is
        assert gw.requests == 0 and not gw.sessions  # not a turn: no session, no policy event
