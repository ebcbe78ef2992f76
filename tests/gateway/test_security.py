"""The gateway's admin surface and its tenants (docs/security.md): without client keys admin stays loopback-only and
refuses what only a web page sends (a foreign Origin, a non-JSON state change, a Host not the gateway's); with keys
the admin endpoints and the engine's admin paths need the admin token, a client key reaches only what agents ask,
and each key gets its own prefix cache upstream (``cache_salt``), down to ``kvgate engine``'s."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvgate.cli import main
from kvgate.errors import UsageError
from kvgate.gateway import Gateway, GatewayConfig
from kvgate.gateway.config import read_api_keys
from kvgate.serve.app import EngineServer
from kvgate.serve.config import ServerConfig
from support.aio import timed
from support.fake_upstream import post, stack

ADMIN = {"Authorization": "Bearer adm"}
K1 = {"Authorization": "Bearer k1"}
K2 = {"Authorization": "Bearer k2"}


async def status_of(client: aiohttp.ClientSession, method: str, url: str, data: bytes = b"",
                    **headers: str) -> tuple[int, Any]:
    async with client.request(method, url, data=data, headers=headers) as r:
        raw = await r.read()
        return r.status, json.loads(raw) if r.content_type == "application/json" else raw


# -- 1. admin without keys: no cross-site request, no DNS rebinding ---------------------------------------------------
@timed(10)
async def test_a_web_page_cannot_switch_the_control_of_a_loopback_gateway() -> None:
    async with stack(kv_pool=1000, control="budgeter") as (up, gw, client, base):
        url = base + "/admin/control"
        body = b'{"control":"none"}'
        # the cross-site "simple" POST: text/plain, a foreign Origin
        st, err = await status_of(client, "POST", url, body, **{"Content-Type": "text/plain",
                                                               "Origin": "http://evil.example"})
        assert st == 403 and err["error"]["type"] == "Forbidden"
        st, err = await status_of(client, "POST", url, body, **{"Content-Type": "text/plain"})
        assert st == 415 and err["error"]["type"] == "UnsupportedMediaType"
        assert gw.control.name == "budgeter"
        st, _ = await status_of(client, "GET", base + "/v1/sessions", Origin="http://evil.example")
        assert st == 403
        st, _ = await status_of(client, "POST", base + "/reset_prefix_cache", Origin="http://evil.example")
        assert st == 403 and not up.seen  # the engine's admin path: never relayed
        await post(client, base + "/v1/completions", {"prompt": [1] * 40}, "mine")
        st, _ = await status_of(client, "DELETE", base + "/v1/sessions/mine", Origin="http://evil.example")
        assert st == 403 and "mine" in gw.sessions
        # the gateway's own page (its own origin) and a client that sends no Origin switch it
        st, _ = await status_of(client, "POST", url, body, **{"Content-Type": "application/json",
                                                             "Origin": f"http://127.0.0.1:{gw.port}"})
        assert st == 200 and gw.control.name == "none"


@timed(10)
async def test_a_host_that_is_not_the_gateways_is_421_on_every_path() -> None:
    async with stack(kv_pool=1000, allowed_hosts=("gw.internal",)) as (up, gw, client, base):
        for path in ("/v1/sessions", "/kvgate/info", "/metrics", "/v1/models"):
            st, err = await status_of(client, "GET", base + path, Host=f"evil.example:{gw.port}")
            assert st == 421 and err["error"]["type"] == "MisdirectedRequest", path
        st, _, _ = await post(client, base + "/v1/completions", {"prompt": [1]}, "S",
                              Host=f"rebound.example:{gw.port}")
        assert st == 421 and not up.seen
        for host in (f"localhost:{gw.port}", f"127.0.0.1:{gw.port}", "gw.internal", f"gw.internal:{gw.port}"):
            st, _ = await status_of(client, "GET", base + "/v1/sessions", Host=host)
            assert st == 200, host
        st, _ = await status_of(client, "GET", base + "/v1/sessions", Host="localhost:1")  # another port
        assert st == 421


# -- 2. keys: an empty one is an error; with keys, a token --------------------------------------------------------
def test_an_empty_key_is_one_line_and_exit_2(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    f = tmp_path / "keys"
    f.write_text("# none\n")
    conf = tmp_path / "gw.toml"  # a config file's api-key is a key too (it was once ignored: no auth at all)
    conf.write_text('api-key = ["k1", ""]\n')
    for args, env in ((["--config", str(conf)], None), (["--api-key", ""], None), (["--api-key", " "], None), ([], ""),
                      (["--api-key", "k1"], None),  # keys without an admin token: the admin surface would be open
                      (["--api-key-file", str(f), "--admin-token", "a"], None)):
        if env is None:
            monkeypatch.delenv("KVGATE_API_KEYS", raising=False)
        else:
            monkeypatch.setenv("KVGATE_API_KEYS", env)
        with pytest.raises(SystemExit) as e:
            main(["gateway", "--upstream", "http://127.0.0.1:9", "--kv-pool", "1000", *args])
        err = capsys.readouterr().err
        assert e.value.code == 2 and len(err.strip().splitlines()) == 1 and "Traceback" not in err, (args, err)
    assert "no key in the file" in err
    with pytest.raises(UsageError, match="empty"):
        GatewayConfig(upstream="http://127.0.0.1:9", api_keys=("k1", ""), admin_token="adm").validate()
    with pytest.raises(UsageError, match="differ"):
        GatewayConfig(upstream="http://127.0.0.1:9", api_keys=("k1",), admin_token="k1").validate()
    f.write_text("# tenants\nk1\n\n  k2  \n")
    assert read_api_keys(f) == ("k1", "k2")


@timed(10)
async def test_with_keys_the_admin_endpoints_need_the_token() -> None:
    async with stack(kv_pool=1_000_000, api_keys=("k1", "k2"), admin_token="adm") as (up, gw, client, base):
        await post(client, base + "/v1/completions", {"prompt": [1] * 40}, "mine", **K1)
        for method, path in (("GET", "/v1/sessions"), ("GET", "/admin/control"), ("GET", "/dashboard"),
                             ("GET", "/kvgate/dashboard.json")):
            for who in ({}, K1):
                st, _ = await status_of(client, method, base + path, **who)
                assert st == 401, (path, who)
            st, _ = await status_of(client, method, base + path, **ADMIN)
            assert st == 200, path
        st, _ = await status_of(client, "POST", base + "/admin/control", b'{"control":"none"}',
                                **{**K1, "Content-Type": "application/json"})
        assert st == 401 and gw.control.name == "budgeter"
        # a key cannot end another key's session; the admin ends any by the id the listing shows
        st, _ = await status_of(client, "DELETE", base + "/v1/sessions/mine", **K2)
        assert st == 404 and "mine@k0" in gw.sessions
        st, _ = await status_of(client, "DELETE", base + "/v1/sessions/mine@k0", **ADMIN)
        assert st == 200 and "mine@k0" not in gw.sessions


# -- 3. each key its own prefix cache ---------------------------------------------------------------------------
@timed(10)
async def test_each_key_gets_its_own_cache_salt_never_the_key() -> None:
    async with stack(kv_pool=1_000_000, api_keys=("k1", "k2"), admin_token="adm") as (up, gw, client, base):
        url = base + "/v1/chat/completions"
        chat = {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        await post(client, url, chat, "a", **K1)
        await post(client, url, {**chat, "stream": True}, "b", **K1)
        await post(client, url, {**chat, "cache_salt": "guessed"}, "c", **K2)  # replaced, never trusted
        bodies = [s["body"] for s in up.seen if s["path"] == "/v1/chat/completions"]
        salts = [b["cache_salt"] for b in bodies]
        assert salts[0] == salts[1] != salts[2] and all(len(s) == 32 and "k" not in s for s in salts)
        assert bodies[1]["stream_options"] == {"include_usage": True}  # both splices kept
    async with stack(kv_pool=1_000_000, api_keys=("k1", "k2"), admin_token="adm",
                     shared_prefix_cache=True) as (up, gw, client, base):
        await post(client, base + "/v1/completions", {"prompt": [1, 2]}, "a", **K1)
        assert "cache_salt" not in up.seen[0]["body"]
    async with stack(kv_pool=1_000_000) as (up, gw, client, base):  # no keys: one tenant, nothing added
        await post(client, base + "/v1/completions", {"prompt": [1, 2]}, "a")
        assert "cache_salt" not in up.seen[0]["body"]


@timed(30)
async def test_through_the_gateway_kvgate_engine_keeps_keys_prompts_apart() -> None:
    eng = EngineServer(ServerConfig(kv_pool=20_000, time_scale=1000.0))
    eng_port = await eng.start("127.0.0.1", 0)
    gw = Gateway(GatewayConfig(upstream=f"http://127.0.0.1:{eng_port}", api_keys=("k1", "k2"), admin_token="adm",
                               time_scale=1000.0, default_max_tokens=4))
    prompt = list(range(100, 916))  # 816 tokens, the prompt length
    try:
        port = await gw.start("127.0.0.1", 0)
        url = f"http://127.0.0.1:{port}/v1/completions"
        async with aiohttp.ClientSession() as client:
            async def cached(key: dict[str, str], sid: str) -> int:
                st, out, _ = await post(client, url, {"prompt": prompt, "max_tokens": 4}, sid, **key)
                assert st == 200, out
                return int(out["usage"]["prompt_tokens_details"]["cached_tokens"])

            first = await cached(K1, "s1")
            again = await cached(K1, "s1b")  # the same key, another session: its own cache
            other = await cached(K2, "s2")  # key 2 sends key 1's prompt
            assert (first, other) == (0, 0) and again >= 800, (first, again, other)
            st, err, _ = await post(client, f"http://127.0.0.1:{eng_port}/v1/completions",
                                    {"prompt": prompt, "max_tokens": 1, "cache_salt": "a/b"})
            assert st == 400 and err["error"]["param"] == "cache_salt"  # as vLLM refuses it
    finally:
        await gw.stop()
        await eng.stop()
        await asyncio.sleep(0)


# -- 4. pass-through: what agents ask, nothing of the engine's admin ----------------------------------------------
@timed(10)
async def test_a_client_key_reaches_no_engine_admin_path() -> None:
    async with stack(kv_pool=1_000_000, api_keys=("k1",), admin_token="adm") as (up, gw, client, base):
        for method, path in (("POST", "/reset_prefix_cache"), ("POST", "/kvgate/trigger"), ("GET", "/kvgate/stats"),
                             ("POST", "/flush_cache"), ("GET", "/server_info")):
            st, err = await status_of(client, method, base + path, **K1)
            assert st == 401 and err["error"]["type"] == "Unauthorized", path
        for method, path in (("GET", "/v2/anything"), ("POST", "/v1/embeddings"), ("GET", "//evil.example/x")):
            st, err = await status_of(client, method, base + path, **K1)
            assert st == 404 and err["error"]["type"] == "NotFound", path
        assert not up.seen
        for method, path in (("GET", "/v1/models"), ("GET", "/v1/models/m"), ("POST", "/tokenize"),
                             ("POST", "/v1/messages/count_tokens"), ("GET", "/health")):
            st, _ = await status_of(client, method, base + path, **K1)
            assert st == 200, path
        st, _ = await status_of(client, "POST", base + "/reset_prefix_cache", **ADMIN)
        assert st == 200 and up.seen[-1]["path"] == "/reset_prefix_cache"
        assert "adm" not in str(up.seen[-1]["headers"].get("Authorization"))  # the token is not forwarded
