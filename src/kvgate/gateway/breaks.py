"""Prefix breaks told from evictions: a session whose cached tokens fell while the pool had room broke its own
prefix; it was not evicted, and the regime alarm must not read its miss as the degraded regime.

Agents break their own prefixes: a per-request nonce in the first system block, a system reminder merged into the
leading system prompt by a system-first chat template, a compaction that rewrites the history, an old tool result
cleared. The turn then misses though the engine kept everything. A turn of a continuing session is a *prefix
break* when::

    cached < 1/2 x min(its previous prompt, this prompt)        (its cache fell; the previous prompt is at least
                                                               MIN_PREFIX tokens)
    and (lineage saw the request rewrite the history or change the head
         or the pool had room: no policy event since the session's previous turn left D above C, and the 1-minute
         hit ratio of the other agent turns is not degraded (>= 0.5, or unknown))

Its cause is "rewrite" or "head" (what lineage saw: :mod:`kvgate.gateway.lineage`), else "unseen" (a change lineage
cannot see, e.g. a cleared old tool result, or an engine that dropped the prefix on its own). A miss in a full or
degraded pool is an eviction, not a break. A break's turn stays out of the alarm's hit ratio
(:class:`kvgate.gateway.metrics.UsageWindows`); the session's context follows the rewrite (the estimator starts
over, and the turn's usage corrects it). No I/O, no clock.
"""

from __future__ import annotations

import math

MIN_PREFIX = 64
"""Tokens a previous prompt must have for a fall in cached tokens to mean anything."""
CAUSES = ("rewrite", "head", "unseen")


def prefix_break(prev_prompt: int, prompt: int, cached: int | None, note: str, pressed: bool,
                 hit_1m: float) -> str:
    """The cause of the turn's prefix break, "" when it is none (see the module docstring). ``prev_prompt``: the
    session's previous prompt tokens (< 0: no previous turn); ``note``: what lineage saw of the request;
    ``pressed``: D exceeded C since the session's previous turn; ``hit_1m``: the 1-minute agent hit ratio (NaN:
    none)."""
    if cached is None or prev_prompt < MIN_PREFIX:
        return ""
    if 2 * cached >= min(prev_prompt, prompt):
        return ""
    if note in ("rewrite", "head"):
        return note
    healthy = math.isnan(hit_1m) or hit_1m >= 0.5
    return "unseen" if not pressed and healthy else ""


class CacheNotes:
    """What a session record keeps for the prefix-break count (owner: this module; the session's lineage verdict
    and its turns' ends are told to it)."""

    __slots__ = ("note", "breaks", "last_break", "rewrites", "mark")

    def __init__(self) -> None:
        self.note = ""
        """What lineage saw of this turn's request: "rewrite" (history rewritten), "head" (head changed), ""."""
        self.breaks = 0
        """Turns whose cached tokens fell while the pool had room (prefix breaks)."""
        self.last_break = ""
        self.rewrites = 0
        """Turns that rewrote its history (compactions), as lineage or the client said."""
        self.mark = 0
        """The pool-pressure count when its last turn ended (:attr:`kvgate.gateway.sessions.Sessions.pressure`)."""

    def saw(self, note: str) -> None:
        """What lineage saw of this turn's request (a rewrite counts as one)."""
        self.note = note
        if note == "rewrite":
            self.rewrites += 1

    def broke(self, cause: str) -> None:
        """The turn was a prefix break of ``cause``."""
        self.breaks += 1
        self.last_break = cause

    def marked(self, pressure: int) -> None:
        """The turn ended at pool-pressure count ``pressure``."""
        self.mark = pressure
