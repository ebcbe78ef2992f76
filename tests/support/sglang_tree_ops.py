"""Random operation sequences on a radix cache, the calls SGLang's scheduler makes (for the tree oracle).

:func:`run_ops` reads a list of random integers as a sequence of scheduler actions on a few sessions and
plays them on a :class:`kvgate.engine.radix.RadixCache` (in the oracle tests a :class:`TeeRadix`, which repeats
each call on SGLang's tree and compares). The actions keep to what a scheduler may do — a request is matched
before it is locked, allocates before it computes, one request per session at a time — and otherwise go
anywhere: matches of waiting requests that are never admitted, refused admissions (lock then unlock), chunked
prefill, decode steps, finishes, aborts at any point (also mid-prefill), retraction (release, evict for the
others, re-prefill of prompt + output later), flushes when idle, and next turns that extend the session's
history, repeat a prompt (a retry) or go back to a shorter one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvgate.engine.base import Request
from kvgate.engine.blocks import SeqKey
from kvgate.engine.radix import RadixCache

RETRACT_DECODE_STEPS = 20


@dataclass
class OpsConfig:
    kv_pool: int
    sessions: int
    groups: int
    group_tokens: int


@dataclass
class _Sess:
    seq: SeqKey
    history: int = 0  # tokens of the session's conversation so far (prompt + output of its last turn)
    req: Request | None = None
    stage: str = "idle"  # idle | waiting | prefill | running
    prompts: list[int] = field(default_factory=list)


class _Driver:
    def __init__(self, cache: RadixCache, cfg: OpsConfig, draws: list[int]) -> None:
        self.cache = cache
        self.cfg = cfg
        self.draws = draws
        self.i = 0
        self.rid = 0
        self.sessions = [
            _Sess(SeqKey(s % cfg.groups if cfg.groups else 0, cfg.group_tokens if cfg.groups else 0, 100 + s))
            for s in range(cfg.sessions)
        ]

    def draw(self, n: int) -> int:
        """The next random integer in ``[0, n)`` (0 once the draws are used up)."""
        if self.i >= len(self.draws):
            return 0
        v = self.draws[self.i] % n
        self.i += 1
        return v

    def holding(self) -> list[Request]:
        return [s.req for s in self.sessions if s.req is not None and s.stage in ("prefill", "running")]

    def new_turn(self, s: _Sess) -> None:
        kind = self.draw(6)
        if kind == 0 and s.prompts:  # a retry of the last prompt
            prompt = s.prompts[-1]
        elif kind == 1 and s.prompts:  # an earlier, shorter prompt
            prompt = s.prompts[self.draw(len(s.prompts))]
        else:
            prompt = s.history + 1 + self.draw(max(2, self.cfg.kv_pool // 6))
        prompt = max(2, min(prompt, self.cfg.kv_pool // 2))
        out = 1 + self.draw(max(1, self.cfg.kv_pool // 10))
        self.rid += 1
        s.req = Request(self.rid, s.seq, prompt, out, 0.0, None)
        s.prompts.append(prompt)
        s.stage = "waiting"

    def admit(self, s: _Sess) -> None:
        req = s.req
        assert req is not None
        hit = self.cache.match(req)
        self.cache.lock(req, hit)
        if self.draw(5) == 0:  # refused after all (PrefillAdder's second memory check)
            self.cache.unlock_req(req)
            return
        req.computed = hit
        s.stage = "prefill"
        self.chunk(s)

    def chunk(self, s: _Sess) -> None:
        req = s.req
        assert req is not None
        left = req.num_tokens - req.computed
        n = left if self.draw(3) else 1 + self.draw(left)
        try:
            self.cache.alloc(n)
        except RuntimeError:  # out of memory: the scheduler would not have admitted it; give its KV back
            self.end(s, finish=False)
            return
        req.computed += n
        if req.computed == req.num_tokens:  # the prompt is done: one token sampled
            req.num_tokens += 1
            req.generated += 1
            if req.generated >= req.max_tokens:
                self.end(s, finish=True)
                return
            s.stage = "running"
        self.cache.insert(req)

    def decode(self) -> None:
        running = [s for s in self.sessions if s.stage == "running"]
        if not running:
            return
        if not self.cache.make_room(len(running)):
            self.retract(running)
            return
        self.cache.alloc(len(running))
        for s in running:
            req = s.req
            assert req is not None
            req.computed += 1
            req.num_tokens += 1
            req.generated += 1
            if req.generated >= req.max_tokens:
                self.end(s, finish=True)

    def retract(self, running: list[_Sess]) -> None:
        victim = running[self.draw(len(running))]
        req = victim.req
        assert req is not None
        self.cache.release(req)
        self.cache.make_room((len(running) - 1) * RETRACT_DECODE_STEPS)
        req.computed = 0
        req.preemptions += 1
        victim.stage = "waiting"

    def end(self, s: _Sess, finish: bool) -> None:
        req = s.req
        assert req is not None
        if finish:
            self.cache.finish(req)
            s.history = req.num_tokens
        else:
            self.cache.release(req)
        s.req = None
        s.stage = "idle"

    def step(self) -> None:
        s = self.sessions[self.draw(len(self.sessions))]
        action = self.draw(10)
        if s.stage == "idle":
            if action < 7:
                self.new_turn(s)
            elif action == 7 and not self.holding():
                self.cache.clear()
        elif s.stage == "waiting":
            assert s.req is not None
            if action < 6:
                self.admit(s)
            elif action < 8:
                self.cache.match(s.req)  # the scheduler looks at it and moves on (lpm, a refused fcfs turn)
            elif action == 8:
                s.req, s.stage = None, "idle"  # aborted while waiting: nothing to release
        elif s.stage == "prefill":
            if action < 8:
                self.chunk(s)
            else:
                self.end(s, finish=False)  # aborted mid-prefill
        elif action < 8:
            self.decode()
        elif action == 8:
            self.end(s, finish=False)  # aborted while decoding
        else:
            running = [x for x in self.sessions if x.stage == "running"]
            self.retract(running)


def run_ops(cache: RadixCache, cfg: OpsConfig, draws: list[int], steps: int) -> int:
    """Play ``steps`` actions drawn from ``draws`` on ``cache``, checking its invariants after each; then end
    every request. Returns the number of steps played."""
    d = _Driver(cache, cfg, draws)
    for _ in range(steps):
        d.step()
        cache.check(d.holding())
    for s in d.sessions:
        if s.stage in ("prefill", "running"):
            d.end(s, finish=s.stage == "running" and d.draw(2) == 0)
    cache.check([])
    return steps
