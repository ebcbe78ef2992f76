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
long-prefill cap): ``tests/test_vllm_sched_oracle.py`` drives both with the same request streams and asserts the
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
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from kvgate.engine.blocks import SeqKey, blocks_for
from kvgate.engine.cache import RunKVPool
from kvgate.engine.costmodel import Profile


class Request:
    __slots__ = (
        "rid", "seq", "prompt", "max_tokens", "num_tokens", "computed", "generated", "cached",
        "preemptions", "t_submit", "t_sched", "t_first", "t_end", "tag", "grow_at",
    )  # fmt: skip

    def __init__(self, rid: int, seq: SeqKey, prompt: int, max_tokens: int, now: float, tag: object) -> None:
        self.rid = rid
        self.seq = seq
        self.prompt = prompt
        self.max_tokens = max_tokens
        self.num_tokens = prompt
        self.computed = 0
        self.generated = 0
        self.cached = (
            -1
        )  # prefix-cache hit at first scheduling (vLLM reports it, not a later re-admission), -1 until then
        self.preemptions = 0
        self.t_submit = now
        self.t_sched = -1.0
        self.t_first = -1.0
        self.t_end = -1.0
        self.tag = tag
        self.grow_at = 0  # allocations below this many tokens change nothing in the pool (see _grow_at)


@dataclass(slots=True)
class StepResult:
    duration: float
    steps: int
    finished: list[Request] = field(default_factory=list)
    first_token: list[Request] = field(default_factory=list)
    prefill_tokens: int = 0
    scheduled: list[tuple[Request, int]] = field(default_factory=list)
    """The requests the step ran and the new tokens of each (per single step of a jump), in vLLM's order."""
    preempted: list[Request] = field(default_factory=list)
    """Requests preempted by recompute in this step, in order."""


@dataclass(slots=True)
class EngineStats:
    steps: int = 0
    busy_s: float = 0.0
    preemptions: int = 0
    prompt_tokens: int = 0
    cached_tokens: int = 0
    prefill_tokens: int = 0
    queries: int = 0
    hits: int = 0


class VllmEngine:
    """The simulated vLLM v1 engine. Drive it with :meth:`add` and :meth:`step`."""

    def __init__(
        self,
        profile: Profile,
        kv_pool_tokens: int | None = None,
        *,
        block_size: int = 16,
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 1024,
        prefix_caching: bool = True,
        reserve_full_prompt: bool = True,
        pool: object | None = None,
    ) -> None:
        self.profile = profile
        self.block_size = block_size
        self.kv_pool_tokens = kv_pool_tokens or profile.kv_pool_tokens
        self.num_blocks = self.kv_pool_tokens // block_size
        self.prefix_caching = prefix_caching
        self.pool = pool if pool is not None else RunKVPool(self.num_blocks, block_size, prefix_caching)
        self.max_batched = max_num_batched_tokens
        self.max_seqs = max_num_seqs
        self.reserve_full_prompt = reserve_full_prompt
        self.running: list[Request] = []
        self.waiting: deque[Request] = deque()
        self.stats = EngineStats()

    # -- driver API -------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.prompt + req.max_tokens > self.profile.max_model_len:
            raise ValueError(
                f"request of {req.prompt}+{req.max_tokens} tokens exceeds max_model_len {self.profile.max_model_len}"
            )
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    def usage(self) -> float:
        return 1.0 - self.pool.num_free_blocks() / self.num_blocks  # type: ignore[attr-defined]

    def flush(self, preempt: bool = True) -> bool:
        """``reset_prefix_cache``; with ``preempt`` running requests are preempted first (as a restart)."""
        if preempt:
            for req in reversed(self.running):
                self._preempt(req)
            self.running.clear()
        return bool(self.pool.reset())  # type: ignore[attr-defined]

    def abort(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
            self.pool.free(req.rid)  # type: ignore[attr-defined]
        elif req in self.waiting:
            self.waiting.remove(req)

    def _preempt(self, req: Request) -> None:
        self.pool.free(req.rid)  # type: ignore[attr-defined]
        req.computed = 0
        req.grow_at = 0
        req.preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)

    # -- one step (or a jump of identical decode steps) --------------------------------------------------
    def step(self, now: float, horizon: float = math.inf) -> StepResult:
        pool = self.pool
        prof = self.profile
        bs = self.block_size
        budget = self.max_batched
        running = self.running
        sched: list[tuple[Request, int]] = []
        preempted: list[Request] = []
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
            while upto >= req.grow_at and not pool.grow(req.rid, upto):  # type: ignore[attr-defined]
                victim = running.pop()
                self._preempt(victim)
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
        admitted = False
        blocked = False
        load_s = 0.0
        if not preempted:
            waiting = self.waiting
            caching = self.prefix_caching
            while waiting and budget > 0 and len(running) < self.max_seqs:
                req = waiting[0]
                hit = pool.lookup(req.seq, req.num_tokens) if caching else 0  # type: ignore[attr-defined]
                n = req.num_tokens - hit
                if n > budget:
                    n = budget
                fit = req.num_tokens if self.reserve_full_prompt else 0
                if not pool.admit(req.rid, req.seq, req.num_tokens, hit, hit + n, fit):  # type: ignore[attr-defined]
                    blocked = True
                    break
                waiting.popleft()
                req.computed = hit
                loaded = getattr(pool, "loaded_tokens", 0)
                if loaded:
                    load_s += pool.load_seconds(loaded)  # type: ignore[attr-defined]
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
        res = StepResult(0.0, 1, scheduled=sched, preempted=preempted)
        if not sched:
            return res
        # Cost of the step.
        tokens = 0
        attn = 0.0
        dec_attn = 0.0
        decode_only = not admitted and not preempted and (blocked or not self.waiting)
        prefill = 0
        for req, n in sched:
            tokens += n
            if n == 1 and req.computed + 1 == req.num_tokens:
                dec_attn += prof.chunk_attn(req.computed, 1)
                if req.t_first < 0:
                    decode_only = False  # its first token ends this very step, not the jump
            else:
                attn += prof.chunk_attn(req.computed, n)
                decode_only = False
                prefill += n
        if prefill:
            dec_attn *= prof.mixed_decode_factor
        dt = prof.step_time(tokens, len(sched), attn + dec_attn) + load_s
        steps = 1
        if decode_only and now + dt < horizon:
            steps, dt = self._jump(sched, dt, horizon - now)
        # Update: computed tokens catch up; a request whose prompt is done samples one token per step.
        out = res
        out.steps = steps
        out.duration = dt
        out.prefill_tokens = prefill
        t_end = now + dt
        finished = out.finished
        for req, n in sched:
            if steps > 1:
                req.computed += steps
                req.num_tokens += steps
                req.generated += steps
            else:
                req.computed += n
                if req.computed < req.num_tokens:
                    continue
                req.num_tokens += 1
                req.generated += 1
            if req.t_first < 0:
                req.t_first = t_end
                out.first_token.append(req)
            if req.generated >= req.max_tokens:
                req.t_end = t_end
                finished.append(req)
        if finished:
            for req in finished:
                pool.free(req.rid)  # type: ignore[attr-defined]
            done = {id(r) for r in finished}
            self.running = [r for r in running if id(r) not in done]
        st = self.stats
        st.steps += steps
        st.busy_s += dt
        st.prefill_tokens += prefill
        return out

    def _jump(self, sched: list[tuple[Request, int]], dt1: float, span: float) -> tuple[int, float]:
        """Extend a decode-only step into ``n`` identical steps; returns (n, total duration)."""
        b = len(sched)
        grow_per_step = self.profile.kv_read_s * b  # every context grows by one token a step
        n_max = min(r.max_tokens - r.generated for r, _ in sched)
        if n_max <= 1:
            return 1, dt1
        # steps until the driver's next event falls inside the last step
        if math.isfinite(span):
            a = grow_per_step / 2.0
            bb = dt1 - a
            n_time = math.ceil((-bb + math.sqrt(bb * bb + 4 * a * span)) / (2 * a)) if a > 0 else math.ceil(span / dt1)
            n_max = min(n_max, max(1, n_time))
        # blocks: the first step's blocks are allocated; find the largest n whose extra blocks fit
        bs = self.block_size
        free = self.pool.num_free_blocks()  # type: ignore[attr-defined]

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
        n = n_max
        if n <= 1:
            return 1, dt1
        for r, _ in sched:
            ok = self.pool.grow(r.rid, r.computed + n)  # type: ignore[attr-defined]
            assert ok
            r.grow_at = _grow_at(r.computed + n, bs)
        return n, n * dt1 + grow_per_step * n * (n - 1) / 2.0


def _grow_at(tokens: int, block_size: int) -> int:
    """Smallest allocation above ``tokens`` that changes the pool: one that fills the partial last block or,
    when the last block is full, one that needs a new block. Smaller ones need no call at all."""
    if tokens % block_size:
        return (tokens // block_size + 1) * block_size
    return tokens + 1
