"""What the gateway tells the client about a turn, in the response's headers (docs/gateway.md, "Response headers")."""

from __future__ import annotations

from kvgate.gateway.fleet import Fleet
from kvgate.gateway.sessions import GwSession
from kvgate.policy.limits import Control

PARK_WAIT_HEADER = "X-Kvgate-Park-Wait"
"""On every turn's response: seconds (gateway time) the policy held the turn before it went upstream ("0": none)."""
HOLD_HEADER = "X-Kvgate-Hold"
""""none", "parked" (an admitted session parked at its turn boundary) or "waiting" (a new session not yet
admitted)."""
CONTROL_HEADER = "X-Kvgate-Control"
"""The control that released the turn, as its spec (``budgeter:low=0.7:high=0.9``)."""
SESSION_REPLY_HEADER = "X-Kvgate-Session"
"""The session the turn was resolved to (its id as the client named it; a lineage session's: the gateway's)."""
LINEAGE_HEADER = "X-Kvgate-Lineage"
"""For a request no source named: how lineage resolved it (continue, retry, rewrite, fork, replay, new), and
``;head`` or ``;rewrite`` when it saw the head change or the history rewritten."""


class TurnHeaders:
    """The headers of a turn's response; the control's spec rendered once per control object."""

    def __init__(self, fleet: Fleet) -> None:
        self._fleet = fleet
        self._spec_of: tuple[Control | None, str] = (None, "")
        self._specs: dict[int, tuple[Control, str]] = {}
        """Each live control's spec by identity (a fleet's replicas each run their own control object)."""

    def of(self, s: GwSession, hold: str, wait: float, lineage: str = "") -> list[tuple[str, str]]:
        """What the gateway did with the turn: its hold and wait, the control, the session and how it was found."""
        policy = s.policy
        limit = policy.control if policy is not None else self._fleet.control
        if limit is not self._spec_of[0]:
            got = self._specs.get(id(limit))
            if got is None or got[0] is not limit:
                if len(self._specs) > 256:  # (controls replaced by switches and replicas' new books)
                    self._specs.clear()
                got = self._specs[id(limit)] = (limit, limit.spec())
            self._spec_of = got
        out = [(PARK_WAIT_HEADER, "0" if not wait else f"{wait:.6f}"), (HOLD_HEADER, hold),
               (CONTROL_HEADER, self._spec_of[1])]
        if not s.anonymous:
            out.append((SESSION_REPLY_HEADER, s.name.label))
            if lineage:
                out.append((LINEAGE_HEADER, lineage + (f";{s.cache.note}" if s.cache.note else "")))
        return out
