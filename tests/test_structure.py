"""The layout holds: import direction, no cycles (between modules, and between packages), no private names across
modules, file, class and function sizes.

Walks ``src/kvgate`` with ``ast`` (nothing is imported), so a violation names the file and line. Every import counts,
a function-local one too: hiding an import inside a function does not hide a cycle."""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = SRC / "kvgate"
CORES = ("workload", "policy", "engine", "fleet")
DRIVERS = ("sim", "http", "serve", "drive", "gateway")
ABOVE_CORES = (*DRIVERS, "analysis", "experiments")
MAX_FILE_LINES = 600
MAX_CLASS_LINES = 300
MAX_FUNCTION_LINES = 80
LONG_FUNCTIONS: dict[tuple[str, str], tuple[int, str]] = {
    ("kvgate/engine/vllm.py", "step"): (
        120, "vLLM v1's schedule() -> cost model -> update() in one pass, as vLLM writes it (the parity oracle test "
        "reads them side by side), with its locals hoisted: the simulator's hottest function"),
    ("kvgate/doctor.py", "check_endpoint"): (
        125, "a checklist run top to bottom, each check a few lines that print as they go; split, the order of the "
        "checks (which one a failure stops) would be spread over functions"),
    ("kvgate/doctor.py", "workload_checks"): (85, "the same checklist's workload half"),
    ("kvgate/workload/trace.py", "import_mini_swe_agent"): (
        120, "one pass over a trace format's records, the state of the pass in its locals"),
    ("kvgate/calibration/measure.py", "measure"): (
        105, "the calibration's measurements in the order they run against one live server (each a few lines)"),
    ("kvgate/experiments/sec3_paired.py", "eval_paired"): (
        105, "the §3 paired claims, one after another, each a few lines over the same pairs"),
    ("kvgate/experiments/sec6_recovery.py", "eval_recovery8"): (
        95, "the §6 recovery claims on the 8B runs, one after another, each a few lines over the same arms"),
    ("kvgate/realvllm/command.py", "serve_command"): (
        90, "a click command whose body is the server's options handed on, one per line"),
}
"""Functions allowed over :data:`MAX_FUNCTION_LINES`, each at most its listed size, with the reason."""
def _modules() -> dict[str, Path]:
    mods = {}
    for p in sorted(PKG.rglob("*.py")):
        parts = p.relative_to(SRC).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = p
    return mods


MODULES = _modules()


def _imports(name: str, path: Path) -> list[tuple[int, str, str | None]]:
    """(line, module, name or None) for every import in a module, relative ones resolved."""
    tree = ast.parse(path.read_text(), filename=str(path))
    pkg = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out: list[tuple[int, str, str | None]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, a.name, None) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                up = pkg.split(".")
                up = up[: len(up) - node.level + 1]
                base = ".".join([*up, base] if base else up)
            out.extend((node.lineno, base, a.name) for a in node.names)
    return out


def _targets(module: str, name: str | None) -> str | None:
    """The kvgate module an import refers to (``from kvgate.x import y`` is module ``kvgate.x.y`` when that exists)."""
    if name is not None and f"{module}.{name}" in MODULES:
        return f"{module}.{name}"
    return module if module in MODULES else None


def _graph() -> dict[str, set[str]]:
    g: dict[str, set[str]] = defaultdict(set)
    for mod, path in MODULES.items():
        for _, module, name in _imports(mod, path):
            t = _targets(module, name)
            if t is not None and t != mod:
                g[mod].add(t)
    return g


def _package(mod: str) -> str:
    parts = mod.split(".")
    return parts[1] if len(parts) > 1 else ""


def test_the_walk_sees_the_tree() -> None:
    assert len(MODULES) > 50
    g = _graph()
    assert "kvgate.engine.base" in g["kvgate.engine.vllm"]  # the walk resolves imports (can fail)
    assert "kvgate.sim.fleet" in g["kvgate.sim.runner"]  # ...and sees one made inside a function


def _cycles(g: dict[str, set[str]], nodes: list[str]) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0

    def visit(v: str) -> None:  # Tarjan's strongly connected components
        nonlocal counter
        index[v] = low[v] = counter
        counter += 1
        stack.append(v)
        on.add(v)
        for w in sorted(g.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                cycles.append(sorted(comp))

    for v in sorted(nodes):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles() -> None:
    cycles = _cycles(_graph(), sorted(MODULES))
    assert not cycles, f"import cycles: {cycles}"


def _package_graph() -> dict[str, set[str]]:
    """Imports between packages (a top-level module is a package of its own), function-local ones included."""
    pg: dict[str, set[str]] = defaultdict(set)
    for mod, targets in _graph().items():
        a = _package(mod) or mod
        for t in targets:
            b = _package(t) or t
            if a != b:
                pg[a].add(b)
    return pg


def test_no_package_cycles() -> None:
    pg = _package_graph()
    assert "sim" in pg["experiments"]  # the walk sees packages (can fail)
    cycles = _cycles(pg, sorted(pg))
    assert not cycles, f"package cycles: {cycles}"


@pytest.mark.parametrize("core", CORES)
def test_cores_import_no_driver_and_no_asyncio(core: str) -> None:
    bad = []
    for mod, path in MODULES.items():
        if _package(mod) != core:
            continue
        for line, module, name in _imports(mod, path):
            top = module.split(".")[0]
            if top in ("asyncio", "aiohttp", "httptools", "click") or (
                top == "kvgate" and (_package(_targets(module, name) or module) in ABOVE_CORES)
            ):
                bad.append(f"{path.relative_to(SRC)}:{line} imports {module}{'.' + name if name else ''}")
    assert not bad, "\n".join(bad)


def test_analysis_imports_no_driver() -> None:
    bad = []
    for mod, path in MODULES.items():
        if _package(mod) != "analysis":
            continue
        for line, module, name in _imports(mod, path):
            if module.split(".")[0] == "kvgate" and _package(_targets(module, name) or module) in DRIVERS:
                bad.append(f"{path.relative_to(SRC)}:{line} imports {module}")
    assert not bad, "\n".join(bad)


def test_no_private_names_across_modules() -> None:
    """``from kvgate.x import _y`` reaches into another module's internals (dunders such as __version__ are public)."""
    bad = []
    for mod, path in MODULES.items():
        for line, module, name in _imports(mod, path):
            if module.split(".")[0] != "kvgate" or name is None or f"{module}.{name}" in MODULES:
                continue
            if name.startswith("_") and not (name.startswith("__") and name.endswith("__")):
                bad.append(f"{path.relative_to(SRC)}:{line} imports {name} from {module}")
    assert not bad, "\n".join(bad)


def test_file_and_class_sizes() -> None:
    bad = []
    for path in MODULES.values():
        text = path.read_text()
        n = text.count("\n") + (0 if text.endswith("\n") else 1)
        if n > MAX_FILE_LINES:
            bad.append(f"{path.relative_to(SRC)}: {n} lines (at most {MAX_FILE_LINES})")
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                if size > MAX_CLASS_LINES:
                    bad.append(f"{path.relative_to(SRC)}:{node.lineno} class {node.name}: {size} lines")
    assert not bad, "\n".join(bad)


def test_functions_fit_on_a_screen() -> None:
    bad = []
    for path in MODULES.values():
        rel = str(path.relative_to(SRC))
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                size = (node.end_lineno or node.lineno) - node.lineno + 1
                limit = LONG_FUNCTIONS.get((rel, node.name), (MAX_FUNCTION_LINES, ""))[0]
                if size > limit:
                    bad.append(f"{rel}:{node.lineno} {node.name}(): {size} lines (at most {limit})")
    assert not bad, "\n".join(bad)


API_NAMES = frozenset({"COMPLETIONS", "CHAT", "RESPONSES", "MESSAGES"})
API_STRINGS = frozenset({"completions", "chat", "responses", "messages"})
MAX_API_BRANCHES = 5
"""Branches on the wire API allowed outside its dialect modules (``kvgate/http/dialect/``)."""


def _names_an_api(node: ast.expr, strings: bool) -> bool:
    """An API constant (``CHAT``, ``dialect.RESPONSES``), an API's name (``"messages"``, with ``strings``), or a
    tuple or set of them."""
    if isinstance(node, ast.Name | ast.Attribute):
        return (node.id if isinstance(node, ast.Name) else node.attr) in API_NAMES
    if isinstance(node, ast.Constant):
        return strings and node.value in API_STRINGS
    if isinstance(node, ast.Tuple | ast.List | ast.Set):
        return bool(node.elts) and all(_names_an_api(e, True) for e in node.elts)
    return False


def _api_branches(tree: ast.AST) -> list[int]:
    """Lines comparing something with an API (``api is CHAT``, ``cfg.api == "chat"``, ``api in (RESPONSES,
    MESSAGES)``) or matching a case on one. A name as the left of ``in`` (``"messages" in body``) asks for a key."""
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Compare):
            sides = [node.left, *node.comparators]
            named = [_names_an_api(x, not (i == 0 and isinstance(node.ops[0], ast.In | ast.NotIn)))
                     for i, x in enumerate(sides)]
            if any(named) and not all(n or isinstance(x, ast.Constant) for n, x in zip(named, sides, strict=True)):
                out.append(node.lineno)
        elif isinstance(node, ast.match_case) and any(
                _names_an_api(p, True) for p in ast.walk(node.pattern) if isinstance(p, ast.expr)):
            out.append(node.pattern.lineno)
    return out


def test_the_api_branch_count_sees_branches() -> None:
    tree = ast.parse("if api is CHAT or cfg.api == 'chat' or api in (RESPONSES, MESSAGES):\n    pass\n"
                     "if 'messages' in body or x == 'user':\n    pass\n")
    assert len(_api_branches(tree)) == 3


def test_branches_on_the_api_live_in_its_dialect() -> None:
    """A new wire API is a module of :mod:`kvgate.http.dialect`, not an edit in every module that speaks one."""
    where = []
    for path in MODULES.values():
        rel = path.relative_to(SRC)
        if rel.parts[:3] == ("kvgate", "http", "dialect"):
            continue
        where += [f"{rel}:{line}" for line in _api_branches(ast.parse(path.read_text()))]
    assert len(where) <= MAX_API_BRANCHES, f"{len(where)} branches on the API outside its dialect: {where}"


MAX_RECORD_FIELDS = 16
SESSION_RECORD = ("kvgate/gateway/sessions.py", "GwSession")
"""The gateway's session record: it and each part it holds (a class its ``__init__`` builds) have at most
:data:`MAX_RECORD_FIELDS` fields, each part written by one module."""


def _assigned(tree: ast.AST) -> Iterator[tuple[ast.stmt, ast.expr]]:
    """(statement, target) of each assignment below ``tree`` (plain, annotated or augmented)."""
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            yield from ((node, t) for t in node.targets)
        elif isinstance(node, ast.AnnAssign | ast.AugAssign):
            yield node, node.target


def _fields(cls: ast.ClassDef) -> set[str]:
    """A class's fields: its ``__slots__``, its class-level annotations (a dataclass's), the ``self.x`` its methods
    assign."""
    out: set[str] = set()
    for node in cls.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "__slots__" for t in node.targets):
            if isinstance(node.value, ast.Tuple | ast.List):
                out |= {e.value for e in node.value.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)}
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
            out.add(node.target.id)
    for _node, t in _assigned(cls):
        for x in ast.walk(t):
            if isinstance(x, ast.Attribute) and isinstance(x.value, ast.Name) and x.value.id == "self":
                out.add(x.attr)
    return out


def _classes() -> dict[str, tuple[str, ast.ClassDef]]:
    """The classes of ``kvgate/gateway`` by name (file, definition)."""
    out = {}
    for path in sorted((PKG / "gateway").glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ClassDef):
                out[node.name] = (str(path.relative_to(SRC)), node)
    return out


def _record_parts(record: ast.ClassDef) -> list[str]:
    """The classes a record's ``__init__`` builds into its fields (``self.slot = TurnSlot()``)."""
    parts = []
    for node in record.body:
        if isinstance(node, ast.FunctionDef) and node.name == "__init__":
            for x in ast.walk(node):
                if (isinstance(x, ast.Assign) and isinstance(x.value, ast.Call) and isinstance(x.value.func, ast.Name)
                        and any(isinstance(t, ast.Attribute) for t in x.targets)):
                    parts.append(x.value.func.id)
    return parts


def _oversized(classes: dict[str, tuple[str, ast.ClassDef]], name: str) -> list[str]:
    rel, record = classes[name]
    bad = []
    for cls in (name, *_record_parts(record)):
        where, node = classes.get(cls, (rel, None))
        if node is None:
            continue
        n = len(_fields(node))
        if n > MAX_RECORD_FIELDS:
            bad.append(f"{where}:{node.lineno} class {cls}: {n} fields (at most {MAX_RECORD_FIELDS})")
    return bad


def test_the_field_count_sees_fields() -> None:
    slots = ", ".join(f'"f{i}"' for i in range(20))
    src = (f"class Rec:\n    x: int\n    __slots__ = ({slots})\n    def __init__(self) -> None:\n"
           "        self.f0 = 0\n        self.part = Part()\n        self.part.y = 1\n"
           "class Part:\n    def __init__(self) -> None:\n        self.a = self.b = 0\n        self.c += 1\n")
    classes = {n.name: ("x.py", n) for n in ast.walk(ast.parse(src)) if isinstance(n, ast.ClassDef)}
    assert _fields(classes["Part"][1]) == {"a", "b", "c"}
    assert len(_fields(classes["Rec"][1])) == 22  # f0..f19, x, part (self.part.y is the part's)
    assert _record_parts(classes["Rec"][1]) == ["Part"]
    assert _oversized(classes, "Rec") == ["x.py:1 class Rec: 22 fields (at most 16)"]


def test_the_session_record_and_its_parts_are_small() -> None:
    """The session record is split by owner (identity and lifecycle, the turn slot, the estimator's carry, the
    cache notes, the lineage trail), not one class every module writes into."""
    classes = _classes()
    rel, name = SESSION_RECORD
    assert classes[name][0] == rel
    assert len(_record_parts(classes[name][1])) >= 4  # the walk sees its parts (can fail)
    bad = _oversized(classes, name)
    assert not bad, "\n".join(bad)


PART_OWNERS = {"name": "kvgate/gateway/identity.py", "slot": "kvgate/gateway/slot.py",
               "est": "kvgate/gateway/estimate.py", "cache": "kvgate/gateway/breaks.py",
               "lin": "kvgate/gateway/lineage.py"}
"""Each part of the session record (by its attribute on :class:`GwSession`) and the one module that writes it."""
PART_RESTORES = ("kvgate/gateway/books.py", "kvgate/gateway/shared_books.py")
"""The books put every part back on a restart (or from another instance's row)."""
PART_WRITES_ALLOWED = {
    ("kvgate/gateway/sharing.py", "slot", "future"): "the shared budget's hold waits on the shared waiter's future",
}


def _part_writes(tree: ast.AST) -> list[tuple[int, str, str]]:
    """(line, part, field) of each ``x.<part>.<field> = ...`` (or ``+=``) with a part of :data:`PART_OWNERS`."""
    out = []
    for node, t in _assigned(tree):
        for x in (t.elts if isinstance(t, ast.Tuple) else [t]):
            if (isinstance(x, ast.Attribute) and isinstance(x.value, ast.Attribute)
                    and x.value.attr in PART_OWNERS):
                out.append((node.lineno, x.value.attr, x.attr))
    return out


def test_the_part_writes_are_seen() -> None:
    tree = ast.parse("s.slot.busy = True\ns.est.turns += 1\na, s.lin.trail = 1, None\ns.label = 'x'\n")
    assert _part_writes(tree) == [(1, "slot", "busy"), (2, "est", "turns"), (3, "lin", "trail")]


def test_each_part_of_the_session_record_has_one_writer() -> None:
    bad = []
    for path in MODULES.values():
        rel = str(path.relative_to(SRC))
        if rel in PART_RESTORES:
            continue
        for line, part, field in _part_writes(ast.parse(path.read_text())):
            if PART_OWNERS[part] != rel and (rel, part, field) not in PART_WRITES_ALLOWED:
                bad.append(f"{rel}:{line} writes {part}.{field} (its writer: {PART_OWNERS[part]})")
    assert not bad, "\n".join(bad)
