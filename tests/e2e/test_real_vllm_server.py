"""kvgate.realvllm: the tiny model, the pool-to-bytes conversion and the managed real vLLM server."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest

from kvgate.errors import UsageError
from kvgate.http.openai import parse_cache_config
from kvgate.realvllm import model
from kvgate.realvllm.server import (
    RealVllm,
    ServerConfig,
    kv_cache_bytes,
    usable_pool_tokens,
)
from support.real_vllm import BLOCK, SHARED_POOL

SRC = str(Path(__file__).resolve().parents[2] / "src")


def _post(url: str, body: dict[str, object]) -> dict[str, object]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())  # type: ignore[no-any-return]


def test_pool_bytes_round_trip_through_vllms_block_count() -> None:
    # vLLM makes bytes // (block_size * bytes per token) blocks and keeps block 0 as its null block
    for pool, bs, per_token in [(8192, 128, 2048), (16, 16, 2048), (49_024, 128, 4096), (1280, 64, 512)]:
        nbytes = kv_cache_bytes(pool, bs, per_token)
        assert usable_pool_tokens(nbytes // (bs * per_token), bs) == pool
    with pytest.raises(ValueError):
        kv_cache_bytes(1000, 128, 2048)


def test_config_rounds_pool_up_to_blocks_and_refuses_a_pool_below_max_model_len() -> None:
    assert ServerConfig(kv_pool=1000).pool == 1024
    assert ServerConfig(kv_pool=1024).pool == 1024
    assert ServerConfig(kv_pool=100_000).model_len == 32_768
    with pytest.raises(UsageError, match="max_model_len"):
        ServerConfig(kv_pool=1024, max_model_len=2048).validate()
    with pytest.raises(UsageError, match="block-size"):
        ServerConfig(kv_pool=1024, block_size=100).validate()


def test_the_server_reads_its_pool_with_the_shared_parser() -> None:
    # the server's pool is what kvgate's discovery reads everywhere: (num_gpu_blocks - 1) x block_size
    text = (
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n"
        'vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="65",sliding_window="None"} 1.0\n'
        'vllm:num_requests_running{engine="0"} 0.0\n'
    )
    info = parse_cache_config(text)
    assert info is not None and info.num_gpu_blocks == 65 and info.block_size == 128
    assert info.kv_pool == usable_pool_tokens(65, 128) == 64 * 128
    assert parse_cache_config("vllm:num_requests_running 0\n") is None


def test_model_kv_bytes_and_vocabulary() -> None:
    spec = model.DEFAULT_SPEC
    assert spec.kv_bytes_per_token() == 2 * 2 * 4 * 64 * 2
    words = model.vocabulary(spec.vocab)
    assert len(words) == len(set(words)) == spec.vocab
    assert words[: len(model.SPECIAL_TOKENS)] == list(model.SPECIAL_TOKENS)
    from kvgate.drive.prompts import WORDS

    assert set(WORDS) <= set(words)  # every word the driver writes is one token
    assert model.ModelSpec(layers=3).fingerprint() != spec.fingerprint()


def test_build_never_replaces_a_directory_it_did_not_build(tmp_path: Path) -> None:
    mine = tmp_path / "my-model"
    mine.mkdir()
    (mine / "config.json").write_text("{}")
    with pytest.raises(UsageError, match="not a kvgate model build"):
        model.build_model(mine)
    assert (mine / "config.json").read_text() == "{}"


def test_cli_refuses_bad_input_in_one_line(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": SRC}
    r = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "real-vllm", "serve", "--kv-pool", "1024", "--max-model-len", "4096"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert r.returncode == 2
    assert r.stderr.startswith("kvgate: error: vLLM refuses a pool") and r.stderr.count("\n") == 1


@pytest.mark.real_vllm
def test_built_model_tokenizes_prefix_stably_and_round_trips(real_vllm_model: Path) -> None:
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(str(real_vllm_model))
    assert model.kv_bytes_per_token(real_vllm_model) == model.DEFAULT_SPEC.kv_bytes_per_token()
    msgs = [{"role": "system", "content": "the file code"}, {"role": "user", "content": "run test, now"}]
    first = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)["input_ids"]
    out = tok.decode([500, 7000, 31_999])
    msgs += [{"role": "assistant", "content": out}, {"role": "user", "content": "more"}]
    second = tok.apply_chat_template(msgs, tokenize=True, add_generation_prompt=True)["input_ids"]
    assert second[: len(first)] == first
    assert second[len(first) : len(first) + 3] == [500, 7000, 31_999]  # decoded output re-tokenizes to itself
    assert tok.unk_token_id not in first


@pytest.mark.real_vllm
def test_shared_server_has_the_pool_asked_for_and_caches_prefixes(real_vllm_server: RealVllm) -> None:
    srv = real_vllm_server
    info = srv.read_cache_info()
    assert info.block_size == BLOCK and info.num_gpu_blocks is not None
    assert (info.num_gpu_blocks - 1) * BLOCK == SHARED_POOL == srv.kv_pool
    # vLLM's own log line counts the null block (max_model_len is a whole number of blocks here)
    assert srv.log_kv_cache_tokens == info.kv_cache_size_tokens == info.num_gpu_blocks * BLOCK
    prompt = " ".join(["the file code test"] * 100)  # 400 tokens: 3 full blocks
    a = _post(srv.url + "/v1/completions", {"model": "tiny-llama", "prompt": prompt, "max_tokens": 4})
    b = _post(srv.url + "/v1/completions", {"model": "tiny-llama", "prompt": prompt, "max_tokens": 4})
    assert a["usage"]["prompt_tokens"] == 400  # type: ignore[index]
    assert b["usage"]["prompt_tokens_details"]["cached_tokens"] == 3 * BLOCK  # type: ignore[index]
    assert a["choices"][0]["text"]  # type: ignore[index]
