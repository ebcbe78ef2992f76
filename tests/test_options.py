"""Each concern's options are written once (kvgate.options) and every program that has the concern takes them."""

from __future__ import annotations

import click
import pytest

from kvgate.cli import cli
from kvgate.engine.factory import EngineConfig
from kvgate.errors import UsageError
from kvgate.serve.config import ServerConfig


def _params(name: str) -> dict[str, click.Parameter]:
    cmd = cli.get_command(click.Context(cli), name)
    assert isinstance(cmd, click.Command)
    return {p.name: p for p in cmd.params if p.name}


@pytest.mark.parametrize("program", ["engine", "sim", "paired", "arms"])
def test_every_program_with_an_engine_takes_the_engine_model_options(program: str) -> None:
    sim, other = _params("sim"), _params(program)
    names = ["engine", "profile", "kv_pool", "no_prefix_cache", "block_size", "max_num_batched_tokens",
             "max_num_seqs", "evict_sessions", "retention", "pin_ttl_s", "prefix_first", "sglang_policy"]
    for n in names:
        assert n in other, f"kvgate {program} lacks --{n}"
        assert other[n].opts == sim[n].opts and other[n].default == sim[n].default, n


def test_the_served_engine_has_no_host_tier_and_says_so() -> None:
    assert "cpu_offload_tokens" not in _params("engine") and "cpu_offload_tokens" in _params("sim")
    with pytest.raises(UsageError, match="host tier"):
        ServerConfig(cpu_offload_tokens=100_000).validate()


def test_engine_checks_are_the_engines_own() -> None:
    for bad in (EngineConfig(block_size=0), EngineConfig(engine="sglang", retention=True),
                EngineConfig(max_num_seqs=0), EngineConfig(offload_bandwidth_gbs=0.0)):
        with pytest.raises(UsageError):
            bad.check_engine()
        with pytest.raises(UsageError):
            ServerConfig(**{f: getattr(bad, f) for f in ("block_size", "engine", "retention", "max_num_seqs",
                                                          "offload_bandwidth_gbs")}).validate()
    EngineConfig().check_engine()
    ServerConfig().validate()
