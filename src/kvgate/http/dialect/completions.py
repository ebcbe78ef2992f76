"""``/v1/completions``: a prompt string or token ids, ``max_tokens`` (16 when absent, OpenAI's default), answers as
``choices`` with their ``text`` (and vLLM's ``token_ids`` when asked), usage in OpenAI's shape."""

from __future__ import annotations

from typing import Any

from kvgate.http.dialect.base import Api


class CompletionsApi(Api):
    name = "completions"
    path = "/v1/completions"
    default_budget = 16

    def request_fields(self, token_ids: bool) -> dict[str, Any]:
        """vLLM's ``return_token_ids`` (the driver sends the next turn's prompt as the ids)."""
        return {"return_token_ids": True} if token_ids else {}
