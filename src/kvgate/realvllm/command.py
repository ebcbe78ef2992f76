"""``kvgate real-vllm``: build the tiny model, serve it with the real vLLM (CPU build) on 127.0.0.1."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

import click

from kvgate.errors import UsageError
from kvgate.options import FINITE, PORT
from kvgate.realengine import process_options


def _error(msg: str, status: int = 1) -> None:
    click.echo(f"kvgate: error: {msg}", err=True)
    sys.exit(status)


@click.group("real-vllm")
def command() -> None:
    """The real vLLM (CPU build) serving a tiny random-weight Llama, for tests and runs on this machine.

    \b
      kvgate real-vllm build-model               the model and tokenizer, built once into a cache dir
      kvgate real-vllm serve --kv-pool 65536 a vLLM OpenAI server with exactly that usable KV pool
    """


_model_dir_option = click.option(
    "--model-dir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Model directory [default: $KVGATE_MODEL_DIR, else ~/.cache/kvgate/tiny-llama].",
)


@command.command("build-model")
@_model_dir_option
@click.option("--force", is_flag=True, help="Rebuild even if a build is already there.")
@click.option("--json", "as_json", is_flag=True, help="Print one JSON object.")
def build_model_command(model_dir: Path | None, force: bool, as_json: bool) -> None:
    """Build the tiny Llama and its word-level ChatML tokenizer locally (seeded, no model hub)."""
    from kvgate.realvllm import model

    t0 = time.monotonic()
    was = model.is_built(model_dir)
    path = model.build_model(model_dir, force=force)
    res = {
        "model_dir": str(path),
        "built": force or not was,
        "seconds": round(time.monotonic() - t0, 2),
        "kv_bytes_per_token": model.kv_bytes_per_token(path),
        "fingerprint": model.DEFAULT_SPEC.fingerprint(),
    }
    if as_json:
        click.echo(json.dumps(res, sort_keys=True))
        return
    verb = "built" if res["built"] else "already built"
    click.echo(f"{path}: {verb} ({res['seconds']} s); KV cache {res['kv_bytes_per_token']} bytes per token")


@command.command("serve", context_settings={"ignore_unknown_options": True})
@click.option("--kv-pool", type=int, required=True, help="Usable KV pool in tokens (rounded up to blocks).")
@click.option("--block-size", type=click.IntRange(min=1), default=128, show_default=True,
              help="KV block size (vLLM's CPU default).")
@click.option("--port", type=PORT, default=8000, show_default=True, help="Port on 127.0.0.1 (0: a free one).")
@click.option("--max-model-len", type=int, default=None, help="[default: the pool, at most 32768].")
@click.option("--no-prefix-cache", is_flag=True, help="Turn vLLM's prefix caching off.")
@click.option("--threads", type=int, default=1, show_default=True, help="OpenMP threads of the model worker.")
@click.option("--compile", "compile_", is_flag=True, help="Let vLLM torch.compile the model (slow start-up).")
@_model_dir_option
@process_options("vLLM")
@click.argument("vllm_args", nargs=-1, type=click.UNPROCESSED)
def serve_command(
    kv_pool: int,
    block_size: int,
    port: int,
    max_model_len: int | None,
    no_prefix_cache: bool,
    threads: int,
    compile_: bool,
    model_dir: Path | None,
    log_path: Path | None,
    startup_timeout: float,
    as_json: bool,
    vllm_args: tuple[str, ...],
) -> None:
    """Serve the tiny model with the real vLLM until Ctrl-C (extra arguments after -- go to vLLM)."""
    from kvgate.realengine import serve_until_stopped
    from kvgate.realvllm.server import RealVllm, ServerConfig, vllm_available

    if startup_timeout <= 0:
        raise UsageError(f"--startup-timeout must be positive, got {startup_timeout}")
    cfg = ServerConfig(
        kv_pool=kv_pool,
        block_size=block_size,
        max_model_len=max_model_len,
        port=port,
        prefix_caching=not no_prefix_cache,
        enforce_eager=not compile_,
        threads=threads,
        model_dir=model_dir,
        extra_args=tuple(vllm_args),
        log_path=log_path,
        startup_timeout_s=startup_timeout,
    )
    # NOTE: the arguments are checked first: vllm_available() imports vLLM (and torch), seconds on a busy machine
    cfg.validate()
    why = vllm_available()
    if why is not None:
        raise UsageError(why)
    srv = RealVllm(cfg)

    def info() -> dict[str, Any]:
        return {
            "url": srv.url,
            "model": cfg.served_model_name,
            "model_dir": str(srv.model_path),
            "kv_pool": srv.kv_pool,
            "num_gpu_blocks": srv.cache_info.num_gpu_blocks if srv.cache_info else None,
            "block_size": srv.cache_info.block_size if srv.cache_info else None,
            "max_model_len": cfg.model_len,
            "prefix_caching": cfg.prefix_caching,
            "kv_bytes_per_token": srv.kv_bytes_per_token,
            "kv_cache_size_tokens_logged": srv.log_kv_cache_tokens,
            "startup_s": round(srv.startup_s or 0.0, 1),
            "log": str(srv.log_path),
            "pid": srv.proc.pid if srv.proc else None,
        }

    def banner(i: dict[str, Any]) -> str:
        return (
            f"serving {i['model']} at {i['url']}: pool {i['kv_pool']} tokens ({i['num_gpu_blocks']} blocks of "
            f"{i['block_size']}, block 0 is the null block), max_model_len {i['max_model_len']}, up in "
            f"{i['startup_s']} s. Ctrl-C stops it."
        )

    serve_until_stopped(srv, "real-vllm", info, banner, as_json)


@command.command("heldout")
@click.option("--out", "out", type=click.Path(file_okay=False, path_type=Path), default=Path("kvgate-heldout"),
              show_default=True, help="Where the runs go (resumable).")
@click.option("--page", "page_dir", type=click.Path(file_okay=False, path_type=Path),
              default=Path("docs/results/real-vllm-heldout"), show_default=True, help="Where the page goes.")
@click.option("--quick", is_flag=True, help="Two runs of 1.5 minutes: a check of the machinery, not the table.")
@click.option("--profile", default=None, help="Engine profile to predict with (e.g. tiny-llama-cpu-vllm032) "
              "[default: measure one first with kvgate calibrate --endpoint, the fitting set, into OUT/profile.json].")
@click.option("--minutes", type=FINITE, default=None, help="Minutes per run [default: 3, --quick 1.5].")
@click.option("--cells", "cells_file", type=click.Path(dir_okay=False, path_type=Path), default=None,
              help="The cells: a JSON list of {lam, kv_pool, shape, trigger ('none' or X@S+D), seed} (needed "
              "unless --quick).")
def heldout_command(out: Path, page_dir: Path, quick: bool, profile: str | None, minutes: float | None,
                    cells_file: Path | None) -> None:
    """The simulator's held-out accuracy against the real vLLM: the runs of a committed cells file, none of which
    the profile was fitted on; writes PAGE/index.md with the error per metric beside BLIS's, per turn and per run,
    split by whether demand exceeded the pool. The cells, the profile and kvgate's commit are frozen in
    OUT/protocol.json before the first run; a later invocation on OUT with any of them changed is refused.

    First the fitting set: kvgate calibrate --endpoint on a server of its own (about 3 minutes). Then each run
    starts a fresh vLLM server and drives it in real time (about 3.5 minutes a run, an hour in all); runs already
    in OUT are kept (a run cut short resumes), and the simulator's predictions are made again each time (two
    simulations, a second each: the run's and the eviction-free one on an unbounded pool). Run it on a quiet
    machine: other load perturbs the real timings; the fit and the runs must share one window (the engine's speed
    drifts over hours).
    """
    from kvgate.realvllm.heldout import run

    if minutes is not None and minutes <= 0:
        raise UsageError(f"--minutes must be positive, got {minutes}")
    res = run(out, page_dir=page_dir, quick=quick, profile=profile, minutes=minutes, cells_file=cells_file,
              progress=lambda m: click.echo(m, err=True))
    s = res["summary"]
    click.echo(f"{s['runs']} runs: median E2E error {s['e2e']:.1%}, TTFT {s['ttft']:.1%}, per-minute hit ratio "
               f"largest error {s['hit_max_all']:.3f}; page {page_dir / 'index.md'}")
