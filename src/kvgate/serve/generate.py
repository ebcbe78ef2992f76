"""The OpenAI generation routes: ``/v1/completions`` and ``/v1/chat/completions``, whole or streamed (SSE).

A request is stamped with its arrival on the engine loop's clock before its body is read, parsed and tokenized;
its token sequence (prompt + the filler output it will produce) goes through the content bridge to a SeqKey, and
its :class:`~kvgate.serve.loop.Turn` waits for the engine loop to deliver its tokens."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from aiohttp import web

from kvgate.engine.base import Request
from kvgate.http.dialect import CHAT, Api
from kvgate.serve.errors import ApiError
from kvgate.serve.loop import EngineFailed, Turn
from kvgate.serve.parse import (
    chat_ids,
    check_model,
    json_response,
    max_tokens,
    prompt_ids,
    read_json,
    session_hint,
    token_array,
)
from kvgate.serve.served import ServedEngine
from kvgate.serve.sse import DONE, ChunkWriter, error_event
from kvgate.serve.tokenizer import filler_array, filler_text

UNAVAILABLE = "ServiceUnavailableError"


class Generation:
    """The generation routes over one served engine."""

    def __init__(self, served: ServedEngine) -> None:
        self.served = served

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=False)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, chat=True)

    async def _serve(self, request: web.Request, chat: bool) -> web.StreamResponse:
        s = self.served
        token, arrived = s.loop.expect()
        try:
            body = await read_json(request)
            check_model(body, s.model)
            field = "messages" if chat else "prompt"
            if field not in body:
                raise ApiError(400, f"'{field}' is required", param=field)
            ids = chat_ids(body, s.tokenizer) if chat else prompt_ids(body["prompt"], s.tokenizer)
            return await self._generate(request, body, ids, chat, token, arrived)
        finally:
            s.loop.forget(token)

    async def _generate(
        self, request: web.Request, body: dict[str, Any], ids: list[int], chat: bool, token: int, arrived: float
    ) -> web.StreamResponse:
        s = self.served
        n = max_tokens(body, len(ids), chat, s.max_model_len, s.kv_pool)
        stream = bool(body.get("stream"))
        hint = session_hint(request, body)
        arr = token_array(ids)
        out = filler_array(n, chat)
        tokens = np.concatenate((arr, out))
        key, content = s.bridge.assign(tokens, len(ids), hint)
        req = Request(s.next_rid(), key, len(ids), n, arrived, None)
        if s.kv_events is not None:
            s.kv_events.track(key, tokens, content.hashes, hint)
        turn = Turn(req, content, stream)
        req.tag = turn
        try:
            s.loop.submit(turn, token)
        except BaseException as e:
            s.bridge.release(content)
            if s.kv_events is not None:
                s.kv_events.untrack(key)
            if isinstance(e, EngineFailed):
                raise ApiError(503, str(e), UNAVAILABLE) from None
            raise
        rid = s.response_id(req.rid, chat)
        created = int(time.time())
        want_ids = bool(body.get("return_token_ids"))
        if stream:
            so = body.get("stream_options") or {}
            return await self._stream(request, turn, rid, created, chat, bool(so.get("include_usage")),
                                      out.tolist() if want_ids else None)
        try:
            while not turn.done:
                await turn.wake.wait()
                turn.wake.clear()
        finally:
            if not turn.done:
                s.loop.abort(turn)
        if turn.error is not None:
            raise ApiError(503, turn.error, UNAVAILABLE)
        out_ids = out[: req.generated].tolist() if want_ids else None
        return json_response(self._whole(req, rid, created, chat, ids, out_ids))

    def _whole(
        self, req: Request, rid: str, created: int, chat: bool, ids: list[int], out_ids: list[int] | None
    ) -> dict[str, Any]:
        """The body of a finished request answered whole (``out_ids``: with vLLM's ``return_token_ids``)."""
        s = self.served
        text = filler_text(0, req.generated, chat)
        choice: dict[str, Any]
        resp: dict[str, Any]
        if chat:
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": []},
                      "logprobs": None, "finish_reason": "length", "stop_reason": None}
            resp = {"id": rid, "object": "chat.completion", "created": created, "model": s.model}
            if out_ids is not None:
                choice["token_ids"] = out_ids
                resp["prompt_token_ids"] = ids
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": "length", "stop_reason": None}
            resp = {"id": rid, "object": "text_completion", "created": created, "model": s.model}
            if out_ids is not None:
                choice["token_ids"] = out_ids
                choice["prompt_token_ids"] = ids
        resp["choices"] = [choice]
        resp["usage"] = usage_object(req, s.created_block, s.cache_details)
        return resp

    async def _stream(
        self, request: web.Request, turn: Turn, rid: str, created: int, chat: bool, include_usage: bool,
        token_ids: list[int] | None,
    ) -> web.StreamResponse:
        s = self.served
        req = turn.req
        total = req.max_tokens
        w = ChunkWriter(rid, created, s.model, chat=chat, token_ids=token_ids)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        sent = 0
        try:
            await resp.prepare(request)
            while True:
                await turn.wake.wait()
                turn.wake.clear()
                if turn.error is not None:
                    await resp.write(error_event(turn.error, 503, UNAVAILABLE) + DONE)
                    break
                v = turn.visible
                if v > sent:
                    data = w.tokens(sent, v, total)
                    if chat and sent == 0:
                        data = w.role() + data
                    sent = v
                    if not turn.done:
                        await resp.write(data)
                        continue
                else:
                    data = b""
                if turn.done:
                    if include_usage:
                        data += w.usage(usage_object(req, s.created_block, s.cache_details))
                    await resp.write(data + DONE)
                    break
        except ConnectionError:
            pass  # the client went away; the finally clause aborts the request
        finally:
            if not turn.done:
                s.loop.abort(turn)
        return resp


def usage_object(req: Request, created_block: int, details_on: bool | None = True, api: Api = CHAT) -> dict[str, Any]:
    """The usage object in ``api``'s dialect (:meth:`kvgate.http.dialect.Api.make_usage`); with ``created_block``
    (the vLLM engine's block size, 0 otherwise) vLLM 0.32's ``created_cache_tokens`` too: the prompt tokens computed
    into cached (full) blocks. ``details_on`` None: ``prompt_tokens_details`` null (vLLM without
    --enable-prompt-tokens-details); False: absent (SGLang without --enable-cache-report)."""
    p, g = req.prompt, req.generated
    cached = max(req.cached, 0)
    created = max(0, p // created_block * created_block - cached) if created_block else None
    return api.make_usage(p, cached, g, details=details_on, created=created)
