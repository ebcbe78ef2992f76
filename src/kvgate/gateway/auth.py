"""Who may ask the gateway what: clients by ``--api-key`` (``Authorization: Bearer KEY``), the admin endpoints by
``--admin-token`` (a header, or ``?token=`` on the dashboard's address) or, without a token (a gateway without
client keys), loopback clients only. Keys and tokens are compared in constant time.

Without client keys a browser on the operator's machine is a loopback client too, so the gateway also refuses what
only a web page would send (:class:`Origins`): a ``Host`` that is not one of the gateway's own names (421, every
path: DNS rebinding), an ``Origin`` that is not the gateway's own on an admin call (403: cross-site requests), and
a state-changing admin call whose body is not ``application/json`` (415: a "simple" cross-site POST). Each
client key has its own ``cache_salt`` (:func:`cache_salts`): an HMAC of the key, never the key. See
docs/security.md."""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
from urllib.parse import parse_qs

from kvgate.errors import ClientError
from kvgate.http.server import Request

LOOPBACK = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"))


class Unauthorized(ClientError):
    http_status = 401


class Forbidden(ClientError):
    http_status = 403


class MisdirectedRequest(ClientError):
    http_status = 421


class UnsupportedMediaType(ClientError):
    http_status = 415


CLIENT_PATHS = frozenset({
    ("GET", "/v1/models"), ("POST", "/v1/messages/count_tokens"), ("POST", "/tokenize"), ("POST", "/detokenize"),
    ("GET", "/health"), ("GET", "/ping"), ("GET", "/version"),
})
"""What a client key reaches of the upstream besides the turns (and ``GET /v1/models/{id}``): what agents ask."""
ENGINE_ADMIN_PATHS = frozenset({
    "/reset_prefix_cache", "/flush_cache", "/kvgate/trigger", "/kvgate/stats", "/kvgate/kv_blocks", "/server_info",
    "/get_server_info", "/get_model_info", "/start_profile", "/stop_profile", "/sleep", "/wake_up", "/is_sleeping",
    "/pause", "/resume", "/collective_rpc", "/load_lora_adapter", "/unload_lora_adapter", "/scale_elastic_ep",
    "/update_weights_from_disk", "/abort_request",
})
"""The engines' (vLLM's, SGLang's, kvgate engine's) admin paths: the admin token's (401 without it); any other
path a client key does not reach is 404."""


def client_path(request: Request) -> bool:
    """A path of the upstream a client key may reach (:data:`CLIENT_PATHS`)."""
    return (request.method, request.path) in CLIENT_PATHS or (
        request.method == "GET" and request.path.startswith("/v1/models/"))


OWN_NAMES = ("127.0.0.1", "localhost", "[::1]")
"""The names a gateway always answers to (with its port)."""


class Origins:
    """The gateway's own names (``Host`` values) and origins (``Origin`` values), from its port, the address it
    binds and ``--allowed-host`` names (a name with a port is taken as it is; one without: with the gateway's port
    and bare, as a reverse proxy on port 80 or 443 sends it)."""

    def __init__(self, port: int, bind: str, allowed: tuple[str, ...]) -> None:
        names = set(OWN_NAMES)
        if bind not in ("", "0.0.0.0", "::"):
            names.add(f"[{bind}]" if ":" in bind and not bind.startswith("[") else bind)
        hosts = {f"{n}:{port}" for n in names} | ({*names} if port == 80 else set())
        for a in allowed:
            a = a.strip().lower()
            hosts |= {a} if a.rpartition(":")[2].isdigit() and not a.endswith("]") else {a, f"{a}:{port}"}
        self.hosts = frozenset(h.lower() for h in hosts)
        self.origins = frozenset(f"{scheme}://{h}" for h in self.hosts for scheme in ("http", "https"))

    def host_check(self, request: Request) -> None:
        """Raise :class:`MisdirectedRequest` unless the request's ``Host`` is one of the gateway's names."""
        if request.headers.get("Host", "").strip().lower() not in self.hosts:
            raise self.misdirected(request)

    def misdirected(self, request: Request) -> MisdirectedRequest:
        host = request.headers.get("Host", "")
        return MisdirectedRequest(f"Host {host[:100]!r} is not this gateway's (127.0.0.1, localhost or [::1] with "
                                  "its port; more with --allowed-host)")

    def origin_check(self, request: Request) -> None:
        """Raise :class:`Forbidden` when the request carries an ``Origin`` other than the gateway's own."""
        origin = request.headers.get("Origin")
        if origin is not None and origin.strip().lower() not in self.origins:
            raise Forbidden(f"cross-origin admin request refused (Origin {origin[:100]!r})")


def json_only(request: Request) -> None:
    """Raise :class:`UnsupportedMediaType` unless a state-changing call's body is declared ``application/json``."""
    ctype = request.headers.get("Content-Type", "").partition(";")[0].strip().lower()
    if ctype != "application/json":
        raise UnsupportedMediaType(f"Content-Type must be application/json, got {ctype[:100]!r}")


def cache_salts(keys: tuple[str, ...], secret: str) -> tuple[str, ...]:
    """Each client key's ``cache_salt``: HMAC-SHA256 of the key under a secret of the gateway (32 hex digits, what
    vLLM and SGLang accept); the same key gets the same salt across restarts and gateways sharing the secret."""
    k = hashlib.sha256(b"kvgate cache_salt\0" + secret.encode()).digest()
    return tuple(hmac.new(k, key.encode(), hashlib.sha256).hexdigest()[:32] for key in keys)


def unauthorized() -> Unauthorized:
    return Unauthorized("invalid or missing API key (Authorization: Bearer KEY)")


def client_authorized(keys: tuple[bytes, ...], request: Request) -> bool:
    """The request carries one of ``keys`` as ``Authorization: Bearer KEY``."""
    return client_key(keys, request) is not None


def client_key(keys: tuple[bytes, ...], request: Request) -> int | None:
    """The number of the key the request carries as ``Authorization: Bearer KEY`` (its place in ``keys``); None
    when it carries none of them. A session belongs to the key that opened it."""
    auth = request.headers.get("Authorization", "")
    if not auth.startswith("Bearer "):
        return None
    given = auth[7:].strip().encode()
    found = None
    for i, key in enumerate(keys):  # NOTE: compare with every key, in constant time, whatever matches
        if hmac.compare_digest(given, key) and found is None:
            found = i
    return found


def has_admin_token(token: str | None, request: Request, query_token: bool = False) -> bool:
    """The request carries ``token`` (``Authorization: Bearer``, ``X-Admin-Token``, or with ``query_token``
    ``?token=``), compared in constant time; False without a token."""
    if not token:
        return False
    auth = request.headers.get("Authorization", "")
    given = auth[7:].strip() if auth.startswith("Bearer ") else request.headers.get("X-Admin-Token", "")
    if not given and query_token:  # the dashboard's address: a browser cannot send a header
        given = parse_qs(request.raw_path.partition("?")[2]).get("token", [""])[0]
    return hmac.compare_digest(given.encode(), token.encode())


def admin_check(token: str | None, request: Request, query_token: bool = False, origins: Origins | None = None) -> None:
    """Raise :class:`Unauthorized` / :class:`Forbidden` unless the request may use the admin endpoints: with a
    token, the token; without, a loopback client whose request carries no foreign ``Origin`` (``origins``)."""
    if token:
        if not has_admin_token(token, request, query_token):
            raise Unauthorized("admin token required (Authorization: Bearer TOKEN or X-Admin-Token)")
        return
    if origins is not None:
        origins.origin_check(request)
    remote = request.remote or ""
    try:
        ok = any(ipaddress.ip_address(remote.split("%")[0]) in net for net in LOOPBACK)
    except ValueError:
        ok = False
    if not ok:
        raise Forbidden("admin endpoints answer loopback clients only (set --admin-token to allow others)")
