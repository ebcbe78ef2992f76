"""The routes around generation: the model list, health and version, vLLM's prefix-cache reset, SGLang's flush,
server and model info, and kvgate's own stats."""

from __future__ import annotations

from typing import Any

from aiohttp import web

from kvgate import __version__
from kvgate.errors import UsageError
from kvgate.serve.errors import ApiError, error_response
from kvgate.serve.parse import json_response, loads, truthy
from kvgate.serve.served import ServedEngine
from kvgate.workload.triggers import parse_trigger


class AdminRoutes:
    """Everything a served engine answers besides generation, tokenization and metrics."""

    def __init__(self, served: ServedEngine) -> None:
        self.served = served

    async def models(self, _request: web.Request) -> web.StreamResponse:
        s = self.served
        card = {"id": s.model, "object": "model", "created": s.created, "owned_by": "kvgate",
                "root": s.model, "parent": None, "max_model_len": s.max_model_len, "permission": []}
        return json_response({"object": "list", "data": [card]})

    async def health(self, _request: web.Request) -> web.StreamResponse:
        dead = self.served.loop.dead
        if dead is not None:
            return error_response(503, f"engine failed: {dead}", "ServiceUnavailableError")
        return web.Response(status=200)

    async def version(self, _request: web.Request) -> web.StreamResponse:
        return json_response({"version": f"kvgate-{__version__}"})

    async def reset_prefix_cache(self, request: web.Request) -> web.StreamResponse:
        """vLLM's: ``?reset_running_requests=true`` (or ``?preempt=true``, or that JSON field) preempts the
        running requests first, as a restart would; without it the reset fails (409) while any runs."""
        q = request.query
        preempt = truthy(q.get("reset_running_requests")) or truthy(q.get("preempt"))
        if request.can_read_body:
            raw = await request.read()
            if raw.strip():
                try:
                    body = loads(raw)
                except ValueError as e:
                    raise ApiError(400, f"JSON decode error: {e}") from None
                if isinstance(body, dict):
                    preempt = preempt or bool(body.get("reset_running_requests") or body.get("preempt"))
        s = self.served
        if not s.loop.flush(preempt):
            running, waiting = s.queue_lengths()
            raise ApiError(409, f"Prefix cache reset failed: {running} requests running, {waiting} waiting "
                           "(?reset_running_requests=true preempts the running ones).", "ConflictError")
        return web.Response(status=200)

    async def trigger(self, request: web.Request) -> web.StreamResponse:
        """kvgate's ``POST /kvgate/trigger`` ``{"trigger": "KIND:SPEC"}``: a trigger's acts on the engine, from now
        (:mod:`kvgate.workload.triggers`; ``kvgate drive`` plays the triggers it cannot play otherwise here)."""
        try:
            body = loads(await request.read())
            t = parse_trigger(str(body["trigger"]))
        except (UsageError, ValueError, KeyError, TypeError) as e:
            raise ApiError(400, f"expected {{\"trigger\": \"KIND:SPEC\"}}: {e}") from None
        try:
            t.check_engine(self.served.engine)
        except UsageError as e:
            raise ApiError(400, str(e)) from None
        self.served.loop.play(t)
        return json_response({"trigger": f"{t.kind}:{t.spec()}", "acts_min": list(t.engine_acts())})

    async def flush_cache(self, _request: web.Request) -> web.StreamResponse:
        """SGLang's: refused (400) while any request runs or waits."""
        s = self.served
        if s.engine.has_work() or s.loop.pending() or not s.loop.flush(False):
            return web.Response(status=400, text="Flush cache failed.\n")
        return web.Response(
            status=200,
            text="Cache flushed.\nPlease check backend logs for more details. (When there are running or waiting "
            "requests, the operation will not be performed.)\n",
        )

    async def server_info(self, _request: web.Request) -> web.StreamResponse:
        """SGLang's ``/server_info`` (the fields kvgate knows; ``max_total_num_tokens`` is the pool)."""
        s = self.served
        cfg = s.cfg
        info = {
            "model_path": s.model, "served_model_name": s.model, "tokenizer_path": "kvgate",
            "context_length": s.max_model_len, "max_total_num_tokens": s.kv_pool,
            "page_size": s.block_size, "chunked_prefill_size": cfg.max_num_batched_tokens,
            "max_running_requests": cfg.max_num_seqs, "schedule_policy": cfg.sglang_policy,
            "disable_radix_cache": not cfg.prefix_caching, "enable_cache_report": cfg.cache_report,
            "version": f"kvgate-{__version__}", "kvgate_time_scale": cfg.time_scale,
        }
        return json_response(info)

    async def model_info(self, _request: web.Request) -> web.StreamResponse:
        return json_response({"model_path": self.served.model, "tokenizer_path": "kvgate", "is_generation": True})

    async def kvgate_stats(self, _request: web.Request) -> web.StreamResponse:
        return json_response(stats(self.served))

    async def kv_blocks(self, _request: web.Request) -> web.StreamResponse:
        """``/kvgate/kv_blocks``: the pool's cached blocks by the hashes its KV events name them with."""
        out = kv_blocks(self.served)
        if out is None:
            raise ApiError(404, "KV events are off (start kvgate engine with --kv-events-config)", "NotFoundError")
        return json_response(out)


def stats(s: ServedEngine) -> dict[str, Any]:
    """``/kvgate/stats``: the engine loop's clock and lag, the queues, the engine's and the bridge's counts."""
    lp = s.loop
    running, waiting = s.queue_lengths()
    st = s.engine.stats
    lags = sorted(lp.lags) or [0.0]
    return {
        "virtual_time_s": lp.vt, "time_scale": lp.scale, "lag_s": lp.lag, "lag_max_s": lp.lag_max,
        "lag_p50_s": lags[len(lags) // 2], "lag_p99_s": lags[int(0.99 * (len(lags) - 1))],
        "running": running, "waiting": waiting, "usage": s.engine.usage(), "steps": st.steps,
        "preemptions": st.preemptions, "queries": st.queries, "hits": st.hits, "finished": lp.finished,
        "aborted": lp.aborted, "late_arrivals": lp.late, "bridge": s.bridge.stats(),
        "kv_events": None if s.kv_events is None else {"batches": s.kv_events.seq, "unnamed": s.kv_events.unnamed},
    }


def kv_blocks(s: ServedEngine) -> dict[str, Any] | None:
    """The engine's own view of what its KV events describe, read from the pool (None: KV events are off):
    ``blocks`` as ``[hash, copies]``, ``sessions`` as the tokens held in each session key's own blocks (keyed by
    the X-Session-ID of its latest request), ``shared_tokens`` the resident tokens of shared-prefix content (held
    as a group prefix, or by the first session that carried it), ``last_seq`` the sequence number of the last
    batch published."""
    pub = s.kv_events
    pool = getattr(s.engine, "pool", None)
    if pub is None or pool is None:
        return None
    copies, own = pub.resident(*pool.cached_blocks())
    held: dict[str, set[Any]] = {}
    for sid, hashes in own.items():
        hint = pub.hint_of(sid)
        if hint is not None and hashes:
            held.setdefault(hint, set()).update(hashes)
    sessions = {hint: len(hashes) * s.block_size for hint, hashes in held.items()}
    return {
        "block_size": s.block_size, "last_seq": pub.seq - 1 if pub.seq else None,
        "blocks": sorted([h, n] for h, n in copies.items()), "sessions": sessions,
        "shared_tokens": len(pub.group_hashes() & copies.keys()) * s.block_size,
    }
