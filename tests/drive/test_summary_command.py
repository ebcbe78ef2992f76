"""``kvgate summary``: reads simulated and driven run directories (a driven one through a gateway) alike."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from pathlib import Path

import pytest
from click.testing import CliRunner

from kvgate.cli import cli
from kvgate.records import write_run
from kvgate.sim.config import SimConfig
from kvgate.sim.runner import simulate

pytest.importorskip("aiohttp")
driver = pytest.importorskip("kvgate.drive.driver")

from kvgate.gateway import Gateway, GatewayConfig  # noqa: E402
from kvgate.serve.app import EngineServer  # noqa: E402
from kvgate.serve.config import ServerConfig  # noqa: E402
from kvgate.workload.shapes import Phase, Workload, synthetic  # noqa: E402

SCALE = 60.0
SMALL = Workload("small", phases=(Phase(0.0, synthetic(shared=64, unique=128, turns=4, output=16, append=32), 4.0),))


async def _drive(out: Path, via_gateway: bool) -> None:
    eng = EngineServer(ServerConfig(kv_pool=2048, time_scale=SCALE))
    port = await eng.start("127.0.0.1", 0)
    gw = None
    try:
        if via_gateway:
            gw = Gateway(GatewayConfig(upstream=f"http://127.0.0.1:{port}", time_scale=SCALE, default_max_tokens=16))
            port = await gw.start("127.0.0.1", 0)
        cfg = driver.DriveConfig(endpoint=f"http://127.0.0.1:{port}", lam=0.4, minutes=1.0, seed=3, time_scale=SCALE)
        await driver.drive(cfg, out, workload=SMALL, status=False, log=lambda _m: None, handle_signals=False)
    finally:
        if gw is not None:
            await gw.stop()
        await eng.stop()


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("runs")
    res = simulate(SimConfig(lam=0.035, minutes=20, seed=501, bursts=("1.5@5+5",)))
    write_run(root / "sim", res.meta, res.tables)

    async def both() -> None:
        async with asyncio.timeout(60):
            await _drive(root / "direct", via_gateway=False)
            await _drive(root / "gateway", via_gateway=True)

    asyncio.run(both())
    return root


def _json_lines(text: str) -> dict[str, dict]:
    out = {}
    for line in text.strip().splitlines():
        r = json.loads(line)
        out[Path(r["path"]).name] = r
    return out


def test_summary_reads_simulated_and_driven_runs(runs: Path) -> None:
    res = CliRunner().invoke(cli, ["summary", str(runs), "--json"])
    assert res.exit_code == 0, res.output
    got = _json_lines(res.output)
    assert set(got) == {"sim", "direct", "gateway"}
    sim = got["sim"]
    assert sim["kind"] == "sim" and "burst 1.5@5+5" in sim["config"] and not sim["recomputed"]
    assert sim["summary"] == json.loads((runs / "sim" / "run.json").read_text())["summary"]
    direct, via = got["direct"], got["gateway"]
    assert direct["kind"] == via["kind"] == "drive"
    assert direct["server"] == {**direct["server"], "kind": "vllm", "via_gateway": False, "kv_pool": 2048,
                                "block_size": 16}
    assert "gateway" not in direct and direct["summary"]["control"] == "none"
    assert via["server"]["via_gateway"] is True and via["server"]["kv_pool"] == 2048
    assert via["summary"]["control"] == "budgeter" and via["gateway"]["turns_waited"] > 0
    # the human form says the same
    text = CliRunner().invoke(cli, ["summary", str(runs / "gateway")]).output
    assert "vllm via a kvgate gateway, 2048 tokens in 16-token blocks" in text and "budgeter" in text


def test_summary_recomputes_a_partial_run_and_writes_figures(runs: Path, tmp_path: Path) -> None:
    # a driven run that crashed has no summary in its run.json: it is recomputed from the records
    meta = json.loads((runs / "direct" / "run.json").read_text())
    stored = meta.pop("summary")
    part = tmp_path / "partial"
    part.mkdir()
    for f in (runs / "direct").iterdir():
        if f.suffix == ".parquet":
            (part / f.name).write_bytes(f.read_bytes())
    (part / "run.json").write_text(json.dumps({**meta, "partial": True}))
    res = CliRunner().invoke(cli, ["summary", str(part), "--json", "--figures", str(tmp_path / "fig")])
    assert res.exit_code == 0, res.output
    r = _json_lines(res.output)["partial"]
    assert r["recomputed"] and r["partial"]
    for key in ("hit_ratio_all", "turns_done", "sessions_arrived", "sessions_finished"):
        assert r["summary"][key] == stored[key], key
    # through a gateway, the recomputed summary keeps the gateway's control and parks
    res = CliRunner().invoke(cli, ["summary", str(runs / "gateway"), "--json", "--recompute"])
    again = _json_lines(res.output)["gateway"]
    stored_gw = json.loads((runs / "gateway" / "run.json").read_text())["summary"]
    assert again["recomputed"] and again["summary"]["control"] == stored_gw["control"] == "budgeter"
    for key in ("parks", "gateway_wait_p90_min", "hit_ratio_all"):
        assert again["summary"][key] == stored_gw[key], key
    names = {p.name for p in (tmp_path / "fig").iterdir()}
    assert {"timeseries.png", "timeseries.svg", "loop-partial.png", "loop-partial.svg"} <= names


def test_summary_of_nothing_is_a_one_line_error(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "summary", str(tmp_path / "nope")], capture_output=True, text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and proc.stderr.strip().count("\n") == 0
    assert proc.stderr.startswith("kvgate: error:") and "no such run directory" in proc.stderr
