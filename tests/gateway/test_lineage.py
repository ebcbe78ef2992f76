"""Lineage (``kvgate.gateway.lineage``) without sockets: continuations, retries, forks, replays, rewrites, changed
heads, completions prompts, namespaces, and the index staying the size of the live sessions."""

from __future__ import annotations

import json
import random
from typing import Any

from kvgate.gateway.lineage import Lineage, LineageNotes
from kvgate.gateway.probe import Probe, prompt_bytes
from kvgate.gateway.slot import TurnSlot
from kvgate.http.dialect import CHAT, COMPLETIONS, MESSAGES, RESPONSES, Api

SYSTEM = {"role": "system", "content": "You are a careful software engineer. " * 50}


class S:
    """A session as lineage sees it."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.lin = LineageNotes()
        self.slot = TurnSlot()


class World:
    """Requests in, sessions out: what the gateway does around lineage (new sessions named in order)."""

    def __init__(self, api: Api = CHAT, make: type[S] = S) -> None:
        self.lin = Lineage()
        self.api = api
        self.n = 0
        self.make = make

    def send(self, body: dict[str, Any], ns: Any = None, raw: bytes | None = None) -> tuple[str, S, S | None]:
        p = self.lin.probe(self.api, body, raw if raw is not None else json.dumps(body).encode(), ns)
        assert p is not None
        found = self.lin.find(p)
        parent = None
        if found.kind in ("continue", "retry", "rewrite"):
            s = found.session
        else:
            self.n += 1
            s = self.make(f"s{self.n}")
            parent = found.session
        self.lin.record(s, p, index=True)
        return found.kind + (f";{found.note}" if found.note else ""), s, parent


def convo(task: str, turns: int, tag: str = "") -> list[list[dict[str, Any]]]:
    """The message lists an agent sends: system, task, then per turn its reply and a tool result."""
    msgs: list[dict[str, Any]] = [SYSTEM, {"role": "user", "content": task}]
    out = [list(msgs)]
    for k in range(turns - 1):
        msgs += [{"role": "assistant", "content": None, "tool_calls": [
            {"id": f"call_{tag}{k}", "type": "function", "function": {"name": "bash", "arguments": '{"cmd": "ls"}'}}]},
                 {"role": "tool", "tool_call_id": f"call_{tag}{k}", "content": f"output {tag} {k} " * 30}]
        out.append(list(msgs))
    return out


def test_conversations_sharing_one_system_prompt_are_one_session_each() -> None:
    w = World()
    convs = [convo(f"task number {i}: fix the bug in module {i}", 6, tag=str(i)) for i in range(10)]
    seen: dict[int, set[str]] = {}
    for k in range(6):  # interleaved turns, as concurrent agents send them
        for i, c in enumerate(convs):
            kind, s, _ = w.send({"messages": c[k]})
            assert kind == ("new" if k == 0 else "continue"), (i, k, kind)
            seen.setdefault(i, set()).add(s.name)
    assert all(len(names) == 1 for names in seen.values()) and len({n for v in seen.values() for n in v}) == 10
    assert w.lin.sessions == 10 and w.lin.stats()["roots"] == 10


def test_identical_first_requests_part_when_their_histories_differ() -> None:
    w = World()
    a, b = convo("same task", 3, "a"), convo("same task", 3, "b")
    _, sa, _ = w.send({"messages": a[0]})
    sa.slot.busy = True  # a's first turn still in flight: b's identical request is another conversation
    kind, sb, parent = w.send({"messages": b[0]})
    assert kind == "fork" and sb is not sa and parent is sa
    sa.slot.busy = False
    assert w.send({"messages": a[1]})[1:] == (sa, None)  # the first of the two alike takes it
    assert w.send({"messages": b[1]})[1:] == (sb, None)  # its own history now tells b apart
    assert w.send({"messages": a[2]})[1] is sa and w.send({"messages": b[2]})[1] is sb


def test_retry_after_a_failure_replay_after_a_success() -> None:
    w = World()
    c = convo("task", 3)
    _, s, _ = w.send({"messages": c[0]})
    _, s2, _ = w.send({"messages": c[1]})
    assert s2 is s
    w.lin.failed(s)
    kind, s3, _ = w.send({"messages": c[1]})  # the same request after a failure: a retry of it
    assert kind == "retry" and s3 is s
    kind, s4, parent = w.send({"messages": c[1]})  # the same again after it succeeded: a replay, a new session
    assert kind == "replay" and s4 is not s and parent is s
    # an earlier request sent again (a replayed history) is a replay too
    kind, s5, parent = w.send({"messages": c[0]})
    assert kind == "replay" and s5 not in (s, s4) and parent in (s, s4)


class Counted(S):
    """A session that counts how often lineage reads its notes."""

    reads = 0

    @property
    def lin(self) -> LineageNotes:
        Counted.reads += 1
        return self._lin

    @lin.setter
    def lin(self, v: LineageNotes) -> None:
        self._lin = v


def test_a_conversation_replayed_thousands_of_times_is_matched_in_bounded_work() -> None:
    w = World(make=Counted)
    c = convo("one task, many rollouts", 2)
    made = [w.send({"messages": c[0]}) for _ in range(3000)]
    assert [k for k, _, _ in made[:3]] == ["new", "replay", "replay"] and w.lin.sessions == 3000
    Counted.reads = 0
    kind, s, parent = w.send({"messages": c[0]})
    # a look at the key's most recent sessions, not at every one of the 3,000 that share it
    assert kind == "replay" and parent in [m[1] for m in made[-32:]]
    assert Counted.reads <= 8 * 32, Counted.reads
    Counted.reads = 0
    kind, s, parent = w.send({"messages": c[1]})  # a rollout goes on: it continues one of them
    assert kind == "continue" and s in [m[1] for m in made[-32:]] and Counted.reads <= 8 * 32


def test_a_fork_is_two_sessions_and_a_busy_session_forks() -> None:
    w = World()
    c = convo("task", 4)
    _, s, _ = w.send({"messages": c[0]})
    w.send({"messages": c[1]})
    w.send({"messages": c[2]})
    branch_a = c[2] + [{"role": "assistant", "content": "plan A"}, {"role": "user", "content": "go with A " * 20}]
    branch_b = c[2] + [{"role": "assistant", "content": "plan B"}, {"role": "user", "content": "go with B " * 20}]
    kind, sa, _ = w.send({"messages": branch_a})
    assert kind == "continue" and sa is s
    kind, sb, parent = w.send({"messages": branch_b})  # the same history continued otherwise: a fork
    assert kind == "fork" and sb is not s and parent is s
    assert w.send({"messages": branch_a + [{"role": "user", "content": "more"}]})[1] is s
    assert w.send({"messages": branch_b + [{"role": "user", "content": "more"}]})[1] is sb
    s.slot.busy = True  # a continuation of a session whose turn is in flight is a fork
    kind, sc, parent = w.send({"messages": branch_a + [{"role": "user", "content": "more"}, {"role": "user",
                                                                                                "content": "x"}]})
    assert kind == "fork" and parent is s and sc is not s


def test_a_compaction_that_keeps_the_task_continues_the_session_and_says_so() -> None:
    w = World()
    c = convo("the task", 8)
    for m in c:
        _, s, _ = w.send({"messages": m})
    compacted = [SYSTEM, {"role": "user", "content": "the task"},
                 {"role": "user", "content": "Summary of the work so far: listed files, fixed two tests."}]
    kind, s2, _ = w.send({"messages": compacted})
    assert kind == "rewrite" and s2 is s
    kind, s3, _ = w.send({"messages": compacted + [{"role": "assistant", "content": "next"},
                                                    {"role": "user", "content": "ok"}]})
    assert kind == "continue" and s3 is s


def test_a_compaction_that_keeps_only_the_summary_is_found_by_the_answer() -> None:
    w = World()
    c = convo("the task", 4)
    for m in c:
        _, s, _ = w.send({"messages": m})
    summary = "The agent listed the repository, found the failing assertion in test_io.py and patched reader.py."
    w.lin.replied(s, "Summary:\n" + summary + "\nDone.")
    kind, s2, _ = w.send({"messages": [SYSTEM, {"role": "user", "content": "Context so far:\n" + summary}]})
    assert kind == "rewrite" and s2 is s


def test_a_changed_head_keeps_the_session_and_is_noted() -> None:
    w = World(MESSAGES)
    msgs = [{"role": "user", "content": "refactor the parser " * 10}]
    who = {"type": "text", "text": "You are Claude"}
    nonce = [{"type": "text", "text": "x-anthropic-billing-header: cch=1;"}, who]
    _, s, _ = w.send({"system": nonce, "messages": msgs})
    nonce2 = [{"type": "text", "text": "x-anthropic-billing-header: cch=2;"}, who]
    use = {"type": "tool_use", "id": "t1", "name": "read", "input": {"path": "a.py"}}
    more = msgs + [{"role": "assistant", "content": [{"type": "text", "text": "Sure"}, use]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "code"}]}]
    kind, s2, _ = w.send({"system": nonce2, "messages": more})
    assert kind == "continue;head" and s2 is s


def test_responses_input_and_instructions() -> None:
    w = World(RESPONSES)
    inp = [{"role": "user", "content": [{"type": "input_text", "text": "add a flag " * 20}]}]
    _, s, _ = w.send({"instructions": "You are Codex.", "input": inp, "store": False})
    inp2 = inp + [{"type": "function_call", "call_id": "c1", "name": "shell", "arguments": '{"cmd":["ls"]}'},
                  {"type": "function_call_output", "call_id": "c1", "output": "a.py b.py"}]
    kind, s2, _ = w.send({"instructions": "You are Codex.", "input": inp2, "store": False})
    assert kind == "continue" and s2 is s


def test_namespaces_never_meet() -> None:
    w = World()
    c = convo("shared", 2)
    _, a, _ = w.send({"messages": c[0]}, ns=0)
    kind, b, _ = w.send({"messages": c[1]}, ns=1)
    assert kind == "new" and b is not a
    assert w.send({"messages": c[1]}, ns=0)[1] is a


def test_completions_prompts_by_chained_chunk_crcs() -> None:
    w = World(COMPLETIONS)
    rng = random.Random(3)
    shared = [rng.randrange(1000, 30000) for _ in range(2000)]
    prompts = []
    for i in range(4):
        p = shared + [rng.randrange(1000, 30000) for _ in range(500 + i)]
        prompts.append([p])
    for k in range(5):
        for i in range(4):
            kind, s, _ = w.send({"prompt": prompts[i][-1], "max_tokens": 8})
            assert kind == ("new" if k == 0 else "continue"), (i, k, kind)
            prompts[i].append(prompts[i][-1] + [rng.randrange(1000, 30000) for _ in range(300)])
    assert w.lin.sessions == 4
    text = "You are a helpful assistant. " * 40
    kind, s, _ = w.send({"prompt": text})
    assert kind == "new" and w.send({"prompt": text + " And then?"})[1] is s


def test_token_ids_are_read_as_sent() -> None:
    body = {"model": "m", "prompt": [5, 6, 7], "max_tokens": 1}
    assert prompt_bytes(body, json.dumps(body).encode()) == b"5, 6, 7"
    assert prompt_bytes(body, b'{"prompt":[5,6,7]}') == b"5,6,7"
    assert prompt_bytes({"prompt": [[1, 2]]}, b'{"prompt":[[1,2]]}') is not None
    for odd in ({"prompt": []}, {"prompt": [["a"], ["b"]]}, {"prompt": None}, {"prompt": [1.5]}, {"prompt": ""}):
        assert prompt_bytes(odd, json.dumps(odd).encode()) is None, odd


def test_forgetting_leaves_an_empty_index() -> None:
    w = World()
    sessions = []
    for i in range(50):
        for m in convo(f"task {i}", 4, str(i)):
            sessions.append(w.send({"messages": m})[1])
    for s in set(sessions):
        w.lin.forget(s)
    st = w.lin.stats()
    assert st["sessions"] == st["roots"] == st["tips"] == st["reply_lines"] == 0


def test_odd_bodies_probe_to_nothing_or_a_conversation() -> None:
    for api, body in ((CHAT, {"messages": []}), (CHAT, {"messages": "x"}), (RESPONSES, {"input": 3}),
                      (MESSAGES, {"system": "s"}), (COMPLETIONS, {"prompt": "short"})):
        assert Lineage.probe(api, body, b"{}", None) is None
    p = Lineage.probe(CHAT, {"messages": [None, 3, {"role": 1, "content": [None]}]}, b"{}", None)
    assert isinstance(p, Probe) and p.n == 3 and isinstance(p.root, int) and p.chars == 0


def test_the_same_task_text_under_another_head_or_api_is_a_new_run_not_a_replay() -> None:
    w = World()
    task = "Fix the failing test in parser.py"
    _, a, _ = w.send({"messages": [SYSTEM, {"role": "user", "content": task}]})
    other = {"role": "system", "content": "You are a terse assistant. " * 40}
    kind, b, parent = w.send({"messages": [other, {"role": "user", "content": task}]})
    assert kind == "new" and b is not a and parent is None  # another system prompt: another conversation
    w.api = RESPONSES
    kind, c, parent = w.send({"input": [{"role": "user", "content": task}], "instructions": SYSTEM["content"]})
    assert kind == "new" and c not in (a, b) and parent is None  # the same head, another API
    w.api = CHAT
    kind, d, parent = w.send({"messages": [SYSTEM, {"role": "user", "content": task}]})
    assert kind == "replay" and parent is a  # the same conversation sent again: still a replay
