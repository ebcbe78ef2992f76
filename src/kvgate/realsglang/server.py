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

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvgate.errors import UsageError
from kvgate.realengine import EngineProcess, ProcessConfig, RealEngineError, check_process
from kvgate.realsglang.env import sglang_python, sglang_unavailable


class RealSglangError(RealEngineError):
    """The real SGLang server could not be started or does not behave as configured."""


@dataclass(frozen=True)
class SglangServerConfig(ProcessConfig):
    """How to run the server."""

    kv_pool: int
    context_length: int | None = None
    """None: the model's (SGLang caps a request at it)."""
    prefix_caching: bool = True
    schedule_policy: str = "fcfs"

    def validate(self) -> None:
        if self.kv_pool <= 0:
            raise UsageError(f"--kv-pool must be positive, got {self.kv_pool}")
        if self.context_length is not None and self.context_length <= 0:
            raise UsageError(f"--context-length must be positive, got {self.context_length}")
        check_process(self.port, self.threads)
        if self.schedule_policy not in ("fcfs", "lpm"):
            raise UsageError(f"--schedule-policy must be fcfs or lpm, got {self.schedule_policy!r}")


class RealSglang(EngineProcess):
    """One real SGLang server process (group). A context manager; :meth:`stop` is idempotent."""

    name = "SGLang"
    log_prefix = "kvgate-sglang-"
    error = RealSglangError
    engine_env = {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONWARNINGS": "ignore"}
    env_drop = ("PYTHONPATH",)  # kvgate's source tree is no business of SGLang's venv
    config: SglangServerConfig

    def __init__(self, config: SglangServerConfig) -> None:
        super().__init__(config)
        self.server_info: dict[str, Any] | None = None
        """``/server_info`` as read after start-up."""

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

    def unavailable(self) -> str | None:
        return sglang_unavailable()

    def prepared_model(self) -> Path:
        from kvgate.realvllm import model

        return model.prepared_model(self.config.model_dir)

    def after_start(self) -> None:
        self.server_info = self.read_server_info()
        if self.kv_pool != self.config.kv_pool:
            raise RealSglangError(
                f"SGLang reports max_total_num_tokens {self.kv_pool}; asked for {self.config.kv_pool}"
            )

    def read_server_info(self) -> dict[str, Any]:
        info = json.loads(self.get("/server_info"))
        if "max_total_num_tokens" not in info:
            raise RealSglangError("/server_info has no max_total_num_tokens")
        return dict(info)
