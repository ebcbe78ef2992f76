"""Where a batch of simulated runs executes: forked local processes, or a Ray cluster.

Every batch (``paired``, ``arms``, ``experiment``, ``reproduce``, ``sweep``) is a list of independent jobs
``(SimConfig, out dir or None)``; a job is a pure function of its config (``sim.runner.simulate``), so where it
runs cannot change its result. Two executors:

* ``local`` (default): a pool of forked worker processes on this machine, one per core (from a fork server
  when Ray runs in the same process: forking its threads can deadlock).
* ``ray``: one Ray task per job, on a local Ray (started with ``jobs`` CPUs) or the cluster at ``address``.
  Ray does the scheduling, moves results through its object store and retries a job whose worker died
  (``max_retries``); nothing here manages nodes. Workers must be able to import kvgate (on a cluster: install
  it on every node, or pass a ``runtime_env``).

Resumability is the job's own: a job whose out dir already holds a ``run.json`` for the same config returns
it without running (``job.run_one``), whichever executor runs it. The executor used by ``run_many`` when
none is passed is the one installed with :func:`executing` (a context variable, so it is scoped to a command).
"""

from __future__ import annotations

import contextlib
import contextvars
import multiprocessing as mp
import os
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from kvgate.errors import UsageError
from kvgate.sim.job import Job, run_one

Done = Callable[[int, dict[str, Any]], None]
"""Called as each job completes, with its index and run metadata (in completion order)."""

EXECUTORS = ("local", "ray")


def default_jobs() -> int:
    return max(1, os.cpu_count() or 1)


@dataclass(frozen=True)
class Executor:
    """How to run a batch. ``kind`` is ``local`` or ``ray``; ``jobs`` caps parallel runs (local processes, or the
    CPUs of a local Ray); ``address`` is a Ray cluster to join (None: start a local one)."""

    kind: str = "local"
    jobs: int | None = None
    address: str | None = None
    max_retries: int = 3

    def __post_init__(self) -> None:
        if self.kind not in EXECUTORS:
            raise UsageError(f"unknown executor {self.kind!r}; choose {' or '.join(EXECUTORS)}")
        if self.jobs is not None and self.jobs < 1:
            raise UsageError("--jobs must be at least 1")
        if self.address is not None and self.kind != "ray":
            raise UsageError("--ray-address needs --executor ray")

    def run(self, jobs_list: Sequence[Job], done: Done) -> None:
        """Run every job, calling ``done(index, meta)`` as each finishes."""
        if not jobs_list:
            return
        if self.kind == "ray":
            _run_ray(self, jobs_list, done)
        else:
            _run_local(self, jobs_list, done)


_current: contextvars.ContextVar[Executor | None] = contextvars.ContextVar("kvgate_executor", default=None)


def current() -> Executor:
    """The executor installed by :func:`executing`, else a local one."""
    return _current.get() or Executor()


@contextlib.contextmanager
def executing(executor: Executor) -> Iterator[Executor]:
    """Make ``executor`` the default of every batch run inside the ``with`` block."""
    token = _current.set(executor)
    try:
        yield executor
    finally:
        _current.reset(token)


# -- local ---------------------------------------------------------------------------------------------------


def _run_local(ex: Executor, jobs_list: Sequence[Job], done: Done) -> None:
    n = len(jobs_list)
    jobs = min(ex.jobs or default_jobs(), n)
    if jobs <= 1:
        for i, job in enumerate(jobs_list):
            done(i, run_one(job))
        return
    with _pool_context().Pool(jobs) as pool:
        for i, meta in pool.imap_unordered(_indexed, list(enumerate(jobs_list))):
            done(i, meta)


def _pool_context() -> Any:
    """A fork server, never a fork of this process: a fork copies every other thread's locks mid-use (Ray's and
    gRPC's threads, pyarrow's pool, a gateway's body reader, native threads Python cannot see) and the child can
    deadlock on one. The server is a fresh interpreter with the job module imported, so a worker is a cheap fork
    of it; the jobs are picklable."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["kvgate.sim.job"])
    return ctx


def _indexed(item: tuple[int, Job]) -> tuple[int, dict[str, Any]]:
    i, job = item
    return i, run_one(job)


# -- Ray -----------------------------------------------------------------------------------------------------


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise UsageError("--executor ray needs Ray: pip install 'kvgate[ray]'") from None
    return ray


def ray_init(ex: Executor) -> Any:
    """Connect to (or start) Ray for ``ex``; returns the ``ray`` module. Idempotent."""
    ray = _ray()
    if not ray.is_initialized():
        kw: dict[str, Any] = {"include_dashboard": False, "log_to_driver": False, "configure_logging": False}
        if ex.address is not None:
            kw["address"] = ex.address
        else:
            kw["num_cpus"] = ex.jobs or default_jobs()
        try:
            ray.init(**kw)
        except (ConnectionError, RuntimeError, ValueError) as e:
            where = ex.address or "a local Ray"
            raise UsageError(f"cannot start Ray ({where}): {str(e).splitlines()[0] if str(e) else e}") from None
    return ray


def _run_ray(ex: Executor, jobs_list: Sequence[Job], done: Done) -> None:
    ray = ray_init(ex)
    remote = ray.remote(num_cpus=1, max_retries=ex.max_retries)(_ray_job)
    pending = {remote.remote(job): i for i, job in enumerate(jobs_list)}
    while pending:
        ready, _ = ray.wait(list(pending), num_returns=1)
        for ref in ready:
            i = pending.pop(ref)
            done(i, ray.get(ref))


def _ray_job(job: Job) -> dict[str, Any]:
    return run_one(job)
