"""Pool discovery (``kvgate.http.openai``): one definition of C, the block size and the server kind, for the
gateway and the driver alike, against fakes of vLLM (plain and ``VLLM_SERVER_DEV_MODE=1``), SGLang, Dynamo's
frontend, a gateway."""

from __future__ import annotations

import json
from typing import Any

import pytest

from kvgate.http.openai import (
    EngineInfo,
    Unreachable,
    cache_config_labels,
    discover,
    kv_usage_from_metrics,
    parse_cache_config,
    parse_dynamo_metrics,
    parse_gateway_info,
    parse_server_info,
    vllm_kv_pool,
)
from support.aio import timed

# vLLM 0.32 (CPU build), as it answered with --kv-cache-memory-bytes on the tiny Llama: 384 blocks of 128 tokens
VLLM_032 = (
    "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
    "# TYPE vllm:cache_config_info gauge\n"
    'vllm:cache_config_info{block_size="128",cache_dtype="auto",cache_hit_alignment_tokens="128",'
    'enable_prefix_caching="True",engine="0",hash_block_size="128",kv_cache_size_tokens="49090",'
    'num_cpu_blocks="None",num_gpu_blocks="384",prefix_caching_hash_algo="sha256"} 1.0\n'
    'vllm:num_requests_running{engine="0",model_name="tiny"} 0.0\n'
)

# vLLM's /server_info with VLLM_SERVER_DEV_MODE=1 (vllm/entrypoints/serve/dev/server_info/api_router.py)
VLLM_DEV_SERVER_INFO = {
    "vllm_config": "model='tiny', max_model_len=4096, ... max_total_num_tokens=7",
    "vllm_env": {"VLLM_SERVER_DEV_MODE": True},
    "system_env": {"os": "linux", "max_total_num_tokens": 7},
}


def test_vllm_pool_is_what_the_scheduler_can_fill() -> None:
    info = parse_cache_config(VLLM_032)
    assert info is not None and info.kind == "vllm"
    # (num_gpu_blocks - 1) x block_size: block 0 is vLLM's null block; not kv_cache_size_tokens (49,090), not
    # num_gpu_blocks x block_size (49,152)
    assert info.kv_pool == 383 * 128 == 49_024
    assert info.block_size == 128 and info.hash_block_size == 128 and info.num_gpu_blocks == 384
    assert info.kv_cache_size_tokens == 49_090
    # the label kv_cache_size_tokens alone (no block count): the best there is
    only = 'vllm:cache_config_info{block_size="16",kv_cache_size_tokens="123456"} 1.0\n'
    assert parse_cache_config(only) == EngineInfo(
        kind="vllm", kv_pool=123_456, block_size=16, kv_cache_size_tokens=123_456, source="/metrics"
    )
    # the UTF-8 exposition quotes the name
    quoted = '{"vllm:cache_config_info",block_size="16",num_gpu_blocks="1001"} 1.0\n'
    assert parse_cache_config(quoted).kv_pool == 16_000  # type: ignore[union-attr]
    unset = parse_cache_config(VLLM_032.replace('num_gpu_blocks="384"', 'num_gpu_blocks="None"'))
    assert unset is not None and unset.kv_pool == 49_090 and unset.num_gpu_blocks is None
    assert parse_cache_config("vllm:num_requests_running 3\n") is None


def test_cache_config_labels_are_read_once_for_every_reader() -> None:
    labels = cache_config_labels(VLLM_032)
    assert labels is not None and labels["enable_prefix_caching"] == "True" and labels["num_gpu_blocks"] == "384"
    assert vllm_kv_pool(int(labels["num_gpu_blocks"]), int(labels["block_size"])) == 49_024
    assert vllm_kv_pool(1, 128) == 0 and vllm_kv_pool(0, 128) == 0  # the null block alone: nothing to fill
    # an escaped quote stays inside its value; the UTF-8 exposition's quoted name is the same family
    odd = 'vllm:cache_config_info{cache_dtype="a\\"b",block_size="16"} 1.0\n'
    assert cache_config_labels(odd) == {"cache_dtype": 'a\\"b', "block_size": "16"}
    assert cache_config_labels('{"vllm:cache_config_info",block_size="16"} 1.0\n') == {"block_size": "16"}
    assert cache_config_labels("vllm:num_requests_running 3\n") is None


def test_sglang_server_info_and_never_vllms() -> None:
    info = parse_server_info({"max_total_num_tokens": 500_000, "page_size": 1, "enable_cache_report": True})
    assert info is not None and (info.kind, info.kv_pool, info.block_size, info.cache_report) == (
        "sglang", 500_000, 1, True,
    )
    nested = parse_server_info({"internal_states": [{"max_total_num_tokens": 7}]})
    assert nested is not None and nested.kv_pool == 7
    assert parse_server_info({"foo": 1}) is None and parse_server_info([1]) is None
    # vLLM's dev-mode answer is vLLM's, whatever text it holds
    assert parse_server_info(VLLM_DEV_SERVER_INFO) is None
    assert parse_server_info({**VLLM_DEV_SERVER_INFO, "max_total_num_tokens": 7}) is None


# Dynamo's frontend (dynamo.frontend 1.x): its model's runtime config as gauges
DYNAMO_FRONTEND = (
    "# TYPE dynamo_frontend_model_total_kv_blocks gauge\n"
    'dynamo_frontend_model_total_kv_blocks{model="Qwen/Qwen3-8B"} 25000\n'
    "# TYPE dynamo_frontend_model_kv_cache_block_size gauge\n"
    'dynamo_frontend_model_kv_cache_block_size{model="Qwen/Qwen3-8B"} 16\n'
    'dynamo_frontend_queued_requests{model="Qwen/Qwen3-8B"} 0\n'
)


def test_dynamo_frontend_pool_is_its_blocks_times_their_size() -> None:
    info = parse_dynamo_metrics(DYNAMO_FRONTEND)
    assert info is not None and info.kind == "dynamo" and info.kv_pool == 400_000 and info.block_size == 16
    half = parse_dynamo_metrics(DYNAMO_FRONTEND.split("# TYPE dynamo_frontend_model_kv_cache")[0])
    assert half is not None and half.kv_pool is None and half.num_gpu_blocks == 25_000
    assert parse_dynamo_metrics(VLLM_032) is None


@timed(5)
async def test_discovery_reads_dynamos_frontend_from_its_metrics() -> None:
    got = await discover(Fake({"/metrics": (200, DYNAMO_FRONTEND)}))
    assert got.kind == "dynamo" and got.kv_pool == 400_000 and got.source == "/metrics"


def test_gateway_info_names_its_upstreams_pool() -> None:
    gw = {"kvgate": "gateway", "kv_pool": 5000, "control": "budgeter",
          "upstream": {"kind": "vllm", "kv_pool": 49_024, "block_size": 128}}
    info = parse_gateway_info(gw)
    assert info is not None and info.kind == "kvgate-gateway" and info.engine_kind == "vllm"
    assert info.kv_pool == 49_024 and info.block_size == 128 and info.gateway == gw
    # an upstream the gateway could not size: the C it uses
    bare = parse_gateway_info({**gw, "upstream": {"kind": "unknown"}})
    assert bare is not None and bare.kv_pool == 5000 and bare.engine_kind == "unknown"
    assert parse_gateway_info({"kv_pool": 1}) is None


class Fake:
    """A getter answering fixed paths; every other path 404, like an engine that does not serve it."""

    def __init__(self, routes: dict[str, tuple[int, Any]]) -> None:
        self.routes = routes
        self.asked: list[str] = []

    async def __call__(self, path: str) -> tuple[int, bytes]:
        self.asked.append(path)
        status, body = self.routes.get(path, (404, {"detail": "Not Found"}))
        if isinstance(body, BaseException):
            raise body
        return status, body.encode() if isinstance(body, str) else json.dumps(body).encode()


@timed(5)
async def test_discover_vllm_in_dev_mode_is_vllm() -> None:
    # VLLM_SERVER_DEV_MODE=1: /server_info answers 200; it must not be taken for SGLang
    fake = Fake({"/server_info": (200, VLLM_DEV_SERVER_INFO), "/metrics": (200, VLLM_032)})
    info = await discover(fake)
    assert info.kind == "vllm" and info.kv_pool == 49_024 and info.block_size == 128
    assert info.source == "/metrics" and info.cache_report is None
    assert "/get_server_info" not in fake.asked  # vLLM's answer settles it
    # a vLLM whose metrics lack the info gauge is still vLLM (pool unknown, with the reason)
    fake = Fake({"/server_info": (200, VLLM_DEV_SERVER_INFO), "/metrics": (200, "vllm:num_requests_running 0\n")})
    info = await discover(fake)
    assert info.kind == "vllm" and info.kv_pool is None and any("/metrics" in r for r in info.reasons)


@timed(5)
async def test_discover_sglang_gateway_and_nothing() -> None:
    sglang = {"max_total_num_tokens": 12345, "page_size": 1, "enable_cache_report": False}
    # SGLang (or kvgate engine --engine sglang, which also serves vLLM's metrics): /server_info wins
    info = await discover(Fake({"/server_info": (200, sglang), "/metrics": (200, VLLM_032)}))
    assert (info.kind, info.kv_pool, info.source, info.cache_report) == ("sglang", 12345, "/server_info", False)
    older = await discover(Fake({"/get_server_info": (200, sglang)}))
    assert older.kind == "sglang" and older.source == "/get_server_info"
    gw = {"kvgate": "gateway", "kv_pool": 900, "upstream": {"kind": "sglang", "kv_pool": 1000}}
    fake = Fake({"/kvgate/info": (200, gw), "/metrics": (200, "kvgate_parks 3\n")})
    info = await discover(fake)
    assert info.kind == "kvgate-gateway" and info.engine_kind == "sglang" and info.kv_pool == 1000
    assert fake.asked == ["/kvgate/info"]
    nothing = await discover(Fake({"/metrics": (200, "up 1\n")}))
    assert nothing.kind == "unknown" and nothing.kv_pool is None and len(nothing.reasons) == 3
    # an answer that is not a gateway's on /kvgate/info (an echoing upstream) is ignored
    echo = await discover(Fake({"/kvgate/info": (200, {"path": "/kvgate/info"}), "/metrics": (200, VLLM_032)}))
    assert echo.kind == "vllm"
    with pytest.raises(Unreachable):
        await discover(Fake({"/kvgate/info": (0, Unreachable("refused"))}))
    slow = await discover(Fake({"/kvgate/info": (0, TimeoutError()), "/metrics": (200, VLLM_032)}))
    assert slow.kv_pool == 49_024 and "no answer" in slow.reasons[0]


def test_kv_usage_is_the_mean_over_the_engines_behind_one_url() -> None:
    one = 'vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.5\n'
    two = one + 'vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.9\n'
    assert kv_usage_from_metrics(one) == 0.5
    assert kv_usage_from_metrics(two) == pytest.approx(0.7)  # two data-parallel ranks: a fraction of the whole
    assert kv_usage_from_metrics('vllm:gpu_cache_usage_perc{engine="0"} 0.25\n') == 0.25  # vLLM < 0.10
    assert kv_usage_from_metrics("vllm:num_requests_running 3\n") is None
    assert kv_usage_from_metrics('sglang:token_usage{model_name="m"} 0.4\n') == 0.4
