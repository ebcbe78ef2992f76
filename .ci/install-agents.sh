#!/usr/bin/env bash
# Install the agent harnesses the harness tests drive, after vLLM:
#   * into the current Python environment, the Anthropic SDK (Messages) and LiteLLM (acompletion) that
#     tests/e2e/test_agent_harnesses.py and tests/serve/test_agent_apis.py import (the OpenAI SDK comes with the
#     test extras). Fails if this adds a conflict with vLLM's requirements (pip check before and after) or if vLLM
#     stops importing;
#   * the agent CLIs from the npm registry, Claude Code, Codex and opencode, into $KVGATE_AGENTS_NPM (default
#     ~/.cache/kvgate/agents): tests/e2e/test_agent_clis.py finds them in its node_modules/.bin (or through
#     $KVGATE_AGENT_BIN);
#   * the Python agent SDKs that tests/e2e/test_agent_sdks.py runs as subprocesses, in venvs of their own (their
#     pins, openai 3 and aider's exact ones, are not vLLM's): the OpenAI Agents SDK, LangGraph with langchain-openai,
#     smolagents and mini-swe-agent in $KVGATE_AGENTS_VENV (default ~/.cache/kvgate/agents-venv), aider in
#     $KVGATE_AIDER_VENV (default ~/.cache/kvgate/aider-venv).
# Skips the npm part, saying so, where npm is absent. Prints how long it took; re-running it on a complete install
# takes seconds.
set -euo pipefail
PY="${PYTHON:-python3}"
export PIP_ROOT_USER_ACTION=ignore PIP_DISABLE_PIP_VERSION_CHECK=1 LITELLM_LOCAL_MODEL_COST_MAP=True
NPM_DIR="${KVGATE_AGENTS_NPM:-$HOME/.cache/kvgate/agents}"
SDK_VENV="${KVGATE_AGENTS_VENV:-$HOME/.cache/kvgate/agents-venv}"
AIDER_VENV="${KVGATE_AIDER_VENV:-$HOME/.cache/kvgate/aider-venv}"
CLIS=("@anthropic-ai/claude-code@2.1.332" "@openai/codex@0.171.0" "opencode-ai@1.18.33")
SDKS=("openai-agents==0.24.0" "langgraph==1.2.24" "langchain-openai==1.8.1" "smolagents==1.26.0"
      "mini-swe-agent==2.4.6")
AIDER="aider-chat==0.86.2"
quiet() { { grep -v -E "^WARNING: Location '.*' is ignored|^npm warn" || true; }; }
vllm_conflicts() { "$PY" -m pip check 2>&1 | grep -i "^vllm" | sort || true; }
t0=$(date +%s)

before=$(vllm_conflicts)
"$PY" -m pip install -q "anthropic>=0.40" "litellm>=1.60" 2>&1 | quiet
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

if command -v npm >/dev/null; then
  mkdir -p "$NPM_DIR"
  # (Claude Code asks for Node 22 but runs its native binary, which the package ships: Node 20 installs it)
  npm install --prefix "$NPM_DIR" --no-fund --no-audit --loglevel=error "${CLIS[@]}" 2>&1 | quiet
  for exe in claude codex opencode; do
    echo "agent CLI: $exe $("$NPM_DIR/node_modules/.bin/$exe" --version 2>&1 | head -1)"
  done
else
  echo "install-agents: npm not found, agent CLIs not installed (their tests skip)"
fi

venv_install() {  # venv, then the requirements
  local venv="$1"
  shift
  [ -x "$venv/bin/python" ] || "$PY" -m venv "$venv"
  "$venv/bin/python" -m pip install -q "$@" 2>&1 | quiet
  return "${PIPESTATUS[0]}"
}
venv_install "$SDK_VENV" "${SDKS[@]}"
MSWEA_SILENT_STARTUP=1 "$SDK_VENV/bin/python" -c "import agents, langgraph, langchain_openai, smolagents, minisweagent; \
print('agent SDKs venv:', '$SDK_VENV')"
venv_install "$AIDER_VENV" "$AIDER"
"$AIDER_VENV/bin/python" -c "import aider; print('aider', aider.__version__, 'in', '$AIDER_VENV')"
echo "install-agents: done in $(( $(date +%s) - t0 )) s"
