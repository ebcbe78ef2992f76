"""``kvgate epp``'s bad input (one line, exit 2) and the Envoy bootstrap it writes, without Envoy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kvgate.epp.envoy import MESSAGE_TIMEOUT_S, bootstrap
from kvgate.epp.picker import MAX_MESSAGE_TIMEOUT_S, extend_s
from kvgate.gateway.config import GatewayConfig

pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2", reason="the epp extra is not installed")


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "kvgate.cli", "epp", *args], capture_output=True, text=True,
                          timeout=60)


@pytest.mark.parametrize(("args", "says"), [
    (["--upstream", "http://engine.local:8000", "--kv-pool", "1000"], "needs an IP address"),
    (["--upstream", "http://127.0.0.1:8000", "--kv-pool", "1000", "--envoy-listen", "1"], "together"),
    (["--upstream", "http://127.0.0.1:8000", "--kv-pool", "1000", "--hold", "maybe"], "--hold"),
])
def test_bad_input_is_one_line_and_exit_2(args: list[str], says: str) -> None:
    got = run(*args)
    assert got.returncode == 2, got
    lines = got.stderr.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], got.stderr


def test_hold_bound_follows_max_park_and_envoys_cap() -> None:
    assert extend_s(GatewayConfig(upstream="http://127.0.0.1:1")) == MAX_MESSAGE_TIMEOUT_S
    assert extend_s(GatewayConfig(upstream="http://127.0.0.1:1", max_park_s=60.0)) == 70
    assert extend_s(GatewayConfig(upstream="http://127.0.0.1:1", max_park_s=300.0, time_scale=30.0)) == 20
    assert extend_s(GatewayConfig(upstream="http://127.0.0.1:1", max_park_s=1e6)) == MAX_MESSAGE_TIMEOUT_S


@pytest.mark.parametrize("body", ["buffered", "streamed"])
def test_bootstrap_routes_by_the_pickers_header_and_lets_it_hold(body: str) -> None:
    cfg = GatewayConfig(upstream="http://127.0.0.1:1", max_park_s=120.0)
    b = bootstrap(cfg, listen=10000, grpc_port=9002, extend_s=extend_s(cfg), body=body)
    res = b["static_resources"]
    assert res["listeners"][0]["address"]["socket_address"] == {"address": "127.0.0.1", "port_value": 10000}
    hcm = res["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    assert hcm["stream_idle_timeout"] == "0s"
    ext = hcm["http_filters"][0]["typed_config"]
    assert ext["message_timeout"] == f"{MESSAGE_TIMEOUT_S}s" and ext["max_message_timeout"] == "130s"
    assert ext["processing_mode"]["request_body_mode"] == ("BUFFERED" if body == "buffered" else "FULL_DUPLEX_STREAMED")
    assert hcm["http_filters"][-1]["name"] == "envoy.filters.http.router"
    route = hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]
    assert route["timeout"] == "0s"
    dst = {c["name"]: c for c in res["clusters"]}
    assert dst["kvgate_original_dst"]["original_dst_lb_config"] == {
        "use_http_header": True, "http_header_name": "x-gateway-destination-endpoint"}
    epp = dst["kvgate_epp"]["load_assignment"]["endpoints"][0]["lb_endpoints"][0]["endpoint"]["address"]
    assert epp["socket_address"]["port_value"] == 9002


def test_the_command_writes_the_bootstrap(tmp_path: Path) -> None:
    """Written before it serves: with an upstream that is not there, the start fails after the file is written."""
    f = tmp_path / "envoy.json"
    got = run("--upstream", "http://127.0.0.1:9", "--envoy-config", str(f), "--envoy-listen", "10001",
              "--health-interval", "0.1")
    assert got.returncode != 0
    assert '"port_value": 10001' in f.read_text()
