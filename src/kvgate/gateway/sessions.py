"""The gateway's session layer: its record of each session (:class:`GwSession`, split by owner), the index of the
sessions and their lifecycle.

No I/O and no clock: every method that needs gateway time is given ``now``. The asyncio of a session is its turn
slot's (:mod:`kvgate.gateway.slot`), which the request path (:mod:`kvgate.gateway.turns`) awaits; the turn's
policy calls are :mod:`kvgate.gateway.asks`'; this module hands the policy's decisions to the slots they name:

* a session's turns are serialised: one request holds the session's turn (``slot.busy``), the next ones queue;
* a held turn waits on ``slot.future``, woken by a ``Proceed`` for the session from any later policy event;
* a session between turns is idle: idle expiry pops the oldest from the front of ``idle``; one idle longer than the
  bound learnt from the think times seen (:mod:`kvgate.gateway.ends`) is *released* first: it leaves the policy
  (``SessionEnded``: its demand leaves D) but its record stays, in ``released``, until ``--idle-timeout``, and a
  turn that comes back resumes it (the policy sees it as new);
* a session that ends (client, DELETE, idle, a client that went away while held, a one-turn request, the cap on
  sessions) is told to the policy (``SessionEnded``) and forgotten by both and by the lineage index
  (:mod:`kvgate.gateway.lineage`), so memory stays bounded;
* in a fleet (:mod:`kvgate.gateway.fleet`) each session is placed on a replica by the router at its turn boundary
  and told to that replica's policy (:mod:`kvgate.gateway.placement`); when a replica goes down its sessions are
  placed anew.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from kvgate.gateway.breaks import CacheNotes
from kvgate.gateway.ends import ThinkTimes
from kvgate.gateway.estimate import Estimate
from kvgate.gateway.fleet import Fleet, Replica
from kvgate.gateway.lineage import Lineage, LineageNotes
from kvgate.gateway.slot import TurnSlot
from kvgate.http.dialect import Api
from kvgate.policy import Policy, Proceed, SessionEnded
from kvgate.policy.core import Decision

if TYPE_CHECKING:
    import asyncio

ANON_PREFIX = "anon-"
"""How a one-turn (anonymous) session's number is shown (``GET /v1/sessions``)."""


class Name:
    """How a session is named (owner: :mod:`kvgate.gateway.identity`, which names a record at its first turn)."""

    __slots__ = ("label", "client", "source", "parent")

    def __init__(self, sid: Any) -> None:
        self.label: str = str(sid)
        """The id as the client named it (a lineage session's: the gateway's)."""
        self.client: int | None = None
        """The number of the client key that opened it (None without keys)."""
        self.source = ""
        """What named it: a source of ``--session-from`` (:mod:`kvgate.gateway.identity`), "" for a one-turn one."""
        self.parent: str | None = None
        """The session it is a child of (a subagent's, a fork's), by label."""


class GwSession:
    """What the gateway keeps per session (the policy core keeps its own state; see ``kvgate.policy``): its identity
    and its place in the lifecycle here, each other part written by one module:

    * ``name`` (:class:`Name`): :mod:`kvgate.gateway.identity`;
    * ``slot`` (:class:`~kvgate.gateway.slot.TurnSlot`, the turn and its asyncio): :mod:`kvgate.gateway.slot`;
    * ``est`` (:class:`~kvgate.gateway.estimate.Estimate`, the estimator's carry): :mod:`kvgate.gateway.estimate`;
    * ``cache`` (:class:`~kvgate.gateway.breaks.CacheNotes`, the prefix-break count): :mod:`kvgate.gateway.breaks`;
    * ``lin`` (:class:`~kvgate.gateway.lineage.LineageNotes`, its trail and answer id): :mod:`kvgate.gateway.lineage`.

    The core's own fields: ``sid`` and ``anonymous`` (set once), ``tenant`` and ``priority``
    (:mod:`kvgate.gateway.tenants`), ``replica``, ``policy`` and ``replaced`` (:mod:`kvgate.gateway.placement`),
    ``known_to_policy``, ``released`` and ``last_active`` (this module: the policy calls and the idle lifecycle);
    a restart's books (:mod:`kvgate.gateway.books`) put them all back."""

    tenant: str | None
    """Its tenant, as its latest request named it (None without tenancy)."""
    priority: int | None
    """Its latest request's priority band (None: its tenant's)."""

    __slots__ = (
        "sid",
        "anonymous",
        "tenant",
        "priority",
        "replica",
        "policy",
        "known_to_policy",
        "replaced",
        "released",
        "last_active",
        "name",
        "slot",
        "est",
        "cache",
        "lin",
    )

    def __init__(self, sid: Any, anonymous: bool) -> None:
        self.sid = sid
        """The gateway's id: the client's, scoped to its key (:func:`kvgate.gateway.identity.scoped`)."""
        self.anonymous = anonymous
        self.tenant = self.priority = None  # (kvgate.gateway.tenants) its latest request's tenant and band
        self.replica: Replica | None = None
        """The replica the session is placed on (None: not placed yet)."""
        self.policy: Policy | None = None
        """The policy that knows the session (its replica's, or the shared one); None when its replica's books went."""
        self.known_to_policy = False
        """The policy core has seen a TurnRequested for it (and not forgotten it)."""
        self.replaced = False
        """Its replica went down between its turns: placed anew, unknown to the new replica's policy until its next
        turn."""
        self.released = False
        """Idle past the learnt bound: out of the policy, kept for its return."""
        self.last_active = 0.0
        """Gateway (virtual) time the last turn ended; idle expiry counts from here."""
        self.name = Name(sid)
        self.slot = TurnSlot()
        self.est = Estimate()
        self.cache = CacheNotes()
        self.lin = LineageNotes()

    @property
    def demand(self) -> int:
        """Its turn's demand as of its last boundary (L_s + o_s): what it needs of its replica's pool."""
        est = self.est
        return est.context + est.output


class Sessions:
    """The gateway's sessions by id, the idle ones oldest first, and the fleet whose policies they are told to."""

    def __init__(self, fleet: Fleet | None = None) -> None:
        self.fleet: Fleet = fleet if fleet is not None else Fleet(("upstream",), "kvgate")
        """The replicas, their books and the router (set up when the gateway starts)."""
        self.by_id: dict[Any, GwSession] = {}
        self.idle: OrderedDict[Any, GwSession] = OrderedDict()
        """Sessions between turns, oldest activity first (idle expiry pops from the front)."""
        self.ends: Counter[str] = Counter()
        """Sessions ended, by cause."""
        self._anon = 0
        self.side_requests = 0
        """Side requests served (:func:`kvgate.gateway.turns.is_side_request`)."""
        self.lineage_n = 0
        """Lineage sessions named so far (their ids: lin-N)."""
        self.dirty: set[Any] | None = None
        """With a state store: the ids of the sessions changed since its last flush (:mod:`kvgate.gateway.store`)."""
        self.released: OrderedDict[Any, GwSession] = OrderedDict()
        """Sessions released from the policy (idle past the learnt bound), oldest activity first."""
        self.think = ThinkTimes()
        """The gaps between a session's turns (the release bound)."""
        self.lineage = Lineage()
        self.responses: dict[str, GwSession] = {}
        """Each session's last answer id (Responses' ``previous_response_id``)."""
        self.pressure = 0
        """Policy events after which D exceeded C (a session whose mark is behind it saw a full pool)."""
        self.resumed = 0
        """Released sessions that came back."""
        self.breaks: Counter[str] = Counter()
        """Prefix breaks by cause (:mod:`kvgate.gateway.breaks`)."""
        self.max_sessions = 0
        """The most sessions kept (0: no cap); past it the oldest idle ones end (reason "cap")."""
        self.idle_s = 300.0
        """``--idle-timeout`` (gateway seconds): the longest a silent session is kept."""
        self._bound_asked = 0.0

    @property
    def policy(self) -> Policy:
        """The one policy of a single upstream (or of a per-turn router's fleet)."""
        p = self.fleet.shared
        if p is None:
            raise AttributeError("a fleet with a sticky router has one policy per replica (see fleet.replicas)")
        return p

    def anonymous_id(self) -> int:
        """A new one-turn session's id: an int, never equal to a client's (string) id."""
        self._anon += 1
        return self._anon

    def lineage_id(self) -> str:
        """A new lineage session's id (the gateway names it)."""
        self.lineage_n += 1
        return f"lin-{self.lineage_n}"

    def by_response(self, rid: str) -> str | None:
        """The label of the session whose last answer was ``rid`` (Responses' ``previous_response_id``)."""
        s = self.responses.get(rid)
        return None if s is None or s.slot.dropped else s.name.label

    def answered_with(self, s: GwSession, api: Api, answer: Any, stream: bool) -> None:
        """Keep what names the session by its answer: the answer's id (Responses' ``previous_response_id``) and,
        read whole, its text's longest line (lineage's rule for compactions)."""
        if api.stored_field is not None:  # (an API whose requests name an earlier answer by its id)
            rid = api.answer_id(answer)
            if rid is not None:
                self.answered(s, rid)
        if not stream and s.name.source == "lineage":
            self.lineage.replied(s, api.answer_text(answer))

    def answered(self, s: GwSession, rid: str | None) -> None:
        """The session's answer had id ``rid`` (kept as its last)."""
        if s.lin.response_id is not None and self.responses.get(s.lin.response_id) is s:
            del self.responses[s.lin.response_id]
        s.lin.answered(rid)
        if rid is not None:
            self.responses[rid] = s

    # -- a session's turn ----------------------------------------------------------------------------------
    def open(self, sid: Any, anonymous: bool) -> GwSession:
        """The session's record (a new one for an unknown id)."""
        s = self.by_id.get(sid)
        if s is None:
            s = self.by_id[sid] = GwSession(sid, anonymous)
        return s

    def take(self, s: GwSession) -> None:
        """The caller now holds the session's turn."""
        s.slot.take()
        self.idle.pop(s.sid, None)
        if s.released:
            del self.released[s.sid]
        self.mark(s)

    def mark(self, s: GwSession) -> None:
        """The session changed: the store writes it at its next flush."""
        if self.dirty is not None and not s.anonymous:
            self.dirty.add(s.sid)

    def leave(self, s: GwSession, now: float) -> bool:
        """Release the session's turn: hand it to the next request of the session, or mark the session idle.
        True when the earliest idle deadline may have moved earlier (the session became the only idle one, or
        the release bound shrank since the timer last asked)."""
        if s.slot.hand_on() or s.slot.dropped:
            return False
        self.mark(s)
        s.last_active = now
        first = not self.idle or self.think.bound(self.idle_s) < self._bound_asked
        self.idle[s.sid] = s
        return first

    def supersede(self, sid: Any, key: int) -> bool:
        """A request of session ``sid`` with body hash ``key`` arrived: if it retries the attempt holding the
        session's turn (same body), that attempt is cancelled (its upstream request with it). True if so."""
        prev = self.by_id.get(sid)
        return prev is not None and prev.slot.supersede(key)

    # -- the policy ----------------------------------------------------------------------------------------
    def apply(self, decisions: list[Decision], start: int = 0) -> None:
        """Release held turns the policy let proceed."""
        sessions = self.by_id
        for i in range(start, len(decisions)):
            d = decisions[i]
            if type(d) is Proceed:
                s = sessions.get(d.session)
                if s is not None:
                    s.slot.wake()

    def end(self, s: GwSession, reason: str, now: float) -> None:
        """End the session (its turn, if any, must not be in flight): SessionEnded, then forget it."""
        if s.slot.dropped:
            return
        s.slot.drop()
        sid = s.sid
        if self.by_id.get(sid) is s:
            del self.by_id[sid]
        self.idle.pop(sid, None)
        if s.released:
            self.released.pop(sid, None)
        self.lineage.forget(s)
        self.answered(s, None)
        self.mark(s)
        if s.replica is not None:
            self.fleet.leave(s)
        if self.fleet.residency is not None and type(sid) is str:
            for r in self.fleet.replicas:
                if r.events is not None:
                    r.events.residency.forget(sid)
        policy = s.policy
        if s.known_to_policy and policy is not None:
            decisions = policy.handle(SessionEnded(now, sid))
            policy.forget(sid)
            s.known_to_policy = False
            self.apply(decisions)
        self.ends[reason] += 1

    # -- idle expiry ---------------------------------------------------------------------------------------
    def first_expiry(self, idle_s: float) -> float | None:
        """When the next idle session is released or forgotten (gateway time), None without idle sessions."""
        best = None
        self._bound_asked = bound = self.think.bound(idle_s)
        if self.idle:
            best = next(iter(self.idle.values())).last_active + bound
        if self.released:
            t = next(iter(self.released.values())).last_active + idle_s
            best = t if best is None or t < best else best
        return best

    def expire(self, now: float, idle_s: float) -> None:
        """Release the sessions idle past the learnt bound, end those idle for ``idle_s`` or longer."""
        bound = self.think.bound(idle_s)
        idle, limit = self.idle, now - idle_s
        while idle:
            s = next(iter(idle.values()))
            if s.last_active > now - bound:
                break
            if bound >= idle_s or s.last_active <= limit:
                self.end(s, "idle", now)
            else:
                self.release(s, now)
        released = self.released
        while released:
            s = next(iter(released.values()))
            if s.last_active > limit:
                break
            self.end(s, "idle", now)

    def release(self, s: GwSession, now: float) -> None:
        """The idle session leaves the policy (its demand leaves D); its record stays for its return."""
        self.idle.pop(s.sid, None)
        s.released = True
        self.released[s.sid] = s
        self.mark(s)
        policy = s.policy
        if s.known_to_policy and policy is not None:
            decisions = policy.handle(SessionEnded(now, s.sid))
            policy.forget(s.sid)
            s.known_to_policy = False
            self.apply(decisions)
        self.ends["released"] += 1

    def trim(self, now: float) -> None:
        """Past ``max_sessions``: end the oldest released, then the oldest idle sessions (reason "cap")."""
        cap = self.max_sessions
        while cap and len(self.by_id) > cap:
            pool = self.released or self.idle
            if not pool:
                return
            self.end(next(iter(pool.values())), "cap", now)

    def held_futures(self) -> Iterator[asyncio.Future[None]]:
        """The futures of the turns held now (O(n): the gateway answers them at shutdown)."""
        for s in list(self.by_id.values()):
            fut = s.slot.held()
            if fut is not None:
                yield fut
