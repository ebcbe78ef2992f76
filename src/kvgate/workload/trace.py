"""Trace shapes: whole-session shapes (first prompt, per-turn output and growth, inter-turn gaps) read from a file.

kvgate's trace-shape format is JSON Lines, one session a line (see ``docs/trace-format.md``)::

    {"id": "astropy__astropy-12907", "shared": 150, "initial": 1662, "outputs": [106, 500, 27],
     "appends": [3846, 17], "gaps": [1.42, 7.13]}

``initial`` is the first prompt (shared prefix included), ``outputs[k]`` the output tokens of turn k,
``appends[k]`` the tokens appended between turn k and k+1 and ``gaps[k]`` the seconds between the end of turn k
and the start of turn k+1 (tool/think time). ``shared`` (optional, default 0) is how many leading tokens of the
first prompt every session of the trace has in common; the rest of the first prompt is unique to the session.

``load_trace`` / ``load_shapes`` read and validate such a file (plain or gzip), optionally truncating sessions at a
context limit; ``import_mini_swe_agent`` converts the usage records of mini-swe-agent runs
(``calls: [[t_s, prompt, completion, cached], ...]``) into it; ``trace_workload`` turns a trace (by default the
bundled mini-swe-agent set) into a :class:`~kvgate.workload.shapes.Workload`.
"""

from __future__ import annotations

import gzip
import json
import math
import os
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path
from typing import Any

from kvgate.errors import UsageError
from kvgate.workload.shapes import SessionShape, Workload

TraceSource = str | os.PathLike[str] | Traversable
"""A trace file: a path, or a package resource (see :func:`bundled_shapes_path`)."""

BUNDLED_SHAPES = "mini-swe-agent-shapes.jsonl.gz"
"""File name of the bundled trace shapes under ``kvgate/data``."""

PAPER_MAX_CONTEXT = 38_000
"""The paper truncates its trace shapes at 38K tokens (engine limit 40K)."""

MINI_SWE_AGENT_SHARED_TOKENS = 1_200
"""Default shared prefix of mini-swe-agent sessions, as the paper replays them: "a unique task suffix per session".

mini-swe-agent's SWE-bench config sends a system prompt (~150 tokens) and an instance template whose fixed
instructions (~1.1K tokens) follow the task. The paper's replay puts the task *last*, so everything but the task is
a prefix all sessions share: ~1.2K tokens, which the bundled trace bounds from above (its shortest first prompt,
template plus the shortest task, is 1,317 tokens). With the task left in place only the ~150-token system prompt
would be shared; pass ``shared_tokens=150`` for that reading.
"""

PAPER_MEDIAN_TOOL_GAP_S = 0.15
"""The paper's tool gaps: "median 0.1-0.2 s ... with a heavy tail" (§2); the middle of that range."""

MINI_SWE_AGENT_DECODE_TOK_S = 120.0
"""Provider decode speed (tokens/s) assumed when removing the model's own time from mini-swe-agent gaps."""

MINI_SWE_AGENT_LATENCY_S = 1.7
"""A per-call provider latency (s) for :func:`tool_gap` when none is given (time to first token, network)."""

_SHAPE_KEYS = frozenset({"id", "shared", "initial", "outputs", "appends", "gaps"})


# ---------------------------------------------------------------------------------------------------------------
# Reading
# ---------------------------------------------------------------------------------------------------------------


class _LineError(Exception):
    """A problem with one line; the caller adds ``file:line:``."""


def _label(source: TraceSource) -> str:
    if isinstance(source, str | os.PathLike):
        return os.fspath(source)
    return str(source.name)


def _read_text(source: TraceSource, label: str) -> str:
    """The whole file as text, gunzipped if it starts with the gzip magic; read errors become UsageError."""
    try:
        data = Path(source).read_bytes() if isinstance(source, str | os.PathLike) else source.read_bytes()
        if data[:2] == b"\x1f\x8b":
            data = gzip.decompress(data)
    except (OSError, EOFError, zlib.error) as exc:
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc) or type(exc).__name__
        raise UsageError(f"{label}: cannot read: {reason}") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        line = data[: exc.start].count(b"\n") + 1
        raise UsageError(f"{label}:{line}: not UTF-8 text (byte {exc.start})") from None


def _json_lines(source: TraceSource, label: str) -> Iterator[tuple[int, Any]]:
    """(line number, parsed JSON) for every non-blank line."""
    text = _read_text(source, label)
    for lineno, raw in enumerate(text.split("\n"), start=1):
        line = raw.strip()
        if not line:
            continue
        try:
            yield lineno, json.loads(line)
        except json.JSONDecodeError as exc:
            raise UsageError(f"{label}:{lineno}: invalid JSON: {exc.msg} (column {exc.colno})") from None


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _int_field(obj: dict[str, Any], key: str, *, minimum: int, what: str) -> int:
    v = obj[key]
    if not _is_int(v) or v < minimum:
        raise _LineError(f"{key!r} must be a {what} integer, got {v!r}")
    return int(v)


def _int_list(obj: dict[str, Any], key: str, *, minimum: int, what: str) -> tuple[int, ...]:
    v = obj[key]
    if not isinstance(v, list) or not all(_is_int(x) and x >= minimum for x in v):
        raise _LineError(f"{key!r} must be a list of {what} integers")
    return tuple(int(x) for x in v)


def _parse_shape(obj: Any, *, shared_override: int | None) -> SessionShape:
    if not isinstance(obj, dict):
        raise _LineError(f"expected a JSON object, got {type(obj).__name__}")
    unknown = sorted(set(obj) - _SHAPE_KEYS)
    if unknown:
        raise _LineError(f"unknown key {unknown[0]!r}")
    for key in ("id", "initial", "outputs", "appends"):
        if key not in obj:
            raise _LineError(f"missing key {key!r}")
    sid = obj["id"]
    if not isinstance(sid, str) or not sid:
        raise _LineError("'id' must be a non-empty string")
    initial = _int_field(obj, "initial", minimum=1, what="positive")
    outputs = _int_list(obj, "outputs", minimum=1, what="positive")
    if not outputs:
        raise _LineError("'outputs' must not be empty (a session has at least one turn)")
    appends = _int_list(obj, "appends", minimum=0, what="non-negative")
    if len(appends) != len(outputs) - 1:
        raise _LineError(f"'appends' must have one entry fewer than 'outputs' ({len(outputs) - 1}), got {len(appends)}")
    gaps: tuple[float, ...] | None = None
    if obj.get("gaps") is not None:
        g = obj["gaps"]
        if not isinstance(g, list) or not all(
            isinstance(x, int | float) and not isinstance(x, bool) and math.isfinite(x) and x >= 0 for x in g
        ):
            raise _LineError("'gaps' must be a list of non-negative numbers (seconds)")
        if len(g) != len(outputs) - 1:
            raise _LineError(f"'gaps' must have one entry fewer than 'outputs' ({len(outputs) - 1}), got {len(g)}")
        gaps = tuple(float(x) for x in g)
    shared = 0
    if "shared" in obj:
        shared = _int_field(obj, "shared", minimum=0, what="non-negative")
    if shared_override is not None:
        shared = shared_override
    if shared > initial:
        raise _LineError(f"shared prefix of {shared} tokens is longer than the first prompt ('initial' = {initial})")
    return SessionShape(
        shared_tokens=shared,
        initial_tokens=initial,
        outputs=outputs,
        appends=appends,
        gaps=gaps,
        source=sid,
    )


@dataclass(frozen=True, slots=True)
class TraceStats:
    """What loading a trace kept and what the context limit removed."""

    source: str
    max_context: int | None
    sessions_read: int
    turns_read: int
    sessions_kept: int
    turns_kept: int
    sessions_truncated: int
    """Sessions kept with their last turns removed (they exceeded ``max_context``)."""
    sessions_dropped: int
    """Sessions removed entirely because not even their first turn fits in ``max_context``."""

    @property
    def turns_dropped(self) -> int:
        return self.turns_read - self.turns_kept

    @property
    def frac_sessions_cut(self) -> float:
        """Fraction of sessions that exceeded ``max_context`` (truncated or dropped)."""
        return (self.sessions_truncated + self.sessions_dropped) / self.sessions_read

    @property
    def frac_turns_dropped(self) -> float:
        return self.turns_dropped / self.turns_read

    def as_dict(self) -> dict[str, Any]:
        return {
            "source": self.source,
            "max_context": self.max_context,
            "sessions_read": self.sessions_read,
            "sessions_kept": self.sessions_kept,
            "sessions_truncated": self.sessions_truncated,
            "sessions_dropped": self.sessions_dropped,
            "turns_read": self.turns_read,
            "turns_kept": self.turns_kept,
            "turns_dropped": self.turns_dropped,
            "frac_sessions_cut": round(self.frac_sessions_cut, 4),
            "frac_turns_dropped": round(self.frac_turns_dropped, 4),
        }


@dataclass(frozen=True, slots=True)
class TraceSet:
    """The shapes of a trace (after truncation) and the loading statistics."""

    shapes: tuple[SessionShape, ...]
    stats: TraceStats


def _check_limits(shared_tokens: int | None, max_context: int | None) -> None:
    if shared_tokens is not None and (not _is_int(shared_tokens) or shared_tokens < 0):
        raise UsageError(f"shared prefix must be a non-negative number of tokens, got {shared_tokens!r}")
    if max_context is not None and (not _is_int(max_context) or max_context < 1):
        raise UsageError(f"max context must be a positive number of tokens, got {max_context!r}")


def load_trace(path: TraceSource, *, shared_tokens: int | None = None, max_context: int | None = None) -> TraceSet:
    """Read and validate a trace-shape file (plain or gzip) and truncate its sessions at ``max_context``.

    ``shared_tokens`` overrides every line's ``shared`` value. With ``max_context``, every turn whose prompt plus
    output exceeds it is dropped together with all later turns of its session (:meth:`SessionShape.truncated`);
    a session whose first turn does not fit is dropped and counted in ``stats.sessions_dropped``.

    Raises UsageError (``file:line: reason``) for an unreadable file, any malformed line, a duplicate session id,
    a file without sessions, or a limit that no session fits in.
    """
    _check_limits(shared_tokens, max_context)
    label = _label(path)
    shapes: list[SessionShape] = []
    seen: dict[str, int] = {}
    for lineno, obj in _json_lines(path, label):
        try:
            shape = _parse_shape(obj, shared_override=shared_tokens)
        except _LineError as exc:
            raise UsageError(f"{label}:{lineno}: {exc}") from None
        if shape.source in seen:
            raise UsageError(
                f"{label}:{lineno}: duplicate session id {shape.source!r} (first on line {seen[shape.source]})"
            )
        seen[shape.source] = lineno
        shapes.append(shape)
    if not shapes:
        raise UsageError(f"{label}: no sessions")

    kept: list[SessionShape] = []
    truncated = dropped = 0
    for shape in shapes:
        t = shape if max_context is None else shape.truncated(max_context)
        if t is None:
            dropped += 1
            continue
        if t is not shape:
            truncated += 1
        kept.append(t)
    if not kept:
        smallest = min(s.initial_tokens + s.outputs[0] for s in shapes)
        raise UsageError(
            f"{label}: no session fits in max context {max_context} (the smallest first turn needs {smallest})"
        )
    stats = TraceStats(
        source=label,
        max_context=max_context,
        sessions_read=len(shapes),
        turns_read=sum(s.turns for s in shapes),
        sessions_kept=len(kept),
        turns_kept=sum(s.turns for s in kept),
        sessions_truncated=truncated,
        sessions_dropped=dropped,
    )
    return TraceSet(tuple(kept), stats)


def load_shapes(
    path: TraceSource, *, shared_tokens: int | None = None, max_context: int | None = None
) -> list[SessionShape]:
    """The shapes of :func:`load_trace` without the statistics."""
    return list(load_trace(path, shared_tokens=shared_tokens, max_context=max_context).shapes)


# ---------------------------------------------------------------------------------------------------------------
# Writing
# ---------------------------------------------------------------------------------------------------------------


def shape_to_json(shape: SessionShape) -> dict[str, Any]:
    """One line of the trace-shape format (``shared`` and ``gaps`` only when present)."""
    obj: dict[str, Any] = {"id": shape.source}
    if shape.shared_tokens:
        obj["shared"] = shape.shared_tokens
    obj["initial"] = shape.initial_tokens
    obj["outputs"] = list(shape.outputs)
    obj["appends"] = list(shape.appends)
    if shape.gaps is not None:
        obj["gaps"] = list(shape.gaps)
    return obj


def _write_lines(lines: Iterable[str], path: str | os.PathLike[str]) -> None:
    text = "".join(line + "\n" for line in lines).encode("utf-8")
    target = Path(path)
    try:
        if target.name.endswith(".gz"):
            # mtime=0 and no file name in the header: the same shapes always give the same bytes
            with open(target, "wb") as f, gzip.GzipFile(filename="", mode="wb", fileobj=f, mtime=0) as gz:
                gz.write(text)
        else:
            target.write_bytes(text)
    except OSError as exc:
        raise UsageError(f"{os.fspath(path)}: cannot write: {exc.strerror or exc}") from None


def write_shapes(shapes: Iterable[SessionShape], path: str | os.PathLike[str]) -> None:
    """Write shapes in the trace-shape format (gzip when the name ends in ``.gz``). Ids must be unique."""
    _write_lines((json.dumps(shape_to_json(s)) for s in shapes), path)


# ---------------------------------------------------------------------------------------------------------------
# Statistics
# ---------------------------------------------------------------------------------------------------------------


def percentile(values: Sequence[float], q: float) -> float:
    """Linear-interpolation percentile (numpy's default); NaN for no values."""
    if not values:
        return math.nan
    v = sorted(values)
    pos = (len(v) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (v[hi] - v[lo]) * (pos - lo)


def describe(shapes: Sequence[SessionShape]) -> dict[str, float]:
    """Summary statistics of a set of shapes (per-call figures are over all turns of all sessions)."""
    prompts = [p for s in shapes for p in s.prompt_tokens()]
    gaps = [g for s in shapes if s.gaps is not None for g in s.gaps]
    turns = [float(s.turns) for s in shapes]
    growth = [o + a for s in shapes for o, a in zip(s.outputs, s.appends, strict=False)]
    return {
        "sessions": len(shapes),
        "turns": len(prompts),
        "median_calls": percentile(turns, 50),
        "mean_calls": sum(turns) / len(turns) if turns else math.nan,
        "median_initial": percentile([s.initial_tokens for s in shapes], 50),
        "median_prompt": percentile(prompts, 50),
        "p95_prompt": percentile(prompts, 95),
        "mean_turn_context": sum(prompts) / len(prompts) if prompts else math.nan,
        "median_peak_context": percentile([s.max_context() for s in shapes], 50),
        "median_output": percentile([o for s in shapes for o in s.outputs], 50),
        "median_append": percentile([a for s in shapes for a in s.appends], 50),
        "mean_growth_per_turn": sum(growth) / len(growth) if growth else math.nan,
        "median_gap_s": percentile(gaps, 50),
        "p95_gap_s": percentile(gaps, 95),
        "mean_gap_s": sum(gaps) / len(gaps) if gaps else math.nan,
    }


# ---------------------------------------------------------------------------------------------------------------
# Importer: mini-swe-agent usage records
# ---------------------------------------------------------------------------------------------------------------


def tool_gap(
    dt_s: float,
    completion: int,
    *,
    decode_tok_s: float = MINI_SWE_AGENT_DECODE_TOK_S,
    latency_s: float = MINI_SWE_AGENT_LATENCY_S,
) -> float:
    """Estimated tool/think time of a recorded call-to-call gap: ``max(0, dt - latency - completion / R)``.

    The recorded gap between the starts of two calls holds the provider's latency and generation time of the first
    call. ``decode_tok_s=math.inf, latency_s=0`` keeps the raw gap. Rounded to 10 ms (the records have 1 s).
    """
    return round(max(0.0, dt_s - latency_s - completion / decode_tok_s), 2)


def _parse_calls(obj: Any) -> tuple[str, list[tuple[float, int, int]]]:
    if not isinstance(obj, dict):
        raise _LineError(f"expected a JSON object, got {type(obj).__name__}")
    sid = obj.get("session")
    if not isinstance(sid, str) or not sid:
        raise _LineError("'session' must be a non-empty string")
    calls = obj.get("calls")
    if not isinstance(calls, list):
        raise _LineError("'calls' must be a list of [t_s, prompt, completion, cached] records")
    out: list[tuple[float, int, int]] = []
    for i, c in enumerate(calls):
        if not isinstance(c, list) or len(c) < 3:
            raise _LineError(f"call {i}: expected [t_s, prompt, completion, cached], got {c!r}")
        t, p, comp = c[0], c[1], c[2]
        if isinstance(t, bool) or not isinstance(t, int | float) or not math.isfinite(t) or t < 0:
            raise _LineError(f"call {i}: time must be a non-negative number, got {t!r}")
        if not _is_int(p) or p < 1:
            raise _LineError(f"call {i}: prompt tokens must be a positive integer, got {p!r}")
        if not _is_int(comp) or comp < 0:
            raise _LineError(f"call {i}: completion tokens must be a non-negative integer, got {comp!r}")
        if out and t < out[-1][0]:
            raise _LineError(f"call {i}: time {t} is earlier than the previous call's ({out[-1][0]})")
        out.append((float(t), int(p), int(comp)))
    return sid, out


def _latency_for_median(src: TraceSource, label: str, decode_tok_s: float, target: float) -> float:
    """The per-call latency (ms resolution) whose tool gaps have a median closest to ``target``."""
    pairs: list[tuple[float, int]] = []
    for lineno, obj in _json_lines(src, label):
        try:
            _, calls = _parse_calls(obj)
        except _LineError as exc:
            raise UsageError(f"{label}:{lineno}: {exc}") from None
        pairs += [(t1 - t0, c0) for (t0, _, c0), (t1, _, _) in zip(calls, calls[1:], strict=False)]
    if not pairs:
        return 0.0

    def med(lat: float) -> float:
        return percentile([tool_gap(dt, c, decode_tok_s=decode_tok_s, latency_s=lat) for dt, c in pairs], 50)

    lo, hi = 0.0, max(dt for dt, _ in pairs)
    if med(lo) <= target:
        return 0.0
    for _ in range(40):  # the median falls as the latency grows
        mid = (lo + hi) / 2
        if med(mid) > target:
            lo = mid
        else:
            hi = mid
    return round(hi, 3)


def import_mini_swe_agent(
    src_path: TraceSource,
    dst_path: str | os.PathLike[str],
    *,
    shared_tokens: int = MINI_SWE_AGENT_SHARED_TOKENS,
    decode_tok_s: float = MINI_SWE_AGENT_DECODE_TOK_S,
    latency_s: float | None = None,
    median_gap_s: float = PAPER_MEDIAN_TOOL_GAP_S,
) -> dict[str, Any]:
    """Convert mini-swe-agent usage records into kvgate's trace-shape format; returns printable statistics.

    Source: one JSON object a line with ``session`` and ``calls: [[t_s, prompt, completion, cached], ...]``.
    Per session: ``initial = prompt[0]``, ``outputs = completion`` (a zero completion becomes 1 and is counted),
    ``appends[k] = prompt[k+1] - prompt[k] - completion[k]`` clipped at 0 (counted), and
    ``gaps[k] = tool_gap(t[k+1] - t[k], completion[k], latency_s=L)``. A session with one call becomes a one-turn
    session; one without calls is dropped (counted). ``dst_path`` is gzipped when its name ends in ``.gz``.

    The records hold call start times in whole seconds, so the tool time inside a gap is not recorded; the
    provider's per-call latency ``L`` is not either. With ``latency_s=None`` (the default), ``L`` is chosen so that
    the median tool gap is ``median_gap_s`` -- the paper's description of these traces (median 0.1-0.2 s, §2) --
    and the heavy tail stays the trace's own.
    """
    if not _is_int(shared_tokens) or shared_tokens < 0:
        raise UsageError(f"shared prefix must be a non-negative number of tokens, got {shared_tokens!r}")
    if not decode_tok_s > 0:
        raise UsageError(f"decode speed must be positive, got {decode_tok_s!r}")
    if latency_s is not None and not (math.isfinite(latency_s) and latency_s >= 0):
        raise UsageError(f"latency must be a non-negative number of seconds, got {latency_s!r}")
    if latency_s is None and not (math.isfinite(median_gap_s) and median_gap_s >= 0):
        raise UsageError(f"median gap must be a non-negative number of seconds, got {median_gap_s!r}")
    label = _label(src_path)
    if latency_s is None:
        latency_s = _latency_for_median(src_path, label, decode_tok_s, median_gap_s)
    lines: list[str] = []
    seen: dict[str, int] = {}
    n_read = n_empty = n_one = n_calls = n_zero_out = 0
    n_appends = n_clipped = clipped_tokens = 0
    raw_gaps: list[float] = []
    est_gaps: list[float] = []
    first_prompts: list[int] = []
    calls_per_session: list[float] = []
    excess: list[float] = []
    for lineno, obj in _json_lines(src_path, label):
        try:
            sid, calls = _parse_calls(obj)
        except _LineError as exc:
            raise UsageError(f"{label}:{lineno}: {exc}") from None
        if sid in seen:
            raise UsageError(f"{label}:{lineno}: duplicate session {sid!r} (first on line {seen[sid]})")
        seen[sid] = lineno
        n_read += 1
        if not calls:
            n_empty += 1
            continue
        if shared_tokens > calls[0][1]:
            raise UsageError(
                f"{label}:{lineno}: shared prefix of {shared_tokens} tokens is longer than the first prompt "
                f"({calls[0][1]}) of session {sid!r}"
            )
        n_calls += len(calls)
        n_one += len(calls) == 1
        calls_per_session.append(float(len(calls)))
        first_prompts.append(calls[0][1])
        outputs: list[int] = []
        for _, _, comp in calls:
            n_zero_out += comp == 0
            outputs.append(max(1, comp))
        appends: list[int] = []
        gaps: list[float] = []
        for (t0, p0, c0), (t1, p1, _) in zip(calls, calls[1:], strict=False):
            a = p1 - p0 - c0
            if a < 0:
                n_clipped += 1
                clipped_tokens -= a
            appends.append(max(0, a))
            raw_gaps.append(t1 - t0)
            gaps.append(tool_gap(t1 - t0, c0, decode_tok_s=decode_tok_s, latency_s=latency_s))
        n_appends += len(appends)
        est_gaps.extend(gaps)
        shape = SessionShape(
            shared_tokens=shared_tokens,
            initial_tokens=calls[0][1],
            outputs=tuple(outputs),
            appends=tuple(appends),
            gaps=tuple(gaps),
            source=sid,
        )
        excess.append(shape.prompt_tokens()[-1] / calls[-1][1] - 1.0)
        lines.append(json.dumps(shape_to_json(shape)))
    if not lines:
        raise UsageError(f"{label}: no sessions with calls")
    _write_lines(lines, dst_path)
    return {
        "source": label,
        "destination": os.fspath(dst_path),
        "sessions_read": n_read,
        "sessions_written": len(lines),
        "sessions_without_calls_dropped": n_empty,
        "one_turn_sessions": n_one,
        "calls": n_calls,
        "median_calls": percentile(calls_per_session, 50),
        "min_first_prompt": min(first_prompts),
        "shared_tokens": shared_tokens,
        "zero_outputs_raised_to_1": n_zero_out,
        "appends": n_appends,
        "appends_clipped": n_clipped,
        "clipped_tokens": clipped_tokens,
        "median_last_prompt_excess": round(percentile(excess, 50), 4),
        "max_last_prompt_excess": round(max(excess), 4),
        "decode_tok_s": decode_tok_s,
        "latency_s": latency_s,
        "median_raw_gap_s": percentile(raw_gaps, 50),
        "p95_raw_gap_s": percentile(raw_gaps, 95),
        "median_gap_s": round(percentile(est_gaps, 50), 2),
        "p95_gap_s": round(percentile(est_gaps, 95), 2),
        "gaps_zero": sum(1 for g in est_gaps if g == 0.0),
    }


# ---------------------------------------------------------------------------------------------------------------
# Workloads
# ---------------------------------------------------------------------------------------------------------------


def bundled_shapes_path() -> Traversable:
    """The bundled mini-swe-agent shapes (a :class:`pathlib.Path` when kvgate is installed from a directory)."""
    return files("kvgate").joinpath("data", BUNDLED_SHAPES)


def trace_workload(
    path: TraceSource | None = None,
    *,
    max_context: int | None = None,
    shared_tokens: int | None = None,
    think_mean_s: float = 5.0,
) -> Workload:
    """A workload that samples whole-session shapes from a trace (None: the bundled mini-swe-agent set).

    ``think_mean_s`` only applies to shapes without recorded gaps (the bundled shapes all have them). Pass
    ``max_context=PAPER_MAX_CONTEXT`` for the paper's 38K truncation.
    """
    if path is None:
        name = "trace:mini-swe-agent"
        source: TraceSource = bundled_shapes_path()
    else:
        source = path
        base = Path(_label(path)).name
        for suffix in (".gz", ".jsonl", ".json"):
            base = base.removesuffix(suffix)
        name = f"trace:{base}"
    ts = load_trace(source, shared_tokens=shared_tokens, max_context=max_context)
    return Workload(name=name, pool=ts.shapes, think_mean_s=think_mean_s)
