"""Who may ask the gateway what: clients by ``--api-key`` (``Authorization: Bearer KEY``), the admin endpoints by
``--admin-token`` (a header, or ``?token=`` on the dashboard's address) or, without a token, loopback clients only.
Keys and tokens are compared in constant time."""

from __future__ import annotations

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


def admin_check(token: str | None, request: Request, query_token: bool = False) -> None:
    """Raise :class:`Unauthorized` / :class:`Forbidden` unless the request may use the admin endpoints."""
    if token:
        auth = request.headers.get("Authorization", "")
        given = auth[7:].strip() if auth.startswith("Bearer ") else request.headers.get("X-Admin-Token", "")
        if not given and query_token:  # the dashboard's address: a browser cannot send a header
            given = parse_qs(request.raw_path.partition("?")[2]).get("token", [""])[0]
        if not hmac.compare_digest(given.encode(), token.encode()):
            raise Unauthorized("admin token required (Authorization: Bearer TOKEN or X-Admin-Token)")
        return
    remote = request.remote or ""
    try:
        ok = any(ipaddress.ip_address(remote.split("%")[0]) in net for net in LOOPBACK)
    except ValueError:
        ok = False
    if not ok:
        raise Forbidden("admin endpoints answer loopback clients only (set --admin-token to allow others)")
