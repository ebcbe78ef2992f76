"""``kvgate engine --kv-events-config``: the KV events it publishes, against its own pool and vLLM's structs.

Servers run in-process on free loopback ports, consumed by the gateway's :class:`KVEventSubscriber` (a ZMQ SUB
socket with replay catch-up) or read back whole from the replay socket; one test starts ``kvgate engine`` as a
process. Every test is bounded by ``timed``; waits are bounded polls, never timing assertions.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import signal
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import numpy as np
import pytest
import zmq
import zmq.asyncio

from kvgate.fleet.kvevents import AllBlocksCleared, BlockRemoved, BlockStored, decode_batch
from kvgate.gateway.kvevents import KVEventSubscriber
from kvgate.serve.app import EngineServer
from kvgate.serve.config import ServerConfig
from kvgate.serve.kvevents import KVEventsConfig, parse_kv_events_config
from kvgate.serve.tokenizer import block_hashes, filler_ids
from support.aio import timed
from support.old_kv_events import OldBatch, OldCleared, OldRemoved, OldStored
from support.ports import free_port, wait_health

MODEL = "Qwen/Qwen3-8B"
FAST = 2000.0


def events_config(tmp: Path, encoding: str = "map", **extra: Any) -> KVEventsConfig:
    raw = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"ipc://{tmp}/kv.pub",
           "replay_endpoint": f"ipc://{tmp}/kv.replay", "topic": "kv", **extra}
    return parse_kv_events_config(json.dumps(raw), encoding)


@contextlib.asynccontextmanager
async def served(cfg: ServerConfig) -> AsyncIterator[tuple[EngineServer, str]]:
    server = EngineServer(cfg)
    port = await server.start("127.0.0.1", 0)
    try:
        yield server, f"http://127.0.0.1:{port}"
    finally:
        await server.stop()


async def complete(http: aiohttp.ClientSession, base: str, prompt: list[int], n: int, session: str) -> dict[str, Any]:
    body = {"model": MODEL, "prompt": prompt, "max_tokens": n}
    async with http.post(base + "/v1/completions", json=body, headers={"X-Session-ID": session}) as r:
        assert r.status == 200, await r.text()
        return await r.json()  # type: ignore[no-any-return]


async def get_json(http: aiohttp.ClientSession, base: str, path: str) -> Any:
    async with http.get(base + path) as r:
        assert r.status == 200, await r.text()
        return await r.json()


async def replay_all(endpoint: str) -> list[tuple[int, bytes]]:
    """Every buffered message of a publisher, from sequence 0, through its replay socket."""
    ctx = zmq.asyncio.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(endpoint)
    out: list[tuple[int, bytes]] = []
    try:
        await sock.send_multipart([b"", (0).to_bytes(8, "big")])
        while True:
            frames = await sock.recv_multipart()
            assert len(frames) == 4 and frames[0] == b""
            seq = int.from_bytes(frames[2], "big", signed=True)
            if seq == -1:
                return out
            assert frames[1] == b"kv"
            out.append((seq, frames[3]))
    finally:
        sock.close(linger=0)


def ids(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(1000, 100000) for _ in range(n)]


# -- the published batches ---------------------------------------------------------------------------------


@timed(60)
async def test_batches_decode_with_vllms_structs_and_name_blocks_by_their_tokens(tmp_path: Path) -> None:
    kv = pytest.importorskip("vllm.distributed.kv_events")
    cfg = ServerConfig(time_scale=FAST, kv_pool=4096, kv_events=events_config(tmp_path))
    rng = random.Random(1)
    prompt = ids(rng, 200)
    async with served(cfg) as (server, base), aiohttp.ClientSession() as http:
        await complete(http, base, prompt, 40, "alice")
        second = prompt + filler_ids(40, False) + ids(rng, 100)
        await complete(http, base, second, 10, "alice")
        async with http.post(base + "/reset_prefix_cache") as r:
            assert r.status == 200
        msgs = await replay_all(f"ipc://{tmp_path}/kv.replay")
    assert [s for s, _ in msgs] == list(range(len(msgs))) and msgs
    decoder = msgspec.msgpack.Decoder(kv.KVEventBatch)
    stored: list[Any] = []
    for _, payload in msgs:
        batch = decoder.decode(payload)  # vLLM's own structs (tagged maps)
        assert batch.data_parallel_rank == 0
        ours = decode_batch(payload)
        assert len(ours.events) == len(batch.events)
        for theirs, mine in zip(batch.events, ours.events, strict=True):
            if isinstance(theirs, kv.BlockStored):
                assert isinstance(mine, BlockStored)
                assert theirs.block_hashes == list(mine.block_hashes)
                assert theirs.medium == "GPU" and theirs.group_idx == 0 and theirs.session_id == "alice"
                assert theirs.block_size == 16 and len(theirs.token_ids) == 16 * len(theirs.block_hashes)
                stored.append(theirs)
            elif isinstance(theirs, kv.BlockRemoved):
                assert isinstance(mine, BlockRemoved) and len(theirs.block_hashes) == 1
            else:
                assert isinstance(theirs, kv.AllBlocksCleared) and isinstance(mine, AllBlocksCleared)
    last = decoder.decode(msgs[-1][1]).events
    assert isinstance(last[-1], kv.AllBlocksCleared)
    # the blocks are named by the chained hashes of the tokens each request sent (prompt + its output)
    want: list[int] = []
    for seq in (prompt + filler_ids(40, False), second + filler_ids(10, False)):
        h = block_hashes(np.array(seq, dtype=np.int64), 16)
        want += [x for x in h if x not in want]
    got = [h for e in stored for h in e.block_hashes]
    assert got == want[: len(got)] and len(got) >= len(prompt + filler_ids(40, False)) // 16
    tokens = [t for e in stored for t in e.token_ids]
    assert tokens == (second + filler_ids(10, False))[: len(tokens)]
    for e in stored:  # each store chains onto the block before it
        first = want.index(e.block_hashes[0])
        assert e.parent_block_hash == (want[first - 1] if first else None)


@timed(60)
async def test_the_older_array_encoding_carries_the_same_events(tmp_path: Path) -> None:
    rng = random.Random(2)
    prompts = [ids(rng, rng.randint(50, 900)) for _ in range(8)]
    decoded: dict[str, list[Any]] = {}
    for enc in ("map", "array"):
        sub = tmp_path / enc
        sub.mkdir()
        cfg = ServerConfig(time_scale=FAST, kv_pool=2048, kv_events=events_config(sub, enc))
        async with served(cfg) as (_, base), aiohttp.ClientSession() as http:
            for i, p in enumerate(prompts):  # one at a time: the same steps in both runs
                await complete(http, base, p, 20, f"s{i}")
            async with http.post(base + "/reset_prefix_cache") as r:
                assert r.status == 200
            msgs = await replay_all(f"ipc://{sub}/kv.replay")
        evs = [e for _, p in msgs for e in decode_batch(p).events]
        if enc == "array":
            old = msgspec.msgpack.Decoder(OldBatch)
            olds = [e for _, p in msgs for e in old.decode(p).events]
            kinds = {OldStored: BlockStored, OldRemoved: BlockRemoved, OldCleared: AllBlocksCleared}
            assert [kinds[type(e)] for e in olds] == [type(e) for e in evs]
            assert [e.block_hashes for e in olds if isinstance(e, OldStored)] == [
                list(e.block_hashes) for e in evs if isinstance(e, BlockStored)
            ]
            assert any(isinstance(e, OldRemoved) for e in olds)
        decoded[enc] = evs

    def strip(e: Any) -> Any:  # the array encoding has no group or session fields
        if isinstance(e, BlockStored):
            return (e.block_hashes, e.parent_block_hash, e.token_ids, e.block_size, e.medium)
        if isinstance(e, BlockRemoved):
            return (e.block_hashes, e.medium)
        return "cleared"

    assert [strip(e) for e in decoded["map"]] == [strip(e) for e in decoded["array"]]
    assert any(isinstance(e, BlockRemoved) for e in decoded["map"])


# -- the consumer's view against the pool ------------------------------------------------------------------


async def drive(rng: random.Random, http: aiohttp.ClientSession, base: str, shared: bool) -> None:
    """Random sessions of random lengths, concurrently: shared system prompts (when ``shared``), turns that
    extend the previous prompt and output, turns that rewrite the previous one (a capped continuation), and one
    prefix-cache reset with the running requests preempted."""
    systems = [ids(rng, rng.randint(40, 300)) for _ in range(3)]
    reset_at = rng.randint(3, 10)
    done = 0

    async def session(k: int) -> None:
        nonlocal done
        name = f"s{k}"
        prompt = (rng.choice(systems) if shared and rng.random() < 0.7 else []) + ids(rng, rng.randint(10, 400))
        previous = prompt
        for _ in range(rng.randint(1, 5)):
            n = rng.randint(1, 60)
            await complete(http, base, prompt, n, name)
            done += 1
            if done == reset_at:
                async with http.post(base + "/reset_prefix_cache?reset_running_requests=true") as r:
                    assert r.status == 200
            if rng.random() < 0.2 and len(previous) > 1:  # the agent retries its previous turn differently
                prompt = previous + ids(rng, rng.randint(5, 200))
            else:
                previous = prompt + filler_ids(n, False)
                prompt = previous + ids(rng, rng.randint(5, 300))

    await asyncio.gather(*(session(k) for k in range(12)))


async def quiesced(server: EngineServer, http: aiohttp.ClientSession, base: str, sub: KVEventSubscriber) -> Any:
    """The engine's own view once it is idle and the consumer has every batch it published."""
    for _ in range(400):
        st = await get_json(http, base, "/kvgate/stats")
        view = await get_json(http, base, "/kvgate/kv_blocks")
        if st["running"] == 0 and st["waiting"] == 0 and sub.residency.last_seq == view["last_seq"]:
            return view
        await asyncio.sleep(0.025)
    raise AssertionError(f"not quiesced: consumer at {sub.residency.last_seq}, engine at {view['last_seq']}")


async def joined(http: aiohttp.ClientSession, base: str, sub: KVEventSubscriber) -> None:
    """Warm-up requests until the subscription is live (a ZMQ SUB joins asynchronously); its first message
    makes it replay everything before."""
    rng = random.Random(0)
    for i in range(100):
        await complete(http, base, ids(rng, 40), 2, f"warmup{i}")
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(sub.connected.wait(), 0.1)
            return
    raise AssertionError("the subscriber never received a message")


@pytest.mark.parametrize(
    ("seed", "shared", "late"), [(1, True, False), (2, True, False), (3, True, True), (4, False, False),
                                 (5, True, False), (6, False, True)]
)
@timed(120)
async def test_consumer_view_of_resident_prefixes_equals_the_pool(
    tmp_path: Path, seed: int, shared: bool, late: bool
) -> None:
    """``late``: the consumer joins after the run and catches up from the publisher's replay buffer."""
    cfg = ServerConfig(time_scale=FAST, kv_pool=3072, kv_events=events_config(tmp_path))
    ep = cfg.kv_events
    assert ep is not None and ep.replay_endpoint is not None
    sub = KVEventSubscriber(ep.endpoint, replay_endpoint=ep.replay_endpoint, topic="kv")
    async with served(cfg) as (server, base), aiohttp.ClientSession() as http:
        if late:
            await drive(random.Random(seed), http, base, shared)
        await sub.start()
        try:
            await joined(http, base, sub)
            if not late:
                await drive(random.Random(seed), http, base, shared)
            view = await quiesced(server, http, base, sub)
        finally:
            await sub.stop()
        stats = await get_json(http, base, "/kvgate/stats")
    res = sub.residency
    assert res.gaps == 0 and sub.bad_messages == 0 and stats["kv_events"]["unnamed"] == 0
    if late:
        assert sub.replayed > 50  # the whole run came through the replay socket
    assert server.engine.pool.evictions > 0  # the small pool forced evictions
    bridge = stats["bridge"]
    assert bridge["capped"] > 0  # a retried turn made the pool forget a session's tail
    if shared:
        assert bridge["groups"] > 0
    # every resident hash, with its copies, as the pool holds them
    engine = {h: n for h, n in view["blocks"]}
    consumer = {h: copies for h, (_, copies, _) in res.blocks.items()}
    assert consumer == engine
    assert engine  # something is resident after the run
    assert res.resident_tokens == 16 * len(engine)
    # per session: at least the blocks of its own content; above that only shared-prefix blocks it stored
    # (a block stored by several sessions counts for each while any copy stays: BlockRemoved names no session)
    mine, extra = view["sessions"], view["shared_tokens"]
    assert (extra > 0) == shared or not shared
    for name in set(mine) | set(res.session_tokens):
        have = res.tokens_of(name)
        assert mine.get(name, 0) <= have <= mine.get(name, 0) + extra, name
    assert sum(res.tokens_of(n) for n in mine) > 0


# -- the command ---------------------------------------------------------------------------------------------


def test_bad_kv_events_config_is_one_line_and_exit_2() -> None:
    cases = ["{bad", "[1]", '{"enable_kv_cache_events": true, "endpoint": "tcp://0.0.0.0:5557"}',
             '{"enable_kv_cache_events": true, "publisher": "kafka"}', '{"enable_kv_cache_events": 1}',
             '{"enable_kv_cache_events": true, "buffer_steps": 0}', '{"enable_kv_cache_events": true, "bogus": 1}',
             '{"enable_kv_cache_events": true, "endpoint": "tcp://127.0.0.1:x"}']
    for bad in cases:
        p = subprocess.run([sys.executable, "-m", "kvgate.cli", "engine", "--kv-events-config", bad],
                           capture_output=True, text=True, timeout=60)
        lines = p.stderr.strip().splitlines()
        assert p.returncode == 2 and len(lines) == 1 and lines[0].startswith("kvgate: error: "), (bad, p.stderr)
    p = subprocess.run([sys.executable, "-m", "kvgate.cli", "engine", "--engine", "sglang", "--kv-events-config",
                        '{"enable_kv_cache_events": true}'], capture_output=True, text=True, timeout=60)
    assert p.returncode == 2 and "vllm engine only" in p.stderr


@timed(90)
async def test_kvgate_engine_process_publishes_to_the_consumer() -> None:
    port, pub, rep = free_port(), free_port(), free_port()
    conf = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
            "replay_endpoint": f"tcp://127.0.0.1:{rep}", "buffer_steps": 100}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvgate.cli", "engine", "--port", str(port), "--time-scale", str(FAST),
         "--kv-pool", "2048", "--kv-events-config", json.dumps(conf)],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
    )
    sub = KVEventSubscriber(f"tcp://127.0.0.1:{pub}", replay_endpoint=f"tcp://127.0.0.1:{rep}")
    try:
        await asyncio.to_thread(wait_health, port, proc)
        base = f"http://127.0.0.1:{port}"
        await sub.start()
        async with aiohttp.ClientSession() as http:
            await joined(http, base, sub)
            await complete(http, base, ids(random.Random(3), 300), 5, "bob")
            for _ in range(400):
                view = await get_json(http, base, "/kvgate/kv_blocks")
                if sub.residency.last_seq == view["last_seq"]:
                    break
                await asyncio.sleep(0.025)
            assert sub.residency.tokens_of("bob") == view["sessions"]["bob"] >= 300 // 16 * 16
    finally:
        await sub.stop()
        proc.send_signal(signal.SIGTERM)
        _, err = await asyncio.to_thread(proc.communicate, None, 30)
    assert proc.returncode == 0, err
    assert b"KV events on" in err
