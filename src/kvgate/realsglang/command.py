"""``kvgate real-sglang serve``: the tiny model served by a real SGLang (its CPU engine) on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import click

from kvgate.errors import UsageError
from kvgate.options import PORT
from kvgate.realengine import process_options


@click.group("real-sglang")
def command() -> None:
    """A real SGLang (0.5.23, CPU engine, in its own venv: bash .ci/install-sglang.sh) serving the tiny model.

    \b
      kvgate real-sglang serve --kv-pool 147456   an SGLang OpenAI server with exactly that KV pool
    """


@command.command("serve", context_settings={"ignore_unknown_options": True})
@click.option("--kv-pool", type=int, required=True, help="KV pool in tokens (SGLang's --max-total-tokens).")
@click.option("--port", type=PORT, default=8000, show_default=True, help="Port on 127.0.0.1 (0: a free one).")
@click.option("--context-length", type=int, default=None, help="[default: the model's].")
@click.option("--schedule-policy", type=click.Choice(["fcfs", "lpm"]), default="fcfs", show_default=True)
@click.option("--no-prefix-cache", is_flag=True, help="Turn SGLang's radix cache off.")
@click.option("--threads", type=int, default=1, show_default=True, help="OpenMP threads of the model.")
@click.option("--model-dir", type=click.Path(file_okay=False, path_type=Path), default=None,
              help="Model directory [default: $KVGATE_MODEL_DIR, else ~/.cache/kvgate/tiny-llama].")
@process_options("SGLang")
@click.argument("sglang_args", nargs=-1, type=click.UNPROCESSED)
def serve_command(
    kv_pool: int, port: int, context_length: int | None, schedule_policy: str, no_prefix_cache: bool, threads: int,
    model_dir: Path | None, log_path: Path | None, startup_timeout: float, as_json: bool, sglang_args: tuple[str, ...],
) -> None:
    """Serve the tiny model with the real SGLang until Ctrl-C (extra arguments after -- go to SGLang)."""
    from kvgate.realengine import serve_until_stopped
    from kvgate.realsglang.server import RealSglang, SglangServerConfig

    if startup_timeout <= 0:
        raise UsageError(f"--startup-timeout must be positive, got {startup_timeout}")
    cfg = SglangServerConfig(
        kv_pool=kv_pool, port=port, context_length=context_length, prefix_caching=not no_prefix_cache,
        schedule_policy=schedule_policy, threads=threads, model_dir=model_dir, extra_args=tuple(sglang_args),
        log_path=log_path, startup_timeout_s=startup_timeout,
    )
    srv = RealSglang(cfg)

    def info() -> dict[str, Any]:
        return {"url": srv.url, "model": cfg.served_model_name, "model_dir": str(srv.model_path),
                "kv_pool": srv.kv_pool, "startup_s": round(srv.startup_s or 0.0, 1), "log": str(srv.log_path),
                "pid": srv.proc.pid if srv.proc else None}

    def banner(i: dict[str, Any]) -> str:
        return f"serving {i['model']} at {i['url']}: pool {i['kv_pool']} tokens, up in {i['startup_s']} s. " \
            "Ctrl-C stops it."

    serve_until_stopped(srv, "real-sglang", info, banner, as_json)
