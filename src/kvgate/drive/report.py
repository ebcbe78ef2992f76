"""A driven run's ``run.json``: what it starts with, what it ends with (the summary, in the simulator's terms), and
the summary as ``kvgate drive`` prints it."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvgate.drive.tally import rounded
from kvgate.workload.trace import percentile

if TYPE_CHECKING:
    from kvgate.drive.client import ServerInfo
    from kvgate.drive.config import DriveConfig
    from kvgate.drive.gateway_log import GatewayLog
    from kvgate.drive.tally import Tally
    from kvgate.workload.session import Sessions


@dataclass
class DriveResult:
    out: Path
    meta: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    interrupted: bool = False

    @property
    def summary(self) -> dict[str, Any]:
        return self.meta["summary"]


def start_meta(
    cfg: DriveConfig, workload: str, endpoint: str, info: ServerInfo, started: str, model: str | None
) -> dict[str, Any]:
    """What ``run.json`` holds from the start: the config, the workload's name and what the probe found."""
    from kvgate import __version__

    return {
        "kvgate_version": __version__,
        "kind": "drive",
        "config": asdict(cfg),
        "seed": cfg.seed,
        "workload": workload,
        "started_at": started,
        "server": {
            "endpoint": endpoint,
            "kind": info.kind,
            "models": list(info.models),
            "model": model,
            "cache_report": info.cache_report,
            "via_gateway": info.gateway is not None,
            "pool": info.engine.record(),
        },
        "kv_pool": info.kv_pool,
        "block_size": info.block_size,
    }


def final_meta(
    meta: dict[str, Any],
    tables: dict[str, Any],
    *,
    tally: Tally,
    sessions: Sessions,
    gw: GatewayLog | None,
    stopped: float,
    interrupted: bool,
    time_scale: float,
) -> dict[str, Any]:
    """``meta`` (the run's ``run.json`` so far) completed with the gateway's side and the summary.

    The summary of an interrupted run covers the time it actually ran; through a gateway it has the gateway's
    control, start and parks, as the simulator's summary of a run with that control."""
    from kvgate.analysis.summary import summarize_tables

    smeta = meta
    if interrupted:
        smeta = dict(meta, config=dict(meta["config"], minutes=stopped / 60.0))
    if gw is not None:
        meta["gateway"] = gw.record()
        meta["parks"] = gw.turns_parked
        control, control_at = gw.control()
        meta["gateway"]["summary_control"] = {"control": control, "control_at": control_at}
        smeta = dict(smeta, parks=meta["parks"], config=dict(smeta["config"], control=control,
                                                             control_at=control_at))
    summary = summarize_tables(smeta, tables)
    lags = [x / time_scale * 1000.0 for x in tables["turns"].column("lag_s").to_pylist()]
    summary.update(
        turns_error=tally.turns_error,
        turns_aborted=tally.turns_aborted,
        client_timeouts=sessions.timeouts,
        client_retries=sessions.retries_sent,
        sessions_abandoned=sessions.abandoned,
        lag_p50_ms=rounded(percentile(lags, 50), 3),
        lag_p99_ms=rounded(percentile(lags, 99), 3),
        lag_max_ms=rounded(max(lags), 3) if lags else None,
        wall_s=meta["wall_s"],
        interrupted=interrupted,
    )
    meta["summary"] = summary
    return meta


def format_summary(s: dict[str, Any], out: Path) -> str:
    deg = f"yes, from minute {s['degraded_from_min']}" if s["persistently_degraded"] else "no"
    rows = [
        ("hit ratio, last 10 min", s["hit_ratio_last10"]),
        ("hit ratio, all turns", s["hit_ratio_all"]),
        ("sessions in system, last 5 min", s["sessions_in_system_last5"]),
        ("turns/s, last 10 min", s["turns_per_s_last10"]),
        ("persistently degraded", deg),
        ("control / parks", f"{s.get('control')} / {s.get('parks')}"),
        ("gateway wait p90, first turns (min)", s.get("gateway_wait_p90_min")),
        ("sessions arrived / finished", f"{s['sessions_arrived']} / {s['sessions_finished']}"),
        ("turns ok / error / aborted", f"{s['turns_done']} / {s['turns_error']} / {s['turns_aborted']}"),
        ("schedule lag p50 / p99 (real ms)", f"{s['lag_p50_ms']} / {s['lag_p99_ms']}"),
        ("wall time (s)", s["wall_s"]),
    ]
    w = max(len(k) for k, _ in rows)
    lines = [f"{k:<{w}}  {v}" for k, v in rows]
    lines.append(f"records: {out}")
    return "\n".join(lines)
