"""What ``GET /v1/sessions`` shows of a session, and the audit of the session records against the policy cores
(both O(sessions): inspection, never the request path)."""

from __future__ import annotations

from typing import Any

from kvgate.gateway.sessions import ANON_PREFIX, GwSession, Sessions
from kvgate.policy import SessionState

_HELD = frozenset({SessionState.WAITING, SessionState.PARKED})
_ADMITTED = frozenset({SessionState.RUNNING, SessionState.THINKING})


# -- inspection ----------------------------------------------------------------------------------------
def session_row(s: GwSession, now: float) -> dict[str, Any]:
    """One session as ``GET /v1/sessions`` lists it."""
    policy = s.policy
    known = s.known_to_policy and policy is not None
    return {
        "id": s.name.label if not s.anonymous else f"{ANON_PREFIX}{s.sid}",
        "client": s.name.client,
        "source": s.name.source,
        "parent": s.name.parent,
        "state": policy.state_of(s.sid).value if known else ("released" if s.released else "new"),  # type: ignore[union-attr]
        "replica": None if s.replica is None else s.replica.url,
        "context_tokens": s.est.context,
        "output_tokens": s.est.output,
        "demand_tokens": policy.demand_of(s.sid) if known else 0,  # type: ignore[union-attr]
        "resident_tokens": None if s.replica is None or s.replica.events is None else s.replica.events.known(s.sid),
        "turns": s.est.turns,
        "last_prompt_tokens": s.est.prompt_tokens if s.est.prompt_tokens >= 0 else None,
        "last_cached_tokens": s.est.cached_tokens if s.est.cached_tokens >= 0 else None,
        "idle_s": None if s.slot.busy else round(now - s.last_active, 3),
        "end_after_turn": s.slot.end_after,
        "prefix_breaks": s.cache.breaks,
        "last_break": s.cache.last_break or None,
        "rewrites": s.cache.rewrites,
        "side_requests": s.lin.side_requests,
    }

def audit(sessions: Sessions) -> dict[str, Any]:
    """Cross-check the session records against the policy cores (O(n)); see :meth:`Gateway.audit`.

    ``replicas``: per replica, D_r as its books hold it and the true sum over the sessions admitted there;
    ``misplaced``: sessions known to a policy that is not their replica's (or placed on a down replica while
    known to one, with per-replica books)."""
    fleet = sessions.fleet
    admitted = 0
    unknown = []
    held_policy = 0
    misplaced = 0
    per: dict[int, int] = {r.index: 0 for r in fleet.replicas}
    for sid, s in sessions.by_id.items():
        policy = s.policy
        if not s.known_to_policy or policy is None:
            if not s.slot.busy and not s.replaced and not s.released:
                unknown.append(sid)
            continue
        rep = s.replica
        if rep is None or policy is not rep.policy or (not rep.up and fleet.shared is None):
            misplaced += 1
        state = policy.state_of(sid)
        if state in _ADMITTED:
            d = policy.demand_of(sid)
            admitted += d
            if rep is not None:
                per[rep.index] += d
        elif state in _HELD:
            held_policy += 1
    counts = fleet.counts()
    orphans = counts["in_system"] - sum(1 for s in sessions.by_id.values() if s.known_to_policy)
    replicas = [{"replica": r.url, "up": r.up, "demand": fleet.stats(r)["demand_tokens"],
                 "admitted_demand": per[r.index]} for r in fleet.replicas]
    return {
        "demand": fleet.demand,
        "admitted_demand": admitted,
        "sessions": len(sessions.by_id),
        "in_system": counts["in_system"],
        "unknown": unknown,
        "orphans": orphans,
        "held_policy": held_policy,
        "idle": len(sessions.idle),
        "released": len(sessions.released),
        "misplaced": misplaced,
        "replicas": replicas,
    }


def books_summary(sessions: Sessions) -> dict[str, Any]:
    """Released and resumed sessions, the release bound, prefix breaks (O(1))."""
    return {"released": len(sessions.released), "resumed": sessions.resumed,
            "release_after_s": round(sessions.think.bound(sessions.idle_s), 3),
            "prefix_breaks": sum(sessions.breaks.values()), "side_requests": sessions.side_requests}


def books_state(sessions: Sessions) -> dict[str, Any]:
    """What lineage holds, the think times and the release bound, the sessions kept (O(1))."""
    return {"lineage": sessions.lineage.stats(), "think_times": sessions.think.state(),
            "release_after_s": round(sessions.think.bound(sessions.idle_s), 3), "idle_timeout_s": sessions.idle_s,
            "released": len(sessions.released), "resumed": sessions.resumed, "sessions_kept": len(sessions.by_id),
            "max_sessions": sessions.max_sessions, "prefix_breaks": dict(sessions.breaks)}

