"""What defines a gateway: :class:`GatewayConfig` (the command's options, typed and validated) and the
``--config`` file of option defaults (TOML, or JSON by extension)."""

from __future__ import annotations

import json
import math
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from yarl import URL

from kvgate.errors import UsageError
from kvgate.fleet.routers import ROUTERS
from kvgate.http.openai import SESSION_HEADER, one_line
from kvgate.policy import CONTROLS, PolicyError, make_control


@dataclass(frozen=True)
class GatewayConfig:
    """Everything that defines a gateway (the command's options, typed)."""

    upstream: str = ""
    """The engine (a fleet's first replica, with ``upstreams`` the others)."""
    upstreams: tuple[str, ...] = ()
    """Further replicas: the gateway fronts ``upstream`` and these (see :attr:`urls`)."""
    router: str | None = None
    """Where a session's turns go in a fleet (:data:`kvgate.fleet.routers.ROUTERS`); None: kvgate."""
    health_interval_s: float = 1.0
    """Real seconds between health checks of a fleet's replicas (one upstream is not checked)."""
    control: str = "budgeter"
    control_opts: Mapping[str, int | float] = field(default_factory=dict)
    control_at_min: float | None = None
    kv_pool: int | None = None
    """C in tokens; None: read it from the upstream."""
    session_header: str = SESSION_HEADER
    time_scale: float = 1.0
    idle_timeout_s: float = 300.0
    max_park_s: float | None = None
    default_max_tokens: int = 1024
    require_session: bool = False
    api_keys: tuple[str, ...] = ()
    upstream_api_key: str | None = None
    admin_token: str | None = None
    max_body_bytes: int = 32 << 20
    upstream_timeout_s: float = 600.0
    shutdown_grace_s: float = 30.0

    @property
    def urls(self) -> tuple[str, ...]:
        """Every upstream, in order: replica 0 is ``upstream`` (when given), then ``upstreams``."""
        return ((self.upstream,) if self.upstream else ()) + tuple(self.upstreams)

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
        if self.router is not None and self.router not in ROUTERS:
            raise UsageError(f"unknown --router {self.router!r}; choose from {', '.join(ROUTERS)}")
        if not (math.isfinite(self.health_interval_s) and self.health_interval_s > 0):
            raise UsageError(f"--health-interval must be a positive number, got {self.health_interval_s}")
        if self.control not in CONTROLS:
            raise UsageError(f"unknown --control {self.control!r}; choose from {', '.join(CONTROLS)}")
        try:
            make_control(self.control, kv_pool=self.kv_pool or 1_000_000, **dict(self.control_opts))
        except PolicyError as e:
            raise UsageError(f"--control {self.control}: {e}") from None
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
        if self.control_at_min is not None and self.control_at_min < 0:
            raise UsageError("--control-at must be non-negative")
        if self.kv_pool is not None and self.kv_pool < 1:
            raise UsageError("--kv-pool must be a positive number of tokens or 'auto'")
        if self.default_max_tokens < 0:
            raise UsageError("--default-max-tokens must be non-negative")
        if self.max_body_bytes < 1024:
            raise UsageError("--max-body-bytes must be at least 1024")
        if not self.session_header.strip():
            raise UsageError("--session-header must name a header")


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
    return f"{u.scheme}://{u.host}:{port}{u.path.rstrip('/')}"


def read_upstreams_file(path: Path) -> tuple[str, ...]:
    """``--upstreams FILE``: one URL per line; blank lines and ``#`` comments (whole or trailing) ignored."""
    try:
        text = path.read_text()
    except (OSError, UnicodeDecodeError) as e:
        raise UsageError(f"--upstreams {path}: {one_line(e, 300)}") from None
    urls = []
    for line in text.splitlines():
        line = line.split("#", 1)[0].strip()
        if line:
            urls.append(line)
    if not urls:
        raise UsageError(f"--upstreams {path}: no upstream URL in the file")
    return tuple(urls)


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
    "upstream", "upstreams", "router", "health_interval", "upstream_api_key", "control", "control_opt", "control_at",
    "kv_pool", "session_header", "host",
    "port", "time_scale", "idle_timeout", "max_park_s", "default_max_tokens", "require_session", "api_key",
    "admin_token", "max_body_bytes", "upstream_timeout", "shutdown_grace", "log_level", "loop",
})  # fmt: skip
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
        if k == "api_key" and type(value) is str:
            value = [value]
        if k == "kv_pool":
            value = str(value)
        out[k] = value
    return out
