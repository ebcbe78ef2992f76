"""The end of a driven run: its final ``run.json`` (with the summary, in the simulator's terms) and the summary as
``kvgate drive`` prints it."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvgate.drive.tally import percentile, rounded

if TYPE_CHECKING:
    from kvgate.drive.gateway_log import GatewayLog
    from kvgate.drive.tally import Tally


@dataclass
class DriveResult:
    out: Path
    meta: dict[str, Any]
    warnings: list[str] = field(default_factory=list)
    interrupted: bool = False

    @property
    def summary(self) -> dict[str, Any]:
        return self.meta["summary"]


def final_meta(
    meta: dict[str, Any],
    tables: dict[str, Any],
    *,
    tally: Tally,
    gw: GatewayLog | None,
    stopped: float,
    interrupted: bool,
    time_scale: float,
) -> dict[str, Any]:
    """``meta`` (the run's ``run.json`` so far) completed with the gateway's side and the summary.

    The summary of an interrupted run covers the time it actually ran; through a gateway it has the gateway's
    controller, start and parks, as the simulator's summary of a run with that controller."""
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
                                                             control_at=control_at))  # fmt: skip
    summary = summarize_tables(smeta, tables)
    lags = [x / time_scale * 1000.0 for x in tables["turns"].column("lag_s").to_pylist()]
    summary.update(
        tally.counts(),
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
