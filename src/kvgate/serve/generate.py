"""The generation routes: ``/v1/completions``, ``/v1/chat/completions``, ``/v1/responses`` and ``/v1/messages``
(with ``/v1/messages/count_tokens``), whole or streamed (SSE).

A request is stamped with its arrival on the engine loop's clock before its body is read, parsed and tokenized
(a conversation of any API through the chat template); its token sequence (prompt + the filler output it will
produce) goes through the content bridge to a SeqKey, and its :class:`~kvgate.serve.loop.Turn` waits for the engine
loop to deliver its tokens. A conversation that offers tools is an agent's turn: :mod:`kvgate.serve.agent` decides
its length and whether it ends in a tool call of harmless arguments (:mod:`kvgate.serve.tools`) or answers and ends;
Responses and Messages answers are their dialects' (:meth:`kvgate.http.dialect.Api.writer`)."""

from __future__ import annotations

import time
from typing import Any

import numpy as np
from aiohttp import web

from kvgate.engine.base import Request
from kvgate.http.dialect import CHAT, COMPLETIONS, MESSAGES, RESPONSES, AnswerWriter, Api, Tool
from kvgate.serve.agent import Finish, Reply
from kvgate.serve.errors import ApiError
from kvgate.serve.loop import EngineFailed, Turn
from kvgate.serve.parse import (
    budget_of,
    cache_salt,
    check_model,
    json_response,
    read_json,
    request_ids,
    session_hint,
    token_array,
)
from kvgate.serve.served import ServedEngine
from kvgate.serve.sse import DONE, ChunkWriter, error_event
from kvgate.serve.tokenizer import filler_array, filler_text
from kvgate.serve.written import Written

UNAVAILABLE = "ServiceUnavailableError"
FINISH_REASONS: dict[str, str] = {"tool": "tool_calls", "stop": "stop", "length": "length"}
"""Chat's ``finish_reason`` for each way an answer ends."""


class Generation:
    """The generation routes over one served engine."""

    def __init__(self, served: ServedEngine) -> None:
        self.served = served

    async def completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, COMPLETIONS)

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, CHAT)

    async def responses(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, RESPONSES)

    async def messages(self, request: web.Request) -> web.StreamResponse:
        return await self._serve(request, MESSAGES)

    async def count_tokens(self, request: web.Request) -> web.StreamResponse:
        """``/v1/messages/count_tokens``: the prompt's tokens, through the chat template (``{"input_tokens": n}``)."""
        s = self.served
        body = await read_json(request)
        check_model(body, s.model)
        return json_response({"input_tokens": len(request_ids(MESSAGES, body, s.tokenizer))})

    async def _serve(self, request: web.Request, api: Api) -> web.StreamResponse:
        s = self.served
        token, arrived = s.loop.expect()
        try:
            body = await read_json(request)
            check_model(body, s.model)
            ids = request_ids(api, body, s.tokenizer)
            n = budget_of(api, body, len(ids), s.max_model_len, s.kv_pool)
            reply = s.agent.reply(api, body, n)
            if reply is None:  # no tools: the whole budget; completions and chat that set one say it cut them
                given = api.sampling_params and (not api.chat_like
                                                 or any(body.get(k) is not None for k in api.budget_fields))
                reply = Reply(n, None, "length" if given else "stop")
            return await self._generate(request, body, ids, api, reply, token, arrived)
        finally:
            s.loop.forget(token)

    async def _generate(
        self, request: web.Request, body: dict[str, Any], ids: list[int], api: Api, reply: Reply, token: int,
        arrived: float,
    ) -> web.StreamResponse:
        s = self.served
        n, call, written = reply.tokens, reply.call, reply.text
        chat = api.chat_like
        stream = bool(body.get("stream"))
        hint = session_hint(request, body)
        arr = token_array(ids)
        out = filler_array(n, chat) if written is None else written.ids
        tokens = np.concatenate((arr, out))
        key, content = s.bridge.assign(tokens, len(ids), hint, cache_salt(body))
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
        rid = s.response_id(req.rid, api.name)
        created = int(time.time())
        w = api.writer(rid, created, s.model, call, api.budget(body, n), reply.finish,
                       _agent_text if written is None else written.text)
        if w is not None:
            if stream:
                return await self._stream(request, turn, w, api)
            await self._finish(turn)
            return json_response(w.whole(req.generated, self._usage(req, api)))
        want_ids = bool(body.get("return_token_ids"))
        if stream:
            so = body.get("stream_options") or {}
            cw = ChunkWriter(rid, created, s.model, chat=chat, token_ids=out.tolist() if want_ids else None,
                             call=call, finish=reply.finish, pieces=None if written is None else written.piece_json)
            return await self._stream(request, turn, cw, api, bool(so.get("include_usage")))
        await self._finish(turn)
        out_ids = out[: req.generated].tolist() if want_ids else None
        return json_response(self._whole(req, rid, created, chat, ids, out_ids, call, reply.finish, written))

    async def _finish(self, turn: Turn) -> None:
        """Wait until the engine finished the request (abort it if the client goes away first)."""
        try:
            while not turn.done:
                await turn.wake.wait()
                turn.wake.clear()
        finally:
            if not turn.done:
                self.served.loop.abort(turn)
        if turn.error is not None:
            raise ApiError(503, turn.error, UNAVAILABLE)

    def _usage(self, req: Request, api: Api) -> dict[str, Any]:
        s = self.served
        return usage_object(req, s.created_block, s.cache_details, api)

    def _whole(
        self, req: Request, rid: str, created: int, chat: bool, ids: list[int], out_ids: list[int] | None,
        call: Tool | None, finish: Finish = "length", written: Written | None = None,
    ) -> dict[str, Any]:
        """The body of a finished request answered whole (``out_ids``: with vLLM's ``return_token_ids``)."""
        s = self.served
        text = filler_text(0, req.generated, chat) if written is None else written.text(0, req.generated)
        choice: dict[str, Any]
        resp: dict[str, Any]
        if chat:
            calls = [] if call is None else [{"id": "call_" + rid.partition("-")[2], "type": "function",
                                              "function": {"name": call[0], "arguments": call[1]}}]
            choice = {"index": 0, "message": {"role": "assistant", "content": text, "tool_calls": calls},
                      "logprobs": None, "finish_reason": FINISH_REASONS[finish],
                      "stop_reason": None}
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
        resp["usage"] = self._usage(req, CHAT if chat else COMPLETIONS)
        return resp

    async def _stream(
        self, request: web.Request, turn: Turn, w: ChunkWriter | AnswerWriter, api: Api, include_usage: bool = True
    ) -> web.StreamResponse:
        """Stream the request's tokens as the engine produces them, in ``w``'s events."""
        s = self.served
        req = turn.req
        total = req.max_tokens
        agent = isinstance(w, AnswerWriter)
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        sent = 0
        try:
            await resp.prepare(request)
            while True:
                await turn.wake.wait()
                turn.wake.clear()
                if turn.error is not None:
                    await resp.write(error_event(turn.error, 503, UNAVAILABLE) + (b"" if agent else DONE))
                    break
                v = turn.visible
                data = b""
                if v > sent:
                    if sent == 0:  # the opening (Responses and Messages), or chat's role chunk, with the first token
                        data = w.opening(self._usage(req, api)) if isinstance(w, AnswerWriter) else w.role()
                    data += w.tokens(sent, v) if isinstance(w, AnswerWriter) else w.tokens(sent, v, total)
                    sent = v
                    if not turn.done:
                        await resp.write(data)
                        continue
                if turn.done:
                    if isinstance(w, AnswerWriter):
                        data += w.closing(req.generated, self._usage(req, api))
                    else:
                        data += w.end(self._usage(req, api) if include_usage else None)
                    await resp.write(data)
                    break
        except ConnectionError:
            pass  # the client went away; the finally clause aborts the request
        finally:
            if not turn.done:
                s.loop.abort(turn)
        return resp


def _agent_text(start: int, stop: int) -> str:
    """An agent answer's text: the filler output, as chat's (so a harness sending it back reuses its KV exactly)."""
    return filler_text(start, stop, True)


def usage_object(req: Request, created_block: int, details_on: bool | None = True, api: Api = CHAT) -> dict[str, Any]:
    """The usage object in ``api``'s dialect (:meth:`kvgate.http.dialect.Api.make_usage`); with ``created_block``
    (the vLLM engine's block size, 0 otherwise) vLLM 0.32's ``created_cache_tokens`` too: the prompt tokens computed
    into cached (full) blocks. ``details_on`` None: ``prompt_tokens_details`` null (vLLM without
    --enable-prompt-tokens-details); False: absent (SGLang without --enable-cache-report)."""
    p, g = req.prompt, req.generated
    cached = max(req.cached, 0)
    created = max(0, p // created_block * created_block - cached) if created_block else None
    return api.make_usage(p, cached, g, details=details_on, created=created)
