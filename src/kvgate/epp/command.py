"""``kvgate epp``: the command, with every option of ``kvgate gateway`` and the picker's own."""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

import click

from kvgate.errors import UsageError
from kvgate.gateway import command as gateway_command
from kvgate.gateway.logs import setup_logging
from kvgate.gateway.pool import PoolNotFound
from kvgate.http.openai import one_line
from kvgate.http.signals import serve_until_signalled
from kvgate.options import PORT, Port

log = logging.getLogger("kvgate.epp")

HELP = """Serve kvgate's policy core as Envoy's endpoint picker (Gateway API Inference Extension).

\b
Envoy calls the picker over ext_proc (gRPC, --grpc-port) for every request: the picker resolves
the session, asks the policy, holds the turn while the control says so (extending Envoy's message
timeout), then picks the session's engine by kvgate's placement (header
x-gateway-destination-endpoint and envoy.lb metadata); the answer's usage ends the turn. The
upstreams are the engines Envoy sends to (IP:PORT). --port serves /metrics, /kvgate/info,
/v1/sessions, /dashboard and /admin/* as kvgate gateway does. --envoy-config FILE --envoy-listen
PORT writes an Envoy bootstrap for this host (run it with envoy -c FILE). See docs/envoy.md.
"""


def _options() -> list[click.Parameter]:
    return [
        click.Option(["--grpc-port"], type=PORT, default=9002, show_default=True,
                     help="The ext_proc (and gRPC health) port Envoy calls (0: a free one; not with --envoy-config, "
                     "whose bootstrap names it)."),
        click.Option(["--hold"], type=click.Choice(["always", "never"]), default="always", show_default=True,
                     help="never: a turn the policy would hold is answered 429 with Retry-After at once (for hosts "
                     "whose Envoy cannot wait on the picker)."),
        click.Option(["--envoy-config"], type=click.Path(dir_okay=False, path_type=Path), metavar="FILE",
                     help="Write an Envoy bootstrap for this stack to FILE (with --envoy-listen), then serve."),
        click.Option(["--envoy-listen"], type=Port(), metavar="PORT", help="The port of that Envoy's listener."),
        click.Option(["--envoy-admin"], type=Port(), metavar="PORT", help="That Envoy's admin port [default: none]."),
        click.Option(["--envoy-body"], type=click.Choice(["buffered", "streamed"]), default="buffered",
                     show_default=True, help="How that Envoy passes bodies: buffered (the request whole) or "
                     "streamed (full duplex, both ways)."),
    ]


def run(**opts: Any) -> None:
    from kvgate.epp.envoy import bootstrap, write_bootstrap
    from kvgate.epp.picker import Picker, extend_s

    own = own_options(opts)
    cfg = gateway_command.config_from(opts)
    host, port = opts["host"], opts["port"]
    setup_logging(opts["log_level"])
    gateway_command.install_loop(opts["loop_kind"])
    if own["envoy_config"] is not None:
        conf = bootstrap(cfg, listen=own["envoy_listen"], grpc_port=own["grpc_port"], extend_s=extend_s(cfg),
                         body=own["envoy_body"], admin_port=own["envoy_admin"])
        try:
            write_bootstrap(own["envoy_config"], conf)
        except OSError as e:
            raise UsageError(f"cannot write --envoy-config {own['envoy_config']}: {one_line(e, 200)}") from None

    def ready(p: Any) -> None:
        log.info(f"kvgate epp: ext_proc on {host}:{p.grpc_port}, HTTP on {host}:{p.port}, in front of "
                 f"{p.upstream_url} ({p.control.spec()}, {p.kv_pool}-token KV pool, hold {p.hold}); Ctrl-C stops",
                 extra={"event": "ready", "port": p.port, "grpc_port": p.grpc_port})

    async def serve() -> None:
        await serve_until_signalled(Picker(cfg, own["grpc_port"], own["hold"]), host, port, ready)

    try:
        asyncio.run(serve())
    except PoolNotFound:
        raise
    except OSError as e:
        raise UsageError(f"cannot listen on {host}:{port}/{own['grpc_port']}: {one_line(e, 300)}") from None


def own_options(opts: dict[str, Any]) -> dict[str, Any]:
    """The options of epp's own, taken out of ``opts`` (the rest are the gateway's) and checked together."""
    own = {k: opts.pop(k) for k in ("grpc_port", "hold", "envoy_config", "envoy_listen", "envoy_admin", "envoy_body")}
    if (own["envoy_config"] is None) != (own["envoy_listen"] is None):
        raise UsageError("give --envoy-config FILE and --envoy-listen PORT together")
    if own["envoy_config"] is not None and own["grpc_port"] == 0:
        raise UsageError("--grpc-port 0 with --envoy-config: the bootstrap names the port Envoy calls; give one")
    return own


def _command() -> click.Command:
    try:
        import grpc  # noqa: F401
        from envoy.service.ext_proc.v3 import external_processor_pb2  # noqa: F401
    except ImportError as e:
        missing = one_line(e, 200)

        def absent(**opts: Any) -> None:
            own_options(opts)  # (what is wrong with the options is said first)
            raise UsageError(f"kvgate epp needs its extra: pip install 'kvgate[epp]' ({missing})")

        callback = absent
    else:
        callback = run
    return click.Command("epp", params=[*gateway_command.command.params, *_options()], callback=callback, help=HELP,
                         context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})


command = _command()
