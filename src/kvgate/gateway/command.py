"""``kvgate gateway``: the command (options, ``--config`` file, event loop), running a :class:`Gateway` until
SIGINT or SIGTERM."""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import click

from kvgate.errors import UsageError
from kvgate.fleet.routers import ROUTERS
from kvgate.gateway.app import Gateway
from kvgate.gateway.config import (
    GatewayConfig,
    KVEventsSource,
    load_config_file,
    parse_kv_events,
    parse_kv_pool,
    read_api_keys,
    read_upstreams,
)
from kvgate.gateway.identity import SOURCES, parse_session_from
from kvgate.gateway.logs import setup_logging
from kvgate.gateway.pool import PoolNotFound
from kvgate.gateway.tenants import TENANT_OPTIONS, tenant_fields
from kvgate.http.limits import ServerLimits
from kvgate.http.openai import SESSION_HEADER, one_line
from kvgate.http.signals import serve_until_signalled
from kvgate.options import BIND_ADDRESS, FINITE, PORT, control_options, url_host, with_options

log = logging.getLogger("kvgate.gateway")


async def serve(cfg: GatewayConfig, host: str, port: int, ready: Callable[[Gateway], None] | None = None) -> None:
    """Run a gateway until SIGINT or SIGTERM, then shut it down gracefully."""
    await serve_until_signalled(Gateway(cfg), host, port, ready)


CONFIG_PARAMS = {"upstreams": "upstreams_file", "api_key": "api_keys", "allowed_host": "allowed_hosts",
                 "loop": "loop_kind"}
"""The ``--config`` keys whose option's parameter has another name (else a file's ``api-key`` were ignored)."""


def _config_callback(ctx: click.Context, _param: click.Parameter, value: Path | None) -> Path | None:
    if value is not None:
        opts = load_config_file(value)
        if type(opts.get("upstream")) is str:  # (--upstream is repeatable: a list of one)
            opts["upstream"] = [opts["upstream"]]
        for key, name in CONFIG_PARAMS.items():  # (the options' parameter names)
            if key in opts:
                opts[name] = opts.pop(key)
        ctx.default_map = {**(ctx.default_map or {}), **opts}
    return value


def client_keys(given: tuple[str, ...], path: Path | None) -> tuple[str, ...]:
    """The client keys of ``--api-key`` (or KVGATE_API_KEYS) and ``--api-key-file``; an empty one is an error
    (``KVGATE_API_KEYS=""`` too): it would turn client auth off without a word."""
    env = os.environ.get("KVGATE_API_KEYS")
    if not given and env is not None and not env.split():
        raise UsageError("KVGATE_API_KEYS is set but empty; give keys or unset it")
    if any(not k.strip() for k in given):
        raise UsageError("--api-key: an empty key (e.g. --api-key \"$KEY\" with KEY unset) would let anyone in")
    return tuple(given) + (read_api_keys(path) if path is not None else ())


def install_loop(kind: str) -> str:
    """Pick the event loop: uvloop when asked (or available with 'auto'), else asyncio's."""
    if kind == "asyncio":
        return "asyncio"
    try:
        import uvloop  # type: ignore[import-not-found]
    except ImportError:
        if kind == "uvloop":
            raise UsageError("--loop uvloop: uvloop is not installed (pip install uvloop)") from None
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


_SECONDS = {"type": FINITE, "metavar": "S"}
"""A duration option (gateway or real seconds, as its help says)."""
_NUMBER = {"type": int, "show_default": True, "metavar": "N"}

_LIMITS = ServerLimits()
LIMIT_OPTIONS = [
    click.option("--max-body-nodes", default=_LIMITS.max_body_nodes, **_NUMBER, help="Request bodies with more "
                 "JSON objects and arrays (a scalar counts 1/8) get 413 (counted as they arrive; bounds the memory "
                 "and loop time of one)."),
    click.option("--max-inflight-body-bytes", default=_LIMITS.bodies_in_flight, **_NUMBER, help="Request body "
                 "bytes held at once across connections; a request past it gets 503 with Retry-After."),
    click.option("--max-answer-bytes", default=64 << 20, **_NUMBER, help="A non-stream upstream answer larger "
                 "than this gets 502 (streamed answers are relayed as they come)."),
    click.option("--head-timeout", default=_LIMITS.head_timeout_s, show_default=True, **_SECONDS, help="Real "
                 "seconds a request's line and headers may take to arrive (then 408 and close)."),
    click.option("--body-timeout", default=_LIMITS.body_timeout_s, show_default=True, **_SECONDS, help="A body "
                 "must bring --min-body-rate bytes a second over every window of this many real seconds (else 408)."),
    click.option("--min-body-rate", default=_LIMITS.min_body_rate, **_NUMBER, help="Bytes a second a request "
                 "body must average over each --body-timeout window."),
    click.option("--max-connections", default=_LIMITS.max_connections, **_NUMBER, help="Client connections open "
                 "at once (lowered to half the file-descriptor limit); past it a connection gets 503 and closes."),
    click.option("--send-timeout", default=_LIMITS.send_timeout_s, show_default=True, **_SECONDS, help="Real "
                 "seconds a client may read nothing of its answer while it waits to go out (then it is cut off)."),
    click.option("--keepalive-timeout", default=_LIMITS.keepalive_s, show_default=True, **_SECONDS, help="Real "
                 "seconds an idle keep-alive connection stays open."),
]
"""The bounds of the gateway's HTTP server and of upstream answers (:mod:`kvgate.http.limits`, docs/security.md)."""


def limit_fields(opts: dict[str, Any]) -> dict[str, Any]:
    """The :class:`GatewayConfig` fields of :data:`LIMIT_OPTIONS`, taken out of ``opts``."""
    limits = ServerLimits(
        head_timeout_s=opts.pop("head_timeout"), body_timeout_s=opts.pop("body_timeout"),
        min_body_rate=opts.pop("min_body_rate"), max_connections=opts.pop("max_connections"),
        max_body_nodes=opts.pop("max_body_nodes"), bodies_in_flight=opts.pop("max_inflight_body_bytes"),
        send_timeout_s=opts.pop("send_timeout"), keepalive_s=opts.pop("keepalive_timeout"),
    )
    return {"server_limits": limits, "max_answer_bytes": opts.pop("max_answer_bytes")}


@click.command("gateway", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--config", type=click.Path(dir_okay=False, path_type=Path), is_eager=True, expose_value=False,
              callback=_config_callback, help="TOML (or .json) file of option defaults; flags override it.")
@click.option("--upstream", "upstream", multiple=True, metavar="URL", help="The engine: an OpenAI-compatible server "
              "(vLLM, SGLang, kvgate engine), e.g. http://127.0.0.1:8100. Repeat it for a fleet of replicas.")
@click.option("--upstreams", "upstreams_file", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="A fleet's upstreams: one URL per line, optionally followed by kv-events=ENDPOINT[,REPLAY]; # "
              "comments (after any --upstream).")
@click.option("--router", type=click.Choice(ROUTERS), metavar="NAME",
              help=f"Where a fleet's sessions go: {', '.join(ROUTERS)} [default: kvgate: session affinity, one "
              "budget per replica, new sessions by headroom].")
@click.option("--kv-events", "kv_events", multiple=True, metavar="ENDPOINT[,REPLAY]",
              help="Follow an upstream's KV cache events (vLLM or kvgate engine started with --kv-events-config): "
              "its ZMQ endpoint, e.g. tcp://10.0.0.5:5557, and optionally its replay endpoint after a comma. Repeat "
              "it once per upstream, in order ('-' for one without); or put kv-events=... after a URL in --upstreams "
              "FILE. Feeds prefix-affinity's placement and --control budgeter-resident; resident tokens per replica "
              "and session in /metrics and GET /v1/sessions.")
@click.option("--health-interval", default=1.0, show_default=True, **_SECONDS,
              help="Real seconds between health checks of a fleet's replicas (GET /health); a replica is down "
              "after a failed check or a connection error, up again when a check passes.")
@click.option("--upstream-api-key", envvar="KVGATE_UPSTREAM_API_KEY", metavar="KEY", help="Authorization: Bearer "
              "KEY sent upstream (replaces the client's). Env: KVGATE_UPSTREAM_API_KEY.")
@with_options(control_options("budgeter"))
@with_options(TENANT_OPTIONS)
@click.option("--kv-pool", default="auto", show_default=True, metavar="auto|TOKENS",
              help="KV pool C (of each replica, in a fleet); auto asks the upstream: vLLM's (num_gpu_blocks - 1) x "
              "block_size from /metrics, SGLang's max_total_num_tokens from /server_info, Dynamo's frontend total "
              "KV blocks x block size from /metrics, another kvgate gateway's /kvgate/info.")
@click.option("--session-header", default=SESSION_HEADER, show_default=True, metavar="NAME",
              help="kvgate's own header naming the session (the source 'header' of --session-from).")
@click.option("--session-from", default="auto", show_default=True, metavar="auto|SOURCE,...",
              help=f"Where a request's session comes from, in order: {', '.join(SOURCES)} (auto: all, this order). "
              "lineage: a request that names none continues the session whose conversation it extends.")
@click.option("--max-sessions", default=100_000, **_NUMBER,
              help="Most sessions kept (named, lineage, released); past it the oldest idle ones end.")
@click.option("--state-dir", type=click.Path(file_okay=False), metavar="DIR",
              help="Keep the session books in DIR (SQLite) across restarts: a gateway started again on it goes on "
              "with every admitted session's demand, its lineage and its clock [default: kept in memory only].")
@click.option("--state-flush", default=0.1, show_default=True, **_SECONDS,
              help="Real seconds between writes of the books to --state-dir (what a crash can lose).")
@click.option("--store", metavar="URL",
              help="Keep the session books at URL: redis://HOST:PORT/DB shares them and the budget between "
              "gateways (any instance takes any turn; see docs/operations.md); sqlite:///DIR is --state-dir DIR.")
@click.option("--host", type=BIND_ADDRESS, default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=PORT, default=8000, show_default=True, help="Port (0: a free one).")
@click.option("--time-scale", type=FINITE, default=1.0, show_default=True,
              help="Gateway seconds per real second (match kvgate engine --time-scale).")
@click.option("--idle-timeout", default=300.0, show_default=True, **_SECONDS,
              help="Forget a session after this long without a request (gateway seconds); it leaves D sooner, "
              "after a bound learnt from the think times seen.")
@click.option("--max-park-s", **_SECONDS,
              help="Answer 503 (Retry-After) to a turn held longer (gateway seconds) [default: wait].")
@click.option("--default-max-tokens", default=1024, **_NUMBER,
              help="Output budget o_s of a request without max_tokens.")
@click.option("--require-session", is_flag=True,
              help="Answer 400 to requests no source of --session-from names (lineage follows a conversation; it "
              "names none).")
@click.option("--api-key", "api_keys", multiple=True, envvar="KVGATE_API_KEYS", metavar="KEY",
              help="Accept clients with Authorization: Bearer KEY (repeatable; env KVGATE_API_KEYS, space-separated). "
              "The client's key is not forwarded.")
@click.option("--api-key-file", type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
              help="Client keys, one per line (# comments), besides any --api-key: keeps them out of ps.")
@click.option("--admin-token", envvar="KVGATE_ADMIN_TOKEN", metavar="TOKEN",
              help="Required by /admin/*, GET /v1/sessions, the dashboard and the engine's admin paths (required "
              "with --api-key) [default: loopback clients only].")
@click.option("--allowed-host", "allowed_hosts", multiple=True, metavar="NAME[:PORT]",
              help="Without client keys only a Host of 127.0.0.1, localhost or [::1] (with the port) or the bind "
              "address is served (421 otherwise: DNS rebinding); add names, e.g. a reverse proxy's (repeatable).")
@click.option("--shared-prefix-cache", is_flag=True,
              help="With --api-key: send no per-key cache_salt, so tenants share the engine's prefix cache (and "
              "can time each other's prompts; see docs/security.md) [default: each key its own].")
@click.option("--max-body-bytes", default=32 << 20, **_NUMBER, help="Larger request bodies get 413.")
@click.option("--offload-body-bytes", default=256 << 10, **_NUMBER, help="Request bodies this large or larger "
              "are read off the event loop (parse, lineage, estimate), in arrival order; 0: all of them.")
@with_options(LIMIT_OPTIONS)
@click.option("--upstream-timeout", default=600.0, show_default=True, **_SECONDS,
              help="Real seconds to wait for the upstream's headers or its next bytes (then 504).")
@click.option("--shutdown-grace", default=30.0, show_default=True, **_SECONDS,
              help="On SIGTERM, real seconds turns in flight get to finish.")
@click.option("--log-level", type=click.Choice(["debug", "info", "warning", "error"]), default="info",
              show_default=True, help="JSON log lines on stderr.")
@click.option("--loop", "loop_kind", type=click.Choice(["auto", "asyncio", "uvloop"]), default="auto",
              show_default=True, help="Event loop (auto: uvloop when installed).")
def command(**opts: Any) -> None:
    """Serve the policy core in front of an OpenAI-compatible engine: park agent sessions at turn boundaries.

    \b
    Relays /v1/completions, /v1/chat/completions, /v1/responses and /v1/messages (streaming or
    not) to --upstream, holding a session's turn while the control says so (the client sees only
    latency); other paths pass through (with --api-key: what agents ask; the engine's admin
    paths need --admin-token; see docs/security.md). Sessions: X-Session-ID, the agents' own headers
    and body fields (--session-from), else the conversation itself (lineage); X-Session-End: true
    on the last turn. Serves /metrics (Prometheus), GET /v1/sessions, DELETE /v1/sessions/ID and
    POST /admin/control {"control": NAME, "opts": {...}}. Stops gracefully on SIGTERM.

    \b
    A fleet: --upstream repeated (or --upstreams FILE). Each replica's KV pool is read from it,
    --router places every session, sticky routers keep one policy per replica (D_r against C_r),
    a replica that fails its health check or a connection is marked down and its sessions are
    placed anew; /metrics has kvgate_replica_* series per replica. See docs/gateway.md.

    \b
    KV events (--kv-events, one per upstream): what each replica holds, from its ZMQ event
    stream; prefix-affinity places new and re-placed sessions where they are resident, and
    --control budgeter-resident counts a thinking session's lost prefix out of D.
    """
    cfg = config_from(opts)
    host, port, time_scale = opts["host"], opts["port"], opts["time_scale"]
    setup_logging(opts["log_level"])
    loop_name = install_loop(opts["loop_kind"])

    def ready(gw: Gateway) -> None:
        log.info(
            f"kvgate gateway: serving at http://{url_host(host)}:{gw.port} in front of {gw.upstream_url}"
            f"{f' (router {gw.fleet.router.name})' if not gw.fleet.single else ''} "
            f"({gw.control.spec()}, {gw.kv_pool}-token KV pool from {gw.kv_pool_source}, upstream "
            f"{gw.upstream_info.kind} with {gw.upstream_info.block_size or '?'}-token blocks, "
            f"time x{time_scale:g}, {loop_name} loop); Ctrl-C stops",
            extra={"event": "ready", "port": gw.port},
        )

    try:
        asyncio.run(serve(cfg, host, port, ready))
    except PoolNotFound:
        raise
    except OSError as e:  # e.g. the port is taken
        raise UsageError(f"cannot listen on {host}:{port}: {one_line(e, 300)}") from None


TENANT_KEYS = tuple(inspect.signature(tenant_fields).parameters)
"""The options' parameter names :func:`tenant_fields` takes."""


def config_from(opts: dict[str, Any]) -> GatewayConfig:
    """The gateway's config from its command's options (``kvgate epp`` takes the same ones), validated."""
    upstream, upstreams_file, kv_events = opts["upstream"], opts["upstreams_file"], opts["kv_events"]
    file_urls, file_events = read_upstreams(upstreams_file) if upstreams_file is not None else ((), ())
    urls = tuple(upstream) + file_urls
    events: tuple[KVEventsSource | None, ...] = (None,) * len(upstream) + file_events
    if kv_events:
        if any(file_events):
            raise UsageError("give KV events either with --kv-events or in the --upstreams file, not both")
        events = tuple(parse_kv_events(k) for k in kv_events)
    o = opts
    cfg = GatewayConfig(
        upstream=urls[0] if urls else "", upstreams=urls[1:], router=o["router"],
        health_interval_s=o["health_interval"], kv_events=events,
        control=o["control"], control_opt=o["control_opt"], control_at=o["control_at"],
        kv_pool=parse_kv_pool(o["kv_pool"]), session_header=o["session_header"],
        session_from=parse_session_from(o["session_from"]), max_sessions=o["max_sessions"],
        state_dir=o["state_dir"], state_flush_s=o["state_flush"], store=o["store"] or None,
        time_scale=o["time_scale"], idle_timeout_s=o["idle_timeout"], max_park_s=o["max_park_s"],
        default_max_tokens=o["default_max_tokens"], require_session=o["require_session"],
        api_keys=client_keys(o["api_keys"], o["api_key_file"]), upstream_api_key=o["upstream_api_key"],
        admin_token=o["admin_token"], allowed_hosts=o["allowed_hosts"], shared_prefix_cache=o["shared_prefix_cache"],
        max_body_bytes=o["max_body_bytes"], offload_body_bytes=o["offload_body_bytes"],
        upstream_timeout_s=o["upstream_timeout"],
        shutdown_grace_s=o["shutdown_grace"], **tenant_fields(**{k: o[k] for k in TENANT_KEYS}),
        **limit_fields(o),
    )
    cfg.validate()
    return cfg
