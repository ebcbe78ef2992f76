"""What RFC 9110 and RFC 9112 require of the gateway's HTTP/1.1 server, spoken to byte by byte over loopback:
``100 Continue`` on a pipelined connection, transfer codings, ``Upgrade`` with a body, ``Host``, the version, and
the head limit counting every byte of the head."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

from kvgate.http.framing import ChunkedEnd
from kvgate.http.server import HttpServer, Request, Response, StreamResponse
from support.aio import timed


class App:
    """``/slow`` streams one event, then waits for :attr:`release`; anything else echoes what arrived."""

    def __init__(self) -> None:
        self.seen: list[Request] = []
        self.release = asyncio.Event()

    async def __call__(self, req: Request) -> Response:
        self.seen.append(req)
        if req.path == "/slow":
            out = StreamResponse(headers={"Content-Type": "text/event-stream"})
            await out.prepare(req)
            await out.write(b"data: 0\n\n")
            await self.release.wait()
            await out.write(b"data: 1\n\n")
            await out.write_eof()
            return out
        info = {"method": req.method, "path": req.path, "body": req.body.decode("latin-1"),
                "host": req.headers.getall("Host", [])}
        return Response(body=json.dumps(info).encode(), content_type="application/json")


@contextlib.asynccontextmanager
async def serving(app: App) -> AsyncIterator[tuple[HttpServer, int]]:
    server = HttpServer(app)
    port = await server.start("127.0.0.1", 0)
    try:
        yield server, port
    finally:
        await server.shutdown(1.0)


async def read_head(reader: asyncio.StreamReader) -> tuple[int, dict[str, str]]:
    head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1")
    lines = head.split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (ln.partition(":") for ln in lines[1:] if ln)}
    return int(lines[0].split()[1]), headers


async def read_chunked(reader: asyncio.StreamReader) -> bytes:
    """A chunked body, strictly: a size line that is not hex (another response written into it) fails."""
    body = b""
    while True:
        line = await reader.readline()
        size = int(line.strip(), 16)
        chunk = await reader.readexactly(size + 2)
        assert chunk.endswith(b"\r\n")
        if size == 0:
            return body
        body += chunk[:-2]


async def read_response(reader: asyncio.StreamReader) -> tuple[int, dict[str, str], bytes]:
    status, headers = await read_head(reader)
    if "content-length" in headers:
        return status, headers, await reader.readexactly(int(headers["content-length"]))
    if headers.get("transfer-encoding") == "chunked":
        return status, headers, await read_chunked(reader)
    return status, headers, await reader.read()


async def exchange(port: int, raw: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send ``raw`` on a connection of its own; the one response to it."""
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        writer.write(raw)
        return await asyncio.wait_for(read_response(reader), 5)
    finally:
        writer.close()


def error_of(status: int, body: bytes) -> dict[str, object]:
    err = json.loads(body)["error"]
    assert err["code"] == status and err["message"]
    return err  # type: ignore[no-any-return]


@timed(10)
async def test_a_pipelined_100_continue_waits_for_the_response_streaming_before_it() -> None:
    """RFC 9110 §10.1.1: the 100 is an interim response to its own request; written while an earlier response is
    still streaming on the connection, it lands inside that response's chunked body."""
    app = App()
    async with serving(app) as (server, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"GET /slow HTTP/1.1\r\nHost: x\r\n\r\n")
        status, headers = await read_head(reader)
        assert (status, headers["transfer-encoding"]) == (200, "chunked")
        assert await reader.readuntil(b"data: 0\n\n\r\n")  # the first event is out; the response is not over
        writer.write(b"POST /e HTTP/1.1\r\nHost: x\r\nExpect: 100-continue\r\nContent-Length: 2\r\n\r\n")
        (conn,) = server._conns
        while conn.req is None:  # the second head is parsed (where a 100 written at once would go out)
            await asyncio.sleep(0.01)
        app.release.set()
        assert await asyncio.wait_for(read_chunked(reader), 5) == b"data: 1\n\n"  # the stream, whole
        assert await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 5) == b"HTTP/1.1 100 Continue\r\n\r\n"
        writer.write(b"ok")
        status, _, body = await asyncio.wait_for(read_response(reader), 5)
        assert (status, json.loads(body)["body"]) == (200, "ok")
        writer.close()


@timed(10)
async def test_transfer_codings_but_chunked_are_501_and_faulty_framing_400() -> None:
    """RFC 9112 §6.1: a coding the server does not implement is 501; chunked not last, or applied twice, leaves
    the body's length unknown: 400 (§6.3)."""
    app = App()
    async with serving(app) as (_, port):
        for te, status in (("gzip, chunked", 501), ("x-custom;q=1, chunked", 501), ("deflate,chunked", 501),
                           ("gzip", 400), ("chunked, chunked", 400), ("identity", 400)):
            raw = f"POST /t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: {te}\r\n\r\n3\r\nabc\r\n0\r\n\r\n".encode()
            got, headers, body = await exchange(port, raw)
            assert got == status, te
            assert headers["connection"] == "close"
            error_of(status, body)
        got, _, body = await exchange(port, b"POST /t HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: Chunked\r\n\r\n"
                                            b"3\r\nabc\r\n0\r\n\r\n")
        assert (got, json.loads(body)["body"]) == (200, "abc")  # (codings are case-insensitive)
        assert [r.path for r in app.seen] == ["/t"]


@timed(10)
async def test_a_body_sent_with_upgrade_is_read_and_the_request_served() -> None:
    """RFC 9110 §7.8: a server may ignore ``Upgrade``; it then serves the request as it is, body and all (the
    connection closes after the answer)."""
    app = App()
    async with serving(app) as (_, port):
        for framing in (b"Content-Length: 5\r\n\r\nhello",
                        b"Transfer-Encoding: chunked\r\n\r\n2\r\nhe\r\n3\r\nllo\r\n0\r\n\r\n"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"POST /u HTTP/1.1\r\nHost: x\r\nConnection: Upgrade\r\nUpgrade: websocket\r\n" + framing)
            status, headers, body = await asyncio.wait_for(read_response(reader), 5)
            assert (status, headers["connection"]) == (200, "close")
            assert json.loads(body)["body"] == "hello"
            assert await asyncio.wait_for(reader.read(), 5) == b""
            writer.close()
        assert [r.body for r in app.seen] == [b"hello", b"hello"]


@timed(10)
async def test_an_http11_request_needs_exactly_one_host() -> None:
    """RFC 9112 §3.2: no ``Host`` in an HTTP/1.1 request, more than one, or one that is not a host[:port]: 400."""
    app = App()
    async with serving(app) as (_, port):
        for raw in (b"GET /h HTTP/1.1\r\n\r\n", b"GET /h HTTP/1.1\r\nHost: a\r\nHost: a\r\n\r\n",
                    b"GET /h HTTP/1.1\r\nHost: a\r\nX: y\r\nhost: b\r\n\r\n",
                    b"GET /h HTTP/1.0\r\nHost: a\r\nHost: b\r\n\r\n",
                    b"GET /h HTTP/1.1\r\nHost: a, b\r\n\r\n", b"GET /h HTTP/1.1\r\nHost: a/b\r\n\r\n"):
            status, _, body = await exchange(port, raw)
            assert status == 400, raw
            error_of(400, body)
        assert app.seen == []
        status, _, body = await exchange(port, b"GET /h HTTP/1.0\r\n\r\n")  # HTTP/1.0: Host optional
        assert status == 200
        status, _, body = await exchange(port, b"GET /h HTTP/1.1\r\nHost: 127.0.0.1:8000\r\n\r\n")
        assert (status, json.loads(body)["host"]) == (200, ["127.0.0.1:8000"])
        status, _, body = await exchange(port, b"GET /h HTTP/1.1\r\nHost:\r\n\r\n")  # (empty: allowed, §3.2)
        assert status == 200


@timed(10)
async def test_versions_but_http1_are_505() -> None:
    """RFC 9110 §15.6.6: a major version the server does not serve is 505 (HTTP/0.9's ``GET /`` too); a higher
    HTTP/1 minor version is served as HTTP/1.1 (RFC 9112 §2.3)."""
    app = App()
    async with serving(app) as (_, port):
        for raw in (b"GET /v\r\n\r\n", b"GET /v HTTP/2.0\r\nHost: x\r\n\r\n", b"GET /v HTTP/3.0\r\nHost: x\r\n\r\n",
                    b"GET /v HTTP/0.9\r\nHost: x\r\n\r\n"):
            status, headers, body = await exchange(port, raw)
            assert (status, headers["connection"]) == (505, "close"), raw
            error_of(505, body)
        assert app.seen == []
        for raw in (b"GET /v\r\n", b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"):  # HTTP/0.9's whole request; HTTP/2's preface
            status, headers, body = await exchange(port, raw)
            assert (status, headers["connection"]) == (505, "close"), raw
        status, _, body = await exchange(port, b"GET /v HTTP/1.2\r\nHost: x\r\n\r\n")
        assert (status, json.loads(body)["path"]) == (200, "/v")


@timed(20)
async def test_the_head_limit_counts_every_byte_of_the_head() -> None:
    """64 KiB of request line and headers, however they are spent: empty fields, whitespace around values, in
    the request line, sent whole or a byte at a time after a pipelined request."""
    app = App()
    async with serving(app) as (server, port):
        empty = b"a:\r\n" * 36_500  # ~146 KB of empty fields
        padded = (b"a:" + b" " * 1000 + b"b\r\n") * 70
        line = b"GET" + b" " * 70_000 + b"/ HTTP/1.1\r\nHost: x\r\n\r\n"
        for raw in (b"GET / HTTP/1.1\r\nHost: x\r\n" + empty + b"\r\n",
                    b"GET / HTTP/1.1\r\nHost: x\r\n" + padded + b"\r\n",
                    line,
                    b"POST /p HTTP/1.1\r\nHost: x\r\nContent-Length: 1\r\n\r\nz"
                    b"GET / HTTP/1.1\r\nHost: x\r\n" + padded + b"\r\n",
                    b"POST /p HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n1\r\nz\r\n0\r\n\r\n"
                    b"GET / HTTP/1.1\r\nHost: x\r\n" + padded + b"\r\n",
                    b"POST /p HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n190;ext=1\r\n"
                    + b"\r\n\r\n" * 100 + b"\r\n0\r\nTrailer: t\r\n\r\nGET / HTTP/1.1\r\nHost: x\r\n" + padded
                    + b"\r\n"):
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(raw)
            if raw.startswith(b"POST"):
                status, _, _ = await asyncio.wait_for(read_response(reader), 5)
                assert status == 200
            status, _, body = await asyncio.wait_for(read_response(reader), 5)
            assert status == 431, raw[:40]
            error_of(431, body)
            writer.close()
        assert server.refused["head_size"] == 6
        assert [r.path for r in app.seen] == ["/p", "/p", "/p"]

        # just under the limit passes, in one write or in pieces; the count starts again with every request
        head = b"GET /n HTTP/1.1\r\nHost: x\r\n"
        fill = b"a:" + b" " * (60_000 - len(head)) + b"b\r\n"
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for i in range(6):
            whole = head + fill + b"\r\n"
            if i % 2:
                writer.write(whole)
            else:
                for k in range(0, len(whole), 7_000):
                    writer.write(whole[k:k + 7_000])
                    await writer.drain()
                    await asyncio.sleep(0)
            status, _, body = await asyncio.wait_for(read_response(reader), 5)
            assert (status, json.loads(body)["path"]) == (200, "/n")
        writer.close()


@timed(20)
async def test_reads_cut_anywhere_or_bodies_of_blank_lines_keep_the_framing() -> None:
    """The server cuts reads where a head or a body ends: a head sent a byte at a time, and a chunked body of
    blank lines and size-line lookalikes with a request pipelined after it in the same read, arrive as sent."""
    app = App()
    async with serving(app) as (_, port):
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        for b in b"POST /bytes HTTP/1.1\r\nHost: x\r\nContent-Length: 2\r\n\r\nok":
            writer.write(bytes([b]))
            await writer.drain()
        status, _, body = await asyncio.wait_for(read_response(reader), 5)
        assert (status, json.loads(body)["body"]) == (200, "ok")
        blank = b"\r\n\r\n0\r\n\r\n" * 40
        writer.write(b"POST /blank HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n%x\r\n%s\r\n0\r\n\r\n"
                     b"POST /after HTTP/1.1\r\nHost: x\r\nContent-Length: 4\r\n\r\n\r\n\r\n" % (len(blank), blank))
        for path, sent in (("/blank", blank), ("/after", b"\r\n\r\n")):
            status, _, body = await asyncio.wait_for(read_response(reader), 5)
            assert (status, json.loads(body)["path"], json.loads(body)["body"]) == (200, path, sent.decode())
        writer.close()


def test_where_a_chunked_body_ends_however_its_bytes_are_cut() -> None:
    body = b"5\r\nhe\r\n\r\r\n3;name=\"v\"\r\nabc\r\nA\r\n0\r\n\r\n0\r\n\r\n\r\n0\r\nX-T: 1\r\nY: 2\r\n\r\n"
    wire = body + b"GET / HTTP/1.1\r\n\r\n"
    for cut in range(len(wire) + 1):
        scan = ChunkedEnd()
        first = scan.end(wire[:cut], 0)
        got = first if first >= 0 else cut + scan.end(wire[cut:], 0)
        assert got == len(body), cut
    assert ChunkedEnd().end(b"0\r\n\r\n", 0) == 5
    assert ChunkedEnd().end(b"zz\r\n0\r\n\r\n", 0) == -1  # (not a size line: the parser refuses it)
