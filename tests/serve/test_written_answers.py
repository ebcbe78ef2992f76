"""``kvgate engine`` answering a code agent (no tools; its system prompt asks for code blocks that end the run by
calling ``final_answer``): a block that prints until the conversation's last turn, then one that calls
``final_answer``, in the block format the prompt shows, ended at the request's stop strings; deterministic per seed;
requests that ask for no code answered as before."""

from __future__ import annotations

import re
from typing import Any

import openai

from kvgate.http.dialect import CHAT, MESSAGES
from kvgate.serve.agent import AgentPolicy, AgentTurns
from kvgate.serve.tokenizer import Tokenizer
from kvgate.serve.written import code_ask
from support.aio import timed
from support.engine_server import engine

MODEL = "Qwen/Qwen3-8B"


def code_prompt(opening: str, closing: str) -> str:
    """A code agent's system prompt in the shape of smolagents' (prompts/code_agent.yaml)."""
    return (
        "You are an expert assistant who can solve any task using code blobs.\n"
        f"The code sequence must be opened with '{opening}', and closed with '{closing}'.\n"
        "In the end you have to return a final answer using the `final_answer` tool.\n---\n"
        f'Task: "What is 5 + 3?"\n\nThought: I will compute it.\n{opening}\nresult = 5 + 3\nfinal_answer(result)\n'
        f"{closing}\n---\nAbove example were using notional tools.\n"
        f"{opening}\ndef final_answer(answer: any) -> any:\n    \"\"\"Provides a final answer\"\"\"\n{closing}\n")


STOPS = ["Observation:", "Calling tools:", "</code>"]


def code_convo(opening: str, closing: str, turns_done: int, task: str = "Fix the bug") -> list[dict[str, Any]]:
    msgs: list[dict[str, Any]] = [{"role": "system", "content": code_prompt(opening, closing)},
                                  {"role": "user", "content": f"New task:\n{task}"}]
    for _ in range(turns_done):
        msgs += [{"role": "assistant", "content": f"Thought: x\n{opening}\nprint(1)\n{closing}"},
                 {"role": "user", "content": "Observation:\nExecution logs:\n1\n"}]
    return msgs


def code_of(text: str, opening: str, closing: str) -> str:
    """The code smolagents' parse_code_blobs takes from an answer (the closing tag added back when it stopped)."""
    if not text.strip().endswith(closing):
        text += closing
    found = re.findall(rf"{re.escape(opening)}(.*?){re.escape(closing)}", text, re.DOTALL)
    assert found, text
    return "\n\n".join(m.strip() for m in found)


def test_the_prompts_block_format_is_found() -> None:
    assert code_ask(code_prompt("<code>", "</code>")) == ("<code>", "</code>")
    assert code_ask(code_prompt("```python", "```")) == ("```python", "```")
    assert code_ask(code_prompt("```py", "```")) == ("```py", "```")
    # code blocks that do not end a run, or a final_answer outside any block: no ask
    assert code_ask("Write code.\n```python\nprint(1)\n```\nthen call final_answer") is None
    assert code_ask("You are an agent. Reply in prose.") is None


def test_prints_until_the_last_turn_then_calls_final_answer() -> None:
    pol = AgentPolicy(AgentTurns(turns=3))
    for opening, closing, stops in (("<code>", "</code>", STOPS), ("```py", "```", STOPS[:2])):
        codes = []
        for k in range(4):
            r = pol.reply(CHAT, {"messages": code_convo(opening, closing, k), "stop": stops}, 100_000)
            assert r is not None and r.text is not None and r.call is None and r.finish == "stop"
            text = r.text.text(0, r.tokens)
            assert r.tokens == len(r.text.ids) and "Observation:" not in text
            assert text.endswith("\n") if closing in stops else text.endswith(closing)
            codes.append(code_of(text, opening, closing))
            # its tokens are what the engine's tokenizer makes of its text: sent back, it hits its KV
            assert Tokenizer().encode(text) == r.text.ids.tolist()
        assert codes == ['print("looked")'] * 2 + ['final_answer("done")'] * 2
        again = AgentPolicy(AgentTurns(turns=3)).reply(CHAT, {"messages": code_convo(opening, closing, 1)}, 500)
        first = pol.reply(CHAT, {"messages": code_convo(opening, closing, 1)}, 500)
        assert again is not None and first is not None and again.text is not None and first.text is not None
        assert again.text.pieces == first.text.pieces and again.tokens == first.tokens


def test_the_shapes_output_length_and_the_budget() -> None:
    pol = AgentPolicy(AgentTurns(turns=3))
    long = pol.reply(CHAT, {"messages": code_convo("<code>", "</code>", 0)}, 100_000)
    assert long is not None and long.text is not None and long.finish == "stop"
    cut = pol.reply(CHAT, {"messages": code_convo("<code>", "</code>", 0), "max_tokens": 5}, 5)
    assert cut is not None and cut.text is not None and cut.finish == "length" and cut.tokens == 5
    assert cut.text.pieces == long.text.pieces[:5]


def test_no_code_asked_is_answered_as_before() -> None:
    pol = AgentPolicy(AgentTurns(turns=3))
    plain = [{"role": "system", "content": "You are helpful."}, {"role": "user", "content": "hi"}]
    assert pol.reply(CHAT, {"messages": plain}, 100) is None
    assert pol.reply(CHAT, {"messages": code_convo("<code>", "</code>", 0), "tool_choice": "none"}, 100) is None
    assert pol.reply(MESSAGES, {"system": "Reply in prose.", "messages": plain[1:]}, 100) is None


@timed(60)
async def test_a_code_agent_loop_ends_by_itself_whole_and_streamed() -> None:
    async with engine(agent=AgentTurns(turns=3)) as base:
        oai = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        try:
            for stream in (False, True):
                msgs: list[Any] = code_convo("<code>", "</code>", 0, f"task {stream}")
                codes = []
                for _ in range(5):
                    if stream:
                        st = await oai.chat.completions.create(model=MODEL, messages=msgs, stop=STOPS, stream=True)
                        chunks = [c async for c in st]
                        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
                        fin = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
                    else:
                        r = await oai.chat.completions.create(model=MODEL, messages=msgs, stop=STOPS)
                        text, fin = r.choices[0].message.content or "", [r.choices[0].finish_reason]
                    assert fin == ["stop"]
                    codes.append(code_of(text, "<code>", "</code>"))
                    if "final_answer(" in codes[-1]:
                        break
                    msgs += [{"role": "assistant", "content": text + "</code>"},
                             {"role": "user", "content": "Observation:\nExecution logs:\nlooked\n"}]
                assert codes == ['print("looked")', 'print("looked")', 'final_answer("done")']
        finally:
            await oai.close()


FENCE = "```"
LISTING = (f"To suggest changes to a file you MUST return the entire content of the updated file.\n"
           f"You MUST use this *file listing* format:\n\npath/to/filename.js\n{FENCE}\n// entire file content ...\n"
           f"{FENCE}\n")
BLOCKS = (f"Every *SEARCH/REPLACE block* must use this format:\n1. The file path\n2. The opening fence: {FENCE}\n"
          f"3. <<<<<<< SEARCH\n4. the lines to find\n5. =======\n6. the lines to put instead\n7. >>>>>>> REPLACE\n"
          f"mathweb/flask/app.py\n{FENCE}python\n<<<<<<< SEARCH\nfrom flask import Flask\n=======\nimport math\n"
          f">>>>>>> REPLACE\n{FENCE}\n")


def edit_convo(system: str) -> list[dict[str, Any]]:
    """An edit request in the shape of aider's: the format, the file added to the chat, the ask (and the format
    again, its example included)."""
    return [{"role": "system", "content": "Act as an expert software developer.\n" + system},
            {"role": "user", "content": "Change the greeting"},
            {"role": "assistant", "content": f"Ok.\n\nshow_greeting.py\n{FENCE}\nprint('Hey')\n{FENCE}\n"},
            {"role": "user", "content": f"I have *added these files to the chat*.\n\ncalc.py\n{FENCE}\n"
                                        f"\ndef add(a, b):\n    return a - b\n{FENCE}\n"},
            {"role": "assistant", "content": "Ok, any changes I propose will be to those files."},
            {"role": "user", "content": "Fix the bug in calc.py\n\n" + system}]


def test_an_edit_in_the_format_asked_that_changes_nothing() -> None:
    pol = AgentPolicy(AgentTurns(turns=3))
    whole = pol.reply(CHAT, {"messages": edit_convo(LISTING)}, 256)
    assert whole is not None and whole.text is not None and whole.finish == "stop"
    text = whole.text.text(0, whole.tokens)
    assert text.endswith(f"\n\ncalc.py\n{FENCE}\n\ndef add(a, b):\n    return a - b\n{FENCE}\n"), text
    assert "path/to" not in text and "show_greeting" not in text
    diff = pol.reply(CHAT, {"messages": edit_convo(BLOCKS)}, 256)
    assert diff is not None and diff.text is not None
    text = diff.text.text(0, diff.tokens)
    block = "<<<<<<< SEARCH\ndef add(a, b):\n=======\ndef add(a, b):\n>>>>>>> REPLACE\n"
    assert text.endswith(f"\n\ncalc.py\n{FENCE}\n{block}{FENCE}\n"), text
    assert Tokenizer().encode(text) == diff.text.ids.tolist()
    # no file shown, or no format asked: filler as before
    bare = [m for m in edit_convo(LISTING) if "added these files" not in m["content"]]
    assert pol.reply(CHAT, {"messages": bare}, 256) is None
    prose = [{**m, "content": "Act as an expert."} if m["role"] == "system" else m for m in edit_convo("")]
    assert pol.reply(CHAT, {"messages": prose}, 256) is None
