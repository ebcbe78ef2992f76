"""calibrate --endpoint's HTTP client: a connection the server closes before answering (a kept-alive one it timed
out as the request went out) costs one retry on a new connection, not the calibration."""

from __future__ import annotations

import asyncio

import pytest

from kvgate.calibration.measure import _Http
from kvgate.errors import UsageError
from support.aio import timed

SSE = (b'HTTP/1.1 200 OK\r\nContent-Type: text/event-stream\r\nConnection: close\r\n\r\n'
       b'data: {"choices":[{"text":"a"}]}\n\n'
       b'data: {"choices":[],"usage":{"prompt_tokens":3,"completion_tokens":1,"total_tokens":4}}\n\n'
       b"data: [DONE]\n\n")


async def _server(drops: int) -> tuple[asyncio.Server, list[int]]:
    """Closes the first ``drops`` connections once a request arrived on them, answers the others."""
    seen = [0]

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        seen[0] += 1
        await reader.readuntil(b"\r\n\r\n")
        if seen[0] > drops:
            writer.write(SSE)
            await writer.drain()
        writer.close()

    return await asyncio.start_server(handle, "127.0.0.1", 0), seen


@timed(30)
async def test_a_connection_closed_before_the_answer_is_retried_once() -> None:
    server, seen = await _server(drops=1)
    http = _Http(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", None, 10.0)
    try:
        sent, first, last, completion, _ = await http.complete([1, 2, 3], 1)
        assert seen[0] == 2 and completion == 1 and sent <= first <= last
    finally:
        await http.close()
        server.close()


@timed(30)
async def test_closed_twice_it_fails_in_one_line() -> None:
    server, seen = await _server(drops=2)
    http = _Http(f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}", None, 10.0)
    try:
        with pytest.raises(UsageError, match="disconnected, twice"):
            await http.complete([1, 2, 3], 1)
        assert seen[0] == 2
    finally:
        await http.close()
        server.close()
