"""Fixtures for the tests against a real vLLM (the CPU build): the tiny model and one shared server.

Tests that need the real engine are marked ``@pytest.mark.real_vllm`` and take ``real_vllm_server`` (one server
for the whole session, started on first use) or start their own with :func:`start_server` (a different pool, a
restart). Where vLLM cannot be imported they skip with the reason; CI installs it (``.ci/install-vllm.sh``), so
there they run. The model is built once into ``$KVGATE_MODEL_DIR`` (default ``~/.cache/kvgate/tiny-llama``).

The shared server: a usable pool of :data:`SHARED_POOL` tokens in blocks of 128 (vLLM's CPU default),
max_model_len :data:`SHARED_MAX_MODEL_LEN`, prefix caching on, one OpenMP thread, eager mode, and
``VLLM_SERVER_DEV_MODE=1`` (the dev endpoints kvgate uses, e.g. ``/reset_prefix_cache``; vLLM then also answers
``/server_info``, which kvgate's SGLang probes must not mistake for SGLang).
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgate.realvllm.server import RealVllm, ServerConfig, vllm_available

SHARED_POOL = 16_384
SHARED_MAX_MODEL_LEN = 8_192
BLOCK = 128


def skip_reason() -> str | None:
    why = vllm_available()
    if why is not None:
        return f"real vLLM tests: {why}"
    for mod in ("transformers", "tokenizers", "torch"):
        try:
            __import__(mod)
        except ImportError:
            return f"real vLLM tests: {mod} is not installed (install the real vLLM with .ci/install-vllm.sh)"
    return None


@pytest.fixture(scope="session")
def real_vllm_model() -> Path:
    """The tiny model's directory (built on first use)."""
    why = skip_reason()
    if why is not None:
        pytest.skip(why)
    from kvgate.realvllm import model

    return model.build_model()


def start_server(tmp: Path, model_dir: Path, *, pool: int, name: str = "vllm", **kw: object) -> RealVllm:
    """Start a real server with a usable pool of ``pool`` tokens; its log is ``tmp/<name>.log``."""
    cfg = ServerConfig(kv_pool=pool, model_dir=model_dir, log_path=tmp / f"{name}.log", **kw)  # type: ignore[arg-type]
    return RealVllm(cfg).start()


@pytest.fixture(scope="session")
def real_vllm_server(real_vllm_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealVllm]:
    """One real vLLM server for the whole session (pool :data:`SHARED_POOL`, blocks of 128)."""
    tmp = tmp_path_factory.mktemp("real-vllm")
    srv = start_server(
        tmp,
        real_vllm_model,
        pool=SHARED_POOL,
        max_model_len=SHARED_MAX_MODEL_LEN,
        block_size=BLOCK,
        env={"VLLM_SERVER_DEV_MODE": "1"},
    )
    if os.environ.get("KVGATE_TEST_VERBOSE"):
        print(f"\nreal vLLM up in {srv.startup_s:.1f} s at {srv.url}, log {srv.log_path}")
    try:
        yield srv
    finally:
        srv.stop()


def metric(text: str, name: str, **labels: str) -> float:
    """Sum of the samples ``name{labels...}`` (a subset of their labels) in a Prometheus exposition; 0 if none."""
    from prometheus_client.parser import text_string_to_metric_families

    total = 0.0
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                total += s.value
    return total


def usable_pool(srv: RealVllm) -> int:
    """(num_gpu_blocks - 1) x block_size, from the server's own ``vllm:cache_config_info`` now."""
    info = srv.read_cache_info()
    assert info.kv_pool is not None, info
    return info.kv_pool
