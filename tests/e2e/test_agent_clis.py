"""The agent CLIs themselves — Claude Code (``claude -p``), Codex (``codex exec``) and opencode (``opencode run``),
from npm — run unchanged (apart from the variables ``docs/agents.md`` gives) against ``kvgate gateway`` in front of
``kvgate engine --agent-turns 3``: each ends by itself (exit 0) within its session's 3 turns, every request it sends
answered 2xx, and the gateway lists one session for it with exactly its 3 turns, its title request (where it sends
one) a side request, no rewrite and no prefix break. Skipped where a CLI is not installed (.ci/install-agents.sh puts
them in ~/.cache/kvgate/agents; or on PATH, or in ``$KVGATE_AGENT_BIN``)."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path
from typing import Any

import pytest

from support.agent_runs import MODEL, TASK, check, check_tree, cli, run, setup, stack
from support.aio import timed

TURNS = 3
pytestmark = pytest.mark.slow


@timed(300)
async def test_claude_code_ends_by_itself(tmp_path: Path) -> None:
    exe = cli("claude")
    async for base, rec in stack(TURNS):
        env, proj = setup(tmp_path, {"ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": "x",
                                     "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "4096"})
        rc, out = await run([exe, "-p", TASK, "--model", MODEL], env, proj)
        assert rc == 0, out[-2000:]
        await check(rec, base, "claude-code", TURNS)


@timed(300)
async def test_claude_code_subagent_is_a_child_session(tmp_path: Path) -> None:
    """``kvgate engine --agent-spawn``: Claude Code's first turn calls its Agent tool once, and waits for it; the
    subagent runs its own 3 turns (it spawns none) and ends, then the main agent its remaining two. The gateway
    lists the subagent as the main session's child (Claude Code's agent headers), each with exactly its 3 turns."""
    exe = cli("claude")
    async for base, rec in stack(TURNS, spawn=True):
        env, proj = setup(tmp_path, {"ANTHROPIC_BASE_URL": base, "ANTHROPIC_API_KEY": "x",
                                     "CLAUDE_CODE_MAX_OUTPUT_TOKENS": "4096"})
        rc, out = await run([exe, "-p", TASK, "--model", MODEL], env, proj)
        assert rc == 0, out[-2000:]
        main, sub = await check_tree(rec, base, "claude-code", TURNS)
        assert sub["id"].startswith(main["id"] + "/agent:"), (main, sub)


@timed(300)
async def test_codex_ends_by_itself(tmp_path: Path) -> None:
    exe = cli("codex")
    async for base, rec in stack(TURNS):
        env, proj = setup(tmp_path, {"KVGATE_API_KEY": "x"})
        codex_home = tmp_path / "codex"
        codex_home.mkdir()
        (codex_home / "config.toml").write_text(
            f'model = "{MODEL}"\nmodel_provider = "kvgate"\n\n[model_providers.kvgate]\nname = "kvgate"\n'
            f'base_url = "{base}/v1"\nwire_api = "responses"\nenv_key = "KVGATE_API_KEY"\n')
        env["CODEX_HOME"] = str(codex_home)
        rc, out = await run([exe, "exec", "--skip-git-repo-check", TASK], env, proj)
        assert rc == 0, out[-2000:]
        await check(rec, base, "codex", TURNS)


def opencode_env(tmp_path: Path, base: str) -> tuple[dict[str, str], Path]:
    """opencode's environment and project: kvgate as its provider (``opencode.json``), no fetches."""
    env, proj = setup(tmp_path, {"OPENCODE_DISABLE_MODELS_FETCH": "1", "OPENCODE_DISABLE_AUTOUPDATE": "1"})
    cfg: dict[str, Any] = {"provider": {"kvgate": {
        "npm": "@ai-sdk/openai-compatible", "options": {"baseURL": f"{base}/v1", "apiKey": "x"},
        "models": {MODEL: {"limit": {"context": 40960, "output": 4096}}}}},
        "model": f"kvgate/{MODEL}", "small_model": f"kvgate/{MODEL}"}
    (proj / "opencode.json").write_text(json.dumps(cfg))
    cache = Path(os.environ.get("KVGATE_OPENCODE_CACHE", ""))
    if cache.is_dir():  # a provider package it would otherwise install from npm (1.18 bundles this one)
        shutil.copytree(cache, Path(env["HOME"]) / ".cache" / "opencode")
    return env, proj


@timed(300)
async def test_opencode_ends_by_itself(tmp_path: Path) -> None:
    exe = cli("opencode")
    async for base, rec in stack(TURNS):
        env, proj = opencode_env(tmp_path, base)
        rc, out = await run([exe, "run", TASK], env, proj)
        assert rc == 0, out[-2000:]
        await check(rec, base, "header", TURNS)


@timed(300)
async def test_opencode_subagent_is_a_child_session(tmp_path: Path) -> None:
    """``kvgate engine --agent-spawn``: opencode's first turn calls its task tool once (the first agent type its
    description lists); the subagent runs its 3 turns and ends. The gateway lists it as the main session's child
    (its ``x-parent-session-id``), each with exactly its 3 turns; the main session's title a side request."""
    exe = cli("opencode")
    async for base, rec in stack(TURNS, spawn=True):
        env, proj = opencode_env(tmp_path, base)
        rc, out = await run([exe, "run", TASK], env, proj)
        assert rc == 0, out[-2000:]
        await check_tree(rec, base, "header", TURNS)
