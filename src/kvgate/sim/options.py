"""The options of the commands that run the simulator, and the config they build (``kvgate sim``, ``paired``,
``arms``, and the batch commands' ``--executor``). Light to import: the simulator loads when a command runs."""

from __future__ import annotations

import functools
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import click

from kvgate.options import (
    AGENT_RETRY_OPTIONS,
    CONTROL_OPTIONS,
    ENGINE_OPTIONS,
    FLEET_OPTIONS,
    WORKLOAD_OPTIONS,
    with_options,
)
from kvgate.workload.triggers import config_values

if TYPE_CHECKING:
    from kvgate.sim.config import SimConfig


TENANT_OPTIONS = [
    click.option("--tenants", default="", metavar="A=F,B=F",
                 help="Tenant classes and their fractions of the arrivals (each session drawn one) [default: one]."),
    click.option("--burst-tenant", default=None, metavar="NAME",
                 help="The tenant every burst's session belongs to [default: drawn like the others]."),
    click.option("--fair-share", is_flag=True,
                 help="Share the control's budget across tenants by weight, re-admitting by tokens served "
                 "(docs/policy.md, fair share) [default: one FIFO for everyone]."),
    click.option("--tenant-weight", "tenant_weights", default="", metavar="A=W,...",
                 help="Tenants' weights under --fair-share [default: 1 each]."),
    click.option("--tenant-priority", "tenant_priorities", default="", metavar="A=P,...",
                 help="Tenants' priority bands under --fair-share, higher served first [default: 0]."),
]
"""Tenants in the simulator: the workload's tenant classes and the fair policy's shares."""


def sim_options(f: Callable[..., Any]) -> Callable[..., Any]:
    """Options shared by every command that runs the simulator: every concern's option set
    (:mod:`kvgate.options`)."""
    return with_options(WORKLOAD_OPTIONS, ENGINE_OPTIONS, FLEET_OPTIONS, CONTROL_OPTIONS, TENANT_OPTIONS,
                        AGENT_RETRY_OPTIONS)(f)


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

    kw = config_values(dict(kw))
    if kw.get("block_size") is None:  # not given: the engine config's default
        kw.pop("block_size", None)
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
