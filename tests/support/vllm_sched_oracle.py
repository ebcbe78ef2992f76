"""vLLM's own v1 ``Scheduler`` run without a model, and kvgate's simulated vLLM engine driven in lockstep with it.

The oracle is ``vllm.v1.core.sched.scheduler.Scheduler`` of **vLLM 0.32.0** (:data:`VLLM_VERSION`), built the way
vLLM's ``tests/v1/core/utils.py`` builds it: a ``VllmConfig`` over a local model config (no weights, no
tokenizer, no network), a ``KVCacheConfig`` with one full-attention group, and requests with concrete token ids.
A step is ``schedule()`` then ``update_from_output()`` with a synthetic ``ModelRunnerOutput``: one sampled token
for every request whose prompt (or recompute) is done, none for a prefill chunk; requests finish at
``max_tokens`` (EOS ignored).

Token ids follow kvgate's content model (:class:`kvgate.engine.blocks.SeqKey`): the first
``group_blocks * block_size`` tokens of a request are its group's shared prefix, the rest are unique to its
session and are a pure function of their position, so a session's next turn (previous prompt + output +
appended tokens) extends the previous one token for token, and the token a request samples at position ``p``
is the one its session's next prompt carries at ``p``. Equal content keys are then equal chained block hashes.

vLLM's pool reserves block 0 as its null block: a kvgate engine of ``n`` blocks is compared with a vLLM
``KVCacheConfig`` of ``n + 1`` blocks (both can hold ``n`` blocks of KV).

:func:`run_lockstep` feeds the same request stream (arrivals and aborts by step index, agent sessions whose
next turn follows a finished one after a think time in steps) to several engines and raises
:class:`Divergence` at the first step where they differ in what they scheduled (requests, order, new tokens),
preempted, admitted (with its prefix-cache hit), finished, or reported as cached tokens.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, Protocol

from kvgate.engine.base import Request as KRequest
from kvgate.engine.blocks import SeqKey
from kvgate.engine.costmodel import QWEN3_8B_MI300X
from kvgate.engine.vllm import VllmEngine

VLLM_VERSION = "0.32.0"
"""The vLLM release whose scheduler kvgate's engine is held to."""

MAX_MODEL_LEN = 1 << 20

# A profile in which every step lasts exactly one time unit: time equals the step index, so a decode jump of
# ``n`` steps can be compared with ``n`` single steps of vLLM, event for event.
UNIT_PROFILE = dataclasses.replace(
    QWEN3_8B_MI300X,
    name="unit-steps",
    overhead_s=1.0,
    weights_s=0.0,
    per_token_s=0.0,
    attn_s=0.0,
    kv_read_s=0.0,
    per_seq_s=0.0,
    max_model_len=MAX_MODEL_LEN,
)


def vllm_missing() -> str | None:
    """Why vLLM's scheduler cannot be imported here, or None when it can."""
    try:
        import vllm  # noqa: F401
        from vllm.v1.core.sched.scheduler import Scheduler  # noqa: F401
    except Exception as e:  # pragma: no cover - depends on the environment
        return f"vLLM {VLLM_VERSION} is not importable: {type(e).__name__}: {e}"
    return None


# -- token content of a SeqKey ------------------------------------------------------------------------------
_GROUP_TAG = 1 << 60
_SESSION_TAG = 2 << 60


def token_ids(seq: SeqKey, block_size: int, start: int, stop: int) -> list[int]:
    """Token ids at positions ``[start, stop)`` of any request with content key ``seq``."""
    g = seq.group_blocks * block_size
    gtag = _GROUP_TAG | (seq.group << 40) | (seq.group_blocks << 24)
    stag = _SESSION_TAG | (seq.session << 24)
    return [(gtag | p) if p < g else (stag | p) for p in range(start, stop)]


# -- what one engine step did, engine-neutral ---------------------------------------------------------------
@dataclass(frozen=True)
class StepView:
    scheduled: tuple[tuple[int, int], ...]
    """(request id, new tokens) in the order the scheduler took them."""
    preempted: frozenset[int]
    admitted: tuple[tuple[int, int], ...]
    """(request id, prefix-cache hit in tokens) for each request taken from the waiting queue."""
    finished: tuple[int, ...]
    cached: tuple[tuple[int, int], ...]
    """(request id, cached tokens reported with the first output token) for requests emitting their first token."""

    def describe(self) -> str:
        return (
            f"scheduled={list(self.scheduled)} preempted={sorted(self.preempted)} admitted={list(self.admitted)} "
            f"finished={list(self.finished)} cached={list(self.cached)}"
        )


class Engine(Protocol):
    name: str
    jumps: bool

    def add(self, rid: int, seq: SeqKey, prompt: int, max_tokens: int) -> None: ...

    def abort(self, rid: int) -> None: ...

    def flush(self, preempt: bool) -> tuple[bool, frozenset[int]]:
        """Reset the prefix cache (preempting every running request first with ``preempt``); returns whether
        it was reset and the requests preempted."""
        ...

    def has_work(self) -> bool: ...

    def step(self, now: int, horizon: float) -> list[StepView]:
        """Run one engine call at step ``now``; a decode jump (up to ``horizon``) returns one view per single
        step it stands for."""
        ...

    def generated(self, rid: int) -> int: ...

    def free_blocks(self) -> int: ...

    def prefix_stats(self) -> tuple[int, int]:
        """(queried, hit) tokens over first admissions so far (vLLM's prefix-cache metrics, preempted excluded)."""
        ...


# -- vLLM's Scheduler -------------------------------------------------------------------------------------
_MODEL_CONFIG: Any = None


def _model_config() -> Any:
    """One ModelConfig for every scheduler (building it reads a local config.json; the slow part)."""
    global _MODEL_CONFIG
    if _MODEL_CONFIG is None:
        from vllm.config import ModelConfig

        logging.getLogger("vllm").setLevel(logging.ERROR)  # platform notes and failed-reset warnings

        d = tempfile.mkdtemp(prefix="kvgate-sched-oracle-")
        cfg = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "hidden_size": 64,
            "intermediate_size": 128,
            "num_attention_heads": 2,
            "num_key_value_heads": 2,
            "num_hidden_layers": 1,
            "vocab_size": 32000,
            "max_position_embeddings": MAX_MODEL_LEN,
            "torch_dtype": "float32",
        }
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump(cfg, f)
        _MODEL_CONFIG = ModelConfig(model=d, skip_tokenizer_init=True, max_model_len=MAX_MODEL_LEN, dtype="float32")
    return _MODEL_CONFIG


_HASHER: Any = None


def _block_hasher(block_size: int) -> Any:
    global _HASHER
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    if _HASHER is None:
        init_none_hash(sha256)
        _HASHER = {}
    h = _HASHER.get(block_size)
    if h is None:
        h = _HASHER[block_size] = get_request_block_hasher(block_size, sha256)
    return h


class VllmSchedulerEngine:
    """vLLM 0.32's v1 Scheduler with synthetic model outputs (see module docstring)."""

    name = "vllm"
    jumps = False

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 1024,
        prefix_caching: bool = True,
        reserve_full_isl: bool = True,
    ) -> None:
        import torch
        from vllm.config import CacheConfig, SchedulerConfig, VllmConfig
        from vllm.v1.core.sched.scheduler import Scheduler
        from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
        from vllm.v1.structured_output import StructuredOutputManager

        sc = SchedulerConfig(
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            max_model_len=MAX_MODEL_LEN,
            enable_chunked_prefill=True,
            is_encoder_decoder=False,
            async_scheduling=False,
            scheduler_reserve_full_isl=reserve_full_isl,
        )
        cc = CacheConfig(block_size=block_size, enable_prefix_caching=prefix_caching)
        vc = VllmConfig(model_config=_model_config(), scheduler_config=sc, cache_config=cc)
        n = num_blocks + 1  # vLLM's null block
        cc.num_gpu_blocks = n
        spec = FullAttentionSpec(block_size=block_size, num_kv_heads=1, head_size=1, dtype=torch.float32)
        kv = KVCacheConfig(num_blocks=n, kv_cache_tensors=[], kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
        self.sched = Scheduler(
            vllm_config=vc,
            kv_cache_config=kv,
            structured_output_manager=StructuredOutputManager(vc),
            block_size=block_size,
            log_stats=True,
        )
        assert self.sched.scheduler_reserve_full_isl == reserve_full_isl
        assert self.sched.kv_cache_manager.watermark_blocks == 0
        self.block_size = block_size
        self.hasher = _block_hasher(block_size)
        self.seqs: dict[int, SeqKey] = {}
        self.reqs: dict[int, Any] = {}
        self.queries = 0
        self.hits = 0
        self.flushed: frozenset[int] = frozenset()  # preempted by a flush; vLLM lists them with the next step's

    def add(self, rid: int, seq: SeqKey, prompt: int, max_tokens: int) -> None:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        sp = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        req = Request(
            request_id=str(rid),
            prompt_token_ids=token_ids(seq, self.block_size, 0, prompt),
            sampling_params=sp,
            pooling_params=None,
            arrival_time=float(rid),
            block_hasher=self.hasher,
        )
        self.seqs[rid] = seq
        self.reqs[rid] = req
        self.sched.add_request(req)

    def abort(self, rid: int) -> None:
        from vllm.v1.request import RequestStatus

        self.sched.finish_requests(str(rid), RequestStatus.FINISHED_ABORTED)

    def flush(self, preempt: bool) -> tuple[bool, frozenset[int]]:
        before = {int(r.request_id) for r in self.sched.running}
        ok = self.sched.reset_prefix_cache(reset_running_requests=preempt)
        gone = frozenset(before - {int(r.request_id) for r in self.sched.running})
        self.flushed |= gone
        return ok, gone

    def has_work(self) -> bool:
        return self.sched.get_num_unfinished_requests() > 0

    def generated(self, rid: int) -> int:
        return self.reqs[rid].num_output_tokens

    def free_blocks(self) -> int:
        return self.sched.kv_cache_manager.block_pool.get_num_free_blocks()

    def prefix_stats(self) -> tuple[int, int]:
        return self.queries, self.hits

    def step(self, now: int, horizon: float) -> list[StepView]:
        from vllm.v1.outputs import ModelRunnerOutput

        sched = self.sched
        waiting_before = {r.request_id for r in sched.waiting}
        flushed, self.flushed = self.flushed, frozenset()
        out = sched.schedule()
        nst = out.num_scheduled_tokens
        scheduled = tuple((int(k), v) for k, v in nst.items())
        admitted = []
        req_ids = list(nst)
        sampled: list[list[int]] = []
        for k, v in nst.items():
            r = sched.requests[k]
            if k in waiting_before:
                admitted.append((int(k), r.num_computed_tokens - v))
            if r.num_computed_tokens >= r.num_tokens:
                p = r.num_tokens
                sampled.append(token_ids(self.seqs[int(k)], self.block_size, p, p + 1))
            else:
                sampled.append([])
        mro = ModelRunnerOutput(
            req_ids=req_ids, req_id_to_index={k: i for i, k in enumerate(req_ids)}, sampled_token_ids=sampled
        )
        outs = sched.update_from_output(out, mro)
        finished = []
        cached = []
        for eco in outs.values():
            if eco.scheduler_stats is not None:  # vLLM's prefix-cache metrics of this step
                pcs = eco.scheduler_stats.prefix_cache_stats
                self.queries += pcs.queries
                self.hits += pcs.hits
            for o in eco.outputs:
                if o.prefill_stats is not None:
                    cached.append((int(o.request_id), o.prefill_stats.num_cached_tokens))
                if o.finish_reason is not None:
                    finished.append(int(o.request_id))
        return [
            StepView(
                scheduled=scheduled,
                preempted=frozenset(int(k) for k in out.preempted_req_ids) - flushed,
                admitted=tuple(admitted),
                finished=tuple(finished),
                cached=tuple(cached),
            )
        ]


# -- kvgate's engine -------------------------------------------------------------------------------------
class KvgateEngine:
    """kvgate's VllmEngine on a unit-time profile; ``jumps`` lets it take decode jumps up to the horizon."""

    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        max_num_batched_tokens: int = 8192,
        max_num_seqs: int = 1024,
        prefix_caching: bool = True,
        reserve_full_isl: bool = True,
        jumps: bool = False,
        pool: object | None = None,
        name: str = "kvgate",
        engine_cls: type[VllmEngine] = VllmEngine,
    ) -> None:
        self.name = name
        self.eng = engine_cls(
            UNIT_PROFILE,
            num_blocks * block_size,
            block_size=block_size,
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            prefix_caching=prefix_caching,
            reserve_full_prompt=reserve_full_isl,
            pool=pool,
        )
        self.jumps = jumps
        self.jumps_taken = 0
        self.now = 0.0
        self.reqs: dict[int, KRequest] = {}

    def add(self, rid: int, seq: SeqKey, prompt: int, max_tokens: int) -> None:
        r = KRequest(rid, seq, prompt, max_tokens, self.now, None)
        self.reqs[rid] = r
        self.eng.add(r)

    def abort(self, rid: int) -> None:
        r = self.reqs[rid]
        if r.t_end < 0:
            self.eng.abort(r)

    def flush(self, preempt: bool) -> tuple[bool, frozenset[int]]:
        before = {r.rid for r in self.eng.running}
        ok = self.eng.flush(preempt)
        return ok, frozenset(before - {r.rid for r in self.eng.running})

    def has_work(self) -> bool:
        return self.eng.has_work()

    def generated(self, rid: int) -> int:
        return self.reqs[rid].generated

    def free_blocks(self) -> int:
        return self.eng.pool.num_free_blocks()  # type: ignore[attr-defined]

    def prefix_stats(self) -> tuple[int, int]:
        # vLLM counts no queries while prefix caching is off; kvgate counts them with no hits
        st = self.eng.stats
        return (st.queries if self.eng.prefix_caching else 0), st.hits

    def step(self, now: int, horizon: float) -> list[StepView]:
        eng = self.eng
        waiting_before = {id(r) for r in eng.waiting}
        self.now = float(now)
        res = eng.step(self.now, horizon if self.jumps else self.now)
        scheduled = tuple((r.rid, n) for r, n in res.scheduled)
        finished = tuple(r.rid for r in res.finished)
        cached = tuple((r.rid, r.cached) for r in res.first_token)
        if res.steps > 1:
            self.jumps_taken += 1
            one = tuple((rid, 1) for rid, _ in scheduled)
            views = [StepView(one, frozenset(), (), (), ()) for _ in range(res.steps - 1)]
            views.append(StepView(one, frozenset(), (), finished, cached))
            return views
        admitted = tuple((r.rid, r.computed - n) for r, n in res.scheduled if id(r) in waiting_before)
        return [StepView(scheduled, frozenset(r.rid for r in res.preempted), admitted, finished, cached)]


# -- request streams --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Turn:
    append: int
    """Tokens this turn appends to the session's context (the first turn: after the group prefix)."""
    max_tokens: int
    think: int
    """Steps between this turn's end and the next turn's arrival."""
    abort_after: int | None = None
    """Abort this many steps after submission if it has not finished by then."""


@dataclass(frozen=True)
class Session:
    sid: int
    group: int
    group_blocks: int
    arrive: int
    turns: tuple[Turn, ...]


@dataclass(frozen=True)
class Stream:
    num_blocks: int
    block_size: int
    max_num_batched_tokens: int
    max_num_seqs: int
    prefix_caching: bool
    sessions: tuple[Session, ...]
    flushes: tuple[tuple[int, bool], ...] = ()
    reserve_full_isl: bool = True
    """vLLM's ``scheduler_reserve_full_isl`` (kvgate's ``reserve_full_prompt``); on by default in both."""
    """(step, preempt): reset the prefix cache at that step, preempting the running requests first or not."""

    def engine_kwargs(self) -> dict[str, Any]:
        return {
            "max_num_batched_tokens": self.max_num_batched_tokens,
            "max_num_seqs": self.max_num_seqs,
            "prefix_caching": self.prefix_caching,
            "reserve_full_isl": self.reserve_full_isl,
        }


class Divergence(AssertionError):
    pass


@dataclass
class Outcome:
    steps: int = 0
    requests: int = 0
    finished: int = 0
    aborted: int = 0
    preemptions: int = 0
    admissions: int = 0
    hit_tokens: int = 0
    max_batch: int = 0
    flushes: int = 0
    """Successful prefix-cache resets."""
    stuck: bool = False
    """Ended with requests that no engine can ever schedule (identically in all)."""
    log: list[str] = field(default_factory=list)


def run_lockstep(stream: Stream, engines: list[Engine], max_steps: int = 20_000) -> Outcome:
    """Drive every engine with ``stream`` step by step; raise :class:`Divergence` at the first difference."""
    bs = stream.block_size
    ref = engines[0]
    out = Outcome()
    # events: step -> list of (kind, payload)
    events: dict[int, list[tuple[str, Any]]] = {}

    def at(step: int, kind: str, payload: Any) -> None:
        events.setdefault(step, []).append((kind, payload))

    for s in stream.sessions:
        at(s.arrive, "submit", (s, 0, s.group_blocks * bs))
    for fstep, preempt in stream.flushes:
        at(fstep, "flush", preempt)
    live: dict[int, tuple[Session, int, int]] = {}  # rid -> (session, turn index, prompt)
    next_rid = 0
    step = 0
    while step < max_steps:
        due = [k for k in events if k <= step]
        for kind, payload in [ev for k in sorted(due) for ev in events.pop(k)]:
            if kind == "submit":
                s, ti, base = payload
                t = s.turns[ti]
                prompt = base + t.append
                rid = next_rid
                next_rid += 1
                seq = SeqKey(s.group, s.group_blocks, s.sid)
                for e in engines:
                    e.add(rid, seq, prompt, t.max_tokens)
                live[rid] = (s, ti, prompt)
                out.requests += 1
                out.log.append(
                    f"step {step}: submit r{rid} session {s.sid} turn {ti} prompt {prompt} max {t.max_tokens}"
                )
                if t.abort_after is not None:
                    at(step + t.abort_after, "abort", rid)
            elif kind == "flush":
                got = [e.flush(payload) for e in engines]
                if len(set(got)) > 1:
                    raise Divergence(f"step {step}: flush(preempt={payload}) gave {got}")
                out.flushes += got[0][0]
                out.log.append(f"step {step}: flush(preempt={payload}) -> {got[0][0]}, preempted {sorted(got[0][1])}")
            elif kind == "abort":
                rid = payload
                if rid in live:
                    gens = [e.generated(rid) for e in engines]
                    if len(set(gens)) > 1:
                        raise Divergence(f"step {step}: r{rid} generated {gens} at abort")
                    for e in engines:
                        e.abort(rid)
                    s, ti, prompt = live.pop(rid)
                    out.aborted += 1
                    out.log.append(f"step {step}: abort r{rid} after {gens[0]} tokens")
                    _next_turn(at, step, s, ti, prompt + gens[0])
        works = [e.has_work() for e in engines]
        if len(set(works)) > 1:
            raise Divergence(
                f"step {step}: has_work differs {dict(zip([e.name for e in engines], works, strict=True))}"
            )
        if not works[0]:
            if not events:
                break
            step = min(events)
            continue
        nxt = min(events) if events else math.inf
        views = [e.step(step, nxt) for e in engines]
        n = max(len(v) for v in views)
        for k, e in enumerate(engines):  # a decode jump stands for several single steps
            while not e.jumps and len(views[k]) < n:
                views[k] = views[k] + e.step(step + len(views[k]), nxt)
            if len(views[k]) != n:
                raise Divergence(f"step {step}: {e.name} ran {len(views[k])} steps, another {n}")
        for i in range(n):
            first = views[0][i]
            for k in range(1, len(engines)):
                if views[k][i] != first:
                    raise Divergence(
                        f"step {step + i}: {ref.name}: {first.describe()}\n    {engines[k].name}: "
                        f"{views[k][i].describe()}\n  last events:\n    " + "\n    ".join(out.log[-12:])
                    )
            out.steps += 1
            out.max_batch = max(out.max_batch, len(first.scheduled))
            out.preemptions += len(first.preempted)
            out.admissions += len(first.admitted)
            out.hit_tokens += sum(h for _, h in first.admitted)
            if first.preempted:
                out.log.append(f"step {step + i}: preempted {sorted(first.preempted)}")
            for rid in first.finished:
                s, ti, prompt = live.pop(rid)
                out.finished += 1
                _next_turn(at, step + i + 1, s, ti, prompt + ref.generated(rid))
        for what, got in (
            ("free blocks", [e.free_blocks() for e in engines]),
            ("prefix stats", [e.prefix_stats() for e in engines]),
        ):
            if len(set(got)) > 1:
                raise Divergence(f"step {step + n - 1}: {what} {got}\n    " + "\n    ".join(out.log[-12:]))
        step += n
        last = views[0][-1]
        if not last.scheduled and not last.preempted:
            # nothing ran and nothing changed: the state is frozen until the next event
            if not events:
                out.log.append(f"step {step}: stuck")
                out.stuck = True
                break
            step = max(step, min(events))
    return out


def _next_turn(at: Any, step: int, s: Session, ti: int, context: int) -> None:
    if ti + 1 < len(s.turns):
        at(step + s.turns[ti].think, "submit", (s, ti + 1, context))
