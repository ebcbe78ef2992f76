"""Tool calls with harmless arguments, so an agent harness runs its loop against ``kvgate engine``.

A request that offers tools (chat ``tools``, Responses ``tools`` of type ``function``, Messages ``tools``) and does
not forbid them (``tool_choice`` ``"none"``) is an agent's turn: :mod:`kvgate.serve.agent` decides whether it calls
one of them (and which) or answers and ends. A call's arguments are the least a schema allows: only the required
properties, each the type's empty value (``""``, ``0`` or the minimum, ``false``, ``[]``, ``{}``, ``null``), the
first ``enum`` or ``const`` value, the first of ``anyOf`` / ``oneOf``. A harness that runs the call runs nothing of
consequence (an empty command, an empty path), gets its tool result and sends its next turn.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import orjson

from kvgate.http.dialect import Api


class Offer(NamedTuple):
    """The tools a request offers: ``(name, parameters schema)`` each in order; the one ``tool_choice`` names
    (``forced``), and whether ``tool_choice`` requires some call (chat and Responses ``"required"``, Messages
    ``{"type": "any"}``)."""

    offered: list[tuple[str, dict[str, Any]]]
    forced: tuple[str, dict[str, Any]] | None
    required: bool


def offered_tools(api: Api, body: dict[str, Any]) -> Offer | None:
    """What the request offers; None when it offers no tool (of a kind that can be called) or forbids calls."""
    tools = body.get("tools")
    if type(tools) is not list or not tools or not api.chat_like:
        return None
    choice = body.get("tool_choice")
    kind = choice.get("type") if type(choice) is dict else choice
    if kind == "none":
        return None
    offered = [got for got in (api.tool_of(t) for t in tools) if got is not None]
    if not offered:
        return None
    wanted = _chosen(choice)
    forced = next((t for t in offered if t[0] == wanted), None) if wanted is not None else None
    return Offer(offered, forced, kind in ("required", "any"))


def _chosen(choice: Any) -> str | None:
    """The tool ``tool_choice`` names (chat: ``{"function": {"name"}}``; Responses and Messages: ``{"name"}``)."""
    if type(choice) is not dict:
        return None
    fn = choice.get("function")
    name = fn.get("name") if type(fn) is dict else choice.get("name")
    return name if type(name) is str else None


def harmless(schema: Any, depth: int = 0) -> Any:
    """The least value ``schema`` allows (see the module docstring)."""
    if type(schema) is not dict or depth > 16:
        return None
    if "const" in schema:
        return schema["const"]
    enum = schema.get("enum")
    if type(enum) is list and enum:
        return enum[0]
    for key in ("anyOf", "oneOf"):
        opts = schema.get(key)
        if type(opts) is list and opts:
            return harmless(opts[0], depth + 1)
    kind = schema.get("type")
    if type(kind) is list:
        kind = next((k for k in kind if k != "null"), "null")
    if kind == "object" or (kind is None and "properties" in schema):
        props = schema.get("properties")
        props = props if type(props) is dict else {}
        required = schema.get("required")
        names = [n for n in required if type(n) is str] if type(required) is list else []
        return {n: harmless(props.get(n), depth + 1) for n in names}
    if kind in ("integer", "number"):
        lo = schema.get("minimum")
        return lo if type(lo) in (int, float) else 0
    return {"string": "", "boolean": False, "array": [], "null": None}.get(kind) if type(kind) is str else None


def arguments(schema: dict[str, Any]) -> str:
    """The call's arguments as JSON text (chat and Responses send them so)."""
    return orjson.dumps(harmless(schema) or {}).decode()
