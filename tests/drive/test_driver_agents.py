"""``kvgate drive`` as agents send: ``--api responses|messages``, ``--session-id none``, tool calls and results in
the history, system nonces and compaction turns — through ``kvgate gateway`` to ``kvgate engine`` on loopback, the
gateway finding every driven session by lineage alone."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path
from typing import Any

import pytest

from kvgate.drive.conversation import ConvoPrompt
from kvgate.drive.driver import DriveConfig, drive
from kvgate.drive.prompts import RequestHead, Vocab
from kvgate.drive.replies import Reply, parse_completion
from kvgate.errors import UsageError
from kvgate.gateway import Gateway, GatewayConfig
from kvgate.http.dialect import MESSAGES, RESPONSES
from kvgate.records import load_run
from kvgate.serve.app import EngineServer
from kvgate.serve.config import ServerConfig
from kvgate.workload.shapes import Phase, Workload, synthetic
from support.aio import timed

SCALE = 60.0
SMALL = Workload("small", phases=(Phase(0.0, synthetic(shared=256, unique=256, turns=6, output=16, append=32),
                                        4.0),))


async def run(tmp: Path, **kw: Any) -> tuple[dict[str, Any], Gateway]:
    eng = EngineServer(ServerConfig(kv_pool=200_000, time_scale=SCALE))
    ep = await eng.start("127.0.0.1", 0)
    gw = Gateway(GatewayConfig(upstream=f"http://127.0.0.1:{ep}", time_scale=SCALE, default_max_tokens=16))
    try:
        port = await gw.start("127.0.0.1", 0)
        cfg = DriveConfig(endpoint=f"http://127.0.0.1:{port}", lam=0.3, minutes=1.5, seed=3, time_scale=SCALE,
                          retries=1, backoff_s=0.01, **kw)
        res = await drive(cfg, tmp / "run", workload=SMALL, status=False, log=lambda _m: None, handle_signals=False)
        for _ in range(200):  # turns cut at the horizon leave the gateway too
            a = gw.audit()
            if a["held"] == a["held_policy"] == a["in_flight"] == 0:
                break
            await asyncio.sleep(0.02)
        return res.summary, gw
    finally:
        await gw.stop()
        await eng.stop()


@pytest.mark.parametrize("api,extra", [("responses", {"stream": True}), ("messages", {"tools": True}),
                                       ("chat", {"tools": True, "stream": True}), ("messages", {"stream": True})])
@timed(90)
async def test_every_driven_session_is_one_lineage_session(tmp_path: Path, api: str, extra: dict[str, Any]) -> None:
    s, gw = await run(tmp_path, api=api, session_id="none", **extra)
    assert s["turns_error"] == 0 and s["turns_done"] > 2 * s["sessions_arrived"]  # (how many: the machine's pace)
    st = gw.sessions_state()
    resolved = st["lineage"]["resolved"]
    # one gateway session per driven session that reached it, every later turn a continuation
    assert resolved["new"] == len(gw.sessions) <= s["sessions_arrived"]
    turns = load_run(tmp_path / "run").turns
    assert resolved["new"] >= len(set(turns["session"][turns["status"] == "ok"]))
    assert resolved["fork"] == resolved["replay"] == resolved["rewrite"] == 0
    assert resolved["continue"] >= s["turns_done"] - s["sessions_arrived"]
    assert gw.summary()["hit_ratio_5m"] > 0.6  # the answers sent back as they came are reused


@timed(90)
async def test_system_nonces_are_prefix_breaks_not_evictions(tmp_path: Path) -> None:
    s, gw = await run(tmp_path, api="chat", session_id="none", system_nonce=True)
    assert s["turns_error"] == 0
    breaks = gw.sessions_state()["prefix_breaks"]
    later = s["turns_done"] - s["sessions_arrived"]
    assert breaks.get("head", 0) >= 0.9 * later  # every later turn misses: the head changed, the pool had room
    assert not gw.summary()["regime_alarm"]


@timed(90)
async def test_compaction_turns_keep_their_sessions(tmp_path: Path) -> None:
    s, gw = await run(tmp_path, api="messages", session_id="none", compact_every=3, stream=True)
    assert s["turns_error"] == 0
    resolved = gw.sessions_state()["lineage"]["resolved"]
    turns = load_run(tmp_path / "run").turns
    compacted = len(set(turns["session"][turns["turn"] == 3]))  # the turn after the third sends the compaction
    assert compacted > 0 and resolved["rewrite"] == compacted and resolved["fork"] == resolved["replay"] == 0
    assert resolved["new"] == len(gw.sessions) <= s["sessions_arrived"]


def test_conversations_in_each_api_send_answers_back_as_they_came() -> None:
    v = Vocab(7)
    head = RequestHead("m", api="responses", stream=False, ignore_eos=True)
    assert json.loads(head.text(9) + "}") == {"model": "m", "stream": False, "store": False, "max_output_tokens": 9}
    assert "ignore_eos" not in head.text(9) and "max_tokens" in RequestHead("m", api="messages", stream=True,
                                                                            ignore_eos=True).text(3)
    p = ConvoPrompt("responses", v, "k/1", 8, 8, tools=True)
    answer = {"id": "r", "output": [{"type": "message", "role": "assistant", "content": [
        {"type": "output_text", "text": "hi"}]}, {"type": "function_call", "call_id": "c9", "name": "bash",
                                                  "arguments": "{}"}], "usage": None}
    reply = parse_completion(answer, RESPONSES)
    assert reply.text == "hi" and reply.calls == [("c9", "bash", "{}")]
    p.extend(0, reply, 1, "result", 1)
    body = json.loads(p.body('{"model":"m"'))
    assert body["input"][-1] == {"type": "function_call_output", "call_id": "c9", "output": "result"}
    assert body["input"][1:3] == answer["output"] and body["tools"][0]["name"] == "bash"
    m = ConvoPrompt("messages", v, "k/2", 8, 8, nonce=True)
    first = json.loads(m.body("{\"model\":\"m\""))["system"]
    reply = parse_completion({"content": [{"type": "text", "text": "ok"}], "usage": {}}, MESSAGES)
    m.extend(0, reply, 1, "more", 1)
    second = json.loads(m.body("{\"model\":\"m\""))["system"]
    assert first[0]["text"] != second[0]["text"] and first[1] == second[1]  # the nonce block alone changes
    assert isinstance(Reply(ok=True).calls, list)


def test_bad_agent_options_are_refused_in_one_line() -> None:
    from kvgate.drive.config import validate

    for kw in ({"api": "x"}, {"session_id": "body"}, {"compact_every": -1}, {"api": "completions", "tools": True}):
        with pytest.raises(UsageError):
            validate(DriveConfig(endpoint="http://127.0.0.1:1", **kw))  # type: ignore[arg-type]
