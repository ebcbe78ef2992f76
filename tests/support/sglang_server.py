"""Fixtures for the tests against a real SGLang (0.5.23, its CPU engine): the tiny model and one shared server.

Tests that need the real server are marked ``@pytest.mark.real_sglang`` and take ``real_sglang_server`` (one
server for the whole session, started on first use) or start their own with :func:`start_sglang`. Where
SGLang's venv is missing (``.ci/install-sglang.sh``), or the tiny model cannot be built here (it needs
``transformers`` and ``tokenizers`` in kvgate's Python), they skip with the reason. The model is
:mod:`kvgate.realvllm.model`'s, built once into ``$KVGATE_MODEL_DIR`` (default ``~/.cache/kvgate/tiny-llama``).

The shared server: a pool of :data:`SHARED_POOL` tokens (``--max-total-tokens``; SGLang's page size is 1),
context length :data:`SHARED_CONTEXT`, fcfs, the radix cache on, one OpenMP thread, metrics on.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from kvgate.realsglang.env import sglang_unavailable
from kvgate.realsglang.server import RealSglang, SglangServerConfig

SHARED_POOL = 8_192
SHARED_CONTEXT = 4_096


def skip_reason() -> str | None:
    why = sglang_unavailable()
    if why is not None:
        return f"real SGLang tests: {why}"
    for mod in ("transformers", "tokenizers"):
        try:
            __import__(mod)
        except ImportError:
            return f"real SGLang tests: {mod} is not installed here (the tiny model is built with it)"
    return None


@pytest.fixture(scope="session")
def real_sglang_model() -> Path:
    """The tiny model's directory (built on first use)."""
    why = skip_reason()
    if why is not None:
        pytest.skip(why)
    from kvgate.realvllm import model

    return model.build_model()


def start_sglang(tmp: Path, model_dir: Path, *, pool: int, name: str = "sglang", **kw: object) -> RealSglang:
    """Start a real SGLang server with a pool of ``pool`` tokens; its log is ``tmp/<name>.log``."""
    cfg = SglangServerConfig(kv_pool=pool, model_dir=model_dir, log_path=tmp / f"{name}.log", **kw)  # type: ignore[arg-type]
    return RealSglang(cfg).start()


@pytest.fixture(scope="session")
def real_sglang_server(real_sglang_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[RealSglang]:
    """One real SGLang server for the whole session (pool :data:`SHARED_POOL`)."""
    tmp = tmp_path_factory.mktemp("real-sglang")
    srv = start_sglang(tmp, real_sglang_model, pool=SHARED_POOL, context_length=SHARED_CONTEXT)
    if os.environ.get("KVGATE_TEST_VERBOSE"):
        print(f"\nreal SGLang up in {srv.startup_s:.1f} s at {srv.url}, log {srv.log_path}")
    try:
        yield srv
    finally:
        srv.stop()
