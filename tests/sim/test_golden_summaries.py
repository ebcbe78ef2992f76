"""Simulated summaries are a pure function of the config: a fixed set of configs (both engines, offload, flush,
every control, a trace run, retries) must reproduce the summaries committed in tests/data/golden-summaries.json
exactly. Refactors and speed work must leave them bit-identical; a deliberate change of behaviour re-records them
(`PYTHONPATH=tests python3 tests/sim/test_golden_summaries.py --record`) and says why in its commit.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest

from kvgate.sim.config import SimConfig
from support.golden import check_summary, main

GOLDEN = Path(__file__).resolve().parents[1] / "data" / "golden-summaries.json"

B = SimConfig(minutes=40, lam=0.04, bursts=("1.0@10+4",))
CONFIGS: dict[str, SimConfig] = {
    "vllm-burst": B.with_(seed=1),
    "vllm-twin": B.with_(seed=1, bursts=(), align_min=14.0),
    "vllm-flush": B.with_(seed=2, bursts=(), flush_at=10.0),
    "vllm-nocache": B.with_(seed=3, prefix_caching=False, lam=0.0086, bursts=("+16@15+5",)),
    "vllm-offload": B.with_(seed=4, cpu_offload_tokens=900_000),
    "vllm-block128": B.with_(seed=5, block_size=128),
    "sglang-burst": B.with_(seed=1, engine="sglang", bursts=("1.5@15+5",)),
    "sglang-lpm-flush": B.with_(seed=2, engine="sglang", sglang_policy="lpm", bursts=(), flush_at=10.0),
    "trace-32b": SimConfig(trace="bundled", profile="qwen3-32b-mi300x", lam=0.025, minutes=30, seed=1,
                           bursts=("1.0@10+4",)),
    "mix-shift": SimConfig(preset="paper-shift", lam=0.075, minutes=45, seed=1),
    "retries": B.with_(seed=6, client_timeout_s=60.0, client_retries=2),
    "retries-budgeter": B.with_(seed=6, client_timeout_s=30.0, client_retries=3, control="budgeter",
                                kv_pool=250_000),
    "rate-change": B.with_(seed=7, rate_at=("20:0.01",)),
}
for _arm in ("budgeter", "cap", "adaptive-cap", "aimd", "admission-cap", "thunder", "budgeter:low=0.65:high=0.85"):
    _name, _, _opts = _arm.partition(":")
    CONFIGS[f"control-{_arm.replace(':', '_')}"] = B.with_(seed=8, control=_name, control_at=20.0,
                                                            control_opt=_opts.replace(":", ","))


def summarize(cfg: SimConfig) -> dict:
    from kvgate.sim.runner import simulate

    res = simulate(cfg)
    s = dict(res.meta["summary"])
    s.pop("wall_s", None)
    extra = {k: res.meta[k] for k in ("engine_steps", "parks", "client_timeouts", "client_retries",
                                      "sessions_abandoned") if k in res.meta}
    return {"summary": s, "meta": extra}


def record() -> None:
    out = {name: {"config": asdict(cfg), **summarize(cfg)} for name, cfg in CONFIGS.items()}
    GOLDEN.parent.mkdir(parents=True, exist_ok=True)
    GOLDEN.write_text(json.dumps(out, indent=1, sort_keys=True) + "\n")
    print(f"{len(out)} summaries written to {GOLDEN}")


def _golden() -> dict:
    if not GOLDEN.exists():
        script = f"tests/sim/{Path(__file__).name}"
        pytest.fail(f"{GOLDEN} is missing: record it with PYTHONPATH=tests python3 {script} --record")
    return json.loads(GOLDEN.read_text())


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_summary_matches_the_committed_one(name: str) -> None:
    golden = _golden()
    assert name in golden, f"{name} has no committed summary: re-record"
    cfg = CONFIGS[name]
    stored = golden[name]["config"]
    # the stored config (as run.json stores it, recorded before fields were added) loads back to this config
    assert set(stored) <= set(json.loads(json.dumps(asdict(cfg)))), "a stored field is gone: re-record"
    check_summary(GOLDEN, name, cfg, summarize(cfg))


if __name__ == "__main__":
    main(record, __doc__)
