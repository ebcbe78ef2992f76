"""What one client may cost the HTTP server (:mod:`kvgate.http.limits`), each bound attacked over loopback as the
issue's attacker did, with small bounds so the attacks end fast: a head or a body trickled (slowloris), more
connections than the cap, bodies past the budget in flight, a body of many tiny JSON nodes. The bounds here are
hang guards or the limits' own values, never a measurement of the machine."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import time
from collections.abc import AsyncIterator

import pytest

from kvgate.errors import UsageError
from kvgate.http.limits import NodeCounter, ServerCollector, ServerLimits, check_limits
from kvgate.http.server import HttpServer, Request, Response, StreamResponse
from support.aio import timed

INFO = b"GET /info HTTP/1.1\r\nHost: x\r\n\r\n"


class App:
    """``/info`` answers at once; any other path echoes the body's length once ``release`` is set."""

    def __init__(self) -> None:
        self.release = asyncio.Event()
        self.release.set()
        self.bodies: list[int] = []
        self.cancelled = 0

    async def __call__(self, req: Request) -> Response:
        if req.path == "/flood":  # a stream of 4 MiB, or without end for ?forever
            out = StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(req)
            chunk = b"data: " + b"x" * (64 << 10) + b"\n\n"
            try:
                for _ in range(1 << 30 if "forever" in req.raw_path else 64):
                    await out.write(chunk)
            except asyncio.CancelledError:
                self.cancelled += 1
                raise
            await out.write_eof()
            return out
        if req.path != "/info":
            self.bodies.append(len(req.body))
            await self.release.wait()
        return Response(body=json.dumps({"path": req.path, "bytes": len(req.body)}).encode(),
                        content_type="application/json")


@contextlib.asynccontextmanager
async def serving(app: App, **kw: float) -> AsyncIterator[tuple[HttpServer, int]]:
    server = HttpServer(app, **kw)  # type: ignore[arg-type]
    port = await server.start("127.0.0.1", 0)
    try:
        yield server, port
    finally:
        app.release.set()
        await server.shutdown(1.0)


async def answer(reader: asyncio.StreamReader, timeout: float = 5.0) -> tuple[int, dict[str, str], bytes]:
    """The next response on ``reader`` (whole-body responses only); the timeout is a hang guard."""
    head = (await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), timeout)).decode("latin-1")
    lines = head.split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    body = await asyncio.wait_for(reader.readexactly(int(headers.get("content-length", "0"))), timeout)
    return int(lines[0].split()[1]), headers, body


async def closed(reader: asyncio.StreamReader, timeout: float = 5.0) -> bytes:
    """Everything until the server closes the connection (a hang guard: the server must close it)."""
    return await asyncio.wait_for(reader.read(), timeout)


@timed(20)
async def test_trickled_heads_are_answered_408_and_closed_at_the_head_deadline() -> None:
    """Slowloris on heads: many connections sending a head a byte at a time never finish it; each is closed with
    408 after ``head_timeout_s`` (plus the sweep's second), while a client with a whole head is served."""
    async with serving(App(), head_timeout_s=0.5) as (server, port):
        t0 = time.monotonic()  # (before any of them opened: each deadline runs from its connection's start)
        conns = [await asyncio.open_connection("127.0.0.1", port) for _ in range(40)]
        head = b"GET /slow HTTP/1.1\r\nHost: x\r\nX-Pad: " + b"a" * 1000
        for i in range(3):  # a byte each, now and then: they stay busy with their heads
            for _, w in conns:
                w.write(head[i:i + 1])
            await asyncio.sleep(0.05)
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(INFO)
        assert (await answer(r))[0] == 200
        w.close()
        for reader, writer in conns:
            got = await closed(reader)
            assert got.startswith(b"HTTP/1.1 408 ") and b'"code":408' in got.replace(b" ", b"")
            writer.close()
        assert time.monotonic() - t0 >= 0.5  # none closed before its deadline
        assert server.refused["head_timeout"] == 40
        assert server.load()["connections"] == 0


@timed(20)
async def test_a_trickled_body_is_408_when_a_window_brings_too_few_bytes() -> None:
    """Slowloris on bodies: a body promising 10,000 bytes and sending one every 0.1 s falls below
    ``min_body_rate`` over a ``body_timeout_s`` window: 408, closed, its bytes back in the budget; a body that
    keeps the rate is served."""
    app = App()
    async with serving(app, body_timeout_s=0.5, min_body_rate=100) as (server, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"POST /slow HTTP/1.1\r\nHost: x\r\nContent-Length: 10000\r\n\r\n")
        assert server.load()["body_bytes"] in (0, 10000)
        got = b""
        for _ in range(60):  # (a hang guard: 6 s of trickling)
            w.write(b"x")
            try:
                got = await asyncio.wait_for(r.read(), 0.1)
                break
            except TimeoutError:
                continue
        assert got.startswith(b"HTTP/1.1 408 "), got
        assert server.refused["body_timeout"] == 1 and server.load()["body_bytes"] == 0
        assert not app.bodies  # it never reached the handler
        w.close()

        r, w = await asyncio.open_connection("127.0.0.1", port)  # 400 bytes/s: above the floor
        w.write(b"POST /ok HTTP/1.1\r\nHost: x\r\nContent-Length: 600\r\n\r\n")
        for _ in range(15):
            w.write(b"y" * 40)
            await asyncio.sleep(0.1)
        status, _, body = await answer(r)
        assert (status, json.loads(body)["bytes"]) == (200, 600)
        w.close()


@timed(20)
async def test_connections_past_the_cap_get_503_and_are_closed() -> None:
    async with serving(App(), max_connections=10) as (server, port):
        assert server.connection_cap == 10
        held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(10)]
        while server.load()["connections"] < 10:
            await asyncio.sleep(0.01)
        extra = [await asyncio.open_connection("127.0.0.1", port) for _ in range(5)]
        for r, w in extra:
            got = await closed(r)
            assert got.startswith(b"HTTP/1.1 503 ") and b"Retry-After: 1" in got
            w.close()
        assert server.refused["connections"] == 5
        r, w = held[0]  # the ones within the cap are served
        w.write(INFO)
        assert (await answer(r))[0] == 200
        for _, w in held:
            w.close()
        while server.load()["connections"]:
            await asyncio.sleep(0.01)
        r, w = await asyncio.open_connection("127.0.0.1", port)  # room again
        w.write(INFO)
        assert (await answer(r))[0] == 200
        w.close()


@timed(30)
async def test_a_client_that_reads_nothing_of_its_answer_is_cut_off() -> None:
    """Slow read: a client asks for a stream and never reads it. Its socket fills, the handler waits; after
    ``send_timeout_s`` without a byte read the connection is aborted and the handler cancelled (before, both
    were held for as long as the client liked). A client that reads is not."""
    app = App()
    async with serving(app, send_timeout_s=0.5) as (server, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"GET /flood HTTP/1.1\r\nHost: x\r\n\r\n")  # all 4 MiB, read as it comes
        head = await asyncio.wait_for(r.readuntil(b"\r\n\r\n"), 5)
        assert head.startswith(b"HTTP/1.1 200 ")
        got, tail = 0, b""
        while not tail.endswith(b"\r\n0\r\n\r\n"):
            chunk = await asyncio.wait_for(r.read(1 << 16), 10)
            assert chunk, "closed before the end of the stream"
            got, tail = got + len(chunk), (tail + chunk)[-16:]
        assert got > 4 << 20 and server.refused["send_timeout"] == 0
        w.close()

        r, w = await asyncio.open_connection("127.0.0.1", port)  # the same, never read
        w.write(b"GET /flood?forever HTTP/1.1\r\nHost: x\r\n\r\n")
        while not app.cancelled:  # (a hang guard: the test's own timeout)
            await asyncio.sleep(0.05)
        assert server.refused["send_timeout"] == 1
        while server.load()["connections"]:
            await asyncio.sleep(0.01)
        w.close()


def test_the_cap_stays_below_the_file_descriptor_limit(monkeypatch: pytest.MonkeyPatch) -> None:
    import resource

    monkeypatch.setattr(resource, "getrlimit", lambda _: (1024, 4096))
    assert ServerLimits(max_connections=100_000).connection_cap() == (1024 - 128) // 2
    assert ServerLimits(max_connections=50).connection_cap() == 50


@timed(20)
async def test_bodies_past_the_budget_in_flight_get_503_with_retry_after() -> None:
    """Two requests whose bodies are held (one being handled, one being received) fill the budget; a third is
    503 with Retry-After before its body is read; once they are done their bytes are back."""
    app = App()
    app.release.clear()
    async with serving(app, bodies_in_flight=10_000, max_body=8_000) as (server, port):
        r1, w1 = await asyncio.open_connection("127.0.0.1", port)
        w1.write(b"POST /a HTTP/1.1\r\nHost: x\r\nContent-Length: 6000\r\n\r\n" + b"a" * 6000)
        while not app.bodies:
            await asyncio.sleep(0.01)
        r2, w2 = await asyncio.open_connection("127.0.0.1", port)
        w2.write(b"POST /b HTTP/1.1\r\nHost: x\r\nContent-Length: 3000\r\n\r\n" + b"b" * 100)  # still arriving
        while server.load()["body_bytes"] < 9000:
            await asyncio.sleep(0.01)
        r3, w3 = await asyncio.open_connection("127.0.0.1", port)
        w3.write(b"POST /c HTTP/1.1\r\nHost: x\r\nContent-Length: 2000\r\n\r\n")
        status, headers, body = await answer(r3)
        assert (status, headers["retry-after"]) == (503, "1") and json.loads(body)["error"]["code"] == 503
        assert server.refused["body_budget"] == 1
        w3.close()
        r4, w4 = await asyncio.open_connection("127.0.0.1", port)  # one without a body is served meanwhile
        w4.write(INFO)
        assert (await answer(r4))[0] == 200
        app.release.set()
        w2.write(b"b" * 2900)
        assert (await answer(r1))[0] == 200 and (await answer(r2))[0] == 200
        while server.load()["body_bytes"]:
            await asyncio.sleep(0.01)
        for w in (w1, w2, w4):
            w.close()


@timed(30)
async def test_a_body_of_many_tiny_nodes_is_413_while_it_arrives_and_others_are_served() -> None:
    """The issue's body (1M tiny messages, under the size limit) is refused by its node count as it arrives,
    never parsed; requests on other connections are answered while it is being received."""
    body = json.dumps({"messages": [{"role": "user", "content": "a"}] * 1_000_000}, separators=(",", ":")).encode()
    app = App()
    async with serving(app, max_body=64 << 20, max_body_nodes=100_000) as (server, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        w.write(b"POST /big HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body))
        step = 1 << 16
        info_r, info_w = await asyncio.open_connection("127.0.0.1", port)
        answered_during = 0
        got = b""
        for i in range(0, len(body), step):
            try:
                w.write(body[i:i + step])
                await w.drain()
            except ConnectionError:
                break
            if i % (step * 16) == 0 and server.refused["body_nodes"] == 0:
                info_w.write(INFO)
                assert (await answer(info_r))[0] == 200
                answered_during += 1
            if r.at_eof() or server.refused["body_nodes"]:
                break
        got = await closed(r)  # (the server lingers, dropping the rest of the body: no reset takes its answer)
        assert got.startswith(b"HTTP/1.1 413 ") and b"JSON objects and arrays" in got
        assert answered_during >= 2 and server.refused["body_nodes"] == 1 and not app.bodies
        assert server.load()["body_bytes"] == 0
        info_w.close()
        w.close()


def test_the_node_counter_counts_objects_and_arrays_across_chunks() -> None:
    doc = json.dumps({"a": [{"b": [1, 2]}, {"c": {}}], "d": "[{not nodes}]"}).encode()
    for cut in range(1, len(doc)):
        nc = NodeCounter(100, exact=True)
        assert nc.feed(doc[:cut]) and nc.feed(doc[cut:])
        assert nc.nodes == 6, cut  # (the root, a, two objects, b, c's {})
    nc = NodeCounter(5)
    assert not nc.feed(doc)


def test_the_node_counters_bound_gives_the_exact_counts_verdict() -> None:
    """Whatever the document, the limit and the cuts, the bound's first stage says what the exact count says at
    every chunk: it only ever skips the count for a body the count would pass."""
    rng = random.Random(7)

    def value(depth: int) -> object:
        r = rng.random()
        if depth > 3 or r < 0.3:
            return rng.choice([1, -2.5, True, None, "x", "a,b:[c]{d}", ""])
        if r < 0.65:
            return [value(depth + 1) for _ in range(rng.randrange(5))]
        return {f"k{i}": value(depth + 1) for i in range(rng.randrange(5))}

    def flat() -> object:  # (scalars only: where the eighths decide)
        k = rng.randrange(600)
        return [1] * k if rng.random() < 0.5 else {f"k{i}": None for i in range(k)}

    for i in range(600):
        top = flat() if i % 2 else [value(0) for _ in range(rng.randrange(1, 30))]
        doc = json.dumps(top, separators=(",", ":")).encode()
        cuts = sorted(rng.sample(range(1, len(doc)), min(3, len(doc) - 1)))
        chunks = [doc[a:b] for a, b in zip([0, *cuts], [*cuts, len(doc)], strict=True)]
        limit = rng.randrange(1, 80)
        fast, exact = NodeCounter(limit), NodeCounter(limit, exact=True)
        for chunk in chunks:
            said = exact.feed(chunk)
            assert fast.feed(chunk) == said, (doc, limit)
            if not said:
                break
    # an agent's turn (long strings) is never counted exactly, however long
    turn = json.dumps({"messages": [{"role": "tool", "content": "w " * 50_000}] * 40}).encode()
    nc = NodeCounter(1_000)
    assert nc.feed(turn) and nc.nodes == 0 and nc.bound < 1_000


def test_bounds_must_be_positive_and_the_budget_fit_one_body() -> None:
    check_limits(ServerLimits())
    for bad in ({"head_timeout_s": 0.0}, {"max_connections": 0}, {"min_body_rate": -1},
                {"body_timeout_s": float("nan")}, {"bodies_in_flight": 1000, "max_body": 2000}):
        with pytest.raises(UsageError):
            check_limits(ServerLimits(**bad))  # type: ignore[arg-type]


@timed(10)
async def test_refusals_are_exported_by_reason() -> None:
    async with serving(App(), max_connections=1) as (server, port):
        r, w = await asyncio.open_connection("127.0.0.1", port)
        while server.load()["connections"] < 1:
            await asyncio.sleep(0.01)
        r2, w2 = await asyncio.open_connection("127.0.0.1", port)
        await closed(r2)
        fams = {f.name: f for f in ServerCollector(lambda: server).collect()}
        refused = {s.labels["reason"]: s.value for s in fams["kvgate_http_refused"].samples}
        assert refused["connections"] == 1 and set(refused) >= {"head_timeout", "body_timeout", "body_budget"}
        assert fams["kvgate_http_connection_cap"].samples[0].value == 1
        assert list(ServerCollector(lambda: None).collect()) == []
        w.close()
        w2.close()
