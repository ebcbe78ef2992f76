"""Per-step cost model of a GPU engine, and the named engine profiles.

One engine step runs a batch: chunks of prompt being prefilled and sequences decoding one token each. Its
duration follows a roofline over the step's pieces (the shape of the kernel timings measured for Qwen3-8B in
``shared/data/h200-qwen3-8b-kernels.json``: linear layers are flat while weight-bound, then grow with tokens;
attention of a chunk grows with chunk x context; decode attention is bound by reading each sequence's KV)::

    step = overhead
         + max(weights, per_token * tokens_in_step)                       # linear layers + sampling
         + sum over chunks  max(kv_read * context_end, attn * n * (cached + n / 2))
         + per_seq * sequences_in_step

and a request reaches the engine's queue ``request_s + request_per_token_s * prompt_tokens`` after it was sent (the
HTTP request, the API server's processing and the hand-off to the engine core: latency beside the steps, measured
on a real server by ``kvgate calibrate --endpoint``; 0 in the paper's profiles, where it is a few milliseconds of a
turn of seconds and was not measured).

A decoding sequence that shares its step with prefill chunks pays more than its KV read: a mixed batch runs decode
tokens through the varlen (prefill-shaped) attention path, which reads KV far less efficiently than the
paged-decode kernel, the more so the more of the step is prefill. Its KV read is multiplied by
``1 + (mixed_decode_factor - 1) * share ** mixed_share_exponent``, ``share`` the step's prefill tokens over its token
budget (:meth:`Profile.mixed_penalty`; an exponent of 0 is the constant ``mixed_decode_factor`` whatever the
prefill). This is what makes a
turn cost more under load than in isolation (the paper's c(L) = 0.146 ms/token under load vs 10-13K tok/s cold
prefill alone) while a cache-warm engine, whose steps carry small incremental prefills, keeps its capacity.

The constants of a profile are the only calibrated inputs of the simulator; ``docs/calibration.md`` says how
they were set and ``kvgate calibrate`` checks them against the paper's measurements.

Profiles are named (the built-in ones below, and the measured ones committed under ``kvgate/data/profiles/``)
or read from a JSON file written by ``kvgate calibrate --endpoint`` (:func:`save_profile`): wherever a profile
name is taken, ``path/to/profile.json`` works too. Reading the file happens once, when a run is configured,
never inside a step.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, fields
from importlib import resources
from pathlib import Path
from typing import Any

from kvgate.errors import UsageError, json_object

PROFILE_FORMAT = 1
"""Version of the profile file format (the ``kvgate_profile`` key)."""


@dataclass(frozen=True, slots=True)
class Profile:
    name: str
    kv_pool: int
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
    """The factor on a decoder's KV read in a step whose token budget is all prefill."""
    mixed_share_exponent: float = 0.0
    """How the factor's excess over 1 falls with the step's prefill share (prefill tokens / token budget): it is
    scaled by share ** this. 0: the whole factor in every step with prefill."""
    max_model_len: int = 40_960
    estimated: bool = False
    note: str = ""
    request_s: float = 0.0
    """Seconds from a request's send to its arrival in the engine's queue, whatever its length: the HTTP request,
    the API server's processing of it and the hand-off to the engine core (and the first token's way back). A
    latency beside the engine's steps, not engine time: the engine steps other requests meanwhile."""
    request_per_token_s: float = 0.0
    """Seconds more of that per prompt token: reading and validating the prompt, passing it to the engine core,
    hashing its blocks."""

    def request_time(self, prompt: int) -> float:
        """The request's way to the engine's queue (:attr:`request_s`, :attr:`request_per_token_s`)."""
        return self.request_s + self.request_per_token_s * prompt

    def mixed_penalty(self, prefill: int, budget: int) -> float:
        """The factor on the decoders' KV read in a step carrying ``prefill`` (> 0) prefill tokens of its token
        ``budget``."""
        a = self.mixed_share_exponent
        if a == 0.0 or prefill >= budget:
            return self.mixed_decode_factor
        return 1.0 + (self.mixed_decode_factor - 1.0) * (prefill / budget) ** a

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
    kv_pool=400_000,
    kv_bytes_per_token=144 * 1024,
    overhead_s=0.0010,
    weights_s=0.0035,
    per_token_s=5.5e-5,
    attn_s=2.4e-9,
    kv_read_s=7.0e-8,
    per_seq_s=1.0e-4,
    mixed_decode_factor=9.0,
    mixed_share_exponent=3.0,
    note="Qwen3-8B, BF16, one AMD MI300X, vLLM 0.20; fitted to the paper's measurements (docs/calibration.md)",
)

# Qwen3-32B: 4x the weights and linear FLOPs, 64 layers x 8 KV heads x 128 x 2 x 2 B = 256 KiB of KV per token
# (1.78x the 8B's 144 KiB, so 1.78x the KV read per context token); attention FLOPs per (query, context) token pair
# go with layers x query heads x head size: 64 x 64 x 128 against the 8B's 36 x 32 x 128, 3.56x.
QWEN3_32B_MI300X = Profile(
    name="qwen3-32b-mi300x",
    kv_pool=365_000,
    kv_bytes_per_token=256 * 1024,
    overhead_s=0.0012,
    weights_s=0.0035 * 4.0,
    per_token_s=5.5e-5 * 4.0,
    attn_s=2.4e-9 * (64 * 64) / (36 * 32),
    kv_read_s=7.0e-8 * 1.78,
    per_seq_s=1.0e-4,
    mixed_decode_factor=9.0,
    mixed_share_exponent=3.0,
    estimated=True,
    note="ESTIMATED: derived from qwen3-8b-mi300x by scaling weights and KV size; not measured",
)

PROFILES: dict[str, Profile] = {p.name: p for p in (QWEN3_8B_MI300X, QWEN3_32B_MI300X)}

_FIELDS = {f.name: f for f in fields(Profile)}
_INTS = ("kv_pool", "kv_bytes_per_token", "max_model_len")
_FLOATS = ("overhead_s", "weights_s", "per_token_s", "attn_s", "kv_read_s", "per_seq_s", "mixed_decode_factor",
           "mixed_share_exponent", "request_s", "request_per_token_s")
_OPTIONAL = ("mixed_decode_factor", "mixed_share_exponent", "max_model_len", "request_s", "request_per_token_s")
"""Keys a profile file may leave out (their defaults: files written before kvgate had them)."""


def bundled_profiles() -> list[str]:
    """Names of the measured profiles shipped in ``kvgate/data/profiles/``."""
    d = resources.files("kvgate").joinpath("data", "profiles")
    if not d.is_dir():
        return []
    return sorted(p.name.removesuffix(".json") for p in d.iterdir() if p.name.endswith(".json"))


def profile(name: str) -> Profile:
    """A built-in profile, a bundled measured one, or a profile file (a path ending in ``.json``)."""
    if name in PROFILES:
        return PROFILES[name]
    if name.endswith(".json") or "/" in name:
        return load_profile(Path(name))
    if name in bundled_profiles():
        text = resources.files("kvgate").joinpath("data", "profiles", name + ".json").read_text("utf-8")
        return profile_from_dict(json_object(text, f"bundled profile {name}"), f"bundled profile {name}")
    names = sorted(PROFILES) + bundled_profiles()
    raise UsageError(f"unknown profile {name!r}; choose from {', '.join(names)}, or give a profile .json file")


def load_profile(path: Path) -> Profile:
    """Read a profile file (the format of :func:`save_profile`)."""
    try:
        text = path.read_text("utf-8")
    except OSError as e:
        raise UsageError(f"cannot read profile {str(path)!r}: {e.strerror or e}") from None
    except UnicodeDecodeError:
        raise UsageError(f"profile {str(path)!r}: not text (a profile is a JSON file)") from None
    return profile_from_dict(json_object(text, f"profile {path}"), f"profile {path}")


def profile_from_dict(obj: dict[str, Any], where: str = "profile") -> Profile:
    """A :class:`Profile` from a profile file's object; ``calibration`` (what was measured) is carried, not read."""
    fmt = obj.get("kvgate_profile")
    if fmt != PROFILE_FORMAT:
        raise UsageError(f"{where}: not a kvgate profile file (kvgate_profile must be {PROFILE_FORMAT}, got {fmt!r})")
    if "kv_pool_tokens" in obj and "kv_pool" not in obj:  # the key's name before kvgate named the pool kv_pool
        obj = {("kv_pool" if k == "kv_pool_tokens" else k): v for k, v in obj.items()}
    unknown = set(obj) - set(_FIELDS) - {"kvgate_profile", "calibration"}
    if unknown:
        raise UsageError(f"{where}: unknown keys {', '.join(sorted(unknown))}")
    kw: dict[str, Any] = {}
    for k in ("name", *_INTS, *_FLOATS):
        if k not in obj:
            if k in _OPTIONAL:
                continue
            raise UsageError(f"{where}: missing {k!r}")
        v = obj[k]
        if k == "name":
            if not isinstance(v, str) or not v:
                raise UsageError(f"{where}: 'name' must be a non-empty string")
        elif k in _INTS:
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise UsageError(f"{where}: {k!r} must be a positive integer, got {v!r}")
        elif not isinstance(v, int | float) or isinstance(v, bool) or not math.isfinite(v) or v < 0:
            raise UsageError(f"{where}: {k!r} must be a number >= 0, got {v!r}")
        kw[k] = float(v) if k in _FLOATS else v
    if kw.get("mixed_decode_factor", 1.0) < 1.0:
        raise UsageError(f"{where}: 'mixed_decode_factor' must be >= 1")
    for k in ("estimated", "note"):
        if k in obj:
            want = bool if k == "estimated" else str
            if not isinstance(obj[k], want):
                raise UsageError(f"{where}: {k!r} must be a {want.__name__}")
            kw[k] = obj[k]
    return Profile(**kw)


def profile_to_dict(p: Profile, calibration: dict[str, Any] | None = None) -> dict[str, Any]:
    """The profile file's object: the format version, every constant, and optionally what was measured."""
    obj: dict[str, Any] = {"kvgate_profile": PROFILE_FORMAT, **asdict(p)}
    if calibration is not None:
        obj["calibration"] = calibration
    return obj


def save_profile(p: Profile, path: Path, calibration: dict[str, Any] | None = None) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile_to_dict(p, calibration), indent=2, sort_keys=False) + "\n", "utf-8")
