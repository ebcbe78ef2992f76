"""The wire dialects (``kvgate.http.dialect``): each API's usage, stream events, budget and conversation, each engine
kind's quirks, with bodies as vLLM 0.32 answers them (its Responses and Messages entrypoints)."""

from __future__ import annotations

import pytest

from kvgate.http.dialect import (
    APIS,
    CHAT,
    COMPLETIONS,
    FLUSH_PATHS,
    MESSAGES,
    RESPONSES,
    SGLANG,
    VLLM,
    Usage,
    api_for_path,
    kind_of,
)
from kvgate.http.openai import EngineInfo

# vLLM 0.32's Responses usage (vllm/entrypoints/openai/responses/protocol.py ResponseUsage): cached always reported
RESPONSES_USAGE = {"input_tokens": 1200, "input_tokens_details": {"cached_tokens": 1024, "cache_write_tokens": 0,
                                                                  "input_tokens_per_turn": [], "cached_tokens_per_turn":
                                                                  []},
                   "output_tokens": 30, "output_tokens_details": {"reasoning_tokens": 0}, "total_tokens": 1230}
# vLLM 0.32's Messages usage (vllm/entrypoints/anthropic/serving.py _build_anthropic_usage): input_tokens is
# prompt - cache_read - cache_creation
MESSAGES_USAGE = {"input_tokens": 76, "output_tokens": 30, "cache_read_input_tokens": 1024,
                  "cache_creation_input_tokens": 100}


def test_each_api_reads_its_own_usage_fields() -> None:
    chat = {"prompt_tokens": 1200, "completion_tokens": 30, "prompt_tokens_details": {"cached_tokens": 1024}}
    assert CHAT.usage(chat) == COMPLETIONS.usage(chat) == Usage(1200, 1024, 30)
    assert RESPONSES.usage(RESPONSES_USAGE) == Usage(1200, 1024, 30)
    assert MESSAGES.usage(MESSAGES_USAGE) == Usage(1200, 1024, 30)
    # without cached-token reporting: vLLM's null details (chat), the absent cache fields (Messages)
    assert CHAT.usage({**chat, "prompt_tokens_details": None}) == Usage(1200, None, 30)
    assert MESSAGES.usage({"input_tokens": 1200, "output_tokens": 30}) == Usage(1200, None, 30)
    # another API's usage, or none at all, is no usage
    assert RESPONSES.usage(chat) is None and CHAT.usage(RESPONSES_USAGE) is None
    assert all(api.usage(None) is None and api.usage({"x": 1}) is None for api in APIS.values())


def test_make_usage_reads_back_through_the_same_dialect() -> None:
    for api in APIS.values():
        u = api.make_usage(1200, 1024, 30, created=100)
        assert api.usage(u) == Usage(1200, 1024, 30), api.name
    assert CHAT.usage(CHAT.make_usage(10, 4, 2, details=None)) == Usage(10, None, 2)
    assert "prompt_tokens_details" not in CHAT.make_usage(10, 4, 2, details=False)
    assert MESSAGES.usage(MESSAGES.make_usage(10, 4, 2, details=False)) == Usage(10, None, 2)


def test_stream_events_carry_usage_where_each_api_puts_it() -> None:
    chunk = {"choices": [], "usage": {"prompt_tokens": 3, "completion_tokens": 1}}
    assert CHAT.event_usage(chunk) == chunk["usage"] and CHAT.usage_only(chunk)
    assert not CHAT.usage_only({"choices": [{"delta": {}}], "usage": None})
    done = {"type": "response.completed", "response": {"id": "resp_1", "usage": RESPONSES_USAGE}}
    assert RESPONSES.event_usage(done) == RESPONSES_USAGE and not RESPONSES.usage_only(done)
    assert RESPONSES.event_usage({"type": "response.created", "response": {"usage": None}}) is None
    start = {"type": "message_start", "message": {"usage": {"input_tokens": 76, "output_tokens": 0}}}
    delta = {"type": "message_delta", "delta": {"stop_reason": "max_tokens"}, "usage": {"output_tokens": 30}}
    assert MESSAGES.event_usage(start) == {"input_tokens": 76, "output_tokens": 0}
    assert MESSAGES.event_usage(delta) == {"output_tokens": 30}
    assert MESSAGES.event_usage({"type": "content_block_delta", "usage": {"output_tokens": 1}}) is None
    assert [a.usage_option for a in (COMPLETIONS, CHAT, RESPONSES, MESSAGES)] == [True, True, False, False]


def test_output_budget_per_api() -> None:
    assert RESPONSES.budget({"max_output_tokens": 300, "max_tokens": 5}, 1024) == 300
    assert MESSAGES.budget({"max_tokens": 300}, 1024) == 300
    assert RESPONSES.budget({}, 1024) == 1024


def test_conversations_split_into_head_and_items() -> None:
    msgs = [{"role": "system", "content": "S"}, {"role": "developer", "content": "D"},
            {"role": "user", "content": "U"}, {"role": "system", "content": "late"}]
    assert CHAT.conversation({"messages": msgs}) == (msgs[:2], msgs[2:])
    head, items = RESPONSES.conversation({"instructions": "I", "input": "hello"})  # type: ignore[misc]
    assert head == [{"role": "system", "content": "I"}] and items == [{"role": "user", "content": "hello"}]
    system = [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"}, {"type": "text", "text": "You are"}]
    head, items = MESSAGES.conversation({"system": system, "messages": msgs[2:]})  # type: ignore[misc]
    assert head == [{"role": "system", "content": system}] and items == msgs[2:]
    for api in (CHAT, RESPONSES, MESSAGES):
        assert api.conversation({"messages": "x", "input": 3}) is None
    assert COMPLETIONS.conversation({"prompt": "x"}) is None


def test_items_read_as_role_text_and_calls_in_every_api() -> None:
    call = {"role": "assistant", "content": None,
            "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "bash", "arguments": '{"c":1}'}}]}
    assert CHAT.parts(call) == ("assistant", "", (("c1", "bash", '{"c":1}'),))
    assert CHAT.parts({"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "image_url"}]}) == (
        "user", "a", ())
    assert RESPONSES.parts({"type": "function_call", "call_id": "c1", "name": "bash", "arguments": "{}"}) == (
        "assistant", "", (("c1", "bash", "{}"),))
    assert RESPONSES.parts({"type": "function_call_output", "call_id": "c1", "output": "ok"}) == ("tool", "ok", ())
    assert RESPONSES.parts({"type": "message", "role": "user",
                            "content": [{"type": "input_text", "text": "hi"}]}) == ("user", "hi", ())
    use = {"role": "assistant", "content": [{"type": "text", "text": "Run it."},
                                            {"type": "tool_use", "id": "t1", "name": "bash", "input": {"c": 1}}]}
    assert MESSAGES.parts(use) == ("assistant", "Run it.", (("t1", "bash", '{"c":1}'),))
    res = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "out"}]}
    assert MESSAGES.parts(res) == ("user", "out", ())
    for api in APIS.values():  # odd items read as empty, never raise
        for odd in (None, 3, "x", {"content": 7}, {"role": 1, "content": [None, 2]}):
            assert isinstance(api.parts(odd), tuple)


def test_paths_and_kinds() -> None:
    assert api_for_path("/v1/messages") is MESSAGES and api_for_path("/v1/messages/count_tokens") is None
    assert {"/reset_prefix_cache", "/flush_cache"} == FLUSH_PATHS
    assert kind_of("sglang") is SGLANG and kind_of("what").name == "unknown"
    assert VLLM.metrics.kv_usage[0] == "vllm:kv_cache_usage_perc" and SGLANG.flush_busy == 400


@pytest.mark.parametrize("report", [True, False, None])
def test_sglang_omits_a_zero_cached_count_only_when_reporting(report: bool | None) -> None:
    info = EngineInfo(kind="sglang", cache_report=report)
    omitted = Usage(100, None, 5)
    assert info.cached(omitted) == (0 if report else None)
    assert info.cached(Usage(100, 64, 5)) == 64
    assert EngineInfo(kind="vllm").cached(omitted) is None  # vLLM without the flag: unknown, not 0
    gw = EngineInfo(kind="kvgate-gateway", cache_report=report, gateway={"upstream": {"kind": "sglang"}})
    assert gw.cached(omitted) == (0 if report else None)
