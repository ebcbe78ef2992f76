"""Reading requests as vLLM does: the body, the model, the prompt (text, token ids, chat messages, a Responses or
Messages conversation), the generation limits and flags; every refusal an :class:`~kvgate.serve.errors.ApiError`
worded as vLLM words it."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from typing import Any

import numpy as np
import orjson
from aiohttp import web

from kvgate.http.dialect import Api
from kvgate.http.openai import SESSION_HEADER
from kvgate.serve.errors import ApiError
from kvgate.serve.tokenizer import VOCAB_SIZE, TokenizeError, Tokenizer

loads: Callable[[bytes], Any] = orjson.loads  # parses a 40K-token prompt ~2.5x faster than json
dumps: Callable[[Any], bytes] = orjson.dumps

def json_response(obj: Any) -> web.Response:
    return web.Response(body=dumps(obj), content_type="application/json")


async def read_json(request: web.Request) -> dict[str, Any]:
    """The request's body, a JSON object."""
    raw = await request.read()
    try:
        body = loads(raw)
    except ValueError as e:
        raise ApiError(400, f"JSON decode error: {e}") from None
    if not isinstance(body, dict):
        raise ApiError(400, "the request body must be a JSON object")
    return body


def check_model(body: dict[str, Any], model: str) -> None:
    """A request naming a model names the served one (404 otherwise, as vLLM)."""
    asked = body.get("model")
    if asked is not None and asked != model:
        raise ApiError(404, f"The model `{asked}` does not exist.", "NotFoundError", "model")


def prompt_ids(prompt: Any, tokenizer: Tokenizer) -> list[int]:
    """A completion's ``prompt`` as token ids: a string, a list of ids, or a list holding one of those."""
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        if not prompt:
            raise ApiError(400, "the prompt is empty", param="prompt")
        return tokenizer.encode(prompt)
    if isinstance(prompt, list) and prompt:
        if isinstance(prompt[0], str | list):
            raise ApiError(400, "kvgate engine takes one prompt per request (a string or a list of token ids)",
                           param="prompt")
        try:
            ok = type(sum(prompt)) is int  # fast, in C: a float anywhere makes the sum a float
        except TypeError:
            ok = False
        if not ok:
            raise ApiError(400, f"prompt token ids must be integers in [0, {VOCAB_SIZE})", param="prompt")
        return prompt
    raise ApiError(400, "'prompt' must be a string, a list of token ids, or a list holding one of those",
                   param="prompt")


def chat_ids(body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    """A chat request's ``messages`` (with ``tools`` and ``add_generation_prompt``) through the chat template."""
    agp = bool(body.get("add_generation_prompt", True))
    try:
        return tokenizer.encode_chat(body["messages"], add_generation_prompt=agp, tools=body.get("tools"))
    except TokenizeError as e:
        raise ApiError(400, str(e), param="messages") from None


def request_ids(api: Api, body: dict[str, Any], tokenizer: Tokenizer) -> list[int]:
    """A request's prompt as token ids: a completion's prompt; a conversation's items through the chat template
    (:meth:`~kvgate.http.dialect.Api.template_messages`, with the tools offered in chat's form)."""
    field = api.prompt_field
    if not api.chat_like:
        if field not in body:
            raise ApiError(400, api.missing_prompt, param=field)
        return prompt_ids(body[field], tokenizer)
    if api.stored_field is not None and body.get(api.stored_field) is not None:
        raise ApiError(400, f"kvgate engine keeps no responses: send the whole input (store false), not "
                       f"{api.stored_field}", param=api.stored_field)
    msgs = api.template_messages(body)
    if msgs is None:
        raise ApiError(400, api.missing_prompt, param=field)
    tools = body.get("tools")
    if tools and not isinstance(tools, list):
        raise ApiError(400, "'tools' must be a list", param=field)
    try:
        return tokenizer.encode_chat(msgs, add_generation_prompt=api.generation_prompt(body),
                                     tools=api.template_tools(body))
    except TokenizeError as e:
        raise ApiError(400, str(e), param=field) from None


def budget_of(api: Api, body: dict[str, Any], prompt_len: int, max_model_len: int, kv_pool: int) -> int:
    """The output tokens a request asks for (:func:`max_tokens` for completions and chat; Responses'
    ``max_output_tokens``; Messages' required ``max_tokens``), checked against the context and the pool."""
    if api.sampling_params:
        return max_tokens(body, prompt_len, api, max_model_len, kv_pool)
    key = api.budget_fields[0]
    val = body.get(key)
    v = body.get("stream")
    if v is not None and not isinstance(v, bool):
        raise ApiError(400, "'stream' must be a boolean", param="stream")
    if val is None:
        if api.budget_required:
            raise ApiError(400, f"{key}: Field required", param=key)
        n = min(api.default_budget, max_model_len - prompt_len)
    else:
        n = int_field(val, key, 1)
    _fits(prompt_len, n, key, "input", max_model_len, kv_pool)
    return n


def _fits(prompt_len: int, n: int, key: str, what: str, m: int, kv_pool: int) -> None:
    if prompt_len >= m:
        raise ApiError(
            400,
            f"This model's maximum context length is {m} tokens. However, your request has {prompt_len} input "
            f"tokens. Please reduce the length of the {what}.",
        )
    if prompt_len + n > m:
        raise ApiError(
            400,
            f"'{key}' is too large: {n}. This model's maximum context length is {m} tokens and your request has "
            f"{prompt_len} input tokens ({n} > {m} - {prompt_len}).",
            param=key,
        )
    if prompt_len + n > kv_pool:
        raise ApiError(400, f"a request of {prompt_len} + {n} tokens can never fit the KV cache of "
                       f"{kv_pool} tokens", param=key)


def token_array(ids: list[int]) -> np.ndarray:
    """Prompt token ids as int64, each checked to be in the vocabulary."""
    try:
        arr = np.fromiter(ids, dtype=np.int64, count=len(ids))
    except (OverflowError, ValueError):
        arr = np.array([-1], dtype=np.int64)
    if arr.min() < 0 or arr.max() >= VOCAB_SIZE:
        raise ApiError(400, f"prompt token ids must be integers in [0, {VOCAB_SIZE})", param="prompt")
    return arr


def max_tokens(body: dict[str, Any], prompt_len: int, api: Api, max_model_len: int, kv_pool: int) -> int:
    """The output tokens a completion or chat request asks for (the first of its budget fields set), checked
    against the context and the KV pool; checks its flags."""
    key = api.budget_fields[-1]
    val = body.get(key)
    for k in api.budget_fields[:-1]:
        if body.get(k) is not None:
            key, val = k, body[k]
            break
    m = max_model_len
    if prompt_len >= m:
        raise ApiError(
            400,
            f"This model's maximum context length is {m} tokens. However, your request has {prompt_len} input "
            f"tokens. Please reduce the length of the input {api.prompt_field}.",
        )
    if val is None:
        n = min(api.default_budget, m - prompt_len)
    else:
        n = int_field(val, key, 1)
        if prompt_len + n > m:
            raise ApiError(
                400,
                f"'max_tokens' or 'max_completion_tokens' is too large: {n}. This model's maximum context "
                f"length is {m} tokens and your request has {prompt_len} input tokens "
                f"({n} > {m} - {prompt_len}).",
                param=key,
            )
    if prompt_len + n > kv_pool:
        raise ApiError(400, f"a request of {prompt_len} + {n} tokens can never fit the KV cache of "
                       f"{kv_pool} tokens", param=key)
    mn = body.get("min_tokens")
    if mn is not None and not 0 <= int_field(mn, "min_tokens", 0) <= n:
        raise ApiError(400, f"min_tokens must be less than or equal to max_tokens={n}, got {mn}.",
                       param="min_tokens")
    for flag in ("ignore_eos", "stream", "return_token_ids", "echo"):
        v = body.get(flag)
        if v is not None and not isinstance(v, bool):
            raise ApiError(400, f"'{flag}' must be a boolean", param=flag)
    if body.get("n") not in (None, 1):
        raise ApiError(400, "kvgate engine generates one choice per request: n must be 1", param="n")
    if body.get("echo"):
        raise ApiError(400, "echo is not supported by kvgate engine", param="echo")
    so = body.get("stream_options")
    if so is not None:
        if not body.get("stream"):
            raise ApiError(400, "Stream options can only be defined when `stream=True`.", param="stream_options")
        if not isinstance(so, dict):
            raise ApiError(400, "'stream_options' must be an object", param="stream_options")
    return n


def session_hint(request: web.Request, body: dict[str, Any]) -> str | None:
    """The session a request names (``X-Session-ID``, or the body's ``session_id``): a hint to the bridge."""
    h = request.headers.get(SESSION_HEADER)
    if h is None:
        v = body.get("session_id")
        h = None if v is None else str(v)
    return h


CACHE_SALT_MAX = 128
"""vLLM's bound on a ``cache_salt`` (characters; none of ``@ / \\`` or NUL)."""


def cache_salt(body: dict[str, Any]) -> int:
    """The request's ``cache_salt`` as the 64-bit value folded into its first block's hash (0: none), refused
    (400) as vLLM refuses it: not a non-empty string of at most 128 characters without ``@``, ``/``, ``\\``, NUL."""
    v = body.get("cache_salt")
    if v is None:
        return 0
    if type(v) is not str or not v or len(v) > CACHE_SALT_MAX or any(c in v for c in "@/\\\0"):
        raise ApiError(400, "Parameter 'cache_salt' must be a non-empty string of at most 128 characters without "
                       "'@', '/', '\\\\' or NUL.", param="cache_salt")
    return int.from_bytes(hashlib.blake2b(v.encode(), digest_size=8).digest(), "little") | 1


def int_field(v: Any, name: str, lo: int) -> int:
    if type(v) is not int or v < lo:
        raise ApiError(400, f"'{name}' must be an integer >= {lo}, got {v!r}", param=name)
    return v


def truthy(v: str | None) -> bool:
    """A query flag's value read as a boolean."""
    return v is not None and v.lower() in ("1", "true", "yes", "on")
