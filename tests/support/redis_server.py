"""A redis-server of the test's own: on a free loopback port, nothing saved (``--save ''``, no AOF), stopped by its
PID; restartable on the same port (a Redis restart loses everything, as ``--save ''`` in production would)."""

from __future__ import annotations

import contextlib
import shutil
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator

import pytest

from support.ports import free_port

REDIS = shutil.which("redis-server")


def need_redis() -> None:
    """Skip the test, saying why, without a redis-server or redis-py."""
    if REDIS is None:
        pytest.skip("redis-server is not installed (bash .ci/install-redis.sh)")
    pytest.importorskip("redis", reason="redis-py is not installed (pip install 'kvgate[redis]')")


class RedisServer:
    """One redis-server process (see the module docstring)."""

    def __init__(self) -> None:
        assert REDIS is not None
        self.port = free_port()
        self.dir = tempfile.mkdtemp(prefix="kvgate-redis-")
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        assert REDIS is not None and self.proc is None
        self.proc = subprocess.Popen(
            [REDIS, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", self.dir, "--daemonize", "no", "--loglevel", "warning"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10.0
        while time.monotonic() < deadline:
            with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", self.port), 0.2) as c:
                c.sendall(b"PING\r\n")
                if c.recv(16).startswith(b"+PONG"):
                    return
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {self.proc.returncode}")
            time.sleep(0.02)
        raise RuntimeError("redis-server did not answer PING within 10 s")

    def kill(self) -> None:
        """SIGKILL (what it held is gone)."""
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.kill()
            proc.wait(10)

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start()


@contextlib.contextmanager
def redis_server() -> Iterator[RedisServer]:
    need_redis()
    srv = RedisServer()
    srv.start()
    try:
        yield srv
    finally:
        srv.stop()
        shutil.rmtree(srv.dir, ignore_errors=True)
