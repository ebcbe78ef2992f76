"""``kvgate engine``: the simulated engine served over HTTP in scaled real time, with vLLM's API surface.

Theory of operation. One asyncio task (:class:`EngineLoop`) owns the simulated engine (the same
:class:`~kvgate.engine.vllm.VllmEngine` or :class:`~kvgate.engine.sglang.SglangEngine` the in-process simulator
drives) and keeps its virtual clock at ``time_scale`` times the real one::

    HTTP handler ──parse, tokenize──▶ ContentBridge ──SeqKey──▶ Request ──eng.add──▶ ┐
         ▲                                                                          │ engine loop:
         │ first token, progress, finish: set the turn's event                      │  step(now, now + slice)
         └────────────────────────────────────────────────────────────────────────── │  sleep duration / scale
                                                                                    ┘  deliver what happened

A step is computed when it starts (``eng.step(now, horizon)``) and its results are delivered when its real
deadline ``t0 + (now + duration) / time_scale`` has come, so a client sees tokens when the simulated GPU would
have produced them. Steps follow each other back to back in virtual time; an idle engine resumes at the
arrival time of the request that woke it. A request is stamped with the virtual time it reached the server and
joins the engine at the first step boundary at or after that stamp, as in the simulator: at a boundary the loop
waits a little (3 ms real at most) for requests still being parsed that arrived before it, so parsing costs no
virtual time. The horizon is ``now`` plus ``slice_ms`` of real time (or the next known arrival), so a decode
jump (many identical decode steps in one call) ends soon enough for a new arrival to join the batch. A client
that disconnects aborts its request (``eng.abort``: its blocks are freed).

Token identity (the content bridge). The engines name cached content by :class:`~kvgate.engine.blocks.SeqKey`
(a group prefix shared by sessions, then tokens unique to one session, append-only), not by token hashes. The
bridge maps every request's token sequence (prompt + the deterministic filler output it will produce) onto a
SeqKey so that equal keys always mean equal tokens. It hashes full 16-token blocks chained, as vLLM does, and
remembers which session key holds which content::

    prompt blocks:  | b0 | b1 | ... | b124 | b125 | ... | b400 | b401 ... |
                    '--- group g (seen in two sessions) ---'
                                          '-- session s: its previous prompt + output --'-- new --'

* If the prompt extends the whole previous content of an idle session s (prompt + output of its last
  request), the request continues s: its hit is exactly the simulator's.
* If it covers s's previous prompt but diverges inside s's content (a retry, an edited output), or names the
  same ``X-Session-ID`` as s's last request, it continues s with its lookup capped at the common blocks
  (vLLM engine; the cap makes the pool drop the stale tail). The SGLang engine cannot cap, so it forks.
* Otherwise it is a new session key. Its group is the longest known group prefix it starts with; if it shares
  more blocks with another session's content than that, the common block-aligned prefix becomes a new group.
* The header ``X-Session-ID`` (or body ``session_id``) is only a hint; correctness never depends on it.

Approximations (docs/engine-server.md): the first session to carry a shared prefix keeps it in its own
session region (the group forms when a second session arrives, so that second session misses the shared
prefix once); groups do not nest; a session key keeps only its newest branch; a request forked off a session
that is busy, or (SGLang) that diverges inside it, hits only its group prefix.
"""

from __future__ import annotations

import asyncio
import contextlib
import heapq
import logging
import math
import os
import sys
import time
from collections import OrderedDict, deque
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass
from typing import Any

import click
import numpy as np
import orjson
from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvgate import __version__
from kvgate.engine.base import Request, StepResult
from kvgate.engine.blocks import SeqKey
from kvgate.engine.capped import CappedKVPool
from kvgate.engine.costmodel import profile as get_profile
from kvgate.engine.factory import EngineConfig, build_engine
from kvgate.errors import ClientError, UsageError
from kvgate.http.openai import error_body
from kvgate.http.signals import settle_for_serving, until_signalled
from kvgate.http.sse import DONE, ChunkWriter, error_event
from kvgate.http.tokenizer import (
    BLOCK,
    VOCAB_SIZE,
    TokenizeError,
    Tokenizer,
    block_hashes,
    filler_array,
    filler_text,
)

_loads: Callable[[bytes], Any] = orjson.loads  # parses a 40K-token prompt ~2.5x faster than json
_dumps: Callable[[Any], bytes] = orjson.dumps


log = logging.getLogger("kvgate.engine_server")

MODEL_NAMES = {"qwen3-8b-mi300x": "Qwen/Qwen3-8B", "qwen3-32b-mi300x": "Qwen/Qwen3-32B"}
"""Default served model name per profile (any other profile serves under its own name)."""
DEFAULT_COMPLETION_MAX_TOKENS = 16
"""OpenAI's default for /v1/completions."""
DEFAULT_CHAT_MAX_TOKENS = 256
"""Without max_tokens a model would stop at EOS; the simulated one has no EOS, so chat defaults to this."""
BRIDGE_MEMORY = 4
"""The bridge remembers the content of idle sessions up to this many times the pool's blocks (LRU)."""
MAX_GROUPS = 4096


# -- errors -------------------------------------------------------------------------------------------------
class ApiError(ClientError):
    """An error answered as vLLM does: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> None:
        super().__init__(message)
        self.http_status = status
        self.kind = kind
        self.param = param

    def response(self) -> web.Response:
        return _error(self.http_status, str(self), self.kind, self.param)


def _error(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    return web.Response(status=status, body=error_body(status, message, kind, param), content_type="application/json")


# -- the content bridge: token sequences -> SeqKey ---------------------------------------------------------
class _Content:
    """What one SeqKey session holds: the chained block hashes and tail of its newest content."""

    __slots__ = ("key", "gb", "hashes", "tail", "length", "prompt_blocks", "busy", "hint", "alive")

    def __init__(self, key: SeqKey, gb: int) -> None:
        self.key = key
        self.gb = gb  # group prefix in bridge blocks
        self.hashes: list[int] = []  # full blocks of prompt + output of its newest request
        self.tail: tuple[int, ...] = ()  # tokens after the last full block
        self.length = 0
        self.prompt_blocks = 0  # full blocks of the newest request's prompt
        self.busy = False  # a request of this key is in the engine
        self.hint: str | None = None
        self.alive = True


class ContentBridge:
    """Maps requests' token sequences onto SeqKeys so that a key's content is always one token sequence.

    ``caps``: the engine pool's per-session hit caps (:class:`CappedKVPool`), or None when the engine cannot
    cap; with caps a session key can continue with a request that diverges inside its content. The bridge
    remembers idle sessions' content up to ``max_blocks`` blocks, least recently used forgotten first (a
    forgotten session's next request gets a new key). See the module docstring."""

    def __init__(self, engine_block: int, *, caching: bool, caps: dict[int, int] | None, max_blocks: int) -> None:
        self.block = bridge_block(engine_block)
        """Tokens per bridge block: the engine's block when it is a multiple of 16, else 16."""
        self.per_block = self.block // engine_block  # engine blocks per bridge block
        self.caching = caching
        self.caps = caps
        self.max_blocks = max_blocks
        self._index: dict[int, _Content] = {}  # hash of block i -> a session whose content has it at block i
        self._groups: dict[int, tuple[int, int]] = {}  # hash of a group's last block -> (group id, blocks)
        self._group_lens: list[int] = []  # distinct group lengths, longest first
        self._hints: dict[str, _Content] = {}
        self._idle: OrderedDict[int, _Content] = OrderedDict()  # LRU of idle sessions
        self._blocks = 0  # blocks held by live _Content entries
        self._next_sid = 0
        self._next_gid = 0
        self.counts = {"continued": 0, "capped": 0, "new": 0, "forked": 0, "groups": 0, "forgotten": 0}

    def assign(self, tokens: np.ndarray, prompt_len: int, hint: str | None) -> tuple[SeqKey, _Content]:
        """The key for a request whose full token sequence (prompt + output, int64) is ``tokens``. Marks it
        busy."""
        if not self.caching:
            self._next_sid += 1
            c = _Content(SeqKey(0, 0, self._next_sid), 0)
            c.busy = True
            self.counts["new"] += 1
            return c.key, c
        B = self.block
        hashes = block_hashes(tokens, B)
        p = prompt_len // B
        s, m = self._deepest(hashes, p)
        if hint is not None:
            hs = self._hints.get(hint)
            if hs is not None and hs is not s and hs.alive:
                mh = _common(hs.hashes, hashes, p)
                if mh > hs.gb and mh >= m:
                    s, m = hs, mh
        cont: _Content | None = None
        cap: int | None = None
        group = self._best_group(hashes, p)
        if s is not None:
            full = m == len(s.hashes) and s.length <= prompt_len and tuple(tokens[m * B : s.length].tolist()) == s.tail
            same = full or m >= s.prompt_blocks or (hint is not None and hint == s.hint)
            if same and m > s.gb:
                if not s.busy and (full or self.caps is not None):
                    cont = s
                    cap = None if full else m * B
                else:
                    self.counts["forked"] += 1
            elif m > (group[1] if group else 0) and len(self._groups) < MAX_GROUPS:
                group = self._new_group(hashes[m - 1], m)
        if cont is None:
            self._next_sid += 1
            gid, gb = group if group else (0, 0)
            cont = _Content(SeqKey(gid, gb * self.per_block, self._next_sid), gb)
            start = 0
            self.counts["new"] += 1
        else:
            self._idle.pop(cont.key.session, None)
            start = m
            self.counts["capped" if cap is not None else "continued"] += 1
        if self.caps is not None:
            if cap is None:
                self.caps.pop(cont.key.session, None)
            else:
                self.caps[cont.key.session] = cap
        self._blocks += len(hashes) - len(cont.hashes)
        cont.hashes = hashes
        cont.tail = tuple(tokens[len(hashes) * B :].tolist())
        cont.length = len(tokens)
        cont.prompt_blocks = p
        cont.busy = True
        if hint is not None:
            cont.hint = hint
            self._hints[hint] = cont
        index = self._index
        for i in range(start, len(hashes)):
            index[hashes[i]] = cont
        return cont.key, cont

    def release(self, c: _Content) -> None:
        """The request of ``c`` left the engine (finished or aborted)."""
        if not c.busy:
            return
        c.busy = False
        if not self.caching or not c.alive:
            return
        self._idle[c.key.session] = c
        while self._blocks > self.max_blocks and self._idle:
            _, old = self._idle.popitem(last=False)
            self._forget(old)

    def _forget(self, c: _Content) -> None:
        index = self._index
        for h in c.hashes:
            if index.get(h) is c:
                del index[h]
        self._blocks -= len(c.hashes)
        c.alive = False
        c.hashes = []
        if c.hint is not None and self._hints.get(c.hint) is c:
            del self._hints[c.hint]
        if self.caps is not None:
            self.caps.pop(c.key.session, None)
        self.counts["forgotten"] += 1

    def _deepest(self, hashes: list[int], p: int) -> tuple[_Content | None, int]:
        """The live session whose content shares the most full prompt blocks with ``hashes``, and how many."""
        index = self._index
        get = index.get
        for i in range(p - 1, -1, -1):
            c = get(hashes[i])
            if c is not None and i < len(c.hashes) and c.hashes[i] == hashes[i]:  # NOTE: stale entries fail this
                return c, i + 1
        return None, 0

    def _best_group(self, hashes: list[int], p: int) -> tuple[int, int] | None:
        groups = self._groups
        for n in self._group_lens:
            if n <= p:
                g = groups.get(hashes[n - 1])
                if g is not None and g[1] == n:
                    return g
        return None

    def _new_group(self, last_hash: int, n: int) -> tuple[int, int]:
        self._next_gid += 1
        g = (self._next_gid, n)
        self._groups[last_hash] = g
        if n not in self._group_lens:
            self._group_lens.append(n)
            self._group_lens.sort(reverse=True)
        self.counts["groups"] += 1
        return g

    def stats(self) -> dict[str, int]:
        return {**self.counts, "indexed_blocks": len(self._index), "idle_sessions": len(self._idle)}


def bridge_block(engine_block: int) -> int:
    """The bridge's hash block for an engine block size: the engine's own when it is a multiple of 16 (vLLM's
    16, its CPU build's 128), else 16 when the engine block divides it (SGLang's page of 1 token)."""
    if engine_block > 0 and engine_block % BLOCK == 0:
        return engine_block
    if engine_block > 0 and BLOCK % engine_block == 0:
        return BLOCK
    raise ValueError(f"engine block size {engine_block} must divide {BLOCK} or be a multiple of it")


def _common(a: list[int], b: list[int], limit: int) -> int:
    """Length of the common prefix of two chained-hash lists (binary search: chained means prefix-closed)."""
    lo, hi = 0, min(len(a), len(b), limit)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if a[mid - 1] == b[mid - 1]:
            lo = mid
        else:
            hi = mid - 1
    return lo


# -- the engine loop ----------------------------------------------------------------------------------------
class _Turn:
    """One request in flight: what its handler waits for."""

    __slots__ = ("req", "content", "stream", "visible", "done", "error", "wake")

    def __init__(self, req: Request, content: _Content, stream: bool) -> None:
        self.req = req
        self.content = content
        self.stream = stream
        self.visible = 0  # output tokens delivered (produced by steps whose real deadline has passed)
        self.done = False
        self.error: str | None = None
        self.wake = asyncio.Event()


class EngineLoop:
    """Owns the engine; steps it in scaled real time and delivers what each step did (module docstring).

    Arrivals. A request is stamped with the virtual time it reached the server (:meth:`expect`) and joins the
    engine at the first step boundary at or after that stamp, as in the simulator, however long parsing and
    hashing it took: at a boundary the loop waits (at most ``MAX_WAIT_S`` real seconds) for requests still
    being parsed that arrived before it, and a jump never runs past a known arrival. The wait delays that
    step's delivery, not its virtual time; the following steps catch up."""

    MAX_WAIT_S = 0.003

    def __init__(self, engine: Any, bridge: ContentBridge, time_scale: float, slice_s: float) -> None:
        self.engine = engine
        self.bridge = bridge
        self.scale = time_scale
        self.slice_v = slice_s * time_scale
        self.vt = 0.0  # engine's virtual time: the end of the last step, or the clock when idle
        self._t0 = 0.0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._changed: asyncio.Event | None = None
        self._task: asyncio.Task[None] | None = None
        self._stalled = False
        self._expected: dict[int, float] = {}  # requests being parsed: token -> arrival (virtual)
        self._token = 0
        self._pending: list[tuple[float, int, _Turn]] = []  # submitted, not yet in the engine (heap by arrival)
        self.active: set[_Turn] = set()
        self._streams: set[_Turn] = set()
        self.dead: str | None = None
        self.lag = 0.0  # virtual seconds the engine was behind the clock at the last step
        self.lag_max = 0.0
        self.lags: deque[float] = deque(maxlen=4096)  # lag at the last steps
        self.late = 0  # arrivals not ready within MAX_WAIT_S of their step boundary
        self.prompt_tokens = 0
        self.generation_done = 0
        self.finished = 0
        self.aborted = 0

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._loop = loop
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        self._t0 = loop.time()
        self._task = loop.create_task(self._run(), name="kvgate-engine-loop")

    async def stop(self, reason: str = "the server is shutting down") -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
        self._fail_all(reason)

    def vnow(self) -> float:
        assert self._loop is not None
        return (self._loop.time() - self._t0) * self.scale

    def expect(self) -> tuple[int, float]:
        """A request reached the server: a token for :meth:`submit` or :meth:`forget`, and its arrival time."""
        t = self.vnow()
        self._token += 1
        self._expected[self._token] = t
        return self._token, t

    def forget(self, token: int) -> None:
        """The request ``token`` will not be submitted (it was refused, or the client left)."""
        if self._expected.pop(token, None) is not None:
            assert self._changed is not None
            self._changed.set()

    def submit(self, turn: _Turn, token: int) -> None:
        """Queue a parsed request; it joins the engine at the first step boundary at or after its arrival."""
        if self.dead is not None:
            raise ApiError(503, f"engine failed: {self.dead}", "ServiceUnavailableError")
        self._expected.pop(token, None)
        heapq.heappush(self._pending, (turn.req.t_submit, token, turn))
        self.active.add(turn)
        if turn.stream:
            self._streams.add(turn)
        assert self._wake is not None and self._changed is not None
        self._changed.set()
        self._wake.set()

    def abort(self, turn: _Turn) -> None:
        """The client went away: take the request out of the engine, freeing its blocks."""
        if turn.done:
            return
        self.engine.abort(turn.req)  # a no-op while it is still pending
        self.aborted += 1
        self._close(turn)
        assert self._wake is not None
        self._wake.set()

    def flush(self, preempt: bool) -> bool:
        ok = bool(self.engine.flush(preempt))
        assert self._wake is not None
        self._wake.set()
        return ok

    def pending(self) -> int:
        return sum(1 for _, _, t in self._pending if not t.done)

    def _close(self, turn: _Turn) -> None:
        turn.done = True
        self.active.discard(turn)
        self._streams.discard(turn)
        self.generation_done += turn.req.generated
        self.bridge.release(turn.content)
        turn.wake.set()

    def _fail_all(self, reason: str) -> None:
        for turn in list(self.active):
            turn.error = reason
            self._close(turn)

    async def _await_parsing(self, now: float) -> None:
        """Wait (bounded) for the requests being parsed that arrived by ``now``."""
        loop, changed = self._loop, self._changed
        assert loop is not None and changed is not None
        deadline = loop.time() + self.MAX_WAIT_S
        while True:
            early = [k for k, t in self._expected.items() if t <= now]
            if not early:
                return
            rem = deadline - loop.time()
            if rem <= 0:
                for k in early:  # they join at the boundary after they are ready
                    del self._expected[k]
                self.late += len(early)
                return
            changed.clear()
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(rem):
                    await changed.wait()

    def _admit(self, now: float) -> None:
        pending = self._pending
        while pending and pending[0][0] <= now:
            turn = heapq.heappop(pending)[2]
            if not turn.done:
                self.engine.add(turn.req)
                self._stalled = False

    async def _run(self) -> None:
        eng = self.engine
        loop, wake = self._loop, self._wake
        assert loop is not None and wake is not None
        try:
            while True:
                now = self.vt
                if self._expected and min(self._expected.values()) <= now:
                    await self._await_parsing(now)
                self._admit(now)
                if self._stalled or not eng.has_work():
                    if self._pending:  # arrivals after the engine's clock (it ran ahead, or nothing can run)
                        self.vt = max(now, self._pending[0][0])
                        continue
                    wake.clear()
                    await wake.wait()
                    self._stalled = False
                    v = self.vnow()
                    if self._pending and self._pending[0][0] < v:
                        v = self._pending[0][0]  # an idle engine starts a request from its arrival
                    if v > self.vt:
                        self.vt = v
                    continue
                horizon = now + self.slice_v
                if self._pending and self._pending[0][0] < horizon:
                    horizon = self._pending[0][0]
                for t in self._expected.values():
                    if now < t < horizon:
                        horizon = t
                res: StepResult = eng.step(now, horizon)
                if res.duration <= 0:
                    self._stalled = True  # nothing can run until a request arrives, leaves or the cache resets
                    continue
                end = now + res.duration
                delay = self._t0 + end / self.scale - loop.time()
                if delay > 0.001:
                    await asyncio.sleep(delay)
                    lag = 0.0
                else:  # NOTE: asyncio sleeps at least 1 ms; within that the engine runs ahead of the clock
                    lag = max(0.0, -delay * self.scale)
                    if lag > self.lag_max:
                        self.lag_max = lag
                    await asyncio.sleep(0)
                self.lag = lag
                self.lags.append(lag)
                self.vt = end
                self._deliver(res)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # a bug in the engine: fail every request, as vLLM's EngineDeadError does
            log.exception("the simulated engine failed")
            self.dead = f"{type(e).__name__}: {e}"
            self._fail_all(f"engine failed: {self.dead}")

    def _deliver(self, res: StepResult) -> None:
        for req in res.first_token:
            self.prompt_tokens += req.prompt
        for req in res.finished:
            turn: _Turn = req.tag  # type: ignore[assignment]
            if not turn.done:
                turn.visible = req.generated
                self.finished += 1
                self._close(turn)
        for turn in self._streams:
            g = turn.req.generated
            if g > turn.visible:
                turn.visible = g
                turn.wake.set()


# -- metrics --------------------------------------------------------------------------------------------------
class _Metrics:
    """Reads the engine at scrape time (nothing on the request path). vLLM's names and labels."""

    def __init__(self, server: EngineServer) -> None:
        self.s = server

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        s = self.s
        eng = s.engine
        lp = s.loop
        names = ["model_name", "engine"]
        lv = [s.model, "0"]

        def gauge(name: str, doc: str, value: float) -> Metric:
            m = GaugeMetricFamily(name, doc, labels=names)
            m.add_metric(lv, value)
            return m

        def counter(name: str, doc: str, value: float) -> Metric:
            m = CounterMetricFamily(name, doc, labels=names)
            m.add_metric(lv, value)
            return m

        running, waiting = s.queue_lengths()
        st = eng.stats
        yield gauge("vllm:num_requests_running", "Number of requests in model execution batches.", running)
        yield gauge("vllm:num_requests_waiting", "Number of requests waiting to be processed.", waiting)
        yield gauge("vllm:kv_cache_usage_perc", "KV-cache usage. 1 means 100 percent usage.", eng.usage())
        yield counter("vllm:prefix_cache_queries", "Prefix cache queries, in terms of number of queried tokens.",
                      st.queries)  # fmt: skip
        yield counter("vllm:prefix_cache_hits", "Prefix cache hits, in terms of number of cached tokens.", st.hits)
        yield counter("vllm:num_preemptions", "Cumulative number of preemption from the engine.", st.preemptions)
        yield counter("vllm:prompt_tokens", "Number of prefill tokens processed.", lp.prompt_tokens)
        gen = lp.generation_done + sum(t.req.generated for t in lp.active)
        yield counter("vllm:generation_tokens", "Number of generation tokens processed.", gen)
        m = CounterMetricFamily("vllm:request_success", "Count of successfully processed requests.",
                                labels=[*names, "finished_reason"])  # fmt: skip
        m.add_metric([*lv, "length"], lp.finished)
        yield m
        info = GaugeMetricFamily(
            "vllm:cache_config_info",
            "Information of the LLMEngine CacheConfig",
            labels=[*names, *s.cache_config],
        )
        info.add_metric([*lv, *s.cache_config.values()], 1.0)
        yield info
        if s.cfg.engine == "sglang":
            sl = ["model_name"]
            for name, doc, v in (
                ("sglang:num_running_reqs", "The number of running requests.", running),
                ("sglang:num_queue_reqs", "The number of requests in the waiting queue.", waiting),
                ("sglang:token_usage", "The token usage.", eng.usage()),
                ("sglang:cache_hit_rate", "The prefix cache hit rate.", st.hits / st.queries if st.queries else 0.0),
            ):
                g = GaugeMetricFamily(name, doc, labels=sl)
                g.add_metric([s.model], v)
                yield g
        yield GaugeMetricFamily("kvgate:virtual_time_seconds", "The engine's virtual clock.", value=lp.vt)
        yield GaugeMetricFamily("kvgate:time_scale", "Virtual seconds per real second.", value=lp.scale)
        yield GaugeMetricFamily("kvgate:engine_lag_seconds", "Virtual seconds the engine was behind the clock "
                                "at its last step (0 when on time).", value=lp.lag)  # fmt: skip
        yield GaugeMetricFamily("kvgate:engine_lag_max_seconds", "Largest engine lag so far (virtual seconds).",
                                value=lp.lag_max)  # fmt: skip


# -- configuration --------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ServerConfig:
    """Everything that defines a served engine."""

    profile: str = "qwen3-8b-mi300x"
    kv_pool: int | None = None
    engine: str = "vllm"
    prefix_caching: bool = True
    time_scale: float = 30.0
    model: str | None = None
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    sglang_policy: str = "fcfs"
    slice_ms: float = 2.0
    """Real milliseconds a decode jump may run ahead of the next possible arrival."""
    block_size: int | None = None
    """Tokens per KV block of the simulated vLLM (None: 16); SGLang's page is 1 token."""
    cache_report: bool = True
    """Report cached prompt tokens in ``usage`` (vLLM's ``--enable-prompt-tokens-details``, SGLang's
    ``--enable-cache-report``). Off: vLLM answers ``"prompt_tokens_details": null``, SGLang omits it."""

    def validate(self) -> None:
        get_profile(self.profile)
        bs = self.block_size
        if bs is not None:
            if self.engine == "sglang" and bs != 1:
                raise UsageError("--block-size: the SGLang engine's page is 1 token")
            if bs < 1 or not (bs % BLOCK == 0 or BLOCK % bs == 0):
                raise UsageError(f"--block-size {bs}: must divide {BLOCK} or be a multiple of it (e.g. 16, 128)")
        if not math.isfinite(self.time_scale) or self.time_scale <= 0:
            raise UsageError("--time-scale must be a positive number")
        if self.kv_pool is not None and self.kv_pool < max(BLOCK, self.block_size or 0):
            raise UsageError(f"--kv-pool must be at least {max(BLOCK, self.block_size or 0)} tokens (one block)")
        if self.engine not in ("vllm", "sglang"):
            raise UsageError(f"unknown engine {self.engine!r}; choose vllm or sglang")
        if self.max_num_batched_tokens <= 0 or self.max_num_seqs <= 0:
            raise UsageError("--max-num-batched-tokens and --max-num-seqs must be positive")
        if self.slice_ms <= 0:
            raise UsageError("--slice-ms must be positive")

    def model_name(self) -> str:
        return self.model or MODEL_NAMES.get(self.profile, self.profile)


def engine_config(cfg: ServerConfig) -> EngineConfig:
    """The engine a served config names (the vLLM one with a :class:`~kvgate.engine.capped.CappedKVPool`)."""
    return EngineConfig(
        engine=cfg.engine, profile=cfg.profile, kv_pool=cfg.kv_pool, prefix_caching=cfg.prefix_caching,
        block_size=cfg.block_size or 16, sglang_policy=cfg.sglang_policy, capped=True,
        max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
    )  # fmt: skip


# -- the HTTP server ------------------------------------------------------------------------------------------
Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class EngineServer:
    """The aiohttp application around one simulated engine. ``engine`` overrides the one the config builds
    (tests serve the vLLM engine under the SGLang API this way)."""

    def __init__(self, cfg: ServerConfig, engine: Any | None = None) -> None:
        cfg.validate()
        self.cfg = cfg
        self.engine = engine if engine is not None else build_engine(engine_config(cfg))
        self.profile = get_profile(cfg.profile)
        self.model = cfg.model_name()
        self.max_model_len = self.profile.max_model_len
        self.block_size: int = self.engine.block_size
        pool = getattr(self.engine, "pool", None)
        # the blocks a request can hold, counted on the empty pool (whatever it reserves)
        usable = pool.num_free_blocks() if pool is not None else self.engine.kv_pool_tokens // self.block_size
        self.kv_tokens: int = usable * self.block_size
        """The pool as vLLM's scheduler sees it: what requests can fill."""
        self.num_gpu_blocks = usable + 1
        """As vLLM reports it: the usable blocks plus its null block (block 0), so that the pool discovery's
        ``(num_gpu_blocks - 1) x block_size`` is :attr:`kv_tokens`."""
        caps = pool.caps if isinstance(pool, CappedKVPool) else None
        self.bridge = ContentBridge(
            self.block_size, caching=cfg.prefix_caching, caps=caps,
            max_blocks=BRIDGE_MEMORY * (self.kv_tokens // bridge_block(self.block_size)) + 1,
        )  # fmt: skip
        self.loop = EngineLoop(self.engine, self.bridge, cfg.time_scale, cfg.slice_ms / 1000.0)
        bs = self.block_size
        per_request = -(-self.max_model_len // bs)
        self.cache_config = {
            "block_size": str(bs),
            "num_gpu_blocks": str(self.num_gpu_blocks),
            # vLLM's: max_model_len x the whole max-length requests that fit (not the pool)
            "kv_cache_size_tokens": str(int(self.num_gpu_blocks / per_request * self.max_model_len)),
            "hash_block_size": str(bs),
            "cache_hit_alignment_tokens": str(bs),
            "enable_prefix_caching": str(cfg.prefix_caching),
        }
        """The labels of ``vllm:cache_config_info``, as vLLM 0.32 reports them (those kvgate knows)."""
        self._created_block = bs if cfg.engine == "vllm" and cfg.prefix_caching else 0
        self._details: bool | None = True if cfg.cache_report else (None if cfg.engine == "vllm" else False)
        """Cached-token details in usage: True; None (vLLM's null); False (absent, as SGLang without the flag)."""
        self.tokenizer = Tokenizer()
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(_Metrics(self))  # type: ignore[arg-type]
        self._rid = 0
        self._rid_prefix = os.urandom(4).hex()
        self._created = int(time.time())
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    # -- lifecycle ----------------------------------------------------------------------------------------
    def app(self) -> web.Application:
        app = web.Application(middlewares=[_error_middleware], client_max_size=256 * 1024 * 1024)
        r = app.router
        r.add_post("/v1/completions", self.completions)
        r.add_post("/v1/chat/completions", self.chat_completions)
        r.add_post("/tokenize", self.tokenize)
        r.add_post("/detokenize", self.detokenize)
        r.add_get("/v1/models", self.models)
        r.add_get("/health", self.health)
        r.add_get("/ping", self.health)
        r.add_get("/version", self.version)
        r.add_get("/metrics", self.metrics)
        r.add_post("/reset_prefix_cache", self.reset_prefix_cache)
        r.add_get("/kvgate/stats", self.kvgate_stats)
        if self.cfg.engine == "sglang":
            r.add_get("/server_info", self.server_info)
            r.add_get("/get_server_info", self.server_info)
            r.add_get("/get_model_info", self.model_info)
            r.add_route("GET", "/flush_cache", self.flush_cache)
            r.add_route("POST", "/flush_cache", self.flush_cache)
        app.on_startup.append(self._on_startup)
        app.on_shutdown.append(self._on_shutdown)
        return app

    async def _on_startup(self, _app: web.Application) -> None:
        self.loop.start()

    async def _on_shutdown(self, _app: web.Application) -> None:
        await self.loop.stop()

    async def start(self, host: str = "127.0.0.1", port: int = 8100) -> int:
        """Serve on ``host:port`` (port 0: a free one); returns the port."""
        runner = web.AppRunner(self.app(), handler_cancellation=True, shutdown_timeout=5.0, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, host, port)
        try:
            await site.start()
        except OSError as e:
            await runner.cleanup()
            reason = os.strerror(e.errno) if e.errno else str(e)
            raise UsageError(f"cannot listen on {host}:{port}: {reason}") from None
        self._runner = runner
        addrs = runner.addresses
        self.port = int(addrs[0][1]) if addrs else port
        return self.port

    async def stop(self) -> None:
        """Stop listening, fail the requests in flight, close every connection."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def queue_lengths(self) -> tuple[int, int]:
        """Requests running, and waiting (in the engine's queue, or parsed and about to join it)."""
        eng = self.engine
        running = len(eng.running) + (1 if getattr(eng, "chunked", None) is not None else 0)
        return running, len(eng.waiting) + self.loop.pending()

    # -- request parsing ----------------------------------------------------------------------------------
    async def _json(self, request: web.Request) -> dict[str, Any]:
        raw = await request.read()
        try:
            body = _loads(raw)
        except ValueError as e:
            raise ApiError(400, f"JSON decode error: {e}") from None
        if not isinstance(body, dict):
            raise ApiError(400, "the request body must be a JSON object")
        return body

    def _check_model(self, body: dict[str, Any]) -> None:
        model = body.get("model")
        if model is not None and model != self.model:
            raise ApiError(404, f"The model `{model}` does not exist.", "NotFoundError", "model")

    def _prompt_ids(self, prompt: Any) -> list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
            prompt = prompt[0]
        if isinstance(prompt, str):
            if not prompt:
                raise ApiError(400, "the prompt is empty", param="prompt")
            return self.tokenizer.encode(prompt)
        if isinstance(prompt, list) and prompt:
            if isinstance(prompt[0], str | list):
                raise ApiError(400, "kvgate engine takes one prompt per request (a string or a list of token ids)",
                               param="prompt")  # fmt: skip
            try:
                ok = type(sum(prompt)) is int  # fast, in C: a float anywhere makes the sum a float
            except TypeError:
                ok = False
            if not ok:
                raise ApiError(400, f"prompt token ids must be integers in [0, {VOCAB_SIZE})", param="prompt")
            return prompt
        raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list holding one of those",
                       param="prompt")  # fmt: skip

    @staticmethod
    def _array(ids: list[int]) -> np.ndarray:
        try:
            arr = np.fromiter(ids, dtype=np.int64, count=len(ids))
        except (OverflowError, ValueError):
            arr = np.array([-1], dtype=np.int64)
        if arr.min() < 0 or arr.max() >= VOCAB_SIZE:
            raise ApiError(400, f"prompt token ids must be integers in [0, {VOCAB_SIZE})", param="prompt")
        return arr

    def _max_tokens(self, body: dict[str, Any], prompt_len: int, chat: bool) -> int:
        key = "max_tokens"
        val = body.get("max_tokens")
        if chat and body.get("max_completion_tokens") is not None:
            key, val = "max_completion_tokens", body["max_completion_tokens"]
        m = self.max_model_len
        if prompt_len >= m:
            raise ApiError(
                400,
                f"This model's maximum context length is {m} tokens. However, your request has {prompt_len} input "
                f"tokens. Please reduce the length of the input {'messages' if chat else 'prompt'}.",
            )
        if val is None:
            default = DEFAULT_CHAT_MAX_TOKENS if chat else DEFAULT_COMPLETION_MAX_TOKENS
            n = min(default, m - prompt_len)
        else:
            n = _int(val, key, 1)
            if prompt_len + n > m:
                raise ApiError(
                    400,
                    f"'max_tokens' or 'max_completion_tokens' is too large: {n}. This model's maximum context "
                    f"length is {m} tokens and your request has {prompt_len} input tokens "
                    f"({n} > {m} - {prompt_len}).",
                    param=key,
                )
        if prompt_len + n > self.kv_tokens:
            raise ApiError(400, f"a request of {prompt_len} + {n} tokens can never fit the KV cache of "
                           f"{self.kv_tokens} tokens", param=key)  # fmt: skip
        mn = body.get("min_tokens")
        if mn is not None and not 0 <= _int(mn, "min_tokens", 0) <= n:
            raise ApiError(400, f"min_tokens must be less than or equal to max_tokens={n}, got {mn}.",
                           param="min_tokens")  # fmt: skip
        for flag in ("ignore_eos", "stream", "return_token_ids", "echo"):
            v = body.get(flag)
            if v is not None and not isinstance(v, bool):
                raise ApiError(400, f"'{flag}' must be a boolean", param=flag)
        if body.get("n") not in (None, 1):
            raise ApiError(400, "kvgate engine generates one choice per request: n must be 1", param="n")
        if body.get("echo"):
            raise ApiError(400, "echo is not supported by kvgate engine", param="echo")
        so = body.get("stream_options")
        if so is not None:
            if not body.get("stream"):
                raise ApiError(400, "Stream options can only be defined when `stream=True`.", param="stream_options")
            if not isinstance(so, dict):
                raise ApiError(400, "'stream_options' must be an object", param="stream_options")
        return n

    @staticmethod
    def _hint(request: web.Request, body: dict[str, Any]) -> str | None:
        h = request.headers.get("X-Session-ID")
        if h is None:
            v = body.get("session_id")
            h = None if v is None else str(v)
        return h

    # -- generation ---------------------------------------------------------------------------------------
    async def completions(self, request: web.Request) -> web.StreamResponse:
        token, arrived = self.loop.expect()
        try:
            body = await self._json(request)
            self._check_model(body)
            if "prompt" not in body:
                raise ApiError(400, "'prompt' is required", param="prompt")
            ids = self._prompt_ids(body["prompt"])
            return await self._generate(request, body, ids, False, token, arrived)
        finally:
            self.loop.forget(token)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        token, arrived = self.loop.expect()
        try:
            body = await self._json(request)
            self._check_model(body)
            if "messages" not in body:
                raise ApiError(400, "'messages' is required", param="messages")
            agp = bool(body.get("add_generation_prompt", True))
            try:
                ids = self.tokenizer.encode_chat(body["messages"], add_generation_prompt=agp, tools=body.get("tools"))
            except TokenizeError as e:
                raise ApiError(400, str(e), param="messages") from None
            return await self._generate(request, body, ids, True, token, arrived)
        finally:
            self.loop.forget(token)

    async def _generate(
        self, request: web.Request, body: dict[str, Any], ids: list[int], chat: bool, token: int, arrived: float
    ) -> web.StreamResponse:
        n = self._max_tokens(body, len(ids), chat)
        stream = bool(body.get("stream"))
        hint = self._hint(request, body)
        arr = self._array(ids)
        out = filler_array(n, chat)
        key, content = self.bridge.assign(np.concatenate((arr, out)), len(ids), hint)
        self._rid += 1
        req = Request(self._rid, key, len(ids), n, arrived, None)
        turn = _Turn(req, content, stream)
        req.tag = turn
        try:
            self.loop.submit(turn, token)
        except BaseException:
            self.bridge.release(content)
            raise
        rid = ("chatcmpl-" if chat else "cmpl-") + self._rid_prefix + format(req.rid, "x")
        created = int(time.time())
        want_ids = bool(body.get("return_token_ids"))
        if stream:
            so = body.get("stream_options") or {}
            return await self._stream(request, turn, rid, created, chat, bool(so.get("include_usage")),
                                      out.tolist() if want_ids else None)  # fmt: skip
        try:
            while not turn.done:
                await turn.wake.wait()
                turn.wake.clear()
        finally:
            if not turn.done:
                self.loop.abort(turn)
        if turn.error is not None:
            raise ApiError(503, turn.error, "ServiceUnavailableError")
        g = req.generated
        text = filler_text(0, g, chat)
        choice: dict[str, Any]
        resp: dict[str, Any]
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                      "logprobs": None, "finish_reason": "length", "stop_reason": None}  # fmt: skip
            resp = {"id": rid, "object": "chat.completion", "created": created, "model": self.model}
            if want_ids:
                choice["token_ids"] = out[:g].tolist()
                resp["prompt_token_ids"] = ids
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
            resp = {"id": rid, "object": "text_completion", "created": created, "model": self.model}
            if want_ids:
                choice["token_ids"] = out[:g].tolist()
                choice["prompt_token_ids"] = ids
        resp["choices"] = [choice]
        resp["usage"] = _usage(req, self._created_block, self._details)
        return web.Response(body=_dumps(resp), content_type="application/json")

    async def _stream(
        self, request: web.Request, turn: _Turn, rid: str, created: int, chat: bool, include_usage: bool,
        token_ids: list[int] | None,
    ) -> web.StreamResponse:  # fmt: skip
        req = turn.req
        total = req.max_tokens
        w = ChunkWriter(rid, created, self.model, chat=chat, token_ids=token_ids)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        sent = 0
        try:
            await resp.prepare(request)
            while True:
                await turn.wake.wait()
                turn.wake.clear()
                if turn.error is not None:
                    await resp.write(error_event(turn.error, 503, "ServiceUnavailableError") + DONE)
                    break
                v = turn.visible
                if v > sent:
                    data = w.tokens(sent, v, total)
                    if chat and sent == 0:
                        data = w.role() + data
                    sent = v
                    if not turn.done:
                        await resp.write(data)
                        continue
                else:
                    data = b""
                if turn.done:
                    if include_usage:
                        data += w.usage(_usage(req, self._created_block, self._details))
                    await resp.write(data + DONE)
                    break
        except ConnectionError:
            pass  # the client went away; the finally clause aborts the request
        finally:
            if not turn.done:
                self.loop.abort(turn)
        return resp

    # -- the rest of the surface --------------------------------------------------------------------------
    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        self._check_model(body)
        if "messages" in body:
            try:
                ids = self.tokenizer.encode_chat(body["messages"], add_generation_prompt=bool(
                    body.get("add_generation_prompt", True)), tools=body.get("tools"))  # fmt: skip
            except TokenizeError as e:
                raise ApiError(400, str(e), param="messages") from None
        elif isinstance(body.get("prompt"), str):
            ids = self.tokenizer.encode(body["prompt"])
        else:
            raise ApiError(400, "/tokenize needs 'prompt' (a string) or 'messages'", param="prompt")
        out = {"count": len(ids), "max_model_len": self.max_model_len, "tokens": ids, "token_strs": None}
        return web.Response(body=_dumps(out), content_type="application/json")

    async def detokenize(self, request: web.Request) -> web.StreamResponse:
        body = await self._json(request)
        self._check_model(body)
        toks = body.get("tokens")
        if not isinstance(toks, list) or not all(type(x) is int for x in toks):
            raise ApiError(400, "'tokens' must be a list of token ids", param="tokens")
        try:
            text = self.tokenizer.decode(toks)
        except TokenizeError as e:
            raise ApiError(400, str(e), param="tokens") from None
        return web.Response(body=_dumps({"prompt": text}), content_type="application/json")

    async def models(self, _request: web.Request) -> web.StreamResponse:
        card = {"id": self.model, "object": "model", "created": self._created, "owned_by": "kvgate",
                "root": self.model, "parent": None, "max_model_len": self.max_model_len, "permission": []}  # fmt: skip
        return web.Response(body=_dumps({"object": "list", "data": [card]}), content_type="application/json")

    async def health(self, _request: web.Request) -> web.StreamResponse:
        if self.loop.dead is not None:
            return _error(503, f"engine failed: {self.loop.dead}", "ServiceUnavailableError")
        return web.Response(status=200)

    async def version(self, _request: web.Request) -> web.StreamResponse:
        return web.Response(body=_dumps({"version": f"kvgate-{__version__}"}), content_type="application/json")

    async def metrics(self, _request: web.Request) -> web.StreamResponse:
        return web.Response(body=generate_latest(self.registry), headers={"Content-Type": CONTENT_TYPE_LATEST})

    async def reset_prefix_cache(self, request: web.Request) -> web.StreamResponse:
        """vLLM's: ``?reset_running_requests=true`` (or ``?preempt=true``, or that JSON field) preempts the
        running requests first, as a restart would; without it the reset fails (409) while any runs."""
        q = request.query
        preempt = _truthy(q.get("reset_running_requests")) or _truthy(q.get("preempt"))
        if request.can_read_body:
            raw = await request.read()
            if raw.strip():
                try:
                    body = _loads(raw)
                except ValueError as e:
                    raise ApiError(400, f"JSON decode error: {e}") from None
                if isinstance(body, dict):
                    preempt = preempt or bool(body.get("reset_running_requests") or body.get("preempt"))
        if not self.loop.flush(preempt):
            running, waiting = self.queue_lengths()
            raise ApiError(409, f"Prefix cache reset failed: {running} requests running, {waiting} waiting "
                           "(?reset_running_requests=true preempts the running ones).", "ConflictError")  # fmt: skip
        return web.Response(status=200)

    async def flush_cache(self, _request: web.Request) -> web.StreamResponse:
        """SGLang's: refused (400) while any request runs or waits."""
        if self.engine.has_work() or self.loop.pending() or not self.loop.flush(False):
            return web.Response(status=400, text="Flush cache failed.\n")
        return web.Response(
            status=200,
            text="Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
            "requests, the operation will not be performed.)\n",
        )

    async def server_info(self, _request: web.Request) -> web.StreamResponse:
        cfg = self.cfg
        info = {
            "model_path": self.model, "served_model_name": self.model, "tokenizer_path": "kvgate",
            "context_length": self.max_model_len, "max_total_num_tokens": self.kv_tokens,
            "page_size": self.block_size, "chunked_prefill_size": cfg.max_num_batched_tokens,
            "max_running_requests": cfg.max_num_seqs, "schedule_policy": cfg.sglang_policy,
            "disable_radix_cache": not cfg.prefix_caching, "enable_cache_report": cfg.cache_report,
            "version": f"kvgate-{__version__}", "kvgate_time_scale": cfg.time_scale,
        }  # fmt: skip
        return web.Response(body=_dumps(info), content_type="application/json")

    async def model_info(self, _request: web.Request) -> web.StreamResponse:
        info = {"model_path": self.model, "tokenizer_path": "kvgate", "is_generation": True}
        return web.Response(body=_dumps(info), content_type="application/json")

    async def kvgate_stats(self, _request: web.Request) -> web.StreamResponse:
        lp = self.loop
        running, waiting = self.queue_lengths()
        st = self.engine.stats
        lags = sorted(lp.lags) or [0.0]
        out = {
            "virtual_time_s": lp.vt, "time_scale": lp.scale, "lag_s": lp.lag, "lag_max_s": lp.lag_max,
            "lag_p50_s": lags[len(lags) // 2], "lag_p99_s": lags[int(0.99 * (len(lags) - 1))],
            "running": running, "waiting": waiting, "usage": self.engine.usage(), "steps": st.steps,
            "preemptions": st.preemptions, "queries": st.queries, "hits": st.hits, "finished": lp.finished,
            "aborted": lp.aborted, "late_arrivals": lp.late, "bridge": self.bridge.stats(),
        }  # fmt: skip
        return web.Response(body=_dumps(out), content_type="application/json")


def _usage(req: Request, created_block: int, details_on: bool | None = True) -> dict[str, Any]:
    """The usage object; with ``created_block`` (the vLLM engine's block size, 0 otherwise) vLLM 0.32's
    ``created_cache_tokens`` too: the prompt tokens computed into cached (full) blocks. ``details_on`` None:
    ``prompt_tokens_details`` null (vLLM without --enable-prompt-tokens-details); False: absent (SGLang without
    --enable-cache-report)."""
    p, g = req.prompt, req.generated
    if not details_on:
        out: dict[str, Any] = {"prompt_tokens": p, "total_tokens": p + g, "completion_tokens": g}
        if details_on is None:
            out["prompt_tokens_details"] = None
        return out
    cached = max(req.cached, 0)
    details: dict[str, int] = {"cached_tokens": cached}
    if created_block:
        details["created_cache_tokens"] = max(0, p // created_block * created_block - cached)
    return {"prompt_tokens": p, "total_tokens": p + g, "completion_tokens": g, "prompt_tokens_details": details}


def _int(v: Any, name: str, lo: int) -> int:
    if type(v) is not int or v < lo:
        raise ApiError(400, f"'{name}' must be an integer >= {lo}, got {v!r}", param=name)
    return v


def _truthy(v: str | None) -> bool:
    return v is not None and v.lower() in ("1", "true", "yes", "on")


@web.middleware
async def _error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error as JSON; never a traceback to the client."""
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status >= 400:  # unknown route, wrong method: FastAPI's shape, as vLLM answers them
            return web.Response(status=e.status, body=_dumps({"detail": e.reason}), content_type="application/json")
        raise
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("error handling %s %s", request.method, request.path)
        return _error(500, "internal server error", "InternalServerError")


# -- the command ------------------------------------------------------------------------------------------------
async def serve(cfg: ServerConfig, host: str, port: int, ready: Callable[[EngineServer], None] | None = None) -> None:
    """Serve until SIGINT or SIGTERM, then shut down gracefully."""
    server = EngineServer(cfg)
    await server.start(host, port)
    # NOTE: a full collection walks every object the imports made (numpy, aiohttp, ...): ~50 ms, i.e. seconds
    # of virtual time at x60. Freezing them leaves the collector only what serving allocates.
    settle_for_serving()
    try:
        await until_signalled(None if ready is None else lambda: ready(server))
    finally:
        await server.stop()


@click.command("engine", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--profile", default="qwen3-8b-mi300x", show_default=True, help="Engine cost profile.")
@click.option("--kv-pool", type=int, default=None, help="KV pool in tokens [default: the profile's, 400000 for "
              "qwen3-8b-mi300x].")  # fmt: skip
@click.option("--engine", "engine_kind", type=click.Choice(["vllm", "sglang"]), default="vllm", show_default=True,
              help="Engine model; sglang also serves SGLang's /server_info and /flush_cache.")  # fmt: skip
@click.option("--no-prefix-cache", is_flag=True, help="Disable prefix caching.")
@click.option("--time-scale", type=float, default=30.0, show_default=True,
              help="Virtual seconds per real second.")  # fmt: skip
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=int, default=8100, show_default=True)
@click.option("--model", default=None, help="Served model name [default: Qwen/Qwen3-8B for qwen3-8b-mi300x].")
@click.option("--max-num-batched-tokens", type=int, default=8192, show_default=True,
              help="Token budget of an engine step (vLLM's; SGLang's chunked_prefill_size).")  # fmt: skip
@click.option("--max-num-seqs", type=int, default=1024, show_default=True, help="Requests per batch.")
@click.option("--sglang-policy", type=click.Choice(["fcfs", "lpm"]), default="fcfs", show_default=True,
              help="SGLang schedule policy (--engine sglang).")  # fmt: skip
@click.option("--slice-ms", type=float, default=2.0, show_default=True,
              help="Real time a decode jump may run before new arrivals are looked at.")  # fmt: skip
@click.option("--block-size", type=int, default=None, metavar="TOKENS",
              help="KV block size of the simulated vLLM [default: 16; vLLM's CPU build uses 128]; a multiple of 16 "
              "or a divisor of it. Reported in vllm:cache_config_info.")  # fmt: skip
@click.option("--no-cache-report", is_flag=True, help="Do not report cached prompt tokens in usage, as vLLM "
              "without --enable-prompt-tokens-details or SGLang without --enable-cache-report.")  # fmt: skip
def command(
    profile: str, kv_pool: int | None, engine_kind: str, no_prefix_cache: bool, time_scale: float, host: str,
    port: int, model: str | None, max_num_batched_tokens: int, max_num_seqs: int, sglang_policy: str,
    slice_ms: float, block_size: int | None, no_cache_report: bool,
) -> None:  # fmt: skip
    """Serve the simulated engine over HTTP (OpenAI-compatible, vLLM's metrics) in scaled real time.

    \b
    Virtual seconds = real seconds x --time-scale: at 30, a turn the simulated GPU serves in 3 s
    answers in 0.1 s. Agent drivers and gateways talk to it as to vLLM (or SGLang with
    --engine sglang); see docs/engine-server.md. Stops gracefully on SIGINT / SIGTERM.
    """
    cfg = ServerConfig(
        profile=profile, kv_pool=kv_pool, engine=engine_kind, prefix_caching=not no_prefix_cache,
        time_scale=time_scale, model=model, max_num_batched_tokens=max_num_batched_tokens,
        max_num_seqs=max_num_seqs, sglang_policy=sglang_policy, slice_ms=slice_ms, block_size=block_size,
        cache_report=not no_cache_report,
    )  # fmt: skip
    cfg.validate()

    def ready(s: EngineServer) -> None:
        click.echo(
            f"kvgate engine: serving {s.model} at http://{host}:{s.port} ({cfg.engine}, profile {cfg.profile}, "
            f"{s.kv_tokens}-token KV pool in {s.block_size}-token blocks, "
            f"prefix caching {'on' if cfg.prefix_caching else 'off'}, "
            f"time x{cfg.time_scale:g}); Ctrl-C stops",
            err=True,
        )

    asyncio.run(serve(cfg, host, port, ready))
    click.echo("kvgate engine: stopped", err=True)


def main(argv: list[str] | None = None) -> None:
    """``python -m kvgate.http.engine_server``: the command on its own (``kvgate engine`` once registered)."""
    try:
        command.main(args=argv, prog_name="kvgate engine", standalone_mode=False)
    except click.ClickException as e:
        click.echo(f"kvgate: error: {e.format_message()}", err=True)
        sys.exit(2)
    except UsageError as e:
        click.echo(f"kvgate: error: {e}", err=True)
        sys.exit(2)


if __name__ == "__main__":  # pragma: no cover
    main()
