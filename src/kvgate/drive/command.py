"""The ``kvgate drive`` command: options, one run, its summary on stdout (exit 130 when interrupted)."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from kvgate.drive.config import DriveConfig, validate
from kvgate.drive.report import format_summary
from kvgate.options import AGENT_RETRY_OPTIONS, FINITE, WORKLOAD_OPTIONS, trigger_options
from kvgate.workload.triggers import config_values, kinds

OPTIONS = [
    click.option("--endpoint", required=True, metavar="URL", help="OpenAI-compatible server, e.g. "
                 "http://localhost:8000 (vLLM, SGLang, a gateway, kvgate engine)."),
    click.option("--model", default=None, help="Model name to send [default: the first the endpoint lists]."),
    click.option("--api", type=click.Choice(["completions", "chat", "responses", "messages"]), default="completions",
                 show_default=True,
                 help="completions: token-id prompts (exact prefix reuse); chat, responses (OpenAI's Responses, the "
                 "whole input every turn, store false), messages (Anthropic's): a conversation (approximate "
                 "lengths), each answer sent back as it came."),
    click.option("--stream", is_flag=True, help="Stream responses (SSE); records the first-token time."),
    click.option("--api-key", envvar="KVGATE_API_KEY", default=None, help="Bearer token [env: KVGATE_API_KEY]."),
    *WORKLOAD_OPTIONS,
    click.option("--seed", type=click.IntRange(min=0), default=501, show_default=True),
    *trigger_options([k for k in kinds(over_http=True) if k.concern != "workload"]),
    click.option("--time-scale", type=FINITE, default=1.0, show_default=True,
                 help="Virtual seconds per real second (1 for a real engine; match kvgate engine's)."),
    click.option("--session-header", default="X-Session-ID", show_default=True, help="Header carrying the session "
                 "id on every turn (the last turn also sends the --session-end-header)."),
    click.option("--session-end-header", default="X-Session-End", show_default=True, metavar="NAME",
                 help="Header set to true on a session's last turn (Dynamo's: x-dynamo-session-final)."),
    click.option("--session-field", default=None, metavar="PATH", help="Also send the session id in this dotted "
                 "body field, e.g. vllm_xargs.agentic_context.program_id (vllm-router's program scheduling)."),
    click.option("--no-token-ids", is_flag=True, help="Do not ask for vLLM's return_token_ids (servers that refuse "
                 "it, e.g. Dynamo); the next prompt then carries stand-in ids for the output."),
    click.option("--session-id", type=click.Choice(["header", "none"]), default="header", show_default=True,
                 help="none: send no session id and no end marker, as agents that name nothing (a kvgate gateway "
                 "finds the session from the conversation: lineage)."),
    click.option("--tools", is_flag=True, help="Offer a tool and answer the model's calls with the appended text as "
                 "their results (chat, responses, messages); kvgate engine calls it every turn."),
    click.option("--system-nonce", is_flag=True, help="Open the system prompt with a per-request nonce, as Claude "
                 "Code's first system block (the prefix differs every turn from its first token)."),
    click.option("--compact-every", type=int, default=0, show_default=True, metavar="K",
                 help="After every K turns rewrite the history to the task and a summary (a compaction); 0: never."),
    click.option("--max-in-flight", type=int, default=4096, show_default=True, help="Most turns in flight at once "
                 "(and pooled connections); waiting for a slot counts as lag."),
    click.option("--timeout", "timeout_s", type=FINITE, default=3600.0, show_default=True,
                 help="Real seconds one request may take; a timed-out turn fails without retry."),
    click.option("--retries", type=int, default=3, show_default=True, help="Retries of a turn after connection "
                 "errors, 5xx and 429 (exponential backoff from 0.5 s)."),
    *AGENT_RETRY_OPTIONS,
    click.option("--no-ignore-eos", is_flag=True, help="Do not send ignore_eos/min_tokens (outputs may end early)."),
    click.option("--append-role", type=click.Choice(["user", "tool"]), default="user", show_default=True,
                 help="Role of the appended tool-output messages with --api chat."),
    click.option("--label", default="", help="Free-form label stored in run.json."),
    click.option("--out", type=click.Path(file_okay=False, path_type=Path), required=True,
                 help="Run directory for the records (jsonl while running, Parquet + run.json at the end)."),
    click.option("--force", is_flag=True, help="Overwrite a run already in --out."),
    click.option("--json", "as_json", is_flag=True, help="Print the summary as one JSON object at the end."),
]


def with_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``f`` with :data:`OPTIONS`, in that order in ``--help``."""
    for o in reversed(OPTIONS):
        f = o(f)
    return f


@click.command("drive")
@with_options
def command(
    out: Path, force: bool, as_json: bool, api_key: str | None, no_ignore_eos: bool, no_token_ids: bool, **kw: Any
) -> None:
    """Drive an OpenAI-compatible endpoint with the simulator's closed-loop agent sessions.

    Same seed, same sessions as `kvgate sim` (arrival times, shapes, think times). Every turn resends the whole
    conversation (previous prompt + the model's output + appended tool tokens) with the session id in a header;
    records have the simulator's schema, times in virtual seconds. A live status line goes to stderr; Ctrl-C
    stops cleanly with the records finished.

    \b
    Against a real vLLM (start it with --enable-prompt-tokens-details):
      kvgate drive --endpoint http://localhost:8000 --burst 1.5@15+5 --out runs/drive-501
    Against kvgate's simulated engine, 30 times faster than real time:
      kvgate drive --endpoint http://localhost:8100 --time-scale 30 --minutes 90 --out runs/fast
    """
    from kvgate.drive.driver import drive
    from kvgate.records import prepare_out

    cfg = DriveConfig(ignore_eos=not no_ignore_eos, token_ids=not no_token_ids, **config_values(kw))
    wl = validate(cfg)
    prepare_out(out, force=force, check_only=True)
    res = asyncio.run(drive(cfg, out, workload=wl, api_key=api_key, force=force))
    if as_json:
        click.echo(json.dumps(res.summary, sort_keys=True))
    else:
        click.echo(format_summary(res.summary, out))
    if res.interrupted:
        click.echo("kvgate: interrupted; the records cover the run so far", err=True)
        sys.exit(130)
