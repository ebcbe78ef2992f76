"""``kvgate import-trace``: mini-SWE-agent usage traces to kvgate's trace-shape JSONL."""

from __future__ import annotations

import json
from pathlib import Path

import click


@click.command("import-trace")
@click.argument("src", type=click.Path(dir_okay=False, path_type=Path))
@click.argument("dst", type=click.Path(dir_okay=False, path_type=Path))
@click.option("--shared-tokens", type=int, default=1200, show_default=True,
              help="Tokens of the prefix every session shares (mini-SWE-agent's prompt without the task, "
                   "as the paper replays it with the task last).")
@click.option("--json", "as_json", is_flag=True)
def import_trace(src: Path, dst: Path, shared_tokens: int, as_json: bool) -> None:
    """Convert mini-SWE-agent usage traces (shared/data/*.jsonl: calls of [t, prompt, completion, cached])
    into kvgate's trace-shape JSONL (docs/trace-format.md), for --trace."""
    from kvgate.errors import UsageError
    from kvgate.workload.trace import import_mini_swe_agent

    if dst.exists() and src.exists() and dst.resolve() == src.resolve():
        raise UsageError(f"import-trace: DST {dst} is SRC itself (the trace would be overwritten); give another file")
    stats = import_mini_swe_agent(src, dst, shared_tokens=shared_tokens)
    if as_json:
        click.echo(json.dumps(stats, sort_keys=True, default=str))
        return
    for k, v in stats.items():
        click.echo(f"{k:<32} {v}")
