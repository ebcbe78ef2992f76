"""The KV-event consumer against vLLM's own ZMQ publisher (pure Python, no GPU): joins late, catches up by replay."""

from __future__ import annotations

import asyncio
import random
from pathlib import Path

import msgspec
import pytest

from kvgate.fleet.kvevents import Residency, decode_batch
from kvgate.gateway.kvevents import KVEventSubscriber
from support.aio import timed

kv = pytest.importorskip("vllm.distributed.kv_events")


def _random_batches(rng: random.Random, n: int) -> list:
    """Random store/remove/clear batches in vLLM's structs."""
    batches = []
    for _ in range(n):
        events = []
        for _ in range(rng.randint(1, 4)):
            u = rng.random()
            hashes = [rng.randrange(40) for _ in range(rng.randint(1, 3))]
            if u < 0.6:
                sid = rng.choice(["a", "b", "c", None])
                events.append(kv.BlockStored(block_hashes=hashes, parent_block_hash=None, token_ids=[1] * 16,
                                             block_size=16, lora_id=None, medium="GPU", lora_name=None,
                                             session_id=sid))
            elif u < 0.95:
                events.append(kv.BlockRemoved(block_hashes=hashes, medium="GPU"))
            else:
                events.append(kv.AllBlocksCleared())
        batches.append(kv.KVEventBatch(ts=0.0, events=events))
    return batches


@timed(60)
async def test_follows_vllms_publisher_and_replays_what_it_missed(tmp_path: Path) -> None:
    pub_ep, replay_ep = f"ipc://{tmp_path}/kv.pub", f"ipc://{tmp_path}/kv.replay"
    publisher = kv.ZmqEventPublisher(0, endpoint=pub_ep, replay_endpoint=replay_ep, topic="kv")
    sub = KVEventSubscriber(pub_ep, replay_endpoint=replay_ep, topic="kv")
    try:
        rng = random.Random(5)
        early = _random_batches(rng, 30)
        for b in early:  # published before the consumer exists: only a replay can recover them
            publisher.publish(b)
        await asyncio.sleep(0.3)
        await sub.start()
        # keep publishing until the subscription is live (PUB/SUB joins asynchronously)
        rest = _random_batches(random.Random(6), 60)
        i = 0
        while not sub.connected.is_set() and i < len(rest):
            publisher.publish(rest[i])
            i += 1
            await asyncio.sleep(0.05)
        for b in rest[i:]:
            publisher.publish(b)
        for _ in range(200):
            if sub.residency.last_seq == len(early) + len(rest) - 1:
                break
            await asyncio.sleep(0.05)
        assert sub.residency.last_seq == len(early) + len(rest) - 1
        assert sub.replayed >= len(early)  # caught up on joining
        assert sub.residency.gaps == 0 and sub.bad_messages == 0
        # the view equals replaying every batch, in order, directly
        full = Residency()
        for b in [*early, *rest]:
            full.apply(decode_batch(msgspec.msgpack.Encoder().encode(b)).events)
        assert sub.residency.blocks == full.blocks
        assert sub.residency.session_tokens == full.session_tokens
    finally:
        await sub.stop()
        publisher.shutdown()


@timed(30)
async def test_without_replay_a_late_join_is_a_gap(tmp_path: Path) -> None:
    pub_ep = f"ipc://{tmp_path}/kv2.pub"
    publisher = kv.ZmqEventPublisher(0, endpoint=pub_ep)
    sub = KVEventSubscriber(pub_ep)
    try:
        for _ in range(5):
            publisher.publish(kv.KVEventBatch(ts=0.0, events=[kv.AllBlocksCleared()]))
        await asyncio.sleep(0.3)
        await sub.start()
        for _ in range(100):
            publisher.publish(kv.KVEventBatch(ts=0.0, events=[kv.AllBlocksCleared()]))
            if sub.connected.is_set():
                break
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.2)
        assert sub.messages >= 1 and sub.residency.gaps >= 1
    finally:
        await sub.stop()
        publisher.shutdown()
