"""Dynamo's mocker timed by kvgate's engine profile: its timing table (``--planner-profile-data``) written from
the paper-8b cost model, so the mocker rows run on the same engine speed as the ``kvgate engine`` rows.

The mocker looks a prefill up by its input length and a decode step by (active KV tokens, context length per
request) (``dynamo/mocker/utils/planner_profiler_perf_data_converter.py``): a file with ``prefill_isl``,
``prefill_ttft_ms``, ``decode_active_kv_tokens``, ``decode_context_length`` and the grid ``decode_itl``. Both come
from :class:`kvgate.engine.costmodel.Profile` as kvgate's engine times a step:

* prefill of ``isl`` tokens alone: chunks of the step budget (8,192), each ``step_time(n, 1, chunk_attn(done, n))``;
* a decode step of ``b = kv / ctx`` requests: ``step_time(b, b, b x kv_read x ctx)`` (each request reads its KV).

What the table cannot say: kvgate's mixed-batch penalty (a decode sharing its step with a prefill chunk pays
``mixed_decode_factor`` times its KV read) and the attention over a cached prefix (the mocker's prefill lookup
knows only the new tokens), so the mocker's turns under load cost less than kvgate's engine's. Measured, not
hidden: the page shows both stacks' uncontrolled baselines.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from kvgate.engine.costmodel import QWEN3_8B_MI300X, Profile

STEP_BUDGET = 8192


def prefill_ms(p: Profile, isl: int, budget: int = STEP_BUDGET) -> float:
    done, t = 0, 0.0
    while done < isl:
        n = min(budget, isl - done)
        t += p.step_time(n, 1, p.chunk_attn(done, n))
        done += n
    return t * 1e3


def decode_ms(p: Profile, kv: float, ctx: float) -> float:
    b = max(1.0, kv / ctx) if ctx > 0 else 1.0
    return p.step_time(int(round(b)), int(round(b)), b * p.kv_read_s * ctx) * 1e3


def write_profile(path: Path, p: Profile = QWEN3_8B_MI300X, *, max_len: int = 40_960, pool: int = 400_000,
                  points: int = 64) -> Path:
    """The mocker's timing table for profile ``p`` (times in ms of the profile's own clock: the mocker's
    ``--speedup-ratio`` then plays it at the run's time scale)."""
    isl = np.unique(np.linspace(1, max_len, points * 2).round().astype(int))
    kv = np.linspace(0.0, float(pool), points)
    ctx = np.linspace(1.0, float(max_len), points)
    itl = np.array([[decode_ms(p, k, c) for c in ctx] for k in kv])
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(
        path, prefill_isl=isl.astype(float), prefill_ttft_ms=np.array([prefill_ms(p, int(n)) for n in isl]),
        decode_active_kv_tokens=kv, decode_context_length=ctx, decode_itl=itl,
    )
    return path
