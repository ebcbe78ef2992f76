"""``kvgate drive`` directly against a real vLLM (CPU build, tiny random-weight Llama): a short run of small trace
sessions writes records whose prompt lengths follow the shapes and whose cached tokens show the prefix cache at work.

One drive run (about 25 s, ``python3 -m kvgate.cli drive`` as a subprocess) against the shared server; the tests
read its records.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from kvgate.realvllm.server import RealVllm
from kvgate.records import load_run
from support.real_vllm import BLOCK, usable_pool

pytestmark = pytest.mark.real_vllm
SRC = str(Path(__file__).resolve().parents[2] / "src")
SHARED = 256
SHAPES = [
    {"id": f"s{i}", "shared": SHARED, "initial": 400 + 60 * i, "outputs": [16, 12, 16], "appends": [300 + 20 * i, 200],
     "gaps": [0.3, 0.5]}
    for i in range(6)
]


@pytest.fixture(scope="module")
def drive_run(real_vllm_server: RealVllm, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    tmp = tmp_path_factory.mktemp("drive")
    trace = tmp / "trace.jsonl"
    trace.write_text("".join(json.dumps(s) + "\n" for s in SHAPES))
    out = tmp / "run"
    cmd = [sys.executable, "-m", "kvgate.cli", "drive", "--endpoint", real_vllm_server.url, "--trace", str(trace),
           "--lam", "0.4", "--minutes", "0.4", "--seed", "7", "--timeout", "60", "--out", str(out),
           "--json"]
    r = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": SRC}, timeout=240)
    assert r.returncode == 0, r.stderr[-2000:]
    return {"out": out, "summary": json.loads(r.stdout.strip().splitlines()[-1]), "server": real_vllm_server}


def test_drive_records_follow_the_shapes_and_carry_cached_tokens(drive_run: dict[str, Any]) -> None:
    run = load_run(drive_run["out"])
    cols = run.turns
    turns = [dict(zip(cols, row, strict=True)) for row in zip(*(cols[k].tolist() for k in cols), strict=True)]
    ok = [t for t in turns if t["status"] == "ok"]
    assert len(ok) >= 6, turns
    by_session: dict[int, dict[int, dict[str, Any]]] = {}
    for t in ok:
        by_session.setdefault(t["session"], {})[t["turn"]] = t
    lengths = {(s["initial"], s["outputs"][0] + s["appends"][0], s["outputs"][1] + s["appends"][1]) for s in SHAPES}
    first_turns = sorted((t["sent_s"], t) for t in ok if t["turn"] == 0)
    for sid, ts in by_session.items():
        if 0 in ts and 1 in ts:
            assert any(ts[0]["prompt_tokens"] == a and ts[1]["prompt_tokens"] == a + b for a, b, _ in lengths), sid
        for k, t in ts.items():
            assert t["output_tokens"] == SHAPES[0]["outputs"][k]  # ignore_eos: every output has its full length
            if k >= 1 and k - 1 in ts:
                prev = ts[k - 1]["prompt_tokens"]
                # the whole previous prompt's full blocks hit (nothing here is large enough to evict them)
                assert BLOCK * (prev // BLOCK) <= t["cached_tokens"] < t["prompt_tokens"], (sid, k, t)
    # every session after the first finds the shared prefix (its full blocks) already cached
    assert first_turns and all(t["cached_tokens"] >= BLOCK * (SHARED // BLOCK) for _, t in first_turns[1:])
    assert sum(t["cached_tokens"] for t in ok) > 0
    assert run.meta["kind"] == "drive"
    # vLLM in dev mode answers /server_info too: the driver still knows it for vLLM, and its model
    assert urllib.request.urlopen(drive_run["server"].url + "/server_info", timeout=10).status == 200
    assert run.meta["server"]["kind"] == "vllm" and run.meta["server"]["model"] == "tiny-llama"


def test_drive_records_the_pool_vllm_can_fill(drive_run: dict[str, Any]) -> None:
    run = load_run(drive_run["out"])
    pools = set(run.samples["kv_pool"].tolist())
    assert pools == {usable_pool(drive_run["server"])}
