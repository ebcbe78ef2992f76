"""The paper's figures from run records (PNG and SVG)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from kvgate.analysis.metrics import series  # noqa: E402
from kvgate.records import Run  # noqa: E402

COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]


def _end_s(run: Run) -> float:
    return float(run.config.get("minutes", 90.0)) * 60.0


def _save(fig: plt.Figure, out: Path) -> list[Path]:
    out.parent.mkdir(parents=True, exist_ok=True)
    paths = []
    for ext in (".png", ".svg"):
        p = out.with_suffix(ext)
        fig.savefig(p, dpi=130, bbox_inches="tight")
        paths.append(p)
    plt.close(fig)
    return paths


def figure_timeseries(
    runs: Sequence[Run],
    labels: Sequence[str],
    out: Path,
    *,
    title: str = "",
    shade: Sequence[tuple[float, float]] = (),
    vline: float | None = None,
) -> list[Path]:
    """Figure 1 style: hit ratio, turn throughput and sessions in the system per minute, one line per run."""
    fig, axes = plt.subplots(3, 1, figsize=(7.5, 6.5), sharex=True)
    for i, (run, lab) in enumerate(zip(runs, labels, strict=True)):
        s = series(run.turns, run.samples, _end_s(run))
        c = COLORS[i % len(COLORS)]
        axes[0].plot(s["t_min"], s["hit_ratio"], color=c, label=lab, lw=1.4)
        axes[1].plot(s["t_min"], s["turns_per_s"], color=c, lw=1.2)
        axes[2].plot(s["t_min"], s.get("in_system", s["t_min"] * 0), color=c, lw=1.4)
    axes[0].set_ylabel("hit ratio")
    axes[0].set_ylim(0, 1.02)
    axes[1].set_ylabel("turns / s")
    axes[2].set_ylabel("sessions in system")
    axes[2].set_xlabel("time (min)")
    for ax in axes:
        for a, b in shade:
            ax.axvspan(a, b, color="0.85", zorder=0)
        if vline is not None:
            ax.axvline(vline, color="0.4", ls="--", lw=1)
        ax.grid(alpha=0.3)
    axes[0].legend(loc="center right", fontsize=8)
    if title:
        axes[0].set_title(title, fontsize=10)
    return _save(fig, out)


def figure_loop(
    run: Run, out: Path, *, title: str = "", shade: Sequence[tuple[float, float]] = (), twin: Run | None = None
) -> list[Path]:
    """Figure 4: resident demand / pool, recomputed prompt tokens/s and hit ratio, per minute (twin dashed)."""
    fig, axes = plt.subplots(3, 1, figsize=(7.5, 6), sharex=True)
    for r, ls, lab in ((run, "-", "burst"), (twin, "--", "no-burst twin")):
        if r is None:
            continue
        s = series(r.turns, r.samples, _end_s(r))
        axes[0].plot(s["t_min"], s.get("demand_over_pool", s["t_min"] * 0), color=COLORS[1], ls=ls, label=lab)
        axes[1].plot(s["t_min"], s["recomputed_tok_per_s"] / 1000.0, color=COLORS[3], ls=ls)
        axes[2].plot(s["t_min"], s["hit_ratio"], color=COLORS[0], ls=ls)
    axes[0].axhline(1.0, color="0.3", ls=":", lw=1)
    axes[0].set_ylabel("demand / pool")
    axes[0].legend(fontsize=8, loc="upper left")
    axes[1].set_ylabel("recomputed K tok/s")
    axes[2].set_ylabel("hit ratio")
    axes[2].set_ylim(0, 1.02)
    axes[2].set_xlabel("time (min)")
    for ax in axes:
        for a, b in shade:
            ax.axvspan(a, b, color="0.85", zorder=0)
        ax.grid(alpha=0.3)
    if title:
        axes[0].set_title(title, fontsize=10)
    return _save(fig, out)


def figure_sweep(
    xs: Sequence[float],
    ys: Sequence[float],
    out: Path,
    *,
    lo: Sequence[float],
    hi: Sequence[float],
    paper: tuple[float, float, float],
    default_x: float,
    xlabel: str,
    ylabel: str,
    title: str = "",
    ys2: Sequence[float] | None = None,
    label2: str = "",
) -> list[Path]:
    """A fraction against a parameter (log x), with its binomial interval, the paper's value and interval as a band,
    and the default parameter as a vertical line."""
    fig, ax = plt.subplots(figsize=(6.8, 4.2))
    p, plo, phi = paper
    ax.axhspan(plo, phi, color="#f4d7a1", alpha=0.6, zorder=0, label="paper (95% interval)")
    ax.axhline(p, color="#b07000", lw=1.2, label="paper")
    ax.errorbar(
        xs,
        ys,
        yerr=[[y - a for y, a in zip(ys, lo, strict=True)], [b - y for y, b in zip(ys, hi, strict=True)]],
        fmt="o-",
        color=COLORS[1],
        capsize=3,
        label="kvgate (95% interval)",
    )
    if ys2 is not None:
        ax.plot(xs, ys2, "s--", color=COLORS[0], label=label2)
    ax.axvline(default_x, color="0.4", ls="--", lw=1, label=f"default {default_x:g}")
    ax.set_xscale("log")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([f"{x:g}" for x in xs])
    ax.set_ylim(-0.03, 1.03)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="best")
    if title:
        ax.set_title(title, fontsize=10)
    return _save(fig, out)


VERDICT_COLORS = {"reproduced": "#2e8b57", "differs": "#e0a030", "not reproduced": "#c0392b", "calibrated": "#8aa0b8",
                  "": "#eeeeee"}


def figure_verdict_grid(
    rows: Sequence[str], cols: Sequence[str], cells: Sequence[Sequence[str]], out: Path, *, title: str = ""
) -> list[Path]:
    """Verdicts of claims (rows) under parameter variants (columns), one colored cell each."""
    from matplotlib.patches import Patch

    h = max(2.5, 0.16 * len(rows) + 1.2)
    fig, ax = plt.subplots(figsize=(2.2 + 0.9 * len(cols), h))
    for i, row in enumerate(cells):
        for j, v in enumerate(row):
            ax.add_patch(plt.Rectangle((j, len(rows) - 1 - i), 1, 1, color=VERDICT_COLORS.get(v, "#eeeeee"),
                                       ec="white", lw=0.5))
    ax.set_xlim(0, len(cols))
    ax.set_ylim(0, len(rows))
    ax.set_xticks([j + 0.5 for j in range(len(cols))])
    ax.set_xticklabels(cols, rotation=30, ha="right", fontsize=8)
    ax.set_yticks([len(rows) - 1 - i + 0.5 for i in range(len(rows))])
    ax.set_yticklabels(rows, fontsize=6)
    ax.tick_params(length=0)
    ax.legend(handles=[Patch(color=c, label=k) for k, c in VERDICT_COLORS.items() if k], fontsize=7,
              loc="upper left", bbox_to_anchor=(1.01, 1.0))
    if title:
        ax.set_title(title, fontsize=10)
    return _save(fig, out)


def figure_mix_shift(points: Sequence[tuple[str, float, float]], out: Path, *, title: str = "") -> list[Path]:
    """Figure 6: end hit ratio against the phase-1 first-turn gateway wait p90, one point per run."""
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    labels = sorted({p[0] for p in points}, key=lambda s: [p[0] for p in points].index(s))
    for i, lab in enumerate(labels):
        xs = [p[1] for p in points if p[0] == lab]
        ys = [p[2] for p in points if p[0] == lab]
        ax.scatter(xs, ys, label=lab, color=COLORS[i % len(COLORS)], s=36, alpha=0.85)
    ax.set_xlabel("phase-1 first-turn gateway wait, p90 (min)")
    ax.set_ylabel("hit ratio, last 10 min")
    ax.set_ylim(-0.02, 1.02)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8, loc="center right")
    if title:
        ax.set_title(title, fontsize=10)
    return _save(fig, out)


def figure_cohorts(
    curves: Sequence[tuple[str, Sequence[float], Sequence[float]]], out: Path, *, title: str = ""
) -> list[Path]:
    """Figure 8: fraction of each arrival cohort that completed by the end of the run."""
    return _curves(curves, out, "arrival cohort (min)", "completed by the end", title, ylim=(-0.02, 1.02), marker="o")


def figure_drift(
    curves: Sequence[tuple[str, Sequence[float], Sequence[float]]], out: Path, *, title: str = ""
) -> list[Path]:
    """Remaining cold work (engine-seconds) over time after the arrival rate was lowered (§4)."""
    return _curves(curves, out, "time (min)", "remaining cold work (engine-s)", title)


def _curves(
    curves: Sequence[tuple[str, Sequence[float], Sequence[float]]],
    out: Path,
    xlabel: str,
    ylabel: str,
    title: str,
    *,
    ylim: tuple[float, float] | None = None,
    marker: str | None = None,
) -> list[Path]:
    """One labelled line per (label, xs, ys)."""
    fig, ax = plt.subplots(figsize=(6.5, 4.0))
    for i, (lab, xs, ys) in enumerate(curves):
        style = {"marker": marker, "ms": 4} if marker else {}
        ax.plot(xs, ys, color=COLORS[i % len(COLORS)], label=lab, lw=1.4, **style)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    if ylim:
        ax.set_ylim(*ylim)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if title:
        ax.set_title(title, fontsize=10)
    return _save(fig, out)
