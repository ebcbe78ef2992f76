"""SGLang's radix cache (page size 1) in kvgate's content model, and the token pool it lives in.

Held to SGLang 0.5.23's own ``UnifiedRadixCache`` (both of its tree cores, Rust and Python) operation for operation
by ``tests/engine/test_sglang_tree_oracle.py``: the same hits, free, evictable and protected tokens and the same
eviction order after every call. What was read: ``mem_cache/unified_radix_cache.py`` (``checkpoint_into_tree``),
``mem_cache/unified_cache/unified_tree_core.py`` (match, insert, split, eviction),
``unified_cache/components/full.py`` (the eviction heap, locks), ``mem_cache/common.py`` (``match_kv_cache``,
``checkpoint_kv_cache``, ``release_kv_cache``) and ``managers/schedule_batch.py``.

Content. A request's token at position ``p`` is named by its :class:`SeqKey`: the group's shared prefix for
``p < group_blocks`` (one group per ``(group, group_blocks)``), then the session's own append-only tokens. So a
node is a range ``[start, end)`` of positions with an owner: a *group node* lies inside its group's prefix
(``end <= G``); any other node belongs to one session (it may begin inside the group prefix: the first
session's prompt is one node until a second session of the group splits it). Two contents compare in O(1)::

    root -- [0, 1200) group g -+- [1200, 2000) g -+- [2000, 6000) session 7 -- [6000, 6299) 7 -- ...
                               |                  +- [2000, 6000) session 9
                               +- [1200, 1500) session 4          (split where session 4's prompt ended early)

The tree, exactly as SGLang's:

* ``match`` walks from the root while a child's first token equals the request's and takes the common length,
  capped at ``num_tokens - 1`` (SGLang's ``max_prefix_len``); a walk that ends inside a node *splits* it. Stamps:
  a split makes the new prefix node (stamped at its creation) and restamps the split-off tail; then the matched
  node gets a new time ``t`` and each ancestor ``t - 1e-5`` per level (so parents sort just before children).
* ``insert`` (``checkpoint_into_tree``: after every prefill chunk, and at finish with prompt + output - 1 tokens)
  stamps the root and every node it walks, splitting where the key ends inside a node, and hangs the rest as a
  new leaf. The request's own KV of tokens the tree already held beyond its locked prefix is freed (duplicates).
  When the inserted key is longer than the prompt, a second walk over the prompt splits the leaf at the prompt
  boundary (SGLang does it so the output can be evicted before the prompt). The request's lock moves to the
  node the insert ended on.
* A lock (``inc_lock_ref``) counts on every node of the path; locked tokens are protected, the rest evictable.
* ``evict(n)`` pops unlocked leaves, oldest stamp first, and deletes them whole; a parent that becomes an
  unlocked leaf joins the heap; it stops once ``n`` tokens are gone. Allocation evicts the shortfall only.

One clock for every stamp (a counter, as SGLang's ``get_and_increase_time_counter``), so runs are deterministic.

Token pool: ``free + tree + private == kv_pool``, where ``private`` is the computed KV of admitted requests not
(yet) in the tree; ``evictable`` is the unlocked part of ``tree``. The scheduler (:mod:`kvgate.engine.sglang`)
reads ``free`` and ``evictable`` and changes them only through ``alloc``, ``make_room``, ``evict`` and the
request methods (``match``, ``lock``, ``unlock_req``, ``insert``, ``finish``, ``release``).
"""

from __future__ import annotations

import heapq

from kvgate.engine.base import Request
from kvgate.engine.blocks import SeqKey

_ANCESTOR_STEP = 1e-5
"""How much older each ancestor of a matched node is stamped (SGLang's ``cur_time -= 0.00001``)."""


class _Node:
    """A node of positions ``[start, end)``: a group node (``sid`` None) or a node of session ``sid``."""

    __slots__ = ("start", "end", "gkey", "gend", "sid", "parent", "children", "lock", "stamp", "born")

    def __init__(
        self, start: int, end: int, gkey: tuple[int, int], gend: int, sid: int | None, parent: _Node | None
    ) -> None:
        self.start = start
        self.end = end
        self.gkey = gkey
        self.gend = gend  # the group prefix's end: tokens before it are the group's
        self.sid = sid if end > gend else None  # a node inside the group prefix belongs to the group
        self.parent = parent
        self.children: dict[tuple[int, object], _Node] = {}
        self.lock = 0
        self.stamp = 0.0
        self.born = 0.0

    @property
    def size(self) -> int:
        return self.end - self.start

    def key_at(self, pos: int) -> tuple[int, object]:
        """The content key of position ``pos`` of this node's path."""
        return (0, self.gkey) if pos < self.gend else (1, self.sid)


def _key(seq: SeqKey, pos: int) -> tuple[int, object]:
    return (0, (seq.group, seq.group_blocks)) if pos < seq.group_blocks else (1, seq.session)


def _common(node: _Node, seq: SeqKey, pos: int, limit: int) -> int:
    """Tokens of ``node`` (starting at ``pos``, its first one known equal) that ``seq`` shares, at most
    ``limit - pos``."""
    # another session's node: only its group part is shared
    end = node.end if node.sid is None or node.sid == seq.session else node.gend
    return min(end, limit) - pos


def _log_content(log: list[tuple[int, object, int, int]], node: _Node) -> None:
    if node.sid is not None and node.start < node.gend:  # a session's node that begins in the group prefix
        log.append((0, node.gkey, node.start, node.gend))
        log.append((1, node.sid, node.gend, node.end))
    elif node.sid is None:
        log.append((0, node.gkey, node.start, node.end))
    else:
        log.append((1, node.sid, node.start, node.end))


class _Held:
    """A request's hold on the tree: the node its lock is on, and how many of its tokens the tree owns."""

    __slots__ = ("node", "protected")

    def __init__(self, node: _Node, protected: int) -> None:
        self.node = node
        self.protected = protected


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
        self.eviction_log: list[tuple[int, object, int, int]] | None = None
        """When a list: the content of every evicted node, in order, as runs ``(0, (group, group_blocks), start,
        end)`` of a group prefix and ``(1, session, start, end)`` of a session's tokens."""
        self._clock = 0.0
        self._root = _Node(0, 0, (-1, 0), 0, None, None)
        self._leaves: set[_Node] = set()  # unlocked leaves: the eviction candidates
        self._matched: dict[int, _Node] = {}  # rid -> node of its last match, until it locks
        self._held: dict[int, _Held] = {}

    # -- the clock and the leaf set -------------------------------------------------------------------------
    def _tick(self) -> float:
        t = self._clock
        self._clock = t + 1.0
        return t

    def _new_node(self, start: int, end: int, like: _Node | SeqKey, parent: _Node) -> _Node:
        if isinstance(like, _Node):
            node = _Node(start, end, like.gkey, like.gend, like.sid, parent)
        else:
            node = _Node(start, end, (like.group, like.group_blocks), like.group_blocks, like.session, parent)
        node.stamp = self._tick()
        node.born = self._tick()  # SGLang's creation_time: here only a tie-break of equal stamps
        return node

    def _refresh_leaf(self, node: _Node) -> None:
        if node is not self._root and not node.lock and not node.children:
            self._leaves.add(node)
        else:
            self._leaves.discard(node)

    # -- reading --------------------------------------------------------------------------------------------
    def cached_tokens(self, seq: SeqKey) -> int:
        """Tokens of ``seq``'s stream that the tree holds, as a prefix. Pure (no stamps, no splits)."""
        if not self.caching:
            return 0
        node = self._root
        pos = 0
        while True:
            child = node.children.get(_key(seq, pos))
            if child is None:
                return pos
            m = _common(child, seq, pos, 1 << 62)
            pos += m
            if m < child.size:
                return pos
            node = child

    # -- structure ------------------------------------------------------------------------------------------
    def _split(self, child: _Node, at: int) -> _Node:
        """Split ``child`` before position ``at``; returns the new node holding ``[child.start, at)``."""
        parent = child.parent
        assert parent is not None
        new = self._new_node(child.start, at, child, parent)
        new.lock = child.lock
        parent.children[child.key_at(child.start)] = new
        new.children[child.key_at(at)] = child
        child.parent = new
        child.start = at
        child.stamp = self._tick()  # the split-off tail is restamped
        self._refresh_leaf(new)
        return new

    def _stamp_path(self, node: _Node) -> None:
        t = self._tick()
        n: _Node | None = node
        while n is not None:
            n.stamp = t
            t -= _ANCESTOR_STEP
            n = n.parent

    def _lock(self, node: _Node) -> None:
        n: _Node | None = node
        while n is not None and n is not self._root:
            if not n.lock:
                self.evictable -= n.size
                self._leaves.discard(n)
            n.lock += 1
            n = n.parent

    def _unlock(self, node: _Node) -> None:
        n: _Node | None = node
        while n is not None and n is not self._root:
            n.lock -= 1
            if not n.lock:
                self.evictable += n.size
                self._refresh_leaf(n)
            n = n.parent

    # -- the request methods --------------------------------------------------------------------------------
    def match(self, req: Request) -> int:
        """``match_prefix`` of the request's tokens capped at ``num_tokens - 1``: the hit. Splits and stamps."""
        if not self.caching:
            return 0
        seq = req.seq
        limit = req.num_tokens - 1
        node = self._root
        pos = 0
        if limit <= 0:
            self._matched[req.rid] = node
            return 0
        while pos < limit:
            child = node.children.get(_key(seq, pos))
            if child is None:
                break
            m = _common(child, seq, pos, limit)
            if m < child.size:
                node = self._split(child, pos + m)
                pos += m
                break
            node = child
            pos += m
        self._stamp_path(node)
        self._matched[req.rid] = node
        return pos

    def lock(self, req: Request, hit: int) -> None:
        """Lock the node the request's last :meth:`match` ended on (``inc_lock_ref``); its ``hit`` tokens are the
        tree's, not its own."""
        if not self.caching:
            return
        node = self._matched.pop(req.rid, self._root)
        self._lock(node)
        self._held[req.rid] = _Held(node, hit)

    def unlock_req(self, req: Request) -> None:
        """Undo :meth:`lock` for a request that was not added after all."""
        held = self._held.pop(req.rid, None)
        if held is not None:
            self._unlock(held.node)

    def _walk_insert(self, seq: SeqKey, upto: int) -> tuple[_Node, int]:
        """The walk of an insert of ``seq``'s first ``upto`` tokens: stamps and splits; returns the last node
        reached and the tokens the tree already had."""
        self._root.stamp = self._tick()
        node = self._root
        pos = 0
        while pos < upto:
            child = node.children.get(_key(seq, pos))
            if child is None:
                break
            child.stamp = self._tick()
            m = _common(child, seq, pos, upto)
            if m < child.size:
                child = self._split(child, pos + m)
            node = child
            pos += m
        return node, pos

    def insert(self, req: Request) -> None:
        """``checkpoint_into_tree``: the request's first ``computed`` tokens go into the tree and its lock moves
        to where they end; they stay locked by the request."""
        self._insert(req)

    def _insert(self, req: Request) -> None:
        if not self.caching:
            return
        held = self._held[req.rid]
        upto = req.computed
        if upto <= 0:
            return
        seq = req.seq
        node, have = self._walk_insert(seq, upto)
        if have > held.protected:
            self.free += have - held.protected  # the request's copies of tokens the tree had
        if have < upto:
            leaf = self._new_node(have, upto, seq, node)
            node.children[_key(seq, have)] = leaf
            self.tree += upto - have
            self.evictable += upto - have
            self._refresh_leaf(node)
            self._refresh_leaf(leaf)
            node = leaf
        if 0 < req.prompt < upto:
            self._walk_insert(seq, req.prompt)  # split at the prompt's end: output evictable before prompt
        self._unlock(held.node)
        self._lock(node)
        held.node = node
        held.protected = upto

    def release(self, req: Request) -> None:
        """Free a request's KV that is not in the tree and unlock its path (retraction, abort)."""
        self._release(req)

    def _release(self, req: Request) -> None:
        self._matched.pop(req.rid, None)
        held = self._held.pop(req.rid, None)
        if held is None:
            self.free += req.computed
            return
        self.free += req.computed - held.protected
        self._unlock(held.node)

    def finish(self, req: Request) -> None:
        """``release_kv_cache(checkpoint=True)``: the committed KV (prompt + output - 1 tokens) goes into the
        tree, unlocked."""
        if req.rid in self._held:
            self._insert(req)
        self._release(req)

    # -- eviction and allocation ----------------------------------------------------------------------------
    def evict(self, need: int) -> int:
        """Delete unlocked leaves, least recently stamped first, until ``need`` tokens are evicted."""
        if need <= 0 or not self._leaves:
            return 0
        heap = [(n.stamp, n.born, n) for n in self._leaves]
        heapq.heapify(heap)
        evicted = 0
        log = self.eviction_log
        while evicted < need and heap:
            _, _, node = heapq.heappop(heap)
            if node not in self._leaves:
                continue
            self._leaves.discard(node)
            parent = node.parent
            assert parent is not None
            del parent.children[node.key_at(node.start)]
            evicted += node.size
            if log is not None:
                _log_content(log, node)
            self._refresh_leaf(parent)
            if parent in self._leaves:
                heapq.heappush(heap, (parent.stamp, parent.born, parent))
        self.free += evicted
        self.tree -= evicted
        self.evictable -= evicted
        self.evicted_tokens += evicted
        return evicted

    def make_room(self, n: int) -> bool:
        """``check_decode_capacity``: evict the shortfall for ``n`` new tokens, then whether they fit."""
        if self.free < n:
            self.evict(n - self.free)
        return self.free >= n

    def alloc(self, n: int) -> None:
        if self.free < n:
            self.evict(n - self.free)
            if self.free < n:
                raise RuntimeError(f"out of KV memory: {n} tokens wanted, {self.free} free")
        self.free -= n

    def clear(self) -> None:
        """Drop the whole tree (``flush_cache``); the caller makes sure no request holds a path."""
        self.free += self.tree
        self.tree = 0
        self.evictable = 0
        self._root.children.clear()
        self._leaves.clear()
        self._matched.clear()

    def check(self, holding: list[Request]) -> None:
        """Token conservation, the evictable count and the leaf set, with ``holding`` the requests that hold KV
        (for tests)."""
        _check(self, holding)


def _check(cache: RadixCache, holding: list[Request]) -> None:
    tree = evictable = 0
    stack = list(cache._root.children.values())
    while stack:
        n = stack.pop()
        assert n.lock >= 0 and n.start < n.end
        tree += n.size
        if not n.lock:
            evictable += n.size
        assert (n in cache._leaves) == (not n.lock and not n.children)
        for c in n.children.values():
            assert c.parent is n and c.start == n.end
            stack.append(c)
    private = 0
    for r in holding:
        held = cache._held.get(r.rid)
        private += r.computed - (held.protected if held is not None else 0)
    assert tree == cache.tree, (tree, cache.tree)
    assert evictable == cache.evictable, (evictable, cache.evictable)
    assert cache.free >= 0 and private >= 0
    assert cache.free + tree + private == cache.kv_pool, (cache.free, tree, private)
