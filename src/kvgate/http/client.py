"""The OpenAI-compatible HTTP side of the agent driver (``kvgate drive``): requests, replies, retries, probes.

One pooled :class:`aiohttp.ClientSession` serves a whole run; its connector allows as many connections as the
driver allows turns in flight, so a turn never waits for a socket. :meth:`Client.turn` sends one turn (a POST
to ``/v1/completions`` or ``/v1/chat/completions``, plain or SSE-streamed) and folds the answer into a
:class:`Reply`: the text, the completion's token ids when the server returns them (vLLM ``return_token_ids``),
the time of the first streamed token and the usage, with ``cached_tokens`` from
``usage.prompt_tokens_details.cached_tokens`` (None when the server did not report it).

Retry policy (one turn is one logical request; every failed attempt is reported to ``on_error``)::

    attempt ──ok──────────────────────────────────────────────────────────────▶ Reply(ok)
       ├── connection refused / reset, server disconnected, body cut short,
       │   HTTP 5xx, HTTP 429, an error event inside an SSE stream
       │        ──▶ wait backoff_s * 2**i (at most 8 s; a Retry-After header wins, at most 30 s)
       │            and retry, up to ``retries`` times; then ──────────────────▶ Reply(error)
       ├── HTTP 4xx other than 429 (the request itself is wrong) ──────────────▶ Reply(error), no retry
       ├── --timeout exceeded (whole request) ─────────────────────────────────▶ Reply(error), no retry:
       │   resending what an overloaded engine could not finish in time only adds load
       └── a 200 whose body is not an OpenAI completion ───────────────────────▶ Reply(error), no retry

Cancellation (the run's end, Ctrl-C) propagates out of :meth:`Client.turn`: the connection is closed, which
makes vLLM and SGLang abort the request.

Server probing (:meth:`Client.probe`) is best-effort beyond reachability: ``/v1/models`` (or ``/health``) must
answer, else the run cannot start; then :func:`kvgate.http.discovery.discover` tells the kind, the pool C and
the block size (vLLM's ``vllm:cache_config_info``: ``(num_gpu_blocks - 1) x block_size``; SGLang's
``/server_info``, which also tells whether ``--enable-cache-report`` is on, SGLang then omitting ``cached_tokens``
when it is 0; a kvgate gateway's ``/kvgate/info``, with its upstream's). Through a kvgate gateway every reply
carries what the gateway did with the turn (``X-Kvgate-Park-Wait``, ``X-Kvgate-Hold``, ``X-Kvgate-Control``:
:class:`Reply` ``park_wait_s``, ``hold``, ``control``), and :meth:`Client.gateway_info` reads its counters.
Flushing (:meth:`Client.flush`) tries vLLM's ``POST /reset_prefix_cache``
(served only with ``VLLM_SERVER_DEV_MODE=1``) and falls back to SGLang's ``POST /flush_cache``, which answers
400 while requests run and is retried every ``retry_s`` until it succeeds, as the paper did.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from kvgate.errors import UsageError
from kvgate.http.discovery import GATEWAY_INFO_PATH, EngineInfo, Unreachable, discover

BACKOFF_CAP_S = 8.0
RETRY_AFTER_CAP_S = 30.0
PROBE_TIMEOUT_S = 10.0


def normalize_endpoint(url: str) -> str:
    """``http://host:8000``, ``http://host:8000/`` and ``http://host:8000/v1`` all name the same server."""
    u = url.strip().rstrip("/")
    parts = urlsplit(u)
    if parts.scheme not in ("http", "https") or not parts.netloc:
        raise UsageError(f"--endpoint {url!r}: expected an http(s) URL such as http://localhost:8000")
    return u.removesuffix("/v1")


@dataclass(frozen=True, slots=True)
class ServerInfo:
    """What the probe learnt about the server (everything but reachability is best-effort)."""

    models: tuple[str, ...] = ()
    kind: str = "unknown"
    """The engine: "vllm", "sglang" or "unknown" (through a kvgate gateway: its upstream's)."""
    cache_report: bool | None = None
    """SGLang's ``enable_cache_report`` when the server told us; None: unknown."""
    pool_tokens: int | None = None
    """The engine's KV pool C in tokens when it told us ((num_gpu_blocks - 1) x block_size on vLLM)."""
    block_size: int | None = None
    engine: EngineInfo = field(default_factory=EngineInfo)
    """Everything discovery found (:mod:`kvgate.http.discovery`)."""

    @property
    def gateway(self) -> dict[str, Any] | None:
        """The kvgate gateway's ``/kvgate/info`` when the endpoint is one, else None."""
        return self.engine.gateway


@dataclass(slots=True)
class Reply:
    """The outcome of one turn (after retries)."""

    ok: bool
    error: str = ""
    http_status: int | None = None
    """HTTP status of the last attempt (None: no response, e.g. connection refused or timeout)."""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    cached_reported: bool = False
    """Whether ``usage.prompt_tokens_details.cached_tokens`` was present."""
    token_ids: list[int] | None = None
    """Completion token ids, when the server returned them."""
    text: str = ""
    first_token_at: float | None = None
    """Loop time of the first streamed chunk carrying output (None when not streaming)."""
    attempts: int = 0
    usage_seen: bool = False
    park_wait_s: float | None = None
    """Seconds (gateway time) a kvgate gateway held the turn (``X-Kvgate-Park-Wait``); None: no gateway said."""
    hold: str | None = None
    """``X-Kvgate-Hold``: "none", "parked" or "waiting"."""
    control: str | None = None
    """``X-Kvgate-Control``: the gateway's controller when it released the turn."""


@dataclass
class AttemptError(Exception):
    """One failed attempt."""

    text: str
    http_status: int | None = None
    retryable: bool = False
    retry_after_s: float | None = None
    kind: str = "error"
    """"connect", "timeout", "http", "protocol"."""
    extra: dict[str, Any] = field(default_factory=dict)

    def __str__(self) -> str:
        return self.text


ErrorHook = Callable[[AttemptError, int, bool], None]
"""Called for every failed attempt with (error, attempt number from 1, will retry)."""


def _one_line(text: str, limit: int = 300) -> str:
    t = " ".join(text.split())
    return t if len(t) <= limit else t[: limit - 3] + "..."


def _retry_after(headers: Mapping[str, str]) -> float | None:
    v = headers.get("Retry-After")
    if v is None:
        return None
    try:
        s = float(v)
    except ValueError:
        return None
    return min(max(0.0, s), RETRY_AFTER_CAP_S) if math.isfinite(s) else None


def _usage_into(r: Reply, usage: Any) -> None:
    if not isinstance(usage, dict):
        return
    r.usage_seen = True
    p, c = usage.get("prompt_tokens"), usage.get("completion_tokens")
    if isinstance(p, int):
        r.prompt_tokens = p
    if isinstance(c, int):
        r.completion_tokens = c
    details = usage.get("prompt_tokens_details")
    if isinstance(details, dict):
        cached = details.get("cached_tokens")
        if isinstance(cached, int) and not isinstance(cached, bool):
            r.cached_tokens = cached
            r.cached_reported = True


def _choice_into(r: Reply, choice: Any, *, delta: bool) -> bool:
    """Fold one choice (or streamed delta) into ``r``; True if it carried output."""
    if not isinstance(choice, dict):
        raise AttemptError("malformed choice in response", kind="protocol")
    text = choice.get("text")
    if text is None:
        msg = choice.get("delta" if delta else "message")
        text = msg.get("content") if isinstance(msg, dict) else None
    got = False
    if isinstance(text, str) and text:
        r.text += text
        got = True
    ids = choice.get("token_ids")
    if isinstance(ids, list) and ids:
        if not all(type(i) is int for i in ids):
            raise AttemptError("malformed token_ids in response", kind="protocol")
        if r.token_ids is None:
            r.token_ids = []
        r.token_ids.extend(ids)
        got = True
    elif isinstance(ids, list) and r.token_ids is None:
        r.token_ids = []
    return got


def gateway_headers_into(r: Reply, headers: Mapping[str, str]) -> None:
    """What a kvgate gateway did with the turn, from its response headers (nothing when there are none)."""
    wait = headers.get("X-Kvgate-Park-Wait")
    if wait is None:
        return
    try:
        w = float(wait)
    except ValueError:
        w = math.nan
    r.park_wait_s = w if math.isfinite(w) and w >= 0 else None
    r.hold = headers.get("X-Kvgate-Hold")
    r.control = headers.get("X-Kvgate-Control")


def parse_completion(obj: Any) -> Reply:
    """A non-streamed ``/v1/completions`` or ``/v1/chat/completions`` response body."""
    if not isinstance(obj, dict):
        raise AttemptError("response is not a JSON object", kind="protocol")
    if "error" in obj and "choices" not in obj:
        raise AttemptError(f"error in response: {_one_line(json.dumps(obj['error']))}", kind="protocol")
    choices = obj.get("choices")
    if not isinstance(choices, list) or not choices:
        raise AttemptError("response has no choices", kind="protocol")
    r = Reply(ok=True)
    _choice_into(r, choices[0], delta=False)
    _usage_into(r, obj.get("usage"))
    return r


class Client:
    """An OpenAI-compatible endpoint behind one pooled aiohttp session. Use as ``async with Client(...)``."""

    def __init__(
        self,
        endpoint: str,
        *,
        max_connections: int = 4096,
        timeout_s: float = 3600.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        api_key: str | None = None,
    ) -> None:
        self.base = normalize_endpoint(endpoint)
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.retries = retries
        self.backoff_s = backoff_s
        self._auth = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self._session: aiohttp.ClientSession | None = None

    async def __aenter__(self) -> Client:
        # NOTE: limit >= max turns in flight, so a turn never queues for a connection inside aiohttp (that wait
        # would escape the schedule-lag measurement).
        conn = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=0, ttl_dns_cache=300)
        self._session = aiohttp.ClientSession(
            connector=conn,
            timeout=aiohttp.ClientTimeout(total=None),
            headers=self._auth,
            raise_for_status=False,
            cookie_jar=aiohttp.DummyCookieJar(),  # an engine sets no cookies; skip the jar's per-request work
        )
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("Client used outside 'async with'")
        return self._session

    # -- probing --------------------------------------------------------------------------------------------
    async def _get(self, path: str, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[int, bytes]:
        async with self.session.get(self.base + path, timeout=aiohttp.ClientTimeout(total=timeout_s)) as resp:
            return resp.status, await resp.read()

    async def probe(self) -> ServerInfo:
        """Check the endpoint answers (``/v1/models``, else ``/health``); raise UsageError if it does not."""
        try:
            status, body = await self._get("/v1/models")
            if status == 404:
                status, _ = await self._get("/health")
                body = b""
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            reason = _one_line(str(e) or type(e).__name__)
            raise UsageError(f"cannot reach the endpoint {self.base}: {reason}") from None
        if status in (401, 403):
            raise UsageError(f"the endpoint {self.base} refused the request ({status}); pass --api-key")
        if status >= 500:
            raise UsageError(f"the endpoint {self.base} is not healthy: GET /v1/models answered {status}")
        models: tuple[str, ...] = ()
        if status == 200 and body:
            try:
                data = json.loads(body).get("data", [])
                models = tuple(str(m["id"]) for m in data if isinstance(m, dict) and "id" in m)
            except (ValueError, AttributeError, TypeError):
                models = ()
        try:
            eng = await discover(self._get_for_discovery, timeout_s=5.0)
        except Unreachable:
            eng = EngineInfo()
        return ServerInfo(
            models=models, kind=eng.engine_kind, cache_report=eng.cache_report, pool_tokens=eng.pool_tokens,
            block_size=eng.block_size, engine=eng,
        )  # fmt: skip

    async def _get_for_discovery(self, path: str) -> tuple[int, bytes]:
        try:
            return await self._get(path, 5.0)
        except aiohttp.ClientConnectorError as e:
            raise Unreachable(_one_line(str(e) or type(e).__name__)) from None
        except aiohttp.ClientError as e:
            raise OSError(_one_line(f"{type(e).__name__}: {e}")) from None

    async def gateway_info(self) -> dict[str, Any] | None:
        """A kvgate gateway's ``/kvgate/info`` now (its controller, counters, sessions); None if it does not
        answer one."""
        try:
            status, body = await self._get(GATEWAY_INFO_PATH, 5.0)
            info = json.loads(body) if status == 200 else None
        except (aiohttp.ClientError, TimeoutError, OSError, ValueError):
            return None
        return info if isinstance(info, dict) and info.get("kvgate") == "gateway" else None

    # -- turns ----------------------------------------------------------------------------------------------
    async def turn(
        self,
        path: str,
        body: bytes,
        headers: Mapping[str, str],
        *,
        stream: bool,
        on_error: ErrorHook | None = None,
    ) -> Reply:
        """Send one turn with the retry policy of the module docstring. Never raises but CancelledError."""
        attempt = 0
        while True:
            attempt += 1
            try:
                r = await self._attempt(path, body, headers, stream)
                r.attempts = attempt
                return r
            except AttemptError as e:
                again = e.retryable and attempt <= self.retries
                if on_error is not None:
                    on_error(e, attempt, again)
                if not again:
                    return Reply(ok=False, error=e.text, http_status=e.http_status, attempts=attempt)
                wait = e.retry_after_s
                if wait is None:
                    wait = min(BACKOFF_CAP_S, self.backoff_s * 2 ** (attempt - 1))
                await asyncio.sleep(wait)

    async def _attempt(self, path: str, body: bytes, headers: Mapping[str, str], stream: bool) -> Reply:
        hdrs = {"Content-Type": "application/json", **headers}
        if stream:
            hdrs["Accept"] = "text/event-stream"
        try:
            async with self.session.post(
                self.base + path, data=body, headers=hdrs, timeout=aiohttp.ClientTimeout(total=self.timeout_s)
            ) as resp:
                gw: Reply | None = None
                if "X-Kvgate-Park-Wait" in resp.headers:
                    gw = Reply(ok=True)
                    gateway_headers_into(gw, resp.headers)
                if resp.status != 200:
                    text = _one_line((await resp.read()).decode("utf-8", "replace"))
                    retry = resp.status >= 500 or resp.status == 429
                    raise AttemptError(
                        f"HTTP {resp.status}: {text}" if text else f"HTTP {resp.status}",
                        http_status=resp.status,
                        retryable=retry,
                        retry_after_s=_retry_after(resp.headers) if retry else None,
                        kind="http",
                    )
                if stream:
                    r = await _read_stream(resp)
                    _copy_gateway(gw, r)
                    return r
                raw = await resp.read()
        except TimeoutError:
            raise AttemptError(f"no answer within --timeout {self.timeout_s:g} s", kind="timeout") from None
        except aiohttp.ClientResponseError as e:  # e.g. a malformed response line
            raise AttemptError(_one_line(f"{type(e).__name__}: {e}"), retryable=True, kind="connect") from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as e:
            text = _one_line(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            raise AttemptError(text, retryable=True, kind="connect") from None
        try:
            obj = json.loads(raw)
        except ValueError:
            raise AttemptError("response is not JSON", http_status=200, kind="protocol") from None
        r = parse_completion(obj)
        _copy_gateway(gw, r)
        return r

    # -- flushing -------------------------------------------------------------------------------------------
    async def flush(
        self,
        *,
        kind: str = "unknown",
        retry_s: float = 1.0,
        log: Callable[[str], None] = lambda _m: None,
    ) -> dict[str, Any]:
        """Flush the server's prefix cache; returns what happened (endpoint, attempts, ok, last answer).

        Tries vLLM's ``/reset_prefix_cache?reset_running_requests=true`` first (unless the probe found SGLang);
        on 404/405 uses SGLang's ``/flush_cache``, retried every ``retry_s`` while it answers 400.
        """
        out: dict[str, Any] = {"endpoint": None, "attempts": 0, "ok": False, "answer": ""}
        if kind != "sglang":
            out["endpoint"] = "/reset_prefix_cache"
            status, text = await self._post_admin("/reset_prefix_cache?reset_running_requests=true")
            out["attempts"] = 1
            out["answer"] = f"{status} {text}".strip()
            if status == 200:
                out["ok"] = True
                return out
            if status not in (404, 405):
                log(f"flush: POST /reset_prefix_cache answered {out['answer']}")
                return out
            out["tried"] = f"/reset_prefix_cache {out['answer']}"
        out["endpoint"] = "/flush_cache"
        out["attempts"] = 0
        while True:
            out["attempts"] += 1
            status, text = await self._post_admin("/flush_cache")
            out["answer"] = f"{status} {text}".strip()
            if status == 200:
                out["ok"] = True
                return out
            if status != 400:
                log(f"flush: POST /flush_cache answered {out['answer']}; giving up")
                return out
            log(f"flush: /flush_cache answered 400 (requests running) to attempt {out['attempts']}; retrying")
            await asyncio.sleep(retry_s)

    async def _post_admin(self, path: str) -> tuple[int | None, str]:
        try:
            async with self.session.post(self.base + path, timeout=aiohttp.ClientTimeout(total=60.0)) as resp:
                return resp.status, _one_line((await resp.read()).decode("utf-8", "replace"), 120)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            return None, _one_line(f"{type(e).__name__}: {e}", 120)


def _copy_gateway(src: Reply | None, dst: Reply) -> None:
    if src is not None:
        dst.park_wait_s, dst.hold, dst.control = src.park_wait_s, src.hold, src.control


async def _read_stream(resp: aiohttp.ClientResponse) -> Reply:
    """Fold an SSE stream (``data: {...}`` events, ``data: [DONE]``) into a Reply.

    NOTE: events are split by hand rather than with ``resp.content.readline()``: with ``return_token_ids`` vLLM
    puts the whole prompt's ids into the first event, which can exceed aiohttp's line limit.
    """
    loop = asyncio.get_running_loop()
    r = Reply(ok=True)
    buf = b""
    done = False
    async for data in resp.content.iter_any():
        buf += data
        while True:
            nl = buf.find(b"\n")
            if nl < 0:
                break
            line, buf = buf[:nl].strip(), buf[nl + 1 :]
            if not line.startswith(b"data:"):
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                done = True
                continue
            try:
                ev = json.loads(payload)
            except ValueError:
                raise AttemptError("malformed SSE event", http_status=200, kind="protocol") from None
            if not isinstance(ev, dict):
                continue
            if "error" in ev and not ev.get("choices"):
                raise AttemptError(
                    f"error event in stream: {_one_line(json.dumps(ev['error']))}",
                    http_status=200,
                    retryable=True,
                    kind="http",
                )
            choices = ev.get("choices")
            if isinstance(choices, list) and choices:
                got = _choice_into(r, choices[0], delta=True)
                if got and r.first_token_at is None:
                    r.first_token_at = loop.time()
            if ev.get("usage") is not None:
                _usage_into(r, ev["usage"])
    if not done:
        raise AttemptError("stream ended without [DONE]", http_status=200, retryable=True, kind="connect")
    return r
