"""Errors as vLLM answers them: JSON bodies (:func:`kvgate.http.openai.error_body`), never a traceback."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

import orjson
from aiohttp import web

from kvgate.errors import ClientError
from kvgate.http.openai import error_body

log = logging.getLogger("kvgate.serve")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]


class ApiError(ClientError):
    """An error answered as vLLM does: ``{"error": {"message", "type", "param", "code"}}``."""

    def __init__(self, status: int, message: str, kind: str = "BadRequestError", param: str | None = None) -> None:
        super().__init__(message)
        self.http_status = status
        self.kind = kind
        self.param = param

    def response(self) -> web.Response:
        return error_response(self.http_status, str(self), self.kind, self.param)


def error_response(status: int, message: str, kind: str, param: str | None = None) -> web.Response:
    """The JSON error response."""
    return web.Response(status=status, body=error_body(status, message, kind, param), content_type="application/json")


@web.middleware
async def error_middleware(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every error as JSON; never a traceback to the client."""
    try:
        return await handler(request)
    except ApiError as e:
        return e.response()
    except web.HTTPException as e:
        if e.status >= 400:  # unknown route, wrong method: FastAPI's shape, as vLLM answers them
            body = orjson.dumps({"detail": e.reason})
            return web.Response(status=e.status, body=body, content_type="application/json")
        raise
    except asyncio.CancelledError:
        raise
    except Exception:
        log.exception("error handling %s %s", request.method, request.path)
        return error_response(500, "internal server error", "InternalServerError")
