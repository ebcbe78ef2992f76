"""``kvgate engine --kv-events-config``: the simulated pool's KV cache events, published as vLLM publishes them.

vLLM (``vllm/distributed/kv_events.py``, ``vllm/v1/core/block_pool.py``) queues a ``BlockStored`` each time a
request's allocation caches full blocks (their chained hashes, the hash of the block before them, their token
ids, the block size, LoRA, medium ``"GPU"``, KV-cache group 0 and the request's ``X-Session-ID``), one
``BlockRemoved`` per cached block evicted by an allocation, and ``AllBlocksCleared`` on ``reset_prefix_cache``;
after each engine step it publishes the queue as one ``KVEventBatch`` ``[ts, events, data_parallel_rank]`` on a
ZMQ PUB socket, as the multipart message ``(topic, seq: 8-byte big-endian, msgpack payload)``, keeps the last
``buffer_steps`` messages, and answers a ROUTER replay request ``(identity, "", start seq)`` with every buffered
message from ``start`` on, then the end marker (seq -1, empty payload).

:class:`KVEventPublisher` does the same over kvgate's pool. It is the pool's observer
(:class:`~kvgate.engine.runs.PoolObserver`): the pool names its blocks by content keys, the publisher names them
by the chained token hashes the content bridge computed for the request that stored them (so two blocks hold the
same tokens exactly when they carry the same hash, as in vLLM), and remembers each key's hash until the content
changes (a capped continuation orphans the old blocks, which keep their old hashes) or the cache is reset.

Sending. Events are batched per engine step and sent from the engine loop's own thread when the step is done (as
vLLM publishes after the step's forward pass), without waiting: a PUB socket never blocks (past its high-water
mark it drops, as vLLM's does; the replay buffer keeps the batch). Encoding is the only cost, well under a
millisecond for a step (an 8192-token chunk stores or evicts at most 512 blocks of 16; a whole 37K-token store
encodes in ~0.8 ms), and a sender thread would spend it under the same interpreter lock, adding a hand-off and
a queue to keep in order. The replay socket is served by an asyncio task on the same loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq
import zmq.asyncio

from kvgate.engine.blocks import SeqKey
from kvgate.errors import UsageError, json_object
from kvgate.fleet.kvevents import (
    AllBlocksCleared,
    BlockHash,
    BlockRemoved,
    BlockStored,
    EventBatch,
    KVEvent,
    encode_batch,
)

log = logging.getLogger("kvgate.serve")

MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)
"""The replay's end marker (vLLM's ``ZmqEventPublisher.END_SEQ``)."""
LOOPBACK = ("127.0.0.1", "localhost", "*")
_FIELDS = {"enable_kv_cache_events", "publisher", "endpoint", "replay_endpoint", "buffer_steps", "hwm",
           "max_queue_size", "topic"}


@dataclass(frozen=True)
class KVEventsConfig:
    """vLLM's ``--kv-events-config`` (``vllm/config/kv_events.py``), and the event encoding kvgate adds."""

    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://127.0.0.1:5557"
    replay_endpoint: str | None = None
    buffer_steps: int = 10_000
    hwm: int = 100_000
    max_queue_size: int = 100_000
    """Accepted for vLLM's sake; kvgate sends without a queue."""
    topic: str = ""
    encoding: str = "map"
    """``map``: vLLM's tagged-map events (vLLM >= 0.11); ``array``: the older positional arrays."""

    @property
    def enabled(self) -> bool:
        return self.enable_kv_cache_events and self.publisher == "zmq"


def parse_kv_events_config(text: str, encoding: str = "map") -> KVEventsConfig:
    """The JSON of ``--kv-events-config``; raises :class:`UsageError` (one line) for anything else."""
    flag = "--kv-events-config"
    raw = json_object(text, flag)
    unknown = sorted(set(raw) - _FIELDS)
    if unknown:
        raise UsageError(f"{flag}: unknown field {unknown[0]!r} (known: {', '.join(sorted(_FIELDS))})")
    if encoding not in ("map", "array"):
        raise UsageError(f"--kv-events-encoding {encoding!r}: choose map or array")
    enable = raw.get("enable_kv_cache_events", False)
    publisher = raw.get("publisher", "zmq" if enable else "null")
    if not isinstance(enable, bool):
        raise UsageError(f"{flag}: enable_kv_cache_events must be true or false")
    if publisher not in ("zmq", "null"):
        raise UsageError(f"{flag}: publisher {publisher!r}: choose zmq or null")
    for k in ("buffer_steps", "hwm", "max_queue_size"):
        v = raw.get(k, 1)
        if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
            raise UsageError(f"{flag}: {k} must be a positive integer")
    topic = raw.get("topic", "")
    if not isinstance(topic, str):
        raise UsageError(f"{flag}: topic must be a string")
    endpoint = raw.get("endpoint", KVEventsConfig.endpoint)
    replay = raw.get("replay_endpoint")
    _check_endpoint("endpoint", endpoint)
    if replay is not None:
        _check_endpoint("replay_endpoint", replay)
        if replay == endpoint:
            raise UsageError(f"{flag}: endpoint and replay_endpoint must differ")
    return KVEventsConfig(
        enable_kv_cache_events=enable, publisher=publisher, endpoint=endpoint, replay_endpoint=replay,
        buffer_steps=raw.get("buffer_steps", KVEventsConfig.buffer_steps), hwm=raw.get("hwm", KVEventsConfig.hwm),
        max_queue_size=raw.get("max_queue_size", KVEventsConfig.max_queue_size), topic=topic, encoding=encoding,
    )


def _check_endpoint(name: str, ep: Any) -> None:
    """A ZMQ endpoint kvgate binds: ``ipc://PATH``, or ``tcp://HOST:PORT`` on loopback (``*`` binds 127.0.0.1)."""
    flag = "--kv-events-config"
    if not isinstance(ep, str):
        raise UsageError(f"{flag}: {name} must be a string")
    if ep.startswith("ipc://") and len(ep) > 6:
        return
    if not ep.startswith("tcp://") or ":" not in ep[6:]:
        raise UsageError(f"{flag}: {name} {ep!r}: expected tcp://127.0.0.1:PORT or ipc://PATH")
    host, _, port = ep[6:].rpartition(":")
    if host not in LOOPBACK:
        raise UsageError(f"{flag}: {name} {ep!r}: kvgate engine publishes on loopback only (127.0.0.1)")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"{flag}: {name} {ep!r}: bad port")


def bind_address(ep: str) -> str:
    """The address to bind for an endpoint (``*`` and ``localhost``: 127.0.0.1)."""
    if ep.startswith("tcp://"):
        _, _, port = ep[6:].rpartition(":")
        return f"tcp://127.0.0.1:{port}"
    return ep


class _Live:
    """What the publisher knows of the one request of a session key in the engine."""

    __slots__ = ("tokens", "hashes", "hint")

    def __init__(self, tokens: np.ndarray, hashes: list[int], hint: str | None) -> None:
        self.tokens = tokens
        self.hashes = hashes
        self.hint = hint


class KVEventPublisher:
    """The pool's observer and vLLM's ZMQ publisher in one (module docstring). :meth:`track` each request before
    it joins the engine, :meth:`untrack` it when it leaves; :meth:`publish` after every engine step and reset."""

    def __init__(self, cfg: KVEventsConfig, block_size: int) -> None:
        self.cfg = cfg
        self.block_size = block_size
        self._live: dict[int, _Live] = {}  # session key -> its request in the engine
        self._hints: dict[int, str] = {}  # session key -> the X-Session-ID of its latest request
        self._names: dict[int, list[BlockHash]] = {}  # session key (or orphan) -> hash of each session block
        # the last store's session key, the session blocks it reached, and the names it replaced (a capped
        # continuation, whose admission forgets the session's old content right after: see forgot)
        self._last: tuple[int, int] = (0, 0)
        self._displaced: dict[int, BlockHash] = {}
        self._group_names: dict[tuple[int, int], list[BlockHash]] = {}
        self._events: list[KVEvent] = []
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=cfg.buffer_steps)
        self.seq = 0
        """The sequence number of the next batch (vLLM's count from 0)."""
        self.unnamed = 0
        """Evictions of blocks the publisher had no hash for (a bug if ever non-zero)."""
        self._topic = cfg.topic.encode()
        self._ctx: zmq.Context[zmq.Socket[bytes]] | None = None
        self._pub: zmq.Socket[bytes] | None = None
        self._router: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None

    # -- sockets ----------------------------------------------------------------------------------------
    def start(self) -> None:
        """Bind the PUB socket (and the replay ROUTER, served on the running asyncio loop)."""
        ctx: zmq.Context[zmq.Socket[bytes]] = zmq.Context()
        self._ctx = ctx
        try:
            pub = ctx.socket(zmq.PUB)
            pub.setsockopt(zmq.LINGER, 0)
            pub.set_hwm(self.cfg.hwm)
            self._pub = pub
            pub.bind(bind_address(self.cfg.endpoint))
            if self.cfg.replay_endpoint is not None:
                actx = zmq.asyncio.Context.shadow(ctx.underlying)
                router = actx.socket(zmq.ROUTER)
                router.setsockopt(zmq.LINGER, 0)
                self._router = router
                router.bind(bind_address(self.cfg.replay_endpoint))
                self._task = asyncio.get_running_loop().create_task(self._serve_replay(), name="kv-events-replay")
        except zmq.ZMQError as e:
            self.close()
            raise UsageError(f"--kv-events-config: cannot bind: {e}") from None

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self.close()

    def close(self) -> None:
        for s in (self._pub, self._router):
            if s is not None:
                s.close(linger=0)
        self._pub = self._router = None
        if self._ctx is not None:
            self._ctx.term()
            self._ctx = None

    async def _serve_replay(self) -> None:
        router = self._router
        assert router is not None
        while True:
            frames = await router.recv_multipart()
            if len(frames) != 3 or len(frames[2]) != 8:
                log.warning("kv events: bad replay request (%d frames)", len(frames))
                continue
            ident, start = frames[0], int.from_bytes(frames[2], "big")
            for i, (seq, payload) in enumerate([m for m in self._buffer if m[0] >= start]):
                await router.send_multipart([ident, b"", self._topic, seq.to_bytes(8, "big"), payload])
                if i % 256 == 255:
                    await asyncio.sleep(0)  # a long replay does not hold up the engine loop
            await router.send_multipart([ident, b"", b"", END_SEQ, b""])

    def publish(self) -> None:
        """Send the events queued since the last call as one batch (none: nothing is sent)."""
        if not self._events:
            return
        batch = EventBatch(time.time(), tuple(self._events), 0)
        self._events = []
        payload = encode_batch(batch, self.cfg.encoding)
        seq = self.seq
        self.seq += 1
        self._buffer.append((seq, payload))
        if self._pub is not None:
            # past its high-water mark a PUB socket drops (the replay buffer still has it)
            with contextlib.suppress(zmq.Again):
                self._pub.send_multipart([self._topic, seq.to_bytes(8, "big"), payload], flags=zmq.NOBLOCK)

    # -- requests -----------------------------------------------------------------------------------------
    def track(self, seq: SeqKey, tokens: np.ndarray, hashes: list[int], hint: str | None) -> None:
        """The request of session key ``seq`` (prompt + output ``tokens``, their chained block ``hashes``) is
        about to join the engine."""
        self._live[seq.session] = _Live(tokens, hashes, hint)
        if hint is not None:
            self._hints[seq.session] = hint

    def untrack(self, seq: SeqKey) -> None:
        self._live.pop(seq.session, None)

    def hint_of(self, sid: int) -> str | None:
        return self._hints.get(sid)

    def group_hashes(self) -> set[BlockHash]:
        """The hashes of every group-prefix block named since the last reset (shared-prefix content)."""
        return {h for names in self._group_names.values() for h in names}

    # -- the pool's observer ------------------------------------------------------------------------------
    def stored(self, seq: SeqKey, first: int, last: int) -> None:
        live = self._live.get(seq.session)
        if live is None:  # NOTE: every request is tracked before it joins; a store without one is a bug
            raise RuntimeError(f"kv events: a store for session key {seq.session} without its request")
        hashes = live.hashes
        gb = seq.group_blocks
        if first < gb:
            gn = self._group_names.setdefault((seq.group, gb), [])
            for i in range(len(gn), min(last, gb)):
                gn.append(hashes[i])
        if last > gb:
            sid = seq.session
            names = self._names.setdefault(sid, [])
            if self._last[0] != sid:
                self._displaced = {}
            self._last = (sid, last - gb)
            displaced = self._displaced
            for i in range(max(first, gb) - gb, last - gb):
                h = hashes[gb + i]
                if i < len(names):
                    old = names[i]
                    if old != h:
                        displaced.setdefault(i, old)
                        names[i] = h
                else:
                    names.append(h)
        bs = self.block_size
        parent = hashes[first - 1] if first else None
        tokens = tuple(live.tokens[first * bs : last * bs].tolist())
        self._events.append(BlockStored(tuple(hashes[first:last]), parent, tokens, bs, None, MEDIUM, 0, live.hint))

    def evicted(self, sid: int, lo: int, hi: int) -> None:
        names = self._names.get(sid)
        ev = self._events
        for i in range(hi - 1, lo - 1, -1):
            if names is None or i >= len(names):
                self.unnamed += 1
                continue
            ev.append(BlockRemoved((names[i],), MEDIUM, 0))

    def evicted_group(self, key: tuple[int, int], idx: int) -> None:
        names = self._group_names.get(key)
        if names is None or idx >= len(names):
            self.unnamed += 1
            return
        self._events.append(BlockRemoved((names[idx],), MEDIUM, 0))

    def forgot(self, sid: int, rel: int, orphan: int | None) -> None:
        """The admission of a capped continuation of ``sid``: its content from session block ``rel`` on is the new
        request's. The old names go with the orphaned blocks; the session keeps the common prefix and what the
        new request stored."""
        last, upto = self._last
        displaced = self._displaced if last == sid else {}
        self._displaced = {}
        self._last = (0, 0)
        names = self._names.get(sid)
        if names is None:
            return
        if orphan is not None:
            self._names[orphan] = [displaced.get(i, h) for i, h in enumerate(names)]
            hint = self._hints.get(sid)
            if hint is not None:  # the orphaned blocks were stored by the session's requests
                self._hints[orphan] = hint
        del names[max(rel, upto if last == sid else 0) :]

    def cleared(self) -> None:
        self._names.clear()
        self._displaced.clear()
        self._group_names.clear()
        self._events.append(AllBlocksCleared())

    # -- inspection ---------------------------------------------------------------------------------------
    def resident(
        self, groups: list[tuple[tuple[int, int], int, int]], sessions: list[tuple[int, int, int]]
    ) -> tuple[dict[BlockHash, int], dict[int, set[BlockHash]]]:
        """The pool's cached copies (``RunKVPool.cached_blocks``) by hash: copies per hash, and the hashes held in
        each session key's own blocks."""
        copies: dict[BlockHash, int] = {}
        own: dict[int, set[BlockHash]] = {}
        for key, idx, n in groups:
            h = self._group_names[key][idx]
            copies[h] = copies.get(h, 0) + n
        for sid, lo, hi in sessions:
            names = self._names[sid]
            mine = own.setdefault(sid, set())
            for i in range(lo, hi):
                h = names[i]
                copies[h] = copies.get(h, 0) + 1
                mine.add(h)
        return copies, own
