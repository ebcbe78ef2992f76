"""Session resolution (``kvgate.gateway.identity``): every convention of the field, by its real header or body
names, through the gateway in front of a fake engine; subagents as child sessions; ``--session-from``; with two
client keys, one client cannot reach the other's session."""

from __future__ import annotations

from typing import Any

import pytest
from multidict import CIMultiDict

from kvgate.errors import UsageError
from kvgate.gateway.identity import SOURCES, Resolver, parse_session_from, scoped
from support.aio import timed
from support.fake_upstream import post, stack

CHAT = {"model": "m", "messages": [{"role": "user", "content": "fix the failing test " * 20}], "max_tokens": 4}


async def listing(client: Any, base: str) -> dict[str, dict[str, Any]]:
    async with client.get(base + "/v1/sessions") as r:
        assert r.status == 200
        return {d["id"]: d for d in (await r.json())["data"]}


def test_every_convention_read_from_a_request() -> None:
    r = Resolver(SOURCES, "X-Session-ID")
    cases: list[tuple[dict[str, str], dict[str, Any], tuple[str, str, str | None]]] = [
        ({"X-Session-ID": "k1"}, {}, ("k1", "header", None)),
        ({"X-Session-Id": "oc-1"}, {}, ("oc-1", "header", None)),  # opencode's spelling: the same header
        ({"X-Session-Id": "oc-2", "x-parent-session-id": "oc-1"}, {}, ("oc-2", "header", "oc-1")),  # its subagent
        ({}, {"session_id": "v1"}, ("v1", "body", None)),
        ({"x-claude-code-session-id": "cc"}, {}, ("cc", "claude-code", None)),
        ({"x-claude-code-session-id": "cc", "x-claude-code-agent-id": "a7"}, {}, ("cc/agent:a7", "claude-code", "cc")),
        ({"x-claude-code-session-id": "cc", "x-claude-code-agent-id": "a8", "x-claude-code-parent-agent-id": "a7"}, {},
         ("cc/agent:a8", "claude-code", "cc/agent:a7")),
        ({"thread-id": "t1", "session-id": "cache-key"}, {}, ("t1", "codex", None)),
        ({"thread-id": "t2", "x-codex-parent-thread-id": "t1"}, {}, ("t2", "codex", "t1")),
        ({"thread-id": "t3", "x-codex-turn-metadata": '{"forked_from_thread_id": "t1"}'}, {}, ("t3", "codex", "t1")),
        ({"x-session-affinity": "o1", "x-parent-session-id": "o0"}, {}, ("o1", "opencode", "o0")),
        ({"x-litellm-session-id": "l1"}, {}, ("l1", "litellm", None)),
        ({"x-dynamo-session-id": "d1"}, {}, ("d1", "dynamo", None)),
        ({}, {"metadata": {"user_id": "user_ab12_account_9f0e_session_5c1d-77"}}, ("5c1d-77", "anthropic", None)),
        ({}, {"metadata": {"user_id": '{"device_id": "d", "session_id": "s-json"}'}}, ("s-json", "anthropic", None)),
        ({}, {"prompt_cache_key": "conv-9"}, ("conv-9", "prompt-cache-key", None)),
        ({}, {"user": "u1"}, ("u1", "user", None)),
    ]
    for headers, body, want in cases:
        got = r.named(CIMultiDict(headers), body)
        assert got is not None and (got.sid, got.source, got.parent) == want, (headers, body, got)
    # a session-id header alone is Codex's cache key (forks reuse it): it names nothing
    assert r.named(CIMultiDict({"session-id": "cache-key"}), {}) is None
    codex = r.named(CIMultiDict({"thread-id": "t", "x-codex-turn-metadata": '{"request_kind": "compaction"}'}), {})
    assert codex is not None and codex.compaction
    # odd values name nothing: too long, not printable, not text, metadata without a session
    for body in ({"session_id": "x" * 300}, {"session_id": "a\nb"}, {"session_id": ["x"]},
                 {"metadata": {"user_id": "user_1"}}, {"metadata": "x"}, {"prompt_cache_key": 7.5}):
        assert r.named(CIMultiDict(), body) is None, body


def test_the_order_is_the_documented_precedence_and_session_from_picks() -> None:
    h = CIMultiDict({"X-Session-ID": "k", "x-claude-code-session-id": "cc", "thread-id": "t"})
    body = {"session_id": "b", "user": "u"}
    assert Resolver(SOURCES, "X-Session-ID").named(h, body).sid == "k"  # type: ignore[union-attr]
    assert Resolver(parse_session_from("codex,header"), "X-Session-ID").named(h, body).sid == "t"  # type: ignore
    assert Resolver(parse_session_from("user"), "X-Session-ID").named(h, body).sid == "u"  # type: ignore[union-attr]
    assert Resolver(parse_session_from("lineage"), "X-Session-ID").named(h, body) is None
    assert parse_session_from("auto") == SOURCES and SOURCES[-1] == "lineage" and SOURCES[0] == "header"
    for bad in ("header,nope", "header,header"):
        with pytest.raises(UsageError, match="--session-from"):
            parse_session_from(bad)
    assert scoped("s", None) == "s" and scoped("s", 1) == "s@k1"


@timed(20)
@pytest.mark.parametrize("headers,body,sid,source", [
    ({"X-Session-ID": "kv-1"}, {}, "kv-1", "header"),
    ({"x-claude-code-session-id": "cc-1"}, {}, "cc-1", "claude-code"),
    ({"thread-id": "th-1", "session-id": "shared-cache-key"}, {}, "th-1", "codex"),
    ({"x-session-affinity": "oc-1"}, {}, "oc-1", "opencode"),
    ({"x-litellm-session-id": "ll-1"}, {}, "ll-1", "litellm"),
    ({"x-dynamo-session-id": "dy-1"}, {}, "dy-1", "dynamo"),
    ({}, {"metadata": {"user_id": "user_5e_account_11_session_an-1"}}, "an-1", "anthropic"),
    ({}, {"prompt_cache_key": "pk-1"}, "pk-1", "prompt-cache-key"),
    ({}, {"session_id": "vb-1"}, "vb-1", "body"),
])
async def test_each_convention_names_one_session_through_the_gateway(
    headers: dict[str, str], body: dict[str, Any], sid: str, source: str
) -> None:
    async with stack(kv_pool=1_000_000) as (up, gw, client, base):
        for k in range(3):  # three turns of one conversation
            msgs = CHAT["messages"] + [{"role": "user", "content": f"turn {k}"}]
            status, _, r = await post(client, base + "/v1/chat/completions", {**CHAT, **body, "messages": msgs},
                                      **headers)
            assert status == 200 and r.headers["X-Kvgate-Session"] == sid
        rows = await listing(client, base)
        assert list(rows) == [sid] and rows[sid]["source"] == source and rows[sid]["turns"] == 3
        assert rows[sid]["state"] == "thinking" and rows[sid]["demand_tokens"] > 0
        assert up.seen[-1]["headers"]["X-Session-ID"] == sid  # the engine names what it caches by it


@timed(20)
async def test_subagents_are_child_sessions_of_their_parent() -> None:
    async with stack(kv_pool=1_000_000) as (up, gw, client, base):
        url = base + "/v1/chat/completions"
        await post(client, url, CHAT, **{"x-claude-code-session-id": "main"})
        await post(client, url, CHAT, **{"x-claude-code-session-id": "main", "x-claude-code-agent-id": "explore"})
        await post(client, url, CHAT, **{"x-claude-code-session-id": "main", "x-claude-code-agent-id": "grep",
                                         "x-claude-code-parent-agent-id": "explore"})
        await post(client, url, CHAT, **{"thread-id": "sub", "x-codex-parent-thread-id": "root-thread"})
        await post(client, url, CHAT, **{"x-session-affinity": "oc-child", "x-parent-session-id": "oc-main"})
        rows = await listing(client, base)
        assert rows["main"]["parent"] is None
        assert rows["main/agent:explore"]["parent"] == "main"
        assert rows["main/agent:grep"]["parent"] == "main/agent:explore"
        assert rows["sub"]["parent"] == "root-thread" and rows["oc-child"]["parent"] == "oc-main"
        assert gw.summary()["admitted"] == 5  # each its own session, its own demand


@timed(20)
async def test_with_two_client_keys_one_client_cannot_reach_the_others_session() -> None:
    async with stack(kv_pool=1_000_000, api_keys=("key-a", "key-b"), admin_token="adm") as (up, gw, client, base):
        url = base + "/v1/chat/completions"
        a = {"Authorization": "Bearer key-a"}
        b = {"Authorization": "Bearer key-b"}
        await post(client, url, CHAT, "same-id", **a)
        await post(client, url, CHAT, "same-id", **b)
        await post(client, url, CHAT, "same-id", **b)
        assert set(gw.sessions) == {"same-id@k0", "same-id@k1"}
        assert gw.sessions["same-id@k0"].est.turns == 1 and gw.sessions["same-id@k1"].est.turns == 2
        assert up.seen[-1]["headers"]["X-Session-ID"] == "same-id@k1"
        # the same conversation without ids from both keys: two lineage sessions, never one
        await post(client, url, CHAT, **a)
        await post(client, url, CHAT, **b)
        lineage = [s for s in gw.sessions.values() if s.name.source == "lineage"]
        assert sorted(s.name.client for s in lineage) == [0, 1]  # type: ignore[type-var]
        # B ends "its" session: A's stays
        async with client.delete(base + "/v1/sessions/same-id", headers=b) as r:
            assert r.status == 200
        assert "same-id@k0" in gw.sessions and "same-id@k1" not in gw.sessions
        async with client.delete(base + "/v1/sessions/same-id", headers=b) as r:
            assert r.status == 404  # B cannot find A's
        async with client.delete(base + "/v1/sessions/same-id") as r:
            assert r.status == 401
        async with client.get(base + "/v1/sessions", headers=a) as r:
            assert r.status == 401  # a client key is not the admin token
        admin = {"Authorization": "Bearer adm"}
        rows = [d for d in (await (await client.get(base + "/v1/sessions", headers=admin)).json())["data"]]
        assert {(d["id"], d["client"]) for d in rows if d["source"] == "header"} == {("same-id", 0)}
