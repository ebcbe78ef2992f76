"""The gateway's live page: ``GET /dashboard`` (one self-contained HTML page, no build step, nothing fetched from
elsewhere) polling ``GET /kvgate/dashboard.json`` every second. Both answer as the admin endpoints do (loopback
clients, or ``--admin-token`` given as a header or as ``?token=`` on the page's address, which the page passes on).

What it shows is what identifies the paper's degraded regime: the agent prefix hit ratio (1- and 5-minute
windows), resident demand against the pool (D / C), sessions in the system, admitted and parked beside N*, park
waits, and the regime alarm; with a strip chart of the hit ratio and D / C over the last polls; in a fleet, a row
per replica (up, C_r, D_r, sessions, turns in flight); with tenancy, a row per tenant (:func:`tenant_rows`: the
top :data:`TOP_TENANTS` by admitted tokens, the rest summed under ``other``); with ``--store redis://``, the shared
books: the store up or down, the live instances and this instance's id, whether it admits on its local share, and
a row per replica of the shared budget (C_r, D_r, admitted, held), beside the ``kvgate_shared_*`` metrics.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from typing import Any

from kvgate.gateway.tenants import OTHER, POLICY_FIELDS, PolicyStats, TenantBook

TOP_TENANTS = 8
"""Tenants the dashboard shows rows of; the others are summed in one row, ``other``."""
_SUMMED = ("turns", "tokens", "held", "held_s", "over_quota", "prompt_c", "cached", "prompt_c_5m", "cached_5m")


def quantile(bounds: Sequence[float], counts: Sequence[int], q: float) -> float | None:
    """The upper bound of the histogram bucket holding quantile ``q`` (None: no observations; inf: overflow)."""
    total = sum(counts)
    if total == 0:
        return None
    want = q * total
    acc = 0
    for bound, n in zip((*bounds, math.inf), counts, strict=True):
        acc += n
        if acc >= want:
            return bound
    return math.inf


def park_waits(bounds: Sequence[float], counts: Sequence[int], total_s: float) -> dict[str, Any]:
    n = sum(counts)
    p50, p90 = quantile(bounds, counts, 0.5), quantile(bounds, counts, 0.9)
    return {
        "count": n,
        "mean_s": total_s / n if n else None,
        "p50_le_s": None if p50 is None or math.isinf(p50) else p50,
        "p90_le_s": None if p90 is None or math.isinf(p90) else p90,
    }


def tenant_rows(
    book: TenantBook, stats: Iterable[PolicyStats], now: float, top: int = TOP_TENANTS
) -> list[dict[str, Any]]:
    """The dashboard's tenant table: the ``top`` tenants by admitted tokens (then sessions, then name), then one row
    ``other`` summing every other tenant (and the book's own ``other``), present only if it holds any. Per row:
    sessions in the system, parked, waiting, D_t, admitted tokens and turns, hit ratio (5 minutes and since start),
    turns held and their mean wait, turns refused over quota, quota used in the current window and the budget
    (None: no quota). Every number of ``other`` is the sum of those it folds, the hit ratios recomputed from the
    summed tokens: the rows add up to the totals over all tenants. O(tenants)."""
    policy = book.policy_rows(stats, now)
    merged: dict[str, dict[str, float]] = {}
    for name in {*book.rows, *policy}:
        row = dict.fromkeys((*POLICY_FIELDS, *_SUMMED), 0.0)
        row.update(policy.get(name, {}))
        r = book.rows.get(name)
        if r is not None:
            _, _, pc5, c5 = r.recent.totals(now, 300.0)
            row.update(turns=r.turns, tokens=r.tokens, held=r.held, held_s=r.held_s, over_quota=r.over_quota,
                       prompt_c=r.prompt_c, cached=r.cached, prompt_c_5m=pc5, cached_5m=c5)
        merged[name] = row
    ranked = sorted((n for n in merged if n != OTHER), key=lambda n: (-merged[n]["tokens"], -merged[n]["sessions"], n))
    rest = [merged[n] for n in ranked[top:]] + ([merged[OTHER]] if OTHER in merged else [])
    out = [_shown(n, merged[n]) for n in ranked[:top]]
    if rest:
        out.append(_shown(OTHER, {k: sum(r[k] for r in rest) for k in rest[0]}))
    return out


def _shown(name: str, r: dict[str, float]) -> dict[str, Any]:
    return {
        "tenant": name, "sessions": int(r["sessions"]), "parked": int(r["parked"]), "waiting": int(r["waiting"]),
        "demand_tokens": int(r["demand"]), "admitted_tokens": int(r["tokens"]), "turns": int(r["turns"]),
        "hit_ratio_5m": round(r["cached_5m"] / r["prompt_c_5m"], 6) if r["prompt_c_5m"] else None,
        "hit_ratio": round(r["cached"] / r["prompt_c"], 6) if r["prompt_c"] else None,
        "agent_prompt_tokens": int(r["prompt_c"]), "cached_tokens": int(r["cached"]),
        "held": int(r["held"]), "held_s": round(r["held_s"], 3),
        "held_mean_s": round(r["held_s"] / r["held"], 3) if r["held"] else None,
        "over_quota": int(r["over_quota"]), "quota_used": int(r["used"]),
        "quota": int(r["quota"]) if r["limited"] else None,
    }


PAGE = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>kvgate gateway</title>
<meta name="viewport" content="width=device-width, initial-scale=1">
<style>
body{font:14px/1.4 system-ui,sans-serif;margin:16px;background:#fafafa;color:#222}
h1{font-size:18px;margin:0 0 4px} .sub{color:#666;margin-bottom:12px}
.grid{display:grid;grid-template-columns:repeat(auto-fill,minmax(170px,1fr));gap:10px}
.card{background:#fff;border:1px solid #ddd;border-radius:6px;padding:10px}
.card .k{color:#666;font-size:12px} .card .v{font-size:24px;font-variant-numeric:tabular-nums}
#alarmcard.on{background:#fde2e2;border-color:#d33} #alarmcard.off{background:#e6f4ea;border-color:#3a3}
canvas{background:#fff;border:1px solid #ddd;border-radius:6px;margin-top:12px;width:100%;height:180px}
.err{color:#b00} table{border-collapse:collapse;margin-top:12px} td{padding:2px 10px 2px 0}
</style></head><body>
<h1>kvgate gateway</h1>
<div class="sub"><span id="control">-</span> &middot; upstream <span id="upstream">-</span> &middot;
 gateway time <span id="now">-</span> s &middot; update <span id="polls">0</span>
 <span id="error" class="err"></span></div>
<div class="grid">
<div class="card" id="alarmcard"><div class="k">regime alarm</div><div class="v" id="alarm">-</div></div>
<div class="card"><div class="k">hit ratio, 5 min</div><div class="v" id="hit5">-</div></div>
<div class="card"><div class="k">hit ratio, 1 min</div><div class="v" id="hit1">-</div></div>
<div class="card"><div class="k">D / C</div><div class="v" id="dc">-</div></div>
<div class="card"><div class="k">sessions in system / N*</div><div class="v"><span id="in_system">-</span> /
 <span id="n_star">-</span></div></div>
<div class="card"><div class="k">admitted</div><div class="v" id="admitted">-</div></div>
<div class="card"><div class="k">parked</div><div class="v" id="parked">-</div></div>
<div class="card"><div class="k">waiting</div><div class="v" id="waiting">-</div></div>
<div class="card"><div class="k">park waits (p90 &le;)</div><div class="v"><span id="park_count">-</span>
 (<span id="park_p90">-</span> s)</div></div>
<div class="card"><div class="k">turns finished</div><div class="v" id="finished">-</div></div>
</div>
<canvas id="chart" width="900" height="180"></canvas>
<div class="sub">green: hit ratio (5 min) &middot; blue: D / C (1 = the pool) &middot; red band: alarm</div>
<table><tr><td>D (tokens)</td><td id="demand">-</td><td>C (tokens)</td><td id="capacity">-</td></tr>
<tr><td>running</td><td id="running">-</td><td>thinking</td><td id="thinking">-</td></tr>
<tr><td>parks</td><td id="parks">-</td><td>readmissions</td><td id="readmissions">-</td></tr>
<tr><td>retried turns replaced</td><td id="replaced">-</td><td>upstream errors</td><td id="upstream_errors">-</td></tr>
</table>
<div class="sub" id="shared"></div>
<table id="shared_replicas"></table>
<table id="replicas"></table>
<table id="tenants"></table>
<script>
"use strict";
const token = new URLSearchParams(location.search).get("token");
const hist = [];
let polls = 0;
const $ = id => document.getElementById(id);
const fmt = (x, d) => (x === null || x === undefined) ? "-" : (typeof x === "number" ? x.toFixed(d) : String(x));
function draw() {
  const c = $("chart"), g = c.getContext("2d"), w = c.width, h = c.height;
  g.clearRect(0, 0, w, h);
  if (hist.length < 2) return;
  const n = hist.length, x = i => i * (w - 1) / Math.max(n - 1, 1), y = v => h - 4 - Math.min(v, 1.5) / 1.5 * (h - 8);
  g.fillStyle = "rgba(220,50,50,0.15)";
  hist.forEach((p, i) => { if (p.alarm) g.fillRect(x(i) - w / (2 * n), 0, w / n + 1, h); });
  g.strokeStyle = "#ccc"; g.beginPath(); g.moveTo(0, y(1)); g.lineTo(w, y(1)); g.stroke();
  for (const [key, color] of [["hit", "#2a2"], ["dc", "#26c"]]) {
    g.strokeStyle = color; g.lineWidth = 2; g.beginPath();
    hist.forEach((p, i) => {
      const v = p[key] === null ? 0 : p[key];
      i ? g.lineTo(x(i), y(v)) : g.moveTo(x(i), y(v));
    });
    g.stroke();
  }
}
async function poll() {
  try {
    const headers = token ? {"X-Admin-Token": token} : {};
    const r = await fetch("/kvgate/dashboard.json", {headers: headers, cache: "no-store"});
    if (!r.ok) throw new Error("HTTP " + r.status);
    const d = await r.json(), s = d.sessions;
    polls += 1;
    $("polls").textContent = polls; $("error").textContent = "";
    $("control").textContent = d.control; $("upstream").textContent = d.upstream;
    $("now").textContent = fmt(d.now_s, 0);
    $("alarm").textContent = s.regime_alarm ? "ON" : "off";
    $("alarmcard").className = "card " + (s.regime_alarm ? "on" : "off");
    $("hit5").textContent = fmt(s.hit_ratio_5m, 3); $("hit1").textContent = fmt(s.hit_ratio_1m, 3);
    $("dc").textContent = fmt(s.demand_ratio, 3);
    for (const k of ["in_system", "admitted", "parked", "waiting", "running", "thinking"]) $(k).textContent = s[k];
    $("n_star").textContent = fmt(s.n_star, 1);
    $("demand").textContent = s.demand_tokens; $("capacity").textContent = s.kv_pool;
    $("park_count").textContent = d.park_waits.count; $("park_p90").textContent = fmt(d.park_waits.p90_le_s, 1);
    $("finished").textContent = d.turns.finished || 0;
    $("parks").textContent = d.parks; $("readmissions").textContent = d.readmissions;
    $("replaced").textContent = d.replaced_attempts; $("upstream_errors").textContent = d.upstream_errors;
    const reps = d.replicas || [];  // a fleet: one row per replica
    $("replicas").innerHTML = reps.length < 2 ? "" :
      "<tr><td>replica</td><td>up</td><td>C_r</td><td>D_r</td><td>admitted</td><td>parked</td><td>in flight</td></tr>" +
      reps.map(r => "<tr>" + [r.replica, r.up ? "up" : "DOWN", r.kv_pool, r.demand_tokens, r.admitted, r.parked,
        r.in_flight].map(v => "<td>" + String(v).replace(/</g, "&lt;") + "</td>").join("") + "</tr>").join("");
    const sh = d.shared;  // --store redis://: the instances sharing the books, and the store
    const esc = v => String(v).replace(/</g, "&lt;");
    $("shared").innerHTML = !sh || !sh.owner ? "" :
      "shared store <b id='store_up'>" + (sh.store_up ? "up" : "DOWN") +
      "</b> &middot; instances <b id='instances'>" + sh.instances +
      "</b> &middot; this instance <b id='owner'>" + esc(sh.owner) + "</b>" +
      (sh.local_share ? " &middot; <b>local share</b> " + sh.local_share_tokens + " tokens" : "") +
      " &middot; shared D " + sh.demand_tokens + " / " + sh.kv_pool + ", held " + sh.held;
    const srep = sh && sh.replicas ? Object.entries(sh.replicas) : [];
    $("shared_replicas").innerHTML = srep.length < 2 ? "" :
      "<tr><td>replica (shared budget)</td><td>up</td><td>C_r</td><td>D_r</td><td>admitted</td><td>held</td></tr>" +
      srep.map(([u, r]) => "<tr>" + [u, r.up ? "up" : "DOWN", r.kv_pool, r.demand_tokens, r.admitted, r.held]
        .map(v => "<td>" + esc(v) + "</td>").join("") + "</tr>").join("");
    const ten = d.tenants || [];  // with tenancy: the top tenants, then "other"
    $("tenants").innerHTML = !ten.length ? "" :
      "<tr><td>tenant</td><td>sessions</td><td>parked</td><td>waiting</td><td>D_t</td><td>admitted tokens</td>" +
      "<td>hit 5 min</td><td>hit</td><td>held turns</td><td>mean wait s</td><td>over quota</td>" +
      "<td>quota used</td></tr>" +
      ten.map(t => "<tr>" + [t.tenant, t.sessions, t.parked, t.waiting, t.demand_tokens, t.admitted_tokens,
        fmt(t.hit_ratio_5m, 3), fmt(t.hit_ratio, 3), t.held, fmt(t.held_mean_s, 1), t.over_quota,
        t.quota === null ? "-" : t.quota_used + " / " + t.quota]
        .map(v => "<td>" + String(v).replace(/</g, "&lt;") + "</td>").join("") + "</tr>").join("");
    hist.push({hit: s.hit_ratio_5m, dc: s.demand_ratio, alarm: s.regime_alarm});
    if (hist.length > 600) hist.shift();
    draw();
  } catch (e) {
    $("error").textContent = "(" + e.message + ")";
  }
}
poll();
setInterval(poll, 1000);
</script></body></html>
"""
