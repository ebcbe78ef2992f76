"""An upstream answer read whole (:meth:`kvgate.http.upstream.Response.read`): held once, never twice, and
refused past its limit. The upstream is another process, so that Python's allocation tracing sees only the
client's side of the answer."""

from __future__ import annotations

import asyncio
import subprocess
import sys
import textwrap
import tracemalloc

import pytest

from kvgate.http.upstream import AnswerTooLarge, UpstreamPool
from support.aio import timed

SIZE = 16 << 20

SERVER = textwrap.dedent("""
    import socket, sys
    size, chunked = int(sys.argv[1]), sys.argv[2] == "chunked"
    s = socket.socket(); s.bind(("127.0.0.1", 0)); s.listen(8)
    print(s.getsockname()[1], flush=True)
    block = b"a" * (1 << 20)
    while True:
        c, _ = s.accept()
        while b"\\r\\n\\r\\n" not in c.recv(65536):
            pass
        if chunked:
            c.sendall(b"HTTP/1.1 200 OK\\r\\nTransfer-Encoding: chunked\\r\\n\\r\\n")
            for _ in range(size >> 20):
                c.sendall(b"100000\\r\\n" + block + b"\\r\\n")
            c.sendall(b"0\\r\\n\\r\\n")
        else:
            c.sendall(b"HTTP/1.1 200 OK\\r\\nContent-Length: %d\\r\\n\\r\\n" % size)
            for _ in range(size >> 20):
                c.sendall(block)
        c.close()
""")


async def fetch(port: int, limit: int | None) -> tuple[int, int]:
    """Read the upstream's answer whole: ``(its length, the peak of Python allocations while reading it)``."""
    pool = UpstreamPool("127.0.0.1", port)
    try:
        resp = await pool.request("GET", "/", [])
        tracemalloc.start()
        try:
            body = await resp.read(limit)
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
            resp.close()
        return len(body), peak
    finally:
        await pool.close()


@pytest.mark.parametrize("framing", ["sized", "chunked"])
@timed(60)
async def test_an_answer_read_whole_is_held_once(framing: str) -> None:
    """Before, the chunks were kept and then joined: a peak of twice the answer. Now one buffer grows as they
    come (with its over-allocation, under 1.5 x)."""
    proc = subprocess.Popen([sys.executable, "-c", SERVER, str(SIZE), framing], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None
        port = int(await asyncio.to_thread(proc.stdout.readline))
        n, peak = await fetch(port, None)
        assert n == SIZE
        assert peak < 1.5 * SIZE, f"peak {peak} for a {SIZE}-byte answer"
        with pytest.raises(AnswerTooLarge):
            await fetch(port, SIZE - 1)
    finally:
        proc.kill()
        proc.wait()
