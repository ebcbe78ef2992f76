"""A consumer of vLLM's KV cache events: one ZMQ SUB socket per replica, folded into its :class:`Residency`.

vLLM publishes when started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'``; ``kvgate engine --kv-events-config`` (the same JSON)
publishes the same messages. Messages are ``(topic, seq, payload)`` (:mod:`kvgate.fleet.kvevents`). A SUB socket
may miss messages (it joins late, or the publisher's high-water mark drops them): with a replay endpoint the
consumer asks the publisher's ROUTER socket for what it missed — from sequence 0 when it joins, and across any
gap later — and counts only the gaps it could not fill.
"""

from __future__ import annotations

import asyncio
import logging

import zmq
import zmq.asyncio

from kvgate.fleet.kvevents import KVEventError, Residency, decode_message
from kvgate.http.signals import cancel

log = logging.getLogger("kvgate.gateway")

END_SEQ = -1
"""The sequence number of the replay's end marker (vLLM's ``ZmqEventPublisher.END_SEQ``)."""


class KVEventSubscriber:
    """Follows one publisher. ``await start()``, read :attr:`residency`, ``await stop()``."""

    def __init__(
        self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
        residency: Residency | None = None, replay_timeout_s: float = 2.0,
    ) -> None:  # fmt: skip
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.residency = residency if residency is not None else Residency()
        self.replay_timeout_s = replay_timeout_s
        self.messages = 0
        self.bad_messages = 0
        self.replayed = 0
        self._ctx = zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()

    async def start(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        sub.connect(self.endpoint)
        self._sub = sub
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events {self.endpoint}")

    async def stop(self) -> None:
        await cancel(self._task)
        self._task = None
        if self._sub is not None:
            self._sub.close(linger=0)
            self._sub = None

    async def _run(self) -> None:
        assert self._sub is not None
        while True:
            frames = await self._sub.recv_multipart()
            self.connected.set()
            try:
                seq, batch = decode_message(frames)
            except KVEventError as e:
                self.bad_messages += 1
                if self.bad_messages == 1:
                    log.warning("kv events from %s: %s", self.endpoint, e)
                continue
            last = self.residency.last_seq
            if last is not None and seq <= last:
                continue  # already applied (a replay overlapped)
            want = 0 if last is None else last + 1
            if seq > want and self.replay_endpoint is not None:
                await self._replay(want, seq)
            elif seq > want and last is None:
                self.residency.gaps += 1  # joined mid-stream, and no replay to catch up
            self.residency.apply_message(seq, batch)
            self.messages += 1

    async def _replay(self, start: int, until: int) -> None:
        """Apply what the publisher still buffers from ``start`` up to (not including) ``until``."""
        assert self.replay_endpoint is not None
        req = self._ctx.socket(zmq.DEALER)
        req.setsockopt(zmq.LINGER, 0)
        req.connect(self.replay_endpoint)
        try:
            await req.send_multipart([b"", start.to_bytes(8, "big")])
            while True:
                frames = await asyncio.wait_for(req.recv_multipart(), self.replay_timeout_s)
                if len(frames) != 4:
                    return
                seq = int.from_bytes(frames[2], "big", signed=True)
                if seq == END_SEQ:
                    return
                last = self.residency.last_seq
                if seq >= until or (last is not None and seq <= last):
                    continue
                if last is None and seq != start:
                    # the buffer no longer reaches back to ``start``: the view starts mid-stream
                    self.residency.gaps += 1
                try:
                    _, batch = decode_message(frames[1:])
                except KVEventError:
                    self.bad_messages += 1
                    continue
                self.residency.apply_message(seq, batch)
                self.replayed += 1
        except TimeoutError:
            log.warning("kv events replay from %s timed out", self.replay_endpoint)
        finally:
            req.close(linger=0)
