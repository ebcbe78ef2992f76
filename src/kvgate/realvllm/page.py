"""The real-vLLM experiment's page (and the real-SGLang one's, :mod:`kvgate.realsglang.experiment`): ``index.md``
and one figure per seed, from ``result.json`` alone, as a :class:`kvgate.page.Page`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from kvgate.page import Block, Bullets, Cell, Code, Em, Heading, Image, Link, Page, Para, Pre, Span, Strong, Table

COLORS = {"twin": "tab:green", "burst": "tab:red", "budgeter": "tab:blue", "budgeter-late": "tab:purple"}


def _f(x: Any, nd: int = 2) -> str:
    return "–" if x is None else (f"{x:.{nd}f}" if isinstance(x, float) else str(x))


def figure(res: dict[str, Any], seed: int, path: Path, engine: str = "real vLLM (CPU)") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    d = res["design"]
    rows = [r for r in res["rows"] if r["seed"] == seed]
    fig, (a1, a2) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    b = d["burst"]
    x_s = float(b.split("@")[1].split("+")[0])
    x_d = float(b.split("+")[1])
    for ax in (a1, a2):
        ax.axvspan(x_s, x_s + x_d, color="0.9", label="burst window (burst arms)" if ax is a1 else None)
        ax.grid(alpha=0.3)
    for r in rows:
        c = COLORS.get(r["arm"], "k")
        t = [x + 0.5 for x in r["real"]["t_min"]]
        a1.plot(t, r["real"]["hit_ratio"], "-o", color=c, label=f"{r['arm']} (real)")
        a1.plot(t, r["sim"]["hit_ratio"], "--", color=c, alpha=0.7, label=f"{r['arm']} (simulated)")
        a2.plot(t, r["real"]["in_system"], "-o", color=c)
        a2.plot(t, r["sim"]["in_system"], "--", color=c, alpha=0.7)
        if r.get("switched_at_min") is not None:
            a1.axvline(r["switched_at_min"], color=c, ls=":", lw=1)
    a1.axhline(0.5, color="0.5", lw=0.8, ls=":")
    a1.set_ylabel("prefix hit ratio (per minute)")
    a1.set_ylim(0, 1)
    a2.set_ylabel("sessions in system")
    a2.set_xlabel("minute")
    a1.legend(fontsize=7, ncol=2, loc="lower left")
    a1.set_title(f"{engine} vs kvgate's simulator, seed {seed}: solid real, dashed simulated")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _verdict_notes(res: dict[str, Any]) -> list[Block]:
    """Where each verdict comes from, computed from the rows (no hand-written outcome)."""
    rows = res["rows"]
    out: list[Span] = []
    late = [r for r in rows if r["arm"] == "budgeter-late"]
    burst = {r["seed"]: r for r in rows if r["arm"] == "burst"}
    if late:
        pre = [burst[r["seed"]].get("hit_minute_before_switch") for r in late if r["seed"] in burst]
        pre = [x for x in pre if x is not None]
        if pre:
            out.append(
                f"Recovery: in the minute before the switch the burst arm (identical until then) had a hit ratio "
                f"of {min(pre):.2f}-{max(pre):.2f}"
                + (" — it was still collapsing, not yet collapsed; with arms this short the switch comes as the "
                   "collapse happens. The arms without the switch stay degraded to the end." if max(pre) >= 0.5
                   else " — below 0.5: the arm had collapsed.")
            )
    steady = [r for r in rows if r["real_regime"] == "healthy" and r["arm"] != "budgeter-late"]
    if steady and late:
        w = max(steady, key=lambda r: r["max_abs_minute_error"] or 0)
        lw = max(late, key=lambda r: r["max_abs_minute_error"] or 0)
        minute = max(range(len(lw["error"])), key=lambda i: abs(lw["error"][i] or 0))
        out.append(
            f"Prediction: on the arms healthy throughout (twin, budgeter) the largest per-minute error is "
            f"{w['max_abs_minute_error']:.3f} (seed {w['seed']} {w['arm']}); on the budgeter-late arms, healthy at "
            f"the end, it is {lw['max_abs_minute_error']:.3f} (seed {lw['seed']}, minute {minute}: the minute of the "
            "collapse and the switch, where the simulator collapses a little faster or deeper than the real server)."
        )
    return [Para(Strong("Reading the verdicts.")), *([Bullets(out)] if out else [])]


def write_page(res: dict[str, Any], out: Path, intro: Page | None = None, engine: str = "real vLLM (CPU)") -> Path:
    """``index.md``, ``result.json`` and the figures; ``intro`` (default :func:`vllm_intro`: the page's title and
    its blocks up to the claims) opens the page."""
    seeds = sorted({r["seed"] for r in res["rows"]})
    for s in seeds:
        figure(res, s, out / "figures" / f"seed{s}.png", engine)
    page = intro if intro is not None else vllm_intro(res)
    page.blocks += _body(res, seeds)
    path = out / "index.md"
    path.write_text(page.markdown())
    (out / "result.json").write_text(json.dumps(res, indent=1, sort_keys=True))
    return path


def vllm_intro(res: dict[str, Any]) -> Page:
    """The real-vLLM page's title and opening: what ran, on what, and how it is judged."""
    d = res["design"]
    quick = " --quick" if res.get("quick") else ""
    return Page("The paper's phenomenon on a real vLLM (CPU build)" + (" — quick version" if quick else ""), [
        Para((Code("kvgate experiment real-vllm" + quick), " (", Code("src/kvgate/realvllm/experiment.py"),
              "). A tiny random-weight Llama (2 layers, hidden 256, vocabulary 32,000, bf16, built locally) served "
              "by vLLM 0.32.0's CPU build (", Code("python -m vllm.entrypoints.openai.api_server"),
              ", one OpenMP thread, ", Code("--enforce-eager"), f"), block size {d['block_size']}, step budget "
              f"{d['max_num_batched_tokens']} tokens (vLLM's CPU default), at most {d['max_num_seqs']} sequences, a "
              f"KV pool of {d['kv_pool']:,} tokens. A fresh server (fresh cache) for every arm; sessions driven by ",
              Code("kvgate drive"), " in real time.")),
        Para((Strong("Workload."), f" Sessions of {d['shared']:,} shared + {d['unique']:,} unique tokens, "
              f"{d['turns']} turns of {d['output']} output tokens, {d['append']:,} tokens appended per turn, 5 s mean "
              f"think time; λ = {d['lam']} sessions/s; {d['minutes']:g} minutes per arm; burst ", Code(d["burst"]),
              " (an extra Poisson stream of X·λ from minute S for D minutes). Arms per seed, identical base "
              "arrivals: ", Strong("twin"), " (no burst), ", Strong("burst"), ", ", Strong("budgeter"),
              " (the burst arm through ", Code("kvgate gateway --control budgeter"), " from the start), ",
              Strong("budgeter-late"), " (through ", Code("kvgate gateway --control none"),
              ", switched to the budgeter with ", Code("POST /admin/control"),
              f" at minute {d['control_at_min']:g}).")),
        Para((Strong("Prediction."), " Beside every arm, kvgate's simulator with the profile ", Code(res["profile"]),
              " that ", Code("kvgate calibrate --endpoint"), " fitted against this server (",
              Code("src/kvgate/data/profiles/"), "), the same workload, seed, pool, block size, step budget and "
              "control (", Link("the profile's measurements", "calibration.md"), ").")),
        Para((Strong("Scale."), " Issue 10 sketched 15-minute arms (burst +2λ for 3 minutes from minute 3). On this "
              "2-core machine, shared with other jobs, twelve arms of that length with a fresh server each take over "
              "three hours; the arms here are shorter, with a larger and earlier burst, chosen with the simulator "
              "and the calibrated profile ", Em("before"), " the real runs (the profile is fitted on "
              "micro-measurements and a c(L) load, never on these runs). A minute of each arm is a point below; the "
              "run after the burst is short, so ", Em("persistently"), " means every judged minute, not the "
              "paper's 5-minute windows.")),
        *regimes_text(d),
    ])


def regimes_text(d: dict[str, Any]) -> list[Block]:
    return [Para((Strong("Regimes"), f" are judged on the minutes from {d['judge_from_min']:g} to the end: ",
                  Em("degraded"), " when every minute's hit ratio is below 0.5, ", Em("healthy"), " when every one "
                  "is at or above 0.7, else ", Em("mixed"), "."))]


def _minutes(res: dict[str, Any], seed: int) -> list[Block]:
    """One seed's arms minute by minute: its figure and a table of hits, errors and sessions."""
    rows = [r for r in res["rows"] if r["seed"] == seed]
    n = max(len(r["real"]["t_min"]) for r in rows)
    table: list[list[Span | Cell]] = []
    for r in rows:
        table += [
            [r["arm"], "real hit", *(_f(x) for x in r["real"]["hit_ratio"])],
            ["", "sim hit", *(_f(x) for x in r["sim"]["hit_ratio"])],
            ["", "error (sim − real)", *(_f(x) for x in r["error"])],
            ["", "real in system", *(_f(x, 1) for x in r["real"]["in_system"])],
            ["", "sim in system", *(_f(x, 1) for x in r["sim"]["in_system"])],
        ]
    return [Heading(f"Seed {seed}", 3), Image(f"figures/seed{seed}.png", f"seed {seed}"),
            Table(["arm", "", *(f"min {i}" for i in range(n))], table)]


NOTES: list[Span] = [
    "The machine is a 2-core VM shared with other jobs; the load average during each arm is in the table above. The "
    "server gets one OpenMP thread, so the engine's speed varies with the machine's load; the profile was measured "
    "under similar load (its file records every measurement and the fit's errors).",
    "On a healthy arm the per-minute hit ratio follows from the sessions' geometry (each turn re-sends its previous "
    "prompt, so a turn that finds its prefix cached hits all of it but the last partial block); the simulator's "
    "small error there is expected, and the claims that test it are the regimes: whether the burst arm collapses, "
    "whether its twin stays healthy, and whether the controls keep or bring it back.",
    ("Records of every arm (", Code("kvgate drive"), "'s Parquet and ", Code("run.json"), ") and every simulated run "
     "are under the experiment's output directory; ", Code("result.json"), " beside this page holds every figure on "
     "it."),
]


def _body(res: dict[str, Any], seeds: list[int]) -> list[Block]:
    """The claims, where their verdicts come from, the arms, and every seed minute by minute."""
    blocks: list[Block] = [
        Heading("Claims"),
        Table(["claim", "measured", "verdict"], [[c["claim"], c["measured"], Strong(c["verdict"])]
                                                 for c in res["claims"]]),
        *_verdict_notes(res), Heading("Arms"),
        Table(["seed", "arm", "real regime (hit)", "simulated regime (hit)", "max per-minute error",
               "sessions finished / arrived", "in system at the end (real / sim)", "load average per minute"],
              [[str(r["seed"]), r["arm"], f"{r['real_regime']} ({_f(r['real_hit_judged'])})",
                f"{r['sim_regime']} ({_f(r['sim_hit_judged'])})", _f(r["max_abs_minute_error"]),
                f"{r['sessions_finished']} / {r['sessions_arrived']}",
                f"{_f(r['in_system_last'], 1)} / {_f(r['sim_in_system_last'], 1)}",
                ", ".join(_f(x, 1) for x in r.get("loadavg_per_min") or [])] for r in res["rows"]]),
        Heading("Minute by minute"),
    ]
    for s in seeds:
        blocks += _minutes(res, s)
    return [*blocks, Heading("Notes"), Bullets(NOTES)]


VLLM_REMEASURE: list[Block] = [
    Para("To measure it again (one server, nothing else on it):"),
    Pre("kvgate real-vllm serve --kv-pool 147456 --max-model-len 16384 --port 8000 -- \\\n"
        "    --max-num-batched-tokens 2048 --max-num-seqs 128\n"
        "kvgate calibrate --endpoint http://127.0.0.1:8000 --max-num-batched-tokens 2048 --max-num-seqs 128 \\\n"
        "    --name tiny-llama-cpu-vllm032 --out tiny-llama-cpu-vllm032.json\n"
        "kvgate sim --profile tiny-llama-cpu-vllm032.json --block-size 128 --kv-pool 147456 ..."),
    Para(("vLLM does not tell its step budget (", Code("max_num_batched_tokens"), ") over HTTP, so it is passed to "
          "both; the profile file records it (", Code("calibration.max_num_batched_tokens"), "). ", Code("kvgate sim"),
          " has no option for the step budget yet (its SimConfig field is 8192 by default); ",
          Code("kvgate experiment real-vllm"), " sets it to 2048.")),
]
"""How the real vLLM's profile is measured again (the calibration page's default)."""


def calibration_page(
    profile_json: dict[str, Any], name: str, server: str = "the real CPU vLLM", remeasure: list[Block] | None = None
) -> str:
    """A page of a profile file written by ``kvgate calibrate --endpoint``: constants, measurements, errors;
    ``remeasure`` (default: the real vLLM's) says how to measure it again."""
    cal = profile_json.get("calibration") or {}
    what = {
        "cold": lambda x: f"cold prefill, {x['prompt']:,} tokens",
        "incremental": lambda x: f"incremental prefill, {x['prompt'] - x['cached']:,} new on {x['cached']:,} cached",
        "decode": lambda x: f"decode step, batch {x['batch']} at {x['prompt']:,} context",
        "mixed": lambda x: f"{x['prompt']:,} cold tokens joining {x['batch']} decoders at {x['output']:,}",
    }
    blocks: list[Block] = [Para(profile_json["note"])] if profile_json.get("note") else []
    blocks += [
        Para(f"Measured {cal.get('measured_at', '?')} against {cal.get('model', '?')} "
             f"(server {cal.get('server_version') or '?'}), block size {cal.get('block_size')}, "
             f"{cal.get('num_gpu_blocks')} blocks (usable pool {profile_json['kv_pool']:,} tokens), step budget "
             f"{cal.get('max_num_batched_tokens')} ({cal.get('max_num_batched_tokens_source')}), {cal.get('wall_s')} "
             "s of measuring. The way to the engine (in the profile): "
             f"{profile_json.get('request_s', 0) * 1000:.1f} ms + "
             f"{profile_json.get('request_per_token_s', 0) * 1e6:.2f} µs per prompt token "
             f"({cal.get('request_time_source', 'a POST /tokenize round trip, beside the profile')})."),
        Table(["constant", "value"], [[Code(k), f"{profile_json[k]:.4g}"] for k in (
            "overhead_s", "weights_s", "per_token_s", "attn_s", "kv_read_s", "per_seq_s", "mixed_decode_factor")]),
        Table(["measurement", "measured (s)", "predicted (s)", "error"],
              [[what[x["kind"]](x), f"{x['measured_s']:.4f}", f"{x['predicted_s']:.4f}", f"{x['error']:+.1%}"]
               for x in cal.get("samples", [])]),
    ]
    ld = cal.get("load", {})
    if ld:
        blocks.append(Para(
            f"c(L) load (unique prompts, all misses, {ld['workers']} closed-loop workers, {ld['turns']} turns): mean "
            f"turn {ld['mean_turn_s_measured']:.3f} s measured, {ld['mean_turn_s_predicted']:.3f} s replayed in the "
            f"simulator with the profile; measured c(L) = {ld['c_intercept_s_measured']:+.3f} s + "
            f"{ld['c_slope_ms_per_token_measured']:.4f} ms × L (replay: "
            f"{ld.get('c_slope_ms_per_token_replay', float('nan')):.4f} ms × L). The mixed steps alone give a "
            f"mixed_decode_factor of {ld.get('mixed_decode_factor_from_mixed_steps', float('nan')):.2f}."))
    blocks += remeasure if remeasure is not None else VLLM_REMEASURE
    blocks.append(Para(
        f"Errors: median {cal.get('median_abs_error', float('nan')):.1%}, largest "
        f"{cal.get('max_abs_error', float('nan')):.1%}. The machine was shared with other jobs while measuring, so a "
        "single measurement can be up to 2x its quiet value; each point is the least of its repetitions and the fit "
        "uses a robust loss."))
    return Page(("Profile ", Code(name), f": kvgate calibrate --endpoint on {server}"), blocks).markdown()
