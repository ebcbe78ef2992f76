"""SGLang's RadixCache in kvgate's content model, and the token pool it lives in.

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

Token pool: ``free + tree + private == kv_pool``, where ``private`` is the computed KV of admitted
requests not (yet) in the tree; ``evictable`` is the unlocked part of ``tree``. The scheduler
(:mod:`kvgate.engine.sglang`) reads ``free`` and ``evictable`` and changes them only through ``alloc``,
``make_room``, ``evict`` and the request methods (``match``, ``lock``, ``insert``, ``finish``, ``release``).
"""

from __future__ import annotations

import heapq

from kvgate.engine.base import Request
from kvgate.engine.blocks import SeqKey


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


class RadixCache:
    """The radix tree of one engine (page size 1) over a pool of ``kv_pool`` tokens."""

    def __init__(self, kv_pool: int, *, caching: bool = True) -> None:
        self.kv_pool = kv_pool
        self.block_size = 1
        self.caching = caching
        self.free = kv_pool
        """Tokens no one holds (read it; allocation and eviction change it)."""
        self.tree = 0
        """Tokens in the tree."""
        self.evictable = 0
        """Tokens in the tree that no running request locks."""
        self.evicted_tokens = 0
        self._groups: dict[tuple[int, int], _Group] = {}
        self._sessions: dict[int, _Sess] = {}
        self._held: dict[int, _Held] = {}
        self._tick = 0
        self._heap: list[tuple[int, int, _Group | _Sess]] = []
        self._heap_seq = 0

    def cached_tokens(self, seq: SeqKey) -> int:
        """Tokens of ``seq`` in the tree: its group prefix (if present) and its session's chain. Pure."""
        if not self.caching:
            return 0
        g = self._groups.get((seq.group, seq.group_blocks)) if seq.group_blocks else None
        if g is not None and not g.present:
            return 0
        s = self._sessions.get(seq.session)
        return (g.tokens if g is not None else 0) + (s.length if s is not None else 0)

    def clear(self) -> None:
        """Drop the whole tree (``flush_cache``); the caller makes sure no request holds a path."""
        self.free += self.tree
        self.tree = 0
        self.evictable = 0
        for g in self._groups.values():
            g.present = False
            g.chains = 0
        for s in self._sessions.values():
            s.segs.clear()
            s.length = 0
        self._heap.clear()

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

    def match(self, req: Request) -> int:
        if not self.caching:
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
        self.free += drop
        self.tree -= drop
        self.evictable -= drop
        self.evicted_tokens += drop
        if not sess.length and sess.group is not None:
            sess.group.chains -= 1
            self._push(sess.group)

    def lock(self, req: Request, hit: int) -> None:
        """Lock the prefix ``hit`` matched (``inc_lock_ref``); the session is held even on a miss."""
        if not self.caching:
            return
        grp, sess = self._objs(req.seq)
        if sess.locked:
            raise ValueError(f"session {req.seq.session} already has a request holding its cached prefix")
        has_group = grp is not None and hit > 0
        if has_group:
            assert grp is not None
            if grp.lock == 0:
                self.evictable -= grp.tokens
            grp.lock += 1
        sess.locked = True
        self.evictable -= sess.length
        self._held[req.rid] = _Held(sess, has_group)

    def _unlock(self, held: _Held) -> None:
        sess = held.sess
        sess.locked = False
        self.evictable += sess.length
        self._push(sess)
        if held.has_group:
            grp = sess.group
            assert grp is not None
            grp.lock -= 1
            if grp.lock == 0:
                self.evictable += grp.tokens
                self._push(grp)

    def unlock_req(self, req: Request) -> None:
        """Undo :meth:`_lock` for a request that was not added after all."""
        held = self._held.pop(req.rid, None)
        if held is not None:
            self._unlock(held)

    def _tree_part(self, held: _Held) -> int:
        g = held.sess.group
        return (g.tokens if held.has_group and g is not None else 0) + held.sess.length

    def insert(self, req: Request) -> None:
        """Insert the request's computed tokens into the tree (``cache_unfinished_req`` / ``cache_finished_req``);
        they stay locked by the request."""
        if not self.caching:
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
                self.free += grp.tokens
                if grp.lock == 0:
                    self.evictable -= grp.tokens
            else:
                grp.present = True
                self.tree += grp.tokens
            grp.lock += 1
            held.has_group = True
        new = upto - self._tree_part(held)
        if new > 0:
            if not sess.length and grp is not None:
                grp.chains += 1
            sess.segs.append(new)
            sess.length += new
            self.tree += new
        self._touch(grp, sess)

    def release(self, req: Request) -> None:
        """Free a request's KV that is not in the tree and unlock its path (retraction, abort)."""
        held = self._held.pop(req.rid, None)
        if held is None:
            self.free += req.computed
            return
        self.free += req.computed - self._tree_part(held)
        self._unlock(held)

    def finish(self, req: Request) -> None:
        """``cache_finished_req``: the committed KV (prompt + output - 1 tokens) goes into the tree, unlocked."""
        held = self._held.get(req.rid)
        if held is None:
            self.free += req.computed
            return
        self.insert(req)
        del self._held[req.rid]
        self._unlock(held)

    def evict(self, need: int) -> int:
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
        self.free += evicted
        self.tree -= evicted
        self.evictable -= evicted
        self.evicted_tokens += evicted
        return evicted

    def make_room(self, n: int) -> bool:
        """``check_decode_mem``: evict the shortfall for ``n`` new tokens, then whether they fit."""
        if self.free < n:
            self.evict(n - self.free)
        return self.free >= n

    def alloc(self, n: int) -> None:
        if self.free < n:
            self.evict(n - self.free)
            if self.free < n:
                raise RuntimeError(f"out of KV memory: {n} tokens wanted, {self.free} free")
        self.free -= n

    def check(self, holding: list[Request]) -> None:
        """Token conservation and the evictable count, with ``holding`` the requests that hold KV (for tests)."""
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
        for r in holding:
            held = self._held.get(r.rid)
            private += r.computed - (self._tree_part(held) if held is not None else 0)
        assert tree == self.tree, (tree, self.tree)
        assert evictable == self.evictable, (evictable, self.evictable)
        assert self.free >= 0 and private >= 0
        assert self.free + tree + private == self.kv_pool, (self.free, tree, private)
