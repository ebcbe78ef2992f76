"""Per-step cost model of a GPU engine, and the named engine profiles.

One engine step runs a batch: chunks of prompt being prefilled and sequences decoding one token each. Its
duration follows a roofline over the step's pieces (the shape of the kernel timings measured for Qwen3-8B in
``shared/data/h200-qwen3-8b-kernels.json``: linear layers are flat while weight-bound, then grow with tokens;
attention of a chunk grows with chunk x context; decode attention is bound by reading each sequence's KV)::

    step = overhead
         + max(weights, per_token * tokens_in_step)                       # linear layers + sampling
         + sum over chunks  max(kv_read * context_end, attn * n * (cached + n / 2))
         + per_seq * sequences_in_step

A decoding sequence that shares its step with a prefill chunk pays ``mixed_decode_factor`` times its KV read:
a mixed batch runs decode tokens through the varlen (prefill-shaped) attention path, which reads KV far less
efficiently than the paged-decode kernel. This is what makes a turn cost more under load than in isolation
(the paper's c(L) = 0.146 ms/token under load vs 10-13K tok/s cold prefill alone).

The constants of a profile are the only calibrated inputs of the simulator; ``docs/calibration.md`` says how
they were set and ``kvgate calibrate`` checks them against the paper's measurements.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvgate.errors import UsageError


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    kv_pool_tokens: int
    """Default KV pool (tokens) the engine gets for this model and GPU."""
    kv_bytes_per_token: int
    overhead_s: float
    weights_s: float
    per_token_s: float
    attn_s: float
    """Seconds per (new token x context token) of prefill attention."""
    kv_read_s: float
    """Seconds per context token read by a chunk (decode attention is bound by this)."""
    per_seq_s: float
    mixed_decode_factor: float = 1.0
    max_model_len: int = 40_960
    estimated: bool = False
    note: str = ""

    def step_time(self, tokens: int, seqs: int, attn: float) -> float:
        """Duration of a step with ``tokens`` new tokens over ``seqs`` sequences; ``attn`` is the summed
        attention term of its chunks (see :meth:`chunk_attn`)."""
        lin = self.per_token_s * tokens
        if lin < self.weights_s:
            lin = self.weights_s
        return self.overhead_s + lin + attn + self.per_seq_s * seqs

    def chunk_attn(self, cached: int, n: int) -> float:
        """Attention time of ``n`` new tokens of a sequence with ``cached`` tokens already computed."""
        comp = self.attn_s * n * (cached + 0.5 * n)
        mem = self.kv_read_s * (cached + n)
        return comp if comp > mem else mem


QWEN3_8B_MI300X = Profile(
    name="qwen3-8b-mi300x",
    kv_pool_tokens=400_000,
    kv_bytes_per_token=144 * 1024,
    overhead_s=0.0010,
    weights_s=0.0035,
    per_token_s=5.5e-5,
    attn_s=2.4e-9,
    kv_read_s=7.0e-8,
    per_seq_s=1.0e-4,
    mixed_decode_factor=11.0,
    note="Qwen3-8B, BF16, one AMD MI300X, vLLM 0.20; fitted to the paper's measurements (docs/calibration.md)",
)

# Qwen3-32B: 4x the weights and linear FLOPs, 64 layers x 8 KV heads x 128 x 2 x 2 B = 256 KiB of KV per token
# (1.78x the 8B's 144 KiB, so 1.78x the KV read per context token and ~1.8x the attention FLOPs per token pair).
QWEN3_32B_MI300X = Profile(
    name="qwen3-32b-mi300x",
    kv_pool_tokens=365_000,
    kv_bytes_per_token=256 * 1024,
    overhead_s=0.0012,
    weights_s=0.0035 * 4.0,
    per_token_s=5.5e-5 * 4.0,
    attn_s=2.4e-9 * 1.78,
    kv_read_s=7.0e-8 * 1.78,
    per_seq_s=1.0e-4,
    mixed_decode_factor=11.0,
    estimated=True,
    note="ESTIMATED: derived from qwen3-8b-mi300x by scaling weights and KV size; not measured",
)

PROFILES: dict[str, Profile] = {p.name: p for p in (QWEN3_8B_MI300X, QWEN3_32B_MI300X)}


def profile(name: str) -> Profile:
    try:
        return PROFILES[name]
    except KeyError:
        raise UsageError(f"unknown profile {name!r}; choose from {', '.join(sorted(PROFILES))}") from None
