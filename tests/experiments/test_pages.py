"""Experiment pages: every figure they reference exists, and (when Chromium is installed) they render."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest

from kvgate.experiments.runner import report, run_experiments


@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("results")
    run_experiments(["thresholds"], out, quick=True, progress=False)
    return out


def test_pages_reference_existing_figures(results: Path) -> None:
    assert "<img src=" in (results / "thresholds" / "index.html").read_text()
    for page in [results / "index.html", results / "thresholds" / "index.html"]:
        html = page.read_text()
        for src in re.findall(r"<img src='([^']+)'", html):
            p = page.parent / src
            assert p.exists() and p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", src
    assert "thresholds/index.html" in (results / "index.html").read_text()


def test_index_has_the_four_verdicts_and_a_baselines_table(results: Path) -> None:
    md = (results / "index.md").read_text()
    head = next(line for line in md.splitlines() if line.startswith("| experiment |"))
    assert [c.strip() for c in head.strip("|").split("|")][2:] == ["reproduced", "differs", "not reproduced",
                                                                     "calibrated"]
    assert "## Baselines not in the paper" in md and "## Closing note" in md
    page = json.loads((results / "thresholds" / "result.json").read_text())
    counted = [c for c in page["claims"] if not c["baseline"]]
    assert sum(page["verdicts"].values()) == len(counted) and all(c["rule"] for c in counted)
    assert f"Of {len(counted)} claims" in md


def test_report_rebuilds_without_running(results: Path) -> None:
    before = {p: p.stat().st_mtime for p in (results / "thresholds" / "runs").rglob("*.parquet")}
    res = report(results)
    assert "thresholds" in res
    after = {p: p.stat().st_mtime for p in (results / "thresholds" / "runs").rglob("*.parquet")}
    assert before == after  # no run was redone


@pytest.mark.skipif(not shutil.which("chromium"), reason="headless Chromium not installed")
def test_page_renders_in_headless_chromium(results: Path, tmp_path: Path) -> None:
    shot = tmp_path / "shot.png"
    page = results / "thresholds" / "index.html"
    subprocess.run(
        ["chromium", "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync",
         f"--user-data-dir={tmp_path / 'profile'}", "--window-size=1000,1400", f"--screenshot={shot}",
         page.as_uri()],
        capture_output=True, timeout=60, check=False,
    )
    assert shot.exists() and shot.stat().st_size > 10_000
