"""What a client sends that the gateway must answer itself, in the OpenAI error shape, rather than guess at or relay:
a session header sent twice with different values, a body in a content coding, a method a path of the gateway's
own does not take, a turn's path with an encoded slash, a request no source names under ``--require-session``
(lineage follows conversations and names none), and an upstream's refusal that is not JSON."""

from __future__ import annotations

from multidict import CIMultiDict
from yarl import URL

from support.aio import timed
from support.fake_upstream import post, stack

CHAT = {"model": "m", "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 4}


def _error(body: object, kind: str) -> None:
    assert isinstance(body, dict) and body["error"]["type"] == kind, body


@timed(15)
async def test_a_session_header_twice_with_different_values_is_refused() -> None:
    async with stack(kv_pool=100_000) as (up, gw, client, base):
        url = base + "/v1/chat/completions"
        for name, values in (("X-Session-ID", ("s1", "s2")), ("X-Session-ID", ("s1", "")),
                             ("X-Session-End", ("true", "false"))):
            headers = CIMultiDict([("Content-Type", "application/json"), ("X-Session-ID", "s0")])
            if name == "X-Session-ID":
                headers.popall("X-Session-ID")
            for v in values:
                headers.add(name, v)
            async with client.post(url, json=CHAT, headers=headers) as r:
                assert r.status == 400, (name, values)
                _error(await r.json(), "ClientError")
        assert not up.seen and gw.requests == 3
        # the same value twice says one thing: served
        headers = CIMultiDict([("X-Session-ID", "s1"), ("X-Session-ID", "s1")])
        async with client.post(url, json=CHAT, headers=headers) as r:
            assert r.status == 200 and r.headers["X-Kvgate-Session"] == "s1"


@timed(15)
async def test_a_body_in_a_content_coding_is_refused_before_it_is_read() -> None:
    async with stack(kv_pool=100_000) as (up, gw, client, base):
        status, body, _ = await post(client, base + "/v1/chat/completions", CHAT, "S", **{"Content-Encoding": "gzip"})
        assert status == 415
        _error(body, "UnsupportedMediaType")
        assert not up.seen
        status, _, _ = await post(client, base + "/v1/chat/completions", CHAT, "S", **{"Content-Encoding": "identity"})
        assert status == 200


@timed(15)
async def test_a_method_the_gateways_own_path_does_not_take_is_405_and_never_relayed() -> None:
    async with stack(kv_pool=100_000) as (up, gw, client, base):
        for method, path, allow in (("GET", "/v1/chat/completions", "POST"), ("PUT", "/admin/control", "GET, POST"),
                                    ("DELETE", "/kvgate/info", "GET"), ("POST", "/v1/sessions", "GET"),
                                    ("GET", "/v1/sessions/abc", "DELETE")):
            async with client.request(method, base + path) as r:
                assert r.status == 405 and r.headers["Allow"] == allow, (method, path)
                _error(await r.json(), "MethodNotAllowed")
        for path in ("/v1/sessions/", "/v1/sessions/a%2Fb", "/v1/sessions/del1/"):
            async with client.delete(URL(base + path, encoded=True)) as r:
                assert r.status == 404, path
                _error(await r.json(), "NotFound")
        assert not up.seen  # none of them reached the engine


@timed(15)
async def test_a_turn_path_with_an_encoded_slash_goes_upstream_as_the_turns_path() -> None:
    async with stack(kv_pool=100_000) as (up, gw, client, base):
        async with client.post(URL(base + "/v1/chat%2Fcompletions?x=1", encoded=True), json=CHAT,
                               headers={"X-Session-ID": "S"}) as r:
            assert r.status == 200
        assert up.seen[-1]["path"] == "/v1/chat/completions" and gw.turns["finished"] == 1


@timed(15)
async def test_require_session_refuses_what_only_lineage_would_follow() -> None:
    async with stack(kv_pool=100_000, require_session=True) as (up, gw, client, base):
        url = base + "/v1/chat/completions"
        status, body, _ = await post(client, url, CHAT)  # (--session-from auto: lineage among the sources)
        assert status == 400 and "session id is required" in body["error"]["message"]
        assert "lineage" not in body["error"]["message"]
        status, _, _ = await post(client, url, CHAT, "S")
        assert status == 200 and not gw.audit()["unknown"]


@timed(15)
async def test_an_upstreams_refusal_that_is_not_json_comes_back_in_the_error_shape() -> None:
    async with stack(kv_pool=100_000) as (up, gw, client, base):
        # a header the gateway takes (it is under its 64 KiB) and the upstream's server does not (8,190 bytes a line)
        status, body, r = await post(client, base + "/v1/chat/completions", CHAT, "S", **{"X-Long": "a" * 10_000})
        assert status == 400 and r.headers["Content-Type"].startswith("application/json")
        _error(body, "UpstreamError")
        assert body["error"]["message"].startswith("the upstream answered 400")
        assert gw.audit()["demand"] == gw.audit()["admitted_demand"]
