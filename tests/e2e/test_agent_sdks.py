"""The Python agent SDKs' own loops — the OpenAI Agents SDK (Responses and chat), LangGraph's ``create_react_agent``,
smolagents' ``ToolCallingAgent`` and ``CodeAgent``, mini-swe-agent's ``DefaultAgent`` and aider — run unchanged
(apart from the variables ``docs/agents.md`` gives) against ``kvgate gateway`` in front of ``kvgate engine
--agent-turns 3``: each ends by itself within its session's turns, every request it sends answered 2xx, and the
gateway lists one session for it (found by lineage) with exactly its turns, no rewrite and no prefix break.

The SDKs live in venvs of their own (.ci/install-agents.sh: their pins are not vLLM's), so each harness runs as a
subprocess (tests/support/sdk_harness.py, aider's own CLI); skipped with the reason where one is not installed."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from support.agent_runs import AIDER_VENV, MODEL, SDK_VENV, TASK, check, run, setup, stack, venv_python
from support.aio import timed

TURNS = 3
SCRIPT = Path(__file__).resolve().parents[1] / "support" / "sdk_harness.py"
OFFLINE = {"LITELLM_LOCAL_MODEL_COST_MAP": "True", "MSWEA_COST_TRACKING": "ignore_errors", "HF_HUB_OFFLINE": "1",
           "OPENAI_AGENTS_DISABLE_TRACING": "1", "LANGCHAIN_TRACING_V2": "false", "MSWEA_SILENT_STARTUP": "1"}
pytestmark = pytest.mark.slow

# harness: (module its venv must import, how its run ends by itself, its turns against --agent-turns 3)
SDKS = {
    "agents-responses": ("agents", "final_output", TURNS),
    "agents-chat": ("agents", "final_output", TURNS),
    "langgraph": ("langgraph.prebuilt", "no_tool_call", TURNS),
    "smolagents-tools": ("smolagents", "final_answer", TURNS),
    "smolagents-code": ("smolagents", "final_answer", TURNS),
    "smolagents-code-markdown": ("smolagents", "final_answer", TURNS),
    "mini-swe-agent": ("minisweagent", "Submitted", TURNS),
}


@pytest.mark.parametrize("harness", sorted(SDKS))
@timed(300)
async def test_sdk_ends_by_itself(harness: str, tmp_path: Path) -> None:
    module, ending, turns = SDKS[harness]
    py = venv_python(SDK_VENV, module)
    async for base, rec in stack(TURNS):
        env, proj = setup(tmp_path, OFFLINE)
        rc, out = await run([py, "-P", str(SCRIPT), harness, base], env, proj)  # (-P: not tests/support first)
        assert rc == 0, out[-3000:]
        result = json.loads(out.strip().splitlines()[-1])
        assert result["ended"] == ending, (result, out[-3000:])
        await check(rec, base, "lineage", turns)


@pytest.mark.parametrize("edit_format", [None, "diff"])
@timed(300)
async def test_aider_applies_an_edit_and_ends_by_itself(edit_format: str | None, tmp_path: Path) -> None:
    """aider ``--message`` is one exchange: it sends the message, applies the answer's edits and exits (it sends
    more only to reflect a malformed edit or a lint error back). kvgate engine answers in the edit format aider
    asks for (``whole`` for a model it does not know; ``diff`` given), an edit of calc.py that changes nothing:
    applied, linted clean, one turn, within its session's 3."""
    py = venv_python(AIDER_VENV, "aider")
    async for base, rec in stack(TURNS):
        env, proj = setup(tmp_path, OFFLINE)
        argv = [py, "-m", "aider", "--model", f"openai/{MODEL}", "--openai-api-base", f"{base}/v1",
                "--openai-api-key", "x", "--no-git", "--yes", "--no-show-model-warnings", "--no-check-update",
                "--analytics-disable", "--no-pretty", "--message", TASK, "calc.py"]
        if edit_format is not None:
            argv += ["--edit-format", edit_format]
        rc, out = await run(argv, env, proj)
        assert rc == 0, out[-3000:]
        assert f"with {edit_format or 'whole'} edit format" in out and "Applied edit to calc.py" in out, out[-3000:]
        assert "did not conform" not in out and "token limit" not in out, out[-3000:]
        assert (proj / "calc.py").read_text() == "def add(a, b):\n    return a - b\n"
        assert sorted(p.name for p in proj.iterdir() if not p.name.startswith(".")) == ["calc.py"]
        await check(rec, base, "lineage", 1)
