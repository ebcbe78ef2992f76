"""What the comparison needs from the driver and discovery: the completions fields sent, another system's
end-of-session header and identity body field (``kvgate drive``), and the pool of NVIDIA Dynamo's frontend
(``--kv-pool auto``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from aiohttp import web

from kvgate.drive.config import DriveConfig, check_fields
from kvgate.drive.prompts import RequestHead
from kvgate.errors import UsageError
from kvgate.http.openai import discover, parse_dynamo_metrics
from support.aio import timed
from support.fake_engine import FakeEngine, drive_config, drive_run

# Dynamo 1.6.1's frontend in front of one `python -m dynamo.mocker --num-gpu-blocks-override 400 --block-size 16`
DYNAMO_161 = (
    "# TYPE dynamo_frontend_model_kv_cache_block_size gauge\n"
    'dynamo_frontend_model_kv_cache_block_size{model="tiny"} 16\n'
    "# TYPE dynamo_frontend_model_total_kv_blocks gauge\n"
    'dynamo_frontend_model_total_kv_blocks{model="tiny"} 400\n'
    'dynamo_frontend_worker_active_decode_blocks{dp_rank="0",worker_id="1",worker_type="decode"} 0\n'
)


def test_request_head_fields() -> None:
    vllm = json.loads(RequestHead("m", api="completions", stream=False, ignore_eos=True).text(7) + "}")
    assert vllm["return_token_ids"] is True and vllm["max_tokens"] == 7 and vllm["min_tokens"] == 7
    plain = RequestHead("m", api="completions", stream=False, ignore_eos=True, token_ids=False)
    assert "return_token_ids" not in json.loads(plain.text(7) + "}")
    nested = RequestHead(
        "m", api="completions", stream=False, ignore_eos=False, session_field="vllm_xargs.agentic_context.program_id"
    )
    body = json.loads(nested.text(5, 42) + "}")
    assert body["vllm_xargs"] == {"agentic_context": {"program_id": "42"}}
    assert "vllm_xargs" not in json.loads(nested.text(5) + "}")  # no session: no field


def test_bad_names_are_usage_errors() -> None:
    for kw in ({"session_end_header": "a b"}, {"session_end_header": ""}, {"session_field": "a..b"}):
        try:
            check_fields(DriveConfig(endpoint="http://127.0.0.1:1", **kw))  # type: ignore[arg-type]
        except UsageError:
            continue
        raise AssertionError(f"{kw} accepted")


@timed(20)
async def test_driver_sends_the_other_systems_names(tmp_path: Path) -> None:
    """The end header is renamed, the identity field travels in every body, no return_token_ids is asked for."""
    eng = FakeEngine(return_ids=False)
    seen: list[dict[str, Any]] = []

    async def comp(request: web.Request) -> web.StreamResponse:
        body = await request.json()
        seen.append({"body": body, "final": request.headers.get("x-dynamo-session-final"),
                     "old": request.headers.get("X-Session-End"), "sid": request.headers["X-Session-ID"]})
        return await eng.completions(request)

    app = web.Application()
    app.router.add_get("/v1/models", eng.models)
    app.router.add_post("/v1/completions", comp)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}"
        cfg = drive_config(url, minutes=1.0, session_end_header="x-dynamo-session-final",
                           session_field="vllm_xargs.agentic_context.program_id", token_ids=False)
        await drive_run(cfg, tmp_path / "run")
    finally:
        await runner.cleanup()
    assert seen
    for r in seen:
        assert "return_token_ids" not in r["body"]
        assert r["body"]["vllm_xargs"]["agentic_context"]["program_id"] == r["sid"]
        assert r["old"] is None
    assert any(r["final"] == "true" for r in seen)  # some session finished within the minute
    assert all(r["final"] in (None, "true") for r in seen)


def test_dynamo_pool_from_frontend_metrics() -> None:
    info = parse_dynamo_metrics(DYNAMO_161)
    assert info is not None and info.kind == "dynamo"
    assert info.kv_pool == 400 * 16 and info.block_size == 16 and info.num_gpu_blocks == 400
    no_blocks = parse_dynamo_metrics('dynamo_frontend_model_kv_cache_block_size{model="tiny"} 16\n')
    assert no_blocks is not None and no_blocks.kv_pool is None
    assert parse_dynamo_metrics("vllm:num_requests_running 3\n") is None


@timed(5)
async def test_discover_dynamo_frontend() -> None:
    async def get(path: str) -> tuple[int, bytes]:
        if path == "/metrics":
            return 200, DYNAMO_161.encode()
        return 404, b'{"message":"not found"}'

    info = await discover(get)
    assert info.kind == "dynamo" and info.kv_pool == 6400 and info.source == "/metrics"
