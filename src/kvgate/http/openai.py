"""The OpenAI-compatible wire, as every kvgate program speaks it."""

from __future__ import annotations

from typing import Any

import orjson


def error_object(status: int, message: str, kind: str, param: str | None = None) -> dict[str, Any]:
    """An error as vLLM and OpenAI servers answer them: ``{"error": {"message", "type", "param", "code"}}``."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def error_body(status: int, message: str, kind: str, param: str | None = None) -> bytes:
    """:func:`error_object` as a JSON body."""
    return orjson.dumps(error_object(status, message, kind, param))
