"""The stacks compared: which processes serve the driver, how each competitor is configured, what the driver sends.

Engines (the same in every stack of a row of the page):

* ``kvgate engine`` replicas (the paper-8b engine, 400K tokens each, on kvgate's scaled real-time clock);
* Dynamo's mocker (``python -m dynamo.mocker``, Dynamo 1.6.1 in its own Python 3.10 environment): a simulated
  vLLM-like worker with a finite LRU prefix cache, timed by a table written from the paper-8b profile
  (:mod:`kvgate.compare.mocker_profile`) and played at ``--speedup-ratio`` = the time scale, behind Dynamo's
  frontend (file discovery, TCP request plane, ZMQ events; no etcd, no NATS);
* the real vLLM (CPU build) with the tiny local Llama, in real time (``kvgate.realvllm``).

Fronts: the engine directly; vllm-router (0.1.17, Rust) with program scheduling as its documentation recommends
for agents (``global_queue``, token capacity per rank = the pool, its cost models derived from the engine's
profile; identity from ``X-Session-ID``, its ``auto`` key: the canonical body field ``vllm_xargs.agentic_context``,
which ``kvgate drive --session-field`` can send, reaches the engine unchanged and the real vLLM refuses it) or as
a plain request router (``cache_aware``, ``consistent_hash``); kvgate's gateway (the budgeter; a fleet: a budget
per replica); kvgate in front of vllm-router (kvgate budgets the sessions, the router places them); Dynamo's
frontend (KV router) with or without its ThunderAgent plugin; kvgate in front of Dynamo's frontend.

Time. Every competitor timer is wall-clock seconds; each is divided by the time scale (the documented default /
scale), so that the whole stack runs on the same virtual clock as the driver and the engines. Every value passed
is in the stack's ``config`` and on the page.
"""

from __future__ import annotations

import json
import os
import signal
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvgate.compare.procs import Proc, free_port, kvgate_cli, low_port
from kvgate.engine.costmodel import QWEN3_8B_MI300X, Profile

PAPER_POOL = 400_000
"""The paper-8b engine's pool, per replica (``kvgate engine``'s default)."""
MOCKER_BLOCK = 16
DYNAMO_SESSION_END = "x-dynamo-session-final"


@dataclass(frozen=True)
class Stack:
    """One way of serving the driver."""

    name: str
    title: str
    engine: str
    """"kvgate-engine", "dynamo-mocker" or "real-vllm"."""
    front: str
    """"direct", "vllm-router", "kvgate", "kvgate+vllm-router", "dynamo", "dynamo-ta", "kvgate+dynamo", "envoy"
    (Envoy 1.40 alone), "envoy+epp" (Envoy calling ``kvgate epp``)."""
    policy: str = ""
    """vllm-router's --policy."""
    program_scheduling: bool = False
    control: str = "none"
    """kvgate gateway's control (where there is one)."""
    acts: str = ""
    """Who parks or pauses here: "vllm-router", "dynamo", "kvgate" or "" (nobody: a baseline)."""


STACKS: dict[str, Stack] = {s.name: s for s in (
    Stack("direct", "engine alone (uncontrolled)", "kvgate-engine", "direct"),
    Stack("vr-ps", "vllm-router, program scheduling", "kvgate-engine", "vllm-router", "consistent_hash", True,
          acts="vllm-router"),
    Stack("vr-cache", "vllm-router cache_aware (uncontrolled)", "kvgate-engine", "vllm-router", "cache_aware"),
    Stack("vr-hash", "vllm-router consistent_hash (uncontrolled)", "kvgate-engine", "vllm-router",
          "consistent_hash"),
    Stack("kvgate", "kvgate gateway, budgeter", "kvgate-engine", "kvgate", control="budgeter", acts="kvgate"),
    Stack("kvgate+vr", "kvgate budgeter in front of vllm-router consistent_hash", "kvgate-engine",
          "kvgate+vllm-router", "consistent_hash", control="budgeter", acts="kvgate"),
    Stack("dyn", "Dynamo frontend, KV router (uncontrolled)", "dynamo-mocker", "dynamo"),
    Stack("dyn-ta", "Dynamo frontend, KV router + ThunderAgent", "dynamo-mocker", "dynamo-ta", acts="dynamo"),
    Stack("kvgate+dyn", "kvgate budgeter in front of Dynamo's frontend (no ThunderAgent)", "dynamo-mocker",
          "kvgate+dynamo", control="budgeter", acts="kvgate"),
    Stack("envoy", "Envoy alone, round robin (uncontrolled)", "kvgate-engine", "envoy"),
    Stack("envoy+kvgate", "Envoy + kvgate epp (endpoint picker), budgeter", "kvgate-engine", "envoy+epp",
          control="budgeter", acts="kvgate"),
    Stack("real", "real vLLM alone (uncontrolled)", "real-vllm", "direct"),
    Stack("real-vr-ps", "vllm-router program scheduling on the real vLLM", "real-vllm", "vllm-router",
          "consistent_hash", True, acts="vllm-router"),
)}


@dataclass
class Built:
    """A stack made concrete for one run: its processes, where the driver goes and how it talks."""

    procs: list[Proc]
    endpoint: str
    drive_args: list[str]
    config: dict[str, Any]
    """Every option given to every process (for the page)."""
    engines: list[str] = field(default_factory=list)
    """The engine replicas' URLs (their /metrics are scraped)."""
    router: str = ""
    """vllm-router's URL (its /scheduling/diagnostics is polled)."""
    gateway: str = ""
    frontend_log: str = ""
    """Dynamo frontend's log name (ThunderAgent's scheduler lines)."""
    engine_procs: list[str] = field(default_factory=list)
    """The names of the engine processes, replica order (the failure design stops one)."""


@dataclass(frozen=True)
class Env:
    """What the stacks need from the machine."""

    dynamo_python: str = ""
    """Python of Dynamo's venv ('' when not installed)."""
    vllm_router: str = "vllm-router"
    envoy: str = ""
    """The envoy binary ('' when not installed: .ci/install-envoy.sh)."""
    tokenizer_dir: str = ""
    """A local model directory whose config.json names its architecture (Dynamo's mocker tokenizes with it)."""


def vllm_router_ps_config(pool: int, scale: float, p: Profile | None = None) -> dict[str, Any]:
    """vllm-router's program scheduling as its documentation's production example: ``global_queue``, MRU resume,
    token capacity per rank = the engine's pool; the cost models from the engine's kvgate profile (its constants
    in seconds; the paper-8b engine's by default), every duration and cost divided by the time scale."""
    if p is None:
        p = QWEN3_8B_MI300X

    return {
        # identity from X-Session-ID: the canonical vllm_xargs.agentic_context is forwarded to the engine as it is,
        # and vLLM 0.32 answers 400 to it (its vllm_xargs values must be scalars or lists)
        "program_scheduling_enable_key": "auto",
        "global_queue": True,
        "resume_order": "mru",
        "token_capacity_per_dp_rank": pool,
        "metrics_interval_seconds": 1.0 / scale,
        "queue_timeout_seconds": 600.0 / scale,
        "force_resume_timeout_seconds": 300.0 / scale,
        "paused_retention_ttl_seconds": 1800.0 / scale,
        "shared_prefix_freshness_warmup_seconds": 100.0 / scale,
        "max_acting_ttl_seconds": 10.0 / scale,
        "prefill_cost_model": {
            # cold prefill of x thousand tokens: overhead + linear x + attention's quadratic x^2
            "intercept_seconds": p.overhead_s / scale,
            "linear_seconds_per_1k_tokens": p.per_token_s * 1e3 / scale,
            "quadratic_seconds_per_1k_tokens_squared": p.attn_s * 1e6 / 2.0 / scale,
            "decode_throughput_alpha": 0.15,
        },
        "decode_throughput_model": {
            "fixed_step_seconds": (p.overhead_s + p.weights_s) / scale,
            "batch_step_seconds_per_request": p.per_seq_s / scale,
            "context_step_seconds_per_token": p.kv_read_s / scale,
        },
    }


def vllm_router_args(scale: float) -> list[str]:
    """The router's own wall-clock timers, divided by the scale (integers: at least 1 s)."""
    def secs(x: float) -> str:
        return str(max(1, round(x / scale)))

    return ["--health-check-interval-secs", secs(60), "--cb-timeout-duration-secs", secs(60),
            "--cb-window-duration-secs", secs(120), "--worker-startup-check-interval", "1"]


def thunderagent_parameters(scale: float) -> dict[str, Any]:
    """Dynamo 1.6.1's ThunderAgent defaults (pause at 0.95, target 0.80, hysteresis 0.10), its times / scale."""
    return {
        "pause_threshold": 0.95, "pause_target": 0.80, "resume_hysteresis": 0.10,
        "resume_timeout_seconds": 1800.0 / scale, "session_retention_seconds": 1800.0 / scale,
        "scheduler_interval_seconds": 5.0 / scale, "acting_decay_tau_seconds": 1.0 / scale,
    }


def build(stack: Stack, *, replicas: int, scale: float, env: Env, work: Path, pool: int = PAPER_POOL) -> Built:
    """The processes of ``stack`` with ``replicas`` engines of ``pool`` tokens on the clock ``scale``."""
    if stack.engine == "dynamo-mocker":
        return _build_dynamo(stack, scale=scale, env=env, work=work, pool=pool)
    procs: list[Proc] = []
    engines: list[str] = []
    cfg: dict[str, Any] = {"time_scale": scale, "replicas": replicas}
    profile = None
    if stack.engine == "real-vllm":
        real, pool, profile = _real_vllm(work)
        procs.append(real)
        engines.append(real.ready_url.removesuffix("/health"))
        cfg["engine"] = list(real.argv[1:])
    eng_args = ["--time-scale", f"{scale:g}", "--kv-pool", str(pool)]
    for i in range(replicas if stack.engine == "kvgate-engine" else 0):
        port = free_port()
        procs.append(Proc(f"engine{i}", tuple(kvgate_cli("engine", *eng_args, "--port", str(port))),
                          f"http://127.0.0.1:{port}/health"))
        engines.append(f"http://127.0.0.1:{port}")
        cfg["engine"] = ["kvgate engine", *eng_args]
    built = Built(procs, engines[0], [], cfg, engines=engines, engine_procs=[p.name for p in procs])
    up = engines
    if stack.front in ("vllm-router", "kvgate+vllm-router"):
        up = [_add_router(built, stack, up, scale=scale, env=env, pool=pool, profile=profile)]
    if stack.front in ("kvgate", "kvgate+vllm-router"):
        gw_pool = pool * replicas if stack.front == "kvgate+vllm-router" else pool
        _add_gateway(built, stack, up, scale=scale, pool=gw_pool)
    if stack.front in ("envoy", "envoy+epp"):
        _add_envoy(built, stack, up, scale=scale, pool=pool, env=env, work=work)
    return built


def _add_envoy(built: Built, stack: Stack, upstream: list[str], *, scale: float, pool: int, env: Env,
               work: Path) -> None:
    """Envoy in front of the engines: alone (round robin), or calling ``kvgate epp`` (the budgeter) for each
    request; the picker's HTTP side is the run's gateway (its /kvgate/info and /metrics are read)."""
    from kvgate.epp.envoy import round_robin_bootstrap, write_bootstrap

    if not env.envoy:
        raise ValueError("Envoy is not installed (bash .ci/install-envoy.sh)")
    listen, admin = free_port(), free_port()
    work.mkdir(parents=True, exist_ok=True)
    conf = work / "envoy.json"
    if stack.front == "envoy":
        hosts = [(u.split("//")[1].rsplit(":", 1)[0], int(u.rsplit(":", 1)[1])) for u in upstream]
        write_bootstrap(conf, round_robin_bootstrap(listen, hosts, admin_port=admin))
    else:
        grpc, port = free_port(), free_port()
        args = ["--control", stack.control, "--kv-pool", str(pool), "--time-scale", f"{scale:g}", "--port",
                str(port), "--grpc-port", str(grpc), "--envoy-config", str(conf), "--envoy-listen", str(listen),
                "--envoy-admin", str(admin), "--log-level", "warning"]
        for u in upstream:
            args += ["--upstream", u]
        url = f"http://127.0.0.1:{port}"
        built.procs.append(Proc("epp", tuple(kvgate_cli("epp", *args)), url + "/kvgate/info"))
        built.config["epp"] = ["kvgate epp", *args]
        built.gateway = url
    argv = (env.envoy, "-c", str(conf), "--use-dynamic-base-id", "--concurrency", "1", "-l", "error")
    built.procs.append(Proc("envoy", argv, f"http://127.0.0.1:{admin}/ready", ready_text="LIVE"))
    built.config["envoy"] = list(argv)
    built.endpoint = f"http://127.0.0.1:{listen}"


def _real_vllm(work: Path) -> tuple[Proc, int, Profile]:
    """The real vLLM (CPU build) of ``kvgate experiment real-vllm``: its pool, block size and step budget, the tiny
    Llama; with the profile measured on it (``tiny-llama-cpu-vllm032``) for vllm-router's cost models."""
    from kvgate.engine.costmodel import profile
    from kvgate.realvllm import model
    from kvgate.realvllm.experiment import FULL as REAL
    from kvgate.realvllm.experiment import PROFILE
    from kvgate.realvllm.server import RealVllm, ServerConfig

    cfg = ServerConfig(
        kv_pool=REAL.kv_pool, block_size=REAL.block_size, max_model_len=REAL.max_model_len,
        extra_args=("--max-num-batched-tokens", str(REAL.max_num_batched_tokens), "--max-num-seqs",
                    str(REAL.max_num_seqs)),
    )
    srv = RealVllm(cfg)
    srv.model_path = model.build_model(model.model_dir(None))
    srv.kv_bytes_per_token = model.kv_bytes_per_token(srv.model_path)
    env = {k: v for k, v in srv.environment().items() if os.environ.get(k) != v}
    proc = Proc("vllm", tuple(srv.command()), srv.url + "/health", env=env, startup_s=cfg.startup_timeout_s)
    return proc, cfg.pool, profile(PROFILE)


def _add_router(
    built: Built, stack: Stack, upstream: list[str], *, scale: float, env: Env, pool: int, profile: Profile | None
) -> str:
    port = free_port()
    args = [env.vllm_router, "--worker-urls", *upstream, "--host", "127.0.0.1", "--port", str(port),
            "--policy", stack.policy, "--prometheus-host", "127.0.0.1", "--prometheus-port", str(free_port()),
            *vllm_router_args(scale)]
    if stack.program_scheduling:
        ps = vllm_router_ps_config(pool, scale, profile)
        args += ["--enable-program-scheduling", "--program-scheduling-config-json", json.dumps(ps)]
        built.config["program_scheduling"] = ps
    url = f"http://127.0.0.1:{port}"
    built.procs.append(Proc("vllm-router", tuple(args), url + "/v1/models", env={"RUST_LOG": "info"}))
    built.config["vllm_router"] = [a if not a.startswith("{") else "<program scheduling config>" for a in args]
    built.router = url
    built.endpoint = url
    return url


def _add_gateway(built: Built, stack: Stack, upstream: list[str], *, scale: float, pool: int) -> str:
    port = free_port()
    args = ["--control", stack.control, "--kv-pool", str(pool) if pool else "auto", "--time-scale", f"{scale:g}",
            "--port", str(port), "--log-level", "warning"]
    for u in upstream:
        args += ["--upstream", u]
    url = f"http://127.0.0.1:{port}"
    built.procs.append(Proc("gateway", tuple(kvgate_cli("gateway", *args)), url + "/kvgate/info"))
    built.config["gateway"] = ["kvgate gateway", *args]
    built.gateway = url
    built.endpoint = url
    return url


def dynamo_env(work: Path) -> dict[str, str]:
    """File discovery under the run's directory, every plane on loopback, no model hub."""
    return {
        "DYN_DISCOVERY_BACKEND": "file", "DYN_FILE_KV": str(work / "dynamo-discovery"), "HF_HUB_OFFLINE": "1",
        "DYN_TCP_RPC_HOST": "127.0.0.1", "DYN_TCP_RESPONSE_STREAM_HOST": "127.0.0.1",
        "DYN_EVENT_PLANE_HOST": "127.0.0.1", "DYN_SYSTEM_HOST": "127.0.0.1",
    }


def _build_dynamo(stack: Stack, *, scale: float, env: Env, work: Path, pool: int) -> Built:
    if not env.dynamo_python:
        raise ValueError("Dynamo is not installed (bash .ci/install-competitors.sh)")
    denv = dynamo_env(work)
    planes = ["--discovery-backend", "file", "--request-plane", "tcp", "--event-plane", "zmq"]
    from kvgate.compare.mocker_profile import write_profile

    sys_port = low_port()  # DYN_SYSTEM_PORT is read as an i16
    blocks = pool // MOCKER_BLOCK
    timing = write_profile(work / "mocker-timing.npz", pool=pool)
    mocker = [env.dynamo_python, "-m", "dynamo.mocker", "--model-path", env.tokenizer_dir, "--model-name", "tiny",
              "--num-gpu-blocks-override", str(blocks), "--block-size", str(MOCKER_BLOCK),
              "--speedup-ratio", f"{scale:g}", "--max-model-len", "40960", "--planner-profile-data", str(timing),
              *planes]
    fe_port = free_port()
    front = [env.dynamo_python, "-m", "dynamo.frontend", "--http-host", "127.0.0.1", "--http-port", str(fe_port),
             *planes, "--router-mode", "kv"]
    cfg: dict[str, Any] = {"time_scale": scale, "replicas": 1, "dynamo_env": sorted(denv), "mocker": mocker[1:]}
    drive_args = ["--no-token-ids", "--session-end-header", DYNAMO_SESSION_END]
    fe_env = dict(denv)
    if stack.front == "dynamo-ta":
        params = thunderagent_parameters(scale)
        policy = work / "thunderagent.yaml"
        work.mkdir(parents=True, exist_ok=True)
        lines = ["request_classifier:", "  type: thunderagent", "  parameters:"]
        lines += [f"    {k}: {v!r}" for k, v in params.items()]
        policy.write_text("\n".join(lines) + "\n")
        front += ["--router-policy-config", str(policy)]
        fe_env["DYN_LOG"] = "info,thunderagent=debug"
        cfg["thunderagent"] = params
    cfg["frontend"] = front[1:]
    url = f"http://127.0.0.1:{fe_port}"
    procs = [
        # its /health stays "notready" until a frontend routes to it: the system server answering is enough here,
        # the frontend's model list (below) says when the worker has registered
        Proc("mocker", tuple(mocker), f"http://127.0.0.1:{sys_port}/metrics",
             env={**denv, "DYN_SYSTEM_PORT": str(sys_port)}),
        Proc("frontend", tuple(front), url + "/v1/models", env=fe_env, ready_text='"tiny"',
             stop_signal=signal.SIGINT),
    ]
    built = Built(procs, url, drive_args, cfg, frontend_log="frontend", engine_procs=["mocker"])
    if stack.front == "kvgate+dynamo":
        # the pool from the frontend's /metrics (--kv-pool auto), as an operator would start it; sessions end with
        # kvgate's own X-Session-End (the frontend behind it runs no ThunderAgent)
        _add_gateway(built, stack, [url], scale=scale, pool=0)
        built.drive_args = ["--no-token-ids"]
    return built


def find_env() -> Env:
    """Where the competitors are on this machine (the paths .ci/install-competitors.sh uses)."""
    import shutil

    venv = Path(os.environ.get("KVGATE_DYNAMO_VENV", "~/.cache/kvgate/dynamo-venv")).expanduser()
    py = venv / "bin" / "python"
    router = shutil.which("vllm-router") or ""
    model = Path(os.environ.get("KVGATE_MODEL_DIR", "~/.cache/kvgate/tiny-llama")).expanduser()
    from kvgate.epp.envoy import find_envoy

    return Env(dynamo_python=str(py) if py.exists() else "", vllm_router=router, envoy=find_envoy(),
               tokenizer_dir=str(model) if (model / "config.json").exists() else "")
