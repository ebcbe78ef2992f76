"""Test-wide setup: the headless matplotlib backend, the real engines' session fixtures, and how the suite
splits over pytest-xdist's workers (``-n auto --dist loadgroup`` in pyproject's addopts).

The split: every test file runs whole on one worker (its module fixtures, e.g. a kvgate engine driven for a
minute, are set up once), and every file that takes a shared real server (``real_vllm_server``,
``real_sglang_server``) runs on that server's worker, so each real server starts once per run. Workers: one per
core, at most :data:`MAX_WORKERS` (each may start engines, drivers and real servers of its own). ``-n 0`` runs
the suite in one process.
"""

import os
import urllib.error
import urllib.request
from collections import defaultdict

import pytest

os.environ.setdefault("MPLBACKEND", "Agg")

from support.real_vllm import real_vllm_model, real_vllm_server  # noqa: E402, F401  (session fixtures of the real-vLLM tests)
from support.sglang_server import real_sglang_model, real_sglang_server  # noqa: E402, F401  (the real-SGLang tests')

MAX_WORKERS = 4
SHARED_SERVERS = ("real_vllm_server", "real_sglang_server")
"""Session fixtures that start a real server: the files that take one share a worker."""
SERVER_ANSWER_S = 60.0
"""How long a shared server has to answer ``/health`` before each test that takes it."""
HEAVY_MARKS = ("slow", "real_vllm", "real_sglang")
"""Marks of tests that take tens of seconds or more: their files are started first."""


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    return max(1, min(MAX_WORKERS, len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else 1))


def _file(item: pytest.Item) -> str:
    return item.nodeid.split("::", 1)[0]


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Give each test its xdist group (before xdist reads them): its file's, or the shared server's its file takes;
    and run the groups that hold a shared server first, then those with a heavy test (:data:`HEAVY_MARKS`), then
    the rest, each in collection order - the long groups start first, so no worker is left alone at the end."""
    servers: dict[str, set[str]] = defaultdict(set)
    heavy: set[str] = set()
    for item in items:
        path = _file(item)
        servers[path].update(f for f in SHARED_SERVERS if f in getattr(item, "fixturenames", ()))
        if any(item.get_closest_marker(m) for m in HEAVY_MARKS):
            heavy.add(path)
    group = {path: "+".join(sorted(names)) or path for path, names in servers.items()}
    rank = {path: 0 if servers[path] else 1 if path in heavy else 2 for path in servers}
    for item in items:
        item.add_marker(pytest.mark.xdist_group(group[_file(item)]))
    order = {g: i for i, g in enumerate(dict.fromkeys(group[_file(it)] for it in items))}
    items.sort(key=lambda it: (rank[_file(it)], order[group[_file(it)]]))


@pytest.fixture(autouse=True)
def _shared_server_answers(request: pytest.FixtureRequest) -> None:
    """Before each test that takes a shared real server: the server answers ``/health``, else the test fails at
    once with the end of the server's log. A server that stopped answering fails the rest of its group within a
    minute a test, instead of each test waiting out its own timeout (the group would outlast CI)."""
    for name in SHARED_SERVERS:
        if name not in request.fixturenames:
            continue
        srv = request.getfixturevalue(name)
        try:
            with urllib.request.urlopen(srv.url + "/health", timeout=SERVER_ANSWER_S) as r:
                status = r.status
        except urllib.error.HTTPError as e:
            status = e.code
        except OSError as e:
            status = f"no answer ({e})"
        if status != 200:
            pytest.fail(f"the shared {name} at {srv.url} no longer answers /health: {status}\n{srv.log_tail()}")
