"""The HTTP client of the agent driver (``kvgate drive``): requests, replies, retries, probes.

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
answer, else the run cannot start; then :func:`kvgate.http.openai.discover` tells the kind, the pool C and
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
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from kvgate.drive.replies import (
    AttemptError,
    ErrorHook,
    Reply,
    copy_gateway,
    gateway_headers_into,
    one_line,
    parse_completion,
    read_stream,
    retry_after,
)
from kvgate.errors import UsageError
from kvgate.http.dialect import CHAT, SGLANG, VLLM, Api
from kvgate.http.openai import GATEWAY_INFO_PATH, EngineInfo, Unreachable, discover

BACKOFF_CAP_S = 8.0
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
    kv_pool: int | None = None
    """The engine's KV pool C in tokens when it told us ((num_gpu_blocks - 1) x block_size on vLLM)."""
    block_size: int | None = None
    engine: EngineInfo = field(default_factory=EngineInfo)
    """Everything discovery found (:mod:`kvgate.http.openai`)."""

    @property
    def gateway(self) -> dict[str, Any] | None:
        """The kvgate gateway's ``/kvgate/info`` when the endpoint is one, else None."""
        return self.engine.gateway


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
            reason = one_line(str(e) or type(e).__name__)
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
            models=models, kind=eng.engine_kind, cache_report=eng.cache_report, kv_pool=eng.kv_pool,
            block_size=eng.block_size, engine=eng,
        )

    async def _get_for_discovery(self, path: str) -> tuple[int, bytes]:
        try:
            return await self._get(path, 5.0)
        except aiohttp.ClientConnectorError as e:
            raise Unreachable(one_line(str(e) or type(e).__name__)) from None
        except aiohttp.ClientError as e:
            raise OSError(one_line(f"{type(e).__name__}: {e}")) from None

    async def gateway_info(self) -> dict[str, Any] | None:
        """A kvgate gateway's ``/kvgate/info`` now (its control, counters, sessions); None if it does not
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
        api: Api = CHAT,
    ) -> Reply:
        """Send one turn with the retry policy of the module docstring. Never raises but CancelledError."""
        attempt = 0
        while True:
            attempt += 1
            try:
                r = await self._attempt(path, body, headers, stream, api)
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

    async def _attempt(self, path: str, body: bytes, headers: Mapping[str, str], stream: bool, api: Api) -> Reply:
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
                    text = one_line((await resp.read()).decode("utf-8", "replace"))
                    retry = resp.status >= 500 or resp.status == 429
                    raise AttemptError(
                        f"HTTP {resp.status}: {text}" if text else f"HTTP {resp.status}",
                        http_status=resp.status,
                        retryable=retry,
                        retry_after_s=retry_after(resp.headers) if retry else None,
                        kind="http",
                    )
                if stream:
                    r = await read_stream(resp, api)
                    copy_gateway(gw, r)
                    return r
                raw = await resp.read()
        except TimeoutError:
            raise AttemptError(f"no answer within --timeout {self.timeout_s:g} s", kind="timeout") from None
        except aiohttp.ClientResponseError as e:  # e.g. a malformed response line
            raise AttemptError(one_line(f"{type(e).__name__}: {e}"), retryable=True, kind="connect") from None
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as e:
            text = one_line(f"{type(e).__name__}: {e}" if str(e) else type(e).__name__)
            raise AttemptError(text, retryable=True, kind="connect") from None
        try:
            obj = json.loads(raw)
        except ValueError:
            raise AttemptError("response is not JSON", http_status=200, kind="protocol") from None
        r = parse_completion(obj, api)
        copy_gateway(gw, r)
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
        assert VLLM.flush_path is not None and SGLANG.flush_path is not None
        if kind != SGLANG.name:
            path = VLLM.flush_path.partition("?")[0]
            out["endpoint"] = path
            status, text = await self.post_admin(VLLM.flush_path)
            out["attempts"] = 1
            out["answer"] = f"{status} {text}".strip()
            if status == 200:
                out["ok"] = True
                return out
            if status not in (404, 405):
                log(f"flush: POST {path} answered {out['answer']}")
                return out
            out["tried"] = f"{path} {out['answer']}"
        path = SGLANG.flush_path
        out["endpoint"] = path
        out["attempts"] = 0
        while True:
            out["attempts"] += 1
            status, text = await self.post_admin(path)
            out["answer"] = f"{status} {text}".strip()
            if status == 200:
                out["ok"] = True
                return out
            if status != SGLANG.flush_busy:
                log(f"flush: POST {path} answered {out['answer']}; giving up")
                return out
            log(f"flush: {path} answered {status} (requests running) to attempt {out['attempts']}; retrying")
            await asyncio.sleep(retry_s)

    async def post_admin(self, path: str, body: Any = None) -> tuple[int | None, str]:
        """``POST path`` (with ``body`` as JSON, if any): the status (None: no answer) and the answer's first line."""
        try:
            timeout = aiohttp.ClientTimeout(total=60.0)
            async with self.session.post(self.base + path, json=body, timeout=timeout) as resp:
                return resp.status, one_line((await resp.read()).decode("utf-8", "replace"), 120)
        except (aiohttp.ClientError, TimeoutError, OSError) as e:
            return None, one_line(f"{type(e).__name__}: {e}", 120)
