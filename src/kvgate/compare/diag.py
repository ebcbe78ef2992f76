"""Each system's own account of what it held: polled while a run goes, read from its logs after.

* vllm-router: ``GET /scheduling/diagnostics`` (per rank: ``router_queued_requests``, the requests its
  RequestPool retains; ``router_paused_acting_programs`` and ``router_paused_reasoning_programs``) polled during
  the run, and its INFO decision log (``event="program_admit"``, ``"program_pause"``, ``"force_resume"``, ...).
* Dynamo's ThunderAgent: the frontend's ``thunderagent`` DEBUG line on every scheduler change
  (``paused_programs``, ``waiting_requests``: requests it holds) and its WARN line on forced resumes.
* kvgate's gateway: the driver's records (``X-Kvgate-Hold`` on every held turn: ``gateway.turns_parked``).
* every ``kvgate engine`` replica: its prefix-cache counters (``vllm:prefix_cache_hits_total`` /
  ``queries_total``), so a fleet's replicas are judged one by one.
"""

from __future__ import annotations

import contextlib
import json
import re
from collections import Counter
from pathlib import Path
from typing import Any

from kvgate.compare.procs import get_text

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_EVENT = re.compile(r'event="([a-z_]+)"')
_REASON = re.compile(r'reason="([a-z_]+)"')
_KV = re.compile(r"(\w+)=([0-9.]+)")


def router_snapshot(url: str) -> dict[str, int] | None:
    """Summed over ranks: retained requests, paused and active programs, its token ledger and the engine's usage
    as it reads it, right now (None when it does not answer)."""
    try:
        status, body = get_text(url + "/scheduling/diagnostics", timeout=2.0)
        d = json.loads(body) if status == 200 else None
    except (OSError, ValueError):
        return None
    if type(d) is not dict:
        return None
    out = {"queued_requests": 0, "paused_programs": 0, "active_programs": 0, "used_tokens": 0, "engine_tokens": 0}
    for r in d.get("ranks") or []:
        out["used_tokens"] += int(r.get("router_estimated_used_tokens") or 0)  # its ledger
        out["engine_tokens"] += int(r.get("vllm_usage_scaled_tokens") or 0)  # the engine's KV usage, in tokens
        out["queued_requests"] += int(r.get("router_queued_requests") or 0)
        out["paused_programs"] += int(r.get("router_paused_acting_programs") or 0)
        out["paused_programs"] += int(r.get("router_paused_reasoning_programs") or 0)
        out["active_programs"] += int(r.get("router_active_programs") or 0)
    return out


def engine_counters(url: str) -> tuple[float, float] | None:
    """(prefix-cache hits, queries) of a vLLM-compatible engine, in tokens."""
    with contextlib.suppress(OSError, ValueError):
        status, text = get_text(url + "/metrics", timeout=2.0)
        if status != 200:
            return None
        hits = queries = 0.0
        for line in text.splitlines():
            if line.startswith("vllm:prefix_cache_hits_total"):
                hits += float(line.rsplit(" ", 1)[1])
            elif line.startswith("vllm:prefix_cache_queries_total"):
                queries += float(line.rsplit(" ", 1)[1])
        return hits, queries
    return None


def router_log_events(path: Path) -> dict[str, int]:
    """vllm-router's committed scheduling decisions, counted by event name (and ``event:reason``: a pause is
    ``ttl_expired`` when a program's acting TTL ran out between turns, ``capacity_repair`` under pressure)."""
    if not path.exists():
        return {}
    c: Counter[str] = Counter()
    with path.open(errors="replace") as f:
        for line in f:
            if "event" not in line:
                continue
            line = _ANSI.sub("", line)
            m = _EVENT.search(line)
            if m:
                c[m.group(1)] += 1
                why = _REASON.search(line)
                if why:
                    c[f"{m.group(1)}:{why.group(1)}"] += 1
                if "forced=true" in line:
                    c[f"{m.group(1)}:forced"] += 1
    return dict(c)


def thunderagent_log(path: Path) -> dict[str, int]:
    """ThunderAgent's own count: the most programs paused and requests held at once, state changes, forced
    resumes (from the frontend's log at ``thunderagent=debug``)."""
    out = {"enabled": 0, "max_paused_programs": 0, "max_waiting_requests": 0, "state_changes": 0,
           "forced_resumes": 0, "changes_with_paused": 0}
    if not path.exists():
        return out
    with path.open(errors="replace") as f:
        for line in f:
            if "thunderagent" not in line:
                continue
            line = _ANSI.sub("", line)
            kv = {k: float(v) for k, v in _KV.findall(line)}
            if "admission enabled" in line:
                out["enabled"] = 1
            elif "scheduler state changed" in line:
                out["state_changes"] += 1
                paused = int(kv.get("paused_programs", 0))
                out["changes_with_paused"] += paused > 0
                out["max_paused_programs"] = max(out["max_paused_programs"], paused)
                out["max_waiting_requests"] = max(out["max_waiting_requests"], int(kv.get("waiting_requests", 0)))
            elif "forced program resumes" in line:
                out["forced_resumes"] += int(kv.get("forced_resumes", 0))
    return out


def gateway_holds(run_meta: dict[str, Any]) -> dict[str, int]:
    gw = run_meta.get("gateway") or {}
    return {"turns_parked": int(gw.get("turns_parked") or 0), "turns_waited": int(gw.get("turns_waited") or 0)}
