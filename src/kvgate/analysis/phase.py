"""The phase map: arrival rate x trigger size (x pool) -> fraction of seeds persistently degraded.

The paper (§4) brackets where the degraded regime can exist with two first-order conditions and leaves the
boundary between them open:

* **drain bound** ``λ < 1/S``: with every turn missing, a session costs S = Σ_k c(L_k) engine-seconds; below
  1/S the degraded regime drains by itself, so no trigger leaves a run persistently degraded;
* **healthy-side bound** ``λ T (Z + R0) L̄ ≲ C`` *and the cache-warm engine keeps up*: the cache-warm
  population fits the pool (threshold λ_h = C / E[Σ_k (Z_k + R0) L_k]) and λ stays below the warm capacity
  (turns/s of a saturated engine kept warm, per session); above either the healthy regime cannot hold.

Between them the outcome depends on history. ``kvgate phase-map`` measures it: a grid of runs (λ x burst size
x seed, and pool as a third axis), every run of a seed sharing its base arrivals (a burst only adds sessions, as
in the paired design) and judged on the same 5-minute windows, aligned to the end of the burst. The bounds are
measured on kvgate itself, never taken from the paper: c(L) by the paper's regression on cache-disabled runs
(``analysis.drain.fit_cold_cost``, seeds apart from the grid's), R0 as the mean turn response time of the
no-burst runs at the lowest rate.

The page states three expectations that follow from the theory and reports whether kvgate meets each; any of
them can fail: (1) below 1/S no cell is mostly degraded; (2) inside the band, a trigger raises the degraded
fraction over the same seeds without it; (3) the no-burst fraction rises with λ.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from kvgate.analysis.stats import sign_test_p as sign_test
from kvgate.errors import UsageError

NOCACHE_SEEDS = tuple(range(9001, 9005))
"""Seeds of the cache-disabled runs that fit c(L) (apart from any grid seed)."""
WARM_SEEDS = (9101, 9102)
"""Seeds of the saturated runs that measure the cache-warm capacity."""
NOCACHE_LAM = 0.0086
"""Load of the c(L) runs: the paper's no-cache control (about 80% of the cache-less engine's capacity)."""


@dataclass(frozen=True, kw_only=True)
class ServerChoice:
    """The simulated server a grid of runs uses: the workload preset, the engine's cost profile and the engine."""

    preset: str = "paper-8b"
    profile: str = "qwen3-8b-mi300x"
    engine: str = "vllm"


@dataclass(frozen=True)
class PhaseSpec(ServerChoice):
    lams: tuple[float, ...]
    bursts: tuple[float, ...]
    """Burst sizes as multiples of λ (an extra Poisson stream at b·λ); 0 is the no-burst arm."""
    pools: tuple[int | None, ...] = (None,)
    seeds: tuple[int, ...] = tuple(range(1, 13))
    burst_at: float = 15.0
    burst_min: float = 5.0
    minutes: float = 60.0
    overrides: tuple[tuple[str, Any], ...] = ()
    """Base-config fields set on every run of the grid (``SimConfig`` name, value), e.g. an engine alternative."""

    def __post_init__(self) -> None:
        if not self.lams or not self.bursts or not self.seeds:
            raise UsageError("phase-map needs at least one λ, one burst size and one seed")
        if min(self.lams) <= 0 or min(self.bursts) < 0:
            raise UsageError("phase-map: λ must be positive and burst sizes non-negative")
        if self.burst_at + self.burst_min + 10 > self.minutes:
            raise UsageError("phase-map: runs must last at least 10 minutes after the burst")


def compute_bounds(
    spec: PhaseSpec, pool: int | None, nocache: Sequence[Any], healthy: Sequence[Any], warm_tput: Sequence[float]
) -> dict[str, Any]:
    """1/S from c(L) fitted on the cache-disabled runs; λ_h from R0 of the healthy no-burst runs; the cache-warm
    capacity from the turn throughput of saturated runs held warm by the budgeter (the paper's estimate of it)."""
    from kvgate.analysis.drain import cold_work_per_session, fit_cold_cost
    from kvgate.engine.costmodel import profile
    from kvgate.workload.shapes import preset

    wl = preset(spec.preset)
    cost = fit_cold_cost(nocache)
    s_cold = cold_work_per_session(cost, wl)
    lat = []
    for r in healthy:
        if r.summary.get("persistently_degraded"):
            continue
        ok = r.turns["status"] == "ok"
        lat.extend((r.turns["end_s"][ok] - r.turns["sent_s"][ok]).tolist())
    r0 = float(np.mean(lat)) if lat else math.nan
    c = pool or profile(spec.profile).kv_pool
    # E over sessions of sum_k (Z_k + R0) L_k; a preset's think time is its phase's mean (shapes are identical)
    per_session = []
    for ph in wl.phases:
        p = ph.shape.prompt_tokens()
        per_session.append(sum((ph.think_mean_s + r0) * x for x in p[:-1]) + r0 * p[-1])
    occ = float(np.mean(per_session)) if per_session else math.nan
    lbar = wl.mean_turn_context()
    turns = float(np.mean([ph.shape.turns for ph in wl.phases]))
    warm_lam = float(np.mean(warm_tput)) / turns if warm_tput else math.nan
    return {
        "c_L": f"{cost.intercept_s:+.2f} s + {cost.slope_ms_per_token:.4f} ms x L",
        "S_s": round(s_cold, 1),
        "drain_lam": round(1.0 / s_cold, 5),
        "R0_s": round(r0, 2) if math.isfinite(r0) else None,
        "healthy_lam": round(c / occ, 5) if math.isfinite(occ) and occ > 0 else None,
        "warm_lam": round(warm_lam, 5) if math.isfinite(warm_lam) else None,
        "N_star": round(c / lbar, 1),
        "pool": c,
    }


def fraction(v: list[bool]) -> float:
    return sum(v) / len(v) if v else math.nan


def expectations(spec: PhaseSpec, cells: dict[tuple[Any, float, float], list[bool]],
                 bounds: dict[Any, dict[str, Any]]) -> list[dict[str, Any]]:
    """The three expectations of the module docstring, per pool, each with whether kvgate meets it."""
    out = []
    for pool in spec.pools:
        b = bounds[pool]
        lo, hi = b["drain_lam"], min(b["healthy_lam"] or math.inf, b["warm_lam"] or math.inf)
        below = [(lam, bu, fraction(v)) for (p, lam, bu), v in cells.items() if p == pool and lam < lo]
        bad = [x for x in below if x[2] > 0.5]
        out.append(
            {
                "pool": pool,
                "claim": "below the drain bound 1/S no cell is mostly degraded",
                "met": not bad if below else None,
                "detail": f"{len(below)} cells below 1/S" + (f", {len(bad)} mostly degraded" if bad else ""),
            }
        )
        gains, total = 0, 0
        for lam in spec.lams:
            if not lo <= lam <= hi:
                continue
            f0 = fraction(cells.get((pool, lam, 0.0), []))
            for bu in spec.bursts:
                if bu <= 0 or math.isnan(f0):
                    continue
                total += 1
                if fraction(cells.get((pool, lam, bu), [])) > f0:
                    gains += 1
        out.append(
            {
                "pool": pool,
                "claim": "inside the band a burst raises the degraded fraction over its twins",
                "met": (gains >= 0.5 * total) if total else None,
                "detail": f"{gains} of {total} (λ, burst) cells above their no-burst fraction",
            }
        )
        f0s = [fraction(cells.get((pool, lam, 0.0), [])) for lam in sorted(spec.lams)]
        f0s = [f for f in f0s if not math.isnan(f)]
        steps = zip(f0s, f0s[1:], strict=False)
        rising = len(f0s) >= 2 and f0s[-1] > f0s[0] and all(b2 >= b1 - 0.25 for b1, b2 in steps)
        out.append(
            {
                "pool": pool,
                "claim": "without a trigger the degraded fraction rises with λ",
                "met": rising if len(f0s) >= 2 else None,
                "detail": " → ".join(f"{f:.2f}" for f in f0s),
            }
        )
    return out


def cell_table(spec: PhaseSpec, cells: dict[tuple[Any, float, float], list[bool]]) -> str:
    lines = []
    for pool in spec.pools:
        lines.append(f"pool {pool or 'default'}: fraction of {len(spec.seeds)} seeds persistently degraded")
        lines.append("burst×λ \\ λ " + " ".join(f"{lam:>6g}" for lam in spec.lams))
        for bu in spec.bursts:
            row = [f"{fraction(cells.get((pool, lam, bu), [])):>6.2f}" for lam in spec.lams]
            lines.append(f"{bu:>11g} " + " ".join(row))
        lines.append("")
    return "\n".join(lines)


def format_text(spec: PhaseSpec, cells: dict[tuple[Any, float, float], list[bool]],
                bounds: dict[Any, dict[str, Any]], checks: list[dict[str, Any]]) -> str:
    out = [cell_table(spec, cells)]
    for pool, b in bounds.items():
        out.append(f"pool {pool or 'default'}: c(L) = {b['c_L']}, S = {b['S_s']} s, drain bound 1/S = "
                   f"{b['drain_lam']}; R0 = {b['R0_s']} s, healthy-side bound λ_h = {b['healthy_lam']}, warm capacity "
                   f"{b['warm_lam']} sessions/s; "
                   f"N* = {b['N_star']}")
    for c in checks:
        mark = "n/a" if c["met"] is None else "met" if c["met"] else "NOT met"
        out.append(f"[{mark}] {c['claim']} ({c['detail']})")
    return "\n".join(out)


def page(spec: PhaseSpec, table: str, bounds: dict[Any, dict[str, Any]], checks: list[dict[str, Any]],
         fig: str) -> str:
    lines = [
        "# Phase map: where a trigger leaves the server degraded", "",
        f"Setup: preset {spec.preset}, profile {spec.profile}, engine {spec.engine}; λ ∈ "
        f"{{{', '.join(f'{x:g}' for x in spec.lams)}}}; a burst of b·λ for {spec.burst_min:g} min from minute "
        f"{spec.burst_at:g}, b ∈ {{{', '.join(f'{x:g}' for x in spec.bursts)}}}; {len(spec.seeds)} seeds "
        f"({spec.seeds[0]}–{spec.seeds[-1]}), every arm of a seed sharing its base arrivals; {spec.minutes:g}-minute "
        "runs judged on 5-minute windows from the end of the burst.", "",
        f"Made by `{command(spec)}`.", "",
        "The bounds are measured on kvgate: c(L) by the paper's regression on cache-disabled runs (seeds "
        f"{NOCACHE_SEEDS[0]}–{NOCACHE_SEEDS[-1]}, λ = {NOCACHE_LAM}), R0 from the no-burst runs at the lowest λ.", "",
        "| pool | c(L) | S (s) | drain bound 1/S | R0 (s) | healthy-side bound λ_h | warm capacity | N* = C/L̄ |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for b in bounds.values():
        lines.append(f"| {b['pool']} | {b['c_L']} | {b['S_s']} | {b['drain_lam']} | {b['R0_s']} | "
                     f"{b['healthy_lam']} | {b['warm_lam']} | {b['N_star']} |")
    lines += ["", "| expectation | pool | kvgate | met |", "|---|---|---|---|"]
    for c in checks:
        mark = "n/a" if c["met"] is None else "yes" if c["met"] else "**no**"
        lines.append(f"| {c['claim']} | {c['pool'] or 'default'} | {c['detail']} | {mark} |")
    lines += ["", "```", table.rstrip(), "```", "", f"![phase map]({fig})", ""]
    return "\n".join(lines)


def command(spec: PhaseSpec) -> str:
    """The ``kvgate phase-map`` command line that reproduces ``spec``."""
    parts = ["kvgate phase-map", f"--lam {','.join(f'{x:g}' for x in spec.lams)}",
             f"--burst {','.join(f'{x:g}' for x in spec.bursts)}", f"--seeds {','.join(str(x) for x in spec.seeds)}",
             f"--minutes {spec.minutes:g}", f"--burst-at {spec.burst_at:g}",
             f"--burst-min {spec.burst_min:g}"]
    if spec.pools != (None,):
        parts.append(f"--pool {','.join(str(p) for p in spec.pools)}")
    for k, d in (("preset", "paper-8b"), ("profile", "qwen3-8b-mi300x"), ("engine", "vllm")):
        if getattr(spec, k) != d:
            parts.append(f"--{k} {getattr(spec, k)}")
    return " ".join(parts)


def write_parquet(path: Path, spec: PhaseSpec, cells: dict[tuple[Any, float, float], list[bool]]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    keys = sorted(cells, key=lambda k: (k[0] or 0, k[1], k[2]))
    pq.write_table(pa.table({
        "pool": pa.array([k[0] for k in keys], type=pa.int64()),
        "lam": [k[1] for k in keys],
        "burst": [k[2] for k in keys],
        "seeds": [len(cells[k]) for k in keys],
        "degraded": [sum(cells[k]) for k in keys],
        "fraction": [fraction(cells[k]) for k in keys],
    }), path)


def figure(spec: PhaseSpec, cells: dict[tuple[Any, float, float], list[bool]], bounds: dict[Any, dict[str, Any]],
           out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(spec.pools)
    fig, axes = plt.subplots(1, n, figsize=(5.2 * n + 1, 4.8), squeeze=False)
    fig.subplots_adjust(bottom=0.26, top=0.86)
    lams, bursts = list(spec.lams), list(spec.bursts)
    im = None
    xe, ye = _edges(lams), _edges(bursts)
    for ax, pool in zip(axes[0], spec.pools, strict=True):
        grid = np.array([[fraction(cells.get((pool, lam, bu), [])) for lam in lams] for bu in bursts])
        im = ax.pcolormesh(xe, ye, grid, vmin=0, vmax=1, cmap="magma_r", shading="flat")
        for (i, j), f in np.ndenumerate(grid):
            if not math.isnan(f):
                ax.text(lams[j], bursts[i], f"{f:.2f}", ha="center", va="center", fontsize=7,
                        color="white" if f > 0.55 else "black")
        b = bounds[pool]
        lo, hi = min(xe[0], b["drain_lam"] * 0.9), xe[-1]
        marks = (
            (b["drain_lam"], "1/S (drain bound)", "--"),
            (b["healthy_lam"], "λ_h (pool fits)", ":"),
            (b["warm_lam"], "warm capacity", "-."),
        )
        for x, label, style in marks:
            if x is None:
                continue
            shown = x <= hi
            ax.axvline(min(x, hi), color="tab:blue", linestyle=style, linewidth=1.6,
                       label=f"{label} = {x:.4f}" + ("" if shown else " (off the map)"))
        ax.set_xlim(lo, hi)
        ax.set_xlabel("base arrival rate λ (sessions/s)")
        ax.set_ylabel(f"burst size (× λ, {spec.burst_min:g} min)")
        ax.set_title(f"pool {b['pool']:,} tokens")
        ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.16), ncol=2, fontsize=7, frameon=False)
    fig.colorbar(im, ax=axes[0].tolist(), label="fraction persistently degraded")
    fig.suptitle(f"Phase map ({spec.preset}, {spec.engine}, {len(spec.seeds)} seeds per cell)")
    path = out.with_suffix(".png")
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def _edges(v: Sequence[float]) -> np.ndarray:
    """Cell edges around sorted centres (midpoints inside, half a step outside)."""
    c = np.asarray(v, dtype=float)
    if len(c) == 1:
        return np.array([c[0] - 0.5 * max(abs(c[0]), 1e-3), c[0] + 0.5 * max(abs(c[0]), 1e-3)])
    mid = (c[1:] + c[:-1]) / 2
    return np.concatenate([[c[0] - (mid[0] - c[0])], mid, [c[-1] + (c[-1] - mid[-1])]])


# -- engine-side alternatives against the phase map ------------------------------------------------------------
ALTERNATIVES: dict[str, dict[str, Any]] = {
    "vanilla": {},
    "session-aware eviction": {"evict_sessions": True},
    "TTL pinning (30 s)": {"pin_ttl_s": 30.0},
    "prefix-first admission": {"prefix_first": 64},
    "retention by context": {"retention": True},
}
"""The simulated vLLM as released (vanilla) and each engine-side alternative (``kvgate.engine.vllm``)."""
ALT_LAMS = (0.030, 0.035, 0.040)
ALT_BURSTS = (0.0, 1.5, 3.0)
PAPER_LAM = 0.035
PAPER_BURST = 1.5
"""The paper's 8B setup: λ = 0.035, a +1.5λ burst from minute 15 for 5 minutes (the paired design)."""


def alternatives_verdicts(
    deg: dict[tuple[str, str, float, float, int], bool], seeds: tuple[int, ...]
) -> tuple[list[float], list[float], list[dict[str, Any]]]:
    """The λ and burst axes of the slice and, for every alternative but vanilla, whether it moves the threshold
    (sign test over the seed-cells it turns healthy or degraded against vanilla) and whether the budgeter still
    matters in the paper's burst arm with it on. ``deg``: persistently degraded by (alternative, control, λ,
    burst, seed)."""
    lams = sorted({k[2] for k in deg if k[1] == "none"})
    bursts = sorted({k[3] for k in deg if k[1] == "none"})
    verdicts = []
    for name in ALTERNATIVES:
        if name == "vanilla":
            continue
        better = worse = 0
        for lam in lams:
            for b in bursts:
                for seed in seeds:
                    v, a = deg[("vanilla", "none", lam, b, seed)], deg[(name, "none", lam, b, seed)]
                    better += v and not a
                    worse += a and not v
        p = sign_test(better, worse)
        moves = p < 0.05
        direction = "raises" if better > worse else "lowers"
        frac = {
            (lam, b): (fraction([deg[("vanilla", "none", lam, b, s)] for s in seeds]),
                       fraction([deg[(name, "none", lam, b, s)] for s in seeds]))
            for lam in lams for b in bursts
        }
        none = [deg[(name, "none", PAPER_LAM, PAPER_BURST, s)] for s in seeds]
        bud = [deg[(name, "budgeter", PAPER_LAM, PAPER_BURST, s)] for s in seeds]
        b_better = sum(n and not g for n, g in zip(none, bud, strict=True))
        b_worse = sum(g and not n for n, g in zip(none, bud, strict=True))
        bp = sign_test(b_better, b_worse)
        verdicts.append({
            "alternative": name, "better_pairs": better, "worse_pairs": worse, "p": p,
            "moves_threshold": moves, "direction": direction if moves else "none", "fractions": frac,
            "burst_none": fraction(none), "burst_budgeter": fraction(bud), "budgeter_p": bp,
            "budgeter_matters": b_better > b_worse and bp < 0.05,
        })
    return lams, bursts, verdicts


def alternatives_figure(deg: dict[tuple[str, str, float, float, int], bool], lams: list[float], bursts: list[float],
                seeds: tuple[int, ...], out: Path) -> Path:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(bursts), figsize=(4.6 * len(bursts), 3.8), squeeze=False, sharey=True)
    for ax, b in zip(axes[0], bursts, strict=True):
        for i, name in enumerate(ALTERNATIVES):
            ys = [fraction([deg[(name, "none", lam, b, s)] for s in seeds]) for lam in lams]
            ax.plot(lams, ys, marker="o", linewidth=2.4 if name == "vanilla" else 1.3,
                    color="black" if name == "vanilla" else f"C{i}", label=name, alpha=0.85)
        ax.set_title("no burst" if b == 0 else f"+{b:g}λ burst for 5 min")
        ax.set_xlabel("base arrival rate λ (sessions/s)")
        ax.set_ylim(-0.05, 1.05)
    axes[0][0].set_ylabel("fraction of seeds persistently degraded")
    axes[0][-1].legend(fontsize=7, loc="upper left")
    fig.suptitle(f"Engine-side alternatives on the phase map (paper-8b, {len(seeds)} seeds per point, same seeds)")
    fig.tight_layout()
    path = out.with_suffix(".png")
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def alternatives_page(verdicts: list[dict[str, Any]], lams: list[float], bursts: list[float], seeds: tuple[int, ...],
              quick: bool, n_runs: int, van_none: list[bool], van_bud: list[bool], fig: str) -> str:
    head = "| alternative | " + " | ".join(f"λ={lam:g} b={b:g}" for lam in lams for b in bursts) + " |"
    rows = [head, "|---" * (1 + len(lams) * len(bursts)) + "|"]
    for v in verdicts:
        cells = " | ".join(f"{v['fractions'][(lam, b)][0]:.2f} → {v['fractions'][(lam, b)][1]:.2f}"
                           for lam in lams for b in bursts)
        rows.append(f"| {v['alternative']} | {cells} |")
    verdict_rows = [
        "| alternative | seed-cells better / worse than vanilla | sign-test p | moves the threshold? "
        "| burst arm: none → budgeter | budgeter still matters? |",
        "|---|---|---|---|---|---|",
    ]
    for v in verdicts:
        mv = f"**yes, {v['direction']} it**" if v["moves_threshold"] else "no"
        bm = "**yes**" if v["budgeter_matters"] else "no"
        verdict_rows.append(
            f"| {v['alternative']} | {v['better_pairs']} / {v['worse_pairs']} | {v['p']:.3g} | {mv} "
            f"| {v['burst_none']:.2f} → {v['burst_budgeter']:.2f} (p {v['budgeter_p']:.3g}) | {bm} |"
        )
    vn, vb = fraction(van_none), fraction(van_bud)
    q = " --quick" if quick else ""
    quick_note = " (--quick: 4 seeds, too few for any sign test to reach p < 0.05)" if quick else ""
    return f"""# Engine-side alternatives: do they move the collapse threshold, and does the budgeter still matter?

The paper did not compare engine-side changes. kvgate's simulated vLLM has four, each off by default (the
default is held to vLLM 0.32's own pool and scheduler by oracle tests): session-aware eviction (cached blocks of
parked and ended sessions are evicted before those of admitted ones), TTL pinning (a finished turn's blocks stay
pinned for 30 s, the tool call, and the next turn takes them over), prefix-first admission (the first 64 waiting
requests are admitted in order of cached fraction), and retention by context (longer contexts' blocks are evicted
last). See `kvgate.engine.vllm` and `kvgate.engine.cache`.

**Setup.** paper-8b workload, qwen3-8b-mi300x profile, 60-minute runs, a burst of b·λ extra sessions/s from
minute 15 for 5 minutes, persistent degradation judged on the 5-minute windows after the burst (as the phase map,
`kvgate.analysis.phase`). Each alternative runs the same {len(seeds)} seeds as vanilla vLLM on the slice
λ ∈ {{{", ".join(f"{x:g}" for x in lams)}}} × b ∈ {{{", ".join(f"{x:g}" for x in bursts)}}} without a gateway,
and the paper's burst arm (λ = {PAPER_LAM}, +{PAPER_BURST}λ) with the budgeter. {n_runs} runs{quick_note}.
Reproduce: `kvgate engine-alternatives{q}`.

**Verdicts.** An alternative *moves the threshold* when, over every (λ, b, seed) of the slice, the runs it turns
healthy and the runs it turns degraded (against vanilla, same seed) differ by an exact two-sided sign test at
p < 0.05; the direction says whether it raises the threshold (fewer degraded runs) or lowers it. *The budgeter
still matters* when, in the paper's burst arm with the alternative on, the budgeter turns significantly more
seeds healthy than degraded (sign test, p < 0.05). Vanilla's burst arm: {vn:.2f} degraded without the budgeter,
{vb:.2f} with it.

{chr(10).join(verdict_rows)}

## Fraction of seeds persistently degraded, vanilla → alternative

{chr(10).join(rows)}

![degraded fraction against λ per burst size, each alternative beside vanilla]({fig})

**Limits.** The alternatives are idealised: the engine knows each session's gateway status exactly and pins
cost nothing but blocks. TTL pinning's 30 s and prefix-first's window of 64 are one choice each, not tuned.
With {len(seeds)} seeds per cell a sign test needs several discordant seed-cells to reach p < 0.05, so a small
shift reads "no".
"""
