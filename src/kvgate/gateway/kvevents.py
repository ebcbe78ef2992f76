"""A consumer of vLLM's KV cache events: one ZMQ SUB socket per replica, folded into its :class:`Residency`.

vLLM publishes when started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558"}'``; ``kvgate engine --kv-events-config`` (the same JSON)
publishes the same messages. Messages are ``(topic, seq, payload)`` (:mod:`kvgate.fleet.kvevents`). A SUB socket
may miss messages (it joins late, or the publisher's high-water mark drops them): with a replay endpoint the
consumer asks the publisher's ROUTER socket for what it missed — from sequence 0 when it joins, and across any
gap later — and counts only the gaps it could not fill.

A publisher that restarts (its engine did) numbers from 0 again: a live message at or below the last sequence
applied means that, and the view starts anew (:attr:`restarts`). The gateway clears a replica's view when it marks
the replica down or up (:meth:`reset`). The consumer never stops on its own: a bad message is counted and skipped,
a socket error is logged and the socket made again after a pause (ZMQ itself reconnects a SUB socket whose
publisher is not there yet, or went away; its socket monitor's events are logged: connected, gone, not there yet).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Hashable

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from kvgate.fleet.kvevents import BlockStored, EventBatch, KVEventError, Residency, decode_message
from kvgate.gateway.config import GatewayConfig
from kvgate.gateway.fleet import Fleet
from kvgate.gateway.sessions import Sessions
from kvgate.http.signals import cancel
from kvgate.policy import Control, PolicyError, Timer

log = logging.getLogger("kvgate.gateway")

END_SEQ = -1
"""The sequence number of the replay's end marker (vLLM's ``ZmqEventPublisher.END_SEQ``)."""
RETRY_S = 1.0
"""Real seconds before a socket that failed is made again."""
_WATCHED = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED


class KVEventSubscriber:
    """Follows one publisher. ``await start()``, read :attr:`residency`, ``await stop()``."""

    def __init__(
        self, endpoint: str, *, replay_endpoint: str | None = None, topic: str = "",
        residency: Residency | None = None, replay_timeout_s: float = 2.0,
        on_change: Callable[[EventBatch | None], None] | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.residency = residency if residency is not None else Residency()
        self.replay_timeout_s = replay_timeout_s
        self.on_change = on_change
        """Called with every live batch applied, and with None after a replay (many batches), so the gateway can
        re-read what changed."""
        self.messages = 0
        self.bad_messages = 0
        self.replayed = 0
        self.restarts = 0
        """Times the publisher numbered from 0 again (its engine restarted): the view started anew."""
        self.errors = 0
        """Socket errors (each logged; the socket is made again after :data:`RETRY_S`)."""
        self.peer = False
        """ZMQ is connected to the publisher now (its socket monitor says so)."""
        self._synced = False
        self._failing = 0
        """Socket errors since the last message."""
        self._ctx = zmq.asyncio.Context.instance()
        self._sub: zmq.asyncio.Socket | None = None
        self._mon: zmq.asyncio.Socket | None = None
        self._task: asyncio.Task[None] | None = None
        self._watch_task: asyncio.Task[None] | None = None
        self.connected = asyncio.Event()
        """Set once a message has arrived."""

    async def start(self) -> None:
        try:
            self._connect()
        except zmq.ZMQError as e:  # (the task tries again)
            self.errors += 1
            log.warning("kv events from %s: %s (again in %gs)", self.endpoint, e, RETRY_S)
            self._close()
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"kv-events {self.endpoint}")

    def _connect(self) -> None:
        sub = self._ctx.socket(zmq.SUB)
        sub.setsockopt(zmq.LINGER, 0)
        sub.setsockopt_string(zmq.SUBSCRIBE, self.topic)
        self._sub = sub
        self._mon = mon = sub.get_monitor_socket(_WATCHED)
        loop = asyncio.get_running_loop()
        self._watch_task = loop.create_task(self._watch(mon), name=f"kv-events-monitor {self.endpoint}")
        sub.connect(self.endpoint)

    def _close(self) -> None:
        if self._watch_task is not None:
            self._watch_task.cancel()
            self._watch_task = None
        if self._sub is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._sub.disable_monitor()
            self._sub.close(linger=0)
            self._sub = None
        if self._mon is not None:
            self._mon.close(linger=0)
            self._mon = None
        self.peer = False

    async def stop(self) -> None:
        await cancel(self._task)
        self._task = None
        await cancel(self._watch_task)
        self._watch_task = None
        self._close()

    async def _watch(self, mon: zmq.asyncio.Socket) -> None:
        """Log what ZMQ does about the publisher: connected, gone, or not there yet (it keeps trying)."""
        retried = False
        while True:
            try:
                ev = parse_monitor_message(await mon.recv_multipart())
            except zmq.ZMQError:
                return  # (the socket was closed)
            kind = ev["event"]
            if kind == zmq.EVENT_CONNECTED:
                self.peer, retried = True, False
                log.info("kv events: connected to %s", self.endpoint)
            elif kind == zmq.EVENT_DISCONNECTED:
                self.peer = False
                log.warning("kv events: %s went away; ZMQ reconnects", self.endpoint)
            elif kind == zmq.EVENT_CONNECT_RETRIED and not retried:
                retried = True
                log.warning("kv events: no publisher at %s yet; ZMQ keeps trying", self.endpoint)

    def reset(self) -> None:
        """Forget the replica's view (it went down or came back): unknown until the next message."""
        self.residency.clear()
        self._synced = False

    @property
    def synced(self) -> bool:
        """A message was applied since the view last started, and none was lost since: :meth:`known` answers."""
        return self._synced and self.residency.exact

    def known(self, session: object) -> int | None:
        """The session's resident tokens on this replica, or None when the view cannot say: not synced yet, a
        message lost since the view last started from empty, or no store of the session seen named since then."""
        if not self.synced or not isinstance(session, str):
            return None
        return self.residency.known_tokens(session)

    def stats(self) -> dict[str, object]:
        """What the consumer sees and how its stream went (``GET /v1/sessions``, ``/kvgate/info``, ``/metrics``)."""
        res = self.residency
        return {
            "endpoint": self.endpoint, "replay_endpoint": self.replay_endpoint, "connected": self.peer,
            "synced": self.synced,
            "resident_tokens": res.resident_tokens, "sessions": len(res.session_tokens), "events": res.events,
            "messages": self.messages, "replayed": self.replayed, "gaps": res.gaps, "clears": res.clears,
            "restarts": self.restarts, "bad_messages": self.bad_messages, "errors": self.errors,
            "last_seq": res.last_seq,
        }

    async def _run(self) -> None:
        if self._sub is None:
            await asyncio.sleep(RETRY_S)
        while True:
            try:
                if self._sub is None:
                    self._connect()
                await self._follow()
            except zmq.ZMQError as e:
                self.errors += 1
                # (the same error again every second is logged once, at warning; then at debug)
                self._failing += 1
                level = logging.WARNING if self._failing == 1 else logging.DEBUG
                log.log(level, "kv events from %s: %s (again in %gs)", self.endpoint, e, RETRY_S)
                self._close()
                await asyncio.sleep(RETRY_S)
            except Exception:  # never let a bug stop the consumer (nor the gateway)
                self.errors += 1
                log.exception("kv events from %s failed (again in %gs)", self.endpoint, RETRY_S)
                await asyncio.sleep(RETRY_S)

    async def _follow(self) -> None:
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
                # live messages come in order, and a replay applies only what precedes the live one: the
                # publisher numbers from 0 again (its engine restarted), so its cache is new
                self.restarts += 1
                log.info("kv events from %s restarted at seq %d (last %d)", self.endpoint, seq, last)
                self.reset()
                last = None
            want = 0 if last is None else last + 1
            if seq > want and self.replay_endpoint is not None:
                await self._replay(want, seq)
                if self.on_change is not None:
                    self.on_change(None)
            if seq > want and self.residency.last_seq is None:
                self.residency.gaps += 1  # joined mid-stream, and nothing replayed to catch up
            self.residency.apply_message(seq, batch)
            self.messages += 1
            self._synced = True
            self._failing = 0
            if self.on_change is not None:
                self.on_change(batch)

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


class FleetEvents:
    """The consumers of a fleet's followed replicas (``--kv-events``) and what the gateway does with them: each
    replica's view is its router score (``Replica.resident``) and, through :meth:`resident_tokens`, every policy's
    ``Policy.residency``; after a batch that evicted or cleared blocks, the policies with held turns get a
    ``Timer`` (one for the burst), since a residency-corrected D may admit them now. ``start()``, ``await stop()``."""

    def __init__(
        self, fleet: Fleet, cfg: GatewayConfig, sessions: Sessions, now: Callable[[], float],
        wake: Callable[[], None],
    ) -> None:
        self.fleet = fleet
        self.sessions = sessions
        self.now = now
        self.wake = wake
        self.active = False
        self._pending = False
        for rep in fleet.replicas:
            src = cfg.kv_events_of(rep.index)
            if src is not None:
                rep.events = KVEventSubscriber(src.endpoint, replay_endpoint=src.replay_endpoint,
                                               on_change=self.changed)
                rep.resident = rep.events.residency.tokens_of
        self.followed = [rep for rep in fleet.replicas if rep.events is not None]
        if self.followed:
            fleet.residency = self.resident_tokens

    async def start(self) -> None:
        for rep in self.followed:
            ev = rep.events
            await ev.start()
            log.info("following KV events", extra={"event": "kv_events", "replica": rep.url, "endpoint": ev.endpoint,
                                                   "replay_endpoint": ev.replay_endpoint})
        self.active = True

    async def stop(self) -> None:
        self.active = False
        for rep in self.followed:
            await rep.events.stop()

    def check(self, control: Control) -> None:
        """``PolicyError`` for a control that reads residency when no replica is followed."""
        if control.needs_residency and not self.followed:
            raise PolicyError(f"control {control.name!r} corrects D with measured residency: start the gateway "
                              "with --kv-events")

    def resident_tokens(self, sid: Hashable) -> int | None:
        """The session's resident tokens on its replica; None when unknown (no KV events there, the replica is
        down, its view is not exact, or the session was never seen named there)."""
        s = self.sessions.by_id.get(sid)
        rep = None if s is None else s.replica
        if rep is None or rep.events is None or not rep.up:
            return None
        return rep.events.known(sid)  # type: ignore[no-any-return]

    def changed(self, batch: EventBatch | None) -> None:
        if self._pending or not self.active or not self.fleet.control.needs_residency:
            return
        if batch is not None and all(type(e) is BlockStored for e in batch.events):
            return  # stores only add residency: they never free budget
        self._pending = True
        asyncio.get_running_loop().call_soon(self._nudge)

    def _nudge(self) -> None:
        self._pending = False
        if not self.active:
            return
        now = self.now()
        for policy in list(self.fleet.policies()):
            c = policy.counts()
            if c["parked"] or c["waiting"]:
                self.sessions.apply(policy.handle(Timer(now)))
        self.wake()
