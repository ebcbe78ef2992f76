"""``kvgate engine``: the command, and :func:`serve` (until SIGINT or SIGTERM)."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import click

from kvgate.http.signals import serve_until_signalled
from kvgate.options import BIND_ADDRESS, ENGINE_MODEL_OPTIONS, FINITE, PORT, url_host, with_options
from kvgate.serve.agent import AgentPolicy, AgentTurns, parse_agent_turns
from kvgate.serve.app import EngineServer
from kvgate.serve.config import ServerConfig, check_block_size
from kvgate.serve.kvevents import parse_kv_events_config


async def serve(cfg: ServerConfig, host: str, port: int, ready: Callable[[EngineServer], None] | None = None) -> None:
    """Serve until SIGINT or SIGTERM, then shut down gracefully."""
    # NOTE: settling freezes what the imports made out of the collector: a full collection walks every object
    # (numpy, aiohttp, ...), ~50 ms, i.e. seconds of virtual time at x60.
    await serve_until_signalled(EngineServer(cfg), host, port, ready)


@click.command("engine", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@with_options(ENGINE_MODEL_OPTIONS)
@click.option("--time-scale", type=FINITE, default=30.0, show_default=True,
              help="Virtual seconds per real second.")
@click.option("--host", type=BIND_ADDRESS, default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=PORT, default=8100, show_default=True, help="Port (0: a free one).")
@click.option("--model", default=None, help="Served model name [default: Qwen/Qwen3-8B for qwen3-8b-mi300x].")
@click.option("--slice-ms", type=FINITE, default=2.0, show_default=True,
              help="Real time a decode jump may run before new arrivals are looked at.")
@click.option("--no-cache-report", is_flag=True, help="Do not report cached prompt tokens in usage, as vLLM "
              "without --enable-prompt-tokens-details or SGLang without --enable-cache-report.")
@click.option("--kv-events-config", "kv_events_config", default=None, metavar="JSON",
              help="Publish the pool's KV cache events as vLLM does, e.g. '{\"enable_kv_cache_events\": true, "
              "\"publisher\": \"zmq\", \"endpoint\": \"tcp://127.0.0.1:5557\", \"replay_endpoint\": "
              "\"tcp://127.0.0.1:5558\"}' (vLLM's fields: also topic, buffer_steps, hwm); loopback or ipc:// "
              "only.")
@click.option("--kv-events-encoding", type=click.Choice(["map", "array"]), default="map", show_default=True,
              help="KV event encoding: vLLM's tagged maps (vLLM >= 0.11) or the older positional "
              "arrays.")
@click.option("--agent-turns", default="trace", show_default=True, metavar="N|trace|FILE",
              help="Turns of each conversation that offers tools: N, the bundled trace's shapes (one drawn per "
              "conversation), or a shapes file's. Before its last turn an answer calls a tool; the last answers "
              "and ends.")
@click.option("--agent-seed", type=int, default=0, show_default=True,
              help="Seed of the shape and the tool drawn per conversation and turn.")
@click.option("--agent-spawn", is_flag=True,
              help="A conversation's first turn calls the tool that spawns an agent (Claude Code's Task/Agent, "
              "opencode's task) once; the spawned agent spawns none.")
def command(
    time_scale: float, host: str, port: int, model: str | None, slice_ms: float, no_cache_report: bool,
    kv_events_config: str | None, kv_events_encoding: str, no_prefix_cache: bool, block_size: int | None,
    agent_turns: str, agent_seed: int, agent_spawn: bool, **engine: Any,
) -> None:
    """Serve the simulated engine over HTTP (OpenAI-compatible, vLLM's metrics) in scaled real time.

    \b
    Virtual seconds = real seconds x --time-scale: at 30, a turn the simulated GPU serves in 3 s
    answers in 0.1 s. Agent drivers and gateways talk to it as to vLLM (or SGLang with
    --engine sglang); see docs/engine-server.md. Stops gracefully on SIGINT / SIGTERM.
    """
    check_block_size(engine["engine"], block_size)
    given = {} if block_size is None else {"block_size": block_size}  # not given: the engine config's (16)
    kv_events = None if kv_events_config is None else parse_kv_events_config(kv_events_config, kv_events_encoding)
    cfg = ServerConfig(
        prefix_caching=not no_prefix_cache, time_scale=time_scale, model=model, slice_ms=slice_ms,
        cache_report=not no_cache_report, kv_events=kv_events,
        agent=AgentTurns(parse_agent_turns(agent_turns), agent_seed, agent_spawn), **given, **engine,
    )
    cfg.validate()
    turns = cfg.agent.turns
    if isinstance(turns, str) and turns != "trace":  # (a shapes file: read now, not at the first tool call)
        AgentPolicy(cfg.agent).shapes  # noqa: B018 (raises UsageError for a file that holds no session)

    def ready(s: EngineServer) -> None:
        ev = cfg.kv_events
        events = f", KV events on {ev.endpoint}" if ev is not None and ev.enabled else ""
        click.echo(
            f"kvgate engine: serving {s.model} at http://{url_host(host)}:{s.port} ({cfg.engine}, "
            f"profile {cfg.profile}, "
            f"{s.kv_pool}-token KV pool in {s.block_size}-token blocks, "
            f"prefix caching {'on' if cfg.prefix_caching else 'off'}, "
            f"time x{cfg.time_scale:g}){events}; Ctrl-C stops",
            err=True,
        )

    asyncio.run(serve(cfg, host, port, ready))
    click.echo("kvgate engine: stopped", err=True)
