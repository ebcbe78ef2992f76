"""The processes of a stack: started on loopback, waited for, and stopped by the PID the harness holds.

A :class:`Proc` is one command line with its environment, log file and readiness check (an HTTP path that must
answer 200, optionally with a marker in its body). :class:`Running` starts a list of them in order, each only
after the previous one is ready, and stops them in reverse order, each by its own PID with its own signal
(Dynamo's frontend takes SIGINT: SIGTERM waits for the requests it holds), then SIGKILL after a grace period.
Nothing is ever stopped by name.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from kvgate.errors import UsageError
from kvgate.realengine import free_port

__all__ = ["Proc", "Running", "free_port", "get_text", "kvgate_cli", "kvgate_env", "low_port"]


def low_port(lo: int = 20_000, hi: int = 32_767) -> int:
    """A free loopback port below 32768: Dynamo reads ``DYN_SYSTEM_PORT`` as a signed 16-bit integer."""
    import random
    import socket

    for _ in range(200):
        port = random.randint(lo, hi)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise UsageError(f"no free port in {lo}..{hi}")


def kvgate_cli(*args: str) -> list[str]:
    """``python3 -m kvgate.cli ARGS`` with this interpreter (the one kvgate runs in)."""
    return [sys.executable, "-m", "kvgate.cli", *args]


def kvgate_env() -> dict[str, str]:
    """The environment for kvgate subprocesses: this source tree first on the path."""
    env = dict(os.environ)
    src = str(Path(__file__).resolve().parents[2])
    env["PYTHONPATH"] = src + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    return env


@dataclass(frozen=True)
class Proc:
    """One process of a stack."""

    name: str
    argv: tuple[str, ...]
    ready_url: str
    """GET this until it answers 200 (and holds ``ready_text``, when set)."""
    env: dict[str, str] = field(default_factory=dict)
    """Added to the harness's environment."""
    ready_text: str = ""
    stop_signal: int = signal.SIGTERM
    startup_s: float = 120.0
    """Real seconds it may take to become ready."""


def get_text(url: str, timeout: float = 3.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (loopback only)
            return r.status, r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return e.code, ""


class Running:
    """Processes started in order, stopped in reverse; a context manager that always stops what it started."""

    def __init__(self, procs: Sequence[Proc], log_dir: Path, say: Callable[[str], None] = lambda _m: None) -> None:
        self.procs = list(procs)
        self.log_dir = log_dir
        self.say = say
        self.started: dict[str, subprocess.Popen[bytes]] = {}
        self.startup_s: dict[str, float] = {}

    def __enter__(self) -> Running:
        try:
            for p in self.procs:
                self.start(p)
        except BaseException:
            self.stop_all()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop_all()

    def start(self, p: Proc) -> None:
        self.log_dir.mkdir(parents=True, exist_ok=True)
        env = {**kvgate_env(), **p.env}
        t0 = time.monotonic()
        with open(self.log_dir / f"{p.name}.log", "ab") as log:
            proc = subprocess.Popen(
                list(p.argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT, env=env,
                start_new_session=True,
            )
        self.started[p.name] = proc
        deadline = t0 + p.startup_s
        while True:
            if proc.poll() is not None:
                raise UsageError(
                    f"{p.name} exited with status {proc.returncode} at start-up; see {self.log_dir / p.name}.log"
                )
            with contextlib.suppress(OSError):
                status, body = get_text(p.ready_url)
                if status == 200 and p.ready_text in body:
                    break
            if time.monotonic() > deadline:
                raise UsageError(f"{p.name} was not ready within {p.startup_s:g} s; see {self.log_dir / p.name}.log")
            time.sleep(0.25)
        self.startup_s[p.name] = round(time.monotonic() - t0, 2)

    def pid(self, name: str) -> int:
        return self.started[name].pid

    def stop(self, name: str, grace_s: float = 20.0, sig: int | None = None) -> int | None:
        """Stop one process (by its PID; its own process group, which it leads) and return its exit status."""
        proc = self.started.get(name)
        if proc is None:
            return None
        spec = next(p for p in self.procs if p.name == name)
        if proc.poll() is None:
            _signal(proc, spec.stop_signal if sig is None else sig)
            try:
                proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                _signal(proc, signal.SIGKILL)
                proc.wait(timeout=10)
        return proc.returncode

    def restart(self, new: Proc, sig: int = signal.SIGKILL) -> None:
        """Replace the running process of ``new.name`` by ``new`` (the old one stopped by ``sig`` first)."""
        self.stop(new.name, grace_s=5.0, sig=sig)
        self.procs = [new if p.name == new.name else p for p in self.procs]
        self.start(new)

    def stop_all(self) -> None:
        for name in reversed(list(self.started)):
            self.stop(name)


def _signal(proc: subprocess.Popen[bytes], sig: int) -> None:
    """``sig`` to the process group the process leads (``start_new_session``: its pgid is its PID), so the
    workers it spawned go with it."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
