"""The in-process simulator: owns virtual time and drives the three cores (workload, policy, engine).

The event loop is SimPy-shaped: a heap of ``(time, seq, kind, payload)`` with a per-run counter, so events at
equal times keep their insertion order and a run is deterministic per seed. The engine is stepped whenever
it is idle and has work; each step (or jump of identical decode steps) is bounded by the next pending event,
so arrivals and think-time expiries are seen at the next step boundary, as in a real engine.

Session life cycle (closed loop, :mod:`kvgate.workload.session`: the same objects the HTTP driver drives)::

    arrive -> [gateway: proceed | park] -> engine -> turn done -> think -> [gateway] -> ... -> last turn -> end
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import asdict, dataclass, field
from typing import Any

from kvgate import __version__
from kvgate.engine.base import Request
from kvgate.engine.blocks import SeqKey
from kvgate.engine.costmodel import profile as get_profile
from kvgate.engine.factory import EngineConfig, build_engine
from kvgate.errors import UsageError
from kvgate.policy.config import ControlConfig
from kvgate.policy.core import Policy
from kvgate.policy.events import Park, Proceed, SessionEnded, Timer, TurnAborted, TurnFinished, TurnRequested
from kvgate.policy.state import SessionState
from kvgate.records import Recorder, SampleRow, TurnRow
from kvgate.workload.arrivals import SessionSpec
from kvgate.workload.config import WorkloadConfig
from kvgate.workload.session import Session, Sessions
from kvgate.workload.shapes import Workload

GROUP_ID = 0


@dataclass(frozen=True)
class SimConfig(WorkloadConfig, EngineConfig, ControlConfig):
    """Everything that defines a simulated run: the workload, the engine and the control, plus the simulator's own
    fields. Stored whole (flat) in ``run.json``; :meth:`from_dict` loads it back."""

    align_min: float | None = None
    """Start of the 5-minute windows of the persistent-degradation test; default: end of the trigger."""
    abandoned: str = "disconnect"
    """Without a gateway, what a timed-out attempt does on the engine: "disconnect" (the client closes the
    connection and the engine aborts it, as the OpenAI client does). "keep" (it runs on beside the retry) needs two
    requests of one session in the pool at once, which the simulated pool does not model yet."""
    sample_s: float = 10.0
    label: str = ""


@dataclass(eq=False)
class _SimSession(Session):
    """A session with the simulator's side of its current turn."""

    t_req: float = 0.0
    req: Request | None = None
    sent: float = 0.0
    attempt_sent: float = 0.0


@dataclass
class SimResult:
    config: SimConfig
    meta: dict[str, Any]
    tables: dict[str, Any] = field(default_factory=dict)


ARRIVE, THINK, STEP, SAMPLE, FLUSH, CONTROL, TIMER, END, TIMEOUT, RETRY = range(10)


def validate(cfg: SimConfig) -> Workload:
    """Check a config before running; raises UsageError with a one-line message. Returns the workload."""
    cfg.check_workload()
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
    if cfg.pin_ttl_s < 0 or cfg.prefix_first < 0:
        raise UsageError("--pin-ttl and --prefix-first must be non-negative")
    if cfg.engine != "vllm" and (cfg.evict_sessions or cfg.retention or cfg.pin_ttl_s or cfg.prefix_first):
        raise UsageError("the engine-side alternatives are options of the simulated vLLM (--engine vllm)")
    if cfg.abandoned != "disconnect":
        raise UsageError(f"--abandoned {cfg.abandoned!r}: the simulator models only disconnect (an abandoned attempt "
                         "running on beside its retry needs two requests of one session in the simulated pool)")
    cfg.check_control(pool)
    return wl


def simulate(cfg: SimConfig) -> SimResult:
    """Run one simulated experiment; returns its records (as Arrow tables) and metadata with the summary."""
    wall0 = time.perf_counter()
    wl = validate(cfg)
    horizon = cfg.horizon_s
    specs = cfg.session_specs(wl)
    eng = build_engine(cfg)
    pool_tokens = eng.kv_pool_tokens
    # before --control-at the gateway lets everything through (control none)
    policy = Policy(limit=(cfg if cfg.control_at is None else ControlConfig()).make_control(pool_tokens))
    rec = Recorder()
    sessions = Sessions(cfg.agent_retries())
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

    def seq_key(s: _SimSession) -> SeqKey:
        gb = group_blocks.get(s.spec.shape.shared_tokens)
        if gb is None:
            gb = group_blocks[s.spec.shape.shared_tokens] = s.spec.shape.shared_tokens // eng.block_size
        return SeqKey(GROUP_ID, gb, s.spec.sid)

    def send(s: _SimSession, now: float) -> None:
        nonlocal rid_counter
        rid_counter += 1
        turn = s.current()
        req = Request(rid_counter, seq_key(s), turn.prompt_tokens, turn.output_tokens, now, s)
        s.req = req
        s.sent = now
        s.mark_sent(now)
        eng.add(req)

    status = eng.session_status if getattr(eng, "tracks_sessions", False) else None

    def apply(decisions: list[Any], now: float) -> None:
        for d in decisions:
            if type(d) is Proceed:
                if status is not None:
                    status(d.session, "admitted")
                send(sessions[d.session], now)  # type: ignore[arg-type]
            else:
                assert type(d) is Park
                if status is not None:
                    status(d.session, "parked")

    def request_turn(s: _SimSession, now: float) -> None:
        turn = sessions.request(s)
        s.t_req = now
        if timeout_s is not None:
            s.attempt_sent = now
            push(now + timeout_s, TIMEOUT, (s, turn.index, 0))
        apply(policy.handle(TurnRequested(now, s.spec.sid, turn.prompt_tokens, turn.output_tokens)), now)

    def left(s: _SimSession, now: float) -> None:
        """``s`` has left the loop (ended or given up): the engine and the gateway let it go."""
        if status is not None:
            status(s.spec.sid, "ended")
        apply(policy.handle(SessionEnded(now, s.spec.sid)), now)

    def timed_out(s: _SimSession, now: float) -> None:
        """The agent's current attempt of its turn timed out: abandon it, then retry after a backoff or give up."""
        req = s.req
        if req is not None:  # in flight (held turns stay where they are: the gateway re-attaches the retry)
            rec.turn(TurnRow(
                s.spec.sid, s.spec.cohort, s.turn, s.attempt_sent, s.sent, req.t_sched, req.t_first, now,
                req.prompt, None, req.generated, s.sent - s.t_req, req.preemptions, "aborted", 0.0,
            ))  # fmt: skip
            s.req = None
            # NOTE: marked in any case: the engine may have finished it in a step whose result is not delivered yet
            orphans.add(req.rid)
            eng.abort(req)  # through a gateway it is cancelled upstream; without, the client's disconnect aborts it
            apply(policy.handle(TurnAborted(now, s.spec.sid)), now)
        backoff = sessions.timed_out(s)
        if backoff is None:
            left(s, now)
            return
        push(now + backoff, RETRY, (s, s.turn, s.attempt))

    def retry(s: _SimSession, now: float) -> None:
        turn = sessions.retry(s)
        s.attempt_sent = now
        assert timeout_s is not None
        push(now + timeout_s, TIMEOUT, (s, turn.index, turn.attempt))
        if s.req is None and policy.state_of(s.spec.sid) is SessionState.THINKING:  # cancelled: ask again
            apply(policy.handle(TurnRequested(now, s.spec.sid, turn.prompt_tokens, turn.output_tokens)), now)

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
                s: _SimSession = req.tag
                rec.turn(TurnRow(
                    s.spec.sid, s.spec.cohort, s.turn, s.t_req, s.sent, req.t_sched, req.t_first, req.t_end,
                    req.prompt, req.cached, req.generated, s.sent - s.t_req, req.preemptions, "ok", 0.0,
                ))  # fmt: skip
                s.req = None
                apply(
                    policy.handle(
                        TurnFinished(now, s.spec.sid, req.t_end - s.sent, req.prompt, req.cached, req.generated)
                    ),
                    now,
                )
                think = sessions.finish(s, now)
                if think is not None:
                    push(now + think, THINK, s)
                else:
                    left(s, now)
        elif kind == ARRIVE:
            sp: SessionSpec = payload
            s = _SimSession(sp, sessions.prompts_of(sp.shape))
            sessions.arrive(s)
            request_turn(s, now)
        elif kind == THINK:
            request_turn(payload, now)
        elif kind == SAMPLE:
            c = policy.counts()
            rec.sample(SampleRow(
                now, sessions.in_system, c["admitted"], c["parked"], c["waiting"], len(eng.running), len(eng.waiting),
                eng.usage(), sessions.demand, policy.demand, pool_tokens, eng.stats.preemptions,
            ))  # fmt: skip
        elif kind == FLUSH:
            # SGLang refuses to flush while requests run; retry every second, as the paper's driver did
            if eng.flush(preempt=True):
                flushed_at.append(now)
            else:
                flush_refusals += 1
                push(now + 1.0, FLUSH)
        elif kind == CONTROL:
            apply(policy.set_limit(now, cfg.make_control(pool_tokens)), now)
        elif kind == TIMER:
            timer_at = math.inf
            dl = policy.next_deadline()
            if dl is not None and dl <= now:
                apply(policy.handle(Timer(now)), now)
        elif kind in (TIMEOUT, RETRY):
            s, turn, attempt = payload
            if s.is_attempt(turn, attempt):  # else the turn finished meanwhile
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

    for row in sessions.rows():
        rec.session(row)
    tables = rec.tables()
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
        "client_timeouts": sessions.timeouts,
        "client_retries": sessions.retries_sent,
        "sessions_abandoned": sessions.abandoned,
        "sim_wall_s": time.perf_counter() - wall0,
    }
    from kvgate.analysis.summary import summarize_tables

    meta["summary"] = summarize_tables(meta, tables)
    meta["summary"]["wall_s"] = round(time.perf_counter() - wall0, 4)
    return SimResult(cfg, meta, tables)
