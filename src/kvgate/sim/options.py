"""The options of the commands that run the simulator, and the config they build (``kvgate sim``, ``paired``,
``arms``, and the batch commands' ``--executor``). Light to import: the simulator loads when a command runs."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvgate.fleet.routers import ROUTERS
from kvgate.policy.limits import CONTROLS

if TYPE_CHECKING:
    from kvgate.sim.config import SimConfig



AGENT_RETRY_OPTIONS = [
    click.option("--client-timeout", "client_timeout_s", type=float, default=None, metavar="S",
                 help="Agent-side timeout of one attempt of a turn, virtual seconds [default: none]."),
    click.option("--client-retries", type=int, default=0, show_default=True,
                 help="Retries of a timed-out turn before the agent gives up its session."),
    click.option("--retry-backoff", "retry_backoff_s", type=float, default=2.0, show_default=True, metavar="S",
                 help="Backoff before the first retry, virtual seconds (doubles per retry)."),
    click.option("--retry-jitter", type=float, default=0.5, show_default=True,
                 help="Backoff jitter: each wait times 1 ± this, drawn per attempt."),
]
"""The agent's timeouts and retries (workload.config.AgentRetries), for every program that runs agents."""

def _pools(_ctx: click.Context, _param: click.Parameter, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x.replace("_", "")) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected comma-separated token counts, e.g. 400000,200000") from None


def sim_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """Options shared by every command that runs the simulator."""
    opts = [
        click.option("--preset", default="paper-8b", show_default=True, help="Workload preset: paper-8b, paper-shift."),
        click.option("--trace", default=None, help="Replay trace shapes (kvgate JSONL) instead; 'bundled' for the "
                     "packaged mini-SWE-agent set, 'paper' for it drawn with the paper's trace statistics."),
        click.option("--max-context", type=int, default=None, help="Truncate trace sessions at this context "
                     "[default: 38000]."),
        click.option("--lam", type=float, default=0.035, show_default=True, help="Base session arrival rate (1/s)."),
        click.option("--minutes", type=float, default=90.0, show_default=True, help="Run length (simulated)."),
        click.option("--burst", "bursts", multiple=True, metavar="X@S+D",
                     help="Extra Poisson stream at X*lam from minute S for D minutes (+N@S+D: N extra sessions). "
                     "Repeatable."),
        click.option("--flush-at", type=float, default=None, metavar="MIN",
                     help="Flush the prefix cache (preempting running requests) at this minute."),
        click.option("--rate-at", "rate_at", multiple=True, metavar="MIN:LAM",
                     help="Change the base arrival rate at a minute. Repeatable."),
        click.option("--engine", type=click.Choice(["vllm", "sglang"]), default="vllm", show_default=True),
        click.option("--profile", default="qwen3-8b-mi300x", show_default=True,
                     help="Engine cost profile: a name, or a .json file from kvgate calibrate --endpoint."),
        click.option("--kv-pool", type=int, default=None, help="KV pool in tokens [default: the profile's]."),
        click.option("--no-prefix-cache", is_flag=True, help="Disable prefix caching."),
        click.option("--cpu-offload-tokens", type=int, default=0, help="Host KV tier size in tokens (vllm)."),
        click.option("--offload-bandwidth", "offload_bandwidth_gbs", type=float, default=50.0, show_default=True,
                     metavar="GB/S", help="Effective host-to-GPU bandwidth of the offload tier."),
        click.option("--offload-latency", "offload_latency_s", type=float, default=0.015, show_default=True,
                     metavar="S", help="Fixed latency of one host-to-GPU load (seconds per request)."),
        click.option("--offload-policy", type=click.Choice(["write-through", "on-evict"]), default="write-through",
                     show_default=True, help="Which blocks the host tier holds: every computed block, LRU by store "
                     "or load (vLLM's connector), or what the GPU pool evicts."),
        click.option("--replicas", type=int, default=1, show_default=True,
                     help="Engine replicas, each with its own KV pool, behind one gateway and a router."),
        click.option("--replica-pools", callback=_pools, default="", metavar="C,C,...",
                     help="Every replica's KV pool in tokens (a mixed fleet; joining replicas included) "
                     "[default: --kv-pool for each]."),
        click.option("--router", type=click.Choice(list(ROUTERS)), default="kvgate", show_default=True,
                     help="Where a fleet's turns go (docs/architecture.md); kvgate: session affinity, a new session "
                     "to the replica with the most headroom, and with --control one budget per replica."),
        click.option("--fail-at", "fail_at", multiple=True, metavar="R@MIN",
                     help="Replica R fails at a minute (its turns fail, its cache is gone, its sessions move). "
                     "Repeatable."),
        click.option("--join-at", "join_at", type=float, multiple=True, metavar="MIN",
                     help="A replica joins at a minute (scale-out). Repeatable."),
        click.option("--migrate-after", "migrate_after_s", type=float, default=None, metavar="S",
                     help="kvgate router: move a session parked this long to a replica with headroom."),
        click.option("--block-size", type=int, default=16, show_default=True,
                     help="KV block size of the simulated vLLM in tokens (its CPU build uses 128)."),
        click.option("--evict-sessions", is_flag=True,
                     help="Engine alternative (vllm): evict parked and ended sessions' cached blocks first."),
        click.option("--retention", is_flag=True,
                     help="Engine alternative (vllm): evict longer contexts' cached blocks last."),
        click.option("--pin-ttl", "pin_ttl_s", type=click.FloatRange(min=0), default=0.0, metavar="S",
                     help="Engine alternative (vllm): pin a finished turn's blocks for S seconds [default: off]."),
        click.option("--prefix-first", type=click.IntRange(min=0), default=0, metavar="N",
                     help="Engine alternative (vllm): admit the first N waiting requests by cached fraction."),
        click.option("--sglang-policy", type=click.Choice(["fcfs", "lpm"]), default="fcfs", show_default=True),
        click.option("--control", default="none", show_default=True,
                     help=f"Gateway control: {', '.join(CONTROLS)}."),
        click.option("--control-at", type=float, default=None, metavar="MIN",
                     help="Minute the control starts (before it: none) [default: from the start]."),
        click.option("--control-opt", default="", metavar="K=V,...", help="Control parameters, e.g. K=22,K_hi=25."),
        *AGENT_RETRY_OPTIONS,
    ]
    for o in reversed(opts):
        f = o(f)
    return f


def executor_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """``--executor local|ray`` and ``--ray-address`` for a command that runs batches of simulations: the
    command body runs with that executor installed (``kvgate.sim.executor.executing``)."""

    @functools.wraps(f)
    def wrapper(*args: Any, executor: str, ray_address: str | None, **kw: Any) -> Any:
        from kvgate.sim.executor import Executor, executing

        with executing(Executor(executor, jobs=kw.get("jobs"), address=ray_address)):
            return f(*args, **kw)

    wrapper = click.option("--ray-address", default=None, metavar="ADDR",
                           help="Ray cluster to join (e.g. ray://head:10001) [default: start a local Ray].")(wrapper)
    return click.option("--executor", type=click.Choice(["local", "ray"]), default="local", show_default=True,
                        help="Where runs execute: forked local processes, or Ray tasks.")(wrapper)


def config_from(kw: dict[str, Any], **over: Any) -> SimConfig:
    """The validated config of :func:`sim_options`' values ``kw`` (named as the config's fields), ``over`` on top."""
    from kvgate.sim.config import SimConfig, validate

    cfg = SimConfig.from_dict({**kw, "prefix_caching": not kw["no_prefix_cache"], **over})
    validate(cfg)
    return cfg


def batch_options(seeds: str, seeds_help: str) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """``--seeds`` (default ``seeds``), ``--jobs``, ``--out``, ``--json`` and the executor of a batch command."""

    def deco(f: Callable[..., Any]) -> Callable[..., Any]:
        opts = [
            click.option("--seeds", default=seeds, show_default=True, help=seeds_help),
            click.option("--jobs", type=int, default=None, help="Parallel runs [default: all cores]."),
            click.option("--out", type=click.Path(file_okay=False, path_type=Path), default=None,
                         help="Write every run's records under this directory (resumable)."),
            click.option("--json", "as_json", is_flag=True, help="Print the result as one JSON object."),
        ]
        f = executor_options(f)
        for o in reversed(opts):
            f = o(f)
        return f

    return deco
