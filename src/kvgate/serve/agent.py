"""What ``kvgate engine`` answers a request that offers tools: call a tool, or answer and end, as the session shape
it serves says.

A conversation is a session of the shape its identity draws: the shapes of a trace (the bundled mini-swe-agent
shapes by default, or a shapes file), one picked per conversation by a hash of the seed and the conversation's
opening (its head and the items before the first assistant item: system prompt, tools aside, and the task). Its
turns are the shape's (``--agent-turns trace``) or a fixed number (``--agent-turns N``). Which turn a request is
comes from the conversation itself, not from server state: the number of assistant turns (runs of assistant items:
a message, a tool call) it already holds. Turn ``k`` of ``T``:

* ``k + 1 < T``: a call of one of the offered tools (the one ``tool_choice`` names, else one drawn per turn from
  the seed), its text the shape's output of turn ``k`` cut to the request's budget; chat says ``tool_calls``,
  Messages ``tool_use``, Responses ``completed`` with a ``function_call`` item;
* the last turn (and every later one): an answer with no tool call, the shape's last output; it ends (chat
  ``stop``, Messages ``end_turn``, Responses ``completed``) unless that output reaches a budget the request set (or
  the context's remainder), where it is cut (``length``, ``max_tokens``, ``incomplete``); a request that sets none
  (Codex) gets the default budget's worth, ended. A ``tool_choice`` that requires a call (chat ``"required"``,
  Messages ``{"type": "any"}``, a named tool) gets one whatever the turn.

Tools that only spawn agents (:func:`spawns`: Claude Code's ``Task`` / ``Agent``, opencode's ``task``, Codex's
``multi_agent_v1``) and tools that wait on a user (:data:`INTERACTIVE`) are never drawn, unless ``tool_choice`` names
them: a harness whose every answer spawns a subagent never ends. With ``--agent-spawn`` a conversation's first turn
(of two or more) calls the first offered spawning tool once, its text arguments :data:`SUBTASK` (:func:`spawn_call`);
the spawned agent's conversation opens with that text and spawns none, so a session tree holds one subagent, which
runs its own session's turns and ends.

A request that offers no tools is answered as before (its whole budget of filler), so the driver's closed loop and
everything without tools is as it was, except where the system prompt asks for a written format
(:mod:`kvgate.serve.written`): a code agent's (code blocks that end the run by calling ``final_answer``) is a
session as above, answered in its block format; an editor's (aider's edit formats) gets an edit that changes
nothing, in its format, of the file it shows.
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, NamedTuple

from kvgate.errors import UsageError
from kvgate.http.dialect import Api
from kvgate.serve.tools import arguments, harmless, offered_tools
from kvgate.serve.written import Written, code_answer, code_ask, edit_answer, edit_ask, shown_file, stop_strings
from kvgate.workload.shapes import SessionShape

Finish = Literal["tool", "stop", "length"]
"""How an answer ends: with a tool call, by itself, or cut by its output budget."""

SPAWNING = frozenset({"task", "agent", "dispatch_agent", "spawn_agent", "subagent", "delegate"})
"""Names (lower case) of tools that only start another agent."""
INTERACTIVE = frozenset({"askuserquestion", "ask_user", "question", "request_user_input", "enterplanmode",
                         "exitplanmode", "exit_plan_mode"})
"""Names (lower case) of tools that wait on a user or switch the harness's mode."""
SUBTASK = "Look around the repository and report back in one line (a subtask)."
"""The text a spawning call (``--agent-spawn``) gives its agent: a conversation opening with it spawns none."""
SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"
"""What mini-swe-agent's prompt tells the model to echo to end its run (:func:`submit_call`)."""


class Reply(NamedTuple):
    """The answer a request gets: its output tokens, its tool call (name, arguments JSON), how it ends, and its
    text where it is written (:mod:`kvgate.serve.written`; None: filler)."""

    tokens: int
    call: tuple[str, str] | None
    finish: Finish
    text: Written | None = None


@dataclass(frozen=True)
class AgentTurns:
    """The session shape agent requests are answered from (:mod:`kvgate.serve.agent`)."""

    turns: int | str = "trace"
    """A fixed number of turns per conversation, ``"trace"`` (the bundled shapes' turns) or a shapes file."""
    seed: int = 0
    spawn: bool = False
    """Allow drawing tools that only spawn agents (:data:`SPAWNING`)."""

    def validate(self) -> None:
        t = self.turns
        if isinstance(t, int):
            if t < 1:
                raise UsageError("--agent-turns: a number of turns must be at least 1")
        elif t != "trace" and not Path(t).is_file():
            raise UsageError(f"--agent-turns {t}: not a number, 'trace' or a shapes file")


def parse_agent_turns(value: str) -> int | str:
    """``--agent-turns`` as given: an integer, ``trace`` or a path."""
    v = value.strip()
    return int(v) if v.isdigit() else v


class AgentPolicy:
    """Decides each agent request's reply (see the module docstring). Deterministic per seed and conversation."""

    def __init__(self, cfg: AgentTurns, shapes: Sequence[SessionShape] | None = None) -> None:
        cfg.validate()
        self.cfg = cfg
        self._shapes = list(shapes) if shapes is not None else None

    @property
    def shapes(self) -> list[SessionShape]:
        if self._shapes is None:
            from kvgate.workload.trace import bundled_shapes_path, load_shapes

            t = self.cfg.turns
            src: Any = t if isinstance(t, str) and t != "trace" else bundled_shapes_path()
            self._shapes = load_shapes(src)
            if not self._shapes:
                raise UsageError(f"--agent-turns {t}: the shapes file holds no session")
        return self._shapes

    def reply(self, api: Api, body: dict[str, Any], budget: int) -> Reply | None:
        """The reply to a request that offers tools, or that asks for a written format (:meth:`_written`); None
        for one that does neither (answered as before)."""
        tools = offered_tools(api, body)
        conv = api.conversation(body)
        head, items = conv if conv is not None else ([], [])
        if tools is None:
            return self._written(api, body, head, items, budget)
        ident, k, last, wanted = self._turn(api, head, items)
        n = min(budget, wanted)
        forced, required = tools.forced, tools.required
        if forced is not None:
            return Reply(n, (forced[0], arguments(forced[1])), "tool")
        pool = [t for t in tools.offered if self._drawable(t[0])]
        if self.cfg.spawn and k == 0 < last and (spawn := spawn_call(api, body, head, items, tools.offered)):
            return Reply(n, spawn, "tool")
        if k >= last and (submit := submit_call(api, head, items, pool)) is not None:
            return Reply(n, submit, "tool")
        if pool and (k < last or required):
            name, schema = pool[_mix(ident, k) % len(pool)]
            return Reply(n, (name, arguments(schema)), "tool")
        return Reply(n, None, "length" if wanted >= budget and _budget_binds(api, body, budget) else "stop")

    def _turn(self, api: Api, head: list[Any], items: list[Any]) -> tuple[int, int, int, int]:
        """``(conversation hash, turn, last turn, wanted output tokens)`` of a conversation."""
        ident, k = identity(api, head, items, self.cfg.seed)
        shape = self.shapes[ident % len(self.shapes)]
        last = (self.cfg.turns if isinstance(self.cfg.turns, int) else shape.turns) - 1
        wanted = shape.outputs[min(k, shape.turns - 1)] if k < last else shape.outputs[-1]
        return ident, k, last, wanted

    def _written(self, api: Api, body: dict[str, Any], head: list[Any], items: list[Any], budget: int) -> Reply | None:
        """The reply to a request that offers no tools (:mod:`kvgate.serve.written`): a code agent's block where
        its head asks for one, an edit that changes nothing where it asks for an edit format and its user items
        show a file; else None (answered as before)."""
        if not api.chat_like or body.get("tool_choice") == "none":
            return None
        system = "\n".join(api.parts(it)[1] for it in head)
        ask, edit = code_ask(system), edit_ask(system)
        binds, stops = _budget_binds(api, body, budget), stop_strings(body)
        if ask is not None:
            _, k, last, wanted = self._turn(api, head, items)
            w = code_answer(ask, k >= last, wanted, budget, binds, stops)
        elif edit is not None and (file := shown_file([t for r, t, _ in map(api.parts, items) if r == "user"], system)):
            w = edit_answer(edit, file, self._turn(api, head, items)[3], budget, binds, stops)
        else:
            return None
        return Reply(w.tokens, None, "length" if w.finish == "length" else "stop", w)

    @staticmethod
    def _drawable(name: str) -> bool:
        low = name.lower()
        return low not in INTERACTIVE and not spawns(low)


def submit_call(api: Api, head: list[Any], items: list[Any], pool: list[Any]) -> tuple[str, str] | None:
    """The last turn's call for a harness that ends only on a command it names (mini-swe-agent: ``echo`` of
    :data:`SUBMIT`, its task's first messages say so), through an offered tool taking a ``command``; else None."""
    opening = [api.parts(it)[1] for it in head] + [api.parts(it)[1] for it in items[:2]]
    if not any(SUBMIT in t for t in opening):
        return None
    for name, schema in pool:
        props = schema.get("properties") if type(schema) is dict else None
        if type(props) is dict and "command" in props:
            return name, json.dumps({"command": f"echo {SUBMIT}"})
    return None


def spawn_call(api: Api, body: dict[str, Any], head: list[Any], items: list[Any],
               offered: list[Any]) -> tuple[str, str] | None:
    """The first turn's call of the first offered spawning tool (``--agent-spawn``): its required text arguments
    :data:`SUBTASK` (one naming a ``type`` the first agent type the tool's description lists, opencode's
    ``subagent_type``), so the spawned agent's conversation opens with it, and a boolean that would run the agent
    in the background (Claude Code's ``run_in_background``) false, so the call waits for the agent's answer as its
    result; None for a conversation that opens with :data:`SUBTASK` (a subagent spawns none) or where no spawning
    tool is offered."""
    if any(SUBTASK in t for t in _opening(api, head, items)):
        return None
    for name, schema in offered:
        if not spawns(name.lower()):
            continue
        args = harmless(schema)
        args = args if type(args) is dict else {}
        props = schema.get("properties") if type(schema) is dict else None
        kind_of = _AGENT_TYPE_RE.search(_description(body, name))
        for key, prop in props.items() if type(props) is dict else ():
            kind = prop.get("type") if type(prop) is dict else None
            if key in args and kind == "string" and "enum" not in prop:
                args[key] = kind_of.group(1) if kind_of is not None and "type" in key.lower() else SUBTASK
            elif kind == "boolean" and "background" in key.lower():
                args[key] = False
        return name, json.dumps(args)
    return None


_AGENT_TYPE_RE = re.compile(r"agent types\b[^\n]*\n(?:[^\n]*\n)*?[-*] `?([\w.-]+)`?:")


def _description(body: dict[str, Any], name: str) -> str:
    """The description of the tool ``name`` the request offers (chat's in its ``function``)."""
    for t in body.get("tools") or ():
        if type(t) is not dict:
            continue
        fn = t.get("function") if type(t.get("function")) is dict else t
        if fn.get("name") == name:
            d = fn.get("description")
            return d if type(d) is str else ""
    return ""


def _opening(api: Api, head: list[Any], items: list[Any]) -> list[str]:
    """The texts of a conversation's opening: its head and the items before its first assistant item."""
    out = [api.parts(it)[1] for it in head]
    for it in items:
        role, text, _ = api.parts(it)
        if role == "assistant":
            break
        out.append(text)
    return out


def spawns(name: str) -> bool:
    """Whether a tool (its lower-case name) only starts another agent: one of :data:`SPAWNING`, or a name that
    speaks of agents (Codex's ``multi_agent_v1``)."""
    return name in SPAWNING or "agent" in name


def _budget_binds(api: Api, body: dict[str, Any], budget: int) -> bool:
    """Whether reaching ``budget`` is a cut: the request set it, or the context's remainder made it less than the
    default a request that sets none gets. A harness that sets none (Codex) asks for no limit: an answer of the
    default's length ends by itself, as a model's would."""
    return any(body.get(k) is not None for k in api.budget_fields) or budget < api.default_budget


def identity(api: Api, head: list[Any], items: list[Any], seed: int) -> tuple[int, int]:
    """``(conversation hash, turn)``: a hash of the seed and the conversation's opening (its head and the items
    before its first assistant item), and the assistant turns (runs of assistant items) the conversation holds."""
    h = hashlib.blake2b(str(seed).encode(), digest_size=8)
    for it in head:
        role, text, _ = api.parts(it)
        h.update(f"\x00{role}\x01{text}".encode("utf-8", "surrogatepass"))
    turns, prev = 0, ""
    for it in items:
        role, text, _ = api.parts(it)
        if role == "assistant":
            if prev != "assistant":
                turns += 1
        elif turns == 0:
            h.update(f"\x02{role}\x01{text}".encode("utf-8", "surrogatepass"))
        prev = role
    return int.from_bytes(h.digest(), "big"), turns


def _mix(ident: int, k: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{ident}:{k}".encode(), digest_size=8).digest(), "big")
