"""How fast can ``kvgate engine`` run and still agree with the in-process simulator?

    python3 benchmarks/bench_engine_server.py [--scales 30,60,120,240] [--minutes 15] [--json out.json]

For each time scale a fresh ``kvgate engine`` (a subprocess: ``kvgate engine``) serves a
paper-8b closed loop driven over HTTP from this process: the sessions, arrival times and think times of
``kvgate sim --preset paper-8b --lam 0.035 --seed 501`` (the same ``generate`` call), token-id prompts of
2000 shared + 4000 unique tokens, 300 output tokens (ignore_eos), 1000 appended tokens a turn. Each turn is
compared with the same (session, turn) of the in-process simulator two ways:

* closed loop: ``simulate()`` with the same config (its own timeline; the whole stack against the whole stack);
* replay: an in-process engine fed the HTTP run's own send times (same arrivals, so only the server's
  real-time pacing and HTTP overheads differ).

A scale *agrees* when, in both comparisons, >= 98% of turns report the same cached tokens and the token-weighted
hit ratios differ by <= 0.01, and in the replay turn latency (send to last token as the client sees it, virtual
seconds) is within 5% turn by turn at the median and 15% at the 90th percentile. Closed-loop latencies are
reported as distributions, beside a third reference: the simulator's closed loop with every turn answered
``overhead`` later, ``overhead`` being the median per-turn latency the HTTP run added in the replay (a closed
loop amplifies any per-turn delay: it shifts which turns overlap a neighbour's prefill). A request-path section
times requests on an engine at a huge time scale. With ``--kv-events`` every server publishes its KV events
(``--kv-events-config``, ipc endpoints) to a consumer in this process (the gateway's subscriber): compare its
lag, overheads and agreement with a run without.
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import json
import math
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import aiohttp
import numpy as np

from kvgate.engine.base import Request  # noqa: E402
from kvgate.engine.blocks import SeqKey
from kvgate.engine.costmodel import profile as get_profile
from kvgate.engine.vllm import VllmEngine  # noqa: E402
from kvgate.gateway.kvevents import KVEventSubscriber
from kvgate.serve.tokenizer import filler_ids
from kvgate.sim.config import SimConfig
from kvgate.sim.runner import simulate
from kvgate.workload.arrivals import SessionSpec, generate
from kvgate.workload.shapes import preset

MODEL = "sim"


# -- the server ---------------------------------------------------------------------------------------------------
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class KVEvents:
    """``--kv-events-config`` on ipc endpoints in a temporary directory, and a consumer of them."""

    def __init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="kvgate-bench-kv-")
        self.endpoint, self.replay = f"ipc://{self.dir}/pub", f"ipc://{self.dir}/replay"
        self.sub: KVEventSubscriber | None = None

    def args(self) -> list[str]:
        conf = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": self.endpoint,
                "replay_endpoint": self.replay}
        return ["--kv-events-config", json.dumps(conf)]

    async def start(self) -> None:
        self.sub = KVEventSubscriber(self.endpoint, replay_endpoint=self.replay)
        await self.sub.start()

    async def stop(self) -> dict[str, Any]:
        sub = self.sub
        assert sub is not None
        await sub.stop()
        res = sub.residency
        return {"messages": sub.messages, "replayed": sub.replayed, "gaps": res.gaps, "events": res.events,
                "resident_blocks": len(res.blocks), "bad_messages": sub.bad_messages}


class Server:
    """``kvgate engine`` in a subprocess, stopped with SIGTERM."""

    def __init__(self, scale: float, extra: list[str] | None = None) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        args = [sys.executable, "-m", "kvgate.cli", "engine", "--port", str(self.port), "--time-scale",
                str(scale), "--model", MODEL, *(extra or [])]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)

    async def ready(self, http: aiohttp.ClientSession) -> None:
        for _ in range(400):
            try:
                async with http.get(self.base + "/health") as r:
                    if r.status == 200:
                        return
            except aiohttp.ClientConnectionError:
                pass
            if self.proc.poll() is not None:
                raise RuntimeError("server died: " + (self.proc.stderr.read().decode() if self.proc.stderr else ""))
            await asyncio.sleep(0.05)
        raise RuntimeError("server did not come up")

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


# -- the workload ---------------------------------------------------------------------------------------------------
def _ids(seed: list[int], n: int) -> bytes:
    return ",".join(map(str, np.random.default_rng(seed).integers(0, 100_000, n).tolist())).encode()


class Session:
    """One paper-8b session's prompts as a growing JSON list of token ids (built incrementally)."""

    def __init__(self, spec: SessionSpec, shared: bytes, seed: int) -> None:
        self.spec = spec
        sh = spec.shape
        self.parts = [shared, _ids([seed, 1, spec.sid], sh.initial_tokens - sh.shared_tokens)]
        self.seed = seed

    def body(self, turn: int) -> bytes:
        out = self.spec.shape.outputs[turn]
        head = b'{"model":"%s","max_tokens":%d,"ignore_eos":true,"prompt":[' % (MODEL.encode(), out)
        return head + b",".join(self.parts) + b"]}"

    def advance(self, turn: int) -> None:
        sh = self.spec.shape
        self.parts.append(",".join(map(str, filler_ids(sh.outputs[turn], False))).encode())
        self.parts.append(_ids([self.seed, 2, self.spec.sid, turn], sh.appends[turn]))


async def drive(base: str, scale: float, specs: list[SessionSpec], horizon: float, seed: int) -> dict[str, Any]:
    """The closed loop over HTTP; returns per-turn records keyed (sid, turn) in virtual seconds."""
    loop = asyncio.get_running_loop()
    shared = _ids([seed, 0], specs[0].shape.shared_tokens) if specs else b""
    turns: dict[tuple[int, int], dict[str, Any]] = {}
    errors: list[str] = []
    conn = aiohttp.TCPConnector(limit=0)
    async with aiohttp.ClientSession(connector=conn, timeout=aiohttp.ClientTimeout(total=None)) as http:
        t0 = loop.time()

        def vnow() -> float:
            return (loop.time() - t0) * scale

        async def sleep_until(v: float) -> None:
            d = v / scale - (loop.time() - t0)
            if d > 0:
                await asyncio.sleep(d)

        async def session(spec: SessionSpec) -> None:
            s = Session(spec, shared, seed)
            await sleep_until(spec.arrival_s)
            for k in range(spec.shape.turns):
                sent = vnow()
                if sent > horizon:
                    return
                async with http.post(base + "/v1/completions", data=s.body(k),
                                     headers={"Content-Type": "application/json"}) as r:
                    raw = await r.read()
                    if r.status != 200:
                        errors.append(f"{r.status} {raw[:200]!r}")
                        return
                end = vnow()
                usage = json.loads(raw)["usage"]
                turns[(spec.sid, k)] = {
                    "sent": sent, "end": end, "prompt": usage["prompt_tokens"],
                    "cached": usage["prompt_tokens_details"]["cached_tokens"],
                }
                if k + 1 < spec.shape.turns:
                    s.advance(k)
                    await sleep_until(end + spec.think_s[k])

        tasks = [asyncio.create_task(session(sp)) for sp in specs]
        await sleep_until(horizon)
        await asyncio.sleep(0.2)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        async with http.get(base + "/kvgate/stats") as r:
            stats = await r.json()
    return {"turns": turns, "errors": errors, "server": stats}


# -- the references -------------------------------------------------------------------------------------------------
def closed_loop_reference(cfg: SimConfig) -> dict[tuple[int, int], dict[str, Any]]:
    t = simulate(cfg).tables["turns"].to_pydict()
    out = {}
    for i in range(len(t["session"])):
        key = (t["session"][i], t["turn"][i])
        out[key] = {"sent": t["sent_s"][i], "end": t["end_s"][i], "prompt": t["prompt_tokens"][i],
                    "cached": t["cached_tokens"][i]}
    return out


def replay_reference(http_turns: dict[tuple[int, int], dict[str, Any]], specs: list[SessionSpec],
                     profile: str) -> dict[tuple[int, int], dict[str, Any]]:
    """The in-process engine fed the HTTP run's send times (SeqKeys as the simulator makes them). A turn whose
    previous turn has not finished here yet (the HTTP run was faster) is sent when it finishes."""
    shape = {sp.sid: sp.shape for sp in specs}
    eng = VllmEngine(get_profile(profile))
    heap = [(v["sent"], k) for k, v in http_turns.items()]
    heapq.heapify(heap)
    busy: set[int] = set()
    held: dict[int, tuple[int, int]] = {}
    out: dict[tuple[int, int], dict[str, Any]] = {}
    now = heap[0][0] if heap else 0.0
    rid = 0
    while heap or eng.has_work():
        while heap and heap[0][0] <= now:
            t, (sid, k) = heapq.heappop(heap)
            if sid in busy:
                held[sid] = (sid, k)
                continue
            sh = shape[sid]
            rid += 1
            busy.add(sid)
            eng.add(Request(rid, SeqKey(0, sh.shared_tokens // 16, sid), sh.prompt_tokens()[k], sh.outputs[k], t,
                            (sid, k)))
        if not eng.has_work():
            now = heap[0][0]
            continue
        res = eng.step(now, heap[0][0] if heap else math.inf)
        now += res.duration
        for r in res.finished:
            out[r.tag] = {"sent": r.t_submit, "end": r.t_end, "prompt": r.prompt, "cached": r.cached}  # type: ignore[index]
            sid = r.tag[0]  # type: ignore[index]
            busy.discard(sid)
            if sid in held:
                heapq.heappush(heap, (now, held.pop(sid)))
    return out


def closed_loop_with_overhead(
    specs: list[SessionSpec], horizon: float, overhead: float, profile: str
) -> dict[tuple[int, int], dict[str, Any]]:
    """The simulator's closed loop (the same as ``simulate()`` with ``overhead`` 0), every turn answered
    ``overhead`` virtual seconds after the engine finished it: a client-side cost per turn, as HTTP adds."""
    by = {sp.sid: sp for sp in specs}
    eng = VllmEngine(get_profile(profile))
    heap = [(sp.arrival_s, sp.sid, 0) for sp in specs]
    heapq.heapify(heap)
    out: dict[tuple[int, int], dict[str, Any]] = {}
    now = 0.0
    rid = 0
    while heap or eng.has_work():
        while heap and heap[0][0] <= now:
            t, sid, k = heapq.heappop(heap)
            sh = by[sid].shape
            rid += 1
            eng.add(Request(rid, SeqKey(0, sh.shared_tokens // 16, sid), sh.prompt_tokens()[k], sh.outputs[k], t,
                            (sid, k)))
        if not eng.has_work():
            if heap[0][0] > horizon:
                break
            now = heap[0][0]
            continue
        res = eng.step(now, heap[0][0] if heap else math.inf)
        now += res.duration
        for r in res.finished:
            sid, k = r.tag  # type: ignore[misc]
            end = r.t_end + overhead
            if end <= horizon:
                out[(sid, k)] = {"sent": r.t_submit, "end": end, "prompt": r.prompt, "cached": r.cached}
            if k + 1 < by[sid].shape.turns and end + by[sid].think_s[k] <= horizon:
                heapq.heappush(heap, (end + by[sid].think_s[k], sid, k + 1))
    return out


def _q(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[int(q * (len(xs) - 1))]


def compare(
    http: dict[tuple[int, int], dict[str, Any]], ref: dict[tuple[int, int], dict[str, Any]], per_turn: bool
) -> dict[str, Any]:
    """Cached tokens turn by turn; latency turn by turn (``per_turn``: same arrivals) or as distributions."""
    keys = sorted(set(http) & set(ref))
    if not keys:
        return {"turns": 0, "agrees": False}
    same = sum(http[k]["cached"] == ref[k]["cached"] for k in keys)
    diff = [(k, http[k]["cached"], ref[k]["cached"]) for k in keys if http[k]["cached"] != ref[k]["cached"]][:5]
    hr_h = sum(http[k]["cached"] for k in keys) / sum(http[k]["prompt"] for k in keys)
    hr_r = sum(ref[k]["cached"] for k in keys) / sum(ref[k]["prompt"] for k in keys)
    lat_h = [http[k]["end"] - http[k]["sent"] for k in keys]
    lat_r = [ref[k]["end"] - ref[k]["sent"] for k in keys]
    out: dict[str, Any] = {
        "turns": len(keys), "http_only": len(set(http) - set(ref)), "ref_only": len(set(ref) - set(http)),
        "cached_equal": same / len(keys), "cached_differs": diff, "hit_ratio_http": hr_h, "hit_ratio_ref": hr_r,
        "latency_median_http": _q(lat_h, 0.5), "latency_median_ref": _q(lat_r, 0.5),
        "latency_p90_http": _q(lat_h, 0.9), "latency_p90_ref": _q(lat_r, 0.9),
    }
    hits_ok = out["cached_equal"] >= 0.98 and abs(hr_h - hr_r) <= 0.01
    if per_turn:
        rel = [abs(a - b) / b for a, b in zip(lat_h, lat_r, strict=True)]
        out["err_median"], out["err_p90"] = _q(rel, 0.5), _q(rel, 0.9)
        out["agrees"] = hits_ok and out["err_median"] <= 0.05 and out["err_p90"] <= 0.15
    else:
        out["err_median"] = abs(out["latency_median_http"] / out["latency_median_ref"] - 1)
        out["err_p90"] = abs(out["latency_p90_http"] / out["latency_p90_ref"] - 1)
        out["agrees"] = hits_ok  # latency distributions are reported, not gated (see the module docstring)
    return out


async def run_scale(
    scale: float, cfg: SimConfig, closed: dict[tuple[int, int], dict[str, Any]], server_args: list[str],
    kv: bool = False,
) -> dict[str, Any]:
    horizon = cfg.minutes * 60.0
    specs = generate(preset(cfg.preset), cfg.lam, horizon, cfg.seed)
    events = KVEvents() if kv else None
    server = Server(scale, server_args + (events.args() if events else []))
    kv_stats = None
    try:
        async with aiohttp.ClientSession() as http:
            await server.ready(http)
        if events is not None:
            await events.start()
        wall = time.perf_counter()
        res = await drive(server.base, scale, specs, horizon, cfg.seed)
        wall = time.perf_counter() - wall
    finally:
        if events is not None:
            kv_stats = await events.stop()
        server.stop()
    replay = replay_reference(res["turns"], specs, cfg.profile)
    rep = compare(res["turns"], replay, per_turn=True)
    keys = set(res["turns"]) & set(replay)
    overhead = statistics.median(
        (res["turns"][k]["end"] - res["turns"][k]["sent"]) - (replay[k]["end"] - replay[k]["sent"]) for k in keys
    ) if keys else 0.0
    with_overhead = closed_loop_with_overhead(specs, horizon, max(overhead, 0.0), cfg.profile)
    return {
        "scale": scale, "wall_s": round(wall, 2), "errors": res["errors"][:5], "n_errors": len(res["errors"]),
        "server_lag_max_s": res["server"]["lag_max_s"], "server_lag_p99_s": res["server"]["lag_p99_s"],
        "bridge": res["server"]["bridge"], "late_arrivals": res["server"]["late_arrivals"],
        "replay": rep, "closed_loop": compare(res["turns"], closed, per_turn=False),
        "overhead_s": overhead, "closed_loop_plus_overhead": compare(res["turns"], with_overhead, per_turn=False),
        "kv_events": kv_stats,
    }


# -- request path ---------------------------------------------------------------------------------------------------
async def request_path(n: int = 20, kv: bool = False) -> dict[str, Any]:
    """Real milliseconds per request, client and server (same machine), median of ``n``, with the engine's time
    nearly free (time scale 1e6); ``kv``: the server publishes KV events, consumed here."""
    events = KVEvents() if kv else None
    server = Server(1e6, events.args() if events else None)
    out: dict[str, Any] = {}
    tail = ",".join(map(str, filler_ids(300, False))).encode()

    def ids(lo: int, k: int) -> bytes:
        return ",".join(map(str, range(lo, lo + k))).encode()

    try:
        async with aiohttp.ClientSession() as http:
            await server.ready(http)
            if events is not None:
                await events.start()

            async def timed(label: str, bodies: list[bytes]) -> None:
                times = []
                for data in bodies:
                    t = time.perf_counter()
                    async with http.post(server.base + "/v1/completions", data=data) as r:
                        raw = await r.read()
                        assert r.status == 200, raw[:300]
                    times.append((time.perf_counter() - t) * 1e3)
                out[label] = round(statistics.median(times[3:]), 2)  # the first three warm up

            def body(prompt: bytes, stream: bool = False, out_tokens: int = 300) -> bytes:
                st = b"true" if stream else b"false"
                return b'{"model":"%s","max_tokens":%d,"stream":%s,"prompt":[%s]}' % (MODEL.encode(), out_tokens, st,
                                                                                      prompt)

            await timed("100-token prompt, new, 16 out", [body(ids(1000 * i, 100), out_tokens=16) for i in range(n)])
            await timed("37K-token id prompt, new content, 300 out",
                        [body(ids(20_000 + i, 37_000)) for i in range(n)])
            # an agent session: each prompt is the previous one + its output + 1000 new tokens
            grow = [ids(2000, 6000)]
            for i in range(n):
                grow.append(grow[-1] + b"," + tail + b"," + ids(10_000 + 1000 * i, 1000))
            await timed("agent turn, 6K-25K-token id prompt extending the last, 300 out", [body(g) for g in grow[:n]])
            words = " ".join(chr(97 + i % 26) + chr(97 + i // 26 % 26) + "ora" for i in range(37_000))
            texts = [json.dumps({"model": MODEL, "max_tokens": 300, "prompt": f"{i} {words}"}).encode()
                     for i in range(n)]
            await timed("37K-token text prompt (~200 KB), new, 300 out", texts)
            await timed("37K-token id prompt, new content, 300 out, streamed",
                        [body(ids(80_000 + i, 37_000), stream=True) for i in range(n)])
    finally:
        if events is not None:
            out["kv_events"] = await events.stop()
        server.stop()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--scales", default="30,60,120,240")
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument("--lam", type=float, default=0.035)
    ap.add_argument("--seed", type=int, default=501)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--no-request-path", action="store_true")
    ap.add_argument("--slice-ms", type=float, default=None, help="Passed to the server.")
    ap.add_argument("--kv-events", action="store_true", help="Servers publish KV events to a consumer here.")
    a = ap.parse_args()
    cfg = SimConfig(preset="paper-8b", lam=a.lam, minutes=a.minutes, seed=a.seed)
    closed = closed_loop_reference(cfg)
    results: dict[str, Any] = {"config": {"minutes": a.minutes, "lam": a.lam, "seed": a.seed},
                               "cpus": os.cpu_count(), "load_avg": os.getloadavg()}
    if not a.no_request_path:
        results["request_path_ms"] = asyncio.run(request_path(kv=a.kv_events))
        for k, v in results["request_path_ms"].items():
            print(f"request path: {k}: {v}{'' if k == 'kv_events' else ' ms'}")
    rows = []
    for sc in (float(x) for x in a.scales.split(",")):
        extra = [] if a.slice_ms is None else ["--slice-ms", str(a.slice_ms)]
        r = asyncio.run(run_scale(sc, cfg, closed, extra, a.kv_events))
        rows.append(r)
        for kind in ("replay", "closed_loop", "closed_loop_plus_overhead"):
            c = r[kind]
            print(
                f"x{sc:g} {kind:25s} turns {c['turns']:4d}  cached equal {c['cached_equal']:.3f}  hit "
                f"{c['hit_ratio_http']:.3f} vs {c['hit_ratio_ref']:.3f}  latency median {c['latency_median_http']:.2f}"
                f" vs {c['latency_median_ref']:.2f} s, p90 {c['latency_p90_http']:.2f} vs {c['latency_p90_ref']:.2f}"
                f"  err median {c['err_median']:.3f} p90 {c['err_p90']:.3f}  {'AGREES' if c['agrees'] else 'differs'}"
            )
        print(
            f"x{sc:g} wall {r['wall_s']} s, per-turn HTTP overhead {r['overhead_s']:.3f} s, server lag p99 "
            f"{r['server_lag_p99_s']:.3f} max {r['server_lag_max_s']:.3f} virtual s, errors {r['n_errors']}"
        )
        if r["kv_events"] is not None:
            print(f"x{sc:g} KV events consumed: {r['kv_events']}")
    results["scales"] = rows
    ok = [r["scale"] for r in rows if r["replay"].get("agrees") and r["closed_loop"].get("agrees")]
    results["highest_agreeing_scale"] = max(ok) if ok else None
    print(f"highest agreeing time scale: {results['highest_agreeing_scale']}")
    if a.json:
        a.json.write_text(json.dumps(results, indent=1, default=str))


if __name__ == "__main__":
    main()
