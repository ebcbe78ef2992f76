"""The comparison harness without the competitors: the plans, the stacks' command lines and scaled timers, the
competitors' own diagnostics as their logs and endpoints give them, the mocker's timing table, and the pages."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from kvgate.compare import diag
from kvgate.compare.mocker_profile import decode_ms, prefill_ms, write_profile
from kvgate.compare.plan import DESIGNS, FULL, PLANS, QUICK
from kvgate.compare.stacks import (
    PAPER_POOL,
    STACKS,
    Env,
    build,
    thunderagent_parameters,
    vllm_router_ps_config,
)
from kvgate.engine.costmodel import QWEN3_8B_MI300X

ENV = Env(dynamo_python="/venv/bin/python", vllm_router="vllm-router", tokenizer_dir="/models/tiny")


def test_full_plan_has_eight_seeds_on_every_stack_and_twins_for_baselines() -> None:
    runs = FULL.runs()
    assert len({r.key for r in runs}) == len(runs)
    by_stack: dict[tuple[str, int, str], set[int]] = {}
    for r in runs:
        by_stack.setdefault((r.design, r.replicas, r.stack), set()).add(r.seed)
    assert all(len(seeds) >= 8 for (d, _, _), seeds in by_stack.items() if d != "real-burst")
    # the real vLLM in real time: the scaled-down design of `kvgate experiment real-vllm`, its three seeds
    assert {s: len(v) for (d, _, s), v in by_stack.items() if d == "real-burst"} == {"real": 3, "real-vr-ps": 3}
    assert {r.seed for r in runs if r.design == "real-burst" and r.arm == "twin"} == {1, 2, 3}
    assert all(FULL.scale(r) == 1.0 for r in runs if r.design == "real-burst")
    burst_stacks = {s for d, _, s in by_stack if d == "burst"}
    assert {"direct", "vr-ps", "kvgate", "kvgate+vr", "dyn", "dyn-ta", "kvgate+dyn", "vr-cache", "vr-hash"} <= \
        burst_stacks
    twins = {(r.stack, r.replicas) for r in runs if r.arm == "twin"}
    assert twins and all(not STACKS[s].acts for s, _ in twins)  # the uncontrolled baselines only
    assert {r.stack for r in runs if r.design == "failure"} >= {"vr-ps", "vr-cache", "vr-hash", "kvgate"}
    assert all(r.replicas == 4 for r in runs if r.design == "failure")
    # the failure's uncontrolled stacks have a twin with no replica killed; the controls and recovery have none
    fail_twins = {r.stack for r in runs if r.design == "failure" and r.arm == "twin"}
    assert fail_twins == {s for s in {r.stack for r in runs if r.design == "failure"} if not STACKS[s].acts}
    assert not [r for r in runs if r.design == "recovery" and r.arm == "twin"]


def test_the_failure_page_sets_each_baseline_beside_its_twin() -> None:
    from kvgate.compare.page import side_by_side
    from kvgate.page import Page

    def run(stack: str, arm: str, seed: int, degraded: bool) -> dict:
        return {"run": {"design": "failure", "stack": stack, "arm": arm, "seed": seed},
                "measures": {"degraded": degraded, "lat": [1.0, 2.0, 3.0]}}

    runs = [run("vr-cache", "fail", 1, True), run("vr-cache", "fail", 2, True), run("vr-cache", "twin", 1, True),
            run("vr-cache", "twin", 2, False), run("vr-ps", "fail", 1, False), run("vr-ps", "fail", 2, True),
            run("kvgate", "fail", 1, False), run("kvgate", "fail", 2, False), run("kvgate+vr", "fail", 1, True),
            run("kvgate+vr", "fail", 2, True)]
    text = Page("", side_by_side(runs)).markdown()
    assert "2 of 2 (its twin without the failure: 1 of 2)" in text
    # program scheduling (1 of 2) against each of kvgate's stacks, said of the competitor: worse than kvgate's own
    # router (0 of 2), better than kvgate in front of a router (2 of 2)
    assert "persistently degraded in 1 of 2" in text
    assert "kvgate gateway, budgeter: 0 of 2 (the competitor worse than it on collapse" in text
    assert "consistent_hash: 2 of 2 (the competitor as well as or better than it on collapse" in text


def test_quick_plan_fits_its_budget() -> None:
    """The quick plan's driving time at its time scales, plus ~20 s of start-up per run, is within 30 minutes."""
    real_s = sum(r.minutes * 60.0 / QUICK.scale(r) + 20.0 for r in QUICK.runs())
    assert real_s <= 30 * 60, real_s
    # and it shows every competitor acting beside kvgate and the baseline
    stacks = {r.stack for r in QUICK.runs()}
    assert {"direct", "vr-ps", "kvgate", "dyn", "dyn-ta", "kvgate+dyn"} <= stacks


def test_vllm_router_program_scheduling_is_scaled_and_sized() -> None:
    one = vllm_router_ps_config(PAPER_POOL, 1.0)
    fast = vllm_router_ps_config(PAPER_POOL, 30.0)
    assert one["token_capacity_per_dp_rank"] == fast["token_capacity_per_dp_rank"] == PAPER_POOL
    assert one["program_scheduling_enable_key"] == "auto" and one["global_queue"] is True  # X-Session-ID
    for k, v in one.items():
        if k.endswith("_seconds"):
            assert fast[k] == pytest.approx(v / 30.0), k
    for model in ("prefill_cost_model", "decode_throughput_model"):
        for k, v in one[model].items():
            expect = v if k == "decode_throughput_alpha" else v / 30.0
            assert fast[model][k] == pytest.approx(expect), k
    # the cold-prefill estimate from the engine profile: a 21.6K-token prompt, as the profile times it alone
    pm = one["prefill_cost_model"]
    x = 21.6
    est = pm["intercept_seconds"] + pm["linear_seconds_per_1k_tokens"] * x + \
        pm["quadratic_seconds_per_1k_tokens_squared"] * x * x
    assert est == pytest.approx(prefill_ms(QWEN3_8B_MI300X, 21_600, budget=10**9) / 1e3, rel=0.05)


def test_thunderagent_parameters_pass_its_validation() -> None:
    for scale in (1.0, 30.0):
        p = thunderagent_parameters(scale)
        assert 0 <= p["pause_target"] <= p["pause_threshold"] <= 1
        assert 0 <= p["resume_hysteresis"] <= p["pause_threshold"]
        assert all(p[k] > 0 for k in p if k.endswith("_seconds"))
    assert thunderagent_parameters(30.0)["scheduler_interval_seconds"] == pytest.approx(5.0 / 30.0)


def test_stacks_build_their_command_lines(tmp_path: Path) -> None:
    b = build(STACKS["kvgate+vr"], replicas=4, scale=15.0, env=ENV, work=tmp_path)
    assert [p.name for p in b.procs] == ["engine0", "engine1", "engine2", "engine3", "vllm-router", "gateway"]
    gw = list(b.procs[-1].argv)
    assert gw[gw.index("--kv-pool") + 1] == str(4 * PAPER_POOL)  # kvgate budgets the fleet behind the router
    assert gw.count("--upstream") == 1 and b.endpoint == b.gateway
    router = list(b.procs[4].argv)
    assert "--enable-program-scheduling" not in router and router[router.index("--policy") + 1] == "consistent_hash"
    ps = build(STACKS["vr-ps"], replicas=1, scale=30.0, env=ENV, work=tmp_path)
    assert ps.drive_args == [] and ps.endpoint == ps.router  # the driver's X-Session-ID names the program
    cfg = json.loads(list(ps.procs[-1].argv)[list(ps.procs[-1].argv).index("--program-scheduling-config-json") + 1])
    assert cfg["token_capacity_per_dp_rank"] == PAPER_POOL
    direct = build(STACKS["direct"], replicas=1, scale=30.0, env=ENV, work=tmp_path)
    assert direct.endpoint == direct.engines[0] and direct.drive_args == []


def test_dynamo_stacks(tmp_path: Path) -> None:
    ta = build(STACKS["dyn-ta"], replicas=1, scale=30.0, env=ENV, work=tmp_path / "ta")
    mocker, front = ta.procs
    assert "--speedup-ratio" in mocker.argv and "--planner-profile-data" in mocker.argv
    blocks = mocker.argv[list(mocker.argv).index("--num-gpu-blocks-override") + 1]
    assert int(blocks) * 16 == PAPER_POOL  # the same pool as the kvgate engine rows
    assert front.env["DYN_LOG"] == "info,thunderagent=debug" and front.stop_signal.name == "SIGINT"
    assert "type: thunderagent" in (tmp_path / "ta" / "thunderagent.yaml").read_text()
    assert "--no-token-ids" in ta.drive_args and "x-dynamo-session-final" in ta.drive_args
    assert all(v == "127.0.0.1" for k, v in front.env.items() if k.endswith("_HOST"))
    kd = build(STACKS["kvgate+dyn"], replicas=1, scale=30.0, env=ENV, work=tmp_path / "kd")
    gw = list(kd.procs[-1].argv)
    assert gw[gw.index("--kv-pool") + 1] == "auto" and "--router-policy-config" not in kd.procs[1].argv
    assert kd.drive_args == ["--no-token-ids"]  # kvgate ends the sessions: its own X-Session-End
    with pytest.raises(ValueError, match="not installed"):
        build(STACKS["dyn"], replicas=1, scale=30.0, env=Env(), work=tmp_path / "none")


def test_mocker_timing_table_is_the_profile(tmp_path: Path) -> None:
    path = write_profile(tmp_path / "t.npz")
    with np.load(path) as d:
        assert set(d.files) == {"prefill_isl", "prefill_ttft_ms", "decode_active_kv_tokens", "decode_context_length",
                                "decode_itl"}
        isl, ttft = d["prefill_isl"], d["prefill_ttft_ms"]
        assert np.all(np.diff(isl) > 0) and np.all(np.diff(ttft) > 0)
        i = int(np.searchsorted(isl, 21_600))
        assert ttft[i] == pytest.approx(prefill_ms(QWEN3_8B_MI300X, int(isl[i])))
        assert d["decode_itl"].shape == (len(d["decode_active_kv_tokens"]), len(d["decode_context_length"]))
    # a decode step of 10 requests of 20K tokens reads 200K tokens of KV
    p = QWEN3_8B_MI300X
    assert decode_ms(p, 200_000, 20_000) == pytest.approx(
        (p.overhead_s + p.weights_s + 10 * p.per_seq_s + 200_000 * p.kv_read_s) * 1e3)


ROUTER_LOG = (
    "\x1b[2m2026-12-01 22:41:04\x1b[0m \x1b[32m INFO\x1b[0m Program scheduling decision "
    '\x1b[3mevent\x1b[0m\x1b[2m=\x1b[0m"program_admit" \x1b[3mprogram\x1b[0m\x1b[2m=\x1b[0m63 forced=false\n'
    'x INFO Program scheduling decision event="program_admit" program=64 forced=true\n'
    'x INFO Program scheduling decision \x1b[3mevent\x1b[0m\x1b[2m=\x1b[0m"program_pause" program=63 '
    'target="http://127.0.0.1:1" \x1b[3mreason\x1b[0m\x1b[2m=\x1b[0m"capacity_repair" released_private_tokens=1\n'
    'x INFO decision event="program_pause" program=64 reason="ttl_expired"\n'
    "x INFO Started health checker\n"
)
TA_LOG = (
    "2026-12-01T22:26:10Z \x1b[32m INFO\x1b[0m thunderagent: ThunderAgent admission enabled "
    "scheduler_interval_seconds=5.0\n"
    "2026-12-01T22:27:10Z DEBUG thunderagent: ThunderAgent scheduler state changed programs=30 active_programs=20 "
    "paused_programs=7 marked_for_pause=1 waiting_requests=5 tracked_requests=25\n"
    "2026-12-01T22:27:15Z DEBUG thunderagent: ThunderAgent scheduler state changed programs=30 active_programs=27 "
    "paused_programs=0 marked_for_pause=0 waiting_requests=0 tracked_requests=27\n"
    "2026-12-01T22:29:00Z  WARN thunderagent: ThunderAgent deferral timeout forced program resumes forced_resumes=2 "
    "waiting_requests=3\n"
)


def test_competitor_logs(tmp_path: Path) -> None:
    (tmp_path / "r.log").write_text(ROUTER_LOG)
    ev = diag.router_log_events(tmp_path / "r.log")
    assert ev == {"program_admit": 2, "program_admit:forced": 1, "program_pause": 2, "program_pause:capacity_repair": 1,
                  "program_pause:ttl_expired": 1}
    (tmp_path / "f.log").write_text(TA_LOG)
    ta = diag.thunderagent_log(tmp_path / "f.log")
    assert ta == {"enabled": 1, "max_paused_programs": 7, "max_waiting_requests": 5, "state_changes": 2,
                  "forced_resumes": 2, "changes_with_paused": 1}
    assert diag.router_log_events(tmp_path / "none.log") == {}


def test_survivors_are_judged_on_their_own_counters() -> None:
    from kvgate.compare.page import survivors

    polls = [
        {"t_s": 0.0, "engines": [(0, 0), (0, 0), (0, 0)]},
        {"t_s": 1200.0, "engines": [None, (900, 1000), (100, 1000)]},
        {"t_s": 1800.0, "engines": [None, (1800, 2000), (150, 2000)]},
    ]
    assert survivors(polls, 1800.0, last_s=600.0) == [None, pytest.approx(0.9), pytest.approx(0.05)]


def test_designs_are_the_papers() -> None:
    assert DESIGNS["burst"].lam_per_replica == 0.035 and DESIGNS["burst"].burst == "1.5@15+5"
    assert DESIGNS["failure"].lam_per_replica * 4 == pytest.approx(0.112)
    assert set(PLANS) == {"quick", "full", "smoke", "envoy", "envoy-smoke"}


def test_envoy_stacks_build_envoy_and_the_picker(tmp_path: Path) -> None:
    env = Env(envoy="/opt/envoy")
    alone = build(STACKS["envoy"], replicas=4, scale=15.0, env=env, work=tmp_path / "a")
    assert [p.name for p in alone.procs] == ["engine0", "engine1", "engine2", "engine3", "envoy"]
    conf = json.loads((tmp_path / "a" / "envoy.json").read_text())
    eps = conf["static_resources"]["clusters"][0]["load_assignment"]["endpoints"][0]["lb_endpoints"]
    assert len(eps) == 4 and conf["static_resources"]["clusters"][0]["lb_policy"] == "ROUND_ROBIN"
    assert alone.endpoint.startswith("http://127.0.0.1:") and not alone.gateway
    epp = build(STACKS["envoy+kvgate"], replicas=1, scale=30.0, env=env, work=tmp_path / "e")
    assert [p.name for p in epp.procs] == ["engine0", "epp", "envoy"]  # the picker listens before Envoy starts
    assert "--control" in epp.config["epp"] and "budgeter" in epp.config["epp"]
    assert epp.gateway and epp.gateway != epp.endpoint
    with pytest.raises(ValueError, match="install-envoy"):
        build(STACKS["envoy"], replicas=1, scale=30.0, env=Env(), work=tmp_path / "none")


def test_recovery_starts_the_router_without_its_scheduler(tmp_path: Path) -> None:
    from kvgate.compare.runner import _router_off_until

    b = build(STACKS["vr-ps"], replicas=1, scale=30.0, env=ENV, work=tmp_path)
    on = _router_off_until(b)
    off = next(p for p in b.procs if p.name == "vllm-router")
    assert "--enable-program-scheduling" in on.argv and "--program-scheduling-config-json" in on.argv
    assert "--enable-program-scheduling" not in off.argv and "--program-scheduling-config-json" not in off.argv
    assert off.ready_url == on.ready_url  # the same port: the driver never sees the switch but for cut turns
    assert len(on.argv) == len(off.argv) + 3


def test_real_vllm_stack_is_the_real_vllm_experiments(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvgate.realvllm.experiment import FULL as REAL

    b = build(STACKS["real-vr-ps"], replicas=1, scale=1.0, env=ENV, work=tmp_path)
    vllm, router = b.procs
    assert "vllm.entrypoints.openai.api_server" in vllm.argv and "--enable-prompt-tokens-details" in vllm.argv
    cfg = json.loads(router.argv[list(router.argv).index("--program-scheduling-config-json") + 1])
    assert cfg["token_capacity_per_dp_rank"] == REAL.kv_pool
    assert cfg["queue_timeout_seconds"] == 600.0  # real time: its defaults


def test_a_paired_twin_is_judged_on_its_burst_arm_windows(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    """A twin that dips in its first windows and collapses for good later is persistently degraded: its windows
    are aligned at the burst's end as its burst arm's are (the paper's rule), not at minute 0."""
    from types import SimpleNamespace

    import kvgate.records
    from kvgate.compare.page import measures

    def run_with(late_hit: float) -> SimpleNamespace:
        end = np.arange(5.0, 90 * 60.0, 10.0)
        hit = np.where((end >= 300) & (end < 600), 0.2, np.where(end < 2400, 0.9, late_hit))
        prompt = np.full(len(end), 1000.0)
        turns = {"end_s": end, "submit_s": end - 1.0, "status": np.array(["ok"] * len(end)),
                 "cached_tokens": hit * prompt, "prompt_tokens": prompt}
        return SimpleNamespace(turns=turns, samples={"t_s": np.array([0.0])}, meta={"stopped_at_s": 90 * 60.0})

    info = {"summary": {"persistently_degraded": False}, "run": {"design": "burst", "arm": "twin", "minutes": 90.0}}
    monkeypatch.setattr(kvgate.records, "load_run", lambda _p: run_with(0.1))
    assert measures(info, tmp_path)["degraded"] is True
    monkeypatch.setattr(kvgate.records, "load_run", lambda _p: run_with(0.9))
    assert measures(info, tmp_path)["degraded"] is False
