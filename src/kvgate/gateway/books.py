"""The session layer's books as rows, and back (:mod:`kvgate.gateway.store` keeps them): what a restarted gateway
needs of each session and of itself. No I/O here: the snapshot is taken in the event loop, the store writes it in a
thread."""

from __future__ import annotations

import logging
import time
from array import array
from typing import Any

import orjson

from kvgate.gateway.lineage import Trail
from kvgate.gateway.sessions import GwSession, Sessions
from kvgate.gateway.store import Keeper
from kvgate.policy import TurnFinished, TurnRequested

_FIELDS = ("label", "client", "source", "parent", "turns", "kind", "known_tokens", "reply_tokens", "sent_len",
           "context", "output", "prompt_tokens", "cached_tokens", "last_active", "breaks", "last_break", "rewrites",
           "response_id", "side_requests", "offers_tools")
_TRAIL = ("ns", "root", "head", "n", "tip", "chars", "failed", "indexed", "reply", "plen", "pcrc", "bound", "bcrc",
          "api")
ADMITTED = ("running", "thinking")
FIELDS, TRAIL_FIELDS = _FIELDS, _TRAIL
"""What a book keeps of a session, and of its lineage trail."""
_PART = {**dict.fromkeys(("label", "client", "source", "parent"), "name"),
         **dict.fromkeys(("turns", "kind", "known_tokens", "reply_tokens", "sent_len", "context", "output",
                          "prompt_tokens", "cached_tokens"), "est"),
         **dict.fromkeys(("breaks", "last_break", "rewrites"), "cache"),
         **dict.fromkeys(("response_id", "side_requests", "offers_tools"), "lin")}
"""The part of a session record (:class:`GwSession`) that holds each of a book's fields (a book is flat: its row
is the same whichever part holds a field); the rest are the record's own."""
log = logging.getLogger("kvgate.gateway")


def row_of(s: GwSession) -> dict[str, Any]:
    """A session as the store keeps it."""
    row: dict[str, Any] = {"sid": s.sid, **{k: field_of(s, k) for k in _FIELDS}}
    p = s.policy
    state = "released"
    if s.known_to_policy and p is not None:
        state = p.state_of(s.sid).value
        row["demand"] = p.demand_of(s.sid)
    row["state"] = state
    row["replica"] = None if s.replica is None else s.replica.index
    t = s.lin.trail
    if t is not None:
        row["trail"] = {**{k: getattr(t, k) for k in _TRAIL}, "marks": t.marks.tolist()}
    return row


def field_of(s: GwSession, k: str) -> Any:
    """A book's field ``k`` of the session."""
    part = _PART.get(k)
    return getattr(s if part is None else getattr(s, part), k)


def put_field(s: GwSession, k: str, value: Any) -> None:
    """Restore a book's field ``k`` on the session (the store's restore writes each part it kept)."""
    part = _PART.get(k)
    setattr(s if part is None else getattr(s, part), k, value)


def snapshot(sessions: Sessions, meta: dict[str, Any]) -> tuple[dict[str, Any], list[tuple[str, bytes]], list[str]]:
    """``(meta, rows of the marked sessions, ids of the ended ones)``; clears the marks."""
    marked = sessions.dirty
    if marked is None:
        return meta, [], []
    sessions.dirty = set()
    rows, gone = [], []
    by_id = sessions.by_id
    for sid in marked:
        s = by_id.get(sid)
        if s is None:
            gone.append(sid)
        else:
            rows.append((sid, orjson.dumps(row_of(s))))
    return meta, rows, gone


def meta_of(sessions: Sessions, now: float, control: tuple[str, dict[str, Any]], control_at: float | None
            ) -> dict[str, Any]:
    """The gateway's own: its clock (and the wall time it read it), the think times, lineage's counts, the control."""
    t = sessions.think
    return {"version": 1, "now_s": now, "wall": time.time(), "lineage_n": sessions.lineage_n,
            "think": {"counts": t.counts, "total": t.total, "seen": t.seen}, "resolved": sessions.lineage.counts,
            "resumed": sessions.resumed, "breaks": dict(sessions.breaks), "control": [control[0], control[1]],
            "control_at": control_at}


class Resume:
    """What a gateway starting on its state store goes on from: read before it listens, applied once its policies
    exist (:meth:`apply`)."""

    def __init__(self, keeper: Keeper | None, time_scale: float) -> None:
        self.keeper = keeper
        self.meta, self.rows = keeper.store.load() if keeper is not None else ({}, [])
        self.now = resume_time(self.meta, time_scale)
        """The gateway time to go on from (0 without a store, or a new one)."""
        ctl = self.meta.get("control")
        self.control: tuple[str, dict[str, Any]] | None = (ctl[0], dict(ctl[1])) if type(ctl) is list else None
        self.control_at: float | None = self.meta.get("control_at")
        self.restored = 0

    def apply(self, sessions: Sessions, control: tuple[str, dict[str, Any]]) -> None:
        """Restore the sessions (replayed under no control, then ``control`` back), and start keeping the books."""
        if self.keeper is None:
            return
        sessions.dirty = set()
        if self.rows:
            fleet = sessions.fleet
            name, opts = fleet.active
            sessions.apply(fleet.set_control(self.now, "none", {}))
            self.restored = restore(sessions, self.meta, self.rows, self.now)
            sessions.apply(fleet.set_control(self.now, name, opts))
            log.info("books restored", extra={"event": "restored", "sessions": len(self.rows),
                                              "admitted": self.restored, "demand_tokens": fleet.demand,
                                              "now_s": round(self.now, 3)})
        self.meta = {}
        self.rows = []


def resume_time(meta: dict[str, Any], time_scale: float) -> float:
    """The gateway time to go on from: the stored clock plus the time it was down (0 for a new store)."""
    if "now_s" not in meta:
        return 0.0
    down = max(0.0, time.time() - float(meta.get("wall", time.time())))
    return float(meta["now_s"]) + down * time_scale


def restore(sessions: Sessions, meta: dict[str, Any], rows: list[dict[str, Any]], now: float) -> int:
    """Put the stored sessions back (see :mod:`kvgate.gateway.store`); returns the sessions admitted again. The
    admitted ones are replayed through their policies under no control (each admitted whatever the budget: they
    were), then the control in force is put back by the caller. The time the gateway was down is not the sessions'
    silence: their idle clocks are moved on by it (else a restart longer than the release bound would release
    them all)."""
    t = sessions.think
    think = meta.get("think") or {}
    if think.get("counts") and len(think["counts"]) == len(t.counts):
        t.counts, t.total, t.seen = [float(c) for c in think["counts"]], float(think["total"]), int(think["seen"])
        t.refresh()
    sessions.lineage_n = int(meta.get("lineage_n", 0))
    sessions.lineage.counts.update(meta.get("resolved") or {})
    sessions.resumed = int(meta.get("resumed", 0))
    sessions.breaks.update(meta.get("breaks") or {})
    admitted = []
    down = max(0.0, now - float(meta.get("now_s", now)))  # (the sessions could not reach a dead gateway)
    for row in sorted(rows, key=lambda r: r.get("last_active", 0.0)):
        s = _session(sessions, row)
        s.last_active += down
        if row.get("state") in ADMITTED and s.policy is not None:
            admitted.append((s, row))
        else:  # held at the kill, or released: out of D, kept for its return
            s.released = True
            sessions.released[s.sid] = s
    for s, row in admitted:
        policy = s.policy
        assert policy is not None
        demand, out = int(row.get("demand", 0)), min(int(row.get("demand", 0)), max(0, int(row["output"])))
        policy.handle(TurnRequested(now, s.sid, demand - out, out))
        policy.handle(TurnFinished(now, s.sid, 0.0, max(row["prompt_tokens"], 0), None, 0))
        s.known_to_policy = True
        sessions.idle[s.sid] = s
    return len(admitted)


def _session(sessions: Sessions, row: dict[str, Any]) -> GwSession:
    s = GwSession(row["sid"], False)
    for k in _FIELDS:
        if k in row:
            put_field(s, k, row[k])
    fleet = sessions.fleet
    i = row.get("replica")
    rep = fleet.replicas[i] if type(i) is int and 0 <= i < len(fleet.replicas) else fleet.replicas[0]
    s.replica = rep
    rep.members[s.sid] = s
    s.policy = rep.policy
    sessions.by_id[s.sid] = s
    if s.lin.response_id is not None:
        sessions.responses[s.lin.response_id] = s
    tr = row.get("trail")
    if type(tr) is dict:
        t = s.lin.trail = Trail(tr.get("ns"))
        for k in _TRAIL:
            if k in tr and k != "indexed":
                setattr(t, k, tr[k])
        t.marks = array("Q", tr.get("marks") or ())
        if row.get("state") not in ("thinking", "released"):
            t.failed = True  # its turn died with the process: the same request again is a retry of it
        if tr.get("indexed"):
            sessions.lineage.index(s)
    return s
