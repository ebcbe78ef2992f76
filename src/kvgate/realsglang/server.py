"""Start and stop a real SGLang OpenAI server (its CPU engine) as a subprocess on 127.0.0.1.

::

    with RealSglang(SglangServerConfig(kv_pool=4096)) as srv:   # builds the tiny model if missing
        srv.url, srv.kv_pool, srv.startup_s

The command runs in SGLang's venv (:mod:`kvgate.realsglang.env`)::

    SGLANG_USE_CPU_ENGINE=1 python -m sglang.launch_server --model-path DIR --device cpu
        --attention-backend torch_native --enable-cache-report --skip-server-warmup --enable-metrics
        --sleep-on-idle --max-total-tokens N --host 127.0.0.1 --port P

* **The pool in tokens**: ``--max-total-tokens`` (SGLang's page size is 1, so every token of it can be
  cached); after start-up ``/server_info``'s ``max_total_num_tokens`` is read back and must equal it.
* **The model** is :mod:`kvgate.realvllm.model`'s tiny Llama (the same build the real-vLLM tests serve).
* **CPU.** No CPU build of ``sgl-kernel`` is on PyPI; the install script puts kvgate's pure-torch stand-in for
  the few helpers SGLang imports into the venv, and SGLang takes its plain-torch ``forward_native`` paths when
  its CPU ops are absent. So the model math is SGLang's reference torch code (not its AMX kernels): timings are
  not those of a Xeon deployment, while the radix cache, scheduler, retraction and API are SGLang's own.
  ``OMP_NUM_THREADS`` is ``threads`` (default 1). ``--skip-server-warmup``: no warm-up request at start.
  ``--sleep-on-idle``: without it SGLang's scheduler polls its sockets in a loop and holds a core at 100% while no
  request is in flight (on a 2-core machine, half of it, taken from the driver and the gateway beside it); with it
  the scheduler blocks on the same sockets (a zmq poll) until a request arrives.
* **Stop**: SIGTERM to the whole process group (the HTTP server, its scheduler and detokenizer processes), then
  SIGKILL to what is left after a grace period.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

from kvgate.errors import UsageError
from kvgate.realsglang.env import sglang_python, sglang_unavailable
from kvgate.realvllm.server import free_port, live_group_members

SERVED_MODEL_NAME = "tiny-llama"


class RealSglangError(RuntimeError):
    """The real SGLang server could not be started or does not behave as configured."""


@dataclass(frozen=True)
class SglangServerConfig:
    """How to run the server."""

    kv_pool: int
    port: int = 0
    """0: a free port."""
    context_length: int | None = None
    """None: the model's (SGLang caps a request at it)."""
    prefix_caching: bool = True
    schedule_policy: str = "fcfs"
    threads: int = 1
    model_dir: str | Path | None = None
    """None: :func:`kvgate.realvllm.model.model_dir` (built if missing)."""
    served_model_name: str = SERVED_MODEL_NAME
    extra_args: tuple[str, ...] = ()
    log_path: str | Path | None = None
    startup_timeout_s: float = 300.0
    env: dict[str, str] = field(default_factory=dict)

    def validate(self) -> None:
        if self.kv_pool <= 0:
            raise UsageError(f"--kv-pool must be positive, got {self.kv_pool}")
        if self.context_length is not None and self.context_length <= 0:
            raise UsageError(f"--context-length must be positive, got {self.context_length}")
        if not 0 <= self.port < 65536:
            raise UsageError(f"--port must be in 0..65535, got {self.port}")
        if self.threads <= 0:
            raise UsageError(f"--threads must be positive, got {self.threads}")
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise UsageError(f"--schedule-policy must be fcfs or lpm, got {self.schedule_policy!r}")


def _get(url: str, timeout: float = 5.0) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:  # noqa: S310 (loopback only)
            return int(r.status), r.read().decode("utf-8", "replace")
    except urllib.error.HTTPError as e:
        return int(e.code), ""


class RealSglang:
    """One real SGLang server process (group). A context manager; :meth:`stop` is idempotent."""

    def __init__(self, config: SglangServerConfig) -> None:
        config.validate()
        self.config = config
        self.port = config.port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = Path(config.log_path) if config.log_path else None
        self.startup_s: float | None = None
        self.server_info: dict[str, Any] | None = None
        """``/server_info`` as read after start-up."""
        self.model_path: Path | None = None
        self._log: Any = None

    @property
    def kv_pool(self) -> int:
        """The pool the server reports (``max_total_num_tokens``, after :meth:`start`), else the configured one."""
        if self.server_info is not None:
            return int(self.server_info["max_total_num_tokens"])
        return self.config.kv_pool

    def command(self) -> list[str]:
        cfg = self.config
        assert self.model_path is not None
        args = [
            str(sglang_python()), "-m", "sglang.launch_server",
            "--model-path", str(self.model_path),
            "--served-model-name", cfg.served_model_name,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--device", "cpu",
            "--attention-backend", "torch_native",
            "--max-total-tokens", str(cfg.kv_pool),
            "--schedule-policy", cfg.schedule_policy,
            "--enable-cache-report",
            "--enable-metrics",
            "--skip-server-warmup",
            "--sleep-on-idle",
        ]
        if cfg.context_length is not None:
            args += ["--context-length", str(cfg.context_length)]
        if not cfg.prefix_caching:
            args.append("--disable-radix-cache")
        args.extend(cfg.extra_args)
        return args

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.update(
            {
                "SGLANG_USE_CPU_ENGINE": "1",
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "OMP_NUM_THREADS": str(self.config.threads),
                "TOKENIZERS_PARALLELISM": "false",
                "PYTHONUNBUFFERED": "1",
                "PYTHONWARNINGS": "ignore",
            }
        )
        env.pop("PYTHONPATH", None)  # kvgate's source tree is no business of SGLang's venv
        env.update(self.config.env)
        return env

    def start(self) -> RealSglang:
        """Start the server and wait until it answers /health and reports the configured pool."""
        if self.proc is not None:
            raise RealSglangError("server already started")
        why = sglang_unavailable()
        if why is not None:
            raise UsageError(why)
        from kvgate.realvllm import model

        path = model.model_dir(self.config.model_dir)
        if (path / "config.json").exists() and not (path / model.MARKER).exists():
            self.model_path = path  # a model of the user's own: serve it as it is
        else:
            self.model_path = model.build_model(path)
        if self.log_path is None:
            fd, name = tempfile.mkstemp(prefix="kvgate-sglang-", suffix=".log")
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
            self._wait_healthy(t0 + self.config.startup_timeout_s)
            self.startup_s = time.monotonic() - t0
            self.server_info = self.read_server_info()
            if self.kv_pool != self.config.kv_pool:
                raise RealSglangError(
                    f"SGLang reports max_total_num_tokens {self.kv_pool}; asked for {self.config.kv_pool}"
                )
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_healthy(self, deadline: float) -> None:
        assert self.proc is not None
        while True:
            code = self.proc.poll()
            if code is not None:
                raise RealSglangError(f"SGLang exited with status {code} during start-up:\n{self.log_tail()}")
            try:
                status, _ = _get(self.url + "/health", timeout=2.0)
                if status == 200:
                    return
            except (OSError, urllib.error.URLError):
                pass
            if time.monotonic() > deadline:
                raise RealSglangError(
                    f"SGLang did not answer /health within {self.config.startup_timeout_s:.0f} s:\n{self.log_tail()}"
                )
            time.sleep(0.25)

    def read_server_info(self) -> dict[str, Any]:
        status, text = _get(self.url + "/server_info")
        if status != 200:
            raise RealSglangError(f"GET /server_info answered {status}")
        info = json.loads(text)
        if "max_total_num_tokens" not in info:
            raise RealSglangError("/server_info has no max_total_num_tokens")
        return dict(info)

    def metrics(self) -> str:
        status, text = _get(self.url + "/metrics")
        if status != 200:
            raise RealSglangError(f"GET /metrics answered {status}")
        return text

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
            deadline = time.monotonic() + min(grace_s, 5.0)
            while live_group_members(proc.pid) and time.monotonic() < deadline:
                time.sleep(0.1)
            if live_group_members(proc.pid):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(proc.pid, signal.SIGKILL)
            code = proc.returncode
        if self._log is not None:
            self._log.close()
            self._log = None
        return code

    def __enter__(self) -> RealSglang:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
