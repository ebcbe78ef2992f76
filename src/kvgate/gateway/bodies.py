"""Large request bodies read off the event loop, turns kept in the order they arrived.

Between a turn's last body byte and its upstream send the gateway reads the body several times: the parse, the
session's lineage (each item's role, text and tool calls, digests, the text's length), the context estimate and,
for a start-over, the ``/tokenize`` ask. For a body of 200,000 messages that is most of a second of Python, and on
the event loop it holds every other request (``/kvgate/info`` included) as long. What of it only reads the body
(:func:`read_body`) and what only reads the body and the session's own history (the estimate, the ask:
:func:`off_loop`) is pure; what touches shared state (the session index, lineage's index, the policy, the books)
is not. For a body of ``--offload-body-bytes`` or more the pure part runs on one worker thread
(:data:`THREAD_NAME`); a smaller body is read inline, as before (a thread hop would cost more than its parse).

Order. Turns enter the shared part in the order their bodies arrived (:class:`Gate`): a turn takes a ticket when
its handler starts and enters when every earlier ticket has entered (or left: a refused or cancelled request).
While a turn's pure part runs on the thread after it entered (its estimate), no later turn enters. So the
shared state sees exactly the sequence it saw when each turn's work ran on the loop in one piece: two turns of
one session, and a lineage lookup against the sessions before it, behave as before; what else the loop does
(other endpoints, answers relayed, other sessions' upstream answers) goes on meanwhile.

What still runs on the loop for a large body: the node count as its bytes arrive (:mod:`kvgate.http.limits`),
the join of its chunks, the shared part (a few digests and dict lookups) and the upstream write. The parse itself
is one C call that holds the interpreter's lock wherever it runs: ``--max-body-nodes`` bounds it. The worker runs
with the cyclic collector paused and a short switch interval (:func:`worker_pass`), and frees what a large turn
read (:func:`dispose`).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import sys
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from itertools import accumulate
from typing import Any, TypeVar

import orjson

from kvgate.errors import ClientError
from kvgate.gateway.estimate import tokenize_body
from kvgate.gateway.lineage import Lineage
from kvgate.gateway.probe import Probe
from kvgate.gateway.stream import loads
from kvgate.http.dialect import Api, Parts
from kvgate.http.limits import no_collection

OFFLOAD_BYTES = 256 << 10
"""``--offload-body-bytes``: bodies of at least this many bytes are read off the event loop."""
THREAD_NAME = "kvgate-body"
"""The name prefix of the thread large bodies are read on."""

T = TypeVar("T")
_VIEWS: dict[type, type] = {}
_pool: ThreadPoolExecutor | None = None


def pool() -> ThreadPoolExecutor:
    """The one worker thread of the process's gateways (one body at a time: the interpreter's lock lets no
    two run at once anyway, and one bounds the memory of bodies being expanded to one)."""
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=THREAD_NAME)
    return _pool


class Gate:
    """Turns into the shared part in the order they arrived: :meth:`ticket` when a request's handler starts,
    :meth:`enter` when its body is read (waits for the earlier tickets), :meth:`leave` for one that never enters,
    :meth:`hold` while an entered turn's pure part runs off the loop (later tickets wait)."""

    __slots__ = ("_issued", "_turn", "_left", "_waiting", "_held")

    def __init__(self) -> None:
        self._issued = 0
        self._turn = 0  # the next ticket to enter
        self._left: set[int] = set()  # tickets given up before their turn
        self._waiting: dict[int, asyncio.Future[None]] = {}
        self._held = 0

    @property
    def queued(self) -> int:
        """Tickets issued that have not entered or left."""
        return self._issued - self._turn - len(self._left)

    def ticket(self) -> int:
        t = self._issued
        self._issued += 1
        return t

    async def enter(self, t: int) -> None:
        """Wait until ``t`` is next (every earlier ticket entered or left) and no entered turn holds the gate."""
        while t != self._turn or self._held:
            fut = self._waiting[t] = asyncio.get_running_loop().create_future()
            try:
                await fut
            finally:
                del self._waiting[t]
        self._pass()

    def leave(self, t: int) -> None:
        """Ticket ``t`` will not enter (its request was refused or cancelled before its turn)."""
        if t == self._turn:
            self._pass()
        elif t > self._turn:
            self._left.add(t)

    def _pass(self) -> None:
        turn = self._turn + 1
        while turn in self._left:
            self._left.discard(turn)
            turn += 1
        self._turn = turn
        self._wake()

    def _wake(self) -> None:
        fut = self._waiting.get(self._turn)
        if fut is not None and not fut.done() and not self._held:
            fut.set_result(None)

    async def hold(self, fut: asyncio.Future[T]) -> T:
        """``await fut`` with no later turn entering meanwhile."""
        self._held += 1
        try:
            return await fut
        finally:
            self._held -= 1
            self._wake()


class Bodies:
    """How a gateway's turns read their bodies: inline below ``threshold`` bytes, else on the worker thread."""

    def __init__(self, threshold: int = OFFLOAD_BYTES) -> None:
        self.threshold = threshold
        self.gate = Gate()
        self.offloaded = 0
        """Bodies read off the event loop."""

    def parse_now(self, raw: bytes, api: Api) -> dict[str, Any] | None:
        """A small body parsed at once when no earlier turn is still to enter (the common case: what
        :meth:`parse` would do, without a coroutine); None where :meth:`parse` must wait or read it off the loop."""
        gate = self.gate
        if len(raw) >= self.threshold or gate._turn != gate._issued or gate._held:
            return None
        body = json_object(raw)  # (a ClientError takes no ticket)
        gate._issued = gate._turn = gate._turn + 1  # (its ticket, entered: no later one is issued to wake)
        return body

    async def parse(self, raw: bytes, api: Api, client: int | None) -> tuple[dict[str, Any], Api]:
        """The body as a JSON object and the API to read it with (for a large body: a view of ``api`` that has
        read every item and the lineage probe already, :class:`ReadApi`), once every earlier turn entered;
        :class:`ClientError` for a body that is not a JSON object."""
        gate = self.gate
        t = gate.ticket()
        try:
            if len(raw) < self.threshold:
                got: tuple[dict[str, Any], Api] = (json_object(raw), api)
            else:
                self.offloaded += 1
                got = await asyncio.get_running_loop().run_in_executor(pool(), read_body, raw, api, client, gate)
        except BaseException:
            gate.leave(t)
            raise
        try:
            await gate.enter(t)
        except BaseException:
            gate.leave(t)
            raise
        return got



def dispose(api: Api, *objs: Any) -> None:
    """Let the worker free what a large body's turn read (``api`` its :class:`ReadApi`; hundreds of thousands of
    objects: ms of deallocation): handed over once the turn's frames are gone (the loop's next step), so the
    worker's references are the last. A small body's go as they would."""
    if isinstance(api, ReadApi):
        asyncio.get_running_loop().call_soon(pool().submit, _drop, api, objs)


def _drop(*objs: Any) -> None:
    """Nothing: the objects go when the work item does (on the worker)."""


def json_object(raw: bytes) -> dict[str, Any]:
    """The body parsed; :class:`ClientError` unless it is a JSON object."""
    try:
        body = loads(raw)
    except ValueError as e:
        raise ClientError(f"malformed JSON body: {e}") from None
    if type(body) is not dict:
        raise ClientError("the body must be a JSON object")
    return body


async def off_loop(api: Api, fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)``: pure work on a turn's body (and its session's own history): inline, or for a large body
    (``api`` is its :class:`ReadApi`) on the worker thread, no later turn entering the shared part meanwhile."""
    if not isinstance(api, ReadApi):
        return fn(*args)
    gate: Gate = api.__dict__["_gate"]
    return await gate.hold(asyncio.get_running_loop().run_in_executor(pool(), quietly, fn, *args))


SWITCH_S = 0.001
"""The interpreter's switch interval while the worker reads a body (5 ms by default): how soon the event loop's
thread gets the interpreter's lock back when it wakes (a probe's answer takes two or three wake-ups)."""


@contextlib.contextmanager
def worker_pass() -> Iterator[None]:
    """The worker's pass over a body: the collector paused (:func:`kvgate.http.limits.no_collection`), the
    switch interval at :data:`SWITCH_S` (there is one worker: nothing else sets it meanwhile)."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(min(before, SWITCH_S))
    try:
        with no_collection():
            yield
    finally:
        sys.setswitchinterval(before)


def quietly(fn: Callable[..., T], *args: Any) -> T:
    """``fn(*args)`` on the worker (:func:`worker_pass`)."""
    with worker_pass():
        return fn(*args)


def read_body(raw: bytes, api: Api, client: int | None, gate: Gate) -> tuple[dict[str, Any], Api]:
    """The pure pass over a large body (run on the worker thread): the parse, every item read as its API reads
    it, lineage's probe with its text length and digests."""
    with worker_pass():
        body = json_object(raw)
        return body, ReadApi.of(api, body, raw, client, gate)


class ReadApi:
    """An :class:`~kvgate.http.dialect.Api` whose ``conversation`` of one body and ``parts`` of its items were
    read already (a copy of the API object with those two methods answered from what was read); lineage takes its
    :meth:`read_probe` (:meth:`kvgate.gateway.lineage.Lineage.probe`). Any other body or item is read as by the
    API itself."""

    @staticmethod
    def of(api: Api, body: dict[str, Any], raw: bytes, client: int | None, gate: Gate) -> Api:
        kind = type(api)
        cls = _VIEWS.get(kind)
        if cls is None:
            cls = _VIEWS[kind] = type(f"Read{kind.__name__}", (ReadApi, kind), {})
        view: Api = object.__new__(cls)
        view.__dict__.update(api.__dict__)
        conv = api.conversation(body)
        parts: dict[int, Parts] = {}  # (by id: the conversation, kept here, keeps its items alive)
        if conv is not None:
            read_parts = api.parts
            for it in conv[0]:
                parts[id(it)] = read_parts(it)
            for it in conv[1]:
                parts[id(it)] = read_parts(it)
        read = view.__dict__
        read["_api"], read["_body"], read["_conv"], read["_read"], read["_ns"] = api, body, conv, parts, client
        read["_gate"] = gate
        read["_probe"] = _probe(view, api, body, raw, client, conv)
        return view

    def conversation(self, body: dict[str, Any]) -> tuple[list[Any], list[Any]] | None:
        d = self.__dict__
        if body is d["_body"]:
            conv: tuple[list[Any], list[Any]] | None = d["_conv"]
            return conv
        return super().conversation(body)  # type: ignore[misc]

    def parts(self, item: Any) -> Parts:
        got: Parts | None = self.__dict__["_read"].get(id(item))
        return got if got is not None else super().parts(item)  # type: ignore[misc]

    def read_probe(self, body: dict[str, Any], raw: bytes, ns: Any) -> Probe | None:
        d = self.__dict__
        if body is d["_body"] and ns == d["_ns"]:
            return d["_probe"]  # type: ignore[no-any-return]
        return Lineage.probe(d["_api"], body, raw, ns)


def _probe(view: ReadApi, api: Api, body: dict[str, Any], raw: bytes, ns: Any,
           conv: tuple[list[Any], list[Any]] | None) -> Probe | None:
    """Lineage's probe of the body, its items read, digested at the ends and its text's length counted."""
    if not api.chat_like:
        p = Lineage.probe(api, body, raw, ns)
        if p is not None:
            p.crcs()
        return p
    if conv is None or not conv[1]:
        return None
    p = ReadProbe(api, ns, conv[0], conv[1], view.parts)  # (the API itself: no cycle through the view)
    p.root, p.head_digest, p.tip(p.n)  # noqa: B018 (computed and kept)
    return p


class ReadProbe(Probe):
    """A probe whose items were read as a whole: their text lengths summed once, so the length of any tail of
    them (:meth:`new_chars`) costs nothing on the loop."""

    __slots__ = ("_sums",)

    def __init__(self, api: Api, ns: Any, head: list[Any], items: list[Any], parts: Callable[[Any], Parts]
                 ) -> None:
        super().__init__(api, ns, head, items)
        read = self._parts
        for i, it in enumerate(items):
            read[i] = parts(it)
        self._sums = [0, *accumulate(len(read[i][1]) for i in range(self.n))]
        self._chars = self._sums[-1]

    def new_chars(self, start: int) -> int:
        return self._sums[-1] - self._sums[min(max(start, 0), self.n)]


ENCODE_ITEMS = 512
"""Messages of a ``/tokenize`` ask encoded by one call (each call holds the interpreter's lock)."""


def tokenize_ask(api: Api, body: dict[str, Any]) -> bytes | None:
    """The ``/tokenize`` request of a start-over (:func:`kvgate.gateway.estimate.tokenize_body`), encoded as
    ``orjson.dumps`` would, its messages :data:`ENCODE_ITEMS` at a time (a 28 MB ask in one call would hold the
    interpreter's lock, and so the loop, ~20 ms)."""
    ask = tokenize_body(api, body)
    if ask is None:
        return None
    msgs = ask.pop("messages")
    rest = orjson.dumps(ask)  # (what follows the messages, in their order: {"add_generation_prompt":...})
    batches = [orjson.dumps(msgs[i:i + ENCODE_ITEMS])[1:-1] for i in range(0, len(msgs), ENCODE_ITEMS)]
    return b"".join((b'{"messages":[', b",".join(batches), b"],", rest[1:]))


def keyed_tokenize_ask(api: Api, body: dict[str, Any]) -> tuple[bytes, bytes] | None:
    """:func:`tokenize_ask` and its digest (SHA-256's first 16 bytes: where the CPU has SHA instructions, as x86-64
    and arm64 servers do, ~2.5x faster than BLAKE2b, 86 against 208 us for a 128 KB ask; hashlib lets the
    interpreter's lock go while it hashes a large ask), by which an engine's count of the same ask is found again
    without asking."""
    ask = tokenize_ask(api, body)
    return None if ask is None else (ask, hashlib.sha256(ask).digest()[:16])
