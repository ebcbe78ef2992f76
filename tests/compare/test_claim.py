"""Streams of ``kvgate compare run`` sharing one directory: a run is claimed by one live stream at a time, a done
run by none, and a killed stream leaves no stale claim."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from kvgate.compare.plan import Run
from kvgate.compare.runner import claim

RUN = Run("burst", "kvgate", 1, "burst", 501, 90.0)


def test_one_stream_at_a_time_and_never_a_done_run(tmp_path: Path) -> None:
    first = claim(tmp_path, RUN)
    assert first is not None
    assert claim(tmp_path, RUN) is None  # held: another stream skips it
    os.close(first)
    again = claim(tmp_path, RUN)
    assert again is not None
    os.close(again)
    (tmp_path / RUN.key).mkdir(parents=True)
    (tmp_path / RUN.key / "compare.json").write_text("{}")
    assert claim(tmp_path, RUN) is None


def test_a_killed_stream_leaves_no_stale_claim(tmp_path: Path) -> None:
    code = ("import sys, time; from pathlib import Path; from kvgate.compare.plan import Run; "
            "from kvgate.compare.runner import claim; "
            f"fd = claim(Path({str(tmp_path)!r}), Run('burst', 'kvgate', 1, 'burst', 501, 90.0)); "
            "print('held' if fd is not None else 'none', flush=True); time.sleep(60)")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "held"
        assert claim(tmp_path, RUN) is None
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait(timeout=30)
    deadline = time.monotonic() + 10
    fd = claim(tmp_path, RUN)
    while fd is None and time.monotonic() < deadline:
        time.sleep(0.05)
        fd = claim(tmp_path, RUN)
    assert fd is not None
    os.close(fd)
