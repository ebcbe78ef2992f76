"""The gateway's I/O-free parts: the context estimator, the SSE usage scanner, pool parsing, metrics windows, config."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.errors import UsageError
from kvgate.gateway.config import GatewayConfig, load_config_file
from kvgate.gateway.estimate import estimate_context, estimate_turn, item_chars, record_turn, starts_over
from kvgate.gateway.logs import JsonFormatter
from kvgate.gateway.metrics import Histogram, UsageWindows, regime_alarm
from kvgate.gateway.sessions import GwSession
from kvgate.gateway.stream import UsageScanner, with_include_usage
from kvgate.http.dialect import CHAT, COMPLETIONS, RESPONSES, Usage
from kvgate.policy.config import parse_control_opts as control_opts

# -- the estimator -------------------------------------------------------------------------------------------


def test_token_id_prompts_are_exact() -> None:
    s = GwSession("s", False).est
    assert estimate_context(s, {"prompt": list(range(1234))}, COMPLETIONS)[0] == 1234
    assert estimate_context(s, {"prompt": [[1, 2, 3], [4, 5]]}, COMPLETIONS)[0] == 5


def test_text_prompt_estimate_grows_by_the_appended_text() -> None:
    s = GwSession("s", False).est
    p1 = "x" * 400
    L, kind, sent = estimate_context(s, {"prompt": p1}, COMPLETIONS)
    assert L == 100  # chars / 4 on a first turn
    record_turn(s, L, kind, sent, Usage(120, None, 30))
    # the next prompt = previous prompt + the reply (30 tokens, ~120 chars) + 80 appended chars
    p2 = p1 + "r" * 120 + "a" * 80
    L2, _, _ = estimate_context(s, {"prompt": p2}, COMPLETIONS)
    assert L2 == 120 + 30 + 20  # known from usage + appended / 4
    # without usage, the previous estimate is the base and the whole delta counts
    record_turn(s, L2, kind, len(p2), None)
    p3 = p2 + "b" * 40
    assert estimate_context(s, {"prompt": p3}, COMPLETIONS)[0] == L2 + 10
    # a shorter prompt (history rewritten) starts over
    assert estimate_context(s, {"prompt": "y" * 40}, COMPLETIONS)[0] == 10


def test_chat_estimate_counts_new_messages_and_skips_the_reply() -> None:
    s = GwSession("s", False).est
    msgs = [{"role": "system", "content": "s" * 100}, {"role": "user", "content": "u" * 300}]
    L, kind, sent = estimate_context(s, {"messages": msgs}, CHAT)
    assert L == 100 + 2 * 4 and sent == 2
    record_turn(s, L, kind, sent, Usage(110, None, 50))
    msgs2 = [*msgs, {"role": "assistant", "content": "r" * 200}, {"role": "user", "content": "t" * 40}]
    L2, _, sent2 = estimate_context(s, {"messages": msgs2}, CHAT)
    assert sent2 == 4
    assert L2 == 110 + 50 + 10 + 2 * 4  # the reply's text is in completion_tokens; only its overhead is added
    # tool calls and text parts count
    m = {"role": "assistant", "content": None, "tool_calls": [{"function": {"name": "ls", "arguments": "{}"}}]}
    assert item_chars(CHAT, m) == 4
    assert item_chars(CHAT, {"role": "user", "content": [{"type": "text", "text": "abcd"}, {"type": "image"}]}) == 4


def test_one_reading_tells_the_estimate_and_whether_the_turn_starts_over() -> None:
    """estimate_turn's flag is starts_over's answer and its estimate estimate_context's, on every kind of turn: a
    first one, an extended conversation, the same one again, a shorter one, a rewrite (fresh), another API, a
    Responses turn continuing on the server, a completions prompt, no conversation at all."""
    sys_ = {"role": "system", "content": "s" * 100}
    u1, r1, u2 = ({"role": "user", "content": "u" * 300}, {"role": "assistant", "content": "r" * 200},
                  {"role": "user", "content": "t" * 40})
    first, longer, shorter = {"messages": [sys_, u1]}, {"messages": [sys_, u1, r1, u2]}, {"messages": [u2]}
    seen = set()
    for before in (None, first, longer):
        for body, api in ((first, CHAT), (longer, CHAT), (shorter, CHAT), ({"messages": "x"}, CHAT), ({}, CHAT),
                          ({"input": "hi", "previous_response_id": "r1"}, RESPONSES), ({"input": "hi"}, RESPONSES),
                          ({"prompt": "x" * 400}, COMPLETIONS)):
            for fresh in (False, True):
                s = GwSession("s", False).est
                if before is not None:
                    L, kind, sent = estimate_context(s, before, CHAT)
                    record_turn(s, L, kind, sent, Usage(L + 10, None, 50))
                got = estimate_turn(s, body, api, fresh)
                assert got[:3] == estimate_context(s, body, api, fresh)
                assert got[3] is starts_over(s, body, api, fresh), (before, body, fresh)
                seen.add(got[3])
    assert seen == {True, False}


def test_estimator_never_raises_on_odd_bodies() -> None:
    s = GwSession("s", False).est
    body: dict[str, Any]
    for body in ({}, {"prompt": None}, {"prompt": 5}, {"prompt": []}, {"prompt": [None]}, {"messages": "x"},
                 {"messages": [None, 3, {"content": 7}]}, {"prompt": ["ab", 3]}):
        L, _, _ = estimate_context(s, body, CHAT if "messages" in body else COMPLETIONS)
        assert L >= 0


def test_output_budget() -> None:
    assert COMPLETIONS.budget({"max_tokens": 7}, 1024) == 7
    assert CHAT.budget({"max_completion_tokens": 9}, 1024) == 9
    assert CHAT.budget({"max_tokens": None, "max_completion_tokens": 9}, 1024) == 9
    assert CHAT.budget({"max_tokens": 7, "max_completion_tokens": 9}, 1024) == 9  # vLLM: it wins
    assert COMPLETIONS.budget({"max_tokens": "7"}, 1024) == 1024
    assert COMPLETIONS.budget({"max_tokens": True}, 1024) == 1024


# -- stream usage ---------------------------------------------------------------------------------------------

CHUNK = b'data: {"id":"c","choices":[{"index":0,"text":"hi"}]}\n\n'
USAGE = b'data: {"id":"c","choices":[],"usage":{"prompt_tokens":12,"completion_tokens":2}}\n\n'
DONE = b"data: [DONE]\n\n"


@settings(max_examples=200, deadline=None)
@given(cuts=st.lists(st.integers(min_value=0, max_value=len(CHUNK * 3 + USAGE + DONE)), max_size=8),
       drop=st.booleans(), crlf=st.booleans())
def test_scanner_on_any_chunking(cuts: list[int], drop: bool, crlf: bool) -> None:
    stream = CHUNK * 3 + USAGE + DONE
    if crlf:
        stream = stream.replace(b"\n\n", b"\r\n\r\n")
    pieces = [stream[a:b] for a, b in zip([0, *sorted(cuts)], [*sorted(cuts), len(stream)], strict=True)]
    sc = UsageScanner(drop_usage_only=drop)
    out = b"".join(sc.feed(p) for p in pieces) + sc.flush()
    usage = USAGE.replace(b"\n\n", b"\r\n\r\n") if crlf else USAGE
    assert out == (stream.replace(usage, b"") if drop else stream)
    assert sc.usage == {"prompt_tokens": 12, "completion_tokens": 2}


def test_scanner_keeps_usage_with_choices_and_ignores_null_usage() -> None:
    sc = UsageScanner(drop_usage_only=True)
    cont = b'data: {"choices":[{"text":"a"}],"usage":{"prompt_tokens":3,"completion_tokens":1}}\n\n'
    null = b'data: {"choices":[{"text":"a"}],"usage":null}\n\n'
    assert sc.feed(null) == null and sc.usage is None
    assert sc.feed(cont) == cont and sc.usage == {"prompt_tokens": 3, "completion_tokens": 1}


# vLLM 0.32's usage: prompt_tokens_details also carries created_cache_tokens (and multimodal_tokens)
VLLM_032_USAGE = {"prompt_tokens": 1000, "total_tokens": 1004, "completion_tokens": 4,
                  "prompt_tokens_details": {"cached_tokens": 896, "created_cache_tokens": 104,
                                            "multimodal_tokens": None}}


def test_vllm_032_usage_in_a_body_and_in_the_final_stream_chunk() -> None:
    assert COMPLETIONS.usage(VLLM_032_USAGE) == Usage(1000, 896, 4)
    unknown = {**VLLM_032_USAGE, "prompt_tokens_details": {"cached_tokens": None, "created_cache_tokens": 104}}
    assert COMPLETIONS.usage(unknown) == Usage(1000, None, 4)
    final = b"data: " + json.dumps({"id": "cmpl-1", "object": "text_completion", "created": 1, "model": "m",
                                    "choices": [], "usage": VLLM_032_USAGE}).encode() + b"\n\n"
    for drop in (True, False):
        sc = UsageScanner(drop_usage_only=drop)
        out = sc.feed(CHUNK + final[:40]) + sc.feed(final[40:] + DONE) + sc.flush()
        assert sc.usage == VLLM_032_USAGE and out == (CHUNK + DONE if drop else CHUNK + final + DONE)


def test_include_usage_splice_and_reencode() -> None:
    raw = b'{"model":"m","stream":true,"prompt":"hi"}'
    out = with_include_usage(raw, json.loads(raw))
    assert out == b'{"stream_options":{"include_usage":true},"model":"m","stream":true,"prompt":"hi"}'
    raw = b'  {\n "stream": true}'
    assert json.loads(with_include_usage(raw, json.loads(raw))) == {
        "stream": True, "stream_options": {"include_usage": True}}
    raw = b'{"stream":true,"stream_options":{"continuous_usage_stats":true}}'
    assert json.loads(with_include_usage(raw, json.loads(raw)))["stream_options"] == {
        "continuous_usage_stats": True, "include_usage": True}
    raw = b'{"stream":true,"stream_options":null}'
    assert json.loads(with_include_usage(raw, json.loads(raw)))["stream_options"] == {"include_usage": True}


# -- metrics -----------------------------------------------------------------------------------------------------


def test_usage_windows_and_alarm() -> None:
    w = UsageWindows()
    w.add(0.0, 1000, 900)
    w.add(100.0, 1000, 100)
    w.add(290.0, 1000, None)  # no cached report: counts for the mean context, not for the hit ratio
    assert w.hit_ratio(290.0, 60.0) is not None and math.isnan(w.hit_ratio(290.0, 60.0))
    assert w.hit_ratio(290.0, 300.0) == pytest.approx(0.5)
    assert w.hit_ratio(350.0, 300.0) == pytest.approx(0.1)  # the turn at t=0 has left the window
    assert w.mean_prompt(290.0, 300.0) == pytest.approx(1000.0)
    assert regime_alarm(0.1, 500, 1000, 5, 100.0) == (False, 10.0)  # D < C and 5 < N* = 10
    assert regime_alarm(0.1, 500, 1000, 11, 100.0)[0]
    assert regime_alarm(0.1, 1001, 1000, 1, 100.0)[0]
    assert not regime_alarm(0.6, 2000, 1000, 50, 100.0)[0]
    assert not regime_alarm(math.nan, 2000, 1000, 50, 100.0)[0]


def test_histogram_family_is_cumulative() -> None:
    h = Histogram((1.0, 2.0))
    for v in (0.5, 1.0, 1.5, 5.0):
        h.observe(v)
    fam = h.family("x_seconds", "doc")
    buckets = {s.labels.get("le"): s.value for s in fam.samples if s.name.endswith("_bucket")}
    assert buckets == {"1.0": 2, "2.0": 3, "+Inf": 4}


def test_json_log_lines() -> None:
    import logging

    rec = logging.LogRecord("kvgate.gateway", logging.INFO, __file__, 1, "hello %s", ("x",), None)
    rec.event = "start"
    line = json.loads(JsonFormatter().format(rec))
    assert line["msg"] == "hello x" and line["event"] == "start" and line["level"] == "info"


# -- configuration -------------------------------------------------------------------------------------------------


def test_config_validation() -> None:
    GatewayConfig(upstream="http://127.0.0.1:1").validate()
    for bad in (
        GatewayConfig(upstream="ftp://x"),
        GatewayConfig(upstream="http://127.0.0.1:1", control="nope"),
        GatewayConfig(upstream="http://127.0.0.1:1", control_opt="low=2.0"),
        GatewayConfig(upstream="http://127.0.0.1:1", time_scale=0),
        GatewayConfig(upstream="http://127.0.0.1:1", kv_pool=0),
    ):
        with pytest.raises(UsageError):
            bad.validate()
    assert control_opts("cap", "K=3,K_hi=5") == {"K": 3, "K_hi": 5}
    with pytest.raises(UsageError):
        control_opts("cap", "K=0.5")


def test_config_file(tmp_path: Path) -> None:
    f = tmp_path / "gw.toml"
    f.write_text('upstream = "http://127.0.0.1:9"\nkv-pool = 1000\ncontrol-opt = {low = 0.5, high = 0.9}\n'
                 'api-key = "k1"\n')
    cfg = load_config_file(f)
    assert cfg == {"upstream": "http://127.0.0.1:9", "kv_pool": "1000", "control_opt": "low=0.5,high=0.9",
                   "api_key": ["k1"]}
    f.write_text("bogus = 1\n")
    with pytest.raises(UsageError, match="unknown option"):
        load_config_file(f)
