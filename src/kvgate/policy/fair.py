"""Fair share across tenants: the actuator of ``core`` with one queue per (priority band, tenant).

``FairPolicy`` is ``Policy`` with tenancy (``tenancy.Tenancy``); with one tenant and no quota it decides exactly
as ``Policy`` does (the property tests replay random event streams through both). What changes with several:

* **Re-admission order.** Held sessions sit in one lane per (band, tenant), each a parked FIFO and a new-session
  FIFO (parked first, as in the core). The pump serves the highest band with a held session; within a band the
  tenant with the smallest *virtual token counter*: the tokens it has been served (d_s of every turn that
  proceeds) divided by its weight. FIFO within a tenant; the pump still stops at the first head that does not fit.
  A tenant that enters the system with no session in it starts at the smallest counter of those present (idle
  time is not banked credit).
* **Share at the boundary.** An admitted session is parked only if the control says so *and* its tenant holds at
  least its share of D: D_t · W ≥ w_t · D, W the summed weights of the tenants with sessions in the system (a
  share nobody uses goes to the others). When D > high·C some tenant is always at or over its share, so the
  bound holds; a tenant under its share keeps going while the one over it is parked.
* **Arrival.** A new session is admitted at once only if no session is held in a higher band, none of its own
  lane, and no tenant of its band with a smaller counter has one held (nobody queued *ahead* of it).
* **Priority guard.** After ``starve_after`` re-admissions in a row that passed over a held lower band, the next
  goes to the lowest band with a held session.
* **Quota.** A tenant with a budget reserves d_s at each turn boundary (whatever the decision); the finished
  turn settles it to its usage (prompt + output tokens), an aborted or dropped turn is refunded. A turn that
  would take the window's reservations over the budget gets ``OverQuota`` with the time to the window's end.

Controls that resume parked sessions themselves (``thunder``) are refused: the order here is the pump's.
"""

from __future__ import annotations

import heapq
import math
from collections.abc import Hashable
from itertools import count
from typing import Any

import kvgate.policy.events as events
from kvgate.policy.core import Policy, SessionRecord, checked_tokens
from kvgate.policy.events import Decision, OverQuota, Park, Proceed, TurnRequested
from kvgate.policy.fifo import Fifo
from kvgate.policy.limits import Control
from kvgate.policy.state import ADMIT, REQUEST, TRANSITIONS, PolicyError, SessionState, check
from kvgate.policy.tenancy import Tenancy
from kvgate.policy.view import SessionView

_WAITING = SessionState.WAITING
_RUNNING = SessionState.RUNNING
_THINKING = SessionState.THINKING
_PARKED = SessionState.PARKED
# The hot paths below move a session THINKING -> RUNNING (its turn proceeds) and PARKED / WAITING -> RUNNING
# (re-admission) by updating the state counts in place instead of through ``Policy._move``; these moves are legal
# in ``TRANSITIONS`` (checked here, once), and each path tests the state it starts from first.
assert _RUNNING in TRANSITIONS[(_THINKING, REQUEST)]
assert _RUNNING in TRANSITIONS[(_PARKED, ADMIT)] and _RUNNING in TRANSITIONS[(_WAITING, ADMIT)]


class _Tenant:
    __slots__ = ("key", "weight", "served", "demand", "n_in", "quota", "window", "used", "tokens", "home")

    def __init__(self, key: Hashable, tenancy: Tenancy) -> None:
        self.key = key
        self.weight = tenancy.weight(key)
        self.served = 0.0
        """Virtual token counter: tokens of the turns that proceeded, divided by the weight."""
        self.demand = 0
        """D_t: the demand of the tenant's admitted sessions."""
        self.n_in = 0
        """Sessions in the system (admitted or held)."""
        self.quota = tenancy.quota(key)
        self.window = -1
        self.used = 0
        """Tokens reserved or used in window ``window``."""
        self.tokens = 0
        """Tokens of the turns that proceeded (unweighted; for reports)."""
        self.home: _Lane | None = None
        """Its lane in its own band (where its turns that name no priority are held), once it has one."""


class _FairSession(SessionRecord):
    __slots__ = ("tenant", "lane", "reserved", "reserved_in")

    def __init__(self, sid: Hashable, tenant: _Tenant) -> None:
        super().__init__(sid)
        self.tenant = tenant
        self.lane: _Lane | None = None
        self.reserved = 0
        self.reserved_in = -1


class _Lane:
    __slots__ = ("band", "tenant", "parked", "waiting", "entry")

    def __init__(self, band: _Band, tenant: _Tenant, tickets: count[int]) -> None:
        self.band, self.tenant = band, tenant
        self.parked: Fifo[_FairSession] = Fifo(tickets)
        self.waiting: Fifo[_FairSession] = Fifo(tickets)
        self.entry = 0
        """Sequence number of the lane's live entry in its band's heap (0: none)."""

    def head(self) -> _FairSession | None:
        return self.parked.head() if self.parked.live else self.waiting.head()

    def hold(self, rec: _FairSession, waiting: bool) -> None:
        """Queue ``rec`` at the tail of the lane's new-session (``waiting``) or parked FIFO; a lane that had nothing
        held enters its band's heap."""
        parked = self.parked
        was_live = parked.live or self.waiting.live
        (self.waiting if waiting else parked).push(rec)
        rec.lane = self
        band = self.band
        band.live += 1
        if not was_live:
            self.entry = next(band.seq)
            heapq.heappush(band.heap, (self.tenant.served, self.entry, self))

    def unhold(self, rec: _FairSession) -> None:
        """Take ``rec`` out of the lane (its session left while held)."""
        (self.waiting if rec.state is _WAITING else self.parked).remove(rec)
        if not (self.parked.live or self.waiting.live):
            self.entry = 0
        rec.lane = None
        self.band.live -= 1


class _Band:
    __slots__ = ("priority", "heap", "live", "lanes", "seq")

    def __init__(self, priority: int, seq: count[int]) -> None:
        self.priority = priority
        self.heap: list[tuple[float, int, _Lane]] = []
        """(counter when pushed, entry number, lane): the lanes with held sessions, smallest counter on top."""
        self.live = 0
        self.lanes: dict[Hashable, _Lane] = {}
        self.seq = seq
        """The policy's entry numbers (shared by its bands)."""

    def top(self) -> _Lane | None:
        """The live lane with the smallest counter (ties: the earliest entry); stale entries are dropped, and an
        entry whose counter moved since it was pushed is pushed again with the counter it has now."""
        heap = self.heap
        while heap:
            key, seq, lane = heap[0]
            if lane.entry != seq or not (lane.parked.live or lane.waiting.live):
                heapq.heappop(heap)
                continue
            if key != lane.tenant.served:
                lane.entry = next(self.seq)
                heapq.heapreplace(heap, (lane.tenant.served, lane.entry, lane))
                continue
            return lane
        return None


def _next_lane(order: list[_Band], guard: bool) -> _Lane | None:
    """The lane whose head the pump considers next: the highest band with a held session (with ``guard``, the
    starvation guard's turn, the lowest), its smallest counter."""
    if len(order) == 1:
        return order[0].top() if order[0].live else None
    top = lowest = None
    for band in order:
        if band.live:
            top = top or band
            lowest = band
    if top is None:
        return None
    return (lowest if guard else top).top()


class FairPolicy(Policy):
    """``Policy`` with tenants: weighted fair share, priority bands, quotas. See the module docstring."""

    def __init__(self, control: Control, *, now: float = 0.0, tenancy: Tenancy | None = None) -> None:
        self.tenancy = tenancy or Tenancy()
        self._tenants: dict[Hashable, _Tenant] = {}
        self._bands: dict[int, _Band] = {}
        self._order: list[_Band] = []  # bands, highest priority first
        self._single: _Band | None = None  # the band, while there is exactly one
        self._seq = count(1)
        self._weights_in = 0.0  # W: the summed weights of the tenants with sessions in the system
        self._held = 0
        self._present = 0  # tenants with sessions in the system
        self._floor = 0.0  # the counter of the tenant served last (where an entering tenant starts, at the least)
        self._passed = 0  # re-admissions in a row that passed over a held lower band (the starvation guard)
        _check_fifo(control)
        self._lane_tickets = count(1)
        super().__init__(control, now=now)
        if not (self.tenancy.quotas or self.tenancy.default_quota is not None):
            self._handlers[events.TurnFinished] = super()._on_finished  # nothing to settle

    def set_control(self, now: float, control: Control) -> list[Decision]:
        _check_fifo(control)
        return super().set_control(now, control)

    # -- inspection --------------------------------------------------------------------------------------------
    def tenant_stats(self) -> dict[Hashable, dict[str, Any]]:
        """Per tenant: ``demand`` (D_t), ``sessions`` in the system (``parked`` and ``waiting`` of them), ``tokens``
        served, ``weight``, ``quota`` (None: unlimited) and ``used`` of it in quota window ``window`` (O(tenants))."""
        return _tenant_stats(self._tenants, self._lanes())

    def parked_order(self) -> list[Hashable]:
        return [rec.sid for lane in self._lanes() for rec in lane.parked]

    def waiting_order(self) -> list[Hashable]:
        return [rec.sid for lane in self._lanes() for rec in lane.waiting]

    def held_sessions(self) -> list[SessionView]:
        return [SessionView(r.sid, r.state, r.demand, r.output) for lane in self._lanes() for r in lane.parked]  # type: ignore[arg-type]

    def _lanes(self) -> list[_Lane]:
        return [lane for band in self._order for lane in band.lanes.values()]

    # -- event handlers ----------------------------------------------------------------------------------------
    def _on_requested(self, ev: TurnRequested) -> list[Decision]:
        sid = ev.session
        ctx, out = ev.context_tokens, ev.output_tokens
        if type(ctx) is not int or type(out) is not int or ctx < 0 or out < 0:
            ctx, out = checked_tokens(ev)
        demand = ctx + out
        rec: _FairSession | None = self._sessions.get(sid)  # type: ignore[assignment]
        if rec is None:
            return self._arrive(ev, sid, demand, out)
        if rec.state is not _THINKING:
            check(rec.state, REQUEST, sid)
            raise PolicyError(f"control {self._control.name!r} suspended {sid!r}, which FairPolicy does not support")
        tenant = rec.tenant
        if tenant.quota is not None:
            if (refused := _reserve(tenant, demand, ev.now, self.tenancy.window_s)) is not None:
                return [OverQuota(sid, refused)]
            _note_reservation(rec, demand)
        control = self._control
        control.observe_boundary(demand)
        delta = demand - rec.demand
        total = self._demand = self._demand + delta
        tenant.demand += delta
        rec.demand, rec.output = demand, out
        if (
            len(self._admitted) > 1
            and tenant.demand * self._weights_in >= tenant.weight * total  # at or over its share
            and (control.parks(self, sid) or (self._held > 0 and self._owed(tenant)))
        ):
            self._move(rec, REQUEST, _PARKED)
            self._unadmit(rec)
            (tenant.home if ev.priority is None and tenant.home is not None else self._lane_of(ev, tenant)).hold(
                rec, False)
            self._held += 1
            self.parks += 1
            return [Park(sid)]
        n = self._in_state  # THINKING -> RUNNING (checked above)
        n[_THINKING] -= 1
        n[_RUNNING] += 1
        rec.state = _RUNNING
        served = self._floor = tenant.served
        tenant.served = served + demand / tenant.weight
        tenant.tokens += demand
        return [Proceed(sid)]

    def _arrive(self, ev: TurnRequested, sid: Hashable, demand: int, out: int) -> list[Decision]:
        tenant = self._tenant(ev.tenant)
        if tenant.quota is not None:
            refused = _reserve(tenant, demand, ev.now, self.tenancy.window_s)
            if refused is not None:
                return [OverQuota(sid, refused)]
        control = self._control
        control.observe_boundary(demand)
        rec = _FairSession(sid, tenant)
        self._sessions[sid] = rec
        self._enter(tenant)
        _note_reservation(rec, demand)
        rec.demand, rec.output = demand, out
        lane = self._lane_of(ev, tenant)
        if not self._ahead(lane) and (not self._admitted or control.admits(self, demand)):
            self._move(rec, REQUEST, _RUNNING)
            self._admit(rec)
            self._serve(tenant, demand)
            return [Proceed(sid)]
        self._move(rec, REQUEST, _WAITING)
        lane.hold(rec, True)
        self._held += 1
        self.waits += 1
        return [Park(sid)]

    def _on_finished(self, ev: events.TurnFinished) -> list[Decision]:
        rec = self._sessions.get(ev.session)
        if isinstance(rec, _FairSession) and rec.state is _RUNNING and rec.tenant.quota is not None:
            _settle(rec, ev.prompt_tokens + ev.output_tokens, ev.now, self.tenancy.window_s)
        return super()._on_finished(ev)

    def _on_aborted(self, ev: events.TurnAborted) -> list[Decision]:
        rec = self._known(ev.session, "TurnAborted")
        assert isinstance(rec, _FairSession)
        if rec.state is _RUNNING:
            rec.tenant.demand -= rec.demand
            _settle(rec, 0, ev.now, self.tenancy.window_s)
        return super()._on_aborted(ev)

    def _on_ended(self, ev: events.SessionEnded) -> list[Decision]:
        rec = self._known(ev.session, "SessionEnded")
        assert isinstance(rec, _FairSession)
        tenant = rec.tenant
        if rec.state is _RUNNING or rec.state is _THINKING:
            self._unadmit(rec)
        else:
            assert rec.lane is not None
            rec.lane.unhold(rec)
            self._held -= 1
        _settle(rec, 0, ev.now, self.tenancy.window_s)
        self._move(rec, "SessionEnded", SessionState.DONE)
        tenant.n_in -= 1
        if tenant.n_in == 0:
            self._weights_in -= tenant.weight
            self._present -= 1
            if not self._present:
                self._weights_in = 0.0  # no drift from float sums once the system is empty
        return self._pump()

    # -- the actuator --------------------------------------------------------------------------------------------
    def _pump(self) -> list[Decision]:
        out: list[Decision] = []
        if not self._held:
            return out
        control = self._control
        band = self._single
        while True:
            if band is None:  # several bands
                lane = _next_lane(self._order, self._passed >= self.tenancy.starve_after)
                if lane is None:
                    break
            elif not band.live:
                break
            else:  # the heap's top entry, unless stale or its counter moved (then ``top`` sorts it out)
                key, seq, lane = band.heap[0]
                if lane.entry != seq or key != lane.tenant.served:
                    lane = band.top()
                    assert lane is not None
            parked, waiting = lane.parked, lane.waiting
            rec = parked.head() if parked.live else waiting.head()
            assert rec is not None
            admitted = self._admitted
            if admitted and not control.admits(self, rec.demand):
                break
            if band is None:
                self._note_pass(lane.band)
            state = rec.state
            if state is _PARKED:
                parked.remove(rec)
                self.readmissions += 1
            else:
                waiting.remove(rec)
            if not (parked.live or waiting.live):
                lane.entry = 0  # its heap entry is stale now
            rec.lane = None
            lane.band.live -= 1
            self._held -= 1
            n = self._in_state
            n[state] -= 1  # PARKED / WAITING -> RUNNING (the lanes hold nothing else)
            n[_RUNNING] += 1
            rec.state = _RUNNING
            tenant, demand = rec.tenant, rec.demand
            admitted[rec.sid] = rec
            self._demand += demand
            tenant.demand += demand
            served = self._floor = tenant.served
            tenant.served = served + demand / tenant.weight
            tenant.tokens += demand
            out.append(Proceed(rec.sid))
        return out

    def _note_pass(self, band: _Band) -> None:
        lower_held = any(b.live for b in self._order if b.priority < band.priority)
        self._passed = self._passed + 1 if lower_held else 0

    def _ahead(self, lane: _Lane) -> bool:
        """Whether a held session is ahead of a new one arriving on ``lane``."""
        if lane.parked.live or lane.waiting.live:
            return True
        for band in self._order:
            if band is lane.band:
                top = band.top() if band.live else None
                return top is not None and top.tenant.served < lane.tenant.served
            if band.live:
                return True
        return False  # pragma: no cover (the lane's band is in the order)

    def _owed(self, tenant: _Tenant) -> bool:
        """Whether ``tenant`` holds room another is owed: the next held session the pump would take does not fit, and
        belongs to a tenant that stays within its share with it. A share lent is returned at the borrower's boundary.
        (Asked only with sessions held.)"""
        band = self._single
        if band is None:
            lane = _next_lane(self._order, self._passed >= self.tenancy.starve_after)
        else:
            if not band.live:
                return False
            key, seq, lane = band.heap[0]
            if lane.entry != seq or key != lane.tenant.served:
                lane = band.top()
        if lane is None or lane.tenant is tenant:
            return False
        other = lane.tenant
        head = lane.parked.head() if lane.parked.live else lane.waiting.head()
        assert head is not None
        under = (other.demand + head.demand) * self._weights_in <= other.weight * self._demand
        return under and not self._control.admits(self, head.demand)

    # -- bookkeeping ---------------------------------------------------------------------------------------------
    def _tenant(self, key: Hashable) -> _Tenant:
        t = self._tenants.get(key)
        if t is None:
            t = self._tenants[key] = _Tenant(key, self.tenancy)
        return t

    def _enter(self, tenant: _Tenant) -> None:
        """``tenant`` gets a session in the system; entering, its counter is lifted to the one the pump would serve
        next (the smallest of the held tenants'), or with nobody held to the counter last served."""
        if tenant.n_in == 0:
            lane = _next_lane(self._order, self._passed >= self.tenancy.starve_after) if self._held else None
            floor = lane.tenant.served if lane is not None else self._floor
            if tenant.served < floor:
                tenant.served = floor
            self._weights_in += tenant.weight
            self._present += 1
        tenant.n_in += 1

    def _lane_of(self, ev: TurnRequested, tenant: _Tenant) -> _Lane:
        """The lane of ``ev``'s band (its own priority, else its tenant's) for ``tenant``."""
        if ev.priority is None:
            if tenant.home is None:
                tenant.home = self._lane(self.tenancy.priority(tenant.key), tenant)
            return tenant.home
        return self._lane(ev.priority, tenant)

    def _lane(self, priority: int, tenant: _Tenant) -> _Lane:
        band = self._bands.get(priority)
        if band is None:
            band = self._bands[priority] = _Band(priority, self._seq)
            self._order = sorted(self._bands.values(), key=lambda b: -b.priority)
            self._single = band if len(self._order) == 1 else None
        lane = band.lanes.get(tenant.key)
        if lane is None:
            lane = band.lanes[tenant.key] = _Lane(band, tenant, self._lane_tickets)
        return lane

    def _admit(self, rec: _FairSession) -> None:
        self._admitted[rec.sid] = rec
        self._demand += rec.demand
        rec.tenant.demand += rec.demand

    def _unadmit(self, rec: _FairSession) -> None:
        del self._admitted[rec.sid]
        self._demand -= rec.demand
        rec.tenant.demand -= rec.demand

    def _serve(self, tenant: _Tenant, demand: int) -> None:
        self._floor = tenant.served
        tenant.served += demand / tenant.weight
        tenant.tokens += demand



def _tenant_stats(tenants: dict[Hashable, _Tenant], lanes: list[_Lane]) -> dict[Hashable, dict[str, Any]]:
    out: dict[Hashable, dict[str, Any]] = {
        key: {"demand": t.demand, "sessions": t.n_in, "parked": 0, "waiting": 0, "tokens": t.tokens,
              "weight": t.weight, "quota": t.quota, "used": t.used, "window": t.window}
        for key, t in tenants.items()
    }
    for lane in lanes:
        row = out[lane.tenant.key]
        row["parked"] += lane.parked.live
        row["waiting"] += lane.waiting.live
    return out


# -- quotas (a tenant's window of reservations) -------------------------------------------------------------------
def _roll(tenant: _Tenant, now: float, window_s: float) -> None:
    window = math.floor(now / window_s)
    if window != tenant.window:
        tenant.window, tenant.used = window, 0


def _reserve(tenant: _Tenant, demand: int, now: float, window_s: float) -> float | None:
    """Reserve ``demand`` in the tenant's window; the seconds to retry after when it would exceed the quota."""
    _roll(tenant, now, window_s)
    assert tenant.quota is not None
    if tenant.used + demand > tenant.quota:
        return (tenant.window + 1) * window_s - now
    tenant.used += demand
    return None


def _note_reservation(rec: _FairSession, demand: int) -> None:
    if rec.tenant.quota is not None:
        rec.reserved, rec.reserved_in = demand, rec.tenant.window


def _settle(rec: _FairSession, usage: int, now: float, window_s: float) -> None:
    """Settle the turn's reservation to ``usage`` tokens (0: refunded), in the window it was made in."""
    tenant = rec.tenant
    if tenant.quota is None:
        return
    _roll(tenant, now, window_s)
    if rec.reserved_in == tenant.window:
        tenant.used = max(0, tenant.used + usage - rec.reserved)
    rec.reserved, rec.reserved_in = 0, -1


def _check_fifo(control: Control) -> None:
    if not control.fifo_readmit:
        raise PolicyError(
            f"control {control.name!r} resumes sessions on its own timer; fair share needs FIFO re-admission"
        )
