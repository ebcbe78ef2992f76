"""The in-process simulator of a fleet: N engine replicas, each with its own pool, behind one gateway and a router.

Events wait in three heaps merged in ``(time, seq)`` order: what reaches every replica (samples, flushes, control
timers, failures, the end), what may send some replica work (arrivals, think times' ends), and the replicas' step
ends. The sessions are :mod:`kvgate.workload.session`'s closed loop; one engine is a fleet of one.

Where a turn goes (the router stage, :mod:`kvgate.fleet.routers`) is decided when the session reaches its turn
boundary. Sticky routers (``consistent-hash``, ``prefix-affinity``, ``kvgate``) keep a session on one replica, so
each replica has its own policy: the control's budget D_r against C_r (the paper's parking rule, per replica).
Per-turn routers (``round-robin``, ``random``, ``least-loaded``) move a session between turns; their gateway runs
one policy over the fleet (its control sized to the live replicas' summed pools)::

    arrive -> [router: replica r] -> [gateway r: proceed | park] -> engine r -> turn done -> think -> ...

Fleet triggers: ``fail_at`` ("R@M": replica R fails at minute M: its in-flight turns fail and are recorded as
``error``, its cache is gone, its sessions are re-placed by the router and each agent re-sends its failed turn),
``join_at`` (a fresh replica joins at minute M), and the one-engine triggers (bursts, rate and mix changes on the
fleet's arrivals, a flush on every replica). With ``migrate_after_s`` the kvgate router moves a session parked
longer than that to a replica with headroom (it pays one miss there).

Engine steps: a replica's step (or decode jump) is bounded only by the first heap. The vLLM engine leaves a jump
pending (``Engine.step(..., defer=True)``), cut short (``settle``) when work is sent to that replica or its state
is read, as if that moment had been its horizon. So under a sticky router nothing of one replica reaches another:
each replica's records are bit for bit one engine's serving its sessions alone (``tests/sim/test_fleet_replay.py``).
SGLang's engine cannot defer: all its events wait in one heap. Deterministic per seed (the random router too).
"""

from __future__ import annotations

import gc
import heapq
import math
import time
from collections.abc import Sequence
from dataclasses import asdict, replace
from typing import Any

from kvgate import __version__
from kvgate.analysis.fleet import fleet_summary
from kvgate.analysis.summary import summarize_tables
from kvgate.engine.base import Engine, Request
from kvgate.engine.blocks import SeqKey
from kvgate.engine.factory import build_engine
from kvgate.fleet.routers import STICKY, Kvgate, PrefixAffinity, ReplicaView, make_router
from kvgate.policy import (
    Control,
    Park,
    Policy,
    Proceed,
    SessionEnded,
    SessionState,
    Timer,
    TurnAborted,
    TurnFinished,
    TurnRequested,
    make_control,
)
from kvgate.policy.limits import control_class
from kvgate.records import numpy_columns
from kvgate.sim.config import GROUP_ID, SimConfig, SimResult, validate
from kvgate.sim.fleet_records import FleetRecorder, without_replica
from kvgate.sim.replicas import FleetSession, Replica, replica_index
from kvgate.workload.arrivals import SessionSpec, generate
from kvgate.workload.session import Sessions, Turn

ARRIVE, THINK, STEP, SAMPLE, FLUSH, CONTROL, TIMER, END, TIMEOUT, RETRY, FAIL, JOIN, MIGRATE = range(13)
HELD = (SessionState.PARKED, SessionState.WAITING)


def simulate_fleet(cfg: SimConfig, sessions_in: Sequence[SessionSpec] | None = None) -> SimResult:
    """Run one simulated fleet (one replica and no fleet trigger is a run of one engine, recorded as such).

    ``sessions_in`` replaces the sessions the config would draw (its arrival rate, bursts and rate changes are then
    unused): e.g. the sessions one replica of a fleet served, replayed on one engine.

    The cyclic collector is off while the loop runs: what it allocates is freed by reference counting (a 90-minute
    run of 4 replicas leaves ~2,000 objects in cycles, collected afterwards), and each collection would walk every
    live session, request and pool entry, a cost that grows with the fleet (docs/benchmarks.md)."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        return _simulate(cfg, sessions_in)
    finally:
        if enabled:
            gc.enable()


def _simulate(cfg: SimConfig, sessions_in: Sequence[SessionSpec] | None) -> SimResult:
    wall0 = time.perf_counter()
    wl = validate(cfg)
    horizon = cfg.horizon_s
    if sessions_in is None:
        specs = generate(wl, cfg.lam, horizon, cfg.seed, cfg.parsed_bursts(), cfg.parsed_rates())
    else:
        specs = sorted(sessions_in, key=lambda sp: (sp.arrival_s, sp.sid))
    router = make_router(cfg.router, cfg.seed)
    sticky = cfg.router in STICKY
    pools = cfg.pools()
    reps = [Replica(i, p) for i, p in enumerate(pools)]
    one_pool = not cfg.replica_pools

    def engine_for(r: Replica) -> Engine:
        return build_engine(cfg if one_pool else replace(cfg, kv_pool=r.pool))

    def control_for(pool: int, now: float) -> Any:
        on = cfg.control_at is None or now >= cfg.control_at * 60.0
        return cfg.make_control(pool) if on else make_control("none", pool)

    shared: Policy | None = None
    for r in reps[: cfg.replicas]:
        eng = engine_for(r)
        if sticky:
            r.start(eng, Policy(control=control_for(eng.kv_pool, 0.0)))
        else:
            r.start(eng, None)  # type: ignore[arg-type]
    if not sticky:
        shared = Policy(control=control_for(sum(r.engine.kv_pool for r in reps if r.engine), 0.0))
        for r in reps[: cfg.replicas]:
            r.policy = shared
    kv_pool = sum(r.engine.kv_pool for r in reps if r.engine)
    measured = control_class(cfg.control).needs_residency  # budgeter-resident: the pool's residency feeds it
    block_size = reps[0].engine.block_size  # type: ignore[union-attr]
    rec = FleetRecorder()
    sessions = Sessions(cfg.agent_retries())
    by_sid: dict[int, FleetSession] = {}
    heap: list[tuple[float, int, int, Any]] = []
    alone = len(reps) == 1
    # Engines that can leave a jump pending (vLLM's): arrivals and think times' ends, and step ends, wait in heaps
    # of their own and bound no step (see the module's docstring); otherwise (SGLang's) one heap bounds every step.
    defer = reps[0].engine.defers_jumps  # type: ignore[union-attr]
    routed: list[tuple[float, int, int, Any]] = [] if defer else heap
    steps: list[tuple[float, int, int, Any]] = [] if defer else heap
    seq = 0

    def push(t: float, kind: int, payload: Any = None) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(heap, (t, seq, kind, payload))

    def push_routed(t: float, kind: int, payload: Any) -> None:
        nonlocal seq
        seq += 1
        heapq.heappush(routed, (t, seq, kind, payload))

    for sp in specs:
        push_routed(sp.arrival_s, ARRIVE, sp)
    t = 0.0
    while t <= horizon:
        push(t, SAMPLE)
        t += cfg.sample_s
    if cfg.flush_at is not None:
        push(cfg.flush_at * 60.0, FLUSH)
    if cfg.control_at is not None:
        push(cfg.control_at * 60.0, CONTROL)
    push(horizon, END)
    for rep, minute in cfg.parsed_failures():
        push(minute * 60.0, FAIL, rep)
    for k, minute in enumerate(cfg.join_at):
        push(minute * 60.0, JOIN, cfg.replicas + k)

    flushed_at: list[float] = []
    failed_at: list[tuple[int, float]] = []
    joined_at: list[tuple[int, float]] = []
    flush_refusals = migrations = dead_steps = rid_counter = 0
    dead_parks: dict[int, int] = {}
    timer_at: dict[int, float] = {}
    group_blocks: dict[int, int] = {}
    seen: dict[int, int] = {}  # per replica: its pool's evictions when its held sessions were last reconsidered
    timeout_s = cfg.client_timeout_s
    migrate_s = cfg.migrate_after_s
    orphans: set[int] = set()
    needs_demand = isinstance(router, Kvgate) and not alone  # one replica: the router has no choice to make
    needs_usage = isinstance(router, PrefixAffinity) and not alone

    def resident(sid: Any) -> int | None:
        """``sid``'s resident prefix on its replica (its next turn's hit there, as KV events would tell a gateway)."""
        s = by_sid.get(sid)
        rep = reps[s.replica] if s is not None and s.replica >= 0 else None
        if rep is None or not rep.up:
            return None
        settle(rep, now)  # (now: the event being handled)
        return rep.engine.pool.lookup(seq_key(s), 1 << 40)  # type: ignore[union-attr, arg-type]

    def recheck(rep: Replica, now: float) -> None:
        """Held sessions are reconsidered once the replica's cache lost blocks (a measured budget may admit)."""
        pol, evicted = rep.policy, rep.engine.pool.evictions  # type: ignore[union-attr]
        if evicted != seen.get(rep.index, 0) and pol is not None:
            seen[rep.index] = evicted
            if pol.parked_order() or pol.waiting_order():
                apply(pol.handle(Timer(now)), now)

    for pol in {id(r.policy): r.policy for r in reps if measured and r.policy is not None}.values():
        pol.residency = resident

    def settle(rep: Replica, now: float) -> None:
        """Cut ``rep``'s pending jump, if any, at ``now`` (something reaches the replica): its step ends with the
        step containing ``now``, as if ``now`` had been the jump's horizon."""
        if rep.pending is None:
            return
        start, sq, planned = rep.pending
        rep.pending = None
        res = rep.engine.settle(now)  # type: ignore[union-attr]
        if res.steps != planned:  # the step ends earlier: the event already queued for it is stale
            rep.gen += 1
            heapq.heappush(steps, (start + res.duration, sq, STEP, (rep, rep.gen, res)))

    def seq_key(s: FleetSession) -> SeqKey:
        gb = group_blocks.get(s.spec.shape.shared_tokens)
        if gb is None:
            gb = group_blocks[s.spec.shape.shared_tokens] = s.spec.shape.shared_tokens // block_size
        return SeqKey(GROUP_ID, gb, s.spec.sid)

    def views(now: float) -> list[ReplicaView]:
        if needs_usage:  # KV usage is read now: jumps left pending are cut here
            for r in reps:
                settle(r, now)
        return [r.view(needs_usage, needs_demand) for r in reps]

    def place(s: FleetSession, now: float) -> Replica:
        """The router stage: the replica of ``s``'s current turn (membership follows)."""
        if (sticky or alone) and s.replica >= 0 and reps[s.replica].up:  # where the router keeps it (migrate()
            return reps[s.replica]  # moves both); one replica alone leaves the router no other choice
        at = router.replica_of(s.spec.sid) if sticky else None
        if at is None or not reps[at].up:
            at = router.route(s.spec.sid, views(now))
        if at != s.replica:
            if s.replica >= 0:
                reps[s.replica].members.pop(s.spec.sid, None)
            reps[at].members[s.spec.sid] = s
            s.replica = at
        return reps[at]

    def report(rep: Replica, sid: int, status: str, now: float) -> None:
        """The session's status, to an engine that tracks sessions (it may change its pool)."""
        settle(rep, now)
        rep.status(sid, status)

    def send(s: FleetSession, rep: Replica, now: float) -> None:
        nonlocal rid_counter
        rid_counter += 1
        k = s.turn  # the current turn (as s.current(), without building it)
        req = Request(rid_counter, seq_key(s), s.prompts[k], s.spec.shape.outputs[k], now, s)
        s.req = req
        s.sent = now
        s.mark_sent(now)
        settle(rep, now)
        rep.engine.add(req)  # type: ignore[union-attr]
        rep.in_flight += 1
        if not rep.wake:
            rep.wake = True
            woken.append(rep)

    def apply(decisions: list[Any], now: float) -> None:
        for d in decisions:
            s = by_sid[d.session]
            rep = reps[s.replica]
            if type(d) is Proceed:
                if not rep.up:  # a per-turn router's turn held for a replica that failed meanwhile
                    rep = place(s, now)
                if rep.status is not None:
                    report(rep, d.session, "admitted", now)
                send(s, rep, now)
            else:
                assert type(d) is Park
                if rep.status is not None:
                    report(rep, d.session, "parked", now)
                s.parks += 1
                if migrate_s is not None:
                    push(now + migrate_s, MIGRATE, (s, s.parks))

    def ask(s: FleetSession, now: float, turn: Turn | None = None) -> None:
        """``s`` asks the gateway of its replica for its current turn."""
        turn = turn or s.current()
        rep = place(s, now)
        s.policy = rep.policy
        pol: Policy = rep.policy  # type: ignore[assignment]
        apply(pol.handle(TurnRequested(now, s.spec.sid, turn.prompt_tokens, turn.output_tokens)), now)

    def request_turn(s: FleetSession, now: float) -> None:
        turn = sessions.request(s)
        s.t_req = now
        if timeout_s is not None:
            s.attempt_sent = now
            push(now + timeout_s, TIMEOUT, (s, turn.index, 0, s.epoch))
        ask(s, now, turn)

    def left(s: FleetSession, now: float) -> None:
        rep = reps[s.replica]
        if rep.status is not None:
            report(rep, s.spec.sid, "ended", now)
        pol = s.policy
        decisions = pol.handle(SessionEnded(now, s.spec.sid)) if pol is not None else []
        rep.members.pop(s.spec.sid, None)
        router.forget(s.spec.sid)
        apply(decisions, now)

    turn_rows, turn_replicas = rec.cols["turns"].rows, rec.replica_of["turns"]  # rec keeps no files: rows alone

    def turn_at(s: FleetSession, req: Request, t_req: float, end: float, cached: int | None, st: str, at: int) -> None:
        """The turns row of ``s``'s current attempt ``req``, which ran on replica ``at``."""
        # a TurnRow's values in its order, as a plain tuple: the collector untracks a tuple of scalars, not a
        # named tuple, and a run keeps thousands of rows (each one kept tracked costs every collection after it)
        turn_rows.append((
            s.spec.sid, s.spec.cohort, s.turn, t_req, s.sent, req.t_sched, req.t_first, end, req.prompt, cached,
            req.generated, s.sent - s.t_req, req.preemptions, st, 0.0,
        ))
        turn_replicas.append(at)

    def timed_out(s: FleetSession, now: float) -> None:
        req = s.req
        if req is not None:
            turn_at(s, req, s.attempt_sent, now, None, "aborted", s.replica)
            s.req = None
            orphans.add(req.rid)
            rep = reps[s.replica]
            settle(rep, now)
            rep.in_flight -= 1
            rep.engine.abort(req)  # type: ignore[union-attr]
            apply(s.policy.handle(TurnAborted(now, s.spec.sid)), now)  # type: ignore[union-attr]
        backoff = sessions.timed_out(s)
        if backoff is None:
            left(s, now)
            return
        push(now + backoff, RETRY, (s, s.turn, s.attempt, s.epoch))

    def retry(s: FleetSession, now: float) -> None:
        turn = sessions.retry(s)
        s.attempt_sent = now
        assert timeout_s is not None
        push(now + timeout_s, TIMEOUT, (s, turn.index, turn.attempt, s.epoch))
        pol = s.policy
        if s.req is None and (pol is None or pol.state_of(s.spec.sid) is SessionState.THINKING):
            ask(s, now)

    def fail(rep: Replica, now: float) -> None:
        """Replica ``rep`` fails: its in-flight turns fail, its cache and gateway state go, its sessions move."""
        nonlocal dead_steps
        eng, pol = rep.engine, rep.policy
        assert eng is not None and pol is not None
        settle(rep, now)  # the steps it ran before it failed count
        rep.up, rep.busy, rep.wake, rep.engine, rep.in_flight = False, False, False, None, 0
        rep.gen += 1
        failed_at.append((rep.index, now))
        dead_steps += eng.stats.steps
        members = list(rep.members.values())
        resend = [s for s in members if s.req is not None]
        for s in resend:
            turn_at(s, s.req, s.t_req, now, None, "error", rep.index)  # type: ignore[arg-type]
            s.req = None
            s.epoch += 1
        if shared is None:
            dead_parks[rep.index] = pol.parks
            order = {sid: k for k, sid in enumerate(pol.parked_order() + pol.waiting_order())}
            held = sorted((s for s in members if s.req is None and s.spec.sid in order and
                           pol.state_of(s.spec.sid) in HELD), key=lambda s: order[s.spec.sid])
            for s in members:
                s.policy = None
            rep.policy = None
            for s in resend:
                request_turn(s, now)
            for s in held:
                ask(s, now)
            for s in members:  # thinking: placed now, known to their new gateway at their next turn
                if s.replica == rep.index and not s.left:
                    place(s, now)
            return
        resize_shared(now)
        for s in resend:
            apply(shared.handle(TurnAborted(now, s.spec.sid)), now)
            request_turn(s, now)
        for s in members:
            if s.replica == rep.index and not s.left:
                place(s, now)

    def resize_shared(now: float) -> None:
        """A per-turn router's one policy: its control sized to the live replicas' pools."""
        if shared is not None and cfg.control != "none":
            live = sum(r.pool for r in reps if r.up)
            apply(shared.set_control(now, control_for(live, now)), now)

    def join(rep: Replica, now: float) -> None:
        eng = engine_for(rep)
        rep.start(eng, Policy(control=control_for(eng.kv_pool, now), now=now) if shared is None else shared)
        if measured:
            rep.policy.residency = resident  # type: ignore[union-attr]
        joined_at.append((rep.index, now))
        woken.append(rep)
        resize_shared(now)

    def migrate(s: FleetSession, parks: int, now: float) -> None:
        """A session held since its ``parks``-th park: move it to a replica with headroom, if one has it."""
        nonlocal migrations
        pol = s.policy
        if s.left or s.parks != parks or pol is None or pol.state_of(s.spec.sid) not in HELD:
            return
        assert isinstance(router, Kvgate) and migrate_s is not None
        target = router.migration_target(s.spec.sid, s.demand, views(now))
        if target is None:
            push(now + migrate_s, MIGRATE, (s, parks))
            return
        migrations += 1
        old = reps[s.replica]
        if old.status is not None:
            report(old, s.spec.sid, "ended", now)
        decisions = pol.handle(SessionEnded(now, s.spec.sid))
        pol.forget(s.spec.sid)  # it may come back later, as a new session there
        router.move(s.spec.sid, target)
        old.members.pop(s.spec.sid, None)
        reps[target].members[s.spec.sid] = s
        s.replica = target
        apply(decisions, now)
        ask(s, now)

    def sample(rep: Replica, now: float) -> None:
        settle(rep, now)
        books = sessions if len(reps) == 1 else None
        rec.sample_at(rep.sample_row(now, books, shared is not None and len(reps) > 1), rep.index)

    def timed_policies() -> list[Policy]:
        """The live policies whose control has timers (the others never need a TIMER event)."""
        live = [shared] if shared is not None else [r.policy for r in reps if r.up and r.policy is not None]
        return [p for p in live if p is not None and type(p.control).next_deadline is not Control.next_deadline]

    def look(rep: Replica, now: float) -> None:
        """``rep`` was woken: if it is idle with work, its next step (or jump) starts now."""
        nonlocal seq
        eng = rep.engine
        if not (rep.up and not rep.busy and eng.has_work()):  # type: ignore[union-attr]
            rep.wake = False  # until work arrives or its step ends
            return
        res = eng.step(now, heap[0][0] if heap else math.inf, defer)  # type: ignore[union-attr]
        if res.steps and res.duration > 0:
            rep.busy = True
            rep.wake = False
            seq += 1
            heapq.heappush(steps, (now + res.duration, seq, STEP, (rep, rep.gen, res)))
            if res.deferred:
                rep.pending = (now, seq, res.steps)
        else:  # it stays awake: work it could not start may start later (pins expire, a load completes)
            woken.append(rep)

    timed = timed_policies()
    woken: list[Replica] = [r for r in reps if r.wake]
    """Replicas to look at after the event, in index order (as a scan of every replica would)."""
    now = 0.0
    while True:
        src: list[Any] | None = heap if heap else None
        if defer:
            if routed and (src is None or routed[0] < src[0]):
                src = routed
            if steps and (src is None or steps[0] < src[0]):
                src = steps
        if src is None:
            break
        now, _, kind, payload = heapq.heappop(src)
        if now > horizon:
            break
        if kind == STEP:
            rep, gen, payload = payload
            if gen != rep.gen:  # the replica failed meanwhile (its results never arrive), or its jump was cut
                continue
            if rep.pending is not None:  # its jump ran whole
                rep.pending = None
                payload = rep.engine.settle()  # type: ignore[union-attr]
            rep.busy = False
            if not rep.wake:
                rep.wake = True
                woken.append(rep)
            for req in payload.finished:
                if orphans and req.rid in orphans:
                    orphans.discard(req.rid)
                    continue
                s: FleetSession = req.tag
                rep.in_flight -= 1
                turn_at(s, req, s.t_req, req.t_end, req.cached, "ok", rep.index)
                s.req = None
                ev = TurnFinished(now, s.spec.sid, req.t_end - s.sent, req.prompt, req.cached, req.generated)
                apply(s.policy.handle(ev), now)  # type: ignore[union-attr]
                think = sessions.finish(s, now)
                if think is not None:
                    push_routed(now + think, THINK, s)
                else:
                    left(s, now)
            if measured:
                recheck(rep, now)
        elif kind == ARRIVE:
            sp: SessionSpec = payload
            s = by_sid[sp.sid] = FleetSession(sp, sessions.prompts_of(sp.shape))
            sessions.arrive(s)
            request_turn(s, now)
        elif kind == THINK:
            request_turn(payload, now)
        elif kind == SAMPLE:
            for rep in reps:
                if rep.up:
                    sample(rep, now)
        elif kind == FLUSH:
            for rep in reps if payload is None else [reps[payload]]:
                if not rep.up:
                    continue
                if not rep.wake:  # a flush may put preempted requests back to wait
                    rep.wake = True
                    woken.append(rep)
                settle(rep, now)
                if rep.engine.flush(preempt=True):  # type: ignore[union-attr]
                    flushed_at.append(now)
                    if measured:
                        seen[rep.index] = -1
                        recheck(rep, now)
                else:  # SGLang refuses while requests run; retry every second, as the paper's driver did
                    flush_refusals += 1
                    push(now + 1.0, FLUSH, rep.index)
        elif kind == CONTROL:
            if shared is not None:
                apply(shared.set_control(now, cfg.make_control(sum(r.pool for r in reps if r.up))), now)
            for rep in reps:
                if rep.up and shared is None and rep.policy is not None:
                    apply(rep.policy.set_control(now, cfg.make_control(rep.pool)), now)
        elif kind == TIMER:
            pol = payload
            timer_at[id(pol)] = math.inf
            dl = pol.next_deadline()
            if dl is not None and dl <= now and any(r.up and r.policy is pol for r in reps):
                apply(pol.handle(Timer(now)), now)
        elif kind in (TIMEOUT, RETRY):
            s, turn, attempt, epoch = payload
            if s.epoch == epoch and s.is_attempt(turn, attempt):
                (timed_out if kind == TIMEOUT else retry)(s, now)
        elif kind == FAIL:
            if reps[payload].up:
                fail(reps[payload], now)
        elif kind == JOIN:
            join(reps[payload], now)
        elif kind == MIGRATE:
            migrate(payload[0], payload[1], now)
        elif kind == END:
            break
        if kind in (CONTROL, FAIL, JOIN):
            timed = timed_policies()
        for pol in timed:
            dl = pol.next_deadline()
            if dl is not None and dl < timer_at.get(id(pol), math.inf):
                timer_at[id(pol)] = max(dl, now)
                push(timer_at[id(pol)], TIMER, pol)
        if woken:
            if len(woken) == 1:
                look(woken.pop(), now)
            else:
                batch = sorted(woken, key=replica_index)
                woken.clear()
                for rep in batch:
                    if rep.wake:
                        look(rep, now)

    for rep in reps:  # a jump that runs past the end counts whole, as one not left pending does
        if rep.pending is not None:
            rep.pending = None
            rep.engine.settle()  # type: ignore[union-attr]
    for sid in sorted(sessions):
        s = sessions[sid]
        rec.session_at(s.row(), s.replica)  # type: ignore[attr-defined]
    tables = rec.tables()
    live = [r for r in reps if r.up]
    pols = [r.policy for r in live] if shared is None else [shared]
    replica_parks = dict(dead_parks)
    if shared is None:
        replica_parks.update({r.index: r.policy.parks for r in live})  # type: ignore[union-attr]
    meta: dict[str, Any] = {
        "kvgate_version": __version__,
        "kind": "sim",
        "config": asdict(cfg),
        "seed": cfg.seed,
        "kv_pool": kv_pool,
        "engine_steps": dead_steps + sum(r.engine.stats.steps for r in live),  # type: ignore[union-attr]
        "parks": sum(dead_parks.values()) + sum(p.parks for p in pols if p is not None),
        "flushed_at_s": flushed_at,
        "flush_refusals": flush_refusals,
        "client_timeouts": sessions.timeouts,
        "client_retries": sessions.retries_sent,
        "sessions_abandoned": sessions.abandoned,
        "sim_wall_s": time.perf_counter() - wall0,
    }
    if cfg.is_fleet:
        meta.update({
            "replica_pools": pools, "replica_parks": {str(k): v for k, v in sorted(replica_parks.items())},
            "failed_at": failed_at, "joined_at": joined_at, "migrations": migrations,
        })
    if cfg.is_fleet:
        cols = {k: numpy_columns(v) for k, v in tables.items()}
        meta["summary"] = fleet_summary(meta, cols["turns"], cols["sessions"], cols["samples"])
    else:  # a one-engine run, recorded as the one-engine simulator records it
        tables = without_replica(tables)
        meta["summary"] = summarize_tables(meta, tables)
    meta["summary"]["wall_s"] = round(time.perf_counter() - wall0, 4)
    return SimResult(cfg, meta, tables)
