"""An SGLang-like engine in virtual time: radix prefix cache, prefill-first scheduler, retraction.

It is driven exactly like :class:`kvgate.engine.vllm.VllmEngine` (same :class:`Request`, :class:`StepResult`,
:class:`EngineStats`, same cost model), and models SGLang 0.5's scheduler and RadixCache where they matter for
prefix-cached agent sessions. What was read (sgl-project/sglang, v0.5.6 and v0.5.18): ``mem_cache/radix_cache.py``,
``mem_cache/common.py``, ``managers/schedule_policy.py`` (``SchedulePolicy``, ``PrefillAdder``),
``managers/scheduler.py`` (``get_next_batch_to_run``, ``get_new_batch_prefill``, ``update_running_batch``,
``flush_cache``), ``managers/schedule_batch.py`` (``init_next_round_input``, ``retract_decode``, ``release_req``)
and ``scheduler_components/new_token_ratio_tracker.py``. The radix cache and its token pool are
:mod:`kvgate.engine.radix`; this module is the scheduler over it.

Scheduler (``get_next_batch_to_run``; mixed chunked prefill is off by default, overlap scheduling not
modelled). Each step runs *either* one prefill batch *or* one decode step of the whole running batch:

1. prefill first: the in-progress chunked request (if any) takes its next chunk, then waiting requests are
   added in policy order (``fcfs``, or ``lpm``: stable sort by matched prefix, longest first) while
   ``max_num_batched_tokens`` (SGLang's ``chunked_prefill_size``) lasts; the first one that does not fit the
   chunk is truncated and becomes the chunked request. PrefillAdder's memory rule: with
   ``rem_total = free + evictable - reserved``, where ``reserved`` is, over running requests,
   ``min(max_new - generated, 4096) * new_token_ratio`` plus, over requests added this round,
   ``extend + min(max_new, 4096) + 1``, a request is refused (NO_TOKEN) when
   ``extend + remaining max_new + 1 >= rem_total`` (checked before and after locking its matched prefix).
   NO_TOKEN sets ``batch_is_full``: no prefill is tried again until the running batch shrinks (a request
   finishes or is retracted), or nothing is running;
2. otherwise decode: if ``free`` (after evicting the shortfall) cannot hold one token per running request,
   ``retract_decode`` retracts requests, fewest output tokens first (ties: longest prompt), until it can:
   their private KV is freed, their prompt stays in the tree unlocked, they go to the back of the waiting
   queue to be re-prefilled (prompt + output so far) and count as preemptions; ``new_token_ratio`` is reset
   to (decoded + 20 x running) / (max_new + 1) over the requests kept. Each decode step without retraction
   lowers ``new_token_ratio`` by (0.7 - 0.098) / 600 down to 0.098 (init 0.7, min factor 0.14).

Costs use the profile exactly as the vLLM engine does; because a prefill batch never carries decode tokens,
``mixed_decode_factor`` never applies (decode always runs on the paged-decode kernel), but decoding requests
wait while prefill batches run.

The radix cache is SGLang 0.5.23's call for call (``tests/engine/test_sglang_tree_oracle.py`` holds it to SGLang's
own ``UnifiedRadixCache``); ``flush`` ignores ``preempt``.

Speed: a decode step after which no prefill can be tried (nothing waiting, or ``batch_is_full``) and no request
is chunked is repeated ``n`` times in one jump, as in the vLLM engine: until a request finishes, memory would
force a retraction (evictions on the way are made in the same order as single steps make them), or the
driver's next event is due.
"""

from __future__ import annotations

import math

import kvgate.engine.base as base
from kvgate.engine.base import EngineStats, Request, SessionStatus, StepResult
from kvgate.engine.costmodel import Profile
from kvgate.engine.radix import RadixCache

CLIP_MAX_NEW_TOKENS = 4096
"""SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION: cap of a request's max_new_tokens in the admission estimate."""
INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO_FACTOR = 0.14
NEW_TOKEN_RATIO_DECAY_STEPS = 600
RETRACT_DECODE_STEPS = 20
LPM_MAX_QUEUE = 128
"""With more waiting requests SGLang's lpm falls back to fcfs (no whole-queue matching)."""
IN_BATCH_PREFIX_THRESHOLD = 32
"""IN_BATCH_PREFIX_CACHING_CHECK/DEPRIORITIZE_THRESHOLD (lpm's in-batch prefix caching)."""
PAGE = 1


def lpm_order(waiting: list[Request], cache: RadixCache) -> list[Request]:
    """CacheAwarePolicy lpm: match every waiting request, then a stable sort by hit, longest first; requests
    with a tiny hit that share a prefix with an earlier such request go last (in-batch prefix caching)."""
    seen: set[tuple[int, int]] = set()
    keys: list[float] = []
    for r in waiting:
        hit = cache.match(r)
        key = float(-hit)
        if hit <= IN_BATCH_PREFIX_THRESHOLD:
            gkey = (r.seq.group, r.seq.group_blocks)
            shared = r.seq.group_blocks * cache.block_size
            if shared >= IN_BATCH_PREFIX_THRESHOLD and gkey in seen:
                key = math.inf
            elif shared:
                seen.add(gkey)
        keys.append(key)
    order = sorted(range(len(keys)), key=keys.__getitem__)
    return [waiting[i] for i in order]


class PrefillAdder:
    """One round of ``get_new_batch_prefill`` (SGLang's ``PrefillAdder``): the batch being built and the memory
    it reserves, for the running requests' remaining outputs and for its own requests."""

    __slots__ = ("cache", "reserved", "reserved_cur", "rem_input", "rem_chunk", "batch", "admitted", "chunked", "full")

    def __init__(
        self, cache: RadixCache, running: list[Request], ratio: float, max_prefill_tokens: int, max_batched: int
    ) -> None:
        self.cache = cache
        reserved = 0.0
        for r in running:
            reserved += min(r.max_tokens - r.generated, CLIP_MAX_NEW_TOKENS) * ratio
        self.reserved = reserved
        self.reserved_cur = 0.0
        self.rem_input = max_prefill_tokens
        self.rem_chunk = max_batched
        self.batch: list[tuple[Request, int]] = []
        """The requests of the batch and the new tokens of each."""
        self.admitted: list[tuple[Request, int]] = []
        """The waiting requests added, with their hits."""
        self.chunked: Request | None = None
        """The waiting request truncated this round: the next chunked request."""
        self.full = False
        """A request was refused for memory (NO_TOKEN): the engine's ``batch_is_full``."""

    def add_chunked(self, req: Request) -> Request | None:
        """The chunked request's next chunk; returns the request while it stays chunked."""
        cache = self.cache
        rem = min(self.rem_chunk, int(cache.free + cache.evictable - self.reserved))
        if rem <= 0:
            return req  # no room for a chunk this round
        left = req.num_tokens - req.computed
        n = min(left, rem)
        truncated = left > n
        self.batch.append((req, n))
        self.reserved += n + (0 if truncated else min(req.max_tokens, CLIP_MAX_NEW_TOKENS)) + PAGE
        self.reserved_cur += n + PAGE
        self.rem_input -= n
        self.rem_chunk -= n
        return req if truncated else None

    def add_one(self, req: Request) -> bool:
        """Add a waiting request, or its first chunk; False when the round ends here."""
        cache = self.cache
        hit = cache.match(req)
        extend = req.num_tokens - hit
        total = extend + min(max(req.max_tokens - req.generated, 0), CLIP_MAX_NEW_TOKENS) + PAGE
        if total >= cache.free + cache.evictable - self.reserved:
            self.full = True
            return False
        cache.lock(req, hit)
        if total >= cache.free + cache.evictable - self.reserved:  # locking the prefix took it off evictable
            cache.unlock_req(req)
            self.full = True
            return False
        if extend <= self.rem_chunk:
            n = extend
            self.reserved += extend + min(req.max_tokens, CLIP_MAX_NEW_TOKENS) + PAGE
        else:
            n = self.rem_chunk
            if n <= 0:
                cache.unlock_req(req)
                return False
            self.chunked = req
            self.reserved += n + PAGE
        self.reserved_cur += n + PAGE
        self.rem_input -= n
        self.rem_chunk -= n
        self.batch.append((req, n))
        self.admitted.append((req, hit))
        avail = cache.free + cache.evictable
        if avail - self.reserved <= 0 or avail - self.reserved_cur <= 0:
            self.full = True
            return False
        return self.rem_input > 0 and self.rem_chunk > 0


class SglangEngine:
    """The simulated SGLang engine. Drive it with :meth:`add` and :meth:`step` (see the vLLM engine)."""

    tracks_sessions: bool = False
    """No engine-side alternative is modelled: session reports change nothing."""
    hit_caps: dict[int, int] | None = None
    """The radix cache does not cap hits."""
    defers_jumps: bool = False
    """A jump's room is made as it is planned (evictions from the radix cache), so it is never left pending:
    ``defer`` is ignored, and a driver bounds its steps by every event that may reach the engine."""

    def __init__(
        self,
        profile: Profile,
        kv_pool: int | None = None,
        *,
        prefix_caching: bool = True,
        policy: str = "fcfs",
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 1024,
        max_prefill_tokens: int = 16384,
    ) -> None:
        if policy not in ("fcfs", "lpm"):
            raise ValueError(f"unknown schedule policy {policy!r}; choose fcfs or lpm")
        self.profile = profile
        self.block_size = 1  # SGLang's default page size
        self.kv_pool = kv_pool or profile.kv_pool
        if self.kv_pool <= 0 or max_num_batched_tokens <= 0:
            raise ValueError("kv_pool and max_num_batched_tokens must be positive")
        self.prefix_caching = prefix_caching
        self.policy = policy
        self.max_batched = max_num_batched_tokens
        self.max_seqs = max_num_seqs
        self.max_prefill_tokens = max_prefill_tokens
        self.running: list[Request] = []
        self.waiting: list[Request] = []
        self.chunked: Request | None = None
        self.batch_is_full = False
        self.stats = EngineStats()
        self.retractions = 0
        # new_token_ratio = max(base - decays * decay, min), kept as a count so a jump equals its single steps
        self._ratio_min = INIT_NEW_TOKEN_RATIO * MIN_NEW_TOKEN_RATIO_FACTOR
        self._ratio_decay = (INIT_NEW_TOKEN_RATIO - self._ratio_min) / NEW_TOKEN_RATIO_DECAY_STEPS
        self._ratio_base = INIT_NEW_TOKEN_RATIO
        self._ratio_decays = 0
        self.cache = RadixCache(self.kv_pool, caching=prefix_caching)
        self._jumpable = profile.attn_s <= profile.kv_read_s  # a decode token's attention is bound by its KV read

    # -- driver API -------------------------------------------------------------------------------------
    @property
    def num_blocks(self) -> int:
        """Pages of one token."""
        return self.kv_pool

    def add(self, req: Request) -> None:
        base.check_fits(req, self.profile.max_model_len)
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.chunked is not None)

    def usage(self) -> float:
        """Fraction of the pool held by requests (SGLang's token usage: not free, not evictable)."""
        cache = self.cache
        return 1.0 - (cache.free + cache.evictable) / self.kv_pool

    def queue_lengths(self) -> tuple[int, int]:
        return len(self.running) + (self.chunked is not None), len(self.waiting)

    def session_status(self, session: int, status: SessionStatus) -> None:
        base.check_session_status(status)

    def new_token_ratio(self) -> float:
        r = self._ratio_base - self._ratio_decays * self._ratio_decay
        return r if r > self._ratio_min else self._ratio_min

    def flush(self, preempt: bool = True) -> bool:
        """SGLang's ``/flush_cache``: refused (False, nothing changed) unless the engine is idle, with nothing
        running or waiting; then the radix tree is cleared. ``preempt`` is ignored: SGLang cannot preempt."""
        if self.has_work():
            return False
        self.cache.clear()
        return True

    def abort(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
            self.cache.release(req)
            self.batch_is_full = False
        elif req is self.chunked:
            self.chunked = None
            self.cache.release(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    # -- inspection -----------------------------------------------------------------------------------------
    def check_invariants(self) -> None:
        """Token conservation and the evictable count (for tests)."""
        self.cache.check([*self.running, *([self.chunked] if self.chunked is not None else [])])

    # -- one step (or a jump of identical decode steps) --------------------------------------------------
    def step(self, now: float, horizon: float = math.inf, defer: bool = False) -> StepResult:
        """One step (or a jump) at ``now``; ``defer`` is ignored (see :attr:`defers_jumps`)."""
        batch = self._schedule_prefill(now)
        if batch is not None:
            return self._run_prefill(batch, now)
        return self._run_decode(now, horizon)

    def settle(self, until: float | None = None) -> StepResult:
        raise RuntimeError("the SGLang engine leaves no jump pending")

    def _schedule_prefill(self, now: float) -> list[tuple[Request, int]] | None:
        """``get_new_batch_prefill`` with ``PrefillAdder``: the next prefill batch, or None."""
        running = self.running
        waiting = self.waiting
        chunked = self.chunked
        cache = self.cache
        if chunked is None:
            if not waiting:
                return None
            if not running:
                self.batch_is_full = False
            if self.batch_is_full:
                return None
            if len(running) >= self.max_seqs:
                self.batch_is_full = True
                return None
        if self.policy == "lpm" and self.prefix_caching and len(waiting) <= LPM_MAX_QUEUE:
            waiting = self.waiting = lpm_order(waiting, cache)
        adder = PrefillAdder(cache, running, self.new_token_ratio(), self.max_prefill_tokens, self.max_batched)
        keep_chunked = adder.add_chunked(chunked) if chunked is not None else None
        room = self.max_seqs - len(running)
        for req in waiting:
            if len(adder.batch) >= room:
                self.batch_is_full = True
                break
            if not adder.add_one(req):
                break
        if adder.full:
            self.batch_is_full = True
        self.chunked = adder.chunked if adder.chunked is not None else keep_chunked
        batch = adder.batch
        admitted = adder.admitted
        if not batch:
            if not running and chunked is None and waiting:
                req = waiting[0]
                raise RuntimeError(
                    f"request {req.rid} ({req.num_tokens} tokens + {req.max_tokens - req.generated} to generate) "
                    f"can never fit the {self.kv_pool}-token KV pool"
                )
            return None
        if admitted:
            ids = {id(r) for r, _ in admitted}
            self.waiting = [r for r in waiting if id(r) not in ids]
            st = self.stats
            for req, hit in admitted:
                req.computed = hit
                if req.cached < 0:
                    req.cached = hit
                    req.t_sched = now
                    st.queries += req.num_tokens
                    st.hits += hit
        cache.alloc(sum(n for _, n in batch))
        return batch

    def _run_prefill(self, batch: list[tuple[Request, int]], now: float) -> StepResult:
        prof = self.profile
        tokens = 0
        attn = 0.0
        for req, n in batch:
            tokens += n
            attn += prof.chunk_attn(req.computed, n)
        dt = prof.step_time(tokens, len(batch), attn)
        out = StepResult(dt, 1, prefill_tokens=tokens)
        t_end = now + dt
        for req, n in batch:
            req.computed += n
            if req.computed < req.num_tokens:
                self.cache.insert(req)  # a chunk: cache_unfinished_req(chunked=True)
                continue
            if req.sample(1, t_end, out):
                self.cache.finish(req)
                out.finished.append(req)
            else:
                self.cache.insert(req)
                self.running.append(req)
        if out.finished:
            self.batch_is_full = False
        st = self.stats
        st.steps += 1
        st.busy_s += dt
        st.prefill_tokens += tokens
        return out

    def _retract(self) -> None:
        """``retract_decode``: retract requests (fewest output tokens first, ties longest prompt) until the
        others can decode one more token; reset ``new_token_ratio`` from the ones kept."""
        running = self.running
        order = sorted(range(len(running)), key=lambda i: (running[i].generated, -running[i].prompt), reverse=True)
        retracted: list[Request] = []
        first = True
        while first or not self.cache.make_room(len(order)):
            if len(order) == 1:
                break
            first = False
            req = running[order.pop()]
            self.cache.release(req)
            self.cache.make_room(len(order) * RETRACT_DECODE_STEPS)
            req.computed = 0
            req.preemptions += 1
            self.stats.preemptions += 1
            self.retractions += 1
            retracted.append(req)
        if not self.cache.make_room(len(order)):
            raise RuntimeError("out of KV memory with a single request decoding")
        kept = [running[i] for i in order]
        self.running = kept
        decoded = sum(r.generated for r in kept)
        max_new = sum(r.max_tokens for r in kept)
        self._ratio_base = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(kept)) / (max_new + 1))
        self._ratio_decays = 0
        self.waiting.extend(retracted)
        self.batch_is_full = False

    def _run_decode(self, now: float, horizon: float) -> StepResult:
        if not self.running:
            return StepResult(0.0, 1)
        if self.cache.make_room(len(self.running)):
            self._ratio_decays += 1
        else:
            self._retract()
        running = self.running
        b = len(running)
        self.cache.alloc(b)  # check_decode_mem made room
        prof = self.profile
        attn = 0.0
        for r in running:
            attn += prof.chunk_attn(r.computed, 1)
        dt = prof.step_time(b, b, attn)
        steps = 1
        if self._jumpable and self.chunked is None and (self.batch_is_full or not self.waiting) and now + dt < horizon:
            steps, dt = self._jump(dt, horizon - now)
        out = StepResult(dt, steps)
        t_end = now + dt
        finished = out.finished
        for r in running:
            r.computed += steps
            r.num_tokens += steps
            r.generated += steps
            if r.generated >= r.max_tokens:
                r.t_end = t_end
                self.cache.finish(r)
                finished.append(r)
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in running if id(r) not in done]
            self.batch_is_full = False
        st = self.stats
        st.steps += steps
        st.busy_s += dt
        return out

    def _jump(self, dt1: float, span: float) -> tuple[int, float]:
        """Extend a decode step (its tokens allocated) into ``n`` identical steps; returns (n, total duration)."""
        running = self.running
        b = len(running)
        n_max = min(r.max_tokens - r.generated for r in running)
        if n_max <= 1:
            return 1, dt1
        grow_per_step = self.profile.kv_read_s * b  # every context grows by one token a step
        n_max = base.jump_steps(n_max, dt1, grow_per_step, span)
        cache = self.cache
        n = 1
        while n < n_max:
            if cache.free >= b:
                t = min(n_max - n, cache.free // b)
                cache.alloc(t * b)
                n += t
            elif not cache.make_room(b):  # what check_decode_mem does before that step
                break  # that step retracts: leave it to a single step
        self._ratio_decays += n - 1
        return n, base.jump_duration(n, dt1, grow_per_step)
