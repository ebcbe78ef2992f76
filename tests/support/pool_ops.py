"""Random pool operation sequences and a driver that applies them to several pools at once."""

from __future__ import annotations

from dataclasses import dataclass

from hypothesis import note
from hypothesis import strategies as st

from kvgate.engine.blocks import SeqKey
from kvgate.engine.cache import RunKVPool
from support.reference_cache import BlockKVPool

FastPool = RunKVPool

NOP, ADMIT, PREFILL, DECODE, FREE, LOOKUP, RESET = range(7)
# Op-code weights: mostly admissions and growth, some frees, a few lookups and rare resets. NOP comes first
# so that shrinking turns the ops a failure does not need into no-ops.
OP_CODES = [NOP] + [ADMIT] * 12 + [PREFILL] * 8 + [DECODE] * 8 + [FREE] * 8 + [LOOKUP] * 2 + [RESET]
# under group contention: requests come and go quickly, and resets make the group prefix miss again
CONTENDED_OP_CODES = [NOP] + [ADMIT] * 12 + [PREFILL] * 12 + [DECODE] * 2 + [FREE] * 14 + [RESET] * 3
# recompute: requests preempted (freed) in the middle of their prefill and back, no resets
RECOMPUTE_OP_CODES = [NOP] + [ADMIT] * 12 + [PREFILL] * 10 + [DECODE] * 3 + [FREE] * 10


def op_lists(codes: list[int]) -> st.SearchStrategy[list[tuple[int, int, int, int]]]:
    """Operations as ``(op-code, x, y, z)``, each drawn as one 32-bit integer (cheap to generate, and it
    shrinks towards ``codes[0]``, a no-op)."""

    def unpack(v: int) -> tuple[int, int, int, int]:
        return codes[(v & 255) % len(codes)], (v >> 8) & 255, (v >> 16) & 255, v >> 24

    return st.lists(st.integers(0, 2**32 - 1).map(unpack), min_size=20, max_size=150)


@dataclass
class Scenario:
    num_blocks: int
    block_size: int
    enable_caching: bool
    group_blocks: list[int]
    session_groups: list[int]
    max_chunk: int | None
    """Largest prefill chunk (a small token budget), or None for any chunk up to the whole prompt."""
    ops: list[tuple[int, int, int, int]]
    span: int = 40
    """Most new tokens of a turn."""


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    """Any mix: 1-2 groups, 1-5 sessions, block size 4 (sometimes 16), 6-60 blocks (often few)."""
    block_size = draw(st.sampled_from([4, 4, 4, 16]))
    num_blocks = draw(st.one_of(st.integers(6, 20), st.integers(6, 60)))  # often under pressure
    enable_caching = draw(st.sampled_from([True] * 7 + [False]))
    group_blocks = draw(st.lists(st.integers(0, 4), min_size=1, max_size=2))
    n_sessions = draw(st.integers(1, 5))
    session_groups = draw(st.lists(st.integers(0, len(group_blocks) - 1), min_size=n_sessions, max_size=n_sessions))
    max_chunk = draw(st.sampled_from([None, None, 2, 5, 12]))
    return Scenario(
        num_blocks,
        block_size,
        enable_caching,
        group_blocks,
        session_groups,
        max_chunk,
        draw(op_lists(OP_CODES)),
    )


@st.composite
def contended_scenarios(draw: st.DrawFn) -> Scenario:
    """Several sessions of one group prefilling in small chunks, so that requests miss the same group block at
    once and compute duplicate copies of it (vLLM's multi-copy index: which copy a hit touches matters)."""
    num_blocks = draw(st.integers(8, 40))
    group_blocks = [draw(st.integers(1, 4))]
    n_sessions = draw(st.integers(2, 5))
    max_chunk = draw(st.sampled_from([1, 2, 3, 5, 8]))
    return Scenario(num_blocks, 4, True, group_blocks, [0] * n_sessions, max_chunk, draw(op_lists(CONTENDED_OP_CODES)))


@st.composite
def recompute_scenarios(draw: st.DrawFn) -> Scenario:
    """Tight pools, group prefixes evicted under other sessions' pressure, requests preempted mid-prefill and
    recomputed: a session's blocks get several cached copies (vLLM keeps them all; a hit touches the oldest)."""
    block_size = draw(st.sampled_from([2, 4]))
    num_blocks = draw(st.integers(8, 30))
    group_blocks = draw(st.lists(st.integers(1, 3), min_size=1, max_size=2))
    n_sessions = draw(st.integers(2, 5))
    session_groups = draw(st.lists(st.integers(0, len(group_blocks) - 1), min_size=n_sessions, max_size=n_sessions))
    max_chunk = draw(st.sampled_from([1, 2, 3, 5]))
    ops = draw(op_lists(RECOMPUTE_OP_CODES))
    return Scenario(num_blocks, block_size, True, group_blocks, session_groups, max_chunk, ops, span=12)


@st.composite
def block_size_scenarios(draw: st.DrawFn, block_size: int) -> Scenario:
    """A real block size (16: vLLM on GPUs, 128: vLLM's CPU build): turns of up to 3 blocks, prefill chunks of
    half a block to 3 blocks."""
    num_blocks = draw(st.integers(6, 40))
    group_blocks = draw(st.lists(st.integers(0, 3), min_size=1, max_size=2))
    n_sessions = draw(st.integers(1, 5))
    session_groups = draw(st.lists(st.integers(0, len(group_blocks) - 1), min_size=n_sessions, max_size=n_sessions))
    max_chunk = draw(st.sampled_from([None, block_size // 2, block_size, 3 * block_size]))
    ops = draw(op_lists(OP_CODES))
    return Scenario(num_blocks, block_size, True, group_blocks, session_groups, max_chunk, ops, span=3 * block_size)


@dataclass
class Session:
    seq: SeqKey
    tokens: int = 0
    """num_tokens of the session's latest request (0: none yet); grows by one per decoded token."""
    computed: int = 0
    """Tokens the latest request had computed (its allocation) when it was freed."""
    rid: int | None = None
    """The running request, if any."""
    upto: int = 0
    """Tokens the running request's allocation covers."""

    def next_min(self, block_size: int) -> int:
        """Fewest tokens the session's next new request may have."""
        return max(self.computed + 1, self.seq.group_blocks * block_size + 1)


class EvictionLog:
    """A pool observer keeping every evicted block's content key, as the reference logs them."""

    def __init__(self, group_blocks: dict[int, int]) -> None:
        self.group_blocks = group_blocks
        self.log: list[tuple[str, int, int]] = []

    def stored(self, seq: SeqKey, first: int, last: int) -> None:
        pass

    def evicted(self, sid: int, lo: int, hi: int) -> None:
        gb = self.group_blocks.get(sid, 0)
        self.log.extend(("s", sid, gb + j) for j in reversed(range(lo, hi)))

    def evicted_group(self, key: tuple[int, int], idx: int) -> None:
        self.log.append(("g", key[0], idx))

    def forgot(self, sid: int, rel: int, orphan: int | None) -> None:
        pass

    def cleared(self) -> None:
        pass


class Driver:
    """Runs one scenario on the reference and the other pools (the fast one by default), comparing after every
    call."""

    def __init__(self, sc: Scenario, others: tuple[type, ...] = (FastPool,)) -> None:
        self.bs = sc.block_size
        self.span = sc.span  # new tokens of a turn (40: up to 10 blocks of 4, 2.5 blocks of 16)
        self.max_chunk = sc.max_chunk
        self.ref = BlockKVPool(sc.num_blocks, block_size=sc.block_size, enable_caching=sc.enable_caching)
        self.others = [cls(sc.num_blocks, block_size=sc.block_size, enable_caching=sc.enable_caching) for cls in others]
        self.sessions = [
            Session(SeqKey(group=g, group_blocks=sc.group_blocks[g], session=i))
            for i, g in enumerate(sc.session_groups)
        ]
        self.next_rid = 0
        self.freed_rids: list[int] = []
        # the fast pool's eviction hook must report every evicted session block, in eviction order
        self.hooked: list[tuple[RunKVPool, list[tuple[str, int, int]]]] = []
        group_blocks = {s.seq.session: s.seq.group_blocks for s in self.sessions}
        for pool in self.others:
            if type(pool) is RunKVPool:
                log: list[tuple[str, int, int]] = []
                pool.on_evict = lambda sid, lo, hi, log=log: log.extend(
                    ("s", sid, group_blocks[sid] + j) for j in reversed(range(lo, hi))
                )
                self.hooked.append((pool, log))
        # ... and its observer every evicted block, group blocks too, in the reference's eviction order
        self.observed: list[tuple[RunKVPool, EvictionLog]] = []
        for pool in self.others:
            if type(pool) is RunKVPool:
                obs = EvictionLog(group_blocks)
                pool.observe(obs)
                self.observed.append((pool, obs))
        for pool in self.others:
            note(
                f"pool = {type(pool).__name__}({sc.num_blocks}, block_size={sc.block_size}, "
                f"enable_caching={sc.enable_caching})"
            )

    def call(self, name: str, *args: object) -> object:
        want = getattr(self.ref, name)(*args)
        note(f"pool.{name}({', '.join(map(repr, args))})  # reference: {want!r}")
        for pool in self.others:
            got = getattr(pool, name)(*args)
            assert got == want, f"{name}{args!r}: reference {want!r}, {type(pool).__name__} {got!r}"
        return want

    def check(self) -> None:
        ref, bs = self.ref, self.bs
        ref.check()
        for pool in self.others:
            name = type(pool).__name__
            assert pool.num_free_blocks() == ref.num_free_blocks(), (
                f"num_free_blocks(): reference {ref.num_free_blocks()}, {name} {pool.num_free_blocks()}"
            )
            assert pool.evictions == ref.evictions, f"evictions: reference {ref.evictions}, {name} {pool.evictions}"
            log = getattr(pool, "eviction_log", None)
            if log is not None:
                assert log == ref.eviction_log, f"eviction order: reference {ref.eviction_log}, {name} {log}"
        for _, hooked in self.hooked:
            want_s = [k for k in ref.eviction_log if k[0] == "s"]
            assert hooked == want_s, f"on_evict: reference evicted {want_s}, the hook heard {hooked}"
        for _, obs in self.observed:
            assert obs.log == ref.eviction_log, f"eviction order: reference {ref.eviction_log}, observer {obs.log}"
        for s in self.sessions:
            if s.rid is not None:
                for pool in [ref, *self.others]:
                    assert pool.holds(s.rid), f"request {s.rid} should hold blocks"
            # lookups of the session's plausible next requests: the smallest, a long one, and a recompute
            sizes = {s.next_min(bs), s.next_min(bs) + 4 * self.span}
            if s.tokens:
                sizes.add(s.tokens)
            for n in sorted(sizes):
                want = ref.lookup(s.seq, n)
                for pool in self.others:
                    got = pool.lookup(s.seq, n)
                    assert got == want, f"lookup({s.seq!r}, {n}): reference {want}, {type(pool).__name__} {got}"
        for rid in self.freed_rids[-5:]:
            for pool in [ref, *self.others]:
                assert not pool.holds(rid), f"request {rid} was freed"

    def step(self, op: int, x: int, y: int, z: int) -> None:
        bs = self.bs
        idle = [s for s in self.sessions if s.rid is None]
        running = [s for s in self.sessions if s.rid is not None]
        if op == ADMIT and idle:
            s = idle[x % len(idle)]
            recompute = s.tokens > 0 and z % 4 == 0  # a preempted request back (or the same prompt again)
            num_tokens = s.tokens if recompute else s.next_min(bs) + y % self.span
            hit = self.call("lookup", s.seq, num_tokens)
            upto = hit + self.chunk(z // 4, num_tokens - hit)
            fit = num_tokens if y >= 128 else 0  # scheduler_reserve_full_isl on or off
            rid = self.next_rid
            self.next_rid += 1
            if self.call("admit", rid, s.seq, num_tokens, hit, upto, fit):
                s.rid, s.tokens, s.upto = rid, num_tokens, upto
        elif op == PREFILL and running:
            s = running[x % len(running)]
            if s.upto < s.tokens:
                upto = s.upto + self.chunk(y, s.tokens - s.upto)
                if self.call("grow", s.rid, upto):
                    s.upto = upto
            else:
                self.decode(s, 1)
        elif op == DECODE and running:
            s = running[x % len(running)]
            if s.upto == s.tokens:
                self.decode(s, 1 + y % 8, jump=bool(z % 2))
        elif op == FREE and running:
            s = running[x % len(running)]
            self.call("free", s.rid)
            assert s.rid is not None
            self.freed_rids.append(s.rid)
            s.rid, s.computed = None, s.upto
        elif op == LOOKUP and idle:
            s = idle[x % len(idle)]
            self.call("lookup", s.seq, s.next_min(bs) + y % (4 * self.span))
        elif op == RESET:
            self.call("reset")
        else:
            return
        self.check()

    def chunk(self, v: int, left: int) -> int:
        """A prefill chunk of 1 to ``left`` tokens: with a budget ``max_chunk``, ``min(left, 1..max_chunk)``;
        without, the whole rest half of the time."""
        if self.max_chunk is not None:
            return min(left, 1 + v % self.max_chunk)
        return left if v % 2 else 1 + (v // 2) % left

    def decode(self, s: Session, steps: int, jump: bool = False) -> None:
        """Decode ``steps`` tokens: one ``grow`` per token, or one for all of them (the engine's jump over
        identical decode steps)."""
        for n in [steps] if jump else [1] * steps:
            s.tokens += n  # the sampled tokens join the request, then need slots
            if not self.call("grow", s.rid, s.tokens):
                return  # the engine would preempt; the request keeps its tokens
            s.upto = s.tokens
            self.check()


def run(sc: Scenario, others: tuple[type, ...] = (FastPool,)) -> None:
    d = Driver(sc, others)
    d.check()
    for op in sc.ops:
        d.step(*op)
