"""The wire dialects: what each API and each engine kind says on the wire, in one place. The gateway, the driver,
``kvgate doctor`` and ``kvgate engine`` all read them here.

APIs (:class:`Api`; :data:`APIS` by name, :func:`api_for_path` by path)::

    api          path                  prompt                      output budget
    completions  /v1/completions       prompt                      max_tokens
    chat         /v1/chat/completions  messages                    max_completion_tokens, else max_tokens
    responses    /v1/responses         instructions, input         max_output_tokens
    messages     /v1/messages          system, messages            max_tokens

    api          usage: prompt                  cached                                 output
    completions  prompt_tokens                  prompt_tokens_details.cached_tokens    completion_tokens
    chat         prompt_tokens                  prompt_tokens_details.cached_tokens    completion_tokens
    responses    input_tokens                   input_tokens_details.cached_tokens     output_tokens
    messages     input_tokens + cache_read_     cache_read_input_tokens                output_tokens
                 input_tokens + cache_creation_input_tokens

* Cached tokens are reported in vLLM with ``--enable-prompt-tokens-details`` for completions, chat and Messages (a
  Messages answer then has ``cache_read_input_tokens``; without it the field is absent and ``input_tokens`` is the
  whole prompt), always for Responses; in SGLang with ``--enable-cache-report``. Anthropic's ``input_tokens`` counts
  only the uncached part (vLLM: ``prompt - cache_read - cache_creation``), so the prompt is the sum of the three.
* Streams. Completions and chat carry usage only with ``stream_options.include_usage``, in a chunk with
  ``"choices": []`` before ``data: [DONE]``; Responses in the ``response.completed`` (or ``.incomplete``,
  ``.failed``) event's ``response.usage``; Messages in ``message_start``'s ``message.usage`` (the input) and
  ``message_delta``'s ``usage`` (the output; vLLM repeats the input there): the stream's usage is the merge of
  both, later fields winning.
* A conversation is a *head* (chat's leading system/developer messages, Responses' ``instructions`` and leading
  system/developer input items, Messages' ``system``) and *items* (the messages or input items after it). Every
  item reads as ``(role, text, calls)`` (:meth:`Api.parts`): a tool call is ``(id, name, arguments)``.

Each API is a module of its own (:mod:`~kvgate.http.dialect.completions`, :mod:`~kvgate.http.dialect.chat`,
:mod:`~kvgate.http.dialect.responses`, :mod:`~kvgate.http.dialect.messages`) holding all it says on the wire: what
a client sends and reads (the driver, ``kvgate doctor``), what the gateway reads of bodies and streams, and what an
engine answers (``kvgate engine``); what they share is :mod:`~kvgate.http.dialect.base`'s. Engine kinds
(:class:`EngineKind`; :data:`KINDS` by name) are :mod:`~kvgate.http.dialect.kinds`'.

Nothing here does I/O; readers never raise on odd input (a field of the wrong type reads as absent).
"""

from __future__ import annotations

from kvgate.http.dialect.base import Answer, AnswerWriter, Api, Call, Fold, Parts, Tool, Usage, WireError
from kvgate.http.dialect.chat import ChatApi
from kvgate.http.dialect.completions import CompletionsApi
from kvgate.http.dialect.kinds import (
    DYNAMO,
    FLUSH_PATHS,
    GATEWAY,
    KINDS,
    SGLANG,
    UNKNOWN,
    VLLM,
    EngineKind,
    Metrics,
    kind_of,
)
from kvgate.http.dialect.messages import MessagesApi
from kvgate.http.dialect.responses import ResponsesApi

COMPLETIONS, CHAT, RESPONSES, MESSAGES = CompletionsApi(), ChatApi(), ResponsesApi(), MessagesApi()
APIS: dict[str, Api] = {a.name: a for a in (COMPLETIONS, CHAT, RESPONSES, MESSAGES)}
"""The APIs by name (``--api`` values)."""
_BY_PATH = {a.path: a for a in APIS.values()}


def api_for_path(path: str) -> Api | None:
    """The API served at ``path`` (``/v1/messages/count_tokens`` is none: it is not a turn)."""
    return _BY_PATH.get(path)


__all__ = [
    "APIS", "CHAT", "COMPLETIONS", "DYNAMO", "FLUSH_PATHS", "GATEWAY", "KINDS", "MESSAGES", "RESPONSES", "SGLANG",
    "UNKNOWN", "VLLM", "Answer", "AnswerWriter", "Api", "Call", "EngineKind", "Fold", "Metrics", "Parts", "Tool",
    "Usage", "WireError", "api_for_path", "kind_of",
]
