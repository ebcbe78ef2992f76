"""The gateway's logs: one JSON object per line on stderr (``--log-level``)."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Iterable
from typing import Any

_RESERVED = frozenset(vars(logging.LogRecord("", 0, "", 0, "", None, None))) | {"message", "asctime"}


class JsonFormatter(logging.Formatter):
    """One JSON object per line: ``ts`` (RFC 3339, UTC), ``level``, ``logger``, ``msg``, then any ``extra`` fields."""

    def format(self, record: logging.LogRecord) -> str:
        t = record.created
        out: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(t)) + f".{int(t % 1 * 1000):03d}Z",
            "level": record.levelname.lower(),
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in record.__dict__.items():
            if k not in _RESERVED and not k.startswith("_"):
                out[k] = v
        if record.exc_info:
            out["exc"] = self.formatException(record.exc_info)
        return json.dumps(out, default=str, separators=(",", ":"))


def setup_logging(level: str, loggers: Iterable[str] = ("kvgate", "aiohttp")) -> None:
    """Send the named loggers to stderr as JSON lines at ``level`` (others than kvgate's at warning and above)."""
    handler = logging.StreamHandler()
    handler.setFormatter(JsonFormatter())
    for name in loggers:
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.propagate = False
        lg.setLevel(level.upper() if name == "kvgate" else max(logging.WARNING, logging.getLevelName(level.upper())))
