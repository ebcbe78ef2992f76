#!/usr/bin/env bash
# Install SGLang (0.5.23, CPU) into a venv of its own, for the tests that hold kvgate to SGLang's own code.
#
# SGLang pins torch 2.14.1, transformers 5.19 and others that conflict with the vLLM of the main environment, so it
# gets its own venv: $KVGATE_SGLANG_VENV, default ~/.cache/kvgate/sglang-venv (printed at the end; kvgate finds it
# there, or through $KVGATE_SGLANG_PYTHON). In it:
#   * the on-disk CPU torch 2.13.0 (SGLang pins 2.14.1, whose PyPI wheel is a CUDA build of several GB; 2.13.0 works);
#   * sglang without its dependencies, then the plain requirements its imports need (its GPU kernels, flashinfer,
#     deep-ep, CUDA and the like left out: nothing here runs on a GPU);
#   * torchvision 0.28 without dependencies: PyPI's wheel is a CUDA build whose compiled ops do not load beside a
#     CPU torch, and its import then fails registering fakes for them (`operator torchvision::nms does not exist`);
#     its __init__ is patched to skip those registrations when its ops are absent (SGLang only needs transforms);
#   * kvgate's stand-in for `sgl_kernel` (src/kvgate/realsglang/standin/sgl_kernel: a few pure-torch helpers that
#     SGLang's CPU engine imports at load; its docstring says what it replaces and what not), copied in as the
#     top-level package `sgl_kernel` unless a real sgl_kernel is installed.
# Then checks that SGLang's radix caches and, with SGLANG_USE_CPU_ENGINE=1, its server import. Fails (non-zero) if
# anything cannot be installed or imported. Re-running it on a complete venv takes seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
SGLANG_VERSION="${SGLANG_VERSION:-0.5.23}"
TORCH_VERSION="${TORCH_VERSION:-2.13.0}"
VENV="${KVGATE_SGLANG_VENV:-$HOME/.cache/kvgate/sglang-venv}"
BASE_PY="${PYTHON:-python3}"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1
PY="$VENV/bin/python"
# pip, without its "WARNING: Location '...' is ignored" lines for local index directories that lack a package and
# without the resolver's complaint that the pins of sglang (installed --no-deps) are not all met
pip_install() {
  local rc
  "$PY" -m pip install -q "$@" 2>&1 \
    | { grep -v -E "^WARNING: Location '.*' is ignored|^sglang $SGLANG_VERSION requires|^ERROR: pip's dependency resolver" \
        || true; }
  rc=${PIPESTATUS[0]}
  return "$rc"
}
t0=$(date +%s)
if [ ! -x "$PY" ]; then
  "$BASE_PY" -m venv "$VENV"
fi
if ! "$PY" -c "import torch, sys; sys.exit(0 if torch.__version__.startswith('$TORCH_VERSION') else 1)" 2>/dev/null; then
  pip_install "torch==$TORCH_VERSION"
fi
if ! "$PY" -c "import importlib.metadata as m, sys; sys.exit(0 if m.version('sglang') == '$SGLANG_VERSION' else 1)" \
    2>/dev/null; then
  pip_install --no-deps "sglang==$SGLANG_VERSION"
fi
# SGLang's plain requirements that its imports (the radix caches; the CPU server) need, at its pins where it pins
pip_install \
  aiohttp "apache-tvm-ffi==0.1.11" "compressed-tensors==0.18.0" dill einops fastapi gguf interegular IPython \
  jsonschema msgspec numpy "openai==2.8.0" orjson packaging partial_json_parser pillow prometheus-client psutil \
  pybase64 pydantic python-multipart "pyzmq>=25.1.2" regex requests "sentencepiece==0.2.1" setproctitle \
  "soundfile==0.13.1" "tokenizers==0.23.2" tqdm "transformers==5.19.0" triton uvicorn uvloop xxhash zstandard
pip_install --no-deps "xgrammar==0.2.7" "torchvision==0.28.0"
"$PY" - <<'PY'
# torchvision's __init__: skip the fake/autograd registrations of its compiled ops when they did not load
import importlib.util
import pathlib

init = pathlib.Path(importlib.util.find_spec("torchvision").origin)
text = init.read_text()
mark = "# kvgate: "
old = "from torchvision import (\n    _autograd_registrations,\n    _meta_registrations,\n"
new = (
    f"{mark}the registrations need torchvision's compiled ops, which a CUDA build cannot load beside a CPU torch\n"
    "if extension._has_ops():\n"
    "    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401\n"
    "from torchvision import (\n"
)
if mark not in text:
    if old not in text:
        raise SystemExit(f"install-sglang: torchvision's {init} is not as expected; cannot patch it")
    init.write_text(text.replace(old, new))
PY
site=$("$PY" -c "import sysconfig; print(sysconfig.get_paths()['purelib'])")
if "$PY" -c "import sgl_kernel, sys; sys.exit(0 if getattr(sgl_kernel, 'KVGATE_STANDIN', False) else 1)" 2>/dev/null \
    || ! "$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('sgl_kernel') else 1)"; then
  rm -rf "$site/sgl_kernel"
  cp -r src/kvgate/realsglang/standin/sgl_kernel "$site/sgl_kernel"
  rm -rf "$site/sgl_kernel/__pycache__"
fi
"$PY" -W ignore -c "
import sglang.srt.mem_cache.radix_cache, sglang.srt.mem_cache.unified_radix_cache
import sglang.srt.mem_cache.allocator, sglang.srt.mem_cache.memory_pool
" >/dev/null 2>&1 || { echo "install-sglang: SGLang's radix cache does not import" >&2; exit 1; }
SGLANG_USE_CPU_ENGINE=1 "$PY" -W ignore -c "
import sglang.launch_server, sglang.srt.entrypoints.http_server, sglang.srt.managers.scheduler
import sglang.srt.model_executor.model_runner
" >/dev/null 2>&1 || { echo "install-sglang: SGLang's CPU server does not import" >&2; exit 1; }
echo "install-sglang: sglang $SGLANG_VERSION with torch $TORCH_VERSION in $VENV ($(du -sh "$VENV" | cut -f1))" \
  "in $(( $(date +%s) - t0 )) s"
