"""The shipped Prometheus rules (docs/prometheus/kvgate-rules.yml), tested with the real promtool and server.

* `promtool check rules` accepts them;
* `promtool test rules` on series a kvgate gateway exported in a driven run (tests/data/gateway-series.json,
  recorded by tests/support/prom_series.py: collapse, budgeter at minute 22, engine killed at minute 44): each alert is
  expected firing at the first minute the recorded series satisfy its condition for its whole `for` duration
  (computed here from the series, independently of promtool) and not firing before;
* a real Prometheus server scrapes a running gateway for about a minute and its query API shows the regime alarm.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parents[2]
RULES = ROOT / "docs" / "prometheus" / "kvgate-rules.yml"
SERIES = Path(__file__).resolve().parents[1] / "data" / "gateway-series.json"
LABELS = {"instance": "gateway:8000", "job": "kvgate"}

promtool = shutil.which("promtool")
prometheus = shutil.which("prometheus")
needs_promtool = pytest.mark.skipif(promtool is None, reason="promtool not installed (apt-get install prometheus)")


def _series() -> tuple[list[int], dict[tuple[str, tuple[tuple[str, str], ...]], list[float]]]:
    data = json.loads(SERIES.read_text())
    minutes = [s["minute"] for s in data["scrapes"]]
    assert minutes == list(range(len(minutes))), "one scrape per gateway minute from 0"
    out: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = {}
    for i, sc in enumerate(data["scrapes"]):
        for name, labels, value in sc["samples"]:
            key = (name, tuple(sorted(labels.items())))
            out.setdefault(key, [float("nan")] * len(minutes))[i] = value
    return minutes, out


def _get(series: dict, name: str, **labels: str) -> list[float]:
    return series[(name, tuple(sorted(labels.items())))]


def _first_sustained(cond: list[bool], for_min: int) -> int | None:
    """First minute m with cond true at every minute from m - for_min to m (Prometheus `for` at 1m steps)."""
    run = 0
    for m, c in enumerate(cond):
        run = run + 1 if c else 0
        if run > for_min:
            return m
    return None


def _expected(series: dict, n: int) -> dict[str, int]:
    alarm = [v == 1 for v in _get(series, "kvgate_regime_alarm")]
    ratio = [v > 0.95 for v in _get(series, "kvgate_demand_ratio")]
    parked = _get(series, "kvgate_sessions_parked")
    # max_over_time(...[5m]) > 0, read with a left-open window (the stricter reading): minutes m-4..m
    park_any = [max(parked[max(0, m - 4) : m + 1]) > 0 for m in range(n)]
    req = _get(series, "kvgate_requests_total")
    errs = [sum(_get(series, "kvgate_upstream_errors_total", kind=k)[m] for k in ("connect", "disconnect", "timeout",
            "http_5xx")) for m in range(n)]
    # far above the 5% threshold over the last 5 minutes (the test's reading must not hinge on rate extrapolation)
    err_high = [m >= 5 and (errs[m] - errs[m - 5]) > 0.5 * max(req[m] - req[m - 5], 1.0) for m in range(n)]
    out = {}
    for name, cond, for_min in (("KvgateDegradedRegime", alarm, 2), ("KvgateDemandAboveHighWater", ratio, 5),
                                ("KvgateSustainedParking", park_any, 15), ("KvgateUpstreamErrors", err_high, 5)):
        m = _first_sustained(cond, for_min)
        assert m is not None, f"the recorded run never meets {name}'s condition: re-record tests/data"
        out[name] = m
    return out


def _annotations(alert: str) -> dict[str, str]:
    """The alert's annotations as Prometheus renders them for LABELS (they template only the instance)."""
    import yaml

    for group in yaml.safe_load(RULES.read_text())["groups"]:
        for rule in group["rules"]:
            if rule.get("alert") == alert:
                return {k: v.replace("{{ $labels.instance }}", LABELS["instance"]).strip()
                        for k, v in rule.get("annotations", {}).items()}
    raise KeyError(alert)


SEVERITY = {"KvgateDegradedRegime": "page"}


def _test_file(tmp: Path) -> tuple[Path, dict[str, int]]:
    minutes, series = _series()
    n = len(minutes)
    exp = _expected(series, n)
    inputs = []
    for (name, labels), vals in sorted(series.items()):
        lab = dict(labels, **LABELS)
        sel = ",".join(f'{k}="{v}"' for k, v in sorted(lab.items()))
        vals_txt = " ".join("_" if v != v else ("NaN" if v != v else repr(v)) for v in vals)
        inputs.append({"series": f"{name}{{{sel}}}", "values": vals_txt})
    alert_tests: list[dict[str, Any]] = []
    for name, m in exp.items():
        labels = dict(LABELS, severity=SEVERITY.get(name, "warning"))
        alert_tests.append({"eval_time": f"{m}m", "alertname": name,
                            "exp_alerts": [{"exp_labels": labels, "exp_annotations": _annotations(name)}]})
        alert_tests.append({"eval_time": "5m", "alertname": name, "exp_alerts": []})
    # the regime alarm is only pending one minute before it fires
    m = exp["KvgateDegradedRegime"]
    alert_tests.append({"eval_time": f"{m - 1}m", "alertname": "KvgateDegradedRegime", "exp_alerts": []})
    promql = [{"expr": "kvgate:upstream_error_ratio:5m", "eval_time": "30m",
               "exp_samples": [{"labels": "kvgate:upstream_error_ratio:5m{" +
                                ",".join(f'{k}="{v}"' for k, v in sorted(LABELS.items())) + "}", "value": 0}]}]
    doc = {"rule_files": [str(RULES)], "evaluation_interval": "1m",
           "tests": [{"interval": "1m", "input_series": inputs, "alert_rule_test": alert_tests,
                      "promql_expr_test": promql}]}
    path = tmp / "kvgate-rules.test.yml"
    path.write_text(json.dumps(doc, indent=1))  # JSON is YAML
    return path, exp


@needs_promtool
def test_promtool_accepts_the_rules() -> None:
    r = subprocess.run([promtool, "check", "rules", str(RULES)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_rules_on_a_driven_runs_series(tmp_path: Path) -> None:
    path, exp = _test_file(tmp_path)
    # the recorded run reaches each alert in the order the run's phases imply
    assert exp["KvgateDemandAboveHighWater"] <= exp["KvgateDegradedRegime"] + 2
    assert exp["KvgateSustainedParking"] > 22  # the budgeter came on at minute 22
    assert exp["KvgateUpstreamErrors"] > 44  # the engine died at minute 44
    r = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, (r.stdout + r.stderr)[-4000:]


@needs_promtool
def test_a_wrong_expectation_fails_promtool(tmp_path: Path) -> None:
    path, exp = _test_file(tmp_path)
    doc = json.loads(path.read_text())
    for t in doc["tests"][0]["alert_rule_test"]:
        if t["alertname"] == "KvgateDegradedRegime" and t["exp_alerts"]:
            t["eval_time"] = f"{exp['KvgateDegradedRegime'] - 1}m"  # one minute early: still pending
    path.write_text(json.dumps(doc))
    r = subprocess.run([promtool, "test", "rules", str(path)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0


def _query(port: int, expr: str) -> list[dict[str, Any]]:
    url = f"http://127.0.0.1:{port}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return body["data"]["result"]


@pytest.mark.skipif(prometheus is None, reason="prometheus not installed (apt-get install prometheus)")
@pytest.mark.slow
def test_real_prometheus_scrapes_the_gateway_and_sees_the_alarm(tmp_path: Path) -> None:
    from support.ports import free_port
    from support.prom_series import start_stack

    scale = 30.0
    procs: list[subprocess.Popen[bytes]] = []
    pp = free_port()
    try:
        _, gp = start_stack(procs, scale)
        _watch(tmp_path, procs, gp, pp, scale)
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(timeout=20)
                except subprocess.TimeoutExpired:
                    p.kill()


def _watch(tmp_path: Path, procs: list[subprocess.Popen[bytes]], gp: int, pp: int, scale: float) -> None:
    from support.prom_series import drive

    cfg = tmp_path / "prometheus.yml"
    cfg.write_text(json.dumps({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(RULES)],
        "scrape_configs": [{"job_name": "kvgate", "static_configs": [{"targets": [f"127.0.0.1:{gp}"]}]}],
    }))
    procs.append(subprocess.Popen([prometheus, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                   f"--web.listen-address=127.0.0.1:{pp}"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL))
    drv = drive(procs, gp, scale, 40, tmp_path / "run")
    deadline = time.monotonic() + 150
    alarm_seen = False
    scraped = 0
    while time.monotonic() < deadline and drv.poll() is None:
        time.sleep(2)
        try:
            scraped = len(_query(pp, 'up{job="kvgate"} == 1'))
            alarm_seen = bool(_query(pp, 'max_over_time(kvgate_regime_alarm{job="kvgate"}[10m]) == 1'))
        except OSError:
            continue
        if alarm_seen:
            break
    assert scraped == 1, "Prometheus never scraped the gateway"
    assert alarm_seen, "the regime alarm never reached Prometheus"
    # the alert rule is evaluated on it: pending (its `for` is 2 minutes of Prometheus time) or firing
    states: set[str] = set()
    for _ in range(10):
        states = {a["metric"]["alertstate"] for a in _query(pp, 'ALERTS{alertname="KvgateDegradedRegime"}')}
        if states:
            break
        time.sleep(1)
    assert states & {"pending", "firing"}
