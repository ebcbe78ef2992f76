"""``kvgate calibrate --endpoint``: the fit recovers a known profile, the profile file round-trips, and against
``kvgate engine`` serving a known profile the fitted profile predicts that engine's step times."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import random
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest

from kvgate.calibration import fit as ce
from kvgate.calibration import measure as cm
from kvgate.engine.costmodel import (
    QWEN3_8B_MI300X,
    Profile,
    load_profile,
    profile,
    profile_to_dict,
    save_profile,
)
from kvgate.errors import UsageError
from support.ports import free_port

KNOWN = Profile(
    name="known-slow",
    kv_pool=200_000,
    kv_bytes_per_token=4096,
    overhead_s=0.02,
    weights_s=0.01,
    per_token_s=2.0e-4,
    attn_s=4.0e-9,
    kv_read_s=1.0e-6,
    per_seq_s=1.0e-3,
    mixed_decode_factor=3.0,
    max_model_len=16_384,
)
"""Steps of tens to hundreds of milliseconds: scheduling noise of a busy machine stays small beside them."""

# step shapes of an agent workload: (prefill chunks as (cached, new), decoders' contexts)
SHAPES = [
    ([(0, 512)], []),
    ([(0, 4096)], []),
    ([(4096, 1024)], []),
    ([], [512]),
    ([], [4096] * 8),
    ([], [2048] * 16),
    ([(0, 1024)], [4096] * 4),
    ([(2048, 1024)], [2048] * 16),
]


def step_time(p: Profile, chunks: list[tuple[int, int]], decoders: list[int]) -> float:
    """A step charged as engine/vllm.py charges it."""
    attn = sum(p.chunk_attn(c, n) for c, n in chunks)
    dec = sum(p.chunk_attn(c, 1) for c in decoders)
    if chunks:
        dec *= p.mixed_decode_factor
    return p.step_time(sum(n for _, n in chunks) + len(decoders), len(chunks) + len(decoders), attn + dec)


def synthetic(p: Profile, budget: int, noise: float, seed: int) -> ce.Measured:
    """Measurements as a server running profile ``p`` would give them, with multiplicative noise."""
    rng = random.Random(seed)
    facts = ce.ServerFacts("http://x", "m", 16, 12_501, 200_000, 16_384, budget, 1024, "test", 4096)
    m = ce.Measured(facts=facts, request_s=0.001, request_per_token_s=2e-7)
    p = replace(p, request_s=m.request_s, request_per_token_s=m.request_per_token_s)  # the way there, measured apart
    plan = ce.Plan()
    samples = [ce.Sample("cold", L, 0, 1, 1, 0.0) for L in plan.cold]
    samples += [ce.Sample("incremental", a + b, a, 1, 1, 0.0) for a, b in plan.incremental]
    samples += [ce.Sample("decode", C, C, B, plan.decode_tokens, 0.0)
                for C in plan.decode_contexts for B in plan.decode_batches]
    samples += [ce.Sample("mixed", n, 0, B, C, 0.0) for B, C, n in plan.mixed]
    for s in samples:
        s.seconds = ce.predict(p, s, budget) * (1.0 + rng.uniform(-noise, noise))
    m.samples = samples
    # a c(L) load: 4 closed-loop workers of 10 turns, back to back, as the engine would serve them
    workers = {w: [(rng.randint(512, 6144), 0.0) for _ in range(10)] for w in range(4)}
    served = ce.closed_loop(p, facts, workers, {w: 0.0 for w in workers})
    for (w, k), (sent, end) in served.items():
        span = (end - sent) * (1.0 + rng.uniform(-noise, noise))
        m.load.append(ce.LoadTurn(w, workers[w][k][0], 0, sent, sent + span))
    return m


@pytest.mark.parametrize("noise", [0.0, 0.03])
def test_fit_recovers_the_step_times_of_a_known_profile(noise: float) -> None:
    m = synthetic(KNOWN, 8192, noise, seed=7)
    fitted, cal = ce.fit(m, "fitted")
    for chunks, decoders in SHAPES:
        want = step_time(KNOWN, chunks, decoders)
        got = step_time(fitted, chunks, decoders)
        assert abs(got - want) / want < 0.03 + 2 * noise, (chunks, decoders, got, want)
    assert cal["max_abs_error"] < 0.03 + 1.5 * noise  # the factor is chosen on a grid of 9% steps
    assert fitted.kv_pool == 200_000 and fitted.max_model_len == 16_384


def test_fit_detects_a_profile_it_was_not_given() -> None:
    """The comparison above can fail: the fitted profile of one engine mispredicts a different engine."""
    m = synthetic(KNOWN, 8192, 0.0, seed=7)
    fitted, _ = ce.fit(m, "fitted")
    other = replace(KNOWN, kv_read_s=3e-6, mixed_decode_factor=6.0)
    errs = [abs(step_time(fitted, c, d) - step_time(other, c, d)) / step_time(other, c, d) for c, d in SHAPES]
    assert max(errs) > 0.25


def test_profile_file_round_trips(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    save_profile(KNOWN, path, {"block_size": 128})
    assert load_profile(path) == KNOWN
    assert profile(str(path)) == KNOWN
    obj = json.loads(path.read_text())
    assert obj["calibration"] == {"block_size": 128} and obj["kvgate_profile"] == 1
    assert profile_to_dict(QWEN3_8B_MI300X)["overhead_s"] == QWEN3_8B_MI300X.overhead_s


@pytest.mark.parametrize(
    "edit, msg",
    [
        (lambda o: o.pop("kvgate_profile"), "not a kvgate profile"),
        (lambda o: o.update(per_token_s=-1.0), "per_token_s"),
        (lambda o: o.update(kv_pool=1.5), "kv_pool"),
        (lambda o: o.update(typo_s=1.0), "unknown keys typo_s"),
        (lambda o: o.pop("attn_s"), "missing 'attn_s'"),
        (lambda o: o.update(mixed_decode_factor=0.5), "mixed_decode_factor"),
    ],
)
def test_bad_profile_files_are_usage_errors(tmp_path: Path, edit: object, msg: str) -> None:
    obj = profile_to_dict(KNOWN)
    edit(obj)  # type: ignore[operator]
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(obj))
    with pytest.raises(UsageError, match=msg):
        load_profile(path)


def test_profile_names_and_missing_files() -> None:
    assert profile("qwen3-8b-mi300x") is QWEN3_8B_MI300X
    with pytest.raises(UsageError, match="cannot read profile"):
        profile("/nonexistent/p.json")
    with pytest.raises(UsageError, match="unknown profile"):
        profile("no-such-profile")


def test_sim_takes_a_profile_file(tmp_path: Path) -> None:
    path = tmp_path / "slow.json"
    save_profile(replace(KNOWN, max_model_len=40_960), path)
    out = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "sim", "--profile", str(path), "--minutes", "3", "--lam", "0.02",
         "--json"],
        capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 0, out.stderr
    slow = json.loads(out.stdout)
    fast = json.loads(subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "sim", "--minutes", "3", "--lam", "0.02", "--json"],
        capture_output=True, text=True, timeout=120,
    ).stdout)
    assert slow["sessions_arrived"] == fast["sessions_arrived"]
    assert slow != fast  # the slower engine serves the same arrivals differently


# -- against a live kvgate engine --------------------------------------------------------------------------------


def _wait(url: str, proc: subprocess.Popen[bytes], timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise RuntimeError("server exited early")
        try:
            with urllib.request.urlopen(url, timeout=1):
                return
        except OSError:
            time.sleep(0.2)
    raise TimeoutError(url)


@contextlib.contextmanager
def _engine(tmp: Path, time_scale: float) -> Iterator[str]:
    """``kvgate engine`` serving :data:`KNOWN` at ``time_scale``; its URL."""
    path = tmp / "known.json"
    save_profile(KNOWN, path)
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvgate.cli", "engine", "--profile", str(path), "--port", str(port),
         "--time-scale", f"{time_scale:g}"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        _wait(f"http://127.0.0.1:{port}/health", proc)
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.fixture(scope="module")
def known_engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with _engine(tmp_path_factory.mktemp("prof"), 1.0) as url:
        yield url


SMALL = ce.Plan(
    cold=(512, 2048, 6144),
    incremental=((4096, 1024),),
    decode_batches=(1, 8),
    decode_contexts=(512, 4096),
    decode_tokens=24,
    mixed=((8, 4096, 1024),),
    reps=2,
    load_workers=4,
    load_seconds=20.0,
)

TOLERANCE = 0.25
"""Largest relative error of a fitted step time against the served profile's (the stated tolerance)."""


@pytest.mark.slow
def test_fitted_profile_predicts_the_engine_it_measured(known_engine: str) -> None:
    m = asyncio.run(cm.measure(known_engine, plan=SMALL, seed=3))
    assert m.facts.block_size == 16 and m.facts.kv_pool == KNOWN.kv_pool
    fitted, cal = ce.fit(m, "fitted")
    errs = {}
    for chunks, decoders in SHAPES:
        want = step_time(KNOWN, chunks, decoders)
        errs[str((chunks, decoders))] = (step_time(fitted, chunks, decoders) - want) / want
    assert max(abs(e) for e in errs.values()) < TOLERANCE, errs
    ld = cal["load"]
    assert abs(ld["mean_turn_s_predicted"] - ld["mean_turn_s_measured"]) / ld["mean_turn_s_measured"] < TOLERANCE
    assert all(s["cached"] == 0 for s in cal["samples"] if s["kind"] == "cold")
    assert all(s["cached"] > 0 for s in cal["samples"] if s["kind"] == "incremental")


CLI_SCALE = 4.0
"""The time scale of the command-line run: the engine runs 4x faster than real time, and calibrate is told so."""


@pytest.mark.slow
def test_cli_writes_a_loadable_profile(tmp_path: Path) -> None:
    out = tmp_path / "fit.json"
    with _engine(tmp_path, CLI_SCALE) as url:
        r = subprocess.run(
            [sys.executable, "-m", "kvgate.cli", "calibrate", "--endpoint", url, "--quick", "--out", str(out),
             "--name", "fit", "--time-scale", f"{CLI_SCALE:g}", "--json"],
            capture_output=True, text=True, timeout=300,
        )
    assert r.returncode == 0, r.stderr
    obj = json.loads(r.stdout)
    p = load_profile(out)
    assert p.name == "fit" and obj["name"] == "fit"
    assert math.isclose(p.per_token_s, obj["per_token_s"])
    assert obj["calibration"]["block_size"] == 16


def test_cli_errors_are_one_line(tmp_path: Path) -> None:
    port = free_port()
    r = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "calibrate", "--endpoint", f"http://127.0.0.1:{port}"],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 2
    assert r.stderr.startswith("kvgate: error: cannot reach") and r.stderr.count("\n") == 1
    r = subprocess.run(
        [sys.executable, "-m", "kvgate.cli", "calibrate", "--out", str(tmp_path / "x.json")],
        capture_output=True, text=True, timeout=60,
    )
    assert r.returncode == 2 and "need --endpoint" in r.stderr


# -- errors against servers that are not (fully) vLLM ----------------------------------------------------------
def _fake_app(metrics: str, cached: bool) -> object:
    from aiohttp import web

    async def models(_r: web.Request) -> web.Response:
        return web.json_response({"data": [{"id": "m", "max_model_len": 8192}]})

    async def metrics_h(_r: web.Request) -> web.Response:
        return web.Response(text=metrics)

    async def completions(_r: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(_r)
        await resp.write(b'data: {"choices": [{"text": "x"}]}\n\n')
        usage: dict[str, object] = {"prompt_tokens": 10, "completion_tokens": 2}
        if cached:
            usage["prompt_tokens_details"] = {"cached_tokens": 0}
        await resp.write(b"data: " + json.dumps({"choices": [], "usage": usage}).encode() + b"\n\ndata: [DONE]\n\n")
        return resp

    app = web.Application()
    app.router.add_get("/v1/models", models)
    app.router.add_get("/metrics", metrics_h)
    app.router.add_post("/v1/completions", completions)
    return app


VLLM_METRICS = 'vllm:cache_config_info{block_size="16",num_gpu_blocks="1001",enable_prefix_caching="True"} 1.0\n'


@pytest.mark.parametrize(
    "metrics, cached, msg",
    [
        ("# no vllm here\n", True, "is neither vLLM"),
        (VLLM_METRICS, False, "does not report cached tokens"),
        (VLLM_METRICS, True, "prefix caching is not working"),
        (VLLM_METRICS.replace("True", "False"), True, "prefix caching is off"),
    ],
)
def test_servers_calibration_cannot_use_are_usage_errors(metrics: str, cached: bool, msg: str) -> None:
    from aiohttp import web

    async def go() -> None:
        runner = web.AppRunner(_fake_app(metrics, cached))  # type: ignore[arg-type]
        await runner.setup()
        port = free_port()
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        try:
            with pytest.raises(UsageError, match=msg):
                await asyncio.wait_for(cm.measure(f"http://127.0.0.1:{port}", plan=SMALL, timeout_s=30), 60)
        finally:
            await runner.cleanup()

    asyncio.run(go())


def test_request_time_is_a_line_through_the_time_outside_the_engine() -> None:
    """The way to the engine and back, from requests the engine timed: a line in the prompt's length that one
    request delayed by a busy machine does not tilt; none of its parts negative; too few requests: the fallback."""
    rng = random.Random(3)
    front = [(n, 0.004 + 0.8e-6 * n + rng.uniform(-2e-4, 2e-4)) for n in (256, 512, 1024, 2048, 4096, 8192, 9216)
             for _ in range(3)]
    front.append((1024, 0.050))  # a stray one
    a, b = ce.request_time(front, 0.001)
    assert a == pytest.approx(0.004, abs=4e-4) and b == pytest.approx(0.8e-6, rel=0.1)
    a, b = ce.request_time([(n, 0.003) for n in (256, 512, 1024, 4096)], 0.001)
    assert a == pytest.approx(0.003, abs=1e-5) and b == pytest.approx(0.0, abs=1e-9)
    assert ce.request_time([(100, 0.5), (200, 0.6)], 0.001) == (0.001, 0.0)
    a, b = ce.request_time([(n, max(0.0, 0.01 - 1e-6 * n)) for n in (1000, 4000, 8000)], 0.0)  # falls: not below 0
    assert b == 0.0 and a > 0


def test_the_fitted_profile_carries_the_request_time() -> None:
    m = synthetic(KNOWN, 8192, 0.0, seed=7)
    fitted, cal = ce.fit(m, "fitted")
    assert fitted.request_s == 0.001 and fitted.request_per_token_s == 2e-7
    assert "request time" in ce.format_report(fitted, cal)
