"""The held-out protocol of ``kvgate real-vllm heldout --cells FILE``: the cells come from a committed file, and
the cells, the profile and kvgate's source are frozen when the first run begins.

A cells file is a JSON list of ``{"lam", "kv_pool", "shape", "trigger", "seed"}`` (``trigger``: ``"none"`` or the
``--burst`` form ``X@S+D``). Every run must see :data:`AFTER_BURST_MIN` minutes after its last burst ends, so a run
is not cut as its burst ends (the minutes that hold the large errors stay observed). When the first run of an
output directory begins, ``protocol.json`` records the SHA-256 of the cells file and of the profile, the kvgate
commit and the minutes; a later invocation on that directory with any of them changed is refused: no model
change once the runs begin.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import time
from pathlib import Path
from typing import Any

from kvgate.errors import UsageError

AFTER_BURST_MIN = 3.0
"""Minutes every run must see after its last burst ends."""
CELL_KEYS = ("lam", "kv_pool", "shape", "trigger", "seed")

RETIRED_HISTORY = (
    "The table before this protocol ran the 16 cells of the fixed 2 × 2 × 2 × 2 matrix (λ 0.06, 0.1 × pool 96K, 144K "
    "× agent, long-output × no trigger, 2.5@1+2; seeds 11–26). They were scored first on 4-minute runs (E2E 5.2%, "
    "TTFT 19.1%, 14–38% on the λ = 0.1 burst runs); then a request-time term was added to the profile and the runs "
    "were cut from 4 to 3 minutes, so each burst run ended as its burst ended (E2E 4.0%, TTFT 9.8%); with the new "
    "term, 4-minute runs were 26–51% off on those burst cells, and the simulator was early on TTFT in 13 of 16 runs. "
    "No constant was fitted on those runs, but the same cells were scored before and after a model change and the "
    "window was chosen after: that table is not held out, and its cells are retired (none is a cell here)."
)

MODEL_HISTORY = (
    "The cells file was committed (640ef58) before any of its runs and before the model's last change: the mixed "
    "step's penalty scaled by the step's prefill share, with its exponent fitted jointly with its factor on the "
    "calibration's own runs (a712424, docs/calibration.md). Nothing in the engine model changed after that commit "
    "and before or during these runs; the profile was fitted by `kvgate calibrate --endpoint` in the same window, "
    "before the first run, and its hash recorded then."
)


def sha256_file(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def profile_hash(profile: str) -> str:
    """SHA-256 of the profile file, or of a named profile's constants as a profile file would hold them."""
    p = Path(profile)
    if profile.endswith(".json") or "/" in profile:
        return sha256_file(p)
    from kvgate.engine.costmodel import profile as get_profile
    from kvgate.engine.costmodel import profile_to_dict

    text = json.dumps(profile_to_dict(get_profile(profile)), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _commit() -> str:
    src = Path(__file__).resolve().parents[3]
    try:
        head = subprocess.run(["git", "-C", str(src), "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(["git", "-C", str(src), "status", "--porcelain", "--", "src"], capture_output=True,
                               text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if head.returncode != 0:
        return "unknown"
    return head.stdout.strip() + ("+modified" if dirty.stdout.strip() else "")


def freeze(out: Path, cells_file: Path, profile: str, minutes: float) -> dict[str, Any]:
    """``out/protocol.json``: written when the first run begins, checked on every later invocation."""
    want = {"cells_file": cells_file.name, "cells_sha256": sha256_file(cells_file),
            "profile_sha256": profile_hash(profile), "minutes": minutes}
    path = out / "protocol.json"
    if path.exists():
        have = json.loads(path.read_text("utf-8"))
        changed = [k for k in ("cells_sha256", "profile_sha256", "minutes") if have.get(k) != want[k]]
        if changed:
            raise UsageError(f"{out}: its held-out runs began under another protocol ({', '.join(changed)} changed "
                             f"since {have.get('started')}); it is fixed once they begin: use a new --out")
        return have
    rec = {**want, "kvgate_commit": _commit(), "started": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())}
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rec, indent=1) + "\n", "utf-8")
    return rec
