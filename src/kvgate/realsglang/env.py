"""Where SGLang's venv is, and whether it can be used.

``.ci/install-sglang.sh`` installs SGLang into ``$KVGATE_SGLANG_VENV`` (default ``~/.cache/kvgate/sglang-venv``);
``$KVGATE_SGLANG_PYTHON`` names its interpreter directly. Nothing is imported from it into kvgate's process.
"""

from __future__ import annotations

import os
import subprocess
from functools import cache
from pathlib import Path

SGLANG_VERSION = "0.5.23"
"""The SGLang release kvgate's SGLang engine is held to (the oracle tests) and the real-SGLang tests run."""
DEFAULT_VENV = Path.home() / ".cache" / "kvgate" / "sglang-venv"


def sglang_python() -> Path:
    """The Python of SGLang's venv (it may not exist)."""
    explicit = os.environ.get("KVGATE_SGLANG_PYTHON")
    if explicit:
        return Path(explicit)
    return Path(os.environ.get("KVGATE_SGLANG_VENV", str(DEFAULT_VENV))) / "bin" / "python"


@cache
def sglang_unavailable() -> str | None:
    """None if SGLang's venv has SGLang at :data:`SGLANG_VERSION`, else why not (one line)."""
    py = sglang_python()
    if not py.exists():
        return f"SGLang's venv is not installed ({py} is missing; run .ci/install-sglang.sh)"
    probe = "import importlib.metadata as m; print(m.version('sglang'))"
    try:
        out = subprocess.run([str(py), "-c", probe], capture_output=True, text=True, timeout=120, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"SGLang's venv at {py} does not run: {e}"
    version = out.stdout.strip()
    if out.returncode != 0:
        return f"SGLang is not installed in {py}'s venv (run .ci/install-sglang.sh)"
    if version != SGLANG_VERSION:
        return f"SGLang {version} in {py}'s venv; kvgate is held to {SGLANG_VERSION} (run .ci/install-sglang.sh)"
    return None
