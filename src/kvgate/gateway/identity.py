"""Whose turn is this? The one place a request's session is resolved, in a documented order (``--session-from``).

Agents name their sessions in their own ways, or not at all. The sources, in the default order (kvgate's own
first, then the harnesses', then the APIs' body fields, then the conversation itself)::

    source            what names the session                                           parent (a child session)
    header            --session-header (X-Session-ID; opencode's X-Session-Id too)     x-parent-session-id
    body              body session_id (vLLM's)
    claude-code       x-claude-code-session-id; a subagent adds x-claude-code-agent-id   x-claude-code-parent-agent-id,
                      (its session: SESSION/agent:ID)                                    else the main session
    codex             thread-id (not session-id: a cache key that forks reuse)          x-codex-parent-thread-id, or
                                                                                       x-codex-turn-metadata's
                                                                                       parent_thread_id or
                                                                                       forked_from_thread_id
    opencode          x-session-affinity                                               x-parent-session-id
    litellm           x-litellm-session-id (OpenHands through LiteLLM)
    dynamo            x-dynamo-session-id
    anthropic         body metadata.user_id ending in _session_<id> (or a JSON string with session_id)
    responses         body previous_response_id: the session that produced that response
    prompt-cache-key  body prompt_cache_key
    user              body user (OpenAI's end-user id)
    lineage           the conversation itself (:mod:`kvgate.gateway.lineage`)

The first source that names a session wins. ``--session-from`` picks and orders them (``header,lineage``); the
default is all of them in the order above. A request no source names is a one-turn session.

Codex marks a turn that compacts its history (``x-codex-turn-metadata``'s ``request_kind: compaction``):
:attr:`Named.compaction`.

With client keys (``--api-key``) a session belongs to the key that opened it: the same id from another key names
another session (:func:`scoped`), so one client can neither reach another's session nor time its cache through it.

Nothing here does I/O; reading a request costs a few header lookups and dict gets.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import orjson

from kvgate.errors import UsageError
from kvgate.gateway.lineage import Found, Lineage
from kvgate.gateway.probe import Probe
from kvgate.http.dialect import Api

if TYPE_CHECKING:
    from kvgate.gateway.sessions import GwSession, Sessions

SOURCES = ("header", "body", "claude-code", "codex", "opencode", "litellm", "dynamo", "anthropic", "responses",
           "prompt-cache-key", "user", "lineage")
"""Every source of a session id, in the default order."""
MAX_ID = 256
"""Longest session id taken (longer ones are not ids)."""


@dataclass(slots=True)
class Named:
    """A session a request names."""

    sid: str
    """The id as the client named it (:func:`scoped` makes it the gateway's)."""
    source: str
    parent: str | None = None
    """The session this one is a child of (a subagent's main session, a fork's origin)."""
    compaction: bool = False
    """The client says this turn rewrites (compacts) its history."""


def parse_session_from(text: str) -> tuple[str, ...]:
    """``--session-from``: ``auto`` (every source, default order) or a comma-separated list of sources."""
    t = str(text).strip().lower()
    if t in ("", "auto", "all"):
        return SOURCES
    out = []
    for part in t.split(","):
        p = part.strip()
        if p not in SOURCES:
            raise UsageError(f"--session-from: unknown source {p!r}; choose from auto, {', '.join(SOURCES)}")
        if p in out:
            raise UsageError(f"--session-from: {p!r} is given twice")
        out.append(p)
    return tuple(out)


def scoped(sid: str, client: int | None) -> str:
    """The gateway's id of a session a client named: the client key's number after it (none without keys)."""
    return sid if client is None else f"{sid}@k{client}"


@dataclass(slots=True)
class Resolution:
    """Which session a request is a turn of."""

    sid: Any
    """The gateway's id (an int for a one-turn session)."""
    client: int | None
    named: Named | None = None
    """What named it explicitly (None: lineage, or nothing)."""
    probe: Probe | None = None
    """Its conversation as lineage reads it (named sessions: to see rewrites; unnamed: to find the session)."""
    found: Found | None = None
    """Lineage's verdict, for a request no source named."""

    @property
    def anonymous(self) -> bool:
        return self.named is None and self.found is None

    @property
    def lineage(self) -> str:
        """How lineage resolved it ("" when a source named it)."""
        return "" if self.found is None else self.found.kind


class Resolver:
    """Resolves every request's session: the explicit sources in the configured order, then lineage."""

    def __init__(self, sources: tuple[str, ...], session_header: str, sessions: Sessions | None = None) -> None:
        self.sources = sources
        self.lineage = "lineage" in sources
        self._header = session_header
        self._sessions = sessions
        self._by_response: Callable[[str], str | None] = (
            (lambda _rid: None) if sessions is None else sessions.by_response)
        readers: dict[str, Callable[[Mapping[str, str], dict[str, Any]], Named | None]] = {
            "header": self._named_header, "body": _body_session, "claude-code": _claude_code, "codex": _codex,
            "opencode": _opencode, "litellm": _header_source("x-litellm-session-id", "litellm"),
            "dynamo": _header_source("x-dynamo-session-id", "dynamo"), "anthropic": _anthropic,
            "responses": self._previous_response,
            "prompt-cache-key": _body_field("prompt_cache_key", "prompt-cache-key"),
            "user": _body_field("user", "user"),
        }
        self._readers = [readers[s] for s in sources if s != "lineage"]

    def named(self, headers: Mapping[str, str], body: dict[str, Any]) -> Named | None:
        """The session the request names explicitly, by the first source that names one; None when none does."""
        for read in self._readers:
            got = read(headers, body)
            if got is not None:
                return got
        return None

    def resolve(self, headers: Mapping[str, str], body: dict[str, Any], raw: bytes, api: Api,
                client: int | None) -> Resolution:
        """The request's session: named by a source, else found (or started) by lineage, else a one-turn one."""
        sessions = self._sessions
        assert sessions is not None
        named = self.named(headers, body)
        if named is not None:
            probe = Lineage.probe(api, body, raw, client) if api.chat_like else None
            return Resolution(scoped(named.sid, client), client, named, probe)
        if self.lineage:
            probe = Lineage.probe(api, body, raw, client)
            if probe is not None:
                found = sessions.lineage.find(probe)
                if found.kind in ("continue", "retry", "rewrite"):
                    return Resolution(found.session.sid, client, None, probe, found)
                return Resolution(scoped(sessions.lineage_id(), client), client, None, probe, found)
        return Resolution(sessions.anonymous_id(), client)

    def bind(self, s: GwSession, r: Resolution) -> bool:
        """The session ``s`` now holds the turn of request ``r``: name a new record, note what lineage saw of the
        request (``s.cache.note``), move its trail. True when its history was rewritten (count its context afresh)."""
        sessions = self._sessions
        assert sessions is not None
        if not s.name.source and not s.anonymous:
            s.name.client = r.client
            if r.named is not None:
                s.name.source, s.name.label, s.name.parent = r.named.source, r.named.sid, r.named.parent
            else:
                s.name.source, s.name.label = "lineage", str(s.sid).rsplit("@k", 1)[0]
                if r.found is not None and r.found.kind in ("fork", "replay"):
                    s.name.parent = r.found.session.name.label
        note = ""
        if r.probe is not None:
            if r.found is None and r.named is not None:
                note = sessions.lineage.follow(s, r.probe)
            else:
                got = r.found if r.found is not None else sessions.lineage.compare(s, r.probe)
                note = "rewrite" if got.kind == "rewrite" else got.note
                sessions.lineage.record(s, r.probe, index=r.named is None)
        s.cache.saw(note)
        return note == "rewrite"

    def _named_header(self, headers: Mapping[str, str], body: dict[str, Any]) -> Named | None:
        v = _id(headers.get(self._header))
        if v is None:
            return None
        parent = _id(headers.get("x-parent-session-id"))  # (opencode's subagents send their own id and it)
        return Named(v, "header", parent if parent != v else None)

    def _previous_response(self, headers: Mapping[str, str], body: dict[str, Any]) -> Named | None:
        rid = body.get("previous_response_id")
        if type(rid) is not str:
            return None
        sid = self._by_response(rid)
        return None if sid is None else Named(sid, "responses")


def _id(v: Any) -> str | None:
    """A usable id: a non-empty string (an int as its text) of at most :data:`MAX_ID` printable characters."""
    if type(v) is int:
        v = str(v)
    if type(v) is not str or not v or len(v) > MAX_ID or not v.isprintable():
        return None
    return v


def _header_source(name: str, source: str) -> Callable[[Mapping[str, str], dict[str, Any]], Named | None]:
    def read(headers: Mapping[str, str], body: dict[str, Any]) -> Named | None:
        v = _id(headers.get(name))
        return None if v is None else Named(v, source)

    return read


def _body_field(key: str, source: str) -> Callable[[Mapping[str, str], dict[str, Any]], Named | None]:
    def read(headers: Mapping[str, str], body: dict[str, Any]) -> Named | None:
        v = _id(body.get(key))
        return None if v is None else Named(v, source)

    return read


_body_session = _body_field("session_id", "body")


def _claude_code(headers: Mapping[str, str], body: dict[str, Any]) -> Named | None:
    main = _id(headers.get("x-claude-code-session-id"))
    if main is None:
        return None
    agent = _id(headers.get("x-claude-code-agent-id"))
    if agent is None:
        return Named(main, "claude-code")
    parent = _id(headers.get("x-claude-code-parent-agent-id"))
    return Named(f"{main}/agent:{agent}", "claude-code", f"{main}/agent:{parent}" if parent else main)


def _codex(headers: Mapping[str, str], body: dict[str, Any]) -> Named | None:
    thread = _id(headers.get("thread-id"))
    meta = _json_object(headers.get("x-codex-turn-metadata"))
    if thread is None:
        return None
    parent = _id(headers.get("x-codex-parent-thread-id")) or _id(meta.get("parent_thread_id")) or _id(
        meta.get("forked_from_thread_id"))
    return Named(thread, "codex", parent if parent != thread else None, meta.get("request_kind") == "compaction")


def _opencode(headers: Mapping[str, str], body: dict[str, Any]) -> Named | None:
    v = _id(headers.get("x-session-affinity"))
    if v is None:
        return None
    parent = _id(headers.get("x-parent-session-id"))
    return Named(v, "opencode", parent if parent != v else None)


_SESSION_MARK = "_session_"


def _anthropic(headers: Mapping[str, str], body: dict[str, Any]) -> Named | None:
    meta = body.get("metadata")
    user = meta.get("user_id") if type(meta) is dict else None
    if type(user) is not str:
        return None
    if user.startswith("{"):  # a JSON string: {"device_id": ..., "account_uuid": ..., "session_id": ...}
        v = _id(_json_object(user).get("session_id"))
    else:
        i = user.rfind(_SESSION_MARK)
        v = _id(user[i + len(_SESSION_MARK):]) if i >= 0 else None
    return None if v is None else Named(v, "anthropic")


def _json_object(text: Any) -> dict[str, Any]:
    if type(text) is not str or not text.startswith("{"):
        return {}
    try:
        obj = orjson.loads(text)
    except ValueError:
        return {}
    return obj if type(obj) is dict else {}
