"""The in-process simulator of a fleet: N engine replicas, each with its own pool, behind one gateway and a router.

:class:`FleetSim` is the event loop (:class:`kvgate.sim.loop.EventLoop`) with one handler per kind of event; its
state is its attributes. The sessions are :mod:`kvgate.workload.session`'s closed loop; one engine is a fleet of one.

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

Engine steps: a replica's step (or decode jump) is bounded only by the events that reach every replica. The vLLM
engine leaves a jump pending (``Engine.step(..., defer=True)``), cut short (:meth:`FleetSim.settle`) when work is
sent to that replica or its state is read, as if that moment had been its horizon. So under a sticky router nothing
of one replica reaches another: each replica's records are bit for bit one engine's serving its sessions alone
(``tests/sim/test_fleet_replay.py``). SGLang's engine cannot defer: all its events wait in one heap. Deterministic
per seed (the random router too).
"""

from __future__ import annotations

import gc
import heapq
import math
import time
from collections.abc import Sequence
from typing import Any

from kvgate.engine.base import Request, StepResult
from kvgate.fleet.core import Fleet
from kvgate.fleet.routers import make_router
from kvgate.policy import (
    Park,
    Policy,
    Proceed,
    SessionEnded,
    SessionState,
    Timer,
    TurnAborted,
    TurnFinished,
)
from kvgate.policy.core import Decision
from kvgate.policy.limits import control_class
from kvgate.sim.config import SimConfig, SimResult, validate
from kvgate.sim.engines import EngineLoop
from kvgate.sim.fleet_records import FleetRecorder, result
from kvgate.sim.replicas import FleetSession, SimReplica
from kvgate.workload.arrivals import SessionSpec, generate
from kvgate.workload.session import Sessions
from kvgate.workload.shapes import Workload
from kvgate.workload.triggers import triggers_of

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
        wall0 = time.perf_counter()
        sim = FleetSim(cfg, sessions_in)
        sim.run(cfg.horizon_s)
        return result(sim, wall0)
    finally:
        if enabled:
            gc.enable()


class FleetSim(EngineLoop):
    """One simulated run: its replicas, sessions, policies and records. ``run(until)``, then read the records."""

    def __init__(self, cfg: SimConfig, sessions_in: Sequence[SessionSpec] | None = None) -> None:
        wl = validate(cfg)
        super().__init__(cfg)
        self.fleet = fleet = Fleet(self.reps, make_router(cfg.router, cfg.seed))
        fleet.driver = self
        if cfg.control_at is None or cfg.control_at <= 0:
            fleet.active = (cfg.control, cfg.control_opts())
        self.measured = control_class(cfg.control).needs_residency  # budgeter-resident: the pools' residency feeds it
        if self.measured:
            fleet.residency = self.resident
        if fleet.router.reads_kv_usage:
            fleet.refresh = self.refresh_usage
        fleet.tenancy = cfg.tenancy()
        fleet.start(0.0)
        self.kv_pool = fleet.live_pool()
        self.rec = FleetRecorder()
        self.turn_rows, self.turn_replicas = self.rec.cols["turns"].rows, self.rec.replica_of["turns"]
        self.sessions = Sessions(cfg.agent_retries())
        self.by_sid: dict[int, FleetSession] = {}
        self.flushed_at: list[float] = []
        self.failed_at: list[tuple[int, float]] = []
        self.joined_at: list[tuple[int, float]] = []
        self.flush_refusals = self.migrations = self.dead_steps = self.rid_counter = 0
        self.timer_at: dict[int, float] = {}
        self.seen: dict[int, int] = {}
        """Per replica: its pool's evictions when its held sessions were last reconsidered."""
        self.timeout_s = cfg.client_timeout_s
        self.migrate_s = cfg.migrate_after_s
        self.orphans: set[int] = set()
        self.on_step_end = self.on_step_end  # bound once: every step's (and think time's) event carries it
        self.request_turn = self.request_turn  # type: ignore[method-assign]
        self.timed = fleet.timed_policies()
        schedule(self, wl, sessions_in)

    # -- what follows every event: the control's timers (then the replicas woken: EngineLoop.after) ----------------
    def timers(self, now: float) -> None:
        """A timer event for every live policy whose control's next deadline came sooner."""
        for pol in self.timed:
            dl = pol.next_deadline()
            if dl is not None and dl < self.timer_at.get(id(pol), math.inf):
                self.timer_at[id(pol)] = max(dl, now)
                self.push(self.timer_at[id(pol)], self.on_timer, pol)

    # -- the handlers, one per kind of event -------------------------------------------------------------------
    def on_arrive(self, sp: SessionSpec, now: float) -> None:
        s = self.by_sid[sp.sid] = FleetSession(sp, self.sessions.prompts_of(sp.shape))
        s.key = self.seq_key(s)
        self.sessions.arrive(s)
        self.request_turn(s, now)

    def on_step_end(self, payload: tuple[SimReplica, int, StepResult], now: float) -> None:
        """A replica's step (or jump) ended: its finished turns go back to their sessions."""
        rep, gen, res = payload
        if gen != rep.gen:  # the replica failed meanwhile (its results never arrive), or its jump was cut
            return
        if rep.pending is not None:  # its jump ran whole
            rep.pending = None
            res = rep.engine.settle()  # type: ignore[union-attr]
        rep.busy = False
        if not rep.wake:
            rep.wake = True
            self.woken.append(rep)
        orphans, sessions, rows = self.orphans, self.sessions, self.turn_rows
        for req in res.finished:
            if orphans and req.rid in orphans:
                orphans.discard(req.rid)
                continue
            s: FleetSession = req.tag  # type: ignore[assignment]
            rep.in_flight -= 1
            sp, end = s.spec, req.t_end
            rows.append((  # (turn_at()'s row, inline: the hot path)
                sp.sid, sp.cohort, s.turn, s.t_req, s.sent, req.t_sched, req.t_first, end, req.prompt, req.cached,
                req.generated, s.sent - s.t_req, req.preemptions, "ok", 0.0,
            ))
            self.turn_replicas.append(rep.index)
            s.req = None
            ev = TurnFinished(now, sp.sid, end - s.sent, req.prompt, req.cached, req.generated)
            released = s.policy.handle(ev)  # type: ignore[union-attr]
            if released:
                self.apply(released, now)
            think = sessions.finish(s, now)
            if think is not None:
                self.seq += 1
                heapq.heappush(self.routed, (now + think, self.seq, self.request_turn, s))
            else:
                self.left(s, now)
        if self.measured:
            self.recheck(rep, now)

    def on_sample(self, _: None, now: float) -> None:
        books = self.sessions if self.fleet.single else None
        for rep in self.reps:
            if rep.up:
                self.settle(rep, now)
                self.rec.sample_at(rep.sample_row(now, books, self.fleet.counts_of(rep)), rep.index)

    def on_flush(self, which: int | None, now: float) -> None:
        for rep in self.reps if which is None else [self.reps[which]]:
            if not rep.up:
                continue
            if not rep.wake:  # a flush may put preempted requests back to wait
                rep.wake = True
                self.woken.append(rep)
            self.settle(rep, now)
            if rep.engine.flush(preempt=True):  # type: ignore[union-attr]
                self.flushed_at.append(now)
                if self.measured:
                    self.seen[rep.index] = -1
                    self.recheck(rep, now)
            else:  # SGLang refuses while requests run; retry every second, as the paper's driver did
                self.flush_refusals += 1
                self.push(now + 1.0, self.on_flush, rep.index)

    def on_control(self, _: None, now: float) -> None:
        self.apply(self.fleet.set_control(now, self.cfg.control, self.cfg.control_opts()), now)
        self.timed = self.fleet.timed_policies()

    def on_timer(self, pol: Policy, now: float) -> None:
        self.timer_at[id(pol)] = math.inf
        dl = pol.next_deadline()
        if dl is not None and dl <= now and self.fleet.is_live(pol):
            self.apply(pol.handle(Timer(now)), now)

    def on_timeout(self, key: tuple[FleetSession, int, int, int], now: float) -> None:
        """The agent's attempt ``key`` timed out (if it is still the live one): abandoned, then retried or given up."""
        s, turn, attempt, epoch = key
        if s.epoch != epoch or not s.is_attempt(turn, attempt):
            return
        req = s.req
        if req is not None:
            rep: SimReplica = s.replica  # type: ignore[assignment]
            self.turn_at(s, req, s.attempt_sent, now, None, "aborted", rep.index)
            s.req = None
            self.orphans.add(req.rid)
            self.settle(rep, now)
            rep.in_flight -= 1
            rep.engine.abort(req)  # type: ignore[union-attr]
            self.apply(s.policy.handle(TurnAborted(now, s.spec.sid)), now)  # type: ignore[union-attr]
        backoff = self.sessions.timed_out(s)
        if backoff is None:
            self.left(s, now)
            return
        self.push(now + backoff, self.on_retry, (s, s.turn, s.attempt, s.epoch))

    def on_retry(self, key: tuple[FleetSession, int, int, int], now: float) -> None:
        """The backoff of attempt ``key`` is over (if it is still the live one): the agent sends its turn again."""
        s, turn, attempt, epoch = key
        if s.epoch != epoch or not s.is_attempt(turn, attempt):
            return
        turn_again = self.sessions.retry(s)
        s.attempt_sent = now
        assert self.timeout_s is not None
        self.push(now + self.timeout_s, self.on_timeout, (s, turn_again.index, turn_again.attempt, s.epoch))
        pol = s.policy
        if s.req is None and (pol is None or pol.state_of(s.spec.sid) is SessionState.THINKING):
            self.ask(s, now)

    def on_fail(self, index: int, now: float) -> None:
        """Replica ``index`` fails: its engine's steps so far count, then the fleet's books move its sessions."""
        rep = self.reps[index]
        if rep.up:
            self.settle(rep, now)
            self.dead_steps += rep.stop().stats.steps
            self.failed_at.append((index, now))
            self.fleet.fail(rep, now)
        self.timed = self.fleet.timed_policies()

    def on_join(self, index: int, now: float) -> None:
        """A fresh replica joins (its engine, then its books)."""
        rep = self.reps[index]
        rep.start(self.engine_for(rep))
        self.joined_at.append((index, now))
        self.woken.append(rep)
        self.fleet.revive(rep, now)
        self.timed = self.fleet.timed_policies()

    def on_migrate(self, key: tuple[FleetSession, int], now: float) -> None:
        """A session held since its ``parks``-th park moves to a replica with headroom, if one has it."""
        s, parks = key
        pol = s.policy
        if s.left or s.parks != parks or pol is None or pol.state_of(s.spec.sid) not in HELD:
            return
        assert self.migrate_s is not None
        target = self.fleet.migration_target(s)
        if target is None:
            self.push(now + self.migrate_s, self.on_migrate, (s, parks))
            return
        self.migrations += 1
        old = s.replica
        assert old is not None
        if old.status is not None:
            self.report(old, s.spec.sid, "ended", now)
        self.apply(self.fleet.move(s, target, now), now)
        self.ask(s, now)

    def on_end(self, _: None, now: float) -> None:
        self.stop()

    # -- a session's turns -----------------------------------------------------------------------------------
    def request_turn(self, s: FleetSession, now: float) -> None:
        turn = self.sessions.request(s)
        s.t_req = now
        if self.timeout_s is not None:
            s.attempt_sent = now
            self.push(now + self.timeout_s, self.on_timeout, (s, turn.index, 0, s.epoch))
        self.apply(self.fleet.ask(s, now, turn.prompt_tokens, turn.output_tokens, s.spec.tenant), now)

    def ask(self, s: FleetSession, now: float) -> None:
        """``s`` asks the gateway of its replica for its current turn (again)."""
        turn = s.current()
        self.apply(self.fleet.ask(s, now, turn.prompt_tokens, turn.output_tokens, s.spec.tenant), now)

    def apply(self, decisions: list[Decision], now: float) -> None:
        """The policies' decisions: a turn let proceed is sent to its replica's engine; a held one waits."""
        for d in decisions:
            s = self.by_sid[d.session]  # type: ignore[index]
            rep: SimReplica = s.replica  # type: ignore[assignment]
            if type(d) is Proceed:
                if not rep.up:  # a per-turn router's turn held for a replica that failed meanwhile
                    rep = self.fleet.place(s)  # type: ignore[assignment]
                if rep.status is not None:
                    self.report(rep, d.session, "admitted", now)  # type: ignore[arg-type]
                self.send(s, rep, now)
            else:
                assert type(d) is Park
                if rep.status is not None:
                    self.report(rep, d.session, "parked", now)  # type: ignore[arg-type]
                s.parks += 1
                if self.migrate_s is not None:
                    self.push(now + self.migrate_s, self.on_migrate, (s, s.parks))

    def send(self, s: FleetSession, rep: SimReplica, now: float) -> None:
        self.rid_counter += 1
        k = s.turn  # the current turn (as s.current(), without building it)
        req = Request(self.rid_counter, s.key, s.prompts[k], s.spec.shape.outputs[k], now, s)
        s.req = req
        s.sent = now
        s.mark_sent(now)
        rep.in_flight += 1
        if self.request_time is not None:  # its way to the engine's queue (the profile's)
            self.push_routed(now + self.request_time(req.prompt), self.on_reach, (s, req, rep, rep.engine))
            return
        self.reach(rep, req, now)

    def on_reach(self, payload: tuple[FleetSession, Request, SimReplica, Any], now: float) -> None:
        """A request sent earlier reaches its engine's queue, unless it was given up or its replica failed since."""
        s, req, rep, engine = payload
        if s.req is req and rep.engine is engine:
            self.reach(rep, req, now)
        else:
            self.orphans.discard(req.rid)

    def left(self, s: FleetSession, now: float) -> None:
        rep: SimReplica = s.replica  # type: ignore[assignment]
        if rep.status is not None:
            self.report(rep, s.spec.sid, "ended", now)
        pol = s.policy
        decisions = pol.handle(SessionEnded(now, s.spec.sid)) if pol is not None else []
        self.fleet.leave(s)
        if decisions:
            self.apply(decisions, now)

    def turn_at(self, s: FleetSession, req: Request, t_req: float, end: float, cached: int | None, st: str,
                at: int) -> None:
        """The turns row of ``s``'s current attempt ``req``, which ran on replica ``at``."""
        # a TurnRow's values in its order, as a plain tuple: the collector untracks a tuple of scalars, not a
        # named tuple, and a run keeps thousands of rows (each one kept tracked costs every collection after it)
        self.turn_rows.append((
            s.spec.sid, s.spec.cohort, s.turn, t_req, s.sent, req.t_sched, req.t_first, end, req.prompt, cached,
            req.generated, s.sent - s.t_req, req.preemptions, st, 0.0,
        ))
        self.turn_replicas.append(at)

    # -- what the engines tell the policies (a session's resident prefix: EngineLoop.resident) ------------------------
    def recheck(self, rep: SimReplica, now: float) -> None:
        """Held sessions are reconsidered once the replica's cache lost blocks (a measured budget may admit)."""
        pol, evicted = rep.policy, rep.engine.pool.evictions  # type: ignore[union-attr]
        if evicted != self.seen.get(rep.index, 0) and pol is not None:
            self.seen[rep.index] = evicted
            if pol.parked_order() or pol.waiting_order():
                self.apply(pol.handle(Timer(now)), now)

    # -- the fleet's driver (:class:`kvgate.fleet.core.Driver`) ---------------------------------------------------
    def turn_failed(self, s: FleetSession, now: float) -> None:
        """``s``'s turn was in flight on a replica that failed: recorded as an error, the agent re-sends it now."""
        assert s.req is not None and s.replica is not None
        self.turn_at(s, s.req, s.t_req, now, None, "error", s.replica.index)
        s.req = None
        s.epoch += 1
        shared = self.fleet.shared
        if shared is not None:
            self.apply(shared.handle(TurnAborted(now, s.spec.sid)), now)
        self.request_turn(s, now)

    def ask_again(self, s: FleetSession, now: float) -> None:
        self.ask(s, now)


def schedule(sim: FleetSim, wl: Workload, sessions_in: Sequence[SessionSpec] | None) -> None:
    """The events of ``sim``'s run known from the start: arrivals, samples, triggers (each schedules itself:
    :meth:`kvgate.workload.triggers.Trigger.schedule`), the end."""
    cfg, horizon = sim.cfg, sim.cfg.horizon_s
    if sessions_in is None:
        specs = generate(wl, cfg.lam, horizon, cfg.seed, cfg.parsed_bursts(), cfg.parsed_rates(), cfg.parsed_tenants(),
                         cfg.burst_tenant)
    else:
        specs = sorted(sessions_in, key=lambda sp: (sp.arrival_s, sp.sid))
    for sp in specs:
        sim.push_routed(sp.arrival_s, sim.on_arrive, sp)
    t = 0.0
    while t <= horizon:
        sim.push(t, sim.on_sample)
        t += cfg.sample_s
    for trigger in triggers_of(cfg):
        trigger.schedule(sim)
    sim.push(horizon, sim.on_end)
