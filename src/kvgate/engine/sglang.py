"""An SGLang-like engine in virtual time: radix prefix cache, prefill-first scheduler, retraction.

It is driven exactly like :class:`kvgate.engine.vllm.VllmEngine` (same :class:`Request`, :class:`StepResult`,
:class:`EngineStats`, same cost model), and models SGLang 0.5's scheduler and RadixCache where they matter for
prefix-cached agent sessions. What was read (sgl-project/sglang, v0.5.6 and v0.5.18): ``mem_cache/radix_cache.py``,
``mem_cache/common.py``, ``managers/schedule_policy.py`` (``SchedulePolicy``, ``PrefillAdder``),
``managers/scheduler.py`` (``get_next_batch_to_run``, ``get_new_batch_prefill``, ``update_running_batch``,
``flush_cache``), ``managers/schedule_batch.py`` (``init_next_round_input``, ``retract_decode``, ``release_req``)
and ``scheduler_components/new_token_ratio_tracker.py``.

Radix cache (page size 1, so ``block_size`` is 1 and a :class:`SeqKey` group prefix is ``group_blocks`` tokens).
In kvgate's content model the tree is a root, one node per group prefix, and under it one chain of nodes per
session (the session's tokens are unique and append-only)::

    root -- group g (2000 tokens) -+- session 7: [4000 | 299 | 1001 | 299 | ...]   <- leaf = last node
                                   +- session 9: [4000 | 299]

* A node is added per insertion: after a request's prefill SGLang inserts its prompt (``cache_unfinished_req``;
  also after every chunk of a chunked prefill) and after it finishes its committed KV, prompt + output - 1
  tokens (``cache_finished_req``; the last sampled token has no KV). So a turn adds a prompt node and an output
  node, and the next turn of the session hits prompt + output - 1 tokens (``min`` with its input - 1, SGLang's
  ``max_prefix_len``).
* Every match and insert stamps the whole matched path with one access time. kvgate uses a counter for the
  clock (SGLang: ``time.monotonic()``), so all nodes of a session chain share its session's stamp, and the
  group node carries the newest stamp of any session under it.
* A running request locks its path (``lock_ref``); locked tokens are protected, unlocked ones evictable.
* ``evict(n)`` pops unlocked leaves in LRU order and deletes them whole, pushing a parent that became an
  unlocked leaf: a session's chain goes tail node first, and its stamp is the oldest until it is gone, so
  sessions are evicted one after another, least recently used first; the group node goes only when no chain
  is left under it. Allocation evicts the shortfall only (v0.5.18 ``evict_from_tree_cache``).
* The match made when the scheduler *considers* a waiting request refreshes its stamp too: with ``fcfs`` the
  waiting requests it walks through up to the first one refused; with ``lpm`` every waiting request, each
  scheduling round (SGLang matches the whole queue to sort it, while it holds at most 128 requests).

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

Simplifications: a group prefix is one node from the start (SGLang makes the first request's prompt one node
and splits it at the shared prefix when a second session matches); a chunk that ends inside the group prefix
of an uncached group is inserted only once the prefill passes the group prefix; ``flush`` ignores ``preempt``.

Speed: a decode step after which no prefill can be tried (nothing waiting, or ``batch_is_full``) and no request
is chunked is repeated ``n`` times in one jump, as in the vLLM engine: until a request finishes, memory would
force a retraction (evictions on the way are made in the same order as single steps make them), or the
driver's next event is due.
"""

from __future__ import annotations

import heapq
import math

from kvgate.engine.base import EngineStats, Request, StepResult
from kvgate.engine.blocks import SeqKey
from kvgate.engine.costmodel import Profile

__all__ = ["SglangEngine", "Request", "StepResult", "EngineStats"]

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


class _Group:
    """The node of a group prefix."""

    __slots__ = ("key", "tokens", "present", "lock", "tick", "chains")

    def __init__(self, key: tuple[int, int], tokens: int) -> None:
        self.key = key
        self.tokens = tokens
        self.present = False
        self.lock = 0  # lock_ref: requests holding a path through this node
        self.tick = 0  # last access
        self.chains = 0  # sessions with a non-empty chain under this node


class _Sess:
    """A session's chain of nodes under its group node; ``segs`` are the node lengths, root side first."""

    __slots__ = ("sid", "group", "segs", "length", "locked", "tick")

    def __init__(self, sid: int, group: _Group | None) -> None:
        self.sid = sid
        self.group = group
        self.segs: list[int] = []
        self.length = 0
        self.locked = False
        self.tick = 0


class _Held:
    """A request's hold on the tree: its session chain and, once matched or inserted, its group node."""

    __slots__ = ("sess", "has_group")

    def __init__(self, sess: _Sess, has_group: bool) -> None:
        self.sess = sess
        self.has_group = has_group


class SglangEngine:
    """The simulated SGLang engine. Drive it with :meth:`add` and :meth:`step` (see the vLLM engine)."""

    def __init__(
        self,
        profile: Profile,
        kv_pool_tokens: int | None = None,
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
        self.kv_pool_tokens = kv_pool_tokens or profile.kv_pool_tokens
        if self.kv_pool_tokens <= 0 or max_num_batched_tokens <= 0:
            raise ValueError("kv_pool_tokens and max_num_batched_tokens must be positive")
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
        self.evicted_tokens = 0
        self.retractions = 0
        # new_token_ratio = max(base - decays * decay, min), kept as a count so a jump equals its single steps
        self._ratio_min = INIT_NEW_TOKEN_RATIO * MIN_NEW_TOKEN_RATIO_FACTOR
        self._ratio_decay = (INIT_NEW_TOKEN_RATIO - self._ratio_min) / NEW_TOKEN_RATIO_DECAY_STEPS
        self._ratio_base = INIT_NEW_TOKEN_RATIO
        self._ratio_decays = 0
        # token pool: free + tree + private (computed KV of admitted requests not in the tree) == kv_pool_tokens
        self._free = self.kv_pool_tokens
        self._tree = 0
        self._evictable = 0
        self._groups: dict[tuple[int, int], _Group] = {}
        self._sessions: dict[int, _Sess] = {}
        self._held: dict[int, _Held] = {}
        self._tick = 0
        self._heap: list[tuple[int, int, _Group | _Sess]] = []
        self._heap_seq = 0
        self._jumpable = profile.attn_s <= profile.kv_read_s  # a decode token's attention is bound by its KV read

    # -- driver API -------------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        if req.prompt + req.max_tokens > self.profile.max_model_len:
            raise ValueError(
                f"request of {req.prompt}+{req.max_tokens} tokens exceeds max_model_len {self.profile.max_model_len}"
            )
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.running or self.waiting or self.chunked is not None)

    def usage(self) -> float:
        """Fraction of the pool held by requests (SGLang's token usage: not free, not evictable)."""
        return 1.0 - (self._free + self._evictable) / self.kv_pool_tokens

    def new_token_ratio(self) -> float:
        r = self._ratio_base - self._ratio_decays * self._ratio_decay
        return r if r > self._ratio_min else self._ratio_min

    def flush(self, preempt: bool = True) -> bool:
        """SGLang's ``/flush_cache``: refused (False, nothing changed) unless the engine is idle, with nothing
        running or waiting; then the radix tree is cleared. ``preempt`` is ignored: SGLang cannot preempt."""
        if self.has_work():
            return False
        self._free += self._tree
        self._tree = 0
        self._evictable = 0
        for g in self._groups.values():
            g.present = False
            g.chains = 0
        for s in self._sessions.values():
            s.segs.clear()
            s.length = 0
        self._heap.clear()
        return True

    def abort(self, req: Request) -> None:
        if req in self.running:
            self.running.remove(req)
            self._release(req)
            self.batch_is_full = False
        elif req is self.chunked:
            self.chunked = None
            self._release(req)
        elif req in self.waiting:
            self.waiting.remove(req)

    # -- radix cache --------------------------------------------------------------------------------------
    def cached_tokens(self, seq: SeqKey) -> int:
        """Tokens of ``seq`` in the tree: its group prefix (if present) and its session's chain. Pure."""
        if not self.prefix_caching:
            return 0
        g = self._groups.get((seq.group, seq.group_blocks)) if seq.group_blocks else None
        if g is not None and not g.present:
            return 0
        s = self._sessions.get(seq.session)
        return (g.tokens if g is not None else 0) + (s.length if s is not None else 0)

    def lookup(self, req: Request) -> int:
        """SGLang's ``match_prefix`` for a request not admitted yet: the hit, capped at its input - 1 tokens.
        Refreshes the access time of the matched path, as the scheduler's matches do."""
        return self._match(req)

    def evict(self, num_tokens: int) -> int:
        """Evict at least ``num_tokens`` tokens (whole leaves, LRU first) if there are that many; returns the
        number evicted."""
        return self._evict(num_tokens)

    def _objs(self, seq: SeqKey) -> tuple[_Group | None, _Sess]:
        g: _Group | None = None
        if seq.group_blocks:
            key = (seq.group, seq.group_blocks)
            g = self._groups.get(key)
            if g is None:
                g = self._groups[key] = _Group(key, seq.group_blocks * self.block_size)
        s = self._sessions.get(seq.session)
        if s is None:
            s = self._sessions[seq.session] = _Sess(seq.session, g)
        return g, s

    def _push(self, obj: _Group | _Sess) -> None:
        """Queue ``obj`` for eviction if it is an unlocked leaf (stale entries are skipped when popped)."""
        if type(obj) is _Sess:
            if obj.locked or not obj.length:
                return
        else:
            assert type(obj) is _Group
            if not obj.present or obj.lock or obj.chains:
                return
        self._heap_seq += 1
        heapq.heappush(self._heap, (obj.tick, self._heap_seq, obj))
        if len(self._heap) > 4 * (len(self._sessions) + len(self._groups)) + 4096:
            self._compact_heap()

    def _compact_heap(self) -> None:
        entries = []
        for tick, seq, obj in self._heap:
            if obj.tick == tick and self._is_leaf(obj):
                entries.append((tick, seq, obj))
        heapq.heapify(entries)
        self._heap = entries

    @staticmethod
    def _is_leaf(obj: _Group | _Sess) -> bool:
        if type(obj) is _Sess:
            return not obj.locked and obj.length > 0
        assert type(obj) is _Group
        return obj.present and not obj.lock and not obj.chains

    def _touch(self, grp: _Group | None, sess: _Sess | None) -> None:
        """Stamp a matched or inserted path with a new access time."""
        self._tick += 1
        t = self._tick
        if grp is not None and grp.present:
            grp.tick = t
            self._push(grp)
        if sess is not None and sess.length:
            sess.tick = t
            self._push(sess)

    def _match(self, req: Request) -> int:
        if not self.prefix_caching:
            return 0
        grp, sess = self._objs(req.seq)
        if sess.locked:
            raise ValueError(f"session {req.seq.session} already has a request holding its cached prefix")
        cap = req.num_tokens - 1
        gt = grp.tokens if grp is not None else 0
        if (grp is not None and not grp.present) or cap < gt:
            self._tick += 1  # only the root is stamped
            return 0
        have = gt + sess.length
        if have > cap:
            # SGLang would split the last node at the cap; in kvgate's workloads a session's next input always
            # extends its cached tokens, so this is an edge case: the excess is dropped (counted as evicted).
            self._trim(sess, cap - gt)
            have = cap
        self._touch(grp, sess)
        return have

    def _trim(self, sess: _Sess, keep: int) -> None:
        drop = sess.length - keep
        while sess.length > keep:
            last = sess.segs[-1]
            cut = min(last, sess.length - keep)
            if cut == last:
                sess.segs.pop()
            else:
                sess.segs[-1] = last - cut
            sess.length -= cut
        self._free += drop
        self._tree -= drop
        self._evictable -= drop
        self.evicted_tokens += drop
        if not sess.length and sess.group is not None:
            sess.group.chains -= 1
            self._push(sess.group)

    def _lock(self, req: Request, hit: int) -> None:
        """Lock the prefix ``hit`` matched (``inc_lock_ref``); the session is held even on a miss."""
        if not self.prefix_caching:
            return
        grp, sess = self._objs(req.seq)
        if sess.locked:
            raise ValueError(f"session {req.seq.session} already has a request holding its cached prefix")
        has_group = grp is not None and hit > 0
        if has_group:
            assert grp is not None
            if grp.lock == 0:
                self._evictable -= grp.tokens
            grp.lock += 1
        sess.locked = True
        self._evictable -= sess.length
        self._held[req.rid] = _Held(sess, has_group)

    def _unlock(self, held: _Held) -> None:
        sess = held.sess
        sess.locked = False
        self._evictable += sess.length
        self._push(sess)
        if held.has_group:
            grp = sess.group
            assert grp is not None
            grp.lock -= 1
            if grp.lock == 0:
                self._evictable += grp.tokens
                self._push(grp)

    def _unlock_req(self, req: Request) -> None:
        """Undo :meth:`_lock` for a request that was not added after all."""
        held = self._held.pop(req.rid, None)
        if held is not None:
            self._unlock(held)

    def _tree_part(self, held: _Held) -> int:
        g = held.sess.group
        return (g.tokens if held.has_group and g is not None else 0) + held.sess.length

    def _insert(self, req: Request) -> None:
        """Insert the request's computed tokens into the tree (``cache_unfinished_req`` / ``cache_finished_req``);
        they stay locked by the request."""
        if not self.prefix_caching:
            return
        held = self._held[req.rid]
        sess = held.sess
        grp = sess.group
        upto = req.computed
        if grp is not None and not held.has_group:
            if upto < grp.tokens:
                return  # a chunk ending inside an uncached group prefix: inserted with a later chunk
            if grp.present:
                # another request cached the shared prefix meanwhile: this request's copy is freed
                self._free += grp.tokens
                if grp.lock == 0:
                    self._evictable -= grp.tokens
            else:
                grp.present = True
                self._tree += grp.tokens
            grp.lock += 1
            held.has_group = True
        new = upto - self._tree_part(held)
        if new > 0:
            if not sess.length and grp is not None:
                grp.chains += 1
            sess.segs.append(new)
            sess.length += new
            self._tree += new
        self._touch(grp, sess)

    def _release(self, req: Request) -> None:
        """Free a request's KV that is not in the tree and unlock its path (retraction, abort)."""
        held = self._held.pop(req.rid, None)
        if held is None:
            self._free += req.computed
            return
        self._free += req.computed - self._tree_part(held)
        self._unlock(held)

    def _finish(self, req: Request) -> None:
        """``cache_finished_req``: the committed KV (prompt + output - 1 tokens) goes into the tree, unlocked."""
        held = self._held.get(req.rid)
        if held is None:
            self._free += req.computed
            return
        self._insert(req)
        del self._held[req.rid]
        self._unlock(held)

    def _evict(self, need: int) -> int:
        evicted = 0
        heap = self._heap
        while evicted < need and heap:
            tick, _, obj = heap[0]
            if obj.tick != tick or not self._is_leaf(obj):
                heapq.heappop(heap)
                continue
            if type(obj) is _Sess:
                seg = obj.segs.pop()
                obj.length -= seg
                if not obj.length:
                    heapq.heappop(heap)
                    g = obj.group
                    if g is not None:
                        g.chains -= 1
                        self._push(g)
            else:
                assert type(obj) is _Group
                heapq.heappop(heap)
                obj.present = False
                seg = obj.tokens
            evicted += seg
        self._free += evicted
        self._tree -= evicted
        self._evictable -= evicted
        self.evicted_tokens += evicted
        return evicted

    def _alloc(self, n: int) -> None:
        if self._free < n:
            self._evict(n - self._free)
            if self._free < n:
                raise RuntimeError(f"out of KV memory: {n} tokens wanted, {self._free} free")
        self._free -= n

    def check_invariants(self) -> None:
        """Token conservation and the evictable count (for tests)."""
        tree = 0
        evictable = 0
        for g in self._groups.values():
            if g.present:
                tree += g.tokens
                if not g.lock:
                    evictable += g.tokens
            assert g.lock >= 0
        for s in self._sessions.values():
            assert s.length == sum(s.segs)
            tree += s.length
            if not s.locked:
                evictable += s.length
        private = 0
        for r in [*self.running, *([self.chunked] if self.chunked is not None else [])]:
            held = self._held.get(r.rid)
            private += r.computed - (self._tree_part(held) if held is not None else 0)
        assert tree == self._tree, (tree, self._tree)
        assert evictable == self._evictable, (evictable, self._evictable)
        assert self._free >= 0 and private >= 0
        assert self._free + tree + private == self.kv_pool_tokens, (self._free, tree, private)

    # -- one step (or a jump of identical decode steps) --------------------------------------------------
    def step(self, now: float, horizon: float = math.inf) -> StepResult:
        batch = self._schedule_prefill(now)
        if batch is not None:
            return self._run_prefill(batch, now)
        return self._run_decode(now, horizon)

    def _schedule_prefill(self, now: float) -> list[tuple[Request, int]] | None:
        """``get_new_batch_prefill`` with ``PrefillAdder``: the next prefill batch, or None."""
        running = self.running
        waiting = self.waiting
        chunked = self.chunked
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
            self._sort_lpm()
            waiting = self.waiting
        ratio = self.new_token_ratio()
        reserved = 0.0
        for r in running:
            reserved += min(r.max_tokens - r.generated, CLIP_MAX_NEW_TOKENS) * ratio
        reserved_cur = 0.0
        rem_input = self.max_prefill_tokens
        rem_chunk = self.max_batched
        batch: list[tuple[Request, int]] = []
        keep_chunked: Request | None = None
        if chunked is not None:
            rem = min(rem_chunk, int(self._free + self._evictable - reserved))
            left = chunked.num_tokens - chunked.computed
            if rem > 0:
                n = min(left, rem)
                truncated = left > n
                batch.append((chunked, n))
                reserved += n + (0 if truncated else min(chunked.max_tokens, CLIP_MAX_NEW_TOKENS)) + PAGE
                reserved_cur += n + PAGE
                rem_input -= n
                rem_chunk -= n
                keep_chunked = chunked if truncated else None
            else:
                keep_chunked = chunked  # no room for a chunk this round
        new_chunked: Request | None = None
        admitted: list[tuple[Request, int]] = []
        for req in waiting:
            if len(batch) >= self.max_seqs - len(running):
                self.batch_is_full = True
                break
            hit = self._match(req)
            extend = req.num_tokens - hit
            total = extend + min(max(req.max_tokens - req.generated, 0), CLIP_MAX_NEW_TOKENS) + PAGE
            if total >= self._free + self._evictable - reserved:
                self.batch_is_full = True
                break
            self._lock(req, hit)
            if total >= self._free + self._evictable - reserved:  # locking the prefix took it off evictable
                self._unlock_req(req)
                self.batch_is_full = True
                break
            if extend <= rem_chunk:
                n = extend
                reserved += extend + min(req.max_tokens, CLIP_MAX_NEW_TOKENS) + PAGE
            else:
                n = rem_chunk
                if n <= 0:
                    self._unlock_req(req)
                    break
                new_chunked = req
                reserved += n + PAGE
            reserved_cur += n + PAGE
            rem_input -= n
            rem_chunk -= n
            batch.append((req, n))
            admitted.append((req, hit))
            avail = self._free + self._evictable
            if avail - reserved <= 0 or avail - reserved_cur <= 0:
                self.batch_is_full = True
                break
            if rem_input <= 0 or rem_chunk <= 0:
                break
        self.chunked = new_chunked if new_chunked is not None else keep_chunked
        if not batch:
            if not running and chunked is None and waiting:
                req = waiting[0]
                raise RuntimeError(
                    f"request {req.rid} ({req.num_tokens} tokens + {req.max_tokens - req.generated} to generate) "
                    f"can never fit the {self.kv_pool_tokens}-token KV pool"
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
        self._alloc(sum(n for _, n in batch))
        return batch

    def _sort_lpm(self) -> None:
        """CacheAwarePolicy lpm: match every waiting request, then a stable sort by hit, longest first; requests
        with a tiny hit that share a prefix with an earlier such request go last (in-batch prefix caching)."""
        seen: set[tuple[int, int]] = set()
        keys: list[float] = []
        for r in self.waiting:
            hit = self._match(r)
            key = float(-hit)
            if hit <= IN_BATCH_PREFIX_THRESHOLD:
                gkey = (r.seq.group, r.seq.group_blocks)
                shared = r.seq.group_blocks * self.block_size
                if shared >= IN_BATCH_PREFIX_THRESHOLD and gkey in seen:
                    key = math.inf
                elif shared:
                    seen.add(gkey)
            keys.append(key)
        order = sorted(range(len(keys)), key=keys.__getitem__)
        self.waiting = [self.waiting[i] for i in order]

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
                self._insert(req)  # a chunk: cache_unfinished_req(chunked=True)
                continue
            req.num_tokens += 1
            req.generated += 1
            if req.t_first < 0:
                req.t_first = t_end
                out.first_token.append(req)
            if req.generated >= req.max_tokens:
                req.t_end = t_end
                self._finish(req)
                out.finished.append(req)
            else:
                self._insert(req)
                self.running.append(req)
        if out.finished:
            self.batch_is_full = False
        st = self.stats
        st.steps += 1
        st.busy_s += dt
        st.prefill_tokens += tokens
        return out

    def _decode_mem_ok(self, n: int) -> bool:
        """``check_decode_mem``: evict the shortfall for ``n`` new tokens, then whether they fit."""
        if self._free < n:
            self._evict(n - self._free)
        return self._free >= n

    def _retract(self) -> None:
        """``retract_decode``: retract requests (fewest output tokens first, ties longest prompt) until the
        others can decode one more token; reset ``new_token_ratio`` from the ones kept."""
        running = self.running
        order = sorted(range(len(running)), key=lambda i: (running[i].generated, -running[i].prompt), reverse=True)
        retracted: list[Request] = []
        first = True
        while first or not self._decode_mem_ok(len(order)):
            if len(order) == 1:
                break
            first = False
            req = running[order.pop()]
            self._release(req)
            need = len(order) * RETRACT_DECODE_STEPS
            if self._free < need:
                self._evict(need - self._free)
            req.computed = 0
            req.preemptions += 1
            self.stats.preemptions += 1
            self.retractions += 1
            retracted.append(req)
        if not self._decode_mem_ok(len(order)):
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
        if self._decode_mem_ok(len(self.running)):
            self._ratio_decays += 1
        else:
            self._retract()
        running = self.running
        b = len(running)
        self._free -= b
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
                self._finish(r)
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
        if math.isfinite(span):
            a = grow_per_step / 2.0
            bb = dt1 - a
            n_time = math.ceil((-bb + math.sqrt(bb * bb + 4 * a * span)) / (2 * a)) if a > 0 else math.ceil(span / dt1)
            n_max = min(n_max, max(1, n_time))
        n = 1
        while n < n_max:
            if self._free >= b:
                t = min(n_max - n, self._free // b)
                self._free -= t * b
                n += t
            else:
                self._evict(b - self._free)  # what check_decode_mem does before that step
                if self._free < b:
                    break  # that step retracts: leave it to a single step
        self._ratio_decays += n - 1
        return n, n * dt1 + grow_per_step * n * (n - 1) / 2.0
