"""The gateway's upstream client against scripted raw HTTP servers on loopback: framing, reuse, failures."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvgate.http.upstream import (
    HIGH_WATER,
    UpstreamConnectError,
    UpstreamDisconnected,
    UpstreamPool,
    UpstreamProtocolError,
)
from support.aio import timed

Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter, int], Awaitable[None]]


class Server:
    """A raw server: ``handler(reader, writer, connection number)`` runs per connection."""

    def __init__(self, handler: Handler) -> None:
        self.handler = handler
        self.connections = 0
        self.requests: list[bytes] = []
        self.server: asyncio.Server | None = None
        self.port = 0

    async def __aenter__(self) -> Server:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        self.port = self.server.sockets[0].getsockname()[1]
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self.server is not None
        self.server.close()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self.server.wait_closed(), 2)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        try:
            await self.handler(reader, writer, self.connections)
        except (ConnectionError, asyncio.IncompleteReadError):
            pass
        finally:
            writer.close()

    async def read_request(self, reader: asyncio.StreamReader) -> bytes:
        """One request (head and Content-Length body); b"" when the client closed the connection."""
        try:
            head = await reader.readuntil(b"\r\n\r\n")
        except asyncio.IncompleteReadError:
            return b""
        n = 0
        for line in head.split(b"\r\n"):
            if line.lower().startswith(b"content-length:"):
                n = int(line.split(b":")[1])
        body = await reader.readexactly(n) if n else b""
        self.requests.append(head + body)
        return head + body


def ok(body: bytes, extra: bytes = b"") -> bytes:
    return b"HTTP/1.1 200 OK\r\nContent-Type: application/json\r\nContent-Length: %d\r\n%s\r\n" % (
        len(body), extra) + body


def chunked(parts: list[bytes]) -> bytes:
    out = b"HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nTransfer-Encoding: chunked\r\n\r\n"
    for p in parts:
        out += b"%x\r\n%s\r\n" % (len(p), p)
    return out + b"0\r\n\r\n"


@contextlib.asynccontextmanager
async def pool_on(server: Server, **kw: float) -> AsyncIterator[UpstreamPool]:
    pool = UpstreamPool("127.0.0.1", server.port, **kw)  # type: ignore[arg-type]
    try:
        yield pool
    finally:
        await pool.close()


async def serve_ok(srv: Server) -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _n: int) -> None:
        while await srv.read_request(reader):
            writer.write(ok(b'{"ok":true}'))
            await writer.drain()

    return handler


@timed(10)
async def test_keep_alive_reuses_one_connection_and_sends_the_head_it_should() -> None:
    srv = Server(None)  # type: ignore[arg-type]
    srv.handler = await serve_ok(srv)
    async with srv, pool_on(srv) as pool:
        for i in range(3):
            resp = await pool.request("POST", "/v1/x?a=1", [("X-Session-ID", f"s{i}")], b'{"a":1}')
            assert resp.status == 200 and resp.content_type == "application/json"
            assert await resp.read() == b'{"ok":true}'
            assert pool.acquired == 1
            resp.release()
            assert (pool.acquired, pool.idle) == (0, 1)
        assert srv.connections == 1
        head = srv.requests[0].decode()
        assert head.startswith("POST /v1/x?a=1 HTTP/1.1\r\n")
        assert f"Host: 127.0.0.1:{srv.port}\r\n" in head and "X-Session-ID: s0\r\n" in head
        assert "Content-Length: 7\r\n" in head and head.endswith('\r\n\r\n{"a":1}')


@timed(10)
async def test_chunked_body_arrives_piece_by_piece() -> None:
    gate = asyncio.Event()

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _n: int) -> None:
        await srv.read_request(reader)
        full = chunked([b"data: 1\n\n", b"data: 2\n\n"])
        cut = full.index(b"data: 2")
        writer.write(full[:cut])
        await writer.drain()
        await gate.wait()
        writer.write(full[cut:])
        await writer.drain()
        await srv.read_request(reader)

    srv = Server(handler)
    async with srv, pool_on(srv) as pool:
        resp = await pool.request("POST", "/s", [], b"{}")
        assert await resp.readany() == b"data: 1\n\n"  # before the rest was even sent
        gate.set()
        assert await resp.read() == b"data: 2\n\n"
        assert await resp.readany() == b""
        resp.release()
        assert pool.idle == 1


@timed(10)
async def test_body_delimited_by_close_and_head_request() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        req = await srv.read_request(reader)
        if req.startswith(b"HEAD"):
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\n")  # no body for HEAD
            await writer.drain()
            await asyncio.sleep(0.5)
            return
        writer.write(b"HTTP/1.1 200 OK\r\nConnection: close\r\n\r\nuntil the end")
        await writer.drain()

    srv = Server(handler)
    async with srv, pool_on(srv) as pool:
        resp = await pool.request("GET", "/metrics", [])
        assert await resp.read() == b"until the end"
        resp.release()
        assert pool.idle == 0  # not reusable
        resp = await pool.request("HEAD", "/", [])
        assert resp.status == 200 and resp.content_length == 5
        assert await asyncio.wait_for(resp.read(), 0.3) == b""
        resp.release()
        assert (pool.acquired, pool.idle) == (0, 0)


@timed(10)
async def test_a_connection_closed_while_idle_is_replaced_without_an_error() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        await srv.read_request(reader)
        writer.write(ok(b"%d" % n))
        await writer.drain()
        # then close: the client still holds the connection as idle

    srv = Server(handler)
    async with srv, pool_on(srv) as pool:
        for n in (1, 2, 3):
            resp = await pool.request("POST", "/", [], b"x")
            assert await resp.read() == b"%d" % n
            resp.release()
            await asyncio.sleep(0.05)
        assert srv.connections == 3


@timed(10)
async def test_upstream_failures_are_typed() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, n: int) -> None:
        req = await srv.read_request(reader)
        if b"/mid" in req:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 100\r\n\r\nonly part")
            await writer.drain()
        elif b"/bad" in req:
            writer.write(b"NOT HTTP AT ALL\r\n\r\n")
            await writer.drain()
            await asyncio.sleep(0.2)
        elif b"/silent" in req:
            await asyncio.sleep(2)
        elif b"/slowbody" in req:
            writer.write(b"HTTP/1.1 200 OK\r\nContent-Length: 10\r\n\r\nabc")
            await writer.drain()
            await asyncio.sleep(2)

    srv = Server(handler)
    async with srv, pool_on(srv, read_timeout=0.2) as pool:
        resp = await pool.request("GET", "/mid", [])
        with pytest.raises(UpstreamDisconnected):
            await resp.read()
        resp.close()
        with pytest.raises(UpstreamProtocolError):
            await pool.request("GET", "/bad", [])
        loop = asyncio.get_running_loop()
        t0 = loop.time()
        with pytest.raises(TimeoutError):
            await pool.request("GET", "/silent", [])
        assert loop.time() - t0 < 1.0
        resp = await pool.request("GET", "/slowbody", [])
        assert await resp.readany() == b"abc"
        with pytest.raises(TimeoutError):
            await resp.readany()
        resp.close()
        assert (pool.acquired, pool.idle) == (0, 0)
    closed = UpstreamPool("127.0.0.1", srv.port)  # the server is gone now
    with pytest.raises(UpstreamConnectError):
        await closed.request("GET", "/", [])
    await closed.close()


@timed(10)
async def test_informational_response_then_the_real_one() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _n: int) -> None:
        await srv.read_request(reader)
        writer.write(b"HTTP/1.1 100 Continue\r\n\r\n" + ok(b"done"))
        await writer.drain()
        await srv.read_request(reader)

    srv = Server(handler)
    async with srv, pool_on(srv) as pool:
        resp = await pool.request("POST", "/", [], b"x")
        assert resp.status == 200 and await resp.read() == b"done"
        resp.release()


@timed(10)
async def test_reading_pauses_while_the_reader_is_behind() -> None:
    size = 4 * HIGH_WATER
    payload = bytes(range(256)) * (size // 256)

    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _n: int) -> None:
        await srv.read_request(reader)
        writer.write(ok(payload))
        await writer.drain()
        await srv.read_request(reader)

    srv = Server(handler)
    async with srv, pool_on(srv) as pool:
        resp = await pool.request("GET", "/big", [])
        await asyncio.sleep(0.3)  # the server writes as fast as it can; nobody reads
        assert resp.reading_paused
        assert resp.buffered < size
        assert await resp.read() == payload
        resp.release()
        assert pool.idle == 1


@timed(10)
async def test_cancelling_a_request_closes_its_connection() -> None:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _n: int) -> None:
        await srv.read_request(reader)
        await asyncio.sleep(5)

    srv = Server(handler)
    async with srv, pool_on(srv) as pool:
        task = asyncio.create_task(pool.request("GET", "/", []))
        await asyncio.sleep(0.1)
        assert pool.acquired == 1
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert (pool.acquired, pool.idle) == (0, 0)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    parts=st.lists(st.binary(min_size=1, max_size=300), min_size=1, max_size=6),
    cuts=st.lists(st.integers(min_value=1, max_value=2000), max_size=8),
)
def test_any_split_of_the_response_bytes_gives_the_same_body(parts: list[bytes], cuts: list[int]) -> None:
    """However the upstream's bytes are cut into reads, the body is the concatenation of the chunks."""
    wire = chunked(parts)
    points = sorted({c % len(wire) for c in cuts} - {0})
    pieces = [wire[a:b] for a, b in zip([0, *points], [*points, len(wire)], strict=True)]

    async def run() -> bytes:
        async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, _n: int) -> None:
            await srv.read_request(reader)
            for p in pieces:
                writer.write(p)
                await writer.drain()
                await asyncio.sleep(0)
            await srv.read_request(reader)

        srv = Server(handler)
        async with srv, pool_on(srv) as pool:
            resp = await pool.request("GET", "/", [])
            body = await resp.read()
            resp.release()
            assert pool.idle == 1
            return body

    assert asyncio.run(run()) == b"".join(parts)
