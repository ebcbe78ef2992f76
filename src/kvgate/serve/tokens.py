"""vLLM's ``/tokenize`` and ``/detokenize`` over the stand-in tokenizer (:mod:`kvgate.serve.tokenizer`)."""

from __future__ import annotations

from aiohttp import web

from kvgate.serve.errors import ApiError
from kvgate.serve.parse import chat_ids, check_model, json_response, read_json
from kvgate.serve.served import ServedEngine
from kvgate.serve.tokenizer import TokenizeError


class TokenRoutes:
    """Text (or chat messages) to token ids and back, with the served engine's tokenizer."""

    def __init__(self, served: ServedEngine) -> None:
        self.served = served

    async def tokenize(self, request: web.Request) -> web.StreamResponse:
        s = self.served
        body = await read_json(request)
        check_model(body, s.model)
        if "messages" in body:
            ids = chat_ids(body, s.tokenizer)
        elif isinstance(body.get("prompt"), str):
            ids = s.tokenizer.encode(body["prompt"])
        else:
            raise ApiError(400, "/tokenize needs 'prompt' (a string) or 'messages'", param="prompt")
        return json_response({"count": len(ids), "max_model_len": s.max_model_len, "tokens": ids, "token_strs": None})

    async def detokenize(self, request: web.Request) -> web.StreamResponse:
        s = self.served
        body = await read_json(request)
        check_model(body, s.model)
        toks = body.get("tokens")
        if not isinstance(toks, list) or not all(type(x) is int for x in toks):
            raise ApiError(400, "'tokens' must be a list of token ids", param="tokens")
        try:
            text = s.tokenizer.decode(toks)
        except TokenizeError as e:
            raise ApiError(400, str(e), param="tokens") from None
        return json_response({"prompt": text})
