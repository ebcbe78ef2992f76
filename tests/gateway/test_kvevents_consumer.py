"""The KV-event consumer's life: a publisher that restarts, a view the gateway resets, a lost message, an endpoint
with nobody behind it. A plain ZMQ PUB socket sends kvgate's encoding of vLLM's messages; bounded polls only."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path

import aiohttp
import pytest
import zmq
import zmq.asyncio

from kvgate.fleet.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, EventBatch, encode_message
from kvgate.gateway.app import Gateway
from kvgate.gateway.config import GatewayConfig, KVEventsSource
from kvgate.gateway.health import live_tasks
from kvgate.gateway.kvevents import KVEventSubscriber
from support.aio import timed
from support.fake_upstream import FakeUpstream
from support.ports import free_port
from support.wait import until_async


def _stored(sid: str, *hashes: int) -> EventBatch:
    return EventBatch(0.0, (BlockStored(hashes, None, (), 16, None, "GPU", 0, sid),))


class _Pub:
    def __init__(self, endpoint: str) -> None:
        self.sock = zmq.asyncio.Context.instance().socket(zmq.XPUB)  # (tells when the subscriber has joined)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(endpoint)

    async def send(self, seq: int, batch: EventBatch) -> None:
        await self.sock.send_multipart(encode_message(seq, batch))

    def close(self) -> None:
        self.sock.close(linger=0)


async def _joined(pub: _Pub, sub: KVEventSubscriber) -> None:
    """Wait for the subscription (an XPUB socket receives it), then send seq 0."""
    assert (await asyncio.wait_for(pub.sock.recv(), 10))[:1] == b"\x01"
    await pub.send(0, _stored("warm", 999))
    await asyncio.wait_for(sub.connected.wait(), 10)


@timed(30)
async def test_restart_reset_and_gap(tmp_path: Path) -> None:
    ep = f"ipc://{tmp_path}/kv.pub"
    pub = _Pub(ep)
    sub = KVEventSubscriber(ep)
    assert sub.known("a") is None  # nothing seen yet: unknown, not 0
    await sub.start()
    try:
        await _joined(pub, sub)
        await until_async(lambda: sub.stats()["connected"], "the socket monitor's connected")
        await pub.send(1, _stored("a", 1, 2, 3))
        await until_async(lambda: sub.known("a") == 48, "a's three blocks")
        assert sub.synced and sub.known(7) is None  # (anonymous ids are never named)
        assert sub.known("b") is None  # never named in this view: unknown, not 0
        # the engine restarts: its publisher numbers from 0 again, its cache is new
        await pub.send(0, _stored("b", 4))
        await until_async(lambda: sub.restarts == 1, "the restart")
        assert sub.known("a") is None and sub.known("b") == 16 and sub.residency.last_seq == 0
        # the gateway resets the view (the replica went down): unknown until the next message
        sub.reset()
        assert sub.known("b") is None and not sub.synced
        await pub.send(1, EventBatch(0.0, (AllBlocksCleared(), BlockStored((5,), None, (), 16, session_id="c"))))
        await until_async(lambda: sub.known("c") == 16, "the view after the reset")
        # a view reset by the gateway starts wherever the stream is: without replay that start is a gap, which the
        # clear in the same batch makes exact again
        assert sub.residency.gaps == 1 and sub.synced
        # a lost message (seq 2 never arrives) makes the view inexact: the budget must not read it
        await pub.send(3, EventBatch(0.0, (BlockRemoved((5,)),)))
        await until_async(lambda: sub.residency.last_seq == 3, "seq 3")
        assert sub.residency.gaps == 2 and not sub.synced and sub.known("c") is None
        assert sub.residency.tokens_of("c") == 0  # (the router still reads the approximate view)
        await pub.send(4, EventBatch(0.0, (AllBlocksCleared(),)))
        await until_async(lambda: sub.synced, "exact again after a clear")
        assert sub.known("c") == 0  # named before the flush: known to hold nothing now
        # stores that name no session (an older vLLM, or a client the engine cannot name) leave sessions unknown
        await pub.send(5, EventBatch(0.0, (BlockStored((6, 7), None, (), 16),)))
        await until_async(lambda: sub.residency.resident_tokens == 32, "the unnamed store")
        assert sub.known("d") is None and sub.residency.tokens_of("d") == 0
        sub.residency.forget("c")  # (the gateway's session c ended)
        assert sub.known("c") is None
        assert sub.bad_messages == 0 and sub.errors == 0
    finally:
        await sub.stop()
        pub.close()


@timed(30)
async def test_a_gateway_whose_events_endpoint_has_nobody_starts_serves_and_stops(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Nothing listens on the events endpoints: the gateway serves, the replica's residency is unknown (so
    budgeter-resident decides as the plain budgeter), and stopping leaves no task behind."""
    caplog.set_level(logging.INFO, logger="kvgate.gateway")
    up = FakeUpstream()
    await up.start()
    try:
        before = live_tasks()
        src = KVEventsSource(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
        gw = Gateway(GatewayConfig(upstream=up.url, kv_pool=100_000, control="budgeter-resident", kv_events=(src,)))
        port = await gw.start("127.0.0.1", 0)
        try:
            body = {"model": "m", "prompt": [1] * 100, "max_tokens": 4}
            async with aiohttp.ClientSession() as http:
                async with http.post(f"http://127.0.0.1:{port}/v1/completions", json=body,
                                     headers={"X-Session-ID": "s1"}) as r:
                    assert r.status == 200
                    await r.read()
                async with http.get(f"http://127.0.0.1:{port}/v1/sessions") as r:
                    listing = await r.json()
            (s1,) = listing["data"]
            assert s1["state"] == "thinking" and s1["resident_tokens"] is None
            assert gw.policy.residency is not None and gw.policy.residency("s1") is None
            assert gw.control.name == "budgeter-resident"
            await until_async(lambda: "no publisher at" in caplog.text, "the consumer's warning")
            (kv,) = gw.info()["kv_events"]
            assert not kv["connected"]
            assert kv["endpoint"] == src.endpoint and not kv["synced"] and kv["messages"] == 0
        finally:
            await gw.stop()
        # (the fake upstream's side of the gateway's closed connections ends a moment later)
        await until_async(lambda: live_tasks() == before, "the tasks back to the baseline")
        assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("kv-events")]
    finally:
        await up.stop()


@timed(30)
async def test_a_join_whose_replay_does_not_answer_is_a_gap(tmp_path: Path) -> None:
    """The first message seen is seq 3 and the replay endpoint has nobody: the view starts mid-stream, so it is
    not exact (the budget reads unknown)."""
    ep = f"ipc://{tmp_path}/kv.pub"
    pub = _Pub(ep)
    sub = KVEventSubscriber(ep, replay_endpoint=f"ipc://{tmp_path}/nobody", replay_timeout_s=0.2)
    await sub.start()
    try:
        assert (await asyncio.wait_for(pub.sock.recv(), 10))[:1] == b"\x01"
        await pub.send(3, _stored("a", 1))
        await until_async(lambda: sub.residency.last_seq == 3, "seq 3")
        assert sub.residency.gaps == 1 and not sub.synced and sub.known("a") is None and sub.replayed == 0
    finally:
        await sub.stop()
        pub.close()
