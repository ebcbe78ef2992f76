"""The session books as gateways sharing a Redis keep them (``--store redis://``): every instance holds a copy of
every session's book, brought up to date from Redis at each turn boundary. No I/O here: :mod:`kvgate.gateway.sharing`
reads and writes, this module turns a book into a session record and back.

A book is the row of :func:`kvgate.gateway.books.row_of` plus ``idle_wall``: the wall time its last turn ended
(each gateway has its own clock; a book read elsewhere is idle since then on the reader's clock). Its version is the
sequence number of its last write (``P..'books:changed'``, a sorted set: sid -> version); a book read from another
instance replaces the local record's fields, its lineage trail and index entries, and its place among the idle
sessions. What is not in a book stays the instance's own: whether the session holds a turn here, its local policy's
state (the shared budget decides admission), its think times."""

from __future__ import annotations

import contextlib
import time
from array import array
from collections.abc import Callable
from typing import Any

import orjson

from kvgate.gateway.books import FIELDS, TRAIL_FIELDS, put_field, row_of
from kvgate.gateway.lineage import Trail
from kvgate.gateway.sessions import GwSession, Sessions
from kvgate.policy import PolicyError, SessionEnded

_KEPT = tuple(k for k in FIELDS if k not in ("last_active", "response_id"))


class SharedSessions(Sessions):
    """The session layer of a gateway sharing the books: the ids it names are its instance's (lin-TAG-N), and each
    session that leaves D here (ended, or released) is told to ``on_out``."""

    def __init__(self, fleet: Any = None) -> None:
        super().__init__(fleet)
        self.lineage_tag = ""
        self.on_out: Callable[[GwSession, bool], None] | None = None

    def lineage_id(self) -> str:
        self.lineage_n += 1
        return f"lin-{self.lineage_tag}{self.lineage_n}"

    def end(self, s: GwSession, reason: str, now: float) -> None:
        if s.slot.dropped:
            return
        super().end(s, reason, now)
        if self.on_out is not None:
            self.on_out(s, True)

    def release(self, s: GwSession, now: float) -> None:
        super().release(s, now)
        if self.on_out is not None:
            self.on_out(s, False)


def move_to(sessions: Sessions, s: GwSession, engine: str, now: float) -> None:
    """Place ``s`` on the replica of URL ``engine`` here (where the shared budget placed it; nothing for another
    URL, or one upstream): it leaves its old replica's books as a migration does, and is new on the other's."""
    fleet = sessions.fleet
    if fleet.single or not engine or (s.replica is not None and s.replica.url == engine):
        return
    rep = next((r for r in fleet.replicas if r.url == engine), None)
    if rep is None:
        return
    old, pol = s.replica, s.policy
    if pol is not None and s.known_to_policy:
        with contextlib.suppress(PolicyError):  # (a policy that does not know it: nothing to leave)
            pol.state_of(s.sid)
            sessions.apply(pol.handle(SessionEnded(now, s.sid)))
            pol.forget(s.sid)
    if old is not None and old.members.get(s.sid) is s:
        del old.members[s.sid]
    rep.members[s.sid] = s
    s.replica, s.policy, s.known_to_policy = rep, rep.policy, False
    fleet.router.move(s.sid, rep.index)


def book_of(s: GwSession, idle_wall: float) -> str:
    """The session's book as written (JSON)."""
    row = row_of(s)
    row["idle_wall"] = idle_wall
    row["engine"] = None if s.replica is None else s.replica.url  # (the index is the instance's own list's)
    return orjson.dumps(row).decode()


class Books:
    """An instance's copies of the shared books: their versions, and the sessions it wrote last."""

    def __init__(self, sessions: Sessions, time_scale: float) -> None:
        self.sessions = sessions
        self.time_scale = time_scale
        self.versions: dict[str, int] = {}
        """The version of each local copy (0: none written since the books' epoch began)."""
        self.mine: set[str] = set()
        """Sessions whose last book this instance wrote (written again to a Redis that lost them)."""
        self.quiet: set[Any] = set()
        """Sessions ending here whose shared end is already told (the end hook skips them once)."""
        self.last = 0
        """The highest version read."""
        self.epoch = ""
        self.applied = 0
        """Books of other instances applied here."""

    def version(self, s: GwSession) -> str:
        return str(self.versions.get(s.sid, 0))

    def new_epoch(self, epoch: str) -> None:
        """Redis has other books (a new one, or one that lost its data): every copy is read again from version 0."""
        self.epoch = epoch
        self.versions = dict.fromkeys(self.versions, 0)
        self.last = 0

    def apply(self, sid: str, version: int, raw: str, now: float) -> None:
        """One book read from Redis (``raw`` "": the session is gone) into the local records."""
        self.last = max(self.last, version)
        if self.versions.get(sid, -1) >= version:
            return  # (this instance's own write, or older than its copy)
        sessions = self.sessions
        s = sessions.by_id.get(sid)
        if not raw:
            self.versions.pop(sid, None)
            self.mine.discard(sid)
            if s is not None and not s.slot.busy:
                self.quiet.add(sid)
                sessions.end(s, "elsewhere", now)
            return
        row = orjson.loads(raw)
        self.versions[sid] = version
        self.mine.discard(sid)
        self.applied += 1
        if s is None:
            s = GwSession(sid, False)
            rep = sessions.fleet.replicas[0]
            s.replica, s.policy = rep, rep.policy
            rep.members[sid] = s
            sessions.by_id[sid] = s
        if not s.slot.busy:  # (its engine, as the instance that wrote the book sent its turns)
            move_to(sessions, s, row.get("engine") or "", now)
        self._fields(s, row, now)

    def _fields(self, s: GwSession, row: dict[str, Any], now: float) -> None:
        sessions = self.sessions
        lineage = sessions.lineage
        if s.lin.trail is not None and s.lin.trail.indexed:
            lineage.forget(s)
        for k in _KEPT:
            if k in row:
                put_field(s, k, row[k])
        sessions.answered(s, row.get("response_id"))
        idle_wall = float(row.get("idle_wall", time.time()))
        s.last_active = now - max(0.0, time.time() - idle_wall) * self.time_scale
        tr = row.get("trail")
        s.lin.trail = None
        if type(tr) is dict:
            t = s.lin.trail = Trail(tr.get("ns"))
            for k in TRAIL_FIELDS:
                if k in tr and k != "indexed":
                    setattr(t, k, tr[k])
            t.marks = array("Q", tr.get("marks") or ())
            if tr.get("indexed"):
                lineage.index(s)
        if s.released:
            sessions.released.pop(s.sid, None)
            s.released = False
        if not s.slot.busy:
            sessions.idle.pop(s.sid, None)
            sessions.idle[s.sid] = s

    def written(self, s: GwSession, out: list[Any] | None) -> bool:
        """A book write's answer (``[status, version, epoch]``; None: Redis away). False when it was not written."""
        if out is None or len(out) < 3:
            return False
        self.versions[s.sid] = int(out[1])
        self.mine.add(s.sid)
        return True
