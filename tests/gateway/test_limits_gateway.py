"""The gateway's limits (issue items 5-7, docs/security.md#limits), attacked through the gateway as the issue's
attacker did, with small option values so the attacks end fast: trickling connections closed at the deadline and
counted in ``kvgate_http_refused_total``, connections past the cap refused, a non-stream answer past
``--max-answer-bytes`` 502 (a longer stream relayed whole), bodies past the budget in flight 503 with Retry-After,
and the 28 MB body of a million tiny messages 413 while ``/kvgate/info`` is answered. D is checked back to the
true sum after each (``stack``)."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

import aiohttp
import pytest

from kvgate.cli import main
from kvgate.gateway.command import LIMIT_OPTIONS
from kvgate.gateway.config import CONFIG_KEYS
from kvgate.http.limits import ServerLimits
from support.aio import timed
from support.fake_upstream import FakeUpstream, post, settle, stack


async def refused(client: aiohttp.ClientSession, base: str) -> dict[str, float]:
    """``kvgate_http_refused_total`` by reason, as ``/metrics`` shows it."""
    async with client.get(base + "/metrics") as r:
        text = await r.text()
    out = {}
    for line in text.splitlines():
        if line.startswith("kvgate_http_refused_total{"):
            reason = line.split('reason="')[1].split('"')[0]
            out[reason] = float(line.rsplit(" ", 1)[1])
    return out


async def info_ok(port: int, timeout: float = 10.0) -> bool:
    """``GET /kvgate/info`` on a new connection answers 200 (the timeout is a hang guard)."""
    r, w = await asyncio.open_connection("127.0.0.1", port)
    w.write(b"GET /kvgate/info HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nConnection: close\r\n\r\n" % port)
    got = await asyncio.wait_for(r.read(), timeout)
    w.close()
    return got.startswith(b"HTTP/1.1 200 ")


async def rest(reader: asyncio.StreamReader) -> bytes:
    """What the server sent before it closed (a refused body's unread bytes are read and dropped while the
    server lingers, so its answer is not lost to a reset)."""
    return await asyncio.wait_for(reader.read(), 30)


@timed(30)
async def test_slowloris_connections_are_closed_at_the_head_deadline_and_counted() -> None:
    limits = ServerLimits(head_timeout_s=0.5, max_connections=60)
    async with stack(kv_pool=1000, server_limits=limits) as (_, gw, client, base):
        conns = [await asyncio.open_connection("127.0.0.1", gw.port) for _ in range(30)]
        for i in range(3):
            for _, w in conns:
                w.write(b"GET /kvgate/info HTTP/1.1\r\n"[i:i + 1])
            await asyncio.sleep(0.05)
        assert await info_ok(gw.port)  # served while they trickle
        for r, w in conns:
            got = await asyncio.wait_for(r.read(), 10)
            assert got.startswith(b"HTTP/1.1 408 "), got[:80]
            w.close()
        counts = await refused(client, base)
        assert counts["head_timeout"] == 30 and counts["connections"] == 0


@timed(30)
async def test_connections_past_max_connections_are_refused_and_counted() -> None:
    async with stack(kv_pool=1000, server_limits=ServerLimits(max_connections=12)) as (_, gw, client, base):
        held = [await asyncio.open_connection("127.0.0.1", gw.port) for _ in range(11)]  # (+ the client's own)
        async with client.get(base + "/kvgate/info") as r:
            assert r.status == 200
        await settle(lambda: gw._server is not None and gw._server.load()["connections"] >= 12)
        extra = [await asyncio.open_connection("127.0.0.1", gw.port) for _ in range(4)]
        for r, w in extra:
            got = await asyncio.wait_for(r.read(), 10)
            assert got.startswith(b"HTTP/1.1 503 ") and b"Retry-After" in got
            w.close()
        for _, w in held:
            w.close()
        await settle(lambda: gw._server is not None and gw._server.load()["connections"] <= 1)
        counts = await refused(client, base)
        assert counts["connections"] == 4


@timed(60)
async def test_a_client_that_never_reads_its_stream_is_cut_off_and_the_upstream_request_ends() -> None:
    up = FakeUpstream()
    up.chunks = 200_000  # ~30 MB of events: far more than the sockets between hold
    limits = ServerLimits(send_timeout_s=0.5)
    async with stack(up, kv_pool=10**7, server_limits=limits) as (_, gw, client, base):
        r, w = await asyncio.open_connection("127.0.0.1", gw.port)
        body = json.dumps({"prompt": [1] * 10, "max_tokens": 10, "stream": True}).encode()
        w.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                b"X-Session-ID: s\r\nContent-Length: %d\r\n\r\n%s" % (gw.port, len(body), body))
        await settle(lambda: up.cancelled == 1, timeout=30)  # (never read: the gateway let go of it)
        assert up.streamed < 200_000
        counts = await refused(client, base)
        assert counts["send_timeout"] == 1
        await settle(lambda: gw.in_flight == 0)
        w.close()


@timed(60)
async def test_a_non_stream_answer_past_max_answer_bytes_is_502_and_a_long_stream_is_relayed() -> None:
    up = FakeUpstream()
    async with stack(up, kv_pool=10**7, max_answer_bytes=100_000) as (_, gw, client, base):
        url = base + "/v1/completions"
        up.chunks = 10  # a small answer: relayed
        status, body, _ = await post(client, url, {"prompt": [1] * 10, "max_tokens": 10}, "a")
        assert status == 200 and body["usage"]["completion_tokens"] == 10
        up.chunks = 100_000  # "ok " x 100,000: 300 KB in one JSON body
        status, body, _ = await post(client, url, {"prompt": [1] * 10, "max_tokens": 10}, "a")
        assert status == 502 and "over the limit of 100000 bytes" in body["error"]["message"]
        assert gw.upstream_errors["too_large"] == 1
        up.chunks = 3000  # a stream of ~400 KB: relayed as it comes, whatever its length
        async with client.post(url, json={"prompt": [1] * 10, "max_tokens": 10, "stream": True},
                               headers={"X-Session-ID": "a"}) as r:
            raw = await r.read()
        assert r.status == 200 and len(raw) > 100_000 and raw.endswith(b"data: [DONE]\n\n")
        assert raw.count(b'"text": "ok "') == 3000
        up.chunks = 3
        status, _, _ = await post(client, url, {"prompt": [1] * 10, "max_tokens": 10}, "a")
        assert status == 200  # the session goes on after the refused answer


@timed(60)
async def test_bodies_past_the_budget_in_flight_are_503_with_retry_after() -> None:
    up = FakeUpstream()
    up.delay_s = 1.0  # a turn's body stays held while its upstream answers
    limits = ServerLimits(bodies_in_flight=6000)
    async with stack(up, kv_pool=10**7, max_body_bytes=4096, server_limits=limits) as (_, gw, client, base):
        url = base + "/v1/completions"
        body = {"prompt": "x" * 3500, "max_tokens": 4}
        first = asyncio.create_task(post(client, url, body, "one"))
        await settle(lambda: len(up.seen) == 1)
        async with client.post(url, json=body, headers={"X-Session-ID": "two"}) as r:
            err = await r.json()
            assert (r.status, r.headers["Retry-After"]) == (503, "1") and err["error"]["code"] == 503
        assert (await first)[0] == 200
        status, _, _ = await post(client, url, body, "two")  # the budget is back
        assert status == 200
        counts = await refused(client, base)
        assert counts["body_budget"] == 1


@timed(120)
async def test_a_28mb_body_of_a_million_tiny_messages_is_413_while_the_gateway_answers() -> None:
    """The issue's body, under --max-body-bytes, at the default --max-body-nodes: refused by its node count as
    it arrives (never parsed: no ~500 MB of objects, no loop stall), while /kvgate/info is answered."""
    msgs = [{"role": "user", "content": "a"}] * 1_000_000
    body = json.dumps({"model": "m", "messages": msgs}, separators=(",", ":")).encode()
    assert 28 << 20 < len(body) < 32 << 20
    async with stack(kv_pool=10**9, max_body_bytes=32 << 20) as (up, gw, client, base):
        r, w = await asyncio.open_connection("127.0.0.1", gw.port)
        w.write(b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1:%d\r\nContent-Type: application/json\r\n"
                b"Content-Length: %d\r\n\r\n" % (gw.port, len(body)))
        answered = 0
        step = 1 << 18
        for i in range(0, len(body), step):
            try:
                w.write(body[i:i + step])
                await w.drain()
                await asyncio.sleep(0)  # (drain does not yield while the socket takes it: let the gateway read)
            except ConnectionError:
                break
            if not r.at_eof() and gw._server is not None \
                    and gw._server.load()["body_bytes"]:  # (the big body is being received)
                assert await info_ok(gw.port)
                answered += 1
            if r.at_eof():
                break
        got = await rest(r)
        w.close()
        assert got.startswith(b"HTTP/1.1 413 ") and b"JSON objects and arrays" in got
        assert answered >= 2 and not up.seen
        counts = await refused(client, base)
        assert counts["body_nodes"] == 1


def test_every_limit_is_an_option_and_a_config_key(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    names = {o(lambda: None).__click_params__[0].name for o in LIMIT_OPTIONS}  # type: ignore[attr-defined]
    assert names == {"head_timeout", "body_timeout", "min_body_rate", "max_connections", "max_body_nodes",
                     "max_inflight_body_bytes", "send_timeout", "keepalive_timeout", "max_answer_bytes"}
    assert names <= CONFIG_KEYS
    conf = tmp_path / "gw.toml"
    conf.write_text("head-timeout = 5\nsend_timeout = -1\n")
    for args, msg in ((["--head-timeout", "0"], "--head-timeout must be a positive number"),
                      (["--max-connections", "0"], "--max-connections must be a positive number"),
                      (["--max-inflight-body-bytes", "2048"], "must be at least --max-body-bytes"),
                      (["--max-answer-bytes", "10"], "--max-answer-bytes must be at least 1024"),
                      (["--config", str(conf)], "--send-timeout must be a positive number")):
        with pytest.raises(SystemExit) as e:
            main(["gateway", "--upstream", "http://127.0.0.1:9", "--kv-pool", "100", *args])
        err = capsys.readouterr().err
        assert e.value.code == 2, (args, err)
        assert msg in err and len(err.strip().splitlines()) == 1, err
