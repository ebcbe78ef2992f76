"""The gateway's HTTP/1.1 server, spoken to byte by byte over loopback: framing, keep-alive, limits, failures."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.http.server import HttpServer, Request, Response, StreamResponse
from support.aio import timed


class App:
    """Handlers the tests choose by path."""

    def __init__(self) -> None:
        self.seen: list[Request] = []
        self.cancelled = asyncio.Event()
        self.release = asyncio.Event()

    async def __call__(self, req: Request) -> Response:
        self.seen.append(req)
        if req.path == "/boom":
            raise RuntimeError("a bug")
        if req.path == "/wait":
            try:
                await self.release.wait()
            except asyncio.CancelledError:
                self.cancelled.set()
                raise
            return Response(body=b"released")
        if req.path == "/stream":
            out = StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(req)
            for i in range(3):
                await out.write(b"data: %d\n\n" % i)
            await out.write_eof(b"data: [DONE]\n\n")
            return out
        info = {"method": req.method, "path": req.path, "raw": req.raw_path, "body": req.body.decode(),
                "remote": req.remote, "x": req.headers.get("x-thing")}
        return Response(body=json.dumps(info).encode(), content_type="application/json")


@contextlib.asynccontextmanager
async def serving(app: App, **kw: float) -> AsyncIterator[tuple[HttpServer, int]]:
    server = HttpServer(app, **kw)  # type: ignore[arg-type]
    port = await server.start("127.0.0.1", 0)
    try:
        yield server, port
    finally:
        await server.shutdown(1.0)


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    lines = head.split("\r\n")
    status = int(lines[0].split()[1])
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    if "content-length" in headers:
        body = await reader.readexactly(int(headers["content-length"]))
    elif headers.get("transfer-encoding") == "chunked":
        body = b""
        while True:
            size = int((await reader.readline()).strip(), 16)
            chunk = await reader.readexactly(size + 2)
            if size == 0:
                break
            body += chunk[:-2]
    else:
        body = await reader.read()
    return status, headers, body


@timed(10)
async def test_keep_alive_pipelining_and_body_framings() -> None:
    app = App()
    async with serving(app) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /a%20b?q=1 HTTP/1.1\r\nHost: x\r\nX-Thing: one\r\nContent-Length: 5\r\n\r\nhello"
            b"POST /c HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n"
            b"GET http://elsewhere.example/d?z=2 HTTP/1.1\r\nHost: x\r\n\r\n"
        )  # three requests in one write: answered in order
        first = json.loads((await read_response(reader))[2])
        assert first == {"method": "POST", "path": "/a b", "raw": "/a%20b?q=1", "body": "hello",
                         "remote": "127.0.0.1", "x": "one"}
        assert json.loads((await read_response(reader))[2])["body"] == "abcde"
        third = json.loads((await read_response(reader))[2])
        assert third["raw"] == "/d?z=2"  # an absolute-form target keeps only its path and query
        writer.close()


@timed(10)
async def test_http10_expect_continue_and_head() -> None:
    app = App()
    async with serving(app) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /e HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
        assert await reader.readuntil(b"\r\n\r\n") == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"ok")
        assert json.loads((await read_response(reader))[2])["body"] == "ok"
        writer.write(b"HEAD /h HTTP/1.1\r\nHost: x\r\n\r\nGET /after HTTP/1.1\r\nHost: x\r\n\r\n")
        head = await reader.readuntil(b"\r\n\r\n")
        assert b"Content-Length" not in head  # a HEAD answer has no body
        assert json.loads((await read_response(reader))[2])["path"] == "/after"
        writer.close()

        # HTTP/1.0: the stream is close-delimited (no chunked encoding) and the connection closes after it
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /stream HTTP/1.0\r\n\r\n")
        status, headers, body = await read_response(reader)
        assert status == 200 and "transfer-encoding" not in headers and headers["connection"] == "close"
        assert body == b"data: 0\n\ndata: 1\n\ndata: 2\n\ndata: [DONE]\n\n"
        writer.close()


@timed(10)
async def test_errors_it_answers_itself() -> None:
    app = App()
    async with serving(app, max_body=100) as (_, port):
        for raw, status in (
            (b"POST /x HTTP/1.1\r\nHost: x\r\nContent-Length: 101\r\n\r\n", 413),
            (
                b"POST /x HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n64\r\n" + b"a" * 100 + b"\r\n"
                b"1\r\nb\r\n0\r\n\r\n",
                413,
            ),
            (b"GARBAGE\r\n\r\n", 400),
            (b"GET / HTTP/1.1\r\nHost: x\r\n" + b"X-Big: " + b"y" * 70_000 + b"\r\n\r\n", 431),
            (b"GET /boom HTTP/1.1\r\nHost: x\r\n\r\n", 500),
        ):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(raw)
            got, headers, body = await read_response(reader)
            assert got == status, raw
            assert headers["content-type"] == "application/json"
            err = json.loads(body)["error"]
            assert err["code"] == status and err["message"]
            writer.close()
        assert [r.path for r in app.seen] == ["/boom"]  # none of the others reached the handler

        # an upgrade is declined: a plain HTTP/1.1 answer, then the connection closes
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /u HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n\r\n")
        status, headers, _ = await read_response(reader)
        assert (status, headers["connection"]) == (200, "close")
        assert await asyncio.wait_for(reader.read(), 2) == b""
        writer.close()


@timed(10)
async def test_a_client_that_goes_away_cancels_its_handler() -> None:
    app = App()
    async with serving(app) as (server, port):
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
        await writer.drain()
        while server.load()["handled"] == 0:
            await asyncio.sleep(0.01)
        writer.close()
        await asyncio.wait_for(app.cancelled.wait(), 2)
        while any(server.load().values()):
            await asyncio.sleep(0.01)


@timed(10)
async def test_idle_connections_close_and_shutdown_lets_handlers_finish() -> None:
    app = App()
    async with serving(app, keepalive_s=0.3) as (server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /x HTTP/1.1\r\nHost: x\r\n\r\n")
        await read_response(reader)
        assert await asyncio.wait_for(reader.read(), 3) == b""  # closed by the server once idle
        writer.close()

        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /wait HTTP/1.1\r\nHost: x\r\n\r\n")
        while server.load()["handled"] == 0:
            await asyncio.sleep(0.01)
        stopping = asyncio.create_task(server.shutdown(5.0))
        await asyncio.sleep(0.1)
        with pytest.raises(OSError):  # no longer listening
            await asyncio.open_connection("127.0.0.1", port)
        app.release.set()
        status, headers, body = await read_response(reader)
        assert (status, body, headers["connection"]) == (200, b"released", "close")
        await stopping
        writer.close()


@settings(max_examples=30, deadline=None)
@given(
    bodies=st.lists(st.binary(max_size=200), min_size=1, max_size=4),
    chunked_flags=st.lists(st.booleans(), min_size=4, max_size=4),
    cuts=st.lists(st.integers(min_value=1, max_value=5000), max_size=10),
)
def test_pipelined_requests_cut_anywhere_are_answered_in_order(
    bodies: list[bytes], chunked_flags: list[bool], cuts: list[int]
) -> None:
    """However a client's bytes are cut into reads, each request arrives whole and is answered in order."""
    wire = b""
    for i, body in enumerate(bodies):
        if chunked_flags[i]:
            framed = (b"%x\r\n%s\r\n" % (len(body), body) if body else b"") + b"0\r\n\r\n"
            wire += b"POST /r%d HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n%s" % (i, framed)
        else:
            wire += b"POST /r%d HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n%s" % (i, len(body), body)
    points = sorted({c % len(wire) for c in cuts} - {0})
    pieces = [wire[a:b] for a, b in zip([0, *points], [*points, len(wire)], strict=True)]

    async def run() -> list[tuple[str, bytes]]:
        async def echo(req: Request) -> Response:
            return Response(body=req.body, headers={"X-Path": req.path})

        server = HttpServer(echo)
        port = await server.start("127.0.0.1", 0)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            for p in pieces:
                writer.write(p)
                await writer.drain()
                await asyncio.sleep(0)
            got = []
            for _ in bodies:
                _, headers, body = await asyncio.wait_for(read_response(reader), 5)
                got.append((headers["x-path"], body))
            writer.close()
            return got
        finally:
            await server.shutdown(1.0)

    assert asyncio.run(run()) == [(f"/r{i}", b) for i, b in enumerate(bodies)]
