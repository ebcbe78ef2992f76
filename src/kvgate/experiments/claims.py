"""Every claim of the paper that kvgate checks, once, with the paper's numbers and the rule that judges it.

Ids are ``experiment.claim``. Tolerances are stated here and nowhere else; they are set from the paper's own
ranges (and how its figures are rounded), never from kvgate's results. ``CAUSES`` holds what is known about why
kvgate differs where it does; a cause is printed only beside a verdict other than "reproduced".
"""

from __future__ import annotations

from kvgate.experiments.verdicts import Calibrated, Count, Figure, Holds, Prevents, Rule, TwinEffect

HIT_DEGRADED = (0.0, 0.35)
"""Where a degraded-regime hit ratio still means "near the shared prompt" (qualitative band)."""
HIT_HEALTHY = (0.85, 1.0)
"""Where a healthy-regime hit ratio still means "cache-efficient"."""

_R: list[tuple[str, Rule]] = [
    # -- paired history dependence (§3, Table 2) ------------------------------------------------------------
    ("paired.only_burst", Count("only the burst arm persistently degraded", "9 of 12 pairs", k=9, n=12, band=0.25)),
    ("paired.only_twin", Count("never only the twin", "0 of 12 pairs", k=0, n=12, band=0.15)),
    ("paired.sign_test", Holds("two-sided sign test over discordant pairs rejects 'no effect' at 5%", "p = 0.00391")),
    (
        "paired.degraded_hit",
        Figure(
            "degraded arms end at the shared-prompt hit ratio (last 10 min)",
            "0.10–0.13",
            lo=0.10,
            hi=0.13,
            tol=0.02,
            qual=HIT_DEGRADED,
        ),
    ),
    (
        "paired.degraded_backlog",
        Figure("…with a large backlog (sessions, last 5 min)", "109–175", lo=109, hi=175, rel=0.15, qual=(60, 400)),
    ),
    (
        "paired.healthy_hit",
        Figure(
            "healthy arms stay cache-efficient (last 10 min)", "0.95", lo=0.95, hi=0.95, tol=0.015, qual=HIT_HEALTHY
        ),
    ),
    (
        "paired.healthy_sessions",
        Figure("…with few sessions in the system (last 5 min)", "5–9", lo=5, hi=9, tol=0.5, qual=(2, 18)),
    ),
    (
        "paired.injected_finished",
        Count(
            "degradation outlasts the burst's own sessions: all injected sessions had finished",
            "7 of 11 degraded burst runs",
            k=7,
            n=11,
            band=0.25,
        ),
    ),
    (
        "paired.twins_spontaneous",
        Count("occasionally a twin slides into the degraded regime on its own", "2 of 12 twins", k=2, n=12, band=0.2),
    ),
    (
        "paired.twin_onset",
        Figure("…25 and 30 minutes into the run", "25, 30 min", lo=25, hi=30, tol=5, qual=(10, 90), unit=" min"),
    ),
    (
        "paired.lam04_healthy",
        Count(
            "not overload: at λ = 0.04 without a burst, runs stay healthy for 30 min",
            "10 of 10 healthy (0 degraded)",
            k=0,
            n=10,
            band=0.1,
        ),
    ),
    (
        "paired.cap_prevents",
        Prevents(
            "a session cap that keeps the active population below the pool: the same "
            "bursts never cause persistent degradation",
            "0/10",
        ),
    ),
    (
        "paired.healthy_side_sessions",
        Figure(
            "healthy side at λ = 0.035: sessions in the system (no-burst runs)",
            "≈ 10",
            lo=10,
            hi=10,
            tol=2,
            qual=(5, 18),
        ),
    ),
    (
        "paired.healthy_side_demand",
        Figure(
            "before the burst, resident demand relative to the pool", "≈ 0.6", lo=0.6, hi=0.6, tol=0.1, qual=(0.3, 1.0)
        ),
    ),
    (
        "paired.healthy_side_R",
        Calibrated(
            "healthy side at λ = 0.035: mean turn response time R",
            "≈ 6 s (Little's law on ≈ 10 sessions)",
            sets="a calibration target of mixed_decode_factor",
        ),
    ),
    (
        "paired.twin_peak_demand",
        Figure(
            "the no-burst twin's resident demand peaks below the pool",
            "0.83 of the pool, never crosses it",
            lo=0.83,
            hi=0.83,
            tol=0.1,
            qual=(0.5, 1.0),
        ),
    ),
    (
        "paired.demand_25",
        Figure(
            "the burst pushes resident demand past the pool (minute 25)",
            "1.4× the pool",
            lo=1.4,
            hi=1.4,
            rel=0.2,
            qual=(1.0, 3.0),
        ),
    ),
    (
        "paired.demand_end",
        Figure(
            "demand keeps climbing (last 5 minutes of the 90-min run)",
            "4.8× the pool",
            lo=4.8,
            hi=4.8,
            rel=0.25,
            qual=(2.0, 10.0),
        ),
    ),
    (
        "paired.recomputed_before",
        Figure(
            "recomputed prompt tokens before the burst", "≈ 1.1K tokens/s", lo=1100, hi=1100, rel=0.3, qual=(300, 3000)
        ),
    ),
    (
        "paired.recomputed_degraded",
        Figure(
            "…rise in the degraded regime (last 10 min)",
            "≈ 6.4K tokens/s",
            lo=6400,
            hi=6400,
            rel=0.2,
            qual=(3000, 13000),
        ),
    ),
    # -- anatomy of the degraded regime (§4), on the paired burst runs -------------------------------------------
    (
        "anatomy.half_cached",
        Figure(
            "degraded regime: turns with less than half their prompt cached (last 10 min)",
            "99.6–100%",
            lo=0.996,
            hi=1.0,
            tol=0.004,
            qual=(0.9, 1.0),
        ),
    ),
    (
        "anatomy.running",
        Figure("…the engine is busy, not stalled: requests running", "16–32", lo=16, hi=32, tol=1, qual=(8, 64)),
    ),
    ("anatomy.kv_usage", Figure("…KV usage", "83–100%", lo=0.83, hi=1.0, tol=0.02, qual=(0.6, 1.0))),
    (
        "anatomy.preemptions",
        Figure("…preemptions stay rare (per 90-min run)", "23–37", lo=23, hi=37, rel=0.2, qual=(5, 150)),
    ),
    (
        "anatomy.turns_per_s",
        Figure("…turn throughput (last 10 min)", "0.35–0.46 turns/s", lo=0.35, hi=0.46, tol=0.02, qual=(0.2, 0.7)),
    ),
    (
        "anatomy.like_nocache",
        Figure(
            "…which is the no-cache engine's throughput (degraded / no-cache)",
            "0.35–0.46 vs 0.33–0.43 turns/s",
            lo=0.81,
            hi=1.39,
            tol=0.0,
            qual=(0.6, 1.8),
        ),
    ),
    # -- no-cache control (§3) -----------------------------------------------------------------------------------
    (
        "nocache.peak",
        Figure(
            "with caching off, an absolute burst of ≈ 16 sessions only raises the backlog",
            "rises to 17–43 sessions",
            lo=17,
            hi=43,
            tol=2,
            qual=(8, 80),
        ),
    ),
    (
        "nocache.drains",
        Count(
            "…and it drains: over the last 30 minutes it shrinks in every run (or is already at its pre-burst level)",
            "4 of 4",
            k=4,
            n=4,
        ),
    ),
    (
        "nocache.at_twin",
        Count("…two runs end at their twins' level", "2 of 4 (3 and 1 unfinished)", k=2, n=4, band=0.25),
    ),
    (
        "nocache.prop_unfinished",
        Figure(
            "rate-proportional burst: both arms end with the same small backlog",
            "0–5 unfinished sessions",
            lo=0,
            hi=5,
            tol=1,
            qual=(0, 15),
        ),
    ),
    (
        "nocache.load_fraction",
        Figure(
            "λ = 0.0086 is about 80% of the no-cache engine's capacity",
            "≈ 80%",
            lo=0.8,
            hi=0.8,
            tol=0.08,
            qual=(0.4, 1.0),
        ),
    ),
    (
        "nocache.throughput",
        Figure(
            "no-cache throughput at comparable (saturating) load",
            "0.33–0.43 turns/s",
            lo=0.33,
            hi=0.43,
            tol=0.02,
            qual=(0.2, 0.7),
        ),
    ),
    # -- flush trigger (§3) --------------------------------------------------------------------------------------
    (
        "flush.count",
        Count(
            "a cache flush with preemption, no extra load, can leave a run persistently degraded",
            "1 of 5",
            k=1,
            n=5,
            band=0.2,
        ),
    ),
    ("flush.most_arrivals", Holds("the run that collapsed had the most arrivals while the cache rebuilt", "yes")),
    ("flush.budgeter_count", Count("the budgeter from the start: no flushed run degraded", "0 of 3", k=0, n=3)),
    ("flush.budgeter_prevents", Prevents("…on the seeds the flush collapses without control", "0/3")),
    # -- trigger size (§3, §4) --------------------------------------------------------------------------------
    ("ts.vllm_2x2", Count("a 2× burst for 2 minutes collapses vLLM at λ = 0.04", "4 of 10", k=4, n=10, band=0.2)),
    (
        "ts.larger_more",
        Holds(
            "larger triggers collapse at least as many runs (2×/2 min < 2×/4 min < 2.5×/5 min)",
            "2×/2 min 4/10; +1.5λ/5 min 11/12 (paired)",
        ),
    ),
    (
        "ts.size_not_alone",
        Holds(
            "size alone does not decide: a run with a smaller burst collapses while one with a larger burst does not",
            "11 and 13 injected collapsed, 17 did not",
        ),
    ),
    (
        "ts.larger_pool",
        Holds(
            "a larger KV pool raises the trigger size needed: the same burst collapses fewer runs", "qualitative (§4)"
        ),
    ),
    # -- trace shapes on 32B (§3, Figure 2) -------------------------------------------------------------------
    (
        "t32.count",
        Count(
            "a 2× burst for 4 min at λ = 0.025 degrades some 32B trace-shape runs",
            "1 of 4 persistently + 1 partially",
            k=2,
            n=4,
            band=0.25,
        ),
    ),
    (
        "t32.twin_effect",
        TwinEffect(
            "…against its own no-burst twin (history dependence)",
            "burst arms 1 + 1 partial, no-burst 0 of 4",
            min_only_trigger=1,
        ),
    ),
    (
        "t32.burst_end_hit",
        Figure(
            "…end hit ratio of the degraded burst runs", "0.34 and 0.81", lo=0.34, hi=0.81, tol=0.05, qual=(0.0, 0.9)
        ),
    ),
    (
        "t32.noburst_hit",
        Figure(
            "no-burst runs stay cache-efficient over 40 min", "0.95–0.97", lo=0.95, hi=0.97, tol=0.01, qual=HIT_HEALTHY
        ),
    ),
    (
        "t32.budgeter_prevents",
        Prevents("the budgeter prevents it (on seeds the burst degrades without control)", "0/4"),
    ),
    (
        "t32.long_noburst",
        Figure(
            "a longer no-burst run degrades on its own",
            "after about 55 min",
            lo=55,
            hi=55,
            tol=10,
            qual=(20, 120),
            unit=" min",
        ),
    ),
    ("t32.lam03_count", Count("at λ = 0.03 the 32B server degrades without any trigger", "4 of 4", k=4, n=4)),
    ("t32.lam03_onset", Figure("…after", "25–35 min", lo=25, hi=35, tol=5, qual=(5, 80), unit=" min")),
    ("t32.lam03_burst", Count("…and so do all runs with a 5-minute burst", "4 of 4", k=4, n=4)),
    (
        "t32.degraded_hit",
        Figure(
            "degraded 32B hit ratio (minutes 74–80, λ = 0.03)",
            "0.12–0.17",
            lo=0.12,
            hi=0.17,
            tol=0.02,
            qual=HIT_DEGRADED,
        ),
    ),
    (
        "t32.lam035_onset",
        Figure(
            "at λ = 0.035 it runs healthily for about 15 minutes, then degrades without a burst",
            "≈ 15 min",
            lo=15,
            hi=15,
            tol=5,
            qual=(3, 40),
            unit=" min",
        ),
    ),
    # -- second engine, SGLang (§3, Figure 3) -------------------------------------------------------------------
    ("sg.absorbs_2x2", Count("SGLang absorbs the 2×/2-min burst", "4 of 4 absorbed (0 collapsed)", k=0, n=4)),
    ("sg.vllm_2x2", Count("…that collapses vLLM", "4 of 10", k=4, n=10, band=0.2)),
    (
        "sg.dips",
        Count(
            "…in two SGLang runs the hit ratio dipped, in the other two it barely moved",
            "2 of 4 dipped",
            k=2,
            n=4,
            band=0.25,
        ),
    ),
    ("sg.dip_depth", Figure("…the dips (1-minute windows)", "0.27–0.29", lo=0.27, hi=0.29, tol=0.05, qual=(0.05, 0.6))),
    ("sg.large_collapses", Count("+1.5λ for 5 or 10 minutes collapses SGLang", "6 of 6", k=6, n=6)),
    (
        "sg.large_hit",
        Figure("…at the shared-prompt hit ratio", "0.09–0.11", lo=0.09, hi=0.11, tol=0.02, qual=HIT_DEGRADED),
    ),
    (
        "sg.large_backlog",
        Figure("…with a backlog growing to", "52–112 sessions", lo=52, hi=112, rel=0.15, qual=(25, 250)),
    ),
    ("sg.flush", Count("once a flush went through, SGLang recovered", "3 of 3 (0 degraded)", k=0, n=3)),
    ("sg.paired_burst", Count("paired design on SGLang: every burst arm degraded persistently", "4 of 4", k=4, n=4)),
    ("sg.paired_twin", Count("…every twin stayed healthy", "0 of 4 twins degraded", k=0, n=4)),
    (
        "sg.paired_burst_hit",
        Figure("…burst arms' hit ratio", "0.09–0.11", lo=0.09, hi=0.11, tol=0.02, qual=HIT_DEGRADED),
    ),
    ("sg.paired_twin_hit", Figure("…twins' hit ratio", "0.93–0.95", lo=0.93, hi=0.95, tol=0.015, qual=HIT_HEALTHY)),
    # -- recovery, 8B (§6, Table 3) -----------------------------------------------------------------------------
    ("r8.none", Count("no control: nothing recovers", "0 of 8", k=0, n=8)),
    ("r8.none_hit", Figure("…end hit ratio", "0.12–0.13", lo=0.12, hi=0.13, tol=0.02, qual=HIT_DEGRADED)),
    ("r8.none_cohort", Figure("…cohort done", "0%", lo=0.0, hi=0.0, tol=0.02, qual=(0.0, 0.2))),
    ("r8.adm", Count("admission-only cap recovers few", "2 of 8", k=2, n=8, band=0.2)),
    ("r8.adm_time", Figure("…and late", "21–23 min", lo=21, hi=23, tol=3, qual=(8, 40), unit=" min")),
    ("r8.adm_low", Count("…four stay below a 0.1 hit ratio to the end", "4 of 8", k=4, n=8, band=0.25)),
    ("r8.aimd", Count("latency AIMD + park recovers most", "5 of 7", k=5, n=7, band=0.25)),
    ("r8.aimd_time", Figure("…later", "14–25 min", lo=14, hi=25, tol=3, qual=(5, 40), unit=" min")),
    ("r8.aimd_hit", Figure("…to a lower hit ratio", "0.84–0.89", lo=0.84, hi=0.89, tol=0.03, qual=(0.5, 0.97))),
    ("r8.cap", Count("session cap + park recovers every collapsed run", "7 of 7", k=7, n=7)),
    ("r8.cap_time", Figure("…within", "≤ 6 min", lo=0, hi=6, qual=(0, 15), unit=" min")),
    ("r8.cap_hit", Figure("…end hit ratio", "0.95", lo=0.95, hi=0.95, tol=0.015, qual=HIT_HEALTHY)),
    ("r8.cap_cohort", Figure("…cohort done", "100%", lo=1.0, hi=1.0, tol=0.01, qual=(0.8, 1.0))),
    ("r8.bud", Count("budgeter + park recovers every collapsed run", "7 of 7", k=7, n=7)),
    ("r8.bud_time", Figure("…within the first 5-minute window", "< 5 min", lo=0, hi=4.99, qual=(0, 10), unit=" min")),
    ("r8.bud_hit", Figure("…end hit ratio", "0.93–0.95", lo=0.93, hi=0.95, tol=0.01, qual=HIT_HEALTHY)),
    ("r8.bud_cohort", Figure("…cohort done", "100%", lo=1.0, hi=1.0, tol=0.01, qual=(0.8, 1.0))),
    (
        "r8.matched_test",
        Holds(
            "on seeds collapsed in every arm: budgeter vs admission-only cap, exact paired test",
            "7/7 vs 1/7, p = 0.031",
        ),
    ),
    (
        "r8.matched_states",
        Figure(
            "matched seeds start control from comparable states: sessions in the system",
            "29–48",
            lo=29,
            hi=48,
            rel=0.1,
            qual=(10, 120),
        ),
    ),
    (
        "r8.matched_spread",
        Figure("…each arm within 6% of its seed's mean", "≤ 6%", lo=0.0, hi=0.06, tol=0.0, qual=(0.0, 0.25)),
    ),
    (
        "r8.lat_bud",
        Figure(
            "cohort arrival-to-completion, budgeter (matched seeds): median",
            "11.6 min (p90 16.9)",
            lo=11.6,
            hi=11.6,
            rel=0.3,
            qual=(4, 30),
            unit=" min",
        ),
    ),
    (
        "r8.lat_cap",
        Figure("…session cap: median", "12.3 min (p90 15.6)", lo=12.3, hi=12.3, rel=0.3, qual=(4, 30), unit=" min"),
    ),
    (
        "r8.lat_healthy",
        Figure(
            "…vs never-collapsed uncontrolled runs: median",
            "3.8 min",
            lo=3.8,
            hi=3.8,
            rel=0.3,
            qual=(1, 8),
            unit=" min",
        ),
    ),
    (
        "r8.aimd_unfinished",
        Figure(
            "…AIMD: cohort sessions unfinished at the end",
            "75 of 349 (21%)",
            lo=0.21,
            hi=0.21,
            tol=0.1,
            qual=(0.0, 0.6),
        ),
    ),
    (
        "r8.adm_unfinished",
        Figure("…admission-only cap: unfinished", "317 of 349 (91%)", lo=0.91, hi=0.91, tol=0.08, qual=(0.5, 1.0)),
    ),
    # -- recovery, 32B trace shapes (§6, Figure 7) ---------------------------------------------------------------
    ("r32.bud", Count("λ = 0.03: the budgeter recovers every collapsed 32B run", "3 of 3", k=3, n=3)),
    ("r32.bud_time", Figure("…in", "< 5 min", lo=0, hi=4.99, qual=(0, 10), unit=" min")),
    ("r32.bud_hit", Figure("…hit ratio", "0.92–0.97", lo=0.92, hi=0.97, tol=0.01, qual=HIT_HEALTHY)),
    ("r32.ada", Count("…an EWMA-adaptive cap recovers too", "3 of 3", k=3, n=3)),
    ("r32.ada_time", Figure("…within", "≤ 21 min", lo=0, hi=21, qual=(0, 40), unit=" min")),
    ("r32.cap", Count("…a session cap set from a lighter load never recovers", "0 of 3", k=0, n=3)),
    ("r32.adm", Count("…nor does an admission-only cap", "0 of 3", k=0, n=3)),
    ("r32.adm_hit", Figure("…its end hit ratio", "0.05–0.08", lo=0.05, hi=0.08, tol=0.02, qual=HIT_DEGRADED)),
    (
        "r32.users_bud",
        Figure(
            "what users see: cohort completed by minute 90, budgeter",
            "65–92%",
            lo=0.65,
            hi=0.92,
            tol=0.03,
            qual=(0.3, 1.0),
        ),
    ),
    ("r32.users_ada", Figure("…adaptive cap", "35–95%", lo=0.35, hi=0.95, tol=0.03, qual=(0.1, 1.0))),
    (
        "r32.users_other",
        Figure("…no control, admission-only and fixed cap", "0–3%", lo=0.0, hi=0.03, tol=0.02, qual=(0.0, 0.3)),
    ),
    (
        "r32b.none",
        Count("λ = 0.025, 3× burst: without control every run degrades and stays degraded", "3 of 3", k=3, n=3),
    ),
    ("r32b.none_hit", Figure("…hit ratio", "0.12–0.13", lo=0.12, hi=0.13, tol=0.02, qual=HIT_DEGRADED)),
    (
        "r32b.none_sessions",
        Figure("…sessions in the system (last 5 min)", "142–175", lo=142, hi=175, rel=0.15, qual=(70, 350)),
    ),
    (
        "r32b.bud_hit",
        Figure(
            "…the budgeter restores the hit ratio (last 10 min)",
            "0.92–0.97",
            lo=0.92,
            hi=0.97,
            tol=0.01,
            qual=HIT_HEALTHY,
        ),
    ),
    ("r32b.ada_hit", Figure("…the adaptive cap too", "0.86–0.93", lo=0.86, hi=0.93, tol=0.02, qual=(0.7, 1.0))),
    ("r32b.bud_cohort", Figure("…cohort completion, budgeter", "54–96%", lo=0.54, hi=0.96, tol=0.03, qual=(0.3, 1.0))),
    ("r32b.ada_cohort", Figure("…adaptive cap", "83–97%", lo=0.83, hi=0.97, tol=0.03, qual=(0.4, 1.0))),
    ("r32b.none_cohort", Figure("…no control", "0–7%", lo=0.0, hi=0.07, tol=0.02, qual=(0.0, 0.3))),
    (
        "r32b.queue_growth",
        Figure(
            "…the queue keeps growing with either controller (last 30 min)",
            "4–8 sessions per 10 min",
            lo=4,
            hi=8,
            tol=1,
            qual=(1, 20),
        ),
    ),
    ("r32b.queue_level", Figure("…averaging (last 5 min)", "73–101 sessions", lo=73, hi=101, rel=0.15, qual=(30, 200))),
    (
        "r32b.arrivals",
        Figure(
            "…because arrivals outpace completions: arrivals per minute",
            "1.5–1.6",
            lo=1.5,
            hi=1.6,
            tol=0.1,
            qual=(1.0, 2.5),
        ),
    ),
    (
        "r32b.completions",
        Figure("…completions per minute (controlled runs)", "0.7–1.3", lo=0.7, hi=1.3, tol=0.1),
    ),
    (
        "r32b.outpace",
        Holds("…so the queue cannot drain: arrivals outpace completions", "1.5–1.6 vs 0.7–1.3 per minute"),
    ),
    # -- session-mix shift (§6, Figure 6) -------------------------------------------------------------------------
    ("mix.none", Count("the shift alone collapses an uncontrolled server", "2 of 2", k=2, n=2)),
    ("mix.none_hit", Figure("…hit ratio at the end", "0.08", lo=0.08, hi=0.08, tol=0.03, qual=HIT_DEGRADED)),
    ("mix.loose", Count("caps of 22 or 34 collapse like no control", "4 of 4", k=4, n=4)),
    ("mix.tight", Count("caps of 10 or 14 prevent the collapse", "0 of 4 collapsed", k=0, n=4)),
    (
        "mix.tight_wait",
        Figure(
            "…but hold phase-1 first turns at the gateway (p90)",
            "0.7–13 min",
            lo=0.7,
            hi=13,
            tol=0.2,
            qual=(0.3, 40),
            unit=" min",
        ),
    ),
    ("mix.good", Count("budgeter and adaptive cap: no collapse", "0 of 4", k=0, n=4)),
    (
        "mix.good_wait",
        Figure("…and no phase-1 gateway wait (p90)", "none", lo=0.0, hi=0.0, tol=0.1, qual=(0, 0.7), unit=" min"),
    ),
    (
        "mix.good_done",
        Figure(
            "…every session arriving in the first 60 min completes by minute 80",
            "100%",
            lo=1.0,
            hi=1.0,
            tol=0.005,
            qual=(0.9, 1.0),
        ),
    ),
    # -- threshold sensitivity (§6) --------------------------------------------------------------------------------
    ("th.recovered", Count("budgeter at 0.65/0.85 and 0.85/0.98: every collapsed run recovers", "all", k=1, n=1)),
    ("th.time", Figure("…in", "< 5 min", lo=0, hi=4.99, qual=(0, 10), unit=" min")),
    ("th.hit", Figure("…end hit ratio", "0.92–0.95", lo=0.92, hi=0.95, tol=0.01, qual=HIT_HEALTHY)),
    (
        "th.cohort",
        Figure(
            "…all sessions arriving in the following 20 min complete", "100%", lo=1.0, hi=1.0, tol=0.01, qual=(0.8, 1.0)
        ),
    ),
    (
        "th.tput_alt",
        Figure(
            "…post-recovery throughput (last 10 min), other thresholds",
            "1.01–1.25 turns/s",
            lo=1.01,
            hi=1.25,
            tol=0.03,
            qual=(0.7, 1.5),
        ),
    ),
    ("th.tput_default", Figure("…default 0.75/0.95", "1.06–1.27 turns/s", lo=1.06, hi=1.27, tol=0.03, qual=(0.7, 1.5))),
    # -- prevention (§6) ----------------------------------------------------------------------------------------------
    ("prev.burst", Count("budgeter from the start: no collapse under a 2×/2-min burst", "0 of 5", k=0, n=5)),
    ("prev.burst_vs_none", Prevents("…on the seeds the burst collapses without control", "0/5")),
    ("prev.flush", Count("…none under a cache flush", "0 of 3", k=0, n=3)),
    ("prev.flush_vs_none", Prevents("…on the seeds the flush collapses without control", "0/3")),
    ("prev.t32", Count("…none on 32B trace shapes (2×/4 min, λ = 0.025)", "0 of 4", k=0, n=4)),
    ("prev.t32_vs_none", Prevents("…on the seeds the burst degrades without control", "0/4")),
    (
        "prev.tput",
        Figure(
            "its throughput in the healthy regime is within run-to-run variation of no control "
            "(|turns budgeter / none − 1| over the whole run, in run-to-run CVs of no control, on the "
            "seeds none keeps healthy)",
            "within variation",
            lo=0.0,
            hi=2.0,
            qual=(0.0, 4.0),
            unit=" CV",
        ),
    ),
    # -- CPU KV offload (§6) ------------------------------------------------------------------------------------
    (
        "off.burst",
        Count(
            "with a 0.9M-token host tier, the paired burst still collapses most runs",
            "4 of 6 burst arms",
            k=4,
            n=6,
            band=0.25,
        ),
    ),
    ("off.twins", Count("…while every twin stays healthy", "0 of 6 twins degraded", k=0, n=6)),
    ("off.hit", Figure("…degraded burst arms' hit ratio", "0.12", lo=0.12, hi=0.12, tol=0.02, qual=HIT_DEGRADED)),
    (
        "off.sessions",
        Figure("…sessions in the system (last 5 min)", "116–136", lo=116, hi=136, rel=0.15, qual=(60, 300)),
    ),
    (
        "off.onset",
        Figure(
            "offloading only delays the collapse: persistent degradation from",
            "minute 40–60",
            lo=40,
            hi=60,
            tol=5,
            qual=(25, 90),
            unit=" min",
        ),
    ),
    (
        "off.onset_base",
        Figure("…instead of (no host tier)", "minute 20–25", lo=20, hi=25, tol=5, qual=(15, 45), unit=" min"),
    ),
    (
        "off.rec_none",
        Count("recovery design (2×/4 min at λ = 0.04): every uncontrolled run collapses late", "3 of 3", k=3, n=3),
    ),
    ("off.rec_budgeter", Prevents("…the budgeter enabled at minute 20 keeps them healthy", "3 of 3 healthy")),
    # -- drain condition (§4) --------------------------------------------------------------------------------------
    (
        "drain.cl",
        Calibrated(
            "c(L) from cache-disabled runs (2-min windows, ≥ 4 running)",
            "−0.06 s + 0.146 ms × L",
            sets="set mixed_decode_factor",
        ),
    ),
    (
        "drain.inv_s",
        Calibrated(
            "1/S for the synthetic workload", "≈ 0.013 sessions/s (S ≈ 78 s)", sets="follows from the calibrated c(L)"
        ),
    ),
    (
        "drain.cl_degraded",
        Calibrated(
            "c(L) fitted on all-miss windows of degraded cache-enabled runs",
            "−0.71 s + 0.187 ms × L; 1/S = 0.012",
            sets="a calibration target of mixed_decode_factor",
        ),
    ),
    (
        "drain.d006",
        Figure(
            "after lowering λ: remaining cold work falls at λ = 0.006",
            "≈ −900 engine-s/h",
            lo=-900,
            hi=-900,
            rel=0.35,
            qual=(-3000, -100),
            unit="/h",
        ),
    ),
    (
        "drain.d010",
        Figure(
            "…stays roughly flat at λ = 0.010", "−67 to +132 /h", lo=-67, hi=132, tol=100, qual=(-400, 400), unit="/h"
        ),
    ),
    (
        "drain.d014",
        Figure("…grows at λ = 0.014", "+604, +663 /h", lo=604, hi=663, rel=0.3, qual=(150, 2500), unit="/h"),
    ),
    ("drain.d018", Holds("…and grows at λ = 0.018", "grows")),
    (
        "drain.s018_start",
        Figure("…at 0.018 sessions in the system at the change", "53", lo=53, hi=53, rel=0.2, qual=(25, 110)),
    ),
    ("drain.s018_end", Figure("…an hour later", "100", lo=100, hi=100, rel=0.2, qual=(60, 220))),
    (
        "drain.no_reform",
        Count("no run's cache re-forms while observed (2 h after the change)", "0 runs re-formed", k=0, n=6),
    ),
    (
        "drain.bracket",
        Holds(
            "the break-even lies between the rates that drain and those that grow, bracketing 1/S",
            "0.010–0.014 vs 1/S = 0.013",
        ),
    ),
]

PAPER_CLAIMS: dict[str, Rule] = dict(_R)
assert len(PAPER_CLAIMS) == len(_R), "duplicate claim id"

CAUSES: dict[str, str] = {
    "r32b.outpace": (
        "the 32B profile is estimated and the bundled trace is one model's shorter sessions (mean turn "
        "context 14.6K; docs/trace-format.md): kvgate's cache-warm 32B engine completes this mix faster than "
        "it arrives at λ = 0.025, so with control the backlog drains instead of growing"
    ),
    "r32b.queue_growth": (
        "the 32B profile is estimated and the bundled trace is one model's shorter sessions (mean turn "
        "context 14.6K; docs/trace-format.md): kvgate's cache-warm 32B engine completes this mix faster than "
        "it arrives at λ = 0.025, so with control the backlog drains instead of growing"
    ),
    "r32b.queue_level": (
        "the 32B profile is estimated and the bundled trace is one model's shorter sessions (mean turn "
        "context 14.6K; docs/trace-format.md): kvgate's cache-warm 32B engine completes this mix faster than "
        "it arrives at λ = 0.025, so with control the backlog drains instead of growing"
    ),
    "r32b.none_sessions": (
        "the 32B profile is estimated and the bundled trace is one model's shorter sessions (mean turn "
        "context 14.6K; docs/trace-format.md): kvgate's cache-warm 32B engine completes this mix faster than "
        "it arrives at λ = 0.025, so with control the backlog drains instead of growing"
    ),
    "r32b.arrivals": (
        "the 32B profile is estimated and the bundled trace is one model's shorter sessions (mean turn "
        "context 14.6K; docs/trace-format.md): kvgate's cache-warm 32B engine completes this mix faster than "
        "it arrives at λ = 0.025, so with control the backlog drains instead of growing"
    ),
    "r32b.completions": (
        "the 32B profile is estimated and the bundled trace is one model's shorter sessions (mean turn "
        "context 14.6K; docs/trace-format.md): kvgate's cache-warm 32B engine completes this mix faster than "
        "it arrives at λ = 0.025, so with control the backlog drains instead of growing"
    ),
    "r32.users_bud": (
        "the 32B profile is estimated and the bundled trace is one model's shorter sessions (mean turn "
        "context 14.6K; docs/trace-format.md): kvgate's cache-warm 32B engine completes this mix faster than "
        "it arrives at λ = 0.025, so with control the backlog drains instead of growing"
    ),
    "r32.users_ada": (
        "the 32B profile is estimated and the bundled trace is one model's shorter sessions (mean turn "
        "context 14.6K; docs/trace-format.md): kvgate's cache-warm 32B engine completes this mix faster than "
        "it arrives at λ = 0.025, so with control the backlog drains instead of growing"
    ),
    "r32b.bud_cohort": (
        "the 32B profile is estimated and the bundled trace is one model's shorter sessions (mean turn "
        "context 14.6K; docs/trace-format.md): kvgate's cache-warm 32B engine completes this mix faster than "
        "it arrives at λ = 0.025, so with control the backlog drains instead of growing"
    ),
    "r32b.ada_cohort": (
        "the 32B profile is estimated and the bundled trace is one model's shorter sessions (mean turn "
        "context 14.6K; docs/trace-format.md): kvgate's cache-warm 32B engine completes this mix faster than "
        "it arrives at λ = 0.025, so with control the backlog drains instead of growing"
    ),
    "r32.users_other": ("the fixed cap from a lighter load recovers in kvgate (its row), so its cohort completes"),
    "flush.most_arrivals": (
        "in kvgate several seeds collapse after the flush and the one with the most arrivals in the 5 minutes"
        " after it is not among them: the arrivals during the rebuild are not the only factor (the paper's "
        "observation rests on its single collapsed run)"
    ),
    "paired.healthy_sessions": (
        "kvgate's healthy-side turns are faster than the paper's (R ≈ 4 s vs ≈ 6 s, set by the decode "
        "constants; docs/calibration.md), so fewer sessions are in the system (Little's law) and less demand "
        "is resident"
    ),
    "paired.healthy_side_sessions": (
        "kvgate's healthy-side turns are faster than the paper's (R ≈ 4 s vs ≈ 6 s, set by the decode "
        "constants; docs/calibration.md), so fewer sessions are in the system (Little's law) and less demand "
        "is resident"
    ),
    "paired.healthy_side_demand": (
        "kvgate's healthy-side turns are faster than the paper's (R ≈ 4 s vs ≈ 6 s, set by the decode "
        "constants; docs/calibration.md), so fewer sessions are in the system (Little's law) and less demand "
        "is resident"
    ),
    "paired.twin_peak_demand": (
        "kvgate's healthy-side turns are faster than the paper's (R ≈ 4 s vs ≈ 6 s, set by the decode "
        "constants; docs/calibration.md), so fewer sessions are in the system (Little's law) and less demand "
        "is resident"
    ),
    "paired.recomputed_before": (
        "kvgate's healthy-side turns are faster than the paper's (R ≈ 4 s vs ≈ 6 s, set by the decode "
        "constants; docs/calibration.md), so fewer sessions are in the system (Little's law) and less demand "
        "is resident"
    ),
    "paired.injected_finished": (
        "not known: kvgate's engine serves a burst session's turns at the pace of the whole backlog (one turn"
        " per N / throughput), so 25 turns take longer than the rest of the run; the paper's injected "
        "sessions finishing suggests they advanced faster than the backlog"
    ),
    "paired.lam04_healthy": (
        "kvgate's λ = 0.04 sits nearer the edge than the paper's: some seeds slide into the degraded regime "
        "on their own within 30 minutes"
    ),
    "paired.twins_spontaneous": (
        "the rate at which kvgate's twins slide on their own depends on how near the edge λ = 0.035 is"
    ),
    "nocache.load_fraction": (
        "the paper's own figures disagree: 0.0086 sessions/s against its no-cache throughput of 0.33–0.43 "
        "turns/s (0.013–0.017 sessions/s at 25 turns) is 50–65%, where kvgate sits"
    ),
    "t32.long_noburst": (
        "the 32B profile is estimated and the bundled trace is one model's shorter sessions "
        "(docs/trace-format.md), so kvgate's 32B server has more margin at λ = 0.025–0.035 than the paper's"
    ),
    "t32.lam035_onset": (
        "the 32B profile is estimated and the bundled trace is one model's shorter sessions, so kvgate's 32B "
        "server has more margin at λ = 0.035 than the paper's"
    ),
    "t32.lam03_onset": ("as for λ = 0.035: more margin, so the spontaneous collapse comes later"),
    "sg.dips": (
        "kvgate's SGLang-like engine differs from its vLLM engine only in running prefill and decode in "
        "separate steps; nothing in it makes the hit ratio dip under a burst it absorbs"
    ),
    "sg.dip_depth": ("no SGLang run dips (see the row above)"),
    "r8.adm_low": (
        "in kvgate the admission-only cap's collapsed runs half-recover: its degraded engine is no slower per"
        " token than its no-cache one (degraded c(L) 0.153 vs the paper's 0.187 ms/token, "
        "docs/calibration.md), so with arrivals held the population drains faster than in the paper"
    ),
    "r8.adm_unfinished": ("as above: with arrivals held, kvgate's degraded population drains faster"),
    "r8.adm": ("as above: with arrivals held, kvgate's degraded population drains faster"),
    "r8.adm_time": ("as above: with arrivals held, kvgate's degraded population drains faster"),
    "r8.aimd_time": (
        "in kvgate the median turn latency is far above 15 s when control starts, so AIMD halves K from 32 "
        "within a minute and parks like a fixed cap; some runs recover in the first window"
    ),
    "r8.aimd_unfinished": ("AIMD recovers sooner in kvgate (row above), so more of its cohort finishes"),
    "r32.cap": (
        "the paper does not give its K; the rule K = ⌊0.75 C / d̄⌋ with d̄ over the light load's turns gives "
        "K = 18, which parks enough to recover in kvgate. A d̄ measured early in a short light-load run "
        "(young sessions, short contexts) would give a looser cap"
    ),
    "th.tput_alt": (
        "kvgate's controllers drain the backlog sooner, so by minutes 50–60 throughput is the offered load (λ"
        " T = 1.0 turns/s, Poisson-varying) where the paper's runs were still working off the backlog"
    ),
    "th.tput_default": (
        "kvgate's controllers drain the backlog sooner, so by minutes 50–60 throughput is the offered load (λ"
        " T = 1.0 turns/s, Poisson-varying) where the paper's runs were still working off the backlog"
    ),
    "drain.d006": (
        "kvgate's degraded engine works off cold turns faster than the paper's (degraded c(L) 0.153 vs 0.187 "
        "ms/token), so after lowering λ its remaining work falls faster"
    ),
    "drain.d010": (
        "kvgate's degraded engine works off cold turns faster than the paper's (degraded c(L) 0.153 vs 0.187 "
        "ms/token), so the break-even moves up: at 0.010 the remaining work falls where the paper's stayed "
        "flat"
    ),
    "drain.d014": ("as at 0.010: kvgate's degraded engine drains faster, so the growth at 0.014 is weaker"),
    "drain.no_reform": (
        "as for the drift: kvgate's backlog at λ = 0.006 drains within the 2 hours and the cache re-forms "
        "once the population falls below what the pool holds"
    ),
    "drain.bracket": ("the drift rows above: kvgate's break-even is higher than the paper's"),
    "off.burst": (
        "at vLLM's published bandwidth (50 GB/s) the host tier reloads a 20K prefix in ≈ 0.07 s, so an "
        "evicted prefix costs almost nothing and the loop does not close; kvgate needs ≈ 1–4 GB/s effective "
        "for the paper's result (offload-sweep). vLLM's connector loads asynchronously, whole blocks only, "
        "and its CPU tier's store and eviction policy differ from kvgate's LRU tier; which of these made the "
        "paper's host hits few is not known"
    ),
    "off.hit": (
        "at vLLM's published bandwidth (50 GB/s) the host tier reloads a 20K prefix in ≈ 0.07 s, so an "
        "evicted prefix costs almost nothing and the loop does not close; kvgate needs ≈ 1–4 GB/s effective "
        "for the paper's result (offload-sweep). vLLM's connector loads asynchronously, whole blocks only, "
        "and its CPU tier's store and eviction policy differ from kvgate's LRU tier; which of these made the "
        "paper's host hits few is not known"
    ),
    "off.sessions": (
        "at vLLM's published bandwidth (50 GB/s) the host tier reloads a 20K prefix in ≈ 0.07 s, so an "
        "evicted prefix costs almost nothing and the loop does not close; kvgate needs ≈ 1–4 GB/s effective "
        "for the paper's result (offload-sweep). vLLM's connector loads asynchronously, whole blocks only, "
        "and its CPU tier's store and eviction policy differ from kvgate's LRU tier; which of these made the "
        "paper's host hits few is not known"
    ),
    "off.onset": (
        "at vLLM's published bandwidth (50 GB/s) the host tier reloads a 20K prefix in ≈ 0.07 s, so an "
        "evicted prefix costs almost nothing and the loop does not close; kvgate needs ≈ 1–4 GB/s effective "
        "for the paper's result (offload-sweep). vLLM's connector loads asynchronously, whole blocks only, "
        "and its CPU tier's store and eviction policy differ from kvgate's LRU tier; which of these made the "
        "paper's host hits few is not known"
    ),
    "off.rec_none": (
        "at vLLM's published bandwidth (50 GB/s) the host tier reloads a 20K prefix in ≈ 0.07 s, so an "
        "evicted prefix costs almost nothing and the loop does not close; kvgate needs ≈ 1–4 GB/s effective "
        "for the paper's result (offload-sweep). vLLM's connector loads asynchronously, whole blocks only, "
        "and its CPU tier's store and eviction policy differ from kvgate's LRU tier; which of these made the "
        "paper's host hits few is not known"
    ),
    "off.rec_budgeter": (
        "at vLLM's published bandwidth (50 GB/s) the host tier reloads a 20K prefix in ≈ 0.07 s, so an "
        "evicted prefix costs almost nothing and the loop does not close; kvgate needs ≈ 1–4 GB/s effective "
        "for the paper's result (offload-sweep). vLLM's connector loads asynchronously, whole blocks only, "
        "and its CPU tier's store and eviction policy differ from kvgate's LRU tier; which of these made the "
        "paper's host hits few is not known"
    ),
}
"""Known or suspected cause of a difference, by claim id (docs/experiments.md has the discussion)."""


def cause(cid: str) -> str:
    return CAUSES.get(cid, "")
