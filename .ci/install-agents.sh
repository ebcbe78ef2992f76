#!/usr/bin/env bash
# Install the agent SDKs the harness tests drive (tests/e2e/test_agent_harnesses.py, tests/serve/test_agent_apis.py)
# into the current Python environment, after vLLM: the Anthropic SDK (Messages) and LiteLLM (acompletion). The
# OpenAI SDK comes with the test extras. Fails if the install adds a conflict with vLLM's requirements (pip check
# before and after) or if vLLM stops importing. Prints how long it took.
set -euo pipefail
PY="${PYTHON:-python3}"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 LITELLM_LOCAL_MODEL_COST_MAP=True
vllm_conflicts() { "$PY" -m pip check 2>&1 | grep -i "^vllm" | sort || true; }
t0=$(date +%s)
before=$(vllm_conflicts)
"$PY" -m pip install -q "anthropic>=0.40" "litellm>=1.60" 2>&1 | { grep -v -E "^WARNING: Location '.*' is ignored" || true; }
"$PY" -c "import anthropic, litellm; print('agent SDKs: anthropic', anthropic.__version__)"
after=$(vllm_conflicts)
if [ "$before" != "$after" ]; then
  echo "install-agents: the agent SDKs changed what vLLM requires:" >&2
  diff <(echo "$before") <(echo "$after") >&2 || true
  exit 1
fi
if "$PY" -c "import importlib.util, sys; sys.exit(0 if importlib.util.find_spec('vllm') else 1)"; then
  "$PY" -c "import vllm" || { echo "install-agents: vLLM no longer imports" >&2; exit 1; }
fi
echo "install-agents: done in $(( $(date +%s) - t0 )) s"
