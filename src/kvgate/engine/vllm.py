"""A vLLM v1-like engine in virtual time: scheduler, paged prefix-cached KV pool, per-step cost model.

An engine step is ``schedule()``, then the cost model, then ``update()`` (vLLM's SchedulerInterface). There is
no separate prefill or decode phase: each request's computed tokens catch up with its tokens, at most
``max_num_batched_tokens`` per step (chunked prefill). The scheduler follows vLLM v1's default (FCFS):

1. running requests first, in admission order, each taking ``min(tokens - computed, budget)`` new tokens;
   when one cannot get a block, the most recently admitted running request is preempted by recompute
   (blocks freed, back to the front of the waiting queue) until it fits or is itself preempted;
2. then, if nothing was preempted this step, waiting requests in order while budget and ``max_num_seqs``
   allow: prefix lookup, then the first chunk; the first that cannot get its blocks stops the loop. As in
   vLLM's default ``scheduler_reserve_full_isl``, a waiting request is admitted only if its whole prompt
   (less the hit) fits in the free blocks, not just its first chunk; this keeps preemptions rare.

Parity: this scheduler is held to **vLLM 0.32.0**'s v1 ``Scheduler`` (``vllm.v1.core.sched.scheduler``, the
synchronous one) with its defaults (FCFS, chunked prefill, ``scheduler_reserve_full_isl``, no watermark, no
long-prefill cap): ``tests/engine/test_vllm_sched_oracle.py`` drives both with the same request streams and asserts the
same requests scheduled with the same new tokens, the same preemptions, admissions, hits, finishes and cached
tokens at every step (decode jumps compared as the single steps they stand for). Not modelled: async scheduling
(vLLM's default on GPUs, off on CPUs), speculative decoding, the watermark and ``long_prefill_token_threshold``
when set, priority scheduling. vLLM's pool of ``n`` blocks holds ``n - 1`` (block 0 is its null block); this
engine's ``num_blocks`` counts usable blocks.

Speed: a step in which only decoding requests run, the batch cannot change and nothing can be admitted is
repeated ``n`` times in one jump (its duration is an arithmetic series, as every context grows by one token a
step) until a request finishes, a block would run out, or the driver's next event is due. A step in which a
request emits its first token is never part of a jump.

The engine reads no clock: the driver passes ``now`` and a ``horizon`` (its next event) and receives the
step's duration and what happened in it.

Engine-side alternatives (all off by default, when the engine is exactly vLLM's), for the question the paper
leaves open, whether changes inside the engine move the collapse threshold:

* ``session_aware`` eviction: the driver reports each session's status (:meth:`session_status`: admitted,
  parked, ended, the gateway's transitions); cached blocks of parked and ended sessions are evicted before
  those of admitted ones (the pool's tiers, ``kvgate.engine.cache``);
* ``retention``: blocks of longer contexts are evicted last (a tier per doubling of the request's full blocks),
  since their miss costs the most prefill;
* ``pin_ttl_s``: a finished turn's blocks stay held (pinned, not evictable) for that many seconds, the agent's
  tool call; the session's next request takes them over when it is first considered for admission, its end
  releases them, and pins expire lazily at the first step whose ``now`` is past them;
* ``prefix_first``: before admitting, the first ``prefix_first`` waiting requests are ordered by the fraction
  of their prompt already cached (stable; bounded work per step), so requests with a resident prefix go first.
"""

from __future__ import annotations

import math
from collections import deque

import kvgate.engine.base as base
from kvgate.engine.base import EngineStats, Request, SessionStatus, StepResult
from kvgate.engine.blocks import KVPool, blocks_for
from kvgate.engine.cache import RunKVPool
from kvgate.engine.capped import CappedKVPool
from kvgate.engine.costmodel import Profile


class Pins:
    """``pin_ttl_s``: a finished request's blocks stay held for its session's next request, ``ttl_s`` seconds
    at most. Pins are released into the pool the engine passes (its pool may be replaced, e.g. by a test)."""

    __slots__ = ("ttl_s", "by_session", "expiry")

    def __init__(self, ttl_s: float) -> None:
        self.ttl_s = ttl_s
        self.by_session: dict[int, int] = {}
        """Session -> rid of its pinned (finished) request."""
        self.expiry: deque[tuple[float, int, int]] = deque()
        """(expiry, session, rid), in expiry order; entries of released pins go stale."""

    def pin(self, req: Request, t_end: float, pool: KVPool) -> None:
        s = req.seq.session
        self.release(s, pool)
        self.by_session[s] = req.rid
        self.expiry.append((t_end + self.ttl_s, s, req.rid))

    def release(self, session: int, pool: KVPool) -> None:
        rid = self.by_session.pop(session, None)
        if rid is not None:
            pool.free(rid)

    def expire(self, now: float, pool: KVPool) -> None:
        q = self.expiry
        pins = self.by_session
        while q and q[0][0] <= now:
            _, session, rid = q.popleft()
            if pins.get(session) == rid:
                del pins[session]
                pool.free(rid)

    def clear(self, pool: KVPool) -> None:
        for s in list(self.by_session):
            self.release(s, pool)
        self.expiry.clear()


class VllmEngine:
    """The simulated vLLM v1 engine. Drive it with :meth:`add` and :meth:`step`."""

    defers_jumps = True

    def __init__(
        self,
        profile: Profile,
        kv_pool: int | None = None,
        *,
        block_size: int = 16,
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 1024,
        prefix_caching: bool = True,
        reserve_full_prompt: bool = True,
        pool: KVPool | None = None,
        session_aware: bool = False,
        retention: bool = False,
        pin_ttl_s: float = 0.0,
        prefix_first: int = 0,
    ) -> None:
        self.profile = profile
        self.block_size = block_size
        self.kv_pool = kv_pool or profile.kv_pool
        self.num_blocks = self.kv_pool // block_size
        self.prefix_caching = prefix_caching
        if pool is None:
            pool = RunKVPool(
                self.num_blocks, block_size, prefix_caching, session_aware=session_aware, retention=retention
            )
        self.pool: KVPool = pool
        self.hit_caps: dict[int, int] | None = pool.caps if isinstance(pool, CappedKVPool) else None
        if pin_ttl_s < 0 or prefix_first < 0:
            raise ValueError("pin_ttl_s and prefix_first must be >= 0")
        self.pin_ttl_s = pin_ttl_s
        self.prefix_first = prefix_first
        self._pins = Pins(pin_ttl_s)
        self.tracks_sessions = session_aware or pin_ttl_s > 0
        self.max_batched = max_num_batched_tokens
        self.max_seqs = max_num_seqs
        self.reserve_full_prompt = reserve_full_prompt
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.stats = EngineStats()
        self._deferred: tuple[StepResult, float, float, float] | None = None

    # -- driver API -------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if self._deferred is not None:
            raise RuntimeError("a deferred jump is pending: settle it first")
        base.check_fits(req, self.profile.max_model_len)
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks() / self.num_blocks

    def queue_lengths(self) -> tuple[int, int]:
        return len(self.running), len(self.waiting)

    def session_status(self, session: int, status: SessionStatus) -> None:
        """The driver's report of a session's status (no effect unless an engine-side alternative uses it)."""
        base.check_session_status(status)
        if status == "ended":
            self._pins.release(session, self.pool)
        self.pool.set_session_low(session, status != "admitted")

    def pinned_sessions(self) -> list[int]:
        return list(self._pins.by_session)

    def _order_waiting(self) -> None:
        """``prefix_first``: the head of the waiting queue by cached fraction, highest first (stable)."""
        waiting = self.waiting
        k = min(self.prefix_first, len(waiting))
        pool = self.pool
        head = [waiting.popleft() for _ in range(k)]
        pins = self._pins

        def frac(r: Request) -> float:
            if r.seq.session in pins.by_session:
                pins.release(r.seq.session, pool)
            return -pool.lookup(r.seq, r.num_tokens) / r.num_tokens

        head.sort(key=frac)
        waiting.extendleft(reversed(head))

    def flush(self, preempt: bool = True) -> bool:
        """``reset_prefix_cache``; with ``preempt`` running requests are preempted first (as a restart)."""
        if self._deferred is not None:
            raise RuntimeError("a deferred jump is pending: settle it first")
        self._pins.clear(self.pool)
        if preempt:
            for req in reversed(self.running):
                self._preempt(req)
            self.running.clear()
        return bool(self.pool.reset())

    def abort(self, req: Request) -> None:
        if self._deferred is not None:
            raise RuntimeError("a deferred jump is pending: settle it first")
        if req in self.running:
            self.running.remove(req)
            self.pool.free(req.rid)
        elif req in self.waiting:
            self.waiting.remove(req)

    def _preempt(self, req: Request) -> None:
        self.pool.free(req.rid)
        req.computed = 0
        req.grow_at = 0
        req.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)

    # -- one step (or a jump of identical decode steps) --------------------------------------------------
    def step(self, now: float, horizon: float = math.inf, defer: bool = False) -> StepResult:
        if self._deferred is not None:
            raise RuntimeError("a deferred jump is pending: settle it first")
        pool = self.pool
        prof = self.profile
        bs = self.block_size
        budget = self.max_batched
        running = self.running
        sched: list[tuple[Request, int]] = []
        preempted: list[Request] | None = None  # allocated on the first preemption (most steps have none)
        attn = 0.0  # the step's attention terms: prefill chunks, decode tokens (see the cost below)
        dec_attn = 0.0
        prefill = 0
        attn_s = prof.attn_s
        kv_read_s = prof.kv_read_s
        i = 0
        while i < len(running):
            req = running[i]
            n = req.num_tokens - req.computed
            if n > budget:
                n = budget
            if n <= 0:
                i += 1
                continue
            upto = req.computed + n
            while upto >= req.grow_at and not pool.grow(req.rid, upto):
                victim = running.pop()
                self._preempt(victim)
                if preempted is None:
                    preempted = [victim]
                else:
                    preempted.append(victim)
                if victim is req:
                    req = None  # type: ignore[assignment]
                    break
            if req is None:
                break
            if upto >= req.grow_at:
                req.grow_at = _grow_at(upto, bs)
            sched.append((req, n))
            budget -= n
            i += 1
            # its cost (summed in vLLM's order, as the step's cost below needs it)
            c = req.computed
            if n == 1 and c + 1 == req.num_tokens:
                # prof.chunk_attn(c, 1) inlined, the same arithmetic: this runs once per request a step
                comp = attn_s * (c + 0.5)
                mem = kv_read_s * (c + 1)
                dec_attn += comp if comp > mem else mem
            else:
                attn += prof.chunk_attn(c, n)
                prefill += n
        admitted = False
        blocked = False
        load_s = 0.0
        pins = self._pins
        if pins.expiry:
            pins.expire(now, pool)
        if not preempted:
            waiting = self.waiting
            caching = self.prefix_caching
            if self.prefix_first and len(waiting) > 1 and budget > 0:
                self._order_waiting()
            pinned = pins.by_session
            while waiting and budget > 0 and len(running) < self.max_seqs:
                req = waiting[0]
                if pinned and req.seq.session in pinned:  # the session's next request takes over its pinned blocks
                    pins.release(req.seq.session, pool)
                hit = pool.lookup(req.seq, req.num_tokens) if caching else 0
                n = req.num_tokens - hit
                if n > budget:
                    n = budget
                fit = req.num_tokens if self.reserve_full_prompt else 0
                if not pool.admit(req.rid, req.seq, req.num_tokens, hit, hit + n, fit):
                    blocked = True
                    break
                waiting.popleft()
                req.computed = hit
                loaded = pool.loaded_tokens
                if loaded:
                    load_s += pool.load_seconds(loaded)
                req.grow_at = _grow_at(hit + n, bs)
                if req.cached < 0:
                    req.cached = hit
                    req.t_sched = now
                    st = self.stats
                    st.queries += req.num_tokens
                    st.hits += hit
                running.append(req)
                sched.append((req, n))
                budget -= n
                admitted = True
                if n == 1 and hit + 1 == req.num_tokens:
                    dec_attn += prof.chunk_attn(hit, 1)
                else:
                    attn += prof.chunk_attn(hit, n)
                    prefill += n
        res = StepResult(0.0, 1, [], [], 0, sched, preempted or ())
        if not sched:
            return res
        # Cost of the step: its attention terms were summed as requests were scheduled.
        tokens = self.max_batched - budget
        decode_only = not prefill and not admitted and not preempted and (blocked or not self.waiting)
        if prefill:
            dec_attn *= prof.mixed_penalty(prefill, self.max_batched)
        dt = prof.step_time(tokens, len(sched), attn + dec_attn) + load_s
        steps = 1
        if decode_only and now + dt < horizon:
            n, grow_per_step = _jump_length(sched, dt, horizon - now, prof.kv_read_s, pool, self.block_size)
            if n > 1:
                if defer:  # nothing more changes until settle(): the jump may still be cut short
                    res.steps = n
                    res.duration = base.jump_duration(n, dt, grow_per_step)
                    res.deferred = True
                    self._deferred = (res, now, dt, grow_per_step)
                    return res
                _grow_jump(pool, sched, n, self.block_size)
                steps, dt = n, base.jump_duration(n, dt, grow_per_step)
        return self._update(res, now, steps, dt, prefill)

    def settle(self, until: float | None = None) -> StepResult:
        """Carry out the jump ``step(..., defer=True)`` left pending, cut to the step containing ``until`` (the
        whole jump when None or past its end): the same steps, blocks and duration as a jump whose horizon had
        been ``until``. Returns the step's result, now with its finished requests."""
        if self._deferred is None:
            raise RuntimeError("no deferred jump to settle")
        res, start, dt1, grow_per_step = self._deferred
        self._deferred = None
        res.deferred = False
        n = res.steps
        if until is not None:
            n = base.jump_steps(n, dt1, grow_per_step, until - start)
        if n > 1:
            _grow_jump(self.pool, res.scheduled, n, self.block_size)
            dt = res.duration if n == res.steps else base.jump_duration(n, dt1, grow_per_step)
        else:
            n, dt = 1, dt1
        return self._update(res, start, n, dt, 0)

    def _update(self, res: StepResult, now: float, steps: int, dt: float, prefill: int) -> StepResult:
        """The step's effect: computed tokens catch up; a request whose prompt is done samples one token per
        step (``steps`` of them in a jump)."""
        sched = res.scheduled
        out = res
        out.steps = steps
        out.duration = dt
        out.prefill_tokens = prefill
        t_end = now + dt
        finished = out.finished
        first = out.first_token
        for req, n in sched:  # Request.sample, inlined: this loop runs for every request of every step
            if steps > 1:
                req.computed += steps
                k = steps
            else:
                req.computed += n
                if req.computed < req.num_tokens:
                    continue
                k = 1
            req.num_tokens += k
            req.generated += k
            if req.t_first < 0:
                req.t_first = t_end
                first.append(req)
            if req.generated >= req.max_tokens:
                req.t_end = t_end
                finished.append(req)
        if finished:
            pool = self.pool
            if self.pin_ttl_s > 0:
                for req in finished:
                    self._pins.pin(req, t_end, pool)
            else:
                for req in finished:
                    pool.free(req.rid)
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
        st = self.stats
        st.steps += steps
        st.busy_s += dt
        st.prefill_tokens += prefill
        return out


def _jump_length(
    sched: list[tuple[Request, int]], dt1: float, span: float, kv_read_s: float, pool: KVPool, bs: int
) -> tuple[int, float]:
    """How many identical decode steps the step ``sched`` can be extended into (1: none), and the growth of a step's
    duration per step. Changes nothing."""
    grow_per_step = kv_read_s * len(sched)  # every context grows by one token a step
    n_max = min(r.max_tokens - r.generated for r, _ in sched)
    if n_max <= 1 or any(r.t_first < 0 for r, _ in sched):  # a first token ends this very step
        return 1, grow_per_step
    n_max = base.jump_steps(n_max, dt1, grow_per_step, span)
    # blocks: the first step's blocks are allocated; find the largest n whose extra blocks fit
    free = pool.num_free_blocks()

    def extra(n: int) -> int:
        tot = 0
        for r, _ in sched:
            tot += blocks_for(r.computed + n, bs) - blocks_for(r.computed + 1, bs)
        return tot

    if extra(n_max) > free:
        lo, hi = 1, n_max
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if extra(mid) <= free:
                lo = mid
            else:
                hi = mid - 1
        n_max = lo
    return max(n_max, 1), grow_per_step


def _grow_jump(pool: KVPool, sched: list[tuple[Request, int]], n: int, bs: int) -> None:
    """Allocate the blocks of a jump of ``n`` steps."""
    for r, _ in sched:
        ok = pool.grow(r.rid, r.computed + n)
        assert ok
        r.grow_at = _grow_at(r.computed + n, bs)


def _grow_at(tokens: int, block_size: int) -> int:
    """Smallest allocation above ``tokens`` that changes the pool: one that fills the partial last block or,
    when the last block is full, one that needs a new block. Smaller ones need no call at all."""
    if tokens % block_size:
        return (tokens // block_size + 1) * block_size
    return tokens + 1
