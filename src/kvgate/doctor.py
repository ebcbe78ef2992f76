"""``kvgate doctor``: is a live vLLM / SGLang (or a kvgate gateway in front of one) set up so kvgate can work?

Checks, in order: the endpoint answers; it is an OpenAI server (``GET /v1/models``); what it is and its pool
(:mod:`kvgate.http.openai`: one definition of C, ``(num_gpu_blocks - 1) x block_size`` on vLLM); prefix
caching on (vLLM's ``vllm:cache_config_info{enable_prefix_caching}``, SGLang's ``disable_radix_cache``); cached
tokens reported and prefix hits real (a probe: two completions sharing a prefix of four blocks, the second must
report ``usage.prompt_tokens_details.cached_tokens`` > 0), and per conversation API (chat, Responses, Messages: two
requests sharing a system prompt, the second's cached tokens read in that API's own field); max model length; a
gateway's control. For a
workload shape (``--preset`` / ``--trace``): N* = C / L̄, whether one session fits, the drain bound 1/S from c(L)
(fitted on a cache-disabled simulation of ``--profile``, or read from a measured ``--profile FILE``) and the
healthy-side bound (the cache-warm population fits the pool), hence the safe arrival-rate band and where
``--lam`` falls in it (the bounds as :mod:`kvgate.analysis.phase` computes them).

Exit codes: 0 healthy config, 1 warnings, 2 usage error, 3 cannot reach / not an OpenAI server.
"""

from __future__ import annotations

import asyncio
import json
import math
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import click

from kvgate.analysis.drain import ColdCost, cold_work_per_session, fit_cold_cost
from kvgate.errors import UsageError
from kvgate.http.dialect import CHAT, COMPLETIONS, MESSAGES, RESPONSES, SGLANG, VLLM, Api
from kvgate.http.openai import SERVER_INFO_PATHS, prefix_caching_label
from kvgate.options import FINITE

OK, WARN, UNREACHABLE = 0, 1, 3
PROBE_BLOCKS = 4
"""Blocks of the probe's shared prefix."""

VLLM_FIX_CACHING = f"start vLLM with {VLLM.caching_flag}"
SGLANG_FIX_CACHING = f"start SGLang {SGLANG.caching_flag}"
VLLM_FIX_REPORT = f"start vLLM with {VLLM.report_flag}"
SGLANG_FIX_REPORT = f"start SGLang with {SGLANG.report_flag}"


@dataclass
class Finding:
    check: str
    level: str
    """"ok", "warn" or "fail"."""
    message: str
    fix: str | None = None


@dataclass
class Report:
    endpoint: str
    findings: list[Finding] = field(default_factory=list)
    facts: dict[str, Any] = field(default_factory=dict)

    def add(self, check: str, level: str, message: str, fix: str | None = None) -> None:
        self.findings.append(Finding(check, level, message, fix))

    @property
    def exit_code(self) -> int:
        levels = {f.level for f in self.findings}
        return UNREACHABLE if "fail" in levels else WARN if "warn" in levels else OK

    def json(self) -> dict[str, Any]:
        return {
            "endpoint": self.endpoint, "exit_code": self.exit_code, "facts": self.facts,
            "findings": [f.__dict__ for f in self.findings],
        }

    def text(self) -> str:
        mark = {"ok": "ok  ", "warn": "WARN", "fail": "FAIL"}
        lines = [f"kvgate doctor: {self.endpoint}"]
        for f in self.findings:
            lines.append(f"  [{mark[f.level]}] {f.check}: {f.message}")
            if f.fix:
                lines.append(f"         fix: {f.fix}")
        verdict = {OK: "healthy configuration", WARN: "warnings (see fix lines)", UNREACHABLE: "cannot use it"}
        lines.append(f"verdict: {verdict[self.exit_code]} (exit {self.exit_code})")
        return "\n".join(lines)


# -- the workload side (pure but for the short simulations that measure c(L) and R0) ----------------------
def cold_cost(profile: str) -> tuple[ColdCost, str, float | None, float | None]:
    """c(L), where it comes from, R0 (the healthy mean turn time) and the cache-warm capacity in turns/s (None:
    unknown) for a profile name (measured on short simulations, as kvgate.analysis.phase does) or a measured JSON file
    ``{"intercept_s": a, "slope_ms_per_token": b, "R0_s": r, "warm_turns_per_s": w}``."""
    p = Path(profile)
    if p.suffix == ".json" or p.exists():
        try:
            obj = json.loads(p.read_text())
            cost = ColdCost(float(obj["intercept_s"]), float(obj["slope_ms_per_token"]) / 1000.0, 0)
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise UsageError(f"--profile {profile}: expected JSON with intercept_s, slope_ms_per_token ({e})") from None
        r0, warm = obj.get("R0_s"), obj.get("warm_turns_per_s")
        num = (int, float)
        return cost, str(p), float(r0) if isinstance(r0, num) else None, float(warm) if isinstance(warm, num) else None
    from kvgate.analysis.phase import NOCACHE_LAM, NOCACHE_SEEDS, WARM_SEEDS
    from kvgate.engine.costmodel import profile as get_profile
    from kvgate.records import from_tables
    from kvgate.sim.config import SimConfig
    from kvgate.sim.runner import simulate

    get_profile(profile)
    base = SimConfig(preset="paper-8b", profile=profile, lam=NOCACHE_LAM)
    nc = simulate(base.with_(prefix_caching=False, bursts=("+16@15+5",), minutes=90.0, seed=NOCACHE_SEEDS[0]))
    fit = fit_cold_cost([from_tables(nc.meta, nc.tables)])
    if not math.isfinite(fit.slope_s_per_token):
        raise UsageError(f"--profile {profile}: could not fit c(L) on a cache-disabled simulation")
    healthy = from_tables(*(lambda r: (r.meta, r.tables))(simulate(base.with_(minutes=30.0, seed=WARM_SEEDS[0]))))
    ok = healthy.turns["status"] == "ok"
    lat = healthy.turns["end_s"][ok] - healthy.turns["sent_s"][ok]
    r0 = float(lat.mean()) if len(lat) else None
    sat = simulate(base.with_(lam=0.08, control="budgeter", minutes=60.0, seed=WARM_SEEDS[0]))
    warm = sat.meta["summary"].get("turns_per_s_last10")
    return fit, f"cache-disabled simulation of {profile}", r0, float(warm) if warm else None


def workload_checks(rep: Report, wl: Any, pool: int | None, max_len: int | None, lam: float | None,
                    profile: str) -> None:
    """N*, one session fits, 1/S, the healthy-side bound and where λ falls (see kvgate.analysis.phase)."""
    lbar = wl.mean_turn_context()
    peak = wl.max_context()
    facts = rep.facts.setdefault("workload", {"name": wl.name, "mean_context_tokens": round(lbar, 1),
                                              "max_context_tokens": peak})
    if max_len is not None and peak > max_len:
        rep.add(
            "workload fits the model",
            "warn",
            f"a session reaches {peak} tokens > max model length {max_len}",
            f"raise --max-model-len to at least {peak} (vLLM) / --context-length (SGLang)",
        )
    if pool is None:
        rep.add("workload vs pool", "warn", "pool size unknown: N* and the bounds need C", None)
        return
    n_star = pool / lbar
    facts["N_star"] = round(n_star, 1)
    if peak > pool:
        rep.add(
            "one session fits",
            "warn",
            f"a session reaches {peak} tokens > the {pool}-token pool: it can never stay cached (N* < 1)",
            "give the engine more KV memory (--gpu-memory-utilization, "
            "--kv-cache-memory-bytes, more GPUs) or shorten sessions (--max-context)",
        )
    else:
        rep.add(
            "one session fits",
            "ok",
            f"largest context {peak} tokens; N* = C / L̄ = {pool} / {lbar:.0f} = {n_star:.1f} sessions",
        )
    cost, cost_source, r0, warm_tput = cold_cost(profile)
    s_cold = cold_work_per_session(cost, wl)
    drain = 1.0 / s_cold if s_cold > 0 else math.inf
    facts.update({"c_L": f"{cost.intercept_s:+.2f} s + {cost.slope_s_per_token * 1000:.4f} ms x L",
                  "c_L_source": cost_source, "S_s": round(s_cold, 1), "drain_lam": round(drain, 5)})
    healthy = None
    if r0 is not None and wl.phases:
        occ = []
        for ph in wl.phases:
            p = ph.shape.prompt_tokens()
            occ.append(sum((ph.think_mean_s + r0) * x for x in p[:-1]) + r0 * p[-1])
        healthy = pool / (sum(occ) / len(occ))
        facts.update({"R0_s": round(r0, 2), "healthy_lam": round(healthy, 5)})
    elif r0 is not None:
        per = []
        for sh in wl.shapes():  # a trace's recorded gaps where it has them, else the workload's mean think time
            p = sh.prompt_tokens()
            gaps = sh.gaps if sh.gaps is not None else (wl.think_mean_s,) * (len(p) - 1)
            per.append(sum((g + r0) * x for g, x in zip(gaps, p[:-1], strict=True)) + r0 * p[-1])
        healthy = pool / (sum(per) / len(per))
        facts.update({"R0_s": round(r0, 2), "healthy_lam": round(healthy, 5)})
    if warm_tput is not None:
        turns = sum(s.turns for s in wl.shapes()) / len(wl.shapes())
        warm_lam = warm_tput / turns
        facts["warm_lam"] = round(warm_lam, 5)
        healthy = warm_lam if healthy is None else min(healthy, warm_lam)
    band = f"safe below 1/S = {drain:.4f}/s" + (f"; history-dependent up to λ_h = {healthy:.4f}/s; over capacity "
                                                 "above" if healthy is not None else "")
    if lam is None:
        rep.add("arrival-rate band", "ok", band + " (give --lam to place a rate)")
        return
    facts["lam"] = lam
    if lam < drain:
        rep.add("arrival rate", "ok", f"λ = {lam:g}/s is below the drain bound: {band}")
    elif healthy is None or lam <= healthy:
        rep.add(
            "arrival rate",
            "warn",
            f"λ = {lam:g}/s is in the history-dependent band ({band}): a burst or a "
            "cache flush can collapse the cache for good",
            "run the gateway with --control budgeter",
        )
    else:
        rep.add(
            "arrival rate",
            "warn",
            f"λ = {lam:g}/s is over capacity ({band}): the pool cannot hold the "
            "cache-warm population or the warm engine cannot keep up",
            "add KV capacity (more GPUs / memory) or admit fewer sessions (--control budgeter parks the rest)",
        )


# -- the endpoint side --------------------------------------------------------------------------------------
async def check_endpoint(rep: Report, url: str, timeout_s: float, api_key: str | None) -> dict[str, Any]:
    """Findings about the server; returns {"pool", "max_len"} for the workload checks (empty when unreachable)."""
    import aiohttp

    from kvgate.http.openai import Unreachable, discover

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    base = url.rstrip("/")
    tmo = aiohttp.ClientTimeout(total=timeout_s)
    async with aiohttp.ClientSession(timeout=tmo, headers=headers) as http:

        async def get(path: str) -> tuple[int, bytes]:
            try:
                async with http.get(base + path) as r:
                    return r.status, await r.read()
            except aiohttp.ClientConnectorError as e:
                raise Unreachable(str(e)) from None
            except aiohttp.ClientError as e:
                raise OSError(str(e)) from None

        try:
            status, body = await get("/v1/models")
        except (Unreachable, OSError, TimeoutError) as e:
            rep.add(
                "reachable",
                "fail",
                f"no answer from {base}: {' '.join(str(e).split()) or type(e).__name__}",
                "check the URL and that the server is running and listening on that address",
            )
            return {}
        rep.add("reachable", "ok", f"{base} answers")
        models = _json(body)
        data = models.get("data") if type(models) is dict else None
        if status != 200 or type(data) is not list or not data or type(data[0]) is not dict or "id" not in data[0]:
            rep.add(
                "OpenAI server",
                "fail",
                f"GET /v1/models answered HTTP {status} without an OpenAI model list",
                "point --endpoint at the engine's OpenAI server (vllm serve / sglang.launch_server), not "
                "another service",
            )
            return {}
        model = str(data[0]["id"])
        max_len = data[0].get("max_model_len")
        max_len = max_len if type(max_len) is int and max_len > 0 else None
        rep.facts.update({"model": model, "max_model_len": max_len})
        rep.add("OpenAI server", "ok", f"serves {model}" + (f", max model length {max_len}" if max_len else ""))
        try:
            info = await discover(get, timeout_s=timeout_s)
        except Unreachable as e:
            rep.add("pool", "fail", f"lost the endpoint during discovery: {e}")
            return {}
        kind = info.engine_kind
        rep.facts.update({"kind": info.kind, "engine": kind, "kv_pool": info.kv_pool,
                          "block_size": info.block_size, "num_gpu_blocks": info.num_gpu_blocks})
        if info.gateway is not None:
            g = info.gateway
            rep.facts["gateway"] = {"control": g.get("spec") or g.get("control"), "version": g.get("version"),
                                    "upstream": (g.get("upstream") or {}).get("url")}
            rep.add(
                "kvgate gateway",
                "ok",
                f"a kvgate gateway (control {g.get('spec') or g.get('control')}) "
                f"in front of {kind} at {(g.get('upstream') or {}).get('url')}",
            )
            if g.get("control") == "none":
                rep.add(
                    "gateway control",
                    "warn",
                    "the gateway only observes (control none)",
                    "start the gateway with --control budgeter to park sessions in the degraded regime",
                )
        if info.kv_pool is not None:
            rep.add(
                "pool",
                "ok",
                f"C = {info.kv_pool} tokens ({info.kind} via {info.source}"
                + (f", {info.num_gpu_blocks} blocks x {info.block_size}" if info.num_gpu_blocks else "")
                + ")",
            )
        else:
            fix = (
                "vLLM >= 0.6 exports vllm:cache_config_info on /metrics; do not disable /metrics"
                if kind == "vllm"
                else "SGLang reports max_total_num_tokens on /server_info"
            )
            rep.add("pool", "warn", "pool size not found (" + "; ".join(info.reasons) + ")", fix)
        caching = await _prefix_caching_flag(get, kind)
        fix_cache = SGLANG_FIX_CACHING if kind == "sglang" else VLLM_FIX_CACHING
        fix_report = SGLANG_FIX_REPORT if kind == "sglang" else VLLM_FIX_REPORT
        if caching is False:
            rep.add(
                "prefix caching", "warn", "prefix caching is off: every turn recomputes its whole context", fix_cache
            )
        probe = await _probe(http, base, model, info.block_size or 16)
        rep.facts["probe"] = probe
        if probe.get("error"):
            rep.add("cached-token probe", "warn", f"the probe request failed: {probe['error']}", None)
        elif probe["cached_tokens"] is None:
            rep.add(
                "cached tokens reported",
                "warn",
                "usage carries no prompt_tokens_details.cached_tokens: "
                "kvgate cannot see prefix hits (hit ratio, the regime alarm)",
                fix_report,
            )
        elif probe["cached_tokens"] > 0:
            rep.add(
                "cached tokens reported",
                "ok",
                f"the second probe request hit {probe['cached_tokens']} of {probe['prompt_tokens']} prompt tokens",
            )
            if caching is None:
                rep.add("prefix caching", "ok", "on (the probe hit)")
        elif caching is not False:
            rep.add(
                "prefix caching",
                "warn",
                f"cached tokens are reported but the probe's shared {probe['shared']}-token prefix did not hit",
                fix_cache,
            )
        if caching is True:
            rep.add("prefix caching", "ok", "on")
        await _api_checks(rep, http, base, model, info.block_size or 16, fix_report)
        return {"pool": info.kv_pool, "max_len": max_len}


async def _prefix_caching_flag(get: Any, kind: str) -> bool | None:
    """What the server says about prefix caching (None: it does not say)."""
    from kvgate.http.openai import Unreachable

    try:
        if kind == "sglang":
            for path in SERVER_INFO_PATHS:
                status, body = await get(path)
                obj = _json(body)
                if status == 200 and type(obj) is dict and type(obj.get("disable_radix_cache")) is bool:
                    return not obj["disable_radix_cache"]
            return None
        status, body = await get("/metrics")
    except (Unreachable, OSError, TimeoutError):
        return None
    if status != 200:
        return None
    return prefix_caching_label(body.decode("utf-8", "replace"))


async def _probe(http: Any, base: str, model: str, block: int) -> dict[str, Any]:
    """Two completions sharing ``PROBE_BLOCKS`` blocks; the second's cached tokens (None: not reported)."""
    import aiohttp

    shared = [100 + (i * 7) % 400 for i in range(PROBE_BLOCKS * block)]
    out: dict[str, Any] = {"shared": len(shared)}
    for tail in ([11, 12, 13], [21, 22, 23]):
        body = {"model": model, "prompt": shared + tail, "max_tokens": 1, "temperature": 0}
        try:
            async with http.post(base + "/v1/completions", json=body) as r:
                resp = _json(await r.read())
                if r.status != 200 or type(resp) is not dict:
                    return {**out, "error": f"POST /v1/completions: HTTP {r.status}"}
        except (aiohttp.ClientError, TimeoutError) as e:
            return {**out, "error": f"POST /v1/completions: {e or type(e).__name__}"}
    usage = COMPLETIONS.usage(resp.get("usage"))
    if usage is None:
        return {**out, "prompt_tokens": None, "cached_tokens": None}
    return {**out, "prompt_tokens": usage.prompt, "cached_tokens": usage.cached}


async def _api_checks(rep: Report, http: Any, base: str, model: str, block: int, fix_report: str) -> None:
    """Cached-token reporting per conversation API (chat, Responses, Messages), each read in its own field."""
    probes = {}
    for api in (CHAT, RESPONSES, MESSAGES):
        got = await _probe_api(http, base, model, block, api)
        probes[api.name] = got
        check = f"cached tokens reported ({api.name}: {api.path})"
        if got.get("status") == 404:
            rep.add(check, "ok", f"not served (404): agents speaking the {api.name} API cannot use this endpoint")
        elif got.get("error"):
            rep.add(check, "warn", f"the probe request failed: {got['error']}", None)
        elif got["cached_tokens"] is None:
            rep.add(check, "warn", f"usage carries no cached tokens in {api.name}'s field: kvgate cannot see "
                    "those agents' prefix hits", fix_report)
        else:
            rep.add(check, "ok", f"the second probe request hit {got['cached_tokens']} of {got['prompt_tokens']} "
                    "prompt tokens")
    rep.facts["api_probes"] = probes


async def _probe_api(http: Any, base: str, model: str, block: int, api: Api) -> dict[str, Any]:
    """Two requests of ``api`` sharing a system prompt of ``PROBE_BLOCKS`` blocks; the second's cached tokens."""
    import aiohttp

    shared = " ".join(f"w{i % 97}" for i in range(PROBE_BLOCKS * block))
    out: dict[str, Any] = {"shared_words": PROBE_BLOCKS * block}
    resp: Any = None
    for tail in ("first question", "second question"):
        user = [{"role": "user", "content": tail}]
        body = {"model": model, **api.request_body(shared, user, 1)}
        try:
            async with http.post(base + api.path, json=body) as r:
                resp = _json(await r.read())
                if r.status != 200 or type(resp) is not dict:
                    return {**out, "status": r.status, "error": f"POST {api.path}: HTTP {r.status}"}
        except (aiohttp.ClientError, TimeoutError) as e:
            return {**out, "error": f"POST {api.path}: {e or type(e).__name__}"}
    usage = api.usage(resp.get("usage"))
    if usage is None:
        return {**out, "prompt_tokens": None, "cached_tokens": None}
    return {**out, "prompt_tokens": usage.prompt, "cached_tokens": usage.cached}


def _json(body: bytes) -> Any:
    try:
        return json.loads(body)
    except ValueError:
        return None


def run(endpoint: str, preset: str | None, trace: str | None, lam: float | None, profile: str,
        timeout_s: float = 10.0, api_key: str | None = None) -> Report:
    wl = None
    if preset and trace:
        raise UsageError("give --preset or --trace, not both")
    if lam is not None and not lam > 0:
        raise UsageError("--lam must be positive")
    if trace:
        from kvgate.workload.trace import PAPER_MAX_CONTEXT, trace_workload

        wl = trace_workload(None if trace == "bundled" else trace, max_context=PAPER_MAX_CONTEXT)
    elif preset or lam is not None:
        from kvgate.workload.shapes import preset as get_preset

        wl = get_preset(preset or "paper-8b")
    if not endpoint.startswith(("http://", "https://")):
        raise UsageError(f"--endpoint {endpoint!r}: expected http://HOST:PORT")
    rep = Report(endpoint)
    got = asyncio.run(check_endpoint(rep, endpoint, timeout_s, api_key))
    if got and wl is not None:
        workload_checks(rep, wl, got.get("pool"), got.get("max_len"), lam, profile)
    return rep


@click.command("doctor", context_settings={"help_option_names": ["-h", "--help"], "max_content_width": 110})
@click.option("--endpoint", required=True, help="The engine's (or a kvgate gateway's) base URL.")
@click.option("--preset", default=None, help="Workload preset for N*, 1/S and the band (paper-8b, paper-shift).")
@click.option("--trace", default=None, help="Workload from a trace (kvgate JSONL; 'bundled').")
@click.option("--lam", type=FINITE, default=None, help="Session arrival rate (1/s) to place in the band.")
@click.option("--profile", default="qwen3-8b-mi300x", show_default=True,
              help="Cost profile NAME (c(L) fitted on its cache-disabled simulation) or a measured FILE "
              "(JSON: intercept_s, slope_ms_per_token, R0_s).")
@click.option("--timeout", "timeout_s", type=FINITE, default=10.0, show_default=True, help="Per request (s).")
@click.option("--api-key", default=None, envvar="OPENAI_API_KEY", help="Bearer key [env OPENAI_API_KEY].")
@click.option("--json", "as_json", is_flag=True, help="Print the report as one JSON object.")
def command(endpoint: str, preset: str | None, trace: str | None, lam: float | None, profile: str,
            timeout_s: float, api_key: str | None, as_json: bool) -> None:
    """Check a live vLLM / SGLang / kvgate gateway: caching, cached-token reporting, pool, and the workload's
    safe arrival-rate band. Exit 0 healthy, 1 warnings, 3 cannot reach or not an OpenAI server."""
    if timeout_s <= 0:
        raise click.BadParameter(f"{timeout_s:g}: a request needs some time (seconds, above 0)",
                                 param_hint="'--timeout'")
    if lam is not None and lam < 0:
        raise click.BadParameter(f"{lam:g}: an arrival rate is at least 0", param_hint="'--lam'")
    rep = run(endpoint, preset, trace, lam, profile, timeout_s, api_key)
    click.echo(json.dumps(rep.json(), indent=1) if as_json else rep.text())
    sys.exit(rep.exit_code)
