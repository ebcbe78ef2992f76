"""What one client may cost the gateway's HTTP server: :class:`ServerLimits` (every bound, with defaults that an
agent's turns never meet), the counters of what was refused, and :class:`NodeCounter` (the JSON objects and
arrays of a request body, counted as its bytes arrive).

Each bound answers one way of holding the server or swelling it:

* ``head_timeout_s``: the request line and headers must arrive within it (from the connection's start, or from a
  request's first byte on a kept-alive connection), else 408 and the connection closes: a client trickling a
  head a byte at a time holds nothing for long.
* ``body_timeout_s`` and ``min_body_rate``: while a body is being read, every ``body_timeout_s`` window must bring
  ``min_body_rate`` bytes a second (or the rest of the body), else 408 and close.
* ``max_connections``: connections beyond it are answered 503 and closed at once; it is lowered at start to
  half the process's file-descriptor limit less a reserve (the other half: upstream connections, files).
* ``max_body``: a larger body is 413 before it is read (by ``Content-Length``) or as soon as it passes the
  bound (chunked).
* ``max_body_nodes``: a JSON body with more objects and arrays is 413, counted while it arrives (never parsed):
  each node costs ~100-200 bytes of Python objects once parsed and time for every pass over it (the parse, one
  C call, holds the event loop wherever it runs: ~14 ms at the default), so this bounds both the memory one
  request swells to and how long handling it can hold the loop. A string, number or literal counts
  1/:data:`SCALARS_PER_NODE` of a node (a flat array of 15 million small numbers, no node at all, took 0.5 s to
  parse). Bodies too short to exceed it (under two bytes a node) are not scanned at all.
* ``bodies_in_flight``: request body bytes held across all connections (being received, or whole and being
  handled); a request that would pass it is answered 503 with ``Retry-After`` and the connection closes.
* ``send_timeout_s``: a client that reads nothing of its answer this long, while bytes wait to go out to it (its
  socket full), is cut off: a stream's handler is cancelled, its upstream request with it.
* ``keepalive_s``: a connection idle between requests this long is closed.

Each is an option of ``kvgate gateway`` (:data:`OPTIONS`); what was refused is ``kvgate_http_refused_total`` by
reason (:class:`ServerCollector`).
"""

from __future__ import annotations

import contextlib
import gc
import resource
import threading
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

import numpy as _np
from prometheus_client.core import CounterMetricFamily, Metric

from kvgate.errors import UsageError
from kvgate.http.prometheus import ScrapeCollector, gauge, labelled

try:  # (the C backend: a Python event per JSON token, no Python per byte)
    from ijson.backends import yajl2_c as _yajl
except ImportError:  # pragma: no cover - ijson's wheels carry it
    _yajl = None

MAX_HEAD_BYTES = 64 << 10
"""Request line and headers together, every byte of them, at most (else 431 and the connection closes)."""

YIELD_BODY_BYTES = 256 << 10
"""Past this many bytes of a body the server reads it one chunk per event-loop step (reading paused until the
next): a loop like uvloop's reads a socket that keeps bringing bytes up to 32 times in one go, and the node
count of each chunk runs as it comes, so a fast client's 28 MB body would otherwise hold every other
connection until it was in."""

FD_RESERVE = 128
"""File descriptors kept back from client connections besides the upstream's half (logs, the state DB, sockets
of discovery and health checks)."""

REFUSALS = ("connections", "head_timeout", "body_timeout", "head_size", "body_size", "body_nodes", "body_budget",
            "send_timeout")
"""Why the server refused a connection or a request itself (the label of ``kvgate_http_refused_total``)."""


@dataclass(frozen=True)
class ServerLimits:
    """Every bound of :class:`kvgate.http.server.HttpServer` (see the module docstring)."""

    max_body: int = 32 << 20
    head_timeout_s: float = 30.0
    body_timeout_s: float = 30.0
    min_body_rate: int = 1024
    max_connections: int = 4096
    max_body_nodes: int = 64_000
    bodies_in_flight: int = 1 << 30
    send_timeout_s: float = 60.0
    keepalive_s: float = 75.0

    def connection_cap(self) -> int:
        """``max_connections``, lowered to what the file-descriptor limit leaves for clients."""
        soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
        if soft == resource.RLIM_INFINITY or soft <= 0:
            return self.max_connections
        return max(1, min(self.max_connections, (soft - FD_RESERVE) // 2))


OPTIONS = {
    "head_timeout_s": "--head-timeout", "body_timeout_s": "--body-timeout", "min_body_rate": "--min-body-rate",
    "max_connections": "--max-connections", "max_body_nodes": "--max-body-nodes",
    "bodies_in_flight": "--max-inflight-body-bytes", "send_timeout_s": "--send-timeout",
    "keepalive_s": "--keepalive-timeout",
}
"""The gateway option of each :class:`ServerLimits` field (``max_body``: ``--max-body-bytes``)."""


def check_limits(limits: ServerLimits) -> None:
    """:class:`UsageError` (naming the option) for a bound that is not a positive number."""
    for field, option in OPTIONS.items():
        v = getattr(limits, field)
        if not (isinstance(v, int | float) and v == v and 0 < v < float("inf")):
            raise UsageError(f"{option} must be a positive number, got {v}")
    if limits.bodies_in_flight < limits.max_body:
        raise UsageError(f"--max-inflight-body-bytes ({limits.bodies_in_flight}) must be at least --max-body-bytes "
                         f"({limits.max_body}): else a body within --max-body-bytes could never be served")


class ServerCollector(ScrapeCollector):
    """The server's families: what it refused by reason, connections open and their cap, body bytes held.
    ``server_of``: the :class:`kvgate.http.server.HttpServer` (None before it starts)."""

    def __init__(self, server_of: Any) -> None:
        self.server_of = server_of

    def collect(self) -> Iterator[Metric]:
        server = self.server_of()
        if server is None:
            return
        yield labelled(CounterMetricFamily, "kvgate_http_refused", "Connections and requests the HTTP server "
                       "refused itself, by reason (connections: over --max-connections; head_timeout, "
                       "body_timeout: too slow; head_size, body_size, body_nodes: too large; body_budget: over "
                       "--max-inflight-body-bytes; send_timeout: the client read nothing of its answer).", "reason",
                       server.refused, REFUSALS)
        load = server.load()
        yield gauge("kvgate_http_connections", "Client connections open.", load["connections"])
        yield gauge("kvgate_http_connection_cap", "Client connections served at once (--max-connections, lowered "
                    "to fit the file-descriptor limit).", server.connection_cap)
        yield gauge("kvgate_http_body_bytes_held", "Request body bytes held now (received or being received), "
                    "against --max-inflight-body-bytes.", load["body_bytes"])


def refusal_counter() -> Counter[str]:
    """A counter of refusals with every reason present (so each series exists from the start)."""
    return Counter(dict.fromkeys(REFUSALS, 0))


_KIND = itemgetter(0)
SCALARS_PER_NODE = 8
"""Strings, numbers and literals (``true``, ``false``, ``null``) counted as one node: parsing eight costs about
what one small object with its members does (a 128k-token id prompt is 16,000 nodes)."""


class _Collector:
    """:func:`no_collection`'s count of its callers (any thread) and whether the collector was on before them."""

    lock = threading.Lock()
    callers = 0
    was_on = False


@contextlib.contextmanager
def no_collection() -> Iterator[None]:
    """The cyclic garbage collector paused while a body is counted or read: those passes make hundreds of
    thousands of short-lived or acyclic objects (parser events, items' parts), and each full collection they
    would set off walks every object of the process holding the interpreter's lock (tens of ms a time, on the
    loop or beside it). Their objects are freed by reference counting; collection resumes after the last caller
    (if it was on before the first)."""
    c = _Collector
    with c.lock:
        if c.callers == 0:
            c.was_on = gc.isenabled()
            gc.disable()
        c.callers += 1
    try:
        yield
    finally:
        with c.lock:
            c.callers -= 1
            if c.callers == 0 and c.was_on:
                gc.enable()


class NodeCounter:
    """JSON objects and arrays of a body (and its scalar values, :data:`SCALARS_PER_NODE` a node), counted chunk
    by chunk. ``feed`` returns False once the count passes ``limit``; a body that is not JSON stops the count (the
    handler's own parse answers it).

    Two stages, the same verdict as the exact count alone. First a bound from three byte counts (C loops over
    the bytes, no event per token): an object or array opens with ``{`` or ``[``, and a value other than the
    document itself is its container's first (one a ``{`` or ``[``) or follows a ``,``, so the body has at most
    opens + (1 + opens + commas) / 8 nodes (opens: the ``{`` and ``[``), the same bytes inside strings only
    raising it. While the bound is within the limit the body
    is within it. Once it passes, the exact count (a yajl push parser; the events of one chunk counted and dropped)
    runs over every chunk from the first. An agent's turn (long strings, few small items) stays in the first stage:
    leaving it takes some 64,000 brackets and braces, or eight times as many commas; ``exact`` skips it."""

    __slots__ = ("limit", "nodes", "bound", "_seen", "_events", "send", "_coro", "_kinds", "_opens", "_commas")

    def __init__(self, limit: int, exact: bool = False) -> None:
        self.limit = limit
        self.nodes = 0
        """The exact count so far (0 while the bound holds: the body then has at most ``bound`` nodes)."""
        self.bound = 0
        """The bound so far (of ``_opens``, the ``{`` and ``[`` so far, and ``_commas``)."""
        self._seen: list[bytes] | None = None if exact else []
        """The chunks fed while the bound holds (the exact count starts from the first), or None in the exact
        stage."""
        self._events: list[tuple[str, Any]] = []
        self.send = self._events.append  # (the push parser's target: a C call per event)
        self._kinds: Counter[str] = Counter()
        self._coro: Any = None
        self._opens = 0
        self._commas = 0
        if exact:
            self._start()

    def _start(self) -> None:
        self._coro = _yajl.basic_parse_basecoro(self) if _yajl is not None else None

    def feed(self, data: bytes) -> bool:
        seen = self._seen
        if seen is not None:
            a = _np.frombuffer(data, _np.uint8)
            self._opens += int(_np.count_nonzero((a | 32) == 123))  # ({ is 0x7b, [ 0x5b: the one bit apart)
            self._commas += int(_np.count_nonzero(a == 44))
            self.bound = self._opens + (1 + self._opens + self._commas) // SCALARS_PER_NODE
            if self.bound <= self.limit:
                seen.append(data)
                return True
            self._seen = None
            self._start()
            for chunk in seen:
                if not self._exact(chunk):
                    return False
        return self._exact(data)

    def _exact(self, data: bytes) -> bool:
        coro = self._coro
        if coro is None:
            return True
        try:
            with no_collection():  # (an event tuple per token: freed at once, never a cycle)
                coro.send(data)
        except Exception:  # not JSON (or past its end): not this counter's to judge
            self._coro = None
        events = self._events
        if events:
            kinds = self._kinds
            kinds.update(map(_KIND, events))
            events.clear()
            scalars = kinds["string"] + kinds["number"] + kinds["boolean"] + kinds["null"]
            self.nodes = kinds["start_map"] + kinds["start_array"] + scalars // SCALARS_PER_NODE
        return self.nodes <= self.limit
