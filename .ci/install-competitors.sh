#!/usr/bin/env bash
# Install kvgate's competitors for `kvgate compare`:
#   - vllm-router 0.1.17 (Rust, from PyPI) into the current Python: its requirements (aiohttp, fastapi, uvicorn,
#     orjson, requests, setproctitle) are already kvgate's or vLLM's, so nothing else moves;
#   - NVIDIA Dynamo 1.6.1 (`ai-dynamo`) into its own Python 3.10 venv (on 3.11 one of its dependencies wants a
#     download this machine kind cannot make), at $KVGATE_DYNAMO_VENV (default ~/.cache/kvgate/dynamo-venv);
#   - the tiny local model directory that Dynamo's mocker tokenizes with (kvgate's own, built locally).
# Prints the venv's path and how long it took; fails (non-zero) if anything does not install or import.
set -euo pipefail
ROUTER_VERSION="${VLLM_ROUTER_VERSION:-0.1.17}"
DYNAMO_VERSION="${DYNAMO_VERSION:-1.6.1}"
PY="${PYTHON:-python3}"
VENV="${KVGATE_DYNAMO_VENV:-$HOME/.cache/kvgate/dynamo-venv}"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
pip_q() {
  local py="$1" rc; shift
  "$py" -m pip install -q "$@" 2>&1 | { grep -v -E "^WARNING: Location '.*' is ignored" || true; }
  rc=${PIPESTATUS[0]}
  return "$rc"
}
find_py310() {
  local c
  for c in "${PYTHON310:-}" "$HOME/.pyenv/versions/3.10.13/bin/python" /root/.pyenv/versions/3.10.13/bin/python \
           "$(command -v python3.10 || true)"; do
    if [ -n "$c" ] && [ -x "$c" ]; then echo "$c"; return 0; fi
  done
  ls -d "$HOME"/.pyenv/versions/3.10.*/bin/python 2>/dev/null | tail -1
}
t0=$(date +%s)
if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(m.version('vllm-router') != '$ROUTER_VERSION')" 2>/dev/null; then
  pip_q "$PY" "vllm-router==$ROUTER_VERSION"
fi
"$PY" -c "import vllm_router_rs" || { echo "install-competitors: vllm-router does not import" >&2; exit 1; }
if [ ! -x "$VENV/bin/python" ] || ! "$VENV/bin/python" -c \
    "import importlib.metadata as m, sys; sys.exit(m.version('ai-dynamo') != '$DYNAMO_VERSION')" 2>/dev/null; then
  py310="$(find_py310)"
  [ -n "$py310" ] || { echo "install-competitors: no Python 3.10 (pyenv 3.10.x) for Dynamo" >&2; exit 1; }
  "$py310" -m venv "$VENV"
  pip_q "$VENV/bin/python" "ai-dynamo==$DYNAMO_VERSION"
fi
"$VENV/bin/python" -c "import dynamo.frontend, dynamo.mocker, dynamo._core" \
  || { echo "install-competitors: Dynamo does not import" >&2; exit 1; }
"$PY" -c "from kvgate.realvllm.model import build_model; print('install-competitors: model', build_model())"
echo "install-competitors: vllm-router $ROUTER_VERSION; ai-dynamo $DYNAMO_VERSION in $VENV; $(( $(date +%s) - t0 )) s"
