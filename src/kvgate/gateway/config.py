"""What defines a gateway: :class:`GatewayConfig` (the command's options, typed and validated) and the
``--config`` file of option defaults (TOML, or JSON by extension)."""

from __future__ import annotations

import dataclasses
import json
import math
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from yarl import URL

from kvgate.errors import UsageError
from kvgate.fleet.routers import ROUTERS
from kvgate.gateway.auth import cache_salts
from kvgate.gateway.identity import SOURCES
from kvgate.gateway.tenants import PRIORITY_HEADER, keyed_tenancy
from kvgate.http.limits import ServerLimits, check_limits
from kvgate.http.openai import SESSION_HEADER, one_line
from kvgate.policy import Tenancy
from kvgate.policy.config import ControlConfig


@dataclass(frozen=True)
class GatewayConfig(ControlConfig):
    """Everything that defines a gateway (the command's options, typed): the control (:class:`ControlConfig`,
    composed as the simulator composes it; the budgeter by default) and the gateway's own fields."""

    upstream: str = ""
    """The engine (a fleet's first replica, with ``upstreams`` the others)."""
    upstreams: tuple[str, ...] = ()
    """Further replicas: the gateway fronts ``upstream`` and these (see :attr:`urls`)."""
    router: str | None = None
    """Where a session's turns go in a fleet (:data:`kvgate.fleet.routers.ROUTERS`); None: kvgate."""
    health_interval_s: float = 1.0
    """Real seconds between health checks of a fleet's replicas (one upstream is not checked)."""
    kv_events: tuple[KVEventsSource | None, ...] = ()
    """Each replica's KV events (in :attr:`urls` order; None, or missing at the end: that replica has none)."""
    control: str = "budgeter"
    kv_pool: int | None = None
    """C in tokens; None: read it from the upstream."""
    session_header: str = SESSION_HEADER
    session_from: tuple[str, ...] = SOURCES
    """Where a request's session id comes from, in order (:mod:`kvgate.gateway.identity`)."""
    max_sessions: int = 100_000
    """The most sessions kept; past it the oldest idle ones end."""
    state_dir: str | None = None
    """Where the session books are kept across restarts (:mod:`kvgate.gateway.store`); None: not kept."""
    state_flush_s: float = 0.1
    """Real seconds between writes of the books."""
    store: str | None = None
    """Where the books are kept, as a URL (:func:`kvgate.gateway.store.open_store`): ``redis://HOST:PORT/DB``
    shares them (and the budget) between gateways; None: ``state_dir`` (or nothing)."""
    time_scale: float = 1.0
    idle_timeout_s: float = 300.0
    max_park_s: float | None = None
    default_max_tokens: int = 1024
    require_session: bool = False
    api_keys: tuple[str, ...] = ()
    """The client keys (``Authorization: Bearer KEY``); none: a loopback gateway without client auth."""
    upstream_api_key: str | None = None
    admin_token: str | None = None
    """Required by the admin endpoints (and the engine's admin paths); required when there are client keys."""
    allowed_hosts: tuple[str, ...] = ()
    """``Host`` names the gateway answers to besides 127.0.0.1, localhost, [::1] and its bind address."""
    shared_prefix_cache: bool = False
    """Send no per-key ``cache_salt``: tenants share the engine's prefix cache (and can time each other's)."""
    max_body_bytes: int = 32 << 20
    offload_body_bytes: int = 256 << 10
    """Request bodies of at least this many bytes are read off the event loop (:mod:`kvgate.gateway.bodies`)."""
    server_limits: ServerLimits = ServerLimits()
    """The HTTP server's other bounds (:mod:`kvgate.http.limits`; its ``max_body`` is ``max_body_bytes``)."""
    max_answer_bytes: int = 64 << 20
    """A non-stream upstream answer larger than this is 502 (a stream is relayed as it comes, unbounded)."""
    upstream_timeout_s: float = 600.0
    shutdown_grace_s: float = 30.0
    tenant_header: str | None = None
    """The request header naming a turn's tenant (:mod:`kvgate.gateway.tenants`); None: the client key."""
    priority_header: str = PRIORITY_HEADER
    """The request header giving a turn's priority band (read with tenancy on)."""
    otlp_endpoint: str | None = None
    """Where spans go over OTLP/HTTP (:mod:`kvgate.gateway.tracing`); None: no traces."""

    def tenancy(self) -> Tenancy | None:
        """The policy's tenancy: ``FairPolicy`` with any tenant option (``--tenant-header`` included), API keys in
        the options named as their tenants (``key-N``); None: the plain core."""
        t = super().tenancy()
        if t is None and self.tenant_header is None:
            return None
        return keyed_tenancy(t or Tenancy(window_s=self.quota_window_s), self.api_keys)

    @property
    def urls(self) -> tuple[str, ...]:
        """Every upstream, in order: replica 0 is ``upstream`` (when given), then ``upstreams``."""
        return ((self.upstream,) if self.upstream else ()) + tuple(self.upstreams)

    def kv_events_of(self, index: int) -> KVEventsSource | None:
        """Replica ``index``'s KV events, if it has them."""
        return self.kv_events[index] if index < len(self.kv_events) else None

    @property
    def feeds_residency(self) -> bool:  # type: ignore[override]
        """The gateway measures residency (``budgeter-resident``'s input) from its upstreams' KV events."""
        return any(self.kv_events)

    @property
    def router_name(self) -> str:
        return self.router or "kvgate"

    def validate(self) -> None:
        """Raise :class:`UsageError` with a one-line message for anything wrong."""
        urls = self.urls
        if not urls:
            raise UsageError("no upstream: pass --upstream URL (repeatable) or --upstreams FILE")
        seen: set[str] = set()
        for url in urls:
            key = check_upstream_url(url)
            if key in seen:
                raise UsageError(f"--upstream {url!r} is given twice")
            seen.add(key)
        if self.store and self.state_dir:
            raise UsageError("give the books either --state-dir DIR or --store URL, not both")
        if self.router is not None and self.router not in ROUTERS:
            raise UsageError(f"unknown --router {self.router!r}; choose from {', '.join(ROUTERS)}")
        if not (math.isfinite(self.health_interval_s) and self.health_interval_s > 0):
            raise UsageError(f"--health-interval must be a positive number, got {self.health_interval_s}")
        if len(self.kv_events) > len(urls):
            raise UsageError(f"--kv-events given {len(self.kv_events)} times for {len(urls)} upstream(s); give one "
                             "per upstream, in order ('-' for one without)")
        for src in self.kv_events:
            if src is not None:
                for ep in (src.endpoint, src.replay_endpoint):
                    if ep is not None:
                        check_zmq_endpoint(ep)
        self.check_control(self.kv_pool)
        for name, v, lo in (
            ("--time-scale", self.time_scale, 0.0),
            ("--idle-timeout", self.idle_timeout_s, 0.0),
            ("--upstream-timeout", self.upstream_timeout_s, 0.0),
        ):
            if not (math.isfinite(v) and v > lo):
                raise UsageError(f"{name} must be a positive number, got {v}")
        if self.max_park_s is not None and not self.max_park_s > 0:
            raise UsageError(f"--max-park-s must be positive, got {self.max_park_s}")
        if self.shutdown_grace_s < 0:
            raise UsageError("--shutdown-grace must be non-negative")
        if self.kv_pool is not None and self.kv_pool < 1:
            raise UsageError("--kv-pool must be a positive number of tokens or 'auto'")
        if self.default_max_tokens < 0:
            raise UsageError("--default-max-tokens must be non-negative")
        if self.max_body_bytes < 1024:
            raise UsageError("--max-body-bytes must be at least 1024")
        if self.offload_body_bytes < 0:
            raise UsageError("--offload-body-bytes must be non-negative")
        check_limits(self.http_limits)
        if self.max_answer_bytes < 1024:
            raise UsageError("--max-answer-bytes must be at least 1024")
        if self.tenant_header is not None and not self.tenant_header.strip():
            raise UsageError("--tenant-header must name a header")
        if not self.priority_header.strip():
            raise UsageError("--priority-header must name a header")
        if self.otlp_endpoint is not None and not self.otlp_endpoint.startswith(("http://", "https://")):
            raise UsageError(f"--otlp-endpoint {self.otlp_endpoint!r}: expected an http(s) URL such as "
                             "http://127.0.0.1:4318/v1/traces")
        if not self.session_header.strip():
            raise UsageError("--session-header must name a header")
        if not self.session_from or any(s not in SOURCES for s in self.session_from):
            raise UsageError(f"--session-from: choose from {', '.join(SOURCES)}")
        if self.max_sessions < 1:
            raise UsageError("--max-sessions must be at least 1")
        self._check_auth()
        if not (math.isfinite(self.state_flush_s) and self.state_flush_s > 0):
            raise UsageError(f"--state-flush must be a positive number, got {self.state_flush_s}")


    def _check_auth(self) -> None:
        for key in self.api_keys:
            if not key.strip():
                raise UsageError("--api-key: an empty key (e.g. --api-key \"$KEY\" with KEY unset) would let "
                                 "anyone in; give a non-empty key or no --api-key at all")
        if self.admin_token is not None and not self.admin_token.strip():
            raise UsageError("--admin-token is empty; give a non-empty token or none")
        if self.api_keys and not self.admin_token:
            raise UsageError("--api-key given without --admin-token: with client keys the admin endpoints "
                             "(/admin/*, /v1/sessions, /dashboard, the engine's admin paths) need a token that no "
                             "client key opens; set --admin-token TOKEN (or KVGATE_ADMIN_TOKEN)")
        if self.admin_token and self.admin_token in self.api_keys:
            raise UsageError("--admin-token must differ from every --api-key")
        for h in self.allowed_hosts:
            if not h.strip() or any(c in h for c in " /@"):
                raise UsageError(f"--allowed-host {h!r}: expected a host name, optionally with :PORT")

    @property
    def http_limits(self) -> ServerLimits:
        """The HTTP server's bounds, ``max_body_bytes`` included."""
        return dataclasses.replace(self.server_limits, max_body=self.max_body_bytes)

    @property
    def cache_salts(self) -> tuple[str, ...]:
        """Each client key's ``cache_salt`` sent upstream (none without keys or with ``shared_prefix_cache``)."""
        if not self.api_keys or self.shared_prefix_cache or not self.admin_token:
            return ()
        return cache_salts(self.api_keys, self.admin_token)


def read_api_keys(path: Path) -> tuple[str, ...]:
    """``--api-key-file FILE``: one client key per line; blank lines and ``#`` comment lines ignored."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--api-key-file {path}: {one_line(e, 300)}") from None
    keys = tuple(k for k in (line.strip() for line in text.splitlines()) if k and not k.startswith("#"))
    if not keys:
        raise UsageError(f"--api-key-file {path}: no key in the file")
    return keys


def check_upstream_url(url: str) -> str:
    """An upstream URL as the gateway compares them (scheme, host, port, path); UsageError if it is not one."""
    try:
        u = URL(str(url).strip())
    except ValueError:
        u = URL()
    if u.scheme not in ("http", "https") or not u.host:
        raise UsageError(f"--upstream {url!r}: expected an http(s) URL such as http://127.0.0.1:8100")
    if u.query_string or u.fragment:
        raise UsageError(f"--upstream {url!r}: no query or fragment, please")
    try:
        port = u.port
    except ValueError:
        raise UsageError(f"--upstream {url!r}: the port is not a number") from None
    if not port:  # (yarl reads 1-65535, and 0)
        raise UsageError(f"--upstream {url!r}: the port must be in 1-65535")
    return f"{u.scheme}://{u.host}:{port}{u.path.rstrip('/')}"


@dataclass(frozen=True)
class KVEventsSource:
    """Where a replica publishes its KV events (vLLM's ``--kv-events-config`` endpoint and replay endpoint, with
    the engine's host in place of the ``*`` it binds)."""

    endpoint: str
    replay_endpoint: str | None = None

    def __str__(self) -> str:
        return self.endpoint + (f",{self.replay_endpoint}" if self.replay_endpoint else "")


NO_KV_EVENTS = ("-", "none", "")
"""What ``--kv-events`` (or a file's ``kv-events=``) says for a replica without KV events."""


def check_zmq_endpoint(ep: str) -> None:
    """A ZMQ endpoint the gateway connects to: ``tcp://HOST:PORT`` or ``ipc://PATH``; UsageError otherwise."""
    flag = f"--kv-events {ep!r}"
    if ep.startswith("ipc://") and len(ep) > 6:
        return
    host, sep, port = ep.removeprefix("tcp://").rpartition(":")
    if not ep.startswith("tcp://") or not sep or not host:
        raise UsageError(f"{flag}: expected tcp://HOST:PORT or ipc://PATH (the engine's --kv-events-config endpoint)")
    if host == "*":
        raise UsageError(f"{flag}: '*' is the address the engine binds; give its host, e.g. tcp://127.0.0.1:{port}")
    if not port.isdigit() or not 0 < int(port) < 65536:
        raise UsageError(f"{flag}: the port must be a number in 1-65535")


def parse_kv_events(text: str) -> KVEventsSource | None:
    """``ENDPOINT[,REPLAY_ENDPOINT]`` (``-`` or ``none``: no KV events); UsageError for a bad endpoint."""
    t = str(text).strip()
    if t.lower() in NO_KV_EVENTS:
        return None
    parts = [p.strip() for p in t.split(",")]
    if len(parts) > 2 or not all(parts):
        raise UsageError(f"--kv-events {text!r}: expected ENDPOINT or ENDPOINT,REPLAY_ENDPOINT")
    for ep in parts:
        check_zmq_endpoint(ep)
    if len(parts) == 2 and parts[0] == parts[1]:
        raise UsageError(f"--kv-events {text!r}: the endpoint and the replay endpoint must differ")
    return KVEventsSource(parts[0], parts[1] if len(parts) == 2 else None)


def read_upstreams(path: Path) -> tuple[tuple[str, ...], tuple[KVEventsSource | None, ...]]:
    """``--upstreams FILE``: one upstream per line, ``URL [kv-events=ENDPOINT[,REPLAY_ENDPOINT]]``; blank lines and
    ``#`` comments (whole or trailing) ignored. The URLs, and each one's KV events (None: none)."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--upstreams {path}: {one_line(e, 300)}") from None
    urls = []
    events: list[KVEventsSource | None] = []
    for n, line in enumerate(text.splitlines(), 1):
        fields = line.split("#", 1)[0].split()
        if not fields:
            continue
        urls.append(fields[0])
        src = None
        for f in fields[1:]:
            key, sep, value = f.partition("=")
            if key != "kv-events" or not sep:
                raise UsageError(f"--upstreams {path}:{n}: unknown field {f!r} (expected kv-events=ENDPOINT)")
            src = parse_kv_events(value)
        events.append(src)
    if not urls:
        raise UsageError(f"--upstreams {path}: no upstream URL in the file")
    return tuple(urls), tuple(events)


def parse_kv_pool(text: str) -> int | None:
    """``--kv-pool``: ``auto`` (None: ask the upstream) or a number of tokens (``_`` separators allowed)."""
    t = str(text).strip().lower()
    if t == "auto":
        return None
    try:
        return int(t.replace("_", ""))
    except ValueError:
        raise UsageError(f"--kv-pool {text!r}: expected 'auto' or a number of tokens") from None


CONFIG_KEYS = frozenset({
    "upstream", "upstreams", "router", "health_interval", "kv_events", "upstream_api_key", "control", "control_opt",
    "control_at", "kv_pool", "session_header", "session_from", "max_sessions", "state_dir", "state_flush", "store",
    "host", "port", "time_scale", "idle_timeout", "max_park_s", "default_max_tokens", "require_session", "api_key",
    "admin_token", "api_key_file", "allowed_host", "shared_prefix_cache", "max_body_bytes", "offload_body_bytes",
    "upstream_timeout",
    "shutdown_grace", "log_level", "loop", "head_timeout", "body_timeout", "min_body_rate", "max_connections",
    "max_body_nodes", "max_inflight_body_bytes", "send_timeout", "keepalive_timeout", "max_answer_bytes",
    "fair_share", "tenant_header", "tenant_weight", "tenant_priority", "priority_header", "tenant_quota",
    "otlp_endpoint",
})
"""The options a ``--config`` file may set (the command's option names, with ``_`` for ``-``)."""


def load_config_file(path: Path) -> dict[str, Any]:
    """Option defaults from a TOML (or, by extension, JSON) file: keys are option names (``kv-pool`` or
    ``kv_pool``); ``control-opt`` may be a table; ``api-key`` a string or a list."""
    try:
        text = path.read_bytes()
        data = json.loads(text) if path.suffix == ".json" else tomllib.loads(text.decode())
    except (OSError, ValueError, UnicodeDecodeError) as e:
        raise UsageError(f"--config {path}: {one_line(e, 300)}") from None
    if type(data) is not dict:
        raise UsageError(f"--config {path}: expected a table of options")
    out: dict[str, Any] = {}
    for key, value in data.items():
        k = str(key).replace("-", "_")
        if k not in CONFIG_KEYS:
            raise UsageError(f"--config {path}: unknown option {key!r}")
        if k == "control_opt" and type(value) is dict:
            value = ",".join(f"{a}={b}" for a, b in value.items())
        if k in ("tenant_weight", "tenant_priority", "tenant_quota") and type(value) is dict:
            value = [f"{a}={b}" for a, b in value.items()]
        if k in ("api_key", "kv_events", "allowed_host", "tenant_weight", "tenant_priority", "tenant_quota") \
                and type(value) is str:
            value = [value]
        if k == "kv_pool":
            value = str(value)
        if k == "session_from" and type(value) is list:
            value = ",".join(str(v) for v in value)
        out[k] = value
    return out
