"""The gateway's side of its upstream: one pool of keep-alive connections, the headers relayed each way, a turn
forwarded and its answer relayed as it arrives, and every failure mapped to the status that says who is at fault.

* Unreachable / dropped: 502; timed out: 504 (JSON bodies); an upstream 5xx: 502 with the upstream's message
  (and its ``Retry-After``); a 4xx is relayed as it is.
* A stream that fails after its headers were sent ends with an error event (vLLM's shape) and ``data: [DONE]``.
* Hop-by-hop headers (RFC 9110 §7.6.1) are never relayed; the client's ``Authorization`` is replaced by
  ``--upstream-api-key`` (or dropped when the gateway checks its own keys).
* Any path the gateway does not serve itself passes through: method, headers, body; small answers read whole,
  others streamed.
* A non-stream answer to a turn is read whole (its usage is in it), up to ``--max-answer-bytes``: past it 502,
  the upstream connection closed (kind ``too_large``); a stream is relayed as it comes, whatever its length.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from typing import Any

from yarl import URL

from kvgate.errors import KvgateError, UpstreamError
from kvgate.gateway.config import GatewayConfig
from kvgate.gateway.stream import UsageScanner, dumps, loads
from kvgate.http.dialect import CHAT, Api
from kvgate.http.openai import Unreachable, error_object, one_line
from kvgate.http.server import Request, Response, StreamResponse, error_response, exc_response
from kvgate.http.upstream import AnswerTooLarge, UpstreamConnectError, UpstreamPool, pool_for
from kvgate.http.upstream import Response as UpResponse

log = logging.getLogger("kvgate.gateway")

HOP_BY_HOP = frozenset(
    {"connection", "keep-alive", "proxy-authenticate", "proxy-authorization", "proxy-connection", "te", "trailer",
     "transfer-encoding", "upgrade"}
)
"""Headers that belong to one connection and are never relayed (RFC 9110 §7.6.1)."""
_UP_DROP = HOP_BY_HOP | {"host", "content-length", "expect", "x-admin-token"}  # (the whole body; the admin's)
_DOWN_DROP = HOP_BY_HOP | {"content-length"}
_DONE = b"data: [DONE]\n\n"
PASSTHROUGH_READ_LIMIT = 1 << 20
COUNTS_KEPT = 4096
"""The most ``/tokenize`` counts an upstream relay keeps (:attr:`UpstreamRelay.counts`)."""
"""Pass-through responses up to this size (by Content-Length) are read whole; larger or unsized ones stream."""


class UpstreamTimeout(UpstreamError):
    http_status = 504


Forwarded = tuple[StreamResponse, dict[str, Any] | None, str | None, Any]
"""``(response, usage, failure kind or None, answer)``; failure "client": a write found the client gone; answer: the
parsed body (the last usage event of a stream), when it was read."""


class UpstreamRelay:
    """One upstream (a replica of a fleet): ``open()`` its connection pool, forward turns and pass-through
    requests, ``close()``. ``url``: the upstream (default: the config's first); ``errors``: the counter its failures
    go to (a fleet's relays share one)."""

    def __init__(
        self, cfg: GatewayConfig, *, client_keys: bool, url: str | None = None, errors: Counter[str] | None = None
    ) -> None:
        base = URL((url or cfg.urls[0]).strip())
        self.base = base.with_path(base.path.rstrip("/"))
        self.base_str = str(self.base).rstrip("/")
        """The upstream's URL, as logs and ``/kvgate/info`` show it."""
        self._base_path = self.base.raw_path.rstrip("/")
        self._auth = f"Bearer {cfg.upstream_api_key}" if cfg.upstream_api_key else None
        drop = _UP_DROP | ({"authorization"} if client_keys or self._auth else set())
        self._drop_pass = frozenset(drop)
        self._drop_turn = frozenset(drop | {"accept-encoding"})
        self._replaced: dict[tuple[str, ...], frozenset[str]] = {}
        """The lower-cased names of the headers a turn adds upstream, by their names as given."""
        self._timeouts = (min(10.0, cfg.upstream_timeout_s), cfg.upstream_timeout_s)
        self._max_answer = cfg.max_answer_bytes
        self.client: UpstreamPool | None = None
        self.errors: Counter[str] = Counter() if errors is None else errors
        """Upstream failures by kind (:data:`kvgate.gateway.metrics.UPSTREAM_ERROR_KINDS`)."""
        self.tokenizes = True
        """Whether the upstream answers vLLM's ``/tokenize`` (off after its first 404 or 405)."""
        self.counts: dict[tuple[int | None, bytes], int] = {}
        """The upstream's prompt-token counts of ``/tokenize`` asks it answered, by the client key that sent the
        conversation and the ask's digest (:func:`kvgate.gateway.turns.engine_count`; at most
        :data:`COUNTS_KEPT`, the least recently used dropped first)."""

    def open(self) -> None:
        # bodies are relayed as they come (compressed or not); no cookies are kept, no redirect followed
        connect, read = self._timeouts
        self.client = pool_for(self.base, connect_timeout=connect, read_timeout=read)

    async def close(self) -> None:
        client, self.client = self.client, None
        if client is not None:
            await client.close()

    def connections(self) -> dict[str, int]:
        """Connections of the upstream pool: ``acquired`` (in use) and ``idle`` (kept alive)."""
        pool = self.client
        if pool is None:
            return {"acquired": 0, "idle": 0}
        return {"acquired": pool.acquired, "idle": pool.idle}

    async def get(self, path: str) -> tuple[int, bytes]:
        """``GET path`` of the upstream, for discovery: ``(status, body)``; :class:`Unreachable` when nothing
        listens."""
        assert self.client is not None
        hdrs = [("Authorization", self._auth)] if self._auth else []
        try:
            resp = await self.client.request("GET", self._base_path + path, hdrs)
        except UpstreamConnectError as e:  # nothing listens: the other paths would fail too
            raise Unreachable(one_line(e)) from None
        try:
            body = await resp.read()
        finally:
            resp.release()
        return resp.status, body

    async def post(self, path: str, body: bytes) -> tuple[int, bytes]:
        """``POST path`` of the upstream with a JSON ``body`` (the gateway's own asks, e.g. ``/tokenize``):
        ``(status, body)``; :class:`Unreachable` when nothing listens."""
        assert self.client is not None
        hdrs = [("Content-Type", "application/json")] + ([("Authorization", self._auth)] if self._auth else [])
        try:
            resp = await self.client.request("POST", self._base_path + path, hdrs, body)
        except UpstreamConnectError as e:
            raise Unreachable(one_line(e)) from None
        try:
            data = await resp.read()
        finally:
            resp.release()
        return resp.status, data

    # -- headers -------------------------------------------------------------------------------------------
    def _up_headers(self, headers: Any, turn: bool, replaced: frozenset[str] = frozenset()) -> list[tuple[str, str]]:
        """The client's headers as relayed upstream: hop-by-hop ones dropped, Authorization as configured; none
        named (lower-case) in ``replaced`` (headers the caller adds after these)."""
        drop = self._drop_turn if turn else self._drop_pass
        if "Connection" in headers:
            drop = drop | {t.strip().lower() for t in headers.get("Connection", "").split(",")}
        if replaced:
            drop = drop | replaced
        out = [(k, v) for k, v in headers.items() if k.lower() not in drop]
        if self._auth is not None and "authorization" not in replaced:
            out.append(("Authorization", self._auth))
        if turn:
            if "accept-encoding" not in replaced:
                out.append(("Accept-Encoding", "identity"))  # the gateway reads the usage in the response
            if "Content-Type" not in headers and "content-type" not in replaced:
                out.append(("Content-Type", "application/json"))
        elif "Accept-Encoding" not in headers and "accept-encoding" not in replaced:
            # NOTE: ask for what the client can read: the gateway relays bodies undecoded
            out.append(("Accept-Encoding", "identity"))
        return out

    @staticmethod
    def _down_headers(headers: Any) -> list[tuple[str, str]]:
        drop = _DOWN_DROP
        if "Connection" in headers:
            drop = drop | {t.strip().lower() for t in headers.get("Connection", "").split(",")}
        return [(k, v) for k, v in headers.items() if k.lower() not in drop]

    def _target(self, request: Request) -> str:
        # NOTE: the upstream's scheme and authority are fixed; the client chooses only path and query (the
        # server reduced an absolute-form target, "http://elsewhere/x", to its path and query).
        return self._base_path + request.raw_path

    # -- a turn --------------------------------------------------------------------------------------------
    async def forward(
        self, request: Request, raw: bytes, stream: bool, inject: bool, extra: list[tuple[str, str]],
        api: Api = CHAT, up: list[tuple[str, str]] | None = None, marks: list[int] | None = None,
    ) -> Forwarded:
        """Send the turn upstream and relay the answer; its usage is read where ``api`` puts it. ``inject``: the
        gateway added ``include_usage`` (the usage-only chunk is dropped); ``extra``: headers added to the
        response, whatever it is; ``up``: headers added upstream (replacing the client's of the same names);
        ``marks`` (a traced turn's): set to the wall-clock ns of the response's head and of its first token (the
        first body chunk of a stream; the head of an answer in one piece), and to whether it streamed."""
        assert self.client is not None
        if up:
            names = tuple([k for k, _ in up])
            replaced = self._replaced.get(names)
            if replaced is None:  # (the same few sets of names, turn after turn)
                if len(self._replaced) >= 64:
                    self._replaced.clear()
                replaced = self._replaced[names] = frozenset([k.lower() for k in names])
            headers = self._up_headers(request.headers, True, replaced) + up
        else:
            headers = self._up_headers(request.headers, True)
        try:
            resp = await self.client.request("POST", self._base_path + turn_target(request.raw_path, api.path),
                                             headers, raw)
        except Exception as e:
            return (*self.failure(e, extra), None)
        if marks is not None:
            marks[0] = time.time_ns()
        done = False
        try:
            status = resp.status
            if stream and status == 200 and resp.content_type == "text/event-stream":
                out = StreamResponse(status=status, headers=self._down_headers(resp.headers) + extra)
                scanner = UsageScanner(drop_usage_only=inject, api=api)
                if marks is not None:
                    marks[2] = 1  # (streamed)
                failure = await relay(request, resp, out, scanner, marks)
                done = failure is None
                return out, scanner.usage, failure, scanner.event
            if marks is not None:
                marks[1] = marks[0]
            try:
                data = await resp.read(self._max_answer)
            except AnswerTooLarge as e:  # (the connection is closed: the rest is not read)
                log.warning("upstream answer too large", extra={"event": "upstream_error", "kind": "too_large",
                                                                 "detail": str(e)})
                failed = error_response(502, f"{e} (--max-answer-bytes)", "UpstreamError", extra)
                return failed, None, "too_large", None
            done = True
            if status >= 500:
                failed = _upstream_status(status, data, resp.headers)
                failed.headers.extend(extra)
                return failed, None, "http_5xx", None
            if status >= 400 and resp.content_type != "application/json":  # (a server's own refusal: a head too
                # long for it, a plain-text 4xx of a proxy in between) in the shape every client of the API reads
                return _plain_refusal(status, data, resp.headers, extra), None, "http_4xx", None
            out = Response(body=data, status=status, headers=self._down_headers(resp.headers) + extra)
            if status >= 300:
                return out, None, "http_4xx" if status >= 400 else "http_other", None
            usage = obj = None
            if b'"usage"' in data:
                try:
                    obj = loads(data)
                except ValueError:
                    obj = None
                u = obj.get("usage") if type(obj) is dict else None
                usage = u if type(u) is dict else None
            return out, usage, None, obj
        except Exception as e:
            return (*self.failure(e, extra), None)
        finally:
            if done:
                resp.release()
            else:
                resp.close()

    def failure(self, e: BaseException, extra: list[tuple[str, str]] | None = None) -> tuple[Response, None, str]:
        """The answer to a request the upstream failed (``e``: a timeout or connection error; anything else is
        re-raised), its kind, logged."""
        if isinstance(e, TimeoutError):
            exc: KvgateError = UpstreamTimeout(f"the upstream timed out ({one_line(e, 300)})")
            kind = "timeout"
        elif isinstance(e, UpstreamConnectError):
            exc, kind = UpstreamError(f"the upstream is unreachable: {one_line(e, 300)}"), "connect"
        elif isinstance(e, OSError):
            exc, kind = UpstreamError(f"the upstream connection failed: {one_line(e, 300)}"), "disconnect"
        else:
            raise e
        log.warning("upstream %s", kind, extra={"event": "upstream_error", "kind": kind, "detail": str(exc)})
        out = exc_response(exc)
        if extra:
            out.headers.extend(extra)
        return out, None, kind

    # -- any other path ------------------------------------------------------------------------------------
    async def passthrough(self, request: Request) -> StreamResponse:
        """Relay the request to the upstream as it is (method, headers but hop-by-hop ones, body)."""
        assert self.client is not None
        raw = request.body  # whole, within --max-body-bytes (else the server answered 413)
        try:
            resp = await self.client.request(
                request.method, self._target(request), self._up_headers(request.headers, False), raw
            )
        except Exception as e:
            failed, _, kind = self.failure(e)
            self.errors[kind] += 1
            return failed
        done = False
        try:
            size = resp.content_length
            headers = self._down_headers(resp.headers)
            if request.method == "HEAD" or (size is not None and size <= PASSTHROUGH_READ_LIMIT):
                try:
                    data = await resp.read()
                except Exception as e:
                    failed, _, kind = self.failure(e)
                    self.errors[kind] += 1
                    return failed
                done = True
                return Response(body=data, status=resp.status, headers=headers)
            out = StreamResponse(status=resp.status, headers=headers)
            failure = await relay(request, resp, out, None)
            if failure is not None and failure != "client":
                self.errors[failure] += 1
            done = failure is None
            return out
        finally:
            if done:
                resp.release()
            else:
                resp.close()


def turn_target(raw_path: str, path: str) -> str:
    """A turn's target upstream: its path and query as sent, or, for one routed by its decoded path
    (``/v1/chat%2Fcompletions``), the turn's own ``path`` with its query."""
    if raw_path.startswith(path) and raw_path[len(path):len(path) + 1] in ("", "?"):
        return raw_path
    query = raw_path.partition("?")[2]
    return path + ("?" + query if query else "")


def _plain_refusal(status: int, data: bytes, headers: Any, extra: list[tuple[str, str]]) -> Response:
    """An upstream's 4xx that is not JSON, in the error shape (its text, its ``Retry-After`` kept)."""
    text = " ".join(data[:300].decode("utf-8", "replace").split())
    kept = [(k, v) for k, v in headers.items() if k.lower() == "retry-after"]
    return error_response(status, f"the upstream answered {status}: {text}", "UpstreamError", kept + extra)


def _upstream_status(status: int, data: bytes, headers: Any) -> Response:
    """502 for an upstream 5xx, with the upstream's message (OpenAI's or FastAPI's shape) and ``Retry-After``."""
    detail = data[:500].decode("utf-8", "replace")
    try:
        obj = loads(data)
        err = obj.get("error") if type(obj) is dict else None
        if type(err) is dict and err.get("message"):
            detail = str(err["message"])
        elif type(obj) is dict and obj.get("detail"):
            detail = str(obj["detail"])
    except ValueError:
        pass
    extra = {"Retry-After": headers["Retry-After"]} if "Retry-After" in headers else None
    return error_response(502, f"the upstream answered {status}: {one_line(detail, 300)}", "UpstreamError", extra)


async def relay(
    request: Request, resp: UpResponse, out: StreamResponse, scanner: UsageScanner | None,
    marks: list[int] | None = None,
) -> str | None:
    """Relay the upstream body chunk by chunk as it arrives; the failure kind, or None when it all went through;
    ``marks[1]``: set to the wall-clock ns of the first chunk.

    "client": the client went away (a write failed); "timeout" / "disconnect": the upstream failed, and the
    client got an error event (vLLM's shape) and ``data: [DONE]`` (the status line was sent already).
    """
    try:
        await out.prepare(request)
    except ConnectionError:
        return "client"
    error: BaseException | None = None
    held = b""
    while True:
        try:
            chunk = await resp.readany()
        except Exception as e:  # the upstream failed or timed out mid-body
            error = e
            break
        if not chunk:
            break
        if marks is not None and not marks[1]:
            marks[1] = time.time_ns()
        if scanner is not None:
            chunk = scanner.feed(chunk)
            if not chunk:
                continue
            if chunk.endswith(_DONE):
                # the stream's last event: it goes out with the end of the body, in one write
                held += chunk
                continue
        try:
            if held:  # (data after [DONE]: unusual, relayed as it is)
                chunk, held = held + chunk, b""
            await out.write(chunk)
        except ConnectionError:
            return "client"
    try:
        if scanner is not None:
            held += scanner.flush()
        if error is not None:
            timeout = isinstance(error, TimeoutError)
            what = "timed out" if timeout else "failed"
            event = error_object(504 if timeout else 502, f"the upstream {what} mid-stream: {one_line(error, 300)}",
                                 "UpstreamTimeout" if timeout else "UpstreamError")
            log.warning("upstream failed mid-stream", extra={"event": "upstream_error", "detail": one_line(error, 300)})
            held += b"data: " + dumps(event) + b"\n\n" + _DONE
        await out.write_eof(held)
    except ConnectionError:
        return "client"
    if error is not None:
        return "timeout" if isinstance(error, TimeoutError) else "disconnect"
    return None
