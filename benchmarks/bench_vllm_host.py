"""What vLLM's own host-side code spends per step and per request, at the paper's scale, on this CPU.

    python3 benchmarks/bench_vllm_host.py [--steps 200] [--json out.json]

The engine core of vLLM runs, beside the model, a scheduler (``schedule()`` and ``update_from_output()``), the KV
cache manager (prefix lookups, allocation, eviction, caching of full blocks) and, for every request it receives,
the hashing of its prompt's blocks; the API server process tokenizes prompts and detokenizes outputs. kvgate's
cost model charges the model's GPU time only. This measures the host side with vLLM 0.32.0's own classes (the CPU
build installed here), without a model, at the paper's scale: a 400K-token pool of 16-token blocks, the 8,192-token
step budget, prompts of 6-37K tokens:

* ``healthy``: ~6 requests running at ~22K tokens of context, nothing waiting (the paper's λ = 0.035);
* ``degraded``: 24 requests running at 14-16K tokens with the pool full, and 0, 100 or 300 requests of 20-37K
  tokens waiting whose prefixes are not cached (the paper's degraded regime: 16-32 running, 100+ in the system);
* ``hashing``: building a 30K-token request with vLLM's default block hasher (sha256 over 16-token blocks), which
  the engine core does once per request it receives;
* ``admission``: one 21.6K-token cold turn through the scheduler: its prefix lookup, allocation (evicting cached
  blocks), three 8,192-token chunks and the caching of its full blocks.

Times are CPU seconds of one Python thread on this machine (shared: the figures move with the load average,
printed beside them). Whether they add to a step on the paper's GPU depends on async scheduling (vLLM's default on
GPUs since 2026): the next step is scheduled while the current one runs, so host work per step is hidden unless it
exceeds the GPU's step time (docs/calibration.md, "Where the time goes").
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import statistics
import tempfile
import time
from typing import Any

BLOCK = 16
POOL_TOKENS = 400_000
BUDGET = 8192


def _scheduler(num_blocks: int) -> Any:
    import torch
    from vllm.config import CacheConfig, ModelConfig, SchedulerConfig, VllmConfig
    from vllm.v1.core.sched.scheduler import Scheduler
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec
    from vllm.v1.structured_output import StructuredOutputManager

    logging.getLogger("vllm").setLevel(logging.ERROR)
    d = tempfile.mkdtemp(prefix="kvgate-bench-host-")
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64,
                   "intermediate_size": 128, "num_attention_heads": 2, "num_key_value_heads": 2,
                   "num_hidden_layers": 1, "vocab_size": 151_936, "max_position_embeddings": 65_536,
                   "torch_dtype": "float32"}, f)
    mc = ModelConfig(model=d, skip_tokenizer_init=True, max_model_len=40_960, dtype="float32")
    sc = SchedulerConfig(max_num_seqs=1024, max_num_batched_tokens=BUDGET, max_model_len=40_960,
                         enable_chunked_prefill=True, is_encoder_decoder=False, async_scheduling=False)
    cc = CacheConfig(block_size=BLOCK, enable_prefix_caching=True)
    vc = VllmConfig(model_config=mc, scheduler_config=sc, cache_config=cc)
    cc.num_gpu_blocks = num_blocks + 1
    spec = FullAttentionSpec(block_size=BLOCK, num_kv_heads=1, head_size=1, dtype=torch.float32)
    kv = KVCacheConfig(num_blocks=num_blocks + 1, kv_cache_tensors=[],
                       kv_cache_groups=[KVCacheGroupSpec(["layer"], spec)])
    return Scheduler(vllm_config=vc, kv_cache_config=kv, structured_output_manager=StructuredOutputManager(vc),
                     block_size=BLOCK, log_stats=True)


def _hasher() -> Any:
    from vllm.utils.hashing import sha256
    from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash

    init_none_hash(sha256)
    return get_request_block_hasher(BLOCK, sha256)


class Bench:
    """vLLM's Scheduler with synthetic model outputs (one sampled token per request whose prompt is done)."""

    def __init__(self, seed: int = 1) -> None:
        self.sched = _scheduler(POOL_TOKENS // BLOCK)
        self.hasher = _hasher()
        self.rng = random.Random(seed)
        self.n = 0

    def request(self, prompt: int, out: int = 300) -> Any:
        from vllm import SamplingParams
        from vllm.v1.request import Request

        self.n += 1
        toks = [self.rng.randrange(151_000) for _ in range(prompt)]
        return Request(request_id=str(self.n), prompt_token_ids=toks,
                       sampling_params=SamplingParams(max_tokens=out, ignore_eos=True), pooling_params=None,
                       arrival_time=float(self.n), block_hasher=self.hasher)

    def step(self) -> tuple[float, float, int]:
        """One step; (schedule seconds, update seconds, requests scheduled)."""
        from vllm.v1.outputs import ModelRunnerOutput

        t0 = time.process_time()
        out = self.sched.schedule()
        t1 = time.process_time()
        ids = list(out.num_scheduled_tokens)
        sampled = []
        for k in ids:
            r = self.sched.requests[k]
            sampled.append([self.rng.randrange(151_000)] if r.num_computed_tokens >= r.num_tokens else [])
        mro = ModelRunnerOutput(req_ids=ids, req_id_to_index={k: i for i, k in enumerate(ids)},
                                sampled_token_ids=sampled)
        t2 = time.process_time()
        self.sched.update_from_output(out, mro)
        t3 = time.process_time()
        return t1 - t0, t3 - t2, len(ids)

    def settle(self, max_steps: int = 10_000) -> None:
        """Step until nothing is waiting (every added request admitted and past its prefill)."""
        for _ in range(max_steps):
            if not self.sched.waiting and all(r.num_computed_tokens >= r.num_prompt_tokens
                                              for r in self.sched.running):
                return
            self.step()


def _steps(b: Bench, n: int) -> dict[str, float]:
    s, u = [], []
    for _ in range(n):
        a, c, _k = b.step()
        s.append(a)
        u.append(c)
    return {"schedule_ms": round(1e3 * statistics.median(s), 3), "update_ms": round(1e3 * statistics.median(u), 3),
            "running": len(b.sched.running), "waiting": len(b.sched.waiting)}


def healthy(steps: int) -> dict[str, float]:
    b = Bench()
    for _ in range(6):
        b.sched.add_request(b.request(b.rng.randrange(18_000, 26_000), out=10_000))
    b.settle()
    return _steps(b, steps)


def degraded(waiting: int, steps: int) -> dict[str, float]:
    b = Bench()
    for _ in range(24):
        b.sched.add_request(b.request(b.rng.randrange(14_000, 16_000), out=10_000))
    b.settle()
    for _ in range(waiting):
        b.sched.add_request(b.request(b.rng.randrange(20_000, 37_000)))
    r = _steps(b, steps)
    r["free_blocks"] = b.sched.kv_cache_manager.block_pool.get_num_free_blocks()
    return r


def hashing(reps: int = 5, prompt: int = 30_000) -> dict[str, float]:
    b = Bench()
    toks = [[b.rng.randrange(151_000) for _ in range(prompt)] for _ in range(reps)]
    from vllm import SamplingParams
    from vllm.v1.request import Request

    ts = []
    for i, t in enumerate(toks):
        t0 = time.process_time()
        Request(request_id=f"h{i}", prompt_token_ids=t, sampling_params=SamplingParams(max_tokens=1),
                pooling_params=None, arrival_time=0.0, block_hasher=b.hasher)
        ts.append(time.process_time() - t0)
    ms = 1e3 * statistics.median(ts)
    return {"prompt_tokens": prompt, "ms_per_request": round(ms, 3), "us_per_1k_tokens": round(1e6 * ms / prompt, 1)}


def admission(reps: int = 3) -> dict[str, float]:
    """A cold 21.6K-token turn into a full pool of cached blocks: host time of its prefill steps."""
    out = []
    for _ in range(reps):
        b = Bench()
        for _ in range(18):  # fill the pool with finished (cached) requests of 21.6K
            b.sched.add_request(b.request(21_600, out=1))
        for _ in range(10_000):
            if not b.sched.get_num_unfinished_requests():
                break
            b.step()
        b.sched.add_request(b.request(21_600, out=1))
        tot = 0.0
        for _ in range(10):
            a, c, k = b.step()
            tot += a + c
            if not b.sched.get_num_unfinished_requests():
                break
        out.append(tot)
    return {"prompt_tokens": 21_600, "host_ms_per_cold_turn": round(1e3 * statistics.median(out), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--json", default=None, help="Write the results here as JSON.")
    a = ap.parse_args()
    import vllm

    res: dict[str, Any] = {"vllm": vllm.__version__, "loadavg_before": os.getloadavg()[0]}
    res["healthy"] = healthy(a.steps)
    res["degraded"] = {str(w): degraded(w, a.steps) for w in (0, 100, 300)}
    res["hashing"] = hashing()
    res["admission"] = admission()
    res["loadavg_after"] = os.getloadavg()[0]
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
