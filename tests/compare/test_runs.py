"""Real runs through the harness: kvgate's own stack always (kvgate engine + gateway, a few seconds), and each
competitor's smoke arm when it is installed (``bash .ci/install-competitors.sh``; skipped otherwise, with the
reason). Each run starts its processes on loopback, drives them, stops them by PID and writes compare.json."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvgate.compare.page import write_pages
from kvgate.compare.plan import SMOKE, Plan, Run
from kvgate.compare.runner import done, run_one
from kvgate.compare.stacks import find_env

ENV = find_env()


def _run(plan: Plan, run: Run, out: Path) -> dict:
    info = run_one(plan, run, out, ENV, lambda _m: None)
    assert done(out, run)
    assert info["summary"]["turns_done"] > 0 and info["summary"]["turns_error"] == 0
    return info


def test_kvgate_stack_end_to_end(tmp_path: Path) -> None:
    plan = Plan("t", seeds=(501,), minutes=4.0, rows=(("burst", 1, ("kvgate",)),), time_scale=60.0, twins=False)
    (run,) = plan.runs()
    info = _run(plan, run, tmp_path)
    assert info["diagnostics"]["kvgate"]["turns_parked"] >= 0
    assert info["config"]["gateway"][:3] == ["kvgate gateway", "--control", "budgeter"]
    page, result = write_pages(tmp_path, tmp_path / "pages", "smoke")
    text = page.read_text()
    assert "kvgate gateway, budgeter" in text and "## Configurations" in text
    assert (tmp_path / "pages" / "figures" / "burst-r1-kvgate-engine.png").exists()
    assert json.loads(result.read_text())[0]["key"] == run.key
    _the_page_keeps_what_it_recorded(tmp_path, run)


def _the_page_keeps_what_it_recorded(out: Path, run: Run) -> None:
    """The page's result.json is a record of its own: rewritten after the run directory is gone (another machine,
    a later session), the page still shows the run as measured then, its figure and configuration included, and
    ``kvgate compare run`` with that page counts the run as done."""
    import shutil

    import click.testing

    from kvgate.cli import cli

    pages = out / "pages"
    before = json.loads((pages / "result.json").read_text())
    shutil.rmtree(out / run.key)
    empty = out / "elsewhere"
    empty.mkdir()
    page, result = write_pages(empty, pages, "smoke")
    after = json.loads(result.read_text())
    assert [r["measures"] for r in after] == [r["measures"] for r in before] and after[0]["config"]
    text = page.read_text()
    assert "1 of the 1 runs are as this page recorded them before" in text
    assert "figures/burst-r1-kvgate-engine.png" in text and "kvgate gateway, budgeter" in text
    # the quick plan's run of the same key (seed 501): done, because the page records it
    args = ["compare", "list", "--plan", "quick", "--only", run.key, "--out", str(empty)]
    res = click.testing.CliRunner().invoke(cli, [*args, "--pages", str(pages)])
    assert res.exit_code == 0 and res.output.split() == ["done", run.key], res.output
    res = click.testing.CliRunner().invoke(cli, args)
    assert res.exit_code == 0 and res.output.split() == [run.key], res.output


@pytest.mark.skipif(not ENV.vllm_router, reason="vllm-router is not installed (bash .ci/install-competitors.sh)")
@pytest.mark.slow
def test_vllm_router_smoke(tmp_path: Path) -> None:
    (run,) = [r for r in SMOKE.runs() if r.stack == "vr-ps"]
    info = _run(SMOKE, run, tmp_path)
    events = info["diagnostics"]["vllm_router"]["events"]
    # its own log: every program admitted by the scheduler (the identity field reached it)
    assert events.get("program_admit", 0) > 0
    cfg = info["config"]["program_scheduling"]
    assert cfg["token_capacity_per_dp_rank"] == 400_000


@pytest.mark.skipif(not (ENV.dynamo_python and ENV.tokenizer_dir),
                    reason="Dynamo 1.6.1 is not installed (bash .ci/install-competitors.sh)")
@pytest.mark.slow
def test_dynamo_thunderagent_smoke(tmp_path: Path) -> None:
    (run,) = [r for r in SMOKE.runs() if r.stack == "dyn-ta"]
    info = _run(SMOKE, run, tmp_path)
    assert info["diagnostics"]["thunderagent"]["enabled"] == 1
    drive_meta = json.loads((tmp_path / run.key / "drive" / "run.json").read_text())
    assert drive_meta["server"]["kind"] == "dynamo" and drive_meta["kv_pool"] == 400_000



def _children(pid: int) -> list[int]:
    """The live (not zombie) processes whose parent is ``pid``."""
    kids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                kids.append(int(d.name))
    return kids


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def test_sigterm_stops_the_stack_it_started(tmp_path: Path) -> None:
    """``kvgate compare run`` stopped with SIGTERM (as a batch system or ``kill`` does) stops the engine, gateway and
    driver it started, each in its own process group, and says so in one line; nothing is left running."""
    import os
    import signal
    import subprocess
    import sys

    from tests.support.wait import until

    out = tmp_path / "runs"
    proc = subprocess.Popen([sys.executable, "-m", "kvgate.cli", "compare", "run", "--plan", "quick",
                             "--only", "burst/kvgate-r1-", "--out", str(out)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    started: list[int] = []
    try:
        until(lambda: (out / "burst/kvgate-r1-burst-s501/logs/drive.log").exists(), "the driver to start", timeout=120)
        until(lambda: len(_children(proc.pid)) >= 3, "the engine, gateway and driver", timeout=60)
        started = _children(proc.pid)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=120)
        assert proc.returncode == 128 + signal.SIGTERM, err.decode()
        assert err.decode().strip().splitlines()[-1] == "kvgate: stopped (SIGTERM)"
        until(lambda: not any(_alive(p) for p in started), f"the processes it started ({started}) to stop", timeout=30)
    finally:  # on failure, what it left behind is stopped here, by the PIDs recorded above
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        for pid in started:
            if _alive(pid):
                os.killpg(pid, signal.SIGKILL)
    assert not list(out.glob("*/*/compare.json"))  # an interrupted run is not done: the next invocation redoes it
