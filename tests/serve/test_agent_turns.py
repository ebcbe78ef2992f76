"""``kvgate engine`` answering agents: a tool call until the conversation's last turn, then an answer that ends, the
turn counted from the conversation; never a tool that only spawns agents; deterministic per seed; ``length`` only
where the budget cut the answer; requests without tools answered as before."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest

from kvgate.http.dialect import CHAT, MESSAGES, RESPONSES
from kvgate.serve.agent import SUBTASK, AgentPolicy, AgentTurns
from support.aio import timed
from support.engine_server import engine

MODEL = "Qwen/Qwen3-8B"


def fn(name: str) -> dict[str, Any]:
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}}


TOOLS = [fn("Task"), fn("Agent"), fn("AskUserQuestion"), fn("Read"), fn("Bash"), fn("Grep")]


def convo(turns_done: int, task: str = "fix the parser") -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": task}]
    for k in range(turns_done):
        msgs += [{"role": "assistant", "content": "x", "tool_calls": [
                     {"id": f"c{k}", "type": "function", "function": {"name": "Read", "arguments": "{}"}}]},
                 {"role": "tool", "tool_call_id": f"c{k}", "content": "ok"}]
    return msgs


def test_calls_tools_until_the_last_turn_then_ends() -> None:
    pol = AgentPolicy(AgentTurns(turns=4))
    names = []
    for k in range(6):
        r = pol.reply(CHAT, {"messages": convo(k), "tools": TOOLS}, 100_000)
        assert r is not None
        if k < 3:
            assert r.finish == "tool" and r.call is not None
            names.append(r.call[0])
            assert json.loads(r.call[1]) == {"path": ""}
        else:  # the last turn, and any later one: an answer with no call, ended by itself under a large budget
            assert r.call is None and r.finish == "stop" and r.tokens < 100_000
    assert not {"Task", "Agent", "AskUserQuestion"} & set(names)
    # deterministic per seed and conversation
    assert pol.reply(CHAT, {"messages": convo(1), "tools": TOOLS}, 500) == AgentPolicy(AgentTurns(turns=4)).reply(
        CHAT, {"messages": convo(1), "tools": TOOLS}, 500)


def test_only_spawning_tools_offered_means_an_answer_unless_asked() -> None:
    spawn_only = {"messages": convo(0), "tools": [fn("Task")]}
    r = AgentPolicy(AgentTurns(turns=5)).reply(CHAT, spawn_only, 1000)
    assert r is not None and r.call is None
    r = AgentPolicy(AgentTurns(turns=5, spawn=True)).reply(CHAT, spawn_only, 1000)
    assert r is not None and r.call is not None and r.call[0] == "Task"
    named = {**spawn_only, "tool_choice": {"type": "function", "function": {"name": "Task"}}}
    r = AgentPolicy(AgentTurns(turns=5)).reply(CHAT, named, 1000)
    assert r is not None and r.call is not None and r.call[0] == "Task"
    assert AgentPolicy(AgentTurns(turns=5)).reply(CHAT, {**spawn_only, "tool_choice": "none"}, 1000) is None
    assert AgentPolicy(AgentTurns(turns=5)).reply(CHAT, {"messages": convo(0)}, 1000) is None


def test_codex_spawning_tool_is_never_drawn() -> None:
    pol = AgentPolicy(AgentTurns(turns=50))
    tools = [fn("multi_agent_v1"), fn("exec_command")]
    calls = {r.call[0] for k in range(40) if (r := pol.reply(CHAT, {"messages": convo(k), "tools": tools}, 100))
             and r.call}
    assert calls == {"exec_command"}


def test_last_answer_ends_unless_a_budget_it_set_cut_it() -> None:
    """Codex sets no max_output_tokens: an answer of the default budget's length ends (``stop``), it is not cut."""
    pol = AgentPolicy(AgentTurns(turns=1))
    body = {"input": [{"role": "user", "content": "go"}], "tools": [{"type": "function", "name": "x"}]}
    unset = pol.reply(RESPONSES, body, 256)
    assert unset is not None and unset.call is None and unset.finish == "stop"
    given = pol.reply(RESPONSES, {**body, "max_output_tokens": 256}, 256)
    assert given is not None and given.tokens == unset.tokens and given.finish == "length"


def test_the_trace_draws_each_conversations_turns_and_the_budget_cuts_only_when_reached() -> None:
    pol = AgentPolicy(AgentTurns())
    ends = []
    for task in ("task a", "task b", "task c"):
        k = 0
        while True:
            r = pol.reply(CHAT, {"messages": convo(k, task), "tools": TOOLS}, 100_000)
            assert r is not None
            if r.call is None:
                break
            k += 1
        ends.append(k + 1)
    shapes = pol.shapes
    assert all(min(s.turns for s in shapes) <= n <= max(s.turns for s in shapes) for n in ends)
    assert len(set(ends)) > 1  # each conversation its own shape
    last = pol.reply(CHAT, {"messages": convo(ends[0] - 1, "task a"), "tools": TOOLS}, 1)
    assert last is not None and last.call is None and last.finish == "length" and last.tokens == 1


def test_each_api_counts_its_own_assistant_turns() -> None:
    pol = AgentPolicy(AgentTurns(turns=2))
    tool = {"name": "read", "input_schema": {"type": "object"}}
    msgs = [{"role": "user", "content": "go"}]
    assert pol.reply(MESSAGES, {"messages": msgs, "tools": [tool]}, 100) is not None
    first = pol.reply(MESSAGES, {"messages": msgs, "tools": [tool]}, 100)
    assert first is not None and first.call is not None
    after = msgs + [{"role": "assistant", "content": [{"type": "text", "text": "x"}, {"type": "tool_use", "id": "t",
                                                                                    "name": "read", "input": {}}]},
                    {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "ok"}]}]
    r = pol.reply(MESSAGES, {"messages": after, "tools": [tool]}, 100_000)
    assert r is not None and r.call is None
    rtool = {"type": "function", "name": "shell", "parameters": {"type": "object"}}
    inp = [{"role": "user", "content": "go"}, {"type": "message", "role": "assistant", "content": []},
           {"type": "function_call", "call_id": "c", "name": "shell", "arguments": "{}"},
           {"type": "function_call_output", "call_id": "c", "output": "ok"}]
    r = pol.reply(RESPONSES, {"input": inp, "tools": [rtool]}, 100_000)
    assert r is not None and r.call is None  # message + call: one assistant turn


@timed(60)
async def test_an_agent_loop_ends_by_itself_on_each_api() -> None:
    anthropic = pytest.importorskip("anthropic", reason="the Anthropic SDK is not installed (pip install anthropic)")
    async with engine(agent=AgentTurns(turns=3)) as base:
        oai = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        ant = anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0)
        try:
            msgs: list[Any] = [{"role": "user", "content": "ls"}]
            reasons = []
            for _ in range(5):
                st = await oai.chat.completions.create(model=MODEL, messages=msgs, tools=[fn("Read"), fn("Task")],
                                                       max_tokens=4000, stream=True)
                chunks = [c async for c in st]
                fin = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
                reasons.append(fin[-1])
                calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
                if fin[-1] != "tool_calls":
                    assert not calls
                    break
                call = calls[0][0]  # type: ignore[index]
                assert call.function.name == "Read"  # type: ignore[union-attr]
                msgs += [{"role": "assistant", "content": "", "tool_calls": [{"id": call.id, "type": "function",
                          "function": {"name": "Read", "arguments": "{}"}}]},
                         {"role": "tool", "tool_call_id": call.id, "content": "ok"}]
            assert reasons == ["tool_calls", "tool_calls", "stop"]
            tool = {"name": "Read", "input_schema": {"type": "object", "properties": {}}}
            am: list[Any] = [{"role": "user", "content": "ls"}]
            stops = []
            for _ in range(5):
                m = await ant.messages.create(model=MODEL, max_tokens=4000, messages=am, tools=[tool])
                stops.append(m.stop_reason)
                if m.stop_reason != "tool_use":
                    break
                use = m.content[-1]
                am += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                       {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,  # type: ignore
                                                     "content": "ok"}]}]
            assert stops == ["tool_use", "tool_use", "end_turn"]
            rt = {"type": "function", "name": "shell", "parameters": {"type": "object", "properties": {}}}
            inp: list[Any] = [{"role": "user", "content": "ls"}]
            kinds = []
            for _ in range(5):
                r = await oai.responses.create(model=MODEL, input=inp, tools=[rt], store=False)  # type: ignore
                kinds.append([o.type for o in r.output])
                calls = [o for o in r.output if o.type == "function_call"]
                assert r.status == "completed"
                if not calls:
                    break
                inp += [o.model_dump(exclude_none=True) for o in r.output]
                inp.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": "ok"})
            assert kinds == [["message", "function_call"]] * 2 + [["message"]]
            # no tools: as before, the whole budget, cut by it
            r0 = await oai.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "hi"}],
                                                   max_tokens=7)
            assert r0.choices[0].finish_reason == "length" and r0.usage is not None
            assert r0.usage.completion_tokens == 7
        finally:
            await oai.close()
            await ant.close()


def test_mini_swe_agent_last_turn_echoes_its_submit_command() -> None:
    """mini-swe-agent ends only on the command its prompt names: its last turn runs that, through its bash tool."""
    pol = AgentPolicy(AgentTurns(turns=2))
    bash = {"type": "function", "function": {"name": "bash", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}}
    msgs = convo(1, "Fix it. Finish by issuing `echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`.")
    last = pol.reply(CHAT, {"messages": msgs, "tools": [bash]}, 1000)
    assert last is not None and last.call == ("bash", '{"command": "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"}')
    first = pol.reply(CHAT, {"messages": msgs[:2], "tools": [bash]}, 1000)
    assert first is not None and first.call is not None and "COMPLETE" not in first.call[1]
    plain = pol.reply(CHAT, {"messages": convo(1), "tools": [bash]}, 1000)
    assert plain is not None and plain.call is None


def test_agent_spawn_calls_the_spawning_tool_once_per_session_tree() -> None:
    """``--agent-spawn``: the first turn calls the first spawning tool, in the foreground, its text the subtask;
    later turns, and the spawned agent's conversation (it opens with that text), draw none."""
    agent = {"type": "function", "function": {"name": "Agent", "parameters": {
        "type": "object", "required": ["description", "prompt"], "properties": {
            "description": {"type": "string"}, "prompt": {"type": "string"},
            "model": {"type": "string", "enum": ["sonnet", "opus"]}, "run_in_background": {"type": "boolean"}}}}}
    tools = [agent, fn("Read"), fn("Task")]
    pol = AgentPolicy(AgentTurns(turns=3, spawn=True))
    first = pol.reply(CHAT, {"messages": convo(0), "tools": tools}, 1000)
    assert first is not None and first.finish == "tool" and first.call is not None and first.call[0] == "Agent"
    assert json.loads(first.call[1]) == {"description": SUBTASK, "prompt": SUBTASK, "run_in_background": False}
    later = [pol.reply(CHAT, {"messages": convo(k), "tools": tools}, 1000) for k in (1, 2)]
    assert [r.call[0] if r and r.call else None for r in later][1] is None
    assert later[0] is not None and later[0].call is not None and later[0].call[0] == "Read"
    sub = [pol.reply(CHAT, {"messages": convo(k, SUBTASK), "tools": tools}, 1000) for k in range(3)]
    assert [r.call[0] if r and r.call else None for r in sub] == ["Read", "Read", None]
    one = AgentPolicy(AgentTurns(turns=1, spawn=True)).reply(CHAT, {"messages": convo(0), "tools": tools}, 1000)
    assert one is not None and one.call is None  # a one-turn session answers
    off = AgentPolicy(AgentTurns(turns=3)).reply(CHAT, {"messages": convo(0), "tools": tools}, 1000)
    assert off is not None and off.call is not None and off.call[0] == "Read"


def test_agent_spawn_on_the_harnesses_first_turns() -> None:
    """The real first turns: Claude Code's Agent in the foreground (its subagent_type optional, left out);
    opencode's task with the first agent type its description lists (its subagent_type required)."""
    bodies = Path(__file__).resolve().parents[1] / "data" / "harness-bodies"
    pol = AgentPolicy(AgentTurns(turns=3, spawn=True))
    cc = pol.reply(MESSAGES, json.loads((bodies / "claude-code-first-turn.json").read_text())["body"], 1000)
    assert cc is not None and cc.call is not None and cc.call[0] == "Agent"
    assert json.loads(cc.call[1]) == {"description": SUBTASK, "prompt": SUBTASK, "run_in_background": False}
    oc = pol.reply(CHAT, json.loads((bodies / "opencode-first-turn.json").read_text())["body"], 1000)
    assert oc is not None and oc.call is not None and oc.call[0] == "task"
    assert json.loads(oc.call[1]) == {"description": SUBTASK, "prompt": SUBTASK, "subagent_type": "explore"}
