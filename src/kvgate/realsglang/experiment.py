"""``kvgate experiment real-sglang``: the paper's phenomenon on a real SGLang (its CPU engine), beside the simulator.

The real-vLLM experiment's paired design (:mod:`kvgate.realvllm.experiment`: the same arms, drive, gateway,
analysis, claims and page body), on SGLang 0.5.23 serving the same tiny model
(``python -m sglang.launch_server``, CPU engine, torch-native attention, one OpenMP thread, page size 1): per
seed, four arms on identical base arrivals, each on a fresh server — ``twin``, ``burst``, ``budgeter`` (from the
start) and ``budgeter-late`` (switched on after the collapse). Beside every arm, kvgate's simulated SGLang
(``--engine sglang``, whose radix cache is held to SGLang's own) with the profile ``kvgate calibrate --endpoint``
fitted against this server (``tiny-llama-cpu-sglang0523``).

The design is the real-vLLM one where SGLang allows it: the same sessions, pool and arm lengths; SGLang's prefill
chunk (``--chunked-prefill-size``) and batch limit (``--max-running-requests``) set to vLLM's CPU step budget and
sequence limit. The arrival rate and burst were chosen with the simulator and the calibrated profile before the
real runs (:data:`FULL`'s docstring), never fitted to them.
"""

from __future__ import annotations

import json
from dataclasses import replace
from importlib import resources
from pathlib import Path
from typing import Any

from kvgate.page import Block, Code, Page, Para, Pre, Strong, Table
from kvgate.realvllm import experiment as shared
from kvgate.realvllm.experiment import Design, Progress

PROFILE = "tiny-llama-cpu-sglang0523"
ENGINE = "sglang"

FULL = replace(shared.FULL)
"""Three seeds, four arms of 5 minutes: about 70 minutes with a server start-up (~40-70 s) per arm."""
QUICK = replace(shared.QUICK)
"""For CI: one seed, the twin and the burst arm, 2 minutes each."""


def sglang_server(d: Design, out: Path) -> Any:
    """A fresh real SGLang for one arm (a context manager), logging to ``out/sglang.log``."""
    from kvgate.realsglang.server import RealSglang, SglangServerConfig

    return RealSglang(SglangServerConfig(
        kv_pool=d.kv_pool, context_length=d.max_model_len, log_path=out / "sglang.log",
        extra_args=("--chunked-prefill-size", str(d.max_num_batched_tokens),
                    "--max-running-requests", str(d.max_num_seqs)),
    ))


def intro(res: dict[str, Any]) -> Page:
    """The real-SGLang page's title and opening (:func:`kvgate.realvllm.page.write_page` adds the rest)."""
    from kvgate.realvllm.page import regimes_text

    d = res["design"]
    quick = " --quick" if res.get("quick") else ""
    return Page("The paper's phenomenon on a real SGLang (CPU engine)" + (" — quick version" if quick else ""), [
        Para((Code(f"kvgate experiment real-sglang{quick}"), " (", Code("src/kvgate/realsglang/experiment.py"),
              "). The tiny random-weight Llama of the real-vLLM page (2 layers, hidden 256, vocabulary 32,000, bf16, "
              "built locally) served by SGLang 0.5.23 (", Code("python -m sglang.launch_server"), ", ",
              Code("SGLANG_USE_CPU_ENGINE=1 --device cpu --attention-backend torch_native --enable-cache-report "
                   "--enable-metrics --skip-server-warmup --sleep-on-idle"), ", one OpenMP thread), page size 1, "
              "prefill chunk "
              f"{d['max_num_batched_tokens']} tokens, at most {d['max_num_seqs']} running requests, a KV pool (",
              Code("--max-total-tokens"), f") of {d['kv_pool']:,} tokens. A fresh server (fresh cache) for every "
              "arm; sessions driven by ", Code("kvgate drive"), " in real time. SGLang's CPU kernels (",
              Code("sgl-kernel"), ") have no CPU build on PyPI: the model math is SGLang's plain-torch path (a few "
              "helpers are kvgate's labelled stand-in, ", Code("src/kvgate/realsglang/standin"), "), so its speed is "
              "not a Xeon deployment's; the radix cache, scheduler, retraction and API are SGLang's own code.")),
        Para((Strong("Workload."), " As on the real-vLLM page: sessions of "
              f"{d['shared']:,} shared + {d['unique']:,} unique tokens, {d['turns']} turns of {d['output']} output "
              f"tokens, {d['append']:,} tokens appended per turn, 5 s mean think time; λ = {d['lam']} sessions/s; "
              f"{d['minutes']:g} minutes per arm; burst ", Code(d["burst"]), ". Arms per seed, identical base "
              "arrivals: ", Strong("twin"), ", ", Strong("burst"), ", ", Strong("budgeter"), " (through ",
              Code("kvgate gateway --control budgeter"), " from the start), ", Strong("budgeter-late"), " (through ",
              Code("kvgate gateway --control none"), ", switched to the budgeter with ", Code("POST /admin/control"),
              f" at minute {d['control_at_min']:g}).")),
        Para((Strong("Prediction."), " Beside every arm, kvgate's simulated SGLang (", Code("--engine sglang"),
              ": its radix cache is SGLang 0.5.23's call for call, ", Code("tests/engine/test_sglang_tree_oracle.py"),
              ") with the profile ", Code(res["profile"]), " that ", Code("kvgate calibrate --endpoint"), " fitted "
              "against this server, the same workload, seed, pool, prefill chunk and control. Where SGLang differs "
              "from vLLM — exact hits of prompt + output − 1 (page size 1, no partial block lost), prefill batches "
              "that never carry decode tokens, retraction instead of preemption (",
              Code("sglang:num_retracted_reqs"), ") — the arms below show it from the real server.")),
        *differences(res),
        *regimes_text(d),
    ])


def differences(res: dict[str, Any]) -> list[Block]:
    """What the real server's own counters say per arm: retraction (SGLang's answer to a full pool while
    decoding, where vLLM preempts) and the radix cache's evictions."""
    rows = [r for r in res["rows"] if r.get("engine_counters")]
    if not rows:
        return []
    table = []
    for r in rows:
        c = r["engine_counters"]
        table.append([str(r["seed"]), r["arm"], f"{c.get('sglang:num_retracted_requests_total', 0):.0f}",
                      f"{c.get('sglang:num_retracted_input_tokens_total', 0):,.0f}",
                      f"{c.get('sglang:evicted_tokens_total', 0):,.0f}"])
    return [Para((Strong("From the real server"), " (its own counters at the end of each arm): retracted requests "
                  "(re-prefilled later with their output so far) and tokens evicted from the radix cache.")),
            Table(["seed", "arm", "retracted requests", "retracted input tokens", "evicted tokens"], table)]


def run(
    out: Path, *, quick: bool = False, profile: str = PROFILE, progress: Progress | None = None,
    seeds: tuple[int, ...] | None = None,
) -> dict[str, Any]:
    """Every arm (resumable: an arm whose ``arm.json`` exists is kept), the simulated arms, the page."""
    from kvgate.realsglang.env import sglang_unavailable
    from kvgate.realvllm.page import write_page

    res = shared.run_design(out, shared.chosen(QUICK, FULL, quick, seeds), profile, sglang_unavailable(),
                            progress or (lambda _m: None), engine=ENGINE, server=sglang_server, name="real-sglang")
    res["quick"] = quick
    res["engine"] = ENGINE
    write_page(res, out, intro(res), engine="real SGLang (CPU)")
    (out / "calibration.md").write_text(calibration_md(profile))
    return res


def calibration_md(profile: str = PROFILE) -> str:
    """The profile's page (its constants, measurements and errors), and how to measure it again."""
    from kvgate.engine.costmodel import bundled_profiles
    from kvgate.realvllm.page import calibration_page

    if profile not in bundled_profiles():
        return f"# Profile `{profile}`\n\nNot a profile measured by kvgate calibrate --endpoint.\n"
    text = resources.files("kvgate").joinpath("data", "profiles", profile + ".json").read_text("utf-8")
    remeasure: list[Block] = [
        Para("To measure it again (one server, nothing else on it):"),
        Pre("kvgate real-sglang serve --kv-pool 147456 --context-length 16384 --port 8000 -- \\\n"
            "    --chunked-prefill-size 2048 --max-running-requests 128\n"
            f"kvgate calibrate --endpoint http://127.0.0.1:8000 --name {profile} --out {profile}.json\n"
            f"kvgate sim --engine sglang --profile {profile}.json --kv-pool 147456 ..."),
        Para(("SGLang tells its prefill chunk (", Code("chunked_prefill_size"), ") and batch limit on ",
              Code("/server_info"), ", so calibration reads them there; it skips vLLM's mixed prefill-and-decode "
              "measurements (SGLang runs prefill batches apart from decode steps, so ", Code("mixed_decode_factor"),
              " is not used) and replays its load in kvgate's simulated SGLang.")),
    ]
    return calibration_page(json.loads(text), profile, "a real SGLang (CPU engine)", remeasure)
