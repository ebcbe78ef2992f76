"""The command-line options of each concern, written once and shared by every program's CLI: the workload
(:data:`WORKLOAD_OPTIONS`: ``kvgate sim``, ``paired``, ``arms``, ``drive``), the agents' timeouts and retries
(:data:`AGENT_RETRY_OPTIONS`), the simulated engine (:data:`ENGINE_MODEL_OPTIONS`, ``kvgate engine`` too; with its
triggers :data:`ENGINE_OPTIONS`), the control
(:data:`CONTROL_OPTIONS`) and the fleet (:data:`FLEET_OPTIONS`). Each concern's triggers come from their classes
(:func:`trigger_options`, :mod:`kvgate.workload.triggers`). Light to import: nothing runs here."""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable
from typing import Any

import click

from kvgate.fleet.routers import ROUTERS
from kvgate.policy.limits import CONTROLS
from kvgate.workload import triggers as T

Option = Callable[[Callable[..., Any]], Callable[..., Any]]


def trigger_options(kinds: list[type[T.Trigger]]) -> list[Option]:
    """One option per kind of trigger, as its class declares it (values named by :func:`kvgate.workload.triggers.dest`;
    :func:`kvgate.workload.triggers.config_values` turns them into config fields)."""
    out = []
    for cls in kinds:
        typ = FINITE if cls.number else str
        out.append(click.option(cls.option, T.dest(cls), type=typ, multiple=cls.many, default=None,
                                metavar=cls.metavar, help=cls.help))
    return out


def with_options(*sets: list[Option]) -> Option:
    """A decorator adding every option of ``sets``, in that order in ``--help``."""

    def deco(f: Callable[..., Any]) -> Callable[..., Any]:
        for o in reversed([o for s in sets for o in s]):
            f = o(f)
        return f

    return deco


class Port(click.ParamType):
    """A TCP port to listen on: 1-65535, or 0 (a free one) where ``free`` (an out-of-range number is refused, not
    wrapped into range by the socket layer)."""

    name = "port"

    def __init__(self, free: bool = False) -> None:
        self.free = free

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int) and not isinstance(value, bool):
            n = value
        else:
            try:
                n = int(str(value).strip())
            except ValueError:
                self.fail(f"{value!r} is not a port number", param, ctx)
        low = 0 if self.free else 1
        if not low <= n <= 65535:
            self.fail(f"{n} is not a port: expected {low}-65535{' (0: a free one)' if self.free else ''}", param, ctx)
        return n


class Finite(click.ParamType):
    """A real number that is finite (``nan`` and ``inf`` are numbers to Python's ``float()``, not to an option:
    every range check of a NaN is false, and an infinite rate or length never ends a run), at least ``min`` if
    given."""

    name = "number"

    def __init__(self, min: float | None = None) -> None:
        self.min = min

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> float:
        try:
            x = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number", param, ctx)
        if not math.isfinite(x):
            self.fail(f"{value!r} is not a finite number", param, ctx)
        if self.min is not None and x < self.min:
            self.fail(f"{value!r} is below {self.min:g}", param, ctx)
        return x


FINITE = Finite()
"""A float option's type: finite numbers only."""


PORT = Port(free=True)
"""The servers' ``--port`` (0: a free one, the bound port said at start)."""

_LABEL = re.compile(r"(?!-)[A-Za-z0-9-]{1,63}(?<!-)")


class BindAddress(click.ParamType):
    """An address to listen on: an IP address (``127.0.0.1``, ``::1`` or ``[::1]``, ``0.0.0.0``) or a host name
    (letters, digits and hyphens in dot-separated labels; not all-numeric, which would be a malformed IPv4)."""

    name = "address"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> str:
        text = str(value).strip()
        bare = text[1:-1] if text.startswith("[") and text.endswith("]") else text
        try:
            return str(ipaddress.ip_address(bare))
        except ValueError:
            pass
        labels = text.removesuffix(".").split(".")
        if len(text) <= 253 and all(_LABEL.fullmatch(x) for x in labels) and not all(x.isdigit() for x in labels):
            return text
        self.fail(f"{value!r} is not an address to listen on: an IP address (127.0.0.1, ::1, 0.0.0.0) or a host "
                  "name", param, ctx)


BIND_ADDRESS = BindAddress()


def url_host(host: str) -> str:
    """``host`` as a URL writes it (an IPv6 address in brackets)."""
    return f"[{host}]" if ":" in host else host


def _pools(_ctx: click.Context, _param: click.Parameter, text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x.replace("_", "")) for x in text.split(",") if x.strip())
    except ValueError:
        raise click.BadParameter(f"{text!r}: expected comma-separated token counts, e.g. 400000,200000") from None


WORKLOAD_OPTIONS: list[Option] = [
    click.option("--preset", default="paper-8b", show_default=True, help="Workload preset: paper-8b, paper-shift."),
    click.option("--trace", default=None, help="Replay trace shapes (kvgate JSONL) instead; 'bundled' for the "
                 "packaged mini-SWE-agent set, 'paper' for it drawn with the paper's trace statistics."),
    click.option("--max-context", type=click.IntRange(min=1), default=None,
                 help="Truncate trace sessions at this context [default: 38000]."),
    click.option("--lam", type=FINITE, default=0.035, show_default=True,
                 help="Base session arrival rate (sessions per virtual second)."),
    click.option("--minutes", type=FINITE, default=90.0, show_default=True, help="Run length (virtual minutes)."),
    *trigger_options(T.kinds("workload")),
]
"""The workload: its sessions, its arrivals and their triggers (the seed is each command's: one, or a list)."""

AGENT_RETRY_OPTIONS: list[Option] = [
    click.option("--client-timeout", "client_timeout_s", type=FINITE, default=None, metavar="S",
                 help="Agent-side timeout of one attempt of a turn, virtual seconds [default: none]."),
    click.option("--client-retries", type=int, default=0, show_default=True,
                 help="Retries of a timed-out turn before the agent gives up its session."),
    click.option("--retry-backoff", "retry_backoff_s", type=FINITE, default=2.0, show_default=True, metavar="S",
                 help="Backoff before the first retry, virtual seconds (doubles per retry)."),
    click.option("--retry-jitter", type=FINITE, default=0.5, show_default=True,
                 help="Backoff jitter: each wait times 1 ± this, drawn per attempt."),
]
"""The agent's timeouts and retries (:class:`kvgate.workload.config.AgentRetries`)."""

ENGINE_MODEL_OPTIONS: list[Option] = [
    click.option("--engine", type=click.Choice(["vllm", "sglang"]), default="vllm", show_default=True,
                 help="Engine model: vLLM v1's block pool and scheduler, or SGLang's radix cache."),
    click.option("--profile", default="qwen3-8b-mi300x", show_default=True,
                 help="Engine cost profile: a name, or a .json file from kvgate calibrate --endpoint."),
    click.option("--kv-pool", type=click.IntRange(min=1), default=None,
                 help="KV pool in tokens [default: the profile's]."),
    click.option("--no-prefix-cache", is_flag=True, help="Disable prefix caching."),
    click.option("--block-size", type=click.IntRange(min=1), default=None, metavar="TOKENS",
                 help="KV block size of the simulated vLLM in tokens [default: 16; vLLM's CPU build uses 128; "
                 "SGLang's page is 1]."),
    click.option("--max-num-batched-tokens", type=click.IntRange(min=1), default=8192, show_default=True,
                 help="Token budget of an engine step (vLLM's; SGLang's chunked_prefill_size)."),
    click.option("--max-num-seqs", type=click.IntRange(min=1), default=1024, show_default=True,
                 help="Requests per batch."),
    click.option("--evict-sessions", is_flag=True,
                 help="Engine alternative (vllm): evict parked and ended sessions' cached blocks first."),
    click.option("--retention", is_flag=True,
                 help="Engine alternative (vllm): evict longer contexts' cached blocks last."),
    click.option("--pin-ttl", "pin_ttl_s", type=Finite(min=0), default=0.0, metavar="S",
                 help="Engine alternative (vllm): pin a finished turn's blocks for S seconds [default: off]."),
    click.option("--prefix-first", type=click.IntRange(min=0), default=0, metavar="N",
                 help="Engine alternative (vllm): admit the first N waiting requests by cached fraction."),
    click.option("--sglang-policy", type=click.Choice(["fcfs", "lpm"]), default="fcfs", show_default=True,
                 help="SGLang's schedule policy (--engine sglang)."),
]
"""The simulated engine (:class:`kvgate.engine.factory.EngineConfig`): ``kvgate engine`` serves it, the simulator
runs it."""

OFFLOAD_OPTIONS: list[Option] = [
    click.option("--cpu-offload-tokens", type=click.IntRange(min=0), default=0,
                 help="Host KV tier size in tokens (vllm)."),
    click.option("--offload-bandwidth", "offload_bandwidth_gbs", type=FINITE, default=50.0, show_default=True,
                 metavar="GB/S", help="Effective host-to-GPU bandwidth of the offload tier."),
    click.option("--offload-latency", "offload_latency_s", type=FINITE, default=0.015, show_default=True,
                 metavar="S", help="Fixed latency of one host-to-GPU load (seconds per request)."),
    click.option("--offload-policy", type=click.Choice(["write-through", "on-evict"]), default="write-through",
                 show_default=True, help="Which blocks the host tier holds: every computed block, LRU by store "
                 "or load (vLLM's connector), or what the GPU pool evicts."),
]
"""The simulated vLLM's host KV tier (the simulator's: the served engine has none)."""

ENGINE_OPTIONS: list[Option] = [*ENGINE_MODEL_OPTIONS, *OFFLOAD_OPTIONS, *trigger_options(T.kinds("engine"))]
"""The simulated engine, its host tier and its triggers (the simulator's; a driver plays the triggers on a served
engine over HTTP)."""

def control_options(default: str = "none") -> list[Option]:
    """The gateway's control (:class:`kvgate.policy.config.ControlConfig`), ``default`` the control without
    ``--control`` (the simulator's none, the gateway's budgeter)."""
    return [
        click.option("--control", default=default, show_default=True, help=f"Gateway control: {', '.join(CONTROLS)}."),
        *trigger_options(T.kinds("control")),
        click.option("--control-opt", default="", metavar="K=V,...",
                     help="Control parameters, e.g. low=0.7,high=0.9 (budgeter) or K=22,K_hi=25 (cap)."),
    ]


CONTROL_OPTIONS: list[Option] = control_options()
"""The control's options as the simulator takes them."""

FLEET_OPTIONS: list[Option] = [
    click.option("--replicas", type=click.IntRange(min=1), default=1, show_default=True,
                 help="Engine replicas, each with its own KV pool, behind one gateway and a router."),
    click.option("--replica-pools", callback=_pools, default="", metavar="C,C,...",
                 help="Every replica's KV pool in tokens (a mixed fleet; joining replicas included) "
                 "[default: --kv-pool for each]."),
    click.option("--router", type=click.Choice(list(ROUTERS)), default="kvgate", show_default=True,
                 help="Where a fleet's turns go (docs/architecture.md); kvgate: session affinity, a new session "
                 "to the replica with the most headroom, and with --control one budget per replica."),
    *trigger_options(T.kinds("fleet")),
]
"""The fleet (:class:`kvgate.fleet.config.FleetConfig`) and its triggers."""
