"""The real-vLLM experiment's page: ``index.md`` and figures from ``result.json``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


def write_page(res: dict[str, Any], out: Path) -> Path:
    path = out / "index.md"
    lines = ["# The phenomenon on a real vLLM (CPU build)", ""]
    for c in res["claims"]:
        lines.append(f"- [{c['verdict']}] {c['claim']}: {c['measured']}")
    path.write_text("\n".join(lines) + "\n" + "\n<!-- " + json.dumps(res["design"]) + " -->\n")
    return path
