"""Lineage: which session a request that names none belongs to, read from the conversation it carries.

Theory of operation. An agent resends its whole history every turn, so turn k+1's items begin with turn k's::

    request k     | head | i_1 | i_2 | ... | i_m |
    request k+1   | head | i_1 | i_2 | ... | i_m | reply | tool result | ... |
                          '-root-'    '-- tip --'   (the digest of request k's last TIP_ITEMS items)

A session keeps its *trail* (:class:`Trail`): the digest of its first item (the root), of its head (system prompt,
instructions), the item count m of its last request and the digest of that request's last
:data:`~kvgate.gateway.probe.TIP_ITEMS` items (the tip), the (count, tip) of its first and last :data:`MARKS`
requests (fork points), and the length of its text. The request is read by :class:`~kvgate.gateway.probe.Probe`.
Digests (64-bit BLAKE2b) are of each item as its API reads it (``(role, text, tool calls)``:
:meth:`kvgate.http.dialect.Api.parts`), so an item the client re-serialises differently (a moved ``cache_control``
marker) keeps its digest. A request is matched against the sessions with its root (an index by root, the most
recent :data:`CANDIDATES` looked at, and an index by (root, m, tip) for the continuation itself, its most recent
:data:`CANDIDATES` too)::

    1. continue  an idle session with tip (m, t) where m < n and tip(R, m) == t (the longest such m decides)
    2. retry     an idle session whose last turn failed, its last request sent again (m == n, same tip)
    3. fork      a busy session at (1) or (2): a new session, the child of that one; the same request sent again
                 after it finished, or an earlier request of a session sent again, with the same head and API (the
                 same conversation, not another run's with the same task text): a replay, a new child session
    4. rewrite   an idle session with the root and a request of at most half its last one's items or under half
                 its text: the history was rewritten (a compaction that kept the task); it continues, and says so
    5. fork      one of a session's earlier requests past its first extended (m_j < n): a new session, its child
    6. rewrite   an idle session with the root and a shorter request that shares no more than its first request
    7. fork      its first request extended (not shorter, or the session busy): a new session, its child
    8. rewrite   an idle session whose last answer's longest line is a line of the request (a compaction that kept
                 only the summary; answers read whole, not streamed ones)
    9. new       none of these: a new session

The head is compared apart: a changed head (a nonce in the first system block, a system reminder merged into it)
keeps the session, and :attr:`Found.note` says ``head``. Completions prompts (text, or token ids read from the raw
body as they were sent) are matched by chained CRCs at chunk boundaries (256 bytes doubling to 4 KiB, then every
4 KiB): a session is indexed by its last prompt's last boundary, and a request continues it when its bytes begin
with that whole prompt.

Cost. Only what identifies a continuation is hashed: the root, the items at the candidates' tips and what is new
(every item's digest is computed at most once per request, on demand); a first turn hashes its items once. The
completions prompt is one CRC pass over its bytes. Memory: a trail is a few hundred bytes (:meth:`Lineage.stats`
reports it), named sessions keep a trail but no index entry. Sessions leave the index when they end.

Limits. A middle item rewritten while the first, the tip and the count stay (a cleared old tool result) is not seen
as a rewrite: the session continues (its cached tokens fall, as the prefix-break count sees). Two conversations
whose items are all equal are one to lineage until they differ.

Nothing here does I/O or reads a clock.
"""

from __future__ import annotations

import contextlib
import zlib
from array import array
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from kvgate.gateway.probe import FIRST_BOUNDARY, Probe, prompt_bytes
from kvgate.http.dialect import Api

MARKS = 8
"""Earlier requests a session remembers as fork points, besides its first."""
CANDIDATES = 32
"""Sessions with one root looked at for a fork or a rewrite (the most recent)."""
REPLY_LINE = 64
"""Shortest answer line indexed for rule 5 (characters)."""
Key = tuple[Any, ...]


class Trail:
    """What lineage keeps of one session."""

    __slots__ = ("ns", "root", "head", "n", "tip", "chars", "marks", "failed", "indexed", "reply", "plen", "pcrc",
                 "bound", "bcrc", "api")

    def __init__(self, ns: Any) -> None:
        self.ns = ns
        self.api = ""
        """The API of its last request."""
        self.root = 0
        self.head = 0
        self.n = 0
        """Items of the last request (0: none yet, or a prompt session)."""
        self.tip = 0
        self.chars = 0
        self.marks = array("Q")
        """(count, digest) of its first request, then of its last MARKS requests, flattened."""
        self.failed = False
        """The last turn failed or was aborted: the same request again is a retry."""
        self.indexed = False
        self.reply: int | None = None
        """The digest of the longest line of its last answer (rule 5), when indexed."""
        self.plen = 0
        self.pcrc = 0
        self.bound = 0
        self.bcrc = 0


class LineageNotes:
    """The lineage part of a session record (owner: this module; its trail moves with :meth:`Lineage.record`)."""

    __slots__ = ("trail", "response_id", "side_requests", "offers_tools")
    def __init__(self) -> None:
        self.trail: Trail | None = None
        """What lineage keeps of its conversation."""
        self.response_id: str | None = None
        """Its last answer's id (a Responses ``previous_response_id`` names the session by it)."""
        self.side_requests = 0
        """Side requests sent under its id (a title, a summary), each served as a one-turn session of its own."""
        self.offers_tools = False
        """Its turns offer tools: a request under its id offering none, not continuing it, is a side request."""

    def answered(self, rid: str | None) -> None:
        self.response_id = rid

    def restart(self) -> None:
        self.trail = None

    def sided(self, n: int, tools: bool) -> None:
        """``n`` more side requests came under its id; ``tools``: this turn offers tools."""
        self.side_requests += n
        self.offers_tools = self.offers_tools or tools


@dataclass(slots=True)
class Found:
    """What lineage made of a request: ``kind`` is continue, retry, rewrite (of ``session``), fork, replay (a new
    session, the child of ``session``) or new; ``note`` is "head" when the head changed."""

    kind: str
    session: Any = None
    note: str = ""


NEW = Found("new")


class Lineage:
    """The index of sessions by what their conversations began with and where they stand."""

    def __init__(self) -> None:
        # NOTE: keys are hashes of the fields they stand for and values a session, or a list of sessions when
        # several share a key: ~1 KB a session all told. A hit is checked against the session's trail (a hash may
        # collide), so a collision costs a look, never a wrong match.
        self._tips: dict[int, Any] = {}
        """hash(ns, root, m, tip) -> the sessions whose last request had m items ending with tip."""
        self._roots: dict[int, Any] = {}
        """hash(ns, root) -> the session with that root, or a :class:`_Bucket` of several."""
        self._replies: dict[Key, Any] = {}
        self._chunks: dict[int, Any] = {}
        """hash(ns, boundary, crc) -> the prompt sessions whose last prompt's last boundary that is."""
        self.sessions = 0
        """Sessions indexed."""
        self.counts: dict[str, int] = dict.fromkeys(("continue", "retry", "fork", "replay", "rewrite", "new"), 0)

    # -- reading a request --------------------------------------------------------------------------------------
    @staticmethod
    def probe(api: Api, body: dict[str, Any], raw: bytes, ns: Any) -> Probe | None:
        """The request as lineage reads it; None when it carries no conversation or single prompt to follow."""
        read = getattr(api, "read_probe", None)  # (a large body's, read off the loop: kvgate.gateway.bodies)
        if read is not None:
            return read(body, raw, ns)  # type: ignore[no-any-return]
        if api.chat_like:
            conv = api.conversation(body)
            if conv is None or not conv[1]:
                return None
            return Probe(api, ns, conv[0], conv[1])
        data = prompt_bytes(body, raw)  # (shorter than the first boundary: nothing to follow it by)
        return None if data is None or len(data) < FIRST_BOUNDARY else Probe(api, ns, [], [], data)

    def find(self, p: Probe) -> Found:
        """Which session the request continues (the rules of the module docstring)."""
        found = self._find_prompt(p) if p.data is not None else self._find(p)
        self.counts[found.kind] += 1
        return found

    def _find(self, p: Probe) -> Found:
        ns, root = p.ns, p.root
        bucket = self._roots.get(hash((ns, root)))
        if bucket is None:
            return self._by_reply(p)
        if type(bucket) is _Bucket:
            lengths: Any = sorted(bucket.lengths, reverse=True)
            members = bucket.members
        else:
            lengths, members = (bucket.lin.trail.n,), {bucket: None}
        for m in lengths:  # 1-3: the longest tip the request reaches decides
            if m > p.n:
                continue
            tip = p.tip(m)
            got = [s for s in _recent(self._tips.get(hash((ns, root, m, tip))))
                   if (t := s.lin.trail).tip == tip and t.n == m and t.root == root and t.ns == ns]
            if not got:
                continue
            idle = [s for s in got if not s.slot.busy and not s.slot.dropped]
            if not idle:
                return Found("fork", got[0])
            if m < p.n:
                s = self._prefer(idle, p)
                return Found("continue", s, self._note(s, p))
            failed = [s for s in idle if s.lin.trail.failed]
            if failed:
                s = self._prefer(failed, p)
                return Found("retry", s, self._note(s, p))
            head, api = p.head_digest, p.api.name
            same = [s for s in idle if (t := s.lin.trail).head == head and t.api == api]  # (_same, inline)
            if same:
                return Found("replay", same[0])
        recent = [s for s in _last(members, CANDIDATES) if (t := s.lin.trail).root == root and t.ns == ns]
        for s in recent:  # an earlier request sent again: a replay
            marks = s.lin.trail.marks
            for k in range(0, len(marks), 2):
                if marks[k] == p.n and p.tip(p.n) == marks[k + 1] and self._same(s, p):
                    return Found("replay", s)
        for s in recent:  # much shorter than the session's last: rewritten (compacted)
            t = s.lin.trail
            if self._idle(s) and p.n >= 2 and (2 * p.n <= t.n or 2 * p.chars < t.chars):
                return Found("rewrite", s, self._note(s, p))
        for s in recent:  # an earlier request extended (past its first): a fork
            marks = s.lin.trail.marks
            for k in range(len(marks) - 2, 1, -2):
                m = marks[k]
                if m < p.n and p.tip(m) == marks[k + 1]:
                    return Found("fork", s)
        for s in recent:  # shorter, sharing no more than its first request: rewritten
            if self._idle(s) and 2 <= p.n < s.lin.trail.n:
                return Found("rewrite", s, self._note(s, p))
        for s in recent:  # its first request extended: a fork
            marks = s.lin.trail.marks
            if marks and marks[0] < p.n and p.tip(marks[0]) == marks[1]:
                return Found("fork", s)
        return self._by_reply(p)

    @staticmethod
    def _same(s: Any, p: Probe) -> bool:
        """Whether the session's conversation is the request's (its head and API): a replay's test, so that another
        run sending the same task text under another system prompt or API is a new session."""
        return s.lin.trail.head == p.head_digest and s.lin.trail.api == p.api.name

    @staticmethod
    def _idle(s: Any) -> bool:
        return not s.slot.busy and not s.slot.dropped

    def _by_reply(self, p: Probe) -> Found:
        if not self._replies:
            return NEW
        for it in p.items[:8]:
            for line in p.api.parts(it)[1].splitlines():
                if len(line) >= REPLY_LINE:
                    s = self._replies.get((p.ns, _line_digest(line)))
                    if s is not None and not s.slot.busy and not s.slot.dropped:
                        return Found("rewrite", s, self._note(s, p))
        return NEW

    def _find_prompt(self, p: Probe) -> Found:
        data = p.data or b""
        crcs = p.crcs()
        busy = None
        for b in sorted(crcs, reverse=True):
            for s in _all(self._chunks.get(hash((p.ns, b, crcs[b])))):
                t = s.lin.trail
                if t.bound != b or t.bcrc != crcs[b] or t.ns != p.ns:
                    continue
                if t.plen > len(data) or zlib.crc32(memoryview(data)[b:t.plen], crcs[b]) != t.pcrc:
                    continue
                if s.slot.busy or s.slot.dropped:
                    busy = busy or s
                elif t.plen < len(data):
                    return Found("continue", s)
                elif t.failed:
                    return Found("retry", s)
                else:
                    return Found("replay", s)
        return NEW if busy is None else Found("fork", busy)

    @staticmethod
    def _prefer(sessions: list[Any], p: Probe) -> Any:
        """The session with the request's head, else the first."""
        for s in sessions:
            if s.lin.trail.head == p.head_digest:
                return s
        return sessions[0]

    @staticmethod
    def _note(s: Any, p: Probe) -> str:
        return "head" if s.lin.trail is not None and p.head and s.lin.trail.head != p.head_digest else ""

    def compare(self, s: Any, p: Probe) -> Found:
        """A named session's request against its own trail: rewrite (the history is not its last one extended),
        continue (with ``head`` noted when the head changed), or new (no trail yet)."""
        t = s.lin.trail
        if t is None or (t.n == 0 and t.plen == 0):
            return NEW
        if p.data is not None:
            data = p.data
            ok = t.plen <= len(data) and zlib.crc32(memoryview(data)[: t.plen]) == t.pcrc
            return Found("continue" if ok else "rewrite", s)
        ok = t.n <= p.n and p.tip(t.n) == t.tip and p.root == t.root
        return Found("continue" if ok else "rewrite", s, self._note(s, p))

    def follow(self, s: Any, p: Probe) -> str:
        """A named session's request, :meth:`compare` then :meth:`record` (unindexed) in one: its note, "rewrite"
        (count its context afresh), "head" (the head changed) or ""."""
        t = s.lin.trail
        if t is None or t.indexed or p.data is not None:
            got = self.compare(s, p)
            self.record(s, p, index=False)
            return "rewrite" if got.kind == "rewrite" else got.note
        root, head, n = p.root, p.head_digest, p.n
        if t.n == 0 and t.plen == 0:
            note = ""
        elif t.n <= n and p.tip(t.n) == t.tip and root == t.root:
            note = "head" if p.head and t.head != head else ""
        else:
            note = "rewrite"
        t.failed = False
        t.api = p.api.name
        t.root, t.head, t.n, t.tip = root, head, n, p.tip(n)
        marks = t.marks
        if len(marks) >= 2 * (MARKS + 1):
            del marks[2:4]
        marks.extend((n, t.tip))
        return note

    # -- keeping the index ------------------------------------------------------------------------------------
    def record(self, s: Any, p: Probe, index: bool) -> None:
        """The session ``s`` sends request ``p`` now: its trail moves there (and its index entries, if indexed)."""
        t = s.lin.trail
        if t is None:
            t = s.lin.trail = Trail(p.ns)
        if t.indexed:
            self.unindex(s)
        t.failed = False
        t.api = p.api.name
        if p.data is not None:
            t.plen = len(p.data)
            t.pcrc = zlib.crc32(p.data)
            crcs = p.crcs()
            t.bound = max(crcs) if crcs else 0
            t.bcrc = crcs.get(t.bound, 0)
        else:
            extends = t.n and t.n <= p.n and p.root == t.root and p.tip(t.n) == t.tip
            if index:  # the text length (rule 4): what is new, when the request extends the last
                t.chars = t.chars + p.new_chars(t.n) if extends else p.chars
            t.root, t.head, t.n, t.tip = p.root, p.head_digest, p.n, p.tip(p.n)
            marks = t.marks
            if len(marks) >= 2 * (MARKS + 1):
                del marks[2:4]  # keep the first request, drop the oldest of the rest
            marks.extend((t.n, t.tip))
        if index:
            self.index(s)

    def failed(self, s: Any) -> None:
        """The session's last turn failed or was aborted: sending it again is a retry."""
        if s.lin.trail is not None:
            s.lin.trail.failed = True

    def replied(self, s: Any, text: str) -> None:
        """The session's last answer (read whole): its longest line, for rule 5."""
        t = s.lin.trail
        if t is None or not t.indexed or not text:
            return
        if t.reply is not None:
            self._replies.pop((t.ns, t.reply), None)
        line = max(text.splitlines(), key=len, default="")
        if len(line) < REPLY_LINE:
            t.reply = None
            return
        t.reply = _line_digest(line)
        self._replies[(t.ns, t.reply)] = s

    def forget(self, s: Any) -> None:
        """The session ended: out of the index (its trail stays on it, unindexed)."""
        t = s.lin.trail
        if t is not None and t.indexed:
            self.unindex(s)
            if t.reply is not None and self._replies.get((t.ns, t.reply)) is s:
                del self._replies[(t.ns, t.reply)]
            t.reply = None

    def index(self, s: Any) -> None:
        """Index the session by its trail (also a trail restored from the books)."""
        t = s.lin.trail
        t.indexed = True
        self.sessions += 1
        if t.n:
            _add(self._tips, hash((t.ns, t.root, t.n, t.tip)), s)
            rk = hash((t.ns, t.root))
            got = self._roots.get(rk)
            if got is None:
                self._roots[rk] = s
                return
            if type(got) is not _Bucket:
                got = self._roots[rk] = _Bucket(got)
            got.add(s)
        elif t.bound:
            _add(self._chunks, hash((t.ns, t.bound, t.bcrc)), s)

    def unindex(self, s: Any) -> None:
        t = s.lin.trail
        t.indexed = False
        self.sessions -= 1
        if t.n:
            _drop(self._tips, hash((t.ns, t.root, t.n, t.tip)), s)
            rk = hash((t.ns, t.root))
            got = self._roots.get(rk)
            if got is s:
                del self._roots[rk]
            elif type(got) is _Bucket:
                got.remove(s)
                if len(got.members) == 1:
                    self._roots[rk] = next(iter(got.members))
        elif t.bound:
            _drop(self._chunks, hash((t.ns, t.bound, t.bcrc)), s)

    def stats(self) -> dict[str, Any]:
        """What the index holds (``GET /v1/sessions``, ``/kvgate/info``): sessions, entries, resolutions."""
        return {"sessions": self.sessions, "roots": len(self._roots), "tips": len(self._tips),
                "prompt_chunks": len(self._chunks), "reply_lines": len(self._replies), "resolved": dict(self.counts)}




def _line_digest(line: str) -> int:
    return zlib.crc32(line.strip().encode("utf-8", "surrogatepass")) << 32 | (len(line.strip()) & 0xFFFFFFFF)


def _last(members: dict[Any, None], k: int) -> Iterator[Any]:
    """The last ``k`` keys of an ordered set, most recent first."""
    for i, s in enumerate(reversed(members)):
        if i >= k:
            return
        yield s


class _Bucket:
    """The sessions that share a root (forks, replays, conversations that began alike), and their last requests'
    item counts."""

    __slots__ = ("members", "lengths")

    def __init__(self, s: Any) -> None:
        self.members: dict[Any, None] = {}
        self.lengths: dict[int, int] = {}
        self.add(s)

    def add(self, s: Any) -> None:
        self.members[s] = None
        n = s.lin.trail.n
        self.lengths[n] = self.lengths.get(n, 0) + 1

    def remove(self, s: Any) -> None:
        if self.members.pop(s, 1) is None:
            n = s.lin.trail.n
            left = self.lengths.get(n, 0) - 1
            if left > 0:
                self.lengths[n] = left
            else:
                self.lengths.pop(n, None)


def _recent(got: Any) -> Any:
    """The sessions of an index value, at most the :data:`CANDIDATES` indexed last (in the order indexed): the
    same conversation replayed again and again (rollouts of one task) makes one key's list long, and a request
    looks at its most recent sessions only."""
    if got is None:
        return ()
    if type(got) is not list:
        return (got,)
    return got if len(got) <= CANDIDATES else got[-CANDIDATES:]


def _all(got: Any) -> Any:
    """The sessions of an index value: none, one, or a list."""
    if got is None:
        return ()
    return got if type(got) is list else (got,)


def _add(index: dict[int, Any], key: int, s: Any) -> None:
    got = index.get(key)
    if got is None:
        index[key] = s
    elif type(got) is list:
        got.append(s)
    else:
        index[key] = [got, s]


def _drop(index: dict[int, Any], key: int, s: Any) -> None:
    got = index.get(key)
    if got is s:
        del index[key]
    elif type(got) is list:
        with contextlib.suppress(ValueError):
            got.remove(s)
        if len(got) == 1:
            index[key] = got[0]
