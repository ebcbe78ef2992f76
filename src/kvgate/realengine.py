"""What the real-engine adapters share: one engine server process (group) on 127.0.0.1, and its serve command.

:class:`EngineProcess` runs an engine's OpenAI server as a subprocess in a session of its own, logs to a file,
waits for ``/health``, and stops the whole process group (SIGTERM, then SIGKILL to what is left after a grace
period). An adapter (:mod:`kvgate.realvllm.server`, :mod:`kvgate.realsglang.server`) says only what differs: its
command line, its environment, what it checks once up (:meth:`EngineProcess.prepare`,
:meth:`EngineProcess.after_start`). :func:`serve_until_stopped` is the body of ``kvgate real-vllm serve`` and
``kvgate real-sglang serve``: start, print the server's details, wait for Ctrl-C or SIGTERM, stop.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any, Self

import click

from kvgate.errors import UsageError
from kvgate.options import FINITE


class RealEngineError(RuntimeError):
    """A real engine server could not be started or does not behave as configured."""


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def live_group_members(pgid: int) -> list[int]:
    """Pids of the processes in process group ``pgid`` that are not zombies (Linux ``/proc``).

    Zombies are left out: a stopped server's engine-core and worker processes are reparented to PID 1, which in
    a container may be slow to reap them; they hold no memory, ports or CPU."""
    out = []
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            stat = Path(f"/proc/{d}/stat").read_text()
        except OSError:
            continue
        fields = stat[stat.rfind(")") + 2 :].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] != "Z":
            out.append(int(d))
    return out


def http_get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    """Status and text of a GET on loopback (an HTTP error's status with no text)."""
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (loopback only)
            return int(r.status), r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return int(e.code), ""


SERVED_MODEL_NAME = "tiny-llama"


@dataclass(frozen=True, kw_only=True)
class ProcessConfig:
    """What every adapter's server configuration has beside its engine's own fields."""

    port: int = 0
    """0: a free port."""
    threads: int = 1
    model_dir: str | Path | None = None
    """None: :func:`kvgate.realvllm.model.model_dir` (built if missing)."""
    served_model_name: str = SERVED_MODEL_NAME
    extra_args: tuple[str, ...] = ()
    log_path: str | Path | None = None
    startup_timeout_s: float = 300.0
    env: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        """:class:`UsageError` for a configuration the server cannot run."""


def check_process(port: int, threads: int) -> None:
    """The checks every adapter's configuration makes of its process (:class:`UsageError` for a bad one)."""
    if not 0 <= port < 65536:
        raise UsageError(f"--port must be in 0..65535, got {port}")
    if threads <= 0:
        raise UsageError(f"--threads must be positive, got {threads}")


class EngineProcess:
    """One engine server process (group), of a checked configuration. A context manager; :meth:`stop` is
    idempotent.

    Subclasses set :attr:`name` (as messages say it), :attr:`log_prefix`, :attr:`error` (the error class they
    raise), the variables their engine wants (:attr:`engine_env`, :attr:`env_drop`) and implement :meth:`command`;
    :meth:`prepare` and :meth:`after_start` are hooks."""

    name = "engine"
    log_prefix = "kvgate-engine-"
    error: type[RealEngineError] = RealEngineError
    engine_env: dict[str, str] = {}
    """Variables the engine's process gets beside the offline and one-thread ones every engine gets."""
    env_drop: tuple[str, ...] = ()
    """Variables taken out of the inherited environment."""

    def __init__(self, config: ProcessConfig) -> None:
        config.validate()
        self.config = config
        port, log_path, startup_timeout_s = config.port, config.log_path, config.startup_timeout_s
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = Path(log_path) if log_path else None
        self.startup_timeout_s = startup_timeout_s
        self.startup_s: float | None = None
        self.model_path: Path | None = None
        self._log: Any = None

    # -- what an adapter says ------------------------------------------------------------------------------------

    def command(self) -> list[str]:
        raise NotImplementedError

    def environment(self) -> dict[str, str]:
        """The inherited environment, offline (no hub, no telemetry) with the configured threads, the engine's own
        variables, and the configuration's last."""
        env = dict(os.environ)
        env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "OMP_NUM_THREADS": str(self.config.threads),
                    "TOKENIZERS_PARALLELISM": "false", "PYTHONUNBUFFERED": "1", **self.engine_env})
        for k in self.env_drop:
            env.pop(k, None)
        env.update(self.config.env)
        return env

    def unavailable(self) -> str | None:
        """Why the engine cannot run here (None: it can)."""
        return None

    def prepared_model(self) -> Path:
        """The model directory the server loads (built if missing)."""
        raise NotImplementedError

    def prepare(self) -> None:
        """Before the process starts: the engine is there (:class:`UsageError` if not) and so is its model."""
        why = self.unavailable()
        if why is not None:
            raise UsageError(why)
        self.model_path = self.prepared_model()

    def after_start(self) -> None:
        """Once ``/health`` answers: read back and check what the server reports."""

    # -- the process ---------------------------------------------------------------------------------------------

    def start(self) -> Self:
        """Start the server and wait until it answers /health and :meth:`after_start` is satisfied."""
        if self.proc is not None:
            raise self.error("server already started")
        self.prepare()
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix=self.log_prefix, suffix=".log")
            os.close(fd)
            self.log_path = Path(name)
        self._log = open(self.log_path, "ab")  # noqa: SIM115 (closed in stop)
        t0 = time.monotonic()
        self.proc = subprocess.Popen(
            self.command(),
            stdin=subprocess.DEVNULL,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env=self.environment(),
            start_new_session=True,
        )
        try:
            self._wait_healthy(t0 + self.startup_timeout_s)
            self.startup_s = time.monotonic() - t0
            self.after_start()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, deadline: float) -> None:
        assert self.proc is not None
        while True:
            code = self.proc.poll()
            if code is not None:
                raise self.error(f"{self.name} exited with status {code} during start-up:\n{self.log_tail()}")
            try:
                status, _ = http_get(self.url + "/health", timeout=2.0)
                if status == 200:
                    return
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise self.error(
                    f"{self.name} did not answer /health within {self.startup_timeout_s:.0f} s:\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def get(self, path: str) -> str:
        """The text of ``GET path``; an error unless it answers 200."""
        status, text = http_get(self.url + path)
        if status != 200:
            raise self.error(f"GET {path} answered {status}")
        return text

    def metrics(self) -> str:
        return self.get("/metrics")

    def log_tail(self, n: int = 40) -> str:
        if self.log_path is None:
            return ""
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-n:])

    def stop(self, grace_s: float = 20.0) -> int | None:
        """SIGTERM to the process group, SIGKILL after ``grace_s``; returns the exit status (None if not run)."""
        proc, self.proc = self.proc, None
        code: int | None = None
        if proc is not None:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGTERM)
                try:
                    proc.wait(timeout=grace_s)
                except subprocess.TimeoutExpired:
                    with contextlib.suppress(ProcessLookupError):
                        os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait(timeout=30)
            # an engine's scheduler and worker processes may outlive its API server for a moment: kill what is
            # left of the group, then give the kernel a moment to take them
            for wait_s, kill in ((min(grace_s, 5.0), True), (5.0, False)):
                deadline = time.monotonic() + wait_s
                while live_group_members(proc.pid) and time.monotonic() < deadline:
                    time.sleep(0.1)
                if kill and live_group_members(proc.pid):
                    with contextlib.suppress(ProcessLookupError, PermissionError):
                        os.killpg(proc.pid, signal.SIGKILL)
            code = proc.returncode
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


def _fail(msg: str) -> None:
    click.echo(f"kvgate: error: {msg}", err=True)
    sys.exit(1)


def serve_until_stopped(
    srv: EngineProcess, command: str, info: Callable[[], dict[str, Any]], banner: Callable[[dict[str, Any]], str],
    as_json: bool,
) -> None:
    """Start ``srv``, print its details (``info()``: one JSON object with ``as_json``, else ``banner(info)``), and
    serve until Ctrl-C or SIGTERM; the server exiting by itself is an error (exit 1 naming its log)."""

    def on_signal(_sig: int, _frame: Any) -> None:
        raise KeyboardInterrupt

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        if not as_json:
            where = srv.log_path or "a temporary file"
            click.echo(f"kvgate {command}: starting {srv.name} on {srv.url} (log: {where})")
        try:
            srv.start()
        except RealEngineError as e:
            _fail(f"{str(e).splitlines()[0]} (log: {srv.log_path})")
        details = info()
        click.echo(json.dumps(details, sort_keys=True) if as_json else f"kvgate {command}: {banner(details)}")
        sys.stdout.flush()
        assert srv.proc is not None
        code = srv.proc.wait()
        srv.stop()
        _fail(f"{srv.name} exited with status {code} (log: {srv.log_path})")
    except KeyboardInterrupt:
        pass
    finally:
        for sig, handler in old.items():
            signal.signal(sig, handler)
        srv.stop()
    if not as_json:
        click.echo(f"kvgate {command}: stopped", err=True)


def process_options(engine: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """The options every ``serve`` command has: ``--log`` (``log_path``), ``--startup-timeout``, ``--json``
    (``as_json``)."""
    options = [
        click.option("--log", "log_path", type=click.Path(dir_okay=False, path_type=Path), default=None,
                     help=f"{engine}'s log file [default: a temporary file]."),
        click.option("--startup-timeout", type=FINITE, default=300.0, show_default=True,
                     help="Seconds to wait for /health."),
        click.option("--json", "as_json", is_flag=True, help="Print the server's details as one JSON object once up."),
    ]

    def decorate(f: Callable[..., Any]) -> Callable[..., Any]:
        for option in reversed(options):
            f = option(f)
        return f

    return decorate

