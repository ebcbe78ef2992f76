"""Golden summaries: committed results that a run of the same config must reproduce exactly."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kvgate.sim.config import SimConfig


def check_summary(golden_file: Path, name: str, cfg: SimConfig, got: dict[str, Any]) -> None:
    """``got`` (summary and meta of ``cfg``'s run) equals the one committed under ``name`` in ``golden_file``."""
    golden = json.loads(golden_file.read_text())
    assert name in golden, f"{name} has no committed summary: re-record"
    assert SimConfig.from_dict(golden[name]["config"]) == cfg, "the config changed: re-record"
    got = json.loads(json.dumps(got, default=str))
    assert got == {"summary": golden[name]["summary"], "meta": golden[name]["meta"]}


def main(record: Callable[[], None], doc: str | None) -> None:
    """A golden test run as a script: ``--record`` writes its summaries, anything else prints what it is."""
    if "--record" in sys.argv:
        record()
    else:
        print(doc)
