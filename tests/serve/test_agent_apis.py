"""``kvgate engine``'s Responses and Messages APIs and its tool calls, through the real clients (the OpenAI and
Anthropic Python SDKs): cached tokens in each API's own field, tool calls with harmless arguments an agent loop can
run, streams the SDKs' stream helpers accept, count_tokens, and malformed bodies answered 4xx with a JSON body."""

from __future__ import annotations

import json
from typing import Any

import aiohttp
import openai
import pytest

from kvgate.serve.tools import harmless
from support.aio import timed
from support.engine_server import engine

MODEL = "Qwen/Qwen3-8B"
BASH = {"type": "function", "function": {"name": "bash", "description": "Run a shell command",
                                          "parameters": {"type": "object", "properties": {
                                              "command": {"type": "string"}, "timeout": {"type": "integer"}},
                                              "required": ["command"]}}}


def test_harmless_arguments_follow_the_schema() -> None:
    schema = {"type": "object", "required": ["path", "n", "flags", "mode", "opt", "deep"],
              "properties": {"path": {"type": "string"}, "n": {"type": "integer", "minimum": 1},
                             "flags": {"type": "array", "items": {"type": "string"}},
                             "mode": {"enum": ["read", "write"]}, "opt": {"anyOf": [{"type": "boolean"}]},
                             "deep": {"type": "object", "properties": {"x": {"type": ["null", "number"]}},
                                      "required": ["x"]},
                             "unused": {"type": "string"}}}
    assert harmless(schema) == {"path": "", "n": 1, "flags": [], "mode": "read", "opt": False, "deep": {"x": 0}}
    assert harmless({"type": "object"}) == {} and harmless(None) is None and harmless({"const": 3}) == 3


@timed(60)
async def test_chat_that_offers_tools_gets_a_tool_call_it_can_run_and_send_back() -> None:
    async with engine() as base:
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        try:
            msgs: list[Any] = [{"role": "system", "content": "You are an agent."}, {"role": "user", "content": "ls"}]
            cached = []
            for _ in range(3):  # an agent loop: call, run the tool, send the result back
                r = await client.chat.completions.create(model=MODEL, messages=msgs, tools=[BASH], max_tokens=16)
                ch = r.choices[0]
                assert ch.finish_reason == "tool_calls" and ch.message.tool_calls is not None
                call = ch.message.tool_calls[0]
                assert call.function.name == "bash" and json.loads(call.function.arguments) == {"command": ""}
                assert r.usage is not None and r.usage.prompt_tokens_details is not None
                cached.append(r.usage.prompt_tokens_details.cached_tokens)
                msgs += [ch.message.model_dump(exclude_none=True),
                         {"role": "tool", "tool_call_id": call.id, "content": "a.py\nb.py"}]
            assert cached[0] == 0 and cached[1] > 0 and cached[2] > cached[1]  # the history is reused
            # streamed: the call in a chunk of its own after the text, finish_reason tool_calls
            st = await client.chat.completions.create(model=MODEL, messages=msgs, tools=[BASH], max_tokens=8,
                                                      stream=True, stream_options={"include_usage": True})
            chunks = [c async for c in st]
            calls = [c.choices[0].delta.tool_calls for c in chunks if c.choices and c.choices[0].delta.tool_calls]
            assert len(calls) == 1 and calls[0][0].function.name == "bash"  # type: ignore[index]
            assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"
            assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == 8
            # tool_choice none: text only
            r = await client.chat.completions.create(model=MODEL, messages=msgs, tools=[BASH], tool_choice="none",
                                                     max_tokens=4)
            assert not r.choices[0].message.tool_calls and r.choices[0].finish_reason == "length"
        finally:
            await client.close()


@timed(60)
async def test_responses_whole_and_streamed_with_cached_tokens_in_its_own_field() -> None:
    shell = {"type": "function", "name": "shell", "parameters": {
        "type": "object", "properties": {"command": {"type": "array", "items": {"type": "string"}}},
        "required": ["command"]}}
    async with engine() as base:
        client = openai.AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0)
        try:
            inp: list[Any] = [{"role": "user", "content": "add a --verbose flag " * 10}]
            cached = []
            for _ in range(3):  # Codex's way: store false, the whole input every turn
                r = await client.responses.create(model=MODEL, instructions="You are Codex.", input=inp,
                                                  tools=[shell], max_output_tokens=16, store=False)
                assert r.status == "completed" and [o.type for o in r.output] == ["message", "function_call"]
                call = r.output[1]
                assert call.name == "shell" and json.loads(call.arguments) == {"command": []}  # type: ignore
                assert r.usage is not None and r.usage.output_tokens == 16
                cached.append(r.usage.input_tokens_details.cached_tokens)
                inp += [o.model_dump(exclude_none=True) for o in r.output]
                inp.append({"type": "function_call_output", "call_id": call.call_id, "output": "ok"})  # type: ignore
            assert cached[0] == 0 and 0 < cached[1] < cached[2]
            async with client.responses.stream(model=MODEL, instructions="You are Codex.", input=inp,
                                               tools=[shell], max_output_tokens=8, store=False) as s:
                kinds = [ev.type async for ev in s]
                final = await s.get_final_response()
            assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
            assert kinds.count("response.output_text.delta") == 8
            assert final.usage is not None and final.usage.input_tokens_details.cached_tokens > cached[2]
        finally:
            await client.close()


@timed(60)
async def test_messages_whole_and_streamed_with_cache_read_input_tokens() -> None:
    anthropic = pytest.importorskip("anthropic", reason="the Anthropic SDK is not installed (pip install anthropic)")
    read = {"name": "read_file", "description": "Read a file",
            "input_schema": {"type": "object", "properties": {"path": {"type": "string"}}, "required": ["path"]}}
    async with engine() as base:
        client = anthropic.AsyncAnthropic(base_url=base, api_key="x", max_retries=0)
        try:
            msgs: list[Any] = [{"role": "user", "content": "refactor the parser " * 10}]
            reads = []
            for _ in range(3):
                m = await client.messages.create(model=MODEL, max_tokens=16, system="You are Claude.",
                                                 messages=msgs, tools=[read])
                assert m.stop_reason == "tool_use" and [b.type for b in m.content] == ["text", "tool_use"]
                use = m.content[1]
                assert use.name == "read_file" and use.input == {"path": ""}  # type: ignore[union-attr]
                prompt = m.usage.input_tokens + (m.usage.cache_read_input_tokens or 0) + (
                    m.usage.cache_creation_input_tokens or 0)
                assert prompt > m.usage.input_tokens or not reads  # input_tokens is the uncached part
                reads.append(m.usage.cache_read_input_tokens)
                msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in m.content]},
                         {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id,  # type: ignore
                                                       "content": "def parse(): ..."}]}]
            assert reads[0] == 0 and 0 < reads[1] < reads[2]
            async with client.messages.stream(model=MODEL, max_tokens=8, system="You are Claude.", messages=msgs,
                                              tools=[read]) as s:
                final = await s.get_final_message()
            assert final.stop_reason == "tool_use" and final.usage.output_tokens == 8
            assert (final.usage.cache_read_input_tokens or 0) > reads[2]
            counted = await client.messages.count_tokens(model=MODEL, system="You are Claude.", messages=msgs,
                                                         tools=[read])
            assert counted.input_tokens == prompt_of(final.usage)
        finally:
            await client.close()


def prompt_of(u: Any) -> int:
    return int(u.input_tokens + (u.cache_read_input_tokens or 0) + (u.cache_creation_input_tokens or 0))


@timed(30)
async def test_malformed_responses_and_messages_bodies_get_4xx_json() -> None:
    bad: list[tuple[str, Any, int]] = [
        ("/v1/responses", {"model": MODEL}, 400),
        ("/v1/responses", {"model": MODEL, "input": 5}, 400),
        ("/v1/responses", {"model": MODEL, "input": []}, 400),
        ("/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": 0}, 400),
        ("/v1/responses", {"model": MODEL, "input": "x", "max_output_tokens": "9"}, 400),
        ("/v1/responses", {"model": MODEL, "input": "x", "previous_response_id": "resp_1"}, 400),
        ("/v1/responses", {"model": MODEL, "input": "x", "stream": "yes"}, 400),
        ("/v1/responses", {"model": "other", "input": "x"}, 404),
        ("/v1/messages", {"model": MODEL, "messages": [{"role": "user", "content": "x"}]}, 400),  # no max_tokens
        ("/v1/messages", {"model": MODEL, "max_tokens": 4, "messages": "x"}, 400),
        ("/v1/messages", {"model": MODEL, "max_tokens": 10**9, "messages": [{"role": "user", "content": "x"}]}, 400),
        ("/v1/messages", b"{not json", 400),
        ("/v1/messages", [1, 2], 400),
        ("/v1/messages/count_tokens", {"model": MODEL, "messages": 3}, 400),
    ]
    async with engine() as base, aiohttp.ClientSession() as http:
        for path, body, status in bad:
            data = body if isinstance(body, bytes) else json.dumps(body).encode()
            async with http.post(base + path, data=data, headers={"Content-Type": "application/json"}) as r:
                assert r.status == status, (path, body, r.status, await r.text())
                err = await r.json()
                assert "error" in err and err["error"]["message"], err
        # odd items read as empty text: answered, never a 500
        odd = {"model": MODEL, "max_tokens": 4, "messages": [{"role": "user", "content": [None, {"type": "x"}]},
                                                             {"content": 7}]}
        async with http.post(base + "/v1/messages", json=odd) as r:
            assert r.status == 200
        odd_in = {"model": MODEL, "input": [None, {"type": "reasoning"}, {"type": "function_call"}, "str"]}
        async with http.post(base + "/v1/responses", json=odd_in) as r:
            assert r.status == 200
