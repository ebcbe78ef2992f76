"""The agent driver (``kvgate drive``) against a fake OpenAI-compatible server on loopback.

The fake server remembers each session's last sequence (prompt + output) and reports as cached the longest common
prefix of a new prompt with it (a first turn: with the previous session's first prompt, i.e. the shared prefix),
so the tests can check on the server side that every prompt extends the previous one exactly.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web

from kvgate.analysis.summary import summarize
from kvgate.drive.driver import DriveConfig, Driver
from kvgate.errors import UsageError
from kvgate.records import load_run
from kvgate.workload.arrivals import generate
from kvgate.workload.shapes import PRESETS, Phase, Workload
from support.aio import timed
from support.fake_engine import TINY, FakeEngine, common_prefix, drive_config, drive_run  # noqa: F401  # noqa: F401
from support.ports import free_port

# ---------------------------------------------------------------------------------------------------------------


@timed(60)
async def test_same_seed_same_sessions_and_exact_prefix_extension(tmp_path: Path) -> None:
    cfg = drive_config("", seed=11)
    specs = {s.sid: s for s in generate(TINY, cfg.lam, cfg.horizon_s, cfg.seed)}
    assert len(specs) >= 10
    seen: list[dict[int, list[list[int]]]] = []
    for i in range(2):
        async with FakeEngine() as eng:
            res = await drive_run(cfg.with_(endpoint=eng.url), tmp_path / f"run{i}")
            assert eng.violations == []
            seen.append({sid: [t["prompt"] for t in ts] for sid, ts in eng.turns.items()})
            run = load_run(tmp_path / f"run{i}")
            # the sessions are generate()'s: ids, arrival times, cohorts, shapes
            sess = run.sessions
            assert sorted(sess["session"].tolist()) == sorted(specs)
            for sid, arr in zip(sess["session"].tolist(), sess["arrival_s"].tolist(), strict=True):
                assert arr == specs[sid].arrival_s
            # first sends at the arrival times (within the schedule lag), think times exactly as drawn
            t = run.turns
            ok = t["status"] == "ok"
            # every turn is done but those in flight at the horizon (how many there are depends on the machine's load)
            assert set(t["status"][~ok]) <= {"aborted"} and (t["end_s"][~ok] == cfg.horizon_s).all()
            assert ok.sum() >= 0.8 * len(ok)
            for sid, ts in eng.turns.items():
                sp = specs[sid]
                rows = sorted(
                    (int(k), float(sub), float(end), float(sent))
                    for s_, k, sub, end, sent in zip(
                        t["session"], t["turn"], t["submit_s"], t["end_s"], t["sent_s"], strict=True
                    )
                    if s_ == sid
                )
                assert rows[0][1] == sp.arrival_s
                # (the lag itself is load-dependent: benchmarks/bench_driver.py measures it; half a real second here)
                assert 0 <= rows[0][3] - sp.arrival_s < 0.5 * cfg.time_scale
                for (k0, _, end0, _), (k1, sub1, _, _) in zip(rows, rows[1:], strict=False):
                    assert k1 == k0 + 1
                    assert sub1 == pytest.approx(end0 + sp.think_s[k0], abs=1e-9)
                # prompt lengths follow the shape; prompt k+1 = prompt k + output k + appended k
                want = sp.shape.prompt_tokens()
                for k, turn in enumerate(ts):
                    assert len(turn["prompt"]) == want[k]
                    if k + 1 < len(ts):
                        nxt = ts[k + 1]["prompt"]
                        head = turn["prompt"] + turn["out"]
                        assert nxt[: len(head)] == head
                        assert len(nxt) - len(head) == sp.shape.appends[k]
                        assert ts[k + 1]["cached"] == len(head)  # the whole previous sequence is reusable
            assert res.summary["turns_done"] == int(ok.sum())
    # same seed, same token ids: every turn both runs sent is the same (how many a session sent before the horizon
    # depends on the machine's load, as above)
    both = seen[0].keys() & seen[1].keys()
    assert len(both) >= 0.8 * len(specs)
    for sid in both:
        a, b = seen[0][sid], seen[1][sid]
        n = min(len(a), len(b))
        assert n >= 1 and a[:n] == b[:n], sid
    assert sum(min(len(seen[0][sid]), len(seen[1][sid])) >= 2 for sid in both) >= 0.5 * len(both)
    # shared prefix identical across sessions, unique parts not
    firsts = [ps[0] for ps in seen[0].values()]
    assert all(f[:16] == firsts[0][:16] for f in firsts)
    assert len({tuple(f[16:]) for f in firsts}) == len(firsts)


@timed(15)
async def test_paper_preset_sessions_match_generate(tmp_path: Path) -> None:
    wl = PRESETS["paper-8b"]
    async with FakeEngine() as eng:
        cfg = drive_config(eng.url, lam=0.1, minutes=0.5, seed=501, time_scale=60.0)
        await drive_run(cfg, tmp_path / "run", workload=wl)
        assert eng.violations == []
        specs = generate(wl, cfg.lam, cfg.horizon_s, cfg.seed)
        assert len(specs) > 0
        firsts = sorted((r["t"], r["sid"]) for r in eng.requests if r["turn"] == 0)
        # same sessions, in the same order of arrival (one arriving just before the horizon may be aborted before
        # its first request reaches the engine: only the last ones can be missing)
        assert firsts and [sid for _, sid in firsts] == [s.sid for s in specs][: len(firsts)]
        assert len(firsts) >= len([s for s in specs if s.arrival_s < cfg.horizon_s / 2])
        for s in specs[: len(firsts)]:
            assert len(eng.turns[s.sid][0]["prompt"]) == s.shape.initial_tokens == 6000
            assert eng.turns[s.sid][0]["prompt"][:2000] == eng.turns[specs[0].sid][0]["prompt"][:2000]


@timed(60)
async def test_headers_session_id_and_end(tmp_path: Path) -> None:
    async with FakeEngine() as eng:
        # think times short enough that sessions finish within the run
        wl = Workload("tiny-fast", phases=(Phase(0.0, TINY.phases[0].shape, 0.5),))
        res = await drive_run(drive_config(eng.url, lam=0.3, minutes=1.0), tmp_path / "run", workload=wl)
        assert res.summary["sessions_finished"] > 0
        for r in eng.requests:
            last = r["turn"] == 3
            assert (r["end"] == "true") is last, r
        finished = [sid for sid, ts in eng.turns.items() if len(ts) == 4]
        assert finished
        run = load_run(tmp_path / "run")
        ends = dict(zip(run.sessions["session"].tolist(), run.sessions["end_s"].tolist(), strict=True))
        assert all(not math.isnan(ends[sid]) for sid in finished)


@timed(15)
async def test_custom_session_header(tmp_path: Path) -> None:
    seen: list[str] = []

    @web.middleware
    async def grab(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.path.endswith("completions"):
            seen.append(request.headers.get("X-Agent-Session", ""))
        return await handler(request)

    app = web.Application(middlewares=[grab])
    eng = FakeEngine()

    async def comp(request: web.Request) -> web.StreamResponse:
        hdrs = dict(request.headers)
        hdrs["X-Session-ID"] = request.headers["X-Agent-Session"]
        request = request.clone(headers=hdrs)
        return await eng.completions(request)

    app.router.add_get("/v1/models", eng.models)
    app.router.add_post("/v1/completions", comp)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        url = f"http://127.0.0.1:{runner.addresses[0][1]}/v1/"
        await drive_run(drive_config(url, session_header="X-Agent-Session", minutes=0.5), tmp_path / "run")
    finally:
        await runner.cleanup()
    assert seen and all(s.isdigit() for s in seen)


@timed(15)
async def test_records_load_and_summarize(tmp_path: Path) -> None:
    async with FakeEngine() as eng:
        res = await drive_run(drive_config(eng.url, flush_at=0.5), tmp_path / "run")
    run = load_run(tmp_path / "run")
    assert run.meta["kind"] == "drive" and run.meta["seed"] == 7 and run.meta["partial"] is False
    assert run.meta["config"]["endpoint"] == eng.url and run.meta["kvgate_version"]
    assert not any((tmp_path / "run" / f"{n}.jsonl").exists() for n in ("turns", "sessions", "samples"))
    s = summarize(run)
    assert s["sessions_arrived"] == len(run.sessions["session"]) > 0
    st = run.turns["status"].tolist()
    assert s["turns_done"] == st.count("ok")
    # every request the engine saw is a finished turn or one aborted at the horizon; a turn aborted at the horizon
    # may not have reached the engine yet (it was still connecting), so the engine can have seen fewer
    assert st.count("ok") <= len(eng.requests) <= st.count("ok") + st.count("aborted")
    assert res.summary["turns_done"] == s["turns_done"] and set(st) <= {"ok", "aborted"}
    # cached tokens as the server reported them; admit_s not observable
    t = run.turns
    server = {(sid, k): turn["cached"] for sid, ts in eng.turns.items() for k, turn in enumerate(ts)}
    for sid, k, c, status in zip(t["session"], t["turn"], t["cached_tokens"], t["status"], strict=True):
        if status == "ok":
            assert c == server[(int(sid), int(k))]
    assert np.isnan(run.turns["admit_s"]).all()
    # virtual time: samples every 10 s up to the horizon, lag in virtual seconds
    assert run.samples["t_s"].tolist() == [10.0 * i for i in range(7)]
    assert run.samples["in_system"].max() > 0
    assert (run.turns["lag_s"] >= 0).all() and (run.turns["end_s"] <= 60.0 + 1e-6).all()
    assert res.summary["lag_p99_ms"] is not None
    # the flush went to vLLM's endpoint (preempting running requests) once
    assert eng.flushes == ["/reset_prefix_cache?reset_running_requests=true"]
    # at its minute, never before it, and within the run (how late depends on the machine's load at x120)
    assert run.meta["flush"]["ok"] and 30.0 - 1e-3 <= run.meta["flush"]["at_s"] < 60.0


@timed(15)
async def test_missing_cached_tokens_is_null_with_one_warning(tmp_path: Path) -> None:
    logs: list[str] = []
    async with FakeEngine(report_cached=False) as eng:
        res = await drive_run(drive_config(eng.url), tmp_path / "run", logs)
    assert len(eng.requests) > 5
    run = load_run(tmp_path / "run")
    assert np.isnan(run.turns["cached_tokens"]).all()
    assert res.summary["hit_ratio_last10"] is None  # unknown, not 0 (hit_ratio_all: see docs/driver.md)
    warned = [m for m in logs if "cached" in m]
    assert len(warned) == 1 and len(res.warnings) == 1
    assert "--enable-prompt-tokens-details" in warned[0] and "--enable-cache-report" in warned[0]


@timed(15)
async def test_no_token_ids_falls_back_to_stand_in_ids(tmp_path: Path) -> None:
    logs: list[str] = []
    async with FakeEngine(return_ids=False) as eng:
        res = await drive_run(drive_config(eng.url), tmp_path / "run", logs)
        multi = [ts for ts in eng.turns.values() if len(ts) > 1]
        assert multi
        for ts in multi:
            for a, b in zip(ts, ts[1:], strict=False):
                assert b["prompt"][: len(a["prompt"])] == a["prompt"]  # prompts still extend each other
                assert b["cached"] == len(a["prompt"])  # ... but the stand-in output is not the server's
    assert sum("token ids" in w for w in res.warnings) == 1
    assert res.meta["token_ids_returned"] is False


@timed(15)
async def test_4xx_is_recorded_not_retried_and_ends_the_session(tmp_path: Path) -> None:
    cfg = drive_config("")
    sid = generate(TINY, cfg.lam, cfg.horizon_s, cfg.seed)[0].sid
    async with FakeEngine(fail={(sid, 1): [400]}) as eng:
        res = await drive_run(cfg.with_(endpoint=eng.url), tmp_path / "run")
        attempts = [r for r in eng.requests if r["sid"] == sid]
    assert [r["turn"] for r in attempts] == [0, 1]  # one attempt at turn 1, nothing after
    run = load_run(tmp_path / "run")
    t = run.turns
    mine = t["session"] == sid
    assert t["status"][mine].tolist() == ["ok", "error"]
    row = int(np.nonzero(run.sessions["session"] == sid)[0][0])
    assert run.sessions["turns_done"][row] == 1 and math.isnan(run.sessions["end_s"][row])
    errs = [json.loads(x) for x in (tmp_path / "run" / "errors.jsonl").read_text().splitlines()]
    assert [(e["session"], e["turn"], e["http_status"], e["retry"]) for e in errs] == [(sid, 1, 400, False)]
    assert res.summary["turns_error"] == 1


@timed(15)
async def test_5xx_is_retried_with_backoff(tmp_path: Path) -> None:
    cfg = drive_config("", retries=3)
    sid = generate(TINY, cfg.lam, cfg.horizon_s, cfg.seed)[0].sid
    async with FakeEngine(fail={(sid, 1): [503, 502]}) as eng:
        await drive_run(cfg.with_(endpoint=eng.url), tmp_path / "run")
        attempts = [r["turn"] for r in eng.requests if r["sid"] == sid]
    assert attempts[:4] == [0, 1, 1, 1]
    run = load_run(tmp_path / "run")
    assert "error" not in run.turns["status"].tolist()
    # turn 1 succeeded at its third attempt, and so did every turn after it (but one the run's end cut short)
    st = run.turns["status"][run.turns["session"] == sid].tolist()
    assert st[:2] == ["ok", "ok"] and set(st[:-1]) == {"ok"} and st[-1] in ("ok", "aborted")
    errs = [json.loads(x) for x in (tmp_path / "run" / "errors.jsonl").read_text().splitlines()]
    assert [(e["attempt"], e["http_status"], e["retry"]) for e in errs] == [(1, 503, True), (2, 502, True)]


@timed(20)
async def test_server_killed_mid_run(tmp_path: Path) -> None:
    out = tmp_path / "run"
    async with FakeEngine() as eng:
        task = asyncio.create_task(drive_run(drive_config(eng.url, minutes=2.0, lam=0.5, retries=1), out))
        while len(eng.requests) < 15:
            await asyncio.sleep(0.01)
        partial = load_run(out)  # readable while running: provisional run.json + jsonl
        assert partial.meta["partial"] is True and len(partial.turns["session"]) > 0
        await eng.stop()
        res = await task
    run = load_run(out)
    st = run.turns["status"].tolist()
    assert "ok" in st and "error" in st
    assert res.summary["turns_error"] == st.count("error") > 0
    errs = [json.loads(x) for x in (out / "errors.jsonl").read_text().splitlines()]
    assert errs and all(e["kind"] == "connect" for e in errs)
    assert any(e["retry"] for e in errs) and any(not e["retry"] for e in errs)
    summarize(run)


@timed(15)
async def test_time_scale_compresses_time(tmp_path: Path) -> None:
    async with FakeEngine() as eng:
        t0 = time.perf_counter()
        res = await drive_run(drive_config(eng.url, minutes=1.0, time_scale=120.0), tmp_path / "run")
        wall = time.perf_counter() - t0
    # 60 virtual s at 120x take 0.5 real s; a loaded machine may take longer, but nowhere near the 60 s of 1x
    assert 0.5 <= wall < 10.0
    run = load_run(tmp_path / "run")
    assert run.samples["t_s"][-1] == 60.0
    assert run.turns["end_s"].max() > 30.0  # virtual seconds, not real ones
    assert res.meta["stopped_at_s"] == 60.0


@timed(15)
async def test_streaming_records_first_token(tmp_path: Path) -> None:
    async with FakeEngine() as eng:
        await drive_run(drive_config(eng.url, stream=True), tmp_path / "run")
        assert eng.violations == []
        assert all(r["body"]["stream_options"] == {"include_usage": True} for r in eng.requests)
    run = load_run(tmp_path / "run")
    t = run.turns
    ok = t["status"] == "ok"
    assert ok.sum() > 5
    t = {k: v[ok] for k, v in t.items()}
    assert (t["first_token_s"] >= t["sent_s"]).all() and (t["first_token_s"] <= t["end_s"]).all()
    assert not np.isnan(t["cached_tokens"]).any()


@pytest.mark.parametrize("stream", [False, True])
@timed(15)
async def test_chat_api_extends_messages_verbatim(tmp_path: Path, stream: bool) -> None:
    async with FakeEngine() as eng:
        await drive_run(drive_config(eng.url, api="chat", stream=stream), tmp_path / "run")
        assert eng.violations == []
        multi = [ts for ts in eng.turns.values() if len(ts) > 2]
        assert multi
        for ts in multi:
            m0 = ts[0]["messages"]
            assert m0[0]["role"] == "system" and len(m0[0]["content"].split()) == 16
            assert m0[1]["role"] == "user" and len(m0[1]["content"].split()) == 32
            for a, b in zip(ts, ts[1:], strict=False):
                n = len(a["messages"])
                assert b["messages"][:n] == a["messages"]
                assert b["messages"][n] == {"role": "assistant", "content": a["text"]}
                assert b["messages"][n + 1]["role"] == "user" and len(b["messages"][n + 1]["content"].split()) == 10
        systems = {ts[0]["messages"][0]["content"] for ts in eng.turns.values()}
        assert len(systems) == 1


@timed(15)
async def test_flush_falls_back_to_sglang_and_retries_400(tmp_path: Path) -> None:
    logs: list[str] = []
    async with FakeEngine(has_reset=False, flush_400=2) as eng:
        res = await drive_run(drive_config(eng.url, flush_at=0.2, flush_retry_s=3.0), tmp_path / "run", logs)
    assert eng.flushes == ["/flush_cache 400", "/flush_cache 400", "/flush_cache"]
    fl = res.meta["flush"]
    assert fl["endpoint"] == "/flush_cache" and fl["attempts"] == 3 and fl["ok"]
    assert sum("answered 400" in m for m in logs) == 2


@timed(15)
async def test_stop_finishes_records_and_aborts_in_flight(tmp_path: Path) -> None:
    async with FakeEngine(delay_s=0.5) as eng:
        d = Driver(
            drive_config(eng.url, minutes=5.0, lam=2.0), tmp_path / "run", workload=TINY, status=False,
            log=lambda _m: None, handle_signals=False,
        )
        task = asyncio.create_task(d.run())
        while len(eng.requests) < 5:
            await asyncio.sleep(0.01)
        d.stop()
        res = await task
    assert res.interrupted and res.summary["interrupted"] is True
    run = load_run(tmp_path / "run")
    assert run.meta["partial"] is False and run.meta["stopped_at_s"] < 5 * 60
    st = run.turns["status"].tolist()
    assert st.count("aborted") == res.summary["turns_aborted"] >= 5  # the turns in flight at the stop
    # every session the engine saw is recorded; one that arrived just before the stop may not have reached the
    # engine yet (its first turn still connecting, or not started): then its only row is that turn, aborted
    seen, recorded = {r["sid"] for r in eng.requests}, set(run.sessions["session"].tolist())
    assert seen <= recorded
    for sid in recorded - seen:
        rows = run.turns["session"] == sid
        assert run.turns["turn"][rows].tolist() in ([], [0]) and set(run.turns["status"][rows]) <= {"aborted"}


@timed(15)
async def test_hard_cancel_leaves_a_readable_partial_run(tmp_path: Path) -> None:
    async with FakeEngine() as eng:
        task = asyncio.create_task(drive_run(drive_config(eng.url, minutes=5.0, lam=2.0), tmp_path / "run"))
        while len(eng.turns) < 5:
            await asyncio.sleep(0.01)
        task.cancel()  # as if the process died: no finishing
        with contextlib.suppress(asyncio.CancelledError):
            await task
    run = load_run(tmp_path / "run")
    assert run.meta["partial"] is True
    assert len(run.turns["session"]) >= sum(len(ts) for ts in eng.turns.values()) - 1
    summarize(run)




def test_endpoint_down_at_start_exits_2_with_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from kvgate import cli as cli_mod

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(SystemExit) as exc:
        cli_mod.main(["drive", "--endpoint", url, "--minutes", "1", "--out", str(tmp_path / "run")])
    assert exc.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("kvgate: error: cannot reach the endpoint")
    assert not (tmp_path / "run").exists()


def test_bad_options_are_usage_errors(tmp_path: Path) -> None:
    from kvgate.drive.config import validate

    for kw in ({"time_scale": 0}, {"lam": -1}, {"bursts": ("nonsense",)}, {"endpoint": "localhost:8000"}):
        with pytest.raises(UsageError):
            validate(DriveConfig(**{"endpoint": "http://x:1", **kw}))  # type: ignore[arg-type]


@timed(15)
async def test_out_dir_with_a_run_is_refused(tmp_path: Path) -> None:
    async with FakeEngine() as eng:
        await drive_run(drive_config(eng.url, minutes=0.2), tmp_path / "run")
        with pytest.raises(UsageError, match="already holds a run"):
            await drive_run(drive_config(eng.url, minutes=0.2), tmp_path / "run")
        await drive_run(drive_config(eng.url, minutes=0.2), tmp_path / "run", force=True)
    assert load_run(tmp_path / "run").meta["partial"] is False


@timed(25)
async def test_ctrl_c_stops_cleanly_in_a_subprocess(tmp_path: Path) -> None:
    out = tmp_path / "run"
    async with FakeEngine() as eng:
        args = [
            "drive", "--endpoint", eng.url, "--trace", "bundled", "--lam", "0.5", "--minutes", "30",
            "--time-scale", "30", "--retries", "0", "--out", str(out), "--json",
        ]
        env = dict(os.environ)
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "kvgate.cli", *args,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, env=env,
        )
        try:
            while not eng.requests:
                await asyncio.sleep(0.05)
                if proc.returncode is not None:
                    break
            await asyncio.sleep(0.5)
            proc.send_signal(signal.SIGINT)
            stdout, stderr = await proc.communicate()
        finally:
            if proc.returncode is None:
                proc.kill()
                await proc.wait()
    assert proc.returncode == 130, stderr.decode()
    summary = json.loads(stdout.decode().strip().splitlines()[-1])
    assert summary["interrupted"] is True and summary["turns_done"] > 0
    run = load_run(out)
    assert run.meta["interrupted"] is True and run.meta["partial"] is False
    assert (out / "turns.parquet").exists() and run.meta["stopped_at_s"] < 30 * 60
    assert len(run.turns["session"]) == summary["turns_done"] + summary["turns_aborted"]


def test_reply_parsing_and_endpoint_names() -> None:
    from kvgate.drive.client import normalize_endpoint
    from kvgate.drive.replies import AttemptError, parse_completion

    r = parse_completion(
        {
            "choices": [{"text": "a b", "token_ids": [5, 6]}],
            "usage": {"prompt_tokens": 9, "completion_tokens": 2, "prompt_tokens_details": {"cached_tokens": 3}},
        }
    )
    assert (r.text, r.token_ids, r.prompt_tokens, r.completion_tokens) == ("a b", [5, 6], 9, 2)
    assert r.cached_tokens == 3 and r.cached_reported
    r = parse_completion({"choices": [{"message": {"content": "hi"}}], "usage": {"prompt_tokens_details": None}})
    assert r.text == "hi" and r.token_ids is None and r.cached_tokens is None and not r.cached_reported
    bads: list[Any] = [{"choices": []}, {"choices": [{"text": "a", "token_ids": ["x"]}]}, [1], {"error": {"m": 1}}]
    for bad in bads:
        with pytest.raises(AttemptError) as e:
            parse_completion(bad)
        assert not e.value.retryable
    # vLLM 0.32's prompt_tokens_details also carries created_cache_tokens (and multimodal_tokens)
    r = parse_completion(
        {
            "choices": [{"text": "x"}],
            "usage": {"prompt_tokens": 1000, "completion_tokens": 1, "total_tokens": 1001,
                      "prompt_tokens_details": {"cached_tokens": 896, "created_cache_tokens": 104,
                                                "multimodal_tokens": None}},
        }
    )
    assert (r.prompt_tokens, r.cached_tokens, r.cached_reported) == (1000, 896, True)
    for url in ("http://h:8000", "http://h:8000/", "http://h:8000/v1", "http://h:8000/v1/"):
        assert normalize_endpoint(url) == "http://h:8000"
    with pytest.raises(UsageError):
        normalize_endpoint("h:8000")


def test_gateway_log_reads_the_gateways_side_in_the_drivers_terms() -> None:
    from kvgate.drive.gateway_log import GatewayLog

    start = {"kvgate": "gateway", "control": "budgeter", "spec": "budgeter:low=0.75:high=0.95", "time_scale": 30.0,
             "now_s": 12.0, "scheduled": None, "parks": 5, "waits": 2, "readmissions": 4,
             "sessions": {"admitted": 3, "parked": 1, "waiting": 2, "demand_tokens": 900}}
    log = GatewayLog(start, driver_scale=60.0)  # the gateway runs at half the driver's speed
    assert log.scale_mismatch and log.wait_s(1.5) == 3.0
    assert log.sample() == (3, 1, 2, 900)
    log.turn(10.0, "none", "none")
    log.turn(20.0, "parked", "none")
    log.turn(65.0, "waiting", "budgeter:low=0.75:high=0.95")
    log.turn(70.0, "none", "budgeter:low=0.75:high=0.95")
    assert (log.turns_seen, log.turns_parked, log.turns_waited) == (4, 1, 1)
    assert [c["spec"] for c in log.controls] == ["none", "budgeter:low=0.75:high=0.95"]
    # begun under none, later budgeter: the control started at the first turn it released
    assert log.control() == ("budgeter", 65.0 / 60.0)
    log.end = {"parks": 9, "waits": 2}  # (an answer without readmissions)
    rec = log.record()
    assert rec["parks_during_run"] == 4 and rec["waits_during_run"] == 0 and rec["readmissions_during_run"] is None
    # a control scheduled with --control-at: its gateway time, on the driver's clock
    sched = GatewayLog({**start, "control": "none", "scheduled": {"control": "aimd", "opts": {}, "at_s": 72.0}}, 60.0)
    assert sched.control() == ("aimd", (72.0 - 12.0) * 2.0 / 60.0)
    # no turn seen, nothing scheduled: the gateway's control from the start
    assert GatewayLog(start, 30.0).control() == ("budgeter", None)
    assert not GatewayLog(start, 30.0).scale_mismatch and GatewayLog({}, 1.0).sample() == (-1, -1, -1, -1)


def test_gateway_headers_are_read_into_the_reply() -> None:
    from kvgate.drive.replies import Reply, gateway_headers_into

    r = Reply(ok=True)
    gateway_headers_into(r, {"X-Kvgate-Park-Wait": "2.5", "X-Kvgate-Hold": "parked", "X-Kvgate-Control": "cap:K=3"})
    assert (r.park_wait_s, r.hold, r.control) == (2.5, "parked", "cap:K=3")
    r = Reply(ok=True)
    gateway_headers_into(r, {})  # not a gateway
    assert r.park_wait_s is None and r.hold is None
    gateway_headers_into(r, {"X-Kvgate-Park-Wait": "nan"})
    assert r.park_wait_s is None
