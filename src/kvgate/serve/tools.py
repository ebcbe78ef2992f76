"""Tool calls with harmless arguments, so an agent harness runs its loop against ``kvgate engine``.

A request that offers tools (chat ``tools``, Responses ``tools`` of type ``function``, Messages ``tools``) and does
not forbid them (``tool_choice`` ``"none"``) is answered with one call of the tool ``tool_choice`` names, else of
the first tool, after the filler text. Its arguments are the least a schema allows: only the required properties,
each the type's empty value (``""``, ``0`` or the minimum, ``false``, ``[]``, ``{}``, ``null``), the first
``enum`` or ``const`` value, the first of ``anyOf`` / ``oneOf``. A harness that runs the call runs nothing of
consequence (an empty command, an empty path), gets its tool result and sends its next turn.
"""

from __future__ import annotations

from typing import Any

import orjson

from kvgate.http.dialect import MESSAGES, RESPONSES, Api


def offered_tool(api: Api, body: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
    """``(name, parameters schema)`` of the tool to call; None when the request offers none or forbids calls."""
    tools = body.get("tools")
    if type(tools) is not list or not tools:
        return None
    choice = body.get("tool_choice")
    if choice == "none" or (type(choice) is dict and choice.get("type") == "none"):
        return None
    wanted = _chosen(choice)
    found = None
    for t in tools:
        got = _tool(api, t)
        if got is None:
            continue
        if wanted is None or got[0] == wanted:
            found = got
            break
    return found


def _chosen(choice: Any) -> str | None:
    """The tool ``tool_choice`` names (chat: ``{"function": {"name"}}``; Responses and Messages: ``{"name"}``)."""
    if type(choice) is not dict:
        return None
    fn = choice.get("function")
    name = fn.get("name") if type(fn) is dict else choice.get("name")
    return name if type(name) is str else None


def _tool(api: Api, t: Any) -> tuple[str, dict[str, Any]] | None:
    if type(t) is not dict:
        return None
    if api is MESSAGES:
        name, schema = t.get("name"), t.get("input_schema")
    elif api is RESPONSES:
        if t.get("type", "function") != "function":
            return None
        name, schema = t.get("name"), t.get("parameters")
    else:
        fn = t.get("function")
        if type(fn) is not dict:
            return None
        name, schema = fn.get("name"), fn.get("parameters")
    if type(name) is not str or not name:
        return None
    return name, schema if type(schema) is dict else {}


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
