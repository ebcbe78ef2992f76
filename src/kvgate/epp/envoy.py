"""The Envoy bootstrap ``kvgate epp --envoy-config FILE --envoy-listen PORT`` writes (JSON, which Envoy reads as
YAML): one command pair, ``kvgate epp ...`` and ``envoy -c FILE``, runs the stack on this host.

* A listener on 127.0.0.1:PORT whose HTTP connection manager runs the ext_proc filter, then the router.
* The ext_proc filter calls the picker (cluster ``kvgate_epp``, HTTP/2 to ``--grpc-port``); request headers and
  body (``BUFFERED``, or ``FULL_DUPLEX_STREAMED`` with ``--envoy-body streamed``) and response headers and body
  (``STREAMED``: SSE passes event by event). ``message_timeout`` is short (the picker answers a turn it does not
  hold at once); ``max_message_timeout`` lets the picker extend it while it holds a turn (``--max-park-s`` and a
  margin, at most 1 h, which Envoy caps; a longer hold is extended again). Failing closed: a picker that is
  down answers 500, never an unpicked request.
* The cluster ``kvgate_original_dst`` (``ORIGINAL_DST``) sends each request where the picker's
  ``x-gateway-destination-endpoint`` header says; the route has no overall timeout (a held turn's wait is not
  the engine's), an idle timeout of ``--upstream-timeout``, and reports the endpoint that served it in
  ``x-gateway-destination-endpoint-served``.
* The stream idle timeout is off (a held request sends nothing while it waits); the connection buffers allow
  bodies of ``--max-body-bytes``.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

from kvgate.epp.exchange import DESTINATION_HEADER, SERVED_HEADER
from kvgate.gateway.config import GatewayConfig

MESSAGE_TIMEOUT_S = 5
"""Envoy's wait for each ext_proc answer the picker does not extend (its default, 200 ms, answers 504 on a busy
host)."""
BODY_MODES = ("buffered", "streamed")
_T = "type.googleapis.com/envoy.extensions."


def _address(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def ext_proc_filter(grpc_cluster: str, extend_s: int, body: str = "buffered") -> dict[str, Any]:
    """The ext_proc HTTP filter calling the picker (its ``typed_config`` as Envoy's JSON)."""
    duplex = body == "streamed"
    mode = {"request_header_mode": "SEND", "response_header_mode": "SEND",
            "request_body_mode": "FULL_DUPLEX_STREAMED" if duplex else "BUFFERED",
            "response_body_mode": "FULL_DUPLEX_STREAMED" if duplex else "STREAMED",
            "request_trailer_mode": "SEND" if duplex else "SKIP",
            "response_trailer_mode": "SEND" if duplex else "SKIP"}
    return {
        "name": "envoy.filters.http.ext_proc",
        "typed_config": {
            "@type": _T + "filters.http.ext_proc.v3.ExternalProcessor",
            "grpc_service": {"envoy_grpc": {"cluster_name": grpc_cluster}},
            "processing_mode": mode,
            "message_timeout": f"{MESSAGE_TIMEOUT_S}s",
            "max_message_timeout": f"{max(extend_s, MESSAGE_TIMEOUT_S)}s",
            "failure_mode_allow": False,
            "allow_mode_override": True,
            "mutation_rules": {"allow_all_routing": True},
            "metadata_options": {"receiving_namespaces": {"untyped": ["envoy.lb"]}},
        },
    }


def bootstrap(cfg: GatewayConfig, *, listen: int, grpc_port: int, extend_s: int, body: str = "buffered",
              admin_port: int | None = None, host: str = "127.0.0.1") -> dict[str, Any]:
    """Envoy's bootstrap for the stack: a listener on ``host:listen`` in front of the picker on ``grpc_port``."""
    idle = f"{math.ceil(cfg.upstream_timeout_s)}s"
    buffer = cfg.max_body_bytes + (1 << 20)
    route = {"match": {"prefix": "/"},
             "route": {"cluster": "kvgate_original_dst", "timeout": "0s", "idle_timeout": idle},
             "response_headers_to_add": [{"header": {"key": SERVED_HEADER, "value": "%UPSTREAM_HOST%"},
                                          "append_action": "OVERWRITE_IF_EXISTS_OR_ADD"}]}
    hcm = {
        "@type": _T + "filters.network.http_connection_manager.v3.HttpConnectionManager",
        "stat_prefix": "kvgate",
        "stream_idle_timeout": "0s",
        "request_timeout": "0s",
        "route_config": {"name": "kvgate", "virtual_hosts": [{"name": "all", "domains": ["*"], "routes": [route]}]},
        "http_filters": [
            ext_proc_filter("kvgate_epp", extend_s, body),
            {"name": "envoy.filters.http.router", "typed_config": {"@type": _T + "filters.http.router.v3.Router"}},
        ],
    }
    h2 = {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
        "@type": _T + "upstreams.http.v3.HttpProtocolOptions", "explicit_http_config": {"http2_protocol_options": {}}}}
    clusters = [
        {"name": "kvgate_original_dst", "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED",
         "connect_timeout": "10s", "per_connection_buffer_limit_bytes": buffer,
         "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION_HEADER}},
        {"name": "kvgate_epp", "type": "STATIC", "connect_timeout": "5s", "typed_extension_protocol_options": h2,
         "load_assignment": {"cluster_name": "kvgate_epp", "endpoints": [{"lb_endpoints": [
             {"endpoint": {"address": _address(host, grpc_port)}}]}]}},
    ]
    out: dict[str, Any] = {
        "static_resources": {
            "listeners": [{"name": "kvgate", "address": _address(host, listen),
                           "per_connection_buffer_limit_bytes": buffer,
                           "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                           "typed_config": hcm}]}]}],
            "clusters": clusters,
        },
    }
    if admin_port is not None:
        out["admin"] = {"address": _address(host, admin_port)}
    return out


def write_bootstrap(path: Path, config: dict[str, Any]) -> None:
    path.write_text(json.dumps(config, indent=2) + "\n")


def round_robin_bootstrap(listen: int, upstreams: list[tuple[str, int]], *, max_body_bytes: int = 32 << 20,
                          admin_port: int | None = None, host: str = "127.0.0.1") -> dict[str, Any]:
    """Envoy alone in front of ``upstreams`` (``(IP, port)``): the same listener and route, no picker, one static
    cluster balanced round robin (the baseline of ``kvgate compare``'s Envoy stacks and of the cost benchmark)."""
    cfg = GatewayConfig(upstream=f"http://{upstreams[0][0]}:{upstreams[0][1]}", max_body_bytes=max_body_bytes)
    conf = bootstrap(cfg, listen=listen, grpc_port=1, extend_s=MESSAGE_TIMEOUT_S, admin_port=admin_port, host=host)
    res = conf["static_resources"]
    hcm = res["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]
    hcm["http_filters"] = hcm["http_filters"][1:]  # the router only
    hcm["route_config"]["virtual_hosts"][0]["routes"][0]["route"]["cluster"] = "engines"
    eps = [{"endpoint": {"address": _address(h, p)}} for h, p in upstreams]
    res["clusters"] = [{"name": "engines", "type": "STATIC", "lb_policy": "ROUND_ROBIN", "connect_timeout": "5s",
                        "per_connection_buffer_limit_bytes": max_body_bytes + (1 << 20),
                        "load_assignment": {"cluster_name": "engines", "endpoints": [{"lb_endpoints": eps}]}}]
    return conf


def find_envoy() -> str:
    """The envoy binary: ``$KVGATE_ENVOY_BIN``, the venv of ``.ci/install-envoy.sh`` (``$KVGATE_ENVOY_VENV``,
    default ~/.cache/kvgate/envoy-venv), or ``envoy`` on PATH; '' when none."""
    import os
    import shutil

    venv = Path(os.environ.get("KVGATE_ENVOY_VENV", "~/.cache/kvgate/envoy-venv")).expanduser()
    for cand in (os.environ.get("KVGATE_ENVOY_BIN"), str(venv / "bin" / "envoy"), shutil.which("envoy")):
        if cand and os.access(cand, os.X_OK):
            return cand
    return ""
