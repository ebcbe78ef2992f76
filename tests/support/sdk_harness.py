"""One agent SDK harness run against an OpenAI-compatible base URL, as its documentation writes it (docs/agents.md):
``python sdk_harness.py HARNESS BASE_URL``, in the current directory. Run by tests/e2e/test_agent_sdks.py with the
Python of the venv that holds the SDKs (.ci/install-agents.sh): it imports neither kvgate nor the test support.
Prints one JSON line: ``{"ended": how the run ended, "steps": the harness's own count}``; exits non-zero on error.

Each agent gets the one tool such tasks give it, ``bash`` (it runs nothing: it says what it would run), and is
bounded only by the harness's default limits (or a cap far above the session's turns, where it has none).
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

MODEL = "Qwen/Qwen3-8B"
TASK = "Fix the bug in calc.py"


def bash(command: str) -> str:
    """Run a shell command in the repository.

    Args:
        command: the command line to run.
    """
    return f"ran {command!r}: exit 0"


async def agents_sdk(base: str, api: str) -> dict[str, Any]:
    from agents import (
        Agent,
        OpenAIChatCompletionsModel,
        OpenAIResponsesModel,
        Runner,
        function_tool,
        set_tracing_disabled,
    )
    from openai import AsyncOpenAI

    client = AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
    set_tracing_disabled(True)
    # (a model object: the SDK reads a name's "Qwen/" as a provider prefix)
    kind = OpenAIResponsesModel if api == "responses" else OpenAIChatCompletionsModel
    model = kind(model=MODEL, openai_client=client)
    agent = Agent(name="coder", instructions="You fix bugs.", model=model, tools=[function_tool(bash)])
    result = await Runner.run(agent, TASK)
    calls = sum(1 for it in result.new_items if it.type == "tool_call_item")
    return {"ended": "final_output" if result.final_output is not None else "none", "steps": calls + 1}


def langgraph(base: str) -> dict[str, Any]:
    from langchain_core.tools import tool
    from langchain_openai import ChatOpenAI
    from langgraph.prebuilt import create_react_agent

    llm = ChatOpenAI(model=MODEL, base_url=base + "/v1", api_key="x", max_tokens=1024, max_retries=0)  # type: ignore
    agent = create_react_agent(llm, tools=[tool(bash)])
    out = agent.invoke({"messages": [("user", TASK)]}, {"recursion_limit": 200})
    ai = [m for m in out["messages"] if m.type == "ai"]
    return {"ended": "no_tool_call" if not ai[-1].tool_calls else "tool_call", "steps": len(ai)}


def smolagents_run(base: str, kind: str) -> dict[str, Any]:
    from smolagents import CodeAgent, OpenAIServerModel, ToolCallingAgent, tool

    model = OpenAIServerModel(model_id=MODEL, api_base=base + "/v1", api_key="x")
    if kind == "tools":
        agent: Any = ToolCallingAgent(tools=[tool(bash)], model=model, max_steps=200)
    else:  # its code in <code> tags, or in ```python fences ("code-markdown")
        tags = "markdown" if kind == "code-markdown" else None
        agent = CodeAgent(tools=[tool(bash)], model=model, max_steps=200, code_block_tags=tags)
    agent.run(TASK)
    steps = [s for s in agent.memory.steps if type(s).__name__ == "ActionStep"]
    return {"ended": "final_answer" if steps and steps[-1].is_final_answer else "max_steps", "steps": len(steps)}


def mini_swe_agent(base: str) -> dict[str, Any]:
    import os
    from pathlib import Path

    import yaml
    from minisweagent import package_dir
    from minisweagent.agents.default import DefaultAgent
    from minisweagent.environments.local import LocalEnvironment
    from minisweagent.models.litellm_model import LitellmModel

    os.environ.setdefault("MSWEA_COST_TRACKING", "ignore_errors")
    cfg = yaml.safe_load(Path(package_dir / "config" / "default.yaml").read_text())
    model = LitellmModel(model_name=f"openai/{MODEL}", model_kwargs={"api_base": base + "/v1", "api_key": "x"})
    agent = DefaultAgent(model, LocalEnvironment(), **{**cfg["agent"], "step_limit": 200})
    info = agent.run(TASK)
    return {"ended": info.get("exit_status", ""), "steps": agent.n_calls}


def main() -> None:
    name, base = sys.argv[1], sys.argv[2]
    runs = {
        "agents-responses": lambda: asyncio.run(agents_sdk(base, "responses")),
        "agents-chat": lambda: asyncio.run(agents_sdk(base, "chat_completions")),
        "langgraph": lambda: langgraph(base),
        "smolagents-tools": lambda: smolagents_run(base, "tools"),
        "smolagents-code": lambda: smolagents_run(base, "code"),
        "smolagents-code-markdown": lambda: smolagents_run(base, "code-markdown"),
        "mini-swe-agent": lambda: mini_swe_agent(base),
    }
    print(json.dumps(runs[name]()))


if __name__ == "__main__":
    main()
