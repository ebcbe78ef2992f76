"""What the driver records when its endpoint is a kvgate gateway.

The gateway tells the client, on every turn's response, what it did (``X-Kvgate-Park-Wait``, ``X-Kvgate-Hold``,
``X-Kvgate-Control``; docs/gateway.md), and describes itself on ``GET /kvgate/info`` (control, C, counters,
sessions by state, its upstream's kind and pool). :class:`GatewayLog` folds both into the run's records:

* per turn: ``park_wait_s`` (converted to the driver's virtual seconds) and ``sent_s = driver send + park wait``
  (when the turn left the gateway, as the simulator's records mean it), so ``first_sent_s`` of a session and the
  summary's ``gateway_wait_p90_min`` are the gateway's waits;
* per run (``run.json``, key ``gateway``): the control and its switches as the turns saw them, the turns the
  gateway parked or made wait, and its counters' change over the run;
* for the summary: the control (``control``), the minute it started (``control_at``) and ``parks``, in the
  simulator's terms, so :func:`kvgate.analysis.summary.summarize_tables` reads a driven run through a gateway as it
  reads a simulated run with that control;
* per sample: the gateway's admitted, parked and waiting sessions and its D, polled from ``/kvgate/info``.

Gateway time and driver time: the gateway runs ``--time-scale`` gateway seconds per real second; its waits are
converted by ``driver scale / gateway scale``.
"""

from __future__ import annotations

import math
from typing import Any


class GatewayLog:
    """The gateway side of one driven run (pure bookkeeping; the driver does the requests)."""

    def __init__(self, start: dict[str, Any], driver_scale: float) -> None:
        self.start = start
        gw_scale = _num(start.get("time_scale")) or 1.0
        self.to_driver = driver_scale / gw_scale
        """Driver virtual seconds per gateway second."""
        self.scale_mismatch = not math.isclose(gw_scale, driver_scale, rel_tol=1e-9)
        self.turns_parked = 0
        self.turns_waited = 0
        self.turns_seen = 0
        self.controls: list[dict[str, Any]] = []
        """The control each time it changed, as released turns saw it: ``{"t_s", "spec"}``."""
        self.latest: dict[str, Any] = start
        """The newest ``/kvgate/info`` answer (samples read it)."""
        self.end: dict[str, Any] | None = None

    def wait_s(self, park_wait_gateway_s: float) -> float:
        return park_wait_gateway_s * self.to_driver

    def turn(self, released_s: float, hold: str | None, control: str | None) -> None:
        """A turn came back through the gateway, released from it at driver time ``released_s``."""
        self.turns_seen += 1
        if hold == "parked":
            self.turns_parked += 1
        elif hold == "waiting":
            self.turns_waited += 1
        if control and (not self.controls or self.controls[-1]["spec"] != control):
            self.controls.append({"t_s": round(released_s, 6), "spec": control})

    def sample(self) -> tuple[int, int, int, int]:
        """``(admitted, parked, gateway_waiting, admitted_demand_tokens)`` from the newest answer (-1: unknown)."""
        s = self.latest.get("sessions")
        if type(s) is not dict:
            return -1, -1, -1, -1
        return tuple(_int(s.get(k)) for k in ("admitted", "parked", "waiting", "demand_tokens"))  # type: ignore[return-value]

    def control(self) -> tuple[str, float | None]:
        """The run's control and the driver minute it started (None: from the start), for the summary.

        From the turns: a run that began under ``none`` and later saw another control had that control
        from the first turn it released. Else the gateway's own account at the start: a control scheduled
        with ``--control-at`` starts at that gateway time, converted to the driver's clock."""
        names = [c["spec"].split(":", 1)[0] for c in self.controls]
        later = [i for i, n in enumerate(names) if n != "none"]
        sched = self.start.get("scheduled")
        if type(sched) is dict and type(sched.get("control")) is str:
            at = _num(sched.get("at_s"))
            now = _num(self.start.get("now_s")) or 0.0
            if at is not None:
                return sched["control"], max(0.0, (at - now) * self.to_driver) / 60.0
        if names and names[0] == "none" and later:
            return names[later[0]], self.controls[later[0]]["t_s"] / 60.0
        if names:
            return names[-1], None
        name = self.start.get("control")
        return (name if type(name) is str else "none"), None

    def record(self) -> dict[str, Any]:
        """The ``gateway`` entry of ``run.json``."""
        start, end = self.start, self.end
        out: dict[str, Any] = {
            "version": start.get("version"),
            "control": start.get("control"),
            "spec": start.get("spec"),
            "scheduled": start.get("scheduled"),
            "kv_pool": start.get("kv_pool"),
            "kv_pool_source": start.get("kv_pool_source"),
            "time_scale": start.get("time_scale"),
            "now_s": start.get("now_s"),
            "upstream": start.get("upstream"),
            "turns_seen": self.turns_seen,
            "turns_parked": self.turns_parked,
            "turns_waited": self.turns_waited,
            "controls": list(self.controls),
        }
        for key in ("parks", "waits", "readmissions"):
            a, b = _num(start.get(key)), _num((end or {}).get(key))
            out[f"{key}_during_run"] = None if a is None or b is None else int(b - a)
        return out


def _num(v: Any) -> float | None:
    if type(v) in (int, float) and math.isfinite(v):
        return float(v)
    return None


def _int(v: Any) -> int:
    return int(v) if type(v) in (int, float) and math.isfinite(v) else -1
