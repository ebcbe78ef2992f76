"""The in-process simulator: owns virtual time and drives the three cores (workload, policy, engine).

The event loop is SimPy-shaped: a heap of ``(time, seq, kind, payload)`` with a per-run counter, so events at
equal times keep their insertion order and a run is deterministic per seed. The engine is stepped whenever
it is idle and has work; each step (or jump of identical decode steps) is bounded by the next pending event,
so arrivals and think-time expiries are seen at the next step boundary, as in a real engine.

Session life cycle (closed loop)::

    arrive -> [gateway: proceed | park] -> engine -> turn done -> think -> [gateway] -> ... -> last turn -> end
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from kvgate import __version__
from kvgate.engine.base import Request
from kvgate.engine.blocks import SeqKey
from kvgate.engine.costmodel import profile as get_profile
from kvgate.engine.factory import EngineConfig, build_engine
from kvgate.errors import UsageError
from kvgate.policy import (
    Park,
    Policy,
    PolicyError,
    Proceed,
    SessionEnded,
    SessionState,
    Timer,
    TurnAborted,
    TurnFinished,
    TurnRequested,
    make_limit,
    parse_arm,
)
from kvgate.records import SAMPLES, SESSIONS, TURNS, Columns
from kvgate.workload.arrivals import Burst, RateChange, SessionSpec, generate, parse_burst, parse_rate_at
from kvgate.workload.shapes import Workload, preset

GROUP_ID = 0


@dataclass(frozen=True)
class SimConfig:
    """Everything that defines a simulated run. Stored whole in ``run.json``."""

    preset: str = "paper-8b"
    trace: str | None = None
    """Trace-shape JSONL (kvgate format) to replay instead of a preset; "bundled" for the packaged set."""
    max_context: int | None = None
    lam: float = 0.035
    minutes: float = 90.0
    seed: int = 501
    bursts: tuple[str, ...] = ()
    flush_at: float | None = None
    rate_at: tuple[str, ...] = ()
    engine: str = "vllm"
    profile: str = "qwen3-8b-mi300x"
    kv_pool: int | None = None
    prefix_caching: bool = True
    cpu_offload_tokens: int = 0
    offload_bandwidth_gbs: float = 50.0
    """Effective host-to-GPU bandwidth of the CPU offload tier (GB/s). Default: vLLM's native offloading, DMA copies
    of MB-sized blocks over PCIe Gen5 (~50 GB/s one way, vLLM blog 2025-12-29; docs/calibration.md)."""
    offload_latency_s: float = 0.015
    """Fixed latency of one host-to-GPU transfer (seconds per loaded request; docs/calibration.md)."""
    mixed_decode_factor: float | None = None
    """Override of the profile's ``mixed_decode_factor`` (sensitivity analysis only; None: the profile's)."""
    block_size: int = 16
    """Tokens per KV block of the simulated vLLM (16 on GPUs; vLLM's CPU build uses 128)."""
    sglang_policy: str = "fcfs"
    control: str = "none"
    control_at: float | None = None
    """Minute the controller starts; before it the gateway runs ``none``. None: from the start."""
    control_opt: str = ""
    align_min: float | None = None
    """Start of the 5-minute windows of the persistent-degradation test; default: end of the trigger."""
    client_timeout_s: float | None = None
    """Agent-side timeout of one attempt of a turn (seconds from sending it); None: wait for ever."""
    client_retries: int = 0
    """Attempts after the first before the agent gives up its session."""
    retry_backoff_s: float = 2.0
    """Wait before retry i (doubling per retry, times 1 ± ``retry_jitter`` drawn per attempt)."""
    retry_jitter: float = 0.5
    abandoned: str = "disconnect"
    """Without a gateway, what a timed-out attempt does on the engine: "disconnect" (the client closes the
    connection and the engine aborts it, as the OpenAI client does). "keep" (it runs on beside the retry) needs two
    requests of one session in the pool at once, which the simulated pool does not model yet."""
    evict_sessions: bool = False
    """Engine-side alternative (vllm): evict parked and ended sessions' cached blocks before admitted ones'."""
    retention: bool = False
    """Engine-side alternative (vllm): longer contexts' cached blocks are evicted last."""
    pin_ttl_s: float = 0.0
    """Engine-side alternative (vllm): a finished turn's blocks stay pinned this many seconds (0: off)."""
    prefix_first: int = 0
    """Engine-side alternative (vllm): order the first N waiting requests by cached fraction (0: off)."""
    sample_s: float = 10.0
    max_num_batched_tokens: int = 8192
    max_num_seqs: int = 1024
    label: str = ""

    def with_(self, **kw: Any) -> SimConfig:
        return replace(self, **kw)

    # -- derived, validated pieces -------------------------------------------------------------------
    def parsed_bursts(self) -> list[Burst]:
        return [parse_burst(b) for b in self.bursts]

    def parsed_rates(self) -> list[RateChange]:
        return [parse_rate_at(r) for r in self.rate_at]

    def trigger_end_min(self) -> float | None:
        """End of the run's trigger (last burst end, or the flush), in minutes."""
        ends = [b.end_s / 60 for b in self.parsed_bursts()]
        if self.flush_at is not None:
            ends.append(self.flush_at)
        return max(ends) if ends else None

    def workload(self) -> Workload:
        if self.trace:
            from kvgate.workload import trace as tr

            path = None if self.trace == "bundled" else self.trace
            return tr.trace_workload(path, max_context=self.max_context or 38_000)
        return preset(self.preset)


def control_opts(name: str, text: str) -> dict[str, Any]:
    """``k=v,k=v`` for controller ``name`` to a dict (values typed by :func:`kvgate.policy.parse_arm`)."""
    if not text:
        return {}
    _, opts = parse_arm(name + ":" + text.replace(",", ":"))
    return opts


@dataclass
class _Sess:
    spec: SessionSpec
    prompts: list[int]
    turn: int = 0
    t_req: float = 0.0
    first_sent: float = math.nan
    end: float = math.nan
    demand: int = 0
    req: Request | None = None
    sent: float = 0.0
    attempt: int = 0
    """Attempt of the current turn (0: the first)."""
    attempt_sent: float = 0.0
    gone: bool = False


@dataclass
class SimResult:
    config: SimConfig
    meta: dict[str, Any]
    tables: dict[str, Any] = field(default_factory=dict)


ARRIVE, THINK, STEP, SAMPLE, FLUSH, CONTROL, TIMER, END, TIMEOUT, RETRY = range(10)


def _opt(x: float) -> float | None:
    return None if math.isnan(x) else x


def engine_config(cfg: SimConfig) -> EngineConfig:
    """The engine part of a simulated run's config."""
    return EngineConfig(
        engine=cfg.engine, profile=cfg.profile, kv_pool=cfg.kv_pool, prefix_caching=cfg.prefix_caching,
        block_size=cfg.block_size, cpu_offload_tokens=cfg.cpu_offload_tokens,
        offload_bandwidth_gbs=cfg.offload_bandwidth_gbs, offload_latency_s=cfg.offload_latency_s,
        mixed_decode_factor=cfg.mixed_decode_factor, sglang_policy=cfg.sglang_policy,
        max_num_batched_tokens=cfg.max_num_batched_tokens, max_num_seqs=cfg.max_num_seqs,
        evict_sessions=cfg.evict_sessions, retention=cfg.retention, pin_ttl_s=cfg.pin_ttl_s,
        prefix_first=cfg.prefix_first,
    )  # fmt: skip


def validate(cfg: SimConfig) -> Workload:
    """Check a config before running; raises UsageError with a one-line message."""
    if cfg.lam < 0:
        raise UsageError(f"negative arrival rate {cfg.lam}")
    if cfg.minutes <= 0:
        raise UsageError("--minutes must be positive")
    cfg.parsed_bursts()
    cfg.parsed_rates()
    prof = get_profile(cfg.profile)
    wl = cfg.workload()
    pool = cfg.kv_pool or prof.kv_pool_tokens
    need = wl.max_context()
    if pool < need:
        raise UsageError(f"KV pool of {pool} tokens is smaller than one session's context ({need} tokens)")
    if need > prof.max_model_len:
        raise UsageError(f"sessions reach {need} tokens, over the engine's max_model_len {prof.max_model_len}")
    if cfg.block_size < 1:
        raise UsageError("--block-size must be a positive number of tokens")
    if not cfg.offload_bandwidth_gbs > 0 or not cfg.offload_latency_s >= 0:
        raise UsageError("--offload-bandwidth must be positive and --offload-latency non-negative")
    if cfg.control_at is not None and cfg.control_at < 0:
        raise UsageError("--control-at must be non-negative")
    if cfg.client_timeout_s is not None and not cfg.client_timeout_s > 0:
        raise UsageError("--client-timeout must be positive")
    if cfg.client_retries < 0 or cfg.retry_backoff_s < 0 or not 0 <= cfg.retry_jitter < 1:
        raise UsageError("--retries and --retry-backoff must be non-negative and --retry-jitter in [0, 1)")
    if cfg.pin_ttl_s < 0 or cfg.prefix_first < 0:
        raise UsageError("--pin-ttl and --prefix-first must be non-negative")
    if cfg.engine != "vllm" and (cfg.evict_sessions or cfg.retention or cfg.pin_ttl_s or cfg.prefix_first):
        raise UsageError("the engine-side alternatives are options of the simulated vLLM (--engine vllm)")
    if cfg.abandoned != "disconnect":
        raise UsageError(f"--abandoned {cfg.abandoned!r}: the simulator models only disconnect (an abandoned attempt "
                         "running on beside its retry needs two requests of one session in the simulated pool)")
    try:
        make_limit(cfg.control, capacity_tokens=pool, **control_opts(cfg.control, cfg.control_opt))
    except (PolicyError, ValueError, TypeError) as e:
        raise UsageError(str(e)) from None
    return wl


def simulate(cfg: SimConfig) -> SimResult:
    """Run one simulated experiment; returns its records (as Arrow tables) and metadata with the summary."""
    wall0 = time.perf_counter()
    wl = validate(cfg)
    horizon = cfg.minutes * 60.0
    specs = generate(wl, cfg.lam, horizon, cfg.seed, cfg.parsed_bursts(), cfg.parsed_rates())
    eng = build_engine(engine_config(cfg))
    pool_tokens = eng.kv_pool_tokens
    opts = control_opts(cfg.control, cfg.control_opt)
    if cfg.control_at is None:
        policy = Policy(limit=make_limit(cfg.control, capacity_tokens=pool_tokens, **opts))
    else:
        policy = Policy(limit=make_limit("none", capacity_tokens=pool_tokens))
    turns = Columns(TURNS)
    samples = Columns(SAMPLES)
    sessions: dict[int, _Sess] = {}
    heap: list[tuple[float, int, int, Any]] = []
    seq = 0

    def push(t: float, kind: int, payload: Any = None) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, kind, payload))

    for sp in specs:
        push(sp.arrival_s, ARRIVE, sp)
    t = 0.0
    while t <= horizon:
        push(t, SAMPLE)
        t += cfg.sample_s
    if cfg.flush_at is not None:
        push(cfg.flush_at * 60.0, FLUSH)
    if cfg.control_at is not None:
        push(cfg.control_at * 60.0, CONTROL)
    push(horizon, END)

    in_system = 0
    demand_total = 0
    flushed_at: list[float] = []
    flush_refusals = 0
    engine_busy = False
    timer_at = math.inf
    rid_counter = 0
    group_blocks = {}
    # Agent-side timeouts and retries. A timed-out attempt in flight is aborted on the engine (through a gateway,
    # any control but none, the gateway cancels it upstream; without one, the client's disconnect does). Through a
    # gateway a held turn keeps its place: the retry re-attaches to it.
    timeout_s = cfg.client_timeout_s
    orphans: set[int] = set()
    timeouts = retries_sent = abandoned_sessions = 0

    def seq_key(s: _Sess) -> SeqKey:
        gb = group_blocks.get(s.spec.shape.shared_tokens)
        if gb is None:
            gb = group_blocks[s.spec.shape.shared_tokens] = s.spec.shape.shared_tokens // eng.block_size
        return SeqKey(GROUP_ID, gb, s.spec.sid)

    def send(s: _Sess, now: float) -> None:
        nonlocal rid_counter
        rid_counter += 1
        shape = s.spec.shape
        req = Request(rid_counter, seq_key(s), s.prompts[s.turn], shape.outputs[s.turn], now, s)
        s.req = req
        s.sent = now
        if math.isnan(s.first_sent):
            s.first_sent = now
        eng.add(req)

    status = eng.session_status if getattr(eng, "tracks_sessions", False) else None

    def apply(decisions: list[Any], now: float) -> None:
        for d in decisions:
            if type(d) is Proceed:
                if status is not None:
                    status(d.session, "admitted")
                send(sessions[d.session], now)
            else:
                assert type(d) is Park
                if status is not None:
                    status(d.session, "parked")

    def request_turn(s: _Sess, now: float) -> None:
        nonlocal demand_total
        shape = s.spec.shape
        s.t_req = now
        new_demand = s.prompts[s.turn] + shape.outputs[s.turn]
        demand_total += new_demand - s.demand
        s.demand = new_demand
        if timeout_s is not None:
            s.attempt = 0
            s.attempt_sent = now
            push(now + timeout_s, TIMEOUT, (s, s.turn, 0))
        apply(policy.handle(TurnRequested(now, s.spec.sid, s.prompts[s.turn], shape.outputs[s.turn])), now)

    def leave(s: _Sess, now: float) -> None:
        nonlocal in_system, demand_total
        in_system -= 1
        demand_total -= s.demand
        s.demand = 0
        if status is not None:
            status(s.spec.sid, "ended")
        apply(policy.handle(SessionEnded(now, s.spec.sid)), now)

    def timed_out(s: _Sess, now: float) -> None:
        """The agent's current attempt of its turn timed out: abandon it, then retry after a backoff or give up."""
        nonlocal timeouts, abandoned_sessions
        timeouts += 1
        req = s.req
        if req is not None:  # in flight (held turns stay where they are: the gateway re-attaches the retry)
            turns.add(
                s.spec.sid, s.spec.cohort, s.turn, s.attempt_sent, s.sent, req.t_sched, req.t_first, now,
                req.prompt, None, req.generated, s.sent - s.t_req, req.preemptions, "aborted", 0.0,
            )  # fmt: skip
            s.req = None
            # NOTE: marked in any case: the engine may have finished it in a step whose result is not delivered yet
            orphans.add(req.rid)
            eng.abort(req)  # through a gateway it is cancelled upstream; without, the client's disconnect aborts it
            apply(policy.handle(TurnAborted(now, s.spec.sid)), now)
        if s.attempt >= cfg.client_retries:
            s.gone = True
            abandoned_sessions += 1
            leave(s, now)
            return
        s.attempt += 1
        u = float(np.random.default_rng([cfg.seed, 4, s.spec.sid, s.turn, s.attempt]).uniform(-1.0, 1.0))
        delay = cfg.retry_backoff_s * 2 ** (s.attempt - 1) * (1.0 + cfg.retry_jitter * u)
        push(now + delay, RETRY, (s, s.turn, s.attempt))

    def retry(s: _Sess, now: float) -> None:
        nonlocal retries_sent
        retries_sent += 1
        s.attempt_sent = now
        assert timeout_s is not None
        push(now + timeout_s, TIMEOUT, (s, s.turn, s.attempt))
        if s.req is None and policy.state_of(s.spec.sid) is SessionState.THINKING:  # cancelled: ask again
            shape = s.spec.shape
            apply(policy.handle(TurnRequested(now, s.spec.sid, s.prompts[s.turn], shape.outputs[s.turn])), now)

    now = 0.0
    while heap:
        now, _, kind, payload = heapq.heappop(heap)
        if now > horizon:
            break
        if kind == STEP:
            engine_busy = False
            for req in payload.finished:
                if orphans and req.rid in orphans:  # an abandoned attempt (kept running, or finished as it timed out)
                    orphans.discard(req.rid)
                    continue
                s: _Sess = req.tag
                turns.add(
                    s.spec.sid, s.spec.cohort, s.turn, s.t_req, s.sent, req.t_sched, req.t_first, req.t_end,
                    req.prompt, req.cached, req.generated, s.sent - s.t_req, req.preemptions, "ok", 0.0,
                )  # fmt: skip
                s.req = None
                apply(
                    policy.handle(
                        TurnFinished(now, s.spec.sid, req.t_end - s.sent, req.prompt, req.cached, req.generated)
                    ),
                    now,
                )
                s.turn += 1
                if s.turn < s.spec.shape.turns:
                    push(now + s.spec.think_s[s.turn - 1], THINK, s)
                else:
                    s.end = now
                    leave(s, now)
        elif kind == ARRIVE:
            sp: SessionSpec = payload
            s = _Sess(sp, sp.shape.prompt_tokens())
            sessions[sp.sid] = s
            in_system += 1
            request_turn(s, now)
        elif kind == THINK:
            request_turn(payload, now)
        elif kind == SAMPLE:
            c = policy.counts()
            samples.add(
                now, in_system, c["admitted"], c["parked"], c["waiting"], len(eng.running), len(eng.waiting),
                eng.usage(), demand_total, policy.demand, pool_tokens, eng.stats.preemptions,
            )  # fmt: skip
        elif kind == FLUSH:
            # SGLang refuses to flush while requests run; retry every second, as the paper's driver did
            if eng.flush(preempt=True):
                flushed_at.append(now)
            else:
                flush_refusals += 1
                push(now + 1.0, FLUSH)
        elif kind == CONTROL:
            lim = make_limit(cfg.control, capacity_tokens=pool_tokens, **opts)
            apply(policy.set_limit(now, lim), now)
        elif kind == TIMER:
            timer_at = math.inf
            dl = policy.next_deadline()
            if dl is not None and dl <= now:
                apply(policy.handle(Timer(now)), now)
        elif kind in (TIMEOUT, RETRY):
            s, turn, attempt = payload
            if not s.gone and s.turn == turn and s.attempt == attempt:  # else the turn finished meanwhile
                (timed_out if kind == TIMEOUT else retry)(s, now)
        elif kind == END:
            break
        dl = policy.next_deadline()
        if dl is not None and dl < timer_at:
            timer_at = max(dl, now)
            push(timer_at, TIMER)
        if not engine_busy and eng.has_work():
            nxt = heap[0][0] if heap else math.inf
            res = eng.step(now, nxt)
            if res.steps and res.duration > 0:
                engine_busy = True
                push(now + res.duration, STEP, res)

    sess_cols = Columns(SESSIONS)
    for sid in sorted(sessions):
        s = sessions[sid]
        sess_cols.add(
            sid, s.spec.cohort, s.spec.arrival_s, _opt(s.end), s.spec.shape.turns, s.turn, _opt(s.first_sent),
            s.spec.shape.source,
        )  # fmt: skip
    tables = {"turns": turns.table(), "sessions": sess_cols.table(), "samples": samples.table()}
    meta: dict[str, Any] = {
        "kvgate_version": __version__,
        "kind": "sim",
        "config": asdict(cfg),
        "seed": cfg.seed,
        "pool_tokens": pool_tokens,
        "engine_steps": eng.stats.steps,
        "parks": policy.parks,
        "flushed_at_s": flushed_at,
        "flush_refusals": flush_refusals,
        "client_timeouts": timeouts,
        "client_retries": retries_sent,
        "sessions_abandoned": abandoned_sessions,
        "sim_wall_s": time.perf_counter() - wall0,
    }
    from kvgate.analysis.summary import summarize_tables

    meta["summary"] = summarize_tables(meta, tables)
    meta["summary"]["wall_s"] = round(time.perf_counter() - wall0, 4)
    return SimResult(cfg, meta, tables)
