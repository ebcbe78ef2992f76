"""Where a turn's time to first token goes on the real vLLM (CPU build), request by request.

    python3 benchmarks/real_vllm_ttft_parts.py [--reps 5] [--json out.json] [--profile PATH]

One request at a time on an otherwise idle server (the held-out table's configuration: block size 128, step budget
2,048, one OpenMP thread), a prompt of ``cached`` tokens already in the prefix cache plus ``new`` tokens, one output
token, streamed. Per request, from the client and from vLLM's own histograms (``/metrics`` before and after):

* ``client``: first streamed token - request sent (what ``kvgate drive`` records as TTFT);
* ``server``: ``vllm:time_to_first_token_seconds``, from the request's arrival in the API server's output
  processor (after the request was parsed and processed) to its first token there;
* ``engine``: ``vllm:request_queue_time_seconds`` + ``vllm:request_prefill_time_seconds``, the engine core's own
  timestamps from queued to the first token's step;
* ``model``: the cost model's prefill time with the profile (``--profile``, default the held-out table's).

The rows say which side holds the time the cost model does not charge: the engine's steps (``engine - model``),
the hand-off between the processes (``server - engine``), or the HTTP server and request processing
(``client - server``). Medians over ``--reps`` repetitions, each on a fresh prefix. Run on a quiet machine.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

CACHED = (0, 2048, 4096, 8192)
NEW = (256, 512, 1024, 2048)
SERVER = ("vllm:time_to_first_token_seconds",)


async def _measure(url: str, reps: int, say: Any) -> list[dict[str, Any]]:
    from kvgate.calibration.measure import _Http

    http = _Http(url, None, 600.0)
    rng = random.Random(20261202)

    def uniq(n: int) -> list[int]:
        return [rng.randrange(1000, 30000) for _ in range(n)]

    from kvgate.http.dialect import VLLM

    async def metrics() -> tuple[float, float]:
        server, engine = await http.engine_seconds(SERVER), await http.engine_seconds(VLLM.metrics.engine_time)
        assert server is not None and engine is not None, "not a vLLM that times its requests"
        return server, engine

    try:
        st, body = await http.get("/v1/models")
        http.model = json.loads(body)["data"][0]["id"]
        for n in sorted({*NEW, *CACHED, 128} - {0}):  # first sight of a shape is slow (oneDNN)
            for _ in range(2):
                await http.complete(uniq(n), 1)
        rows = []
        for cached in CACHED:
            for new in NEW:
                got = []
                for _ in range(reps):
                    prefix = uniq(cached)
                    if cached:
                        await http.complete(prefix, 1)
                    (s0, e0) = await metrics()
                    sent, first, _, _, hit = await http.complete(prefix + uniq(new), 1)
                    (s1, e1) = await metrics()
                    got.append({"client": first - sent, "server": s1 - s0, "engine": e1 - e0, "cached_reported": hit})
                row = {"cached": cached, "new": new, "reps": reps,
                       "cached_reported": min(g["cached_reported"] or 0 for g in got)}
                for k in ("client", "server", "engine"):
                    row[k] = statistics.median(g[k] for g in got)
                rows.append(row)
                say(f"cached {cached:>5} new {new:>5}: client {row['client'] * 1e3:6.1f} ms, server "
                    f"{row['server'] * 1e3:6.1f}, engine {row['engine'] * 1e3:6.1f} (hit {row['cached_reported']})")
        return rows
    finally:
        await http.close()


def _model(rows: list[dict[str, Any]], profile: str, budget: int) -> None:
    """The cost model's prefill steps for each row (calibration's prediction, less the profile's request time)."""
    from kvgate.calibration.fit import Sample, predict
    from kvgate.engine.costmodel import profile as get_profile

    p = get_profile(profile)
    for r in rows:
        s = Sample("cold" if not r["cached"] else "incremental", r["cached"] + r["new"], r["cached"], 1, 1, 0.0)
        r["model"] = predict(p, s, budget) - p.request_time(s.prompt)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--json", type=Path, default=None)
    ap.add_argument("--profile", default="docs/results/real-vllm-heldout/profile.json")
    a = ap.parse_args()
    from kvgate.realvllm.experiment import FULL
    from kvgate.realvllm.server import RealVllm, ServerConfig, vllm_available

    why = vllm_available()
    if why is not None:
        sys.exit(f"real_vllm_ttft_parts: {why}")
    log = Path(tempfile.mkdtemp(prefix="kvgate-ttft-parts-")) / "vllm.log"
    cfg = ServerConfig(kv_pool=FULL.kv_pool, block_size=FULL.block_size, max_model_len=FULL.max_model_len,
                       extra_args=("--max-num-batched-tokens", str(FULL.max_num_batched_tokens), "--max-num-seqs",
                                   str(FULL.max_num_seqs)), log_path=log)
    load0 = os.getloadavg()[0]
    with RealVllm(cfg) as srv:
        rows = asyncio.run(_measure(srv.url, a.reps, lambda m: print(m, file=sys.stderr)))
    _model(rows, a.profile, FULL.max_num_batched_tokens)
    print(f"{'cached':>6} {'new':>5} | {'client':>7} {'server':>7} {'engine':>7} {'model':>7} | "
          f"{'client-server':>13} {'server-engine':>13} {'engine-model':>12}   (ms)")
    for r in rows:
        c, s, e, m = (r[k] * 1e3 for k in ("client", "server", "engine", "model"))
        print(f"{r['cached']:>6} {r['new']:>5} | {c:7.1f} {s:7.1f} {e:7.1f} {m:7.1f} | {c - s:13.1f} {s - e:13.1f} "
              f"{e - m:12.1f}")
    res = {"rows": rows, "profile": a.profile, "reps": a.reps, "loadavg": [load0, os.getloadavg()[0]],
           "server": {"block_size": FULL.block_size, "max_num_batched_tokens": FULL.max_num_batched_tokens}}
    print(f"load average {load0:.2f} -> {os.getloadavg()[0]:.2f}")
    if a.json:
        a.json.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
