"""``kvgate epp``'s bad input (one line, exit 2) and the Envoy bootstrap it writes, without Envoy."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("grpc", reason="the epp extra is not installed (pip install 'kvgate[epp]')")
pytest.importorskip("envoy.service.ext_proc.v3.external_processor_pb2", reason="the epp extra is not installed")

from kvgate.epp.envoy import MESSAGE_TIMEOUT_S, bootstrap  # noqa: E402 (after the skips: the picker imports grpc)
from kvgate.epp.picker import MAX_MESSAGE_TIMEOUT_S, extend_s  # noqa: E402
from kvgate.gateway.config import GatewayConfig  # noqa: E402
from support.aio import timed  # noqa: E402


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


@timed(30)
async def test_a_duplex_body_that_ends_with_trailers_is_decided_at_the_trailers() -> None:
    """Full duplex: a body whose last message is not end_of_stream ends with the trailers; the pick is answered
    then (headers, body), before the trailers' own answer, and not before."""
    from envoy.config.core.v3 import base_pb2
    from envoy.service.ext_proc.v3 import external_processor_pb2 as pb

    from kvgate.epp.exchange import DESTINATION_HEADER, Pick
    from kvgate.epp.server import FULL_DUPLEX, Stream

    class FakePicker:
        fleet: Any = None
        extend_s = 10
        streams = 0
        drops_authorization = False
        turns = 0

        def served(self, ex: Any) -> None: ...

        def info(self) -> dict[str, Any]:
            return {}

        async def turn(self, request: Any, api: Any) -> Any:
            self.turns += 1
            request.exchange.picked.set_result(Pick("127.0.0.1:9", [], [], None))
            return await request.exchange.answered

    picker = FakePicker()
    st = Stream(picker)
    hdrs = base_pb2.HeaderMap(headers=[base_pb2.HeaderValue(key=":method", raw_value=b"POST"),
                                       base_pb2.HeaderValue(key=":path", raw_value=b"/v1/chat/completions")])
    msgs = [
        pb.ProcessingRequest(request_headers=pb.HttpHeaders(headers=hdrs, end_of_stream=False),
                             protocol_config=pb.ProtocolConfiguration(request_body_mode=FULL_DUPLEX)),
        pb.ProcessingRequest(request_body=pb.HttpBody(body=b'{"messages": []}', end_of_stream=False)),
    ]
    early = [out for m in msgs async for out in st.step(m)]
    assert early == [] and picker.turns == 0  # (nothing answered before the body has ended)
    got = [out async for out in st.step(pb.ProcessingRequest(request_trailers=pb.HttpTrailers()))]
    assert [o.WhichOneof("response") for o in got] == ["request_headers", "request_body", "request_trailers"]
    sets = {h.header.key: h.header.raw_value for h in got[0].request_headers.response.header_mutation.set_headers}
    assert sets[DESTINATION_HEADER] == b"127.0.0.1:9" and picker.turns == 1
    st.close()


def test_the_picker_takes_the_gateways_client_keys_admin_rules_and_tenants(tmp_path: Path) -> None:
    """``kvgate epp`` has every option of ``kvgate gateway`` and builds its config the same way."""
    from kvgate.epp.command import command
    from kvgate.gateway.command import config_from

    keys = tmp_path / "keys"
    keys.write_text("k1\n# a comment\nk2\n")
    ctx = command.make_context("epp", [
        "--upstream", "http://127.0.0.1:1", "--api-key", "k0", "--api-key-file", str(keys), "--admin-token", "t",
        "--allowed-host", "gw.local", "--tenant-weight", "k0=3", "--tenant-quota", "k1=5000/1m", "--hold", "never"])
    cfg = config_from(ctx.params)
    assert cfg.api_keys == ("k0", "k1", "k2") and cfg.admin_token == "t" and cfg.allowed_hosts == ("gw.local",)
    assert cfg.tenant_weights == "k0=3" and cfg.quota_window_s == 60.0
    assert cfg.tenancy() is not None  # (the fair policy, as the gateway's with tenant options)
