"""Executors: Ray gives the local executor's results, survives a killed worker, and runs resume."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path

import pytest

from kvgate.errors import UsageError
from kvgate.sim.batch import run_many
from kvgate.sim.config import SimConfig
from kvgate.sim.executor import Executor, current, executing
from kvgate.sim.paired import run_paired

ray = pytest.importorskip("ray", reason="Ray is an optional dependency (pip install 'kvgate[ray]')")

PAIRED = SimConfig(lam=0.035, minutes=90, bursts=("1.5@15+5",))


def _strip(res: dict) -> dict:
    """Summaries without their wall-clock fields (the only thing allowed to differ between executors)."""
    out = []
    for p in res["pairs"]:
        out.append({arm: {k: v for k, v in p[arm].items() if k != "wall_s"} for arm in ("twin", "trigger")})
    return {"pairs": out, "counts": res["counts"], "p": res["sign_test_p"]}


@pytest.fixture(scope="module")
def local_ray():
    ex = Executor("ray", jobs=2)
    from kvgate.sim.executor import ray_init

    ray_init(ex)
    yield ex
    ray.shutdown()


@pytest.mark.slow
def test_ray_paired_identical_to_local(local_ray: Executor) -> None:
    seeds = list(range(501, 513))
    local = run_paired(PAIRED, seeds, progress=False)
    with executing(local_ray):
        assert current() is local_ray
        remote = run_paired(PAIRED, seeds, progress=False)
    assert current().kind == "local"
    assert _strip(remote) == _strip(local)
    assert sum(local["counts"].values()) == 12


@pytest.mark.slow
def test_killed_ray_worker_loses_no_run(local_ray: Executor, tmp_path: Path) -> None:
    import psutil

    cfgs = [SimConfig(lam=0.04, minutes=90, seed=s, bursts=("1.0@10+4",)) for s in range(1, 9)]
    jobs = [(cfg, str(tmp_path / f"r{cfg.seed}")) for cfg in cfgs]
    killed: list[int] = []

    me = psutil.Process()

    def killer() -> None:
        # kill the first worker of this test's own Ray cluster (a descendant of this process) seen executing a
        # run (Ray names busy workers "ray::_ray_job"); another Ray on the machine is not touched
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and not killed:
            for p in me.children(recursive=True):
                try:
                    cmd = " ".join(p.cmdline())
                except (psutil.NoSuchProcess, psutil.AccessDenied):
                    continue
                if "ray::_ray_job" in cmd:
                    try:
                        os.kill(p.pid, signal.SIGKILL)
                        killed.append(p.pid)
                    except ProcessLookupError:
                        continue
                    break
            time.sleep(0.02)

    t = threading.Thread(target=killer, daemon=True)
    t.start()
    metas = run_many(jobs, executor=local_ray, progress=False)
    t.join(timeout=5)
    assert killed, "no busy Ray worker was seen to kill"
    assert len(metas) == len(jobs)
    for (cfg, out), meta in zip(jobs, metas, strict=True):
        assert meta["config"]["seed"] == cfg.seed
        assert (Path(out) / "run.json").exists()
    # the same runs, locally, from scratch: identical summaries
    again = run_many([(cfg, None, False) for cfg, _ in jobs], progress=False)
    for a, b in zip(metas, again, strict=True):
        a_s = {k: v for k, v in a["summary"].items() if k != "wall_s"}
        assert a_s == {k: v for k, v in b["summary"].items() if k != "wall_s"}


def test_resume_skips_finished_runs(tmp_path: Path) -> None:
    cfg = SimConfig(minutes=20, seed=7)
    out = tmp_path / "run"
    first = run_many([(cfg, str(out))], progress=False)[0]
    stamp = (out / "run.json").stat().st_mtime_ns
    again = run_many([(cfg, str(out))], progress=False)[0]
    assert (out / "run.json").stat().st_mtime_ns == stamp
    assert again["summary"] == first["summary"]
    # a different config in the same directory is run again
    other = run_many([(cfg.with_(seed=8), str(out))], progress=False)[0]
    assert other["config"]["seed"] == 8


def test_summary_only_jobs_keep_no_records(tmp_path: Path) -> None:
    meta = run_many([(SimConfig(minutes=15), str(tmp_path / "r"), False)], progress=False)[0]
    assert "summary" in meta
    assert (tmp_path / "r" / "run.json").exists()
    assert not list((tmp_path / "r").glob("*.parquet"))


def test_executor_misuse_is_a_usage_error() -> None:
    with pytest.raises(UsageError):
        Executor("dask")
    with pytest.raises(UsageError):
        Executor("local", address="ray://x:1")
    with pytest.raises(UsageError):
        Executor("local", jobs=0)


def test_a_local_pool_never_forks_the_calling_process() -> None:
    """The pool's workers come from a fork server with the job module imported, not from a fork of the caller:
    a fork copies every other thread's locks mid-use (pyarrow's pool after a table was read, gRPC's threads, a
    gateway's body reader) and a second sweep in one process hung on one."""
    from kvgate.sim import executor

    ctx = executor._pool_context()
    assert ctx.get_start_method() == "forkserver"
