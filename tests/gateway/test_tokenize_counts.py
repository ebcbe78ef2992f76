"""A start-over's ``/tokenize`` count is kept by the ask's digest and the client key: a conversation sent again by
the same key is counted without asking the engine again, and one key never gets a count another key's asks made
(the time an answer takes would tell one tenant what another has sent)."""

from __future__ import annotations

from typing import Any

from kvgate.gateway import relay as relay_mod
from kvgate.gateway import turns
from support.aio import timed
from support.fake_upstream import FakeUpstream, post, stack


def conversation(tag: str) -> dict[str, Any]:
    return {"model": "m", "max_tokens": 4, "messages": [
        {"role": "system", "content": f"you are agent {tag}"}, {"role": "user", "content": f"task {tag} " * 40}]}


def asks(up: FakeUpstream) -> int:
    return sum(1 for s in up.seen if s.get("path") == "/tokenize")


@timed(60)
async def test_a_conversation_sent_again_is_counted_once_per_client_key() -> None:
    up = FakeUpstream(tokenizes=True)
    async with stack(up, kv_pool=1_000_000, api_keys=("k1", "k2"), admin_token="adm") as (_, gw, client, base):
        url = base + "/v1/chat/completions"
        k1, k2 = {"Authorization": "Bearer k1"}, {"Authorization": "Bearer k2"}
        first, _, _ = await post(client, url, conversation("a"), **k1)
        assert first == 200 and asks(up) == 1  # (a new session: counted by the engine)
        assert (await post(client, url, conversation("a"), **k1))[0] == 200
        assert asks(up) == 1  # the same conversation again, the same key: the kept count
        assert (await post(client, url, conversation("a"), **k2))[0] == 200
        assert asks(up) == 2  # another key sending it: asked again, never the other key's count
        assert (await post(client, url, conversation("a"), **k2))[0] == 200
        assert asks(up) == 2  # and then that key's own count
        assert (await post(client, url, conversation("b"), **k1))[0] == 200
        assert asks(up) == 3  # another conversation: asked
        assert len(gw.fleet.replicas[0].relay.counts) == 3


@timed(60)
async def test_the_kept_counts_are_bounded(monkeypatch: Any) -> None:
    monkeypatch.setattr(relay_mod, "COUNTS_KEPT", 2)
    monkeypatch.setattr(turns, "COUNTS_KEPT", 2)
    up = FakeUpstream(tokenizes=True)
    async with stack(up, kv_pool=1_000_000) as (_, gw, client, base):
        url = base + "/v1/chat/completions"
        for tag in ("a", "b", "c"):
            assert (await post(client, url, conversation(tag)))[0] == 200
        assert asks(up) == 3
        assert (await post(client, url, conversation("a")))[0] == 200
        assert asks(up) == 4  # the least recently used ("a") was dropped when "c" came
        assert (await post(client, url, conversation("c")))[0] == 200
        assert asks(up) == 4
