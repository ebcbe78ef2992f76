"""Trace-shape format: reading, validation, truncation, the mini-swe-agent importer and the bundled set."""

from __future__ import annotations

import gzip
import json
import math
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvgate.errors import UsageError
from kvgate.workload.shapes import SessionShape, Workload
from kvgate.workload.trace import (
    MINI_SWE_AGENT_SHARED_TOKENS,
    PAPER_MAX_CONTEXT,
    bundled_shapes_path,
    describe,
    import_mini_swe_agent,
    load_shapes,
    load_trace,
    shape_to_json,
    tool_gap,
    trace_workload,
    write_shapes,
)

SHARED_DATA = Path("/work/shared/data/mini-swe-agent-gemini3pro-swebench-verified.jsonl")


def _shape(sid: str, initial: int, outputs: list[int], appends: list[int], gaps=None, shared=0) -> SessionShape:
    return SessionShape(
        shared_tokens=shared,
        initial_tokens=initial,
        outputs=tuple(outputs),
        appends=tuple(appends),
        gaps=None if gaps is None else tuple(gaps),
        source=sid,
    )


def _write(tmp_path: Path, lines: list[str], name: str = "trace.jsonl") -> Path:
    p = tmp_path / name
    p.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return p


GOOD = {"id": "a", "shared": 10, "initial": 100, "outputs": [5, 6, 7], "appends": [20, 30], "gaps": [0.5, 1.0]}


# --- format round trip -----------------------------------------------------------------------------------------


def test_reads_documented_example(tmp_path: Path) -> None:
    line = (
        '{"id": "django__django-11099", "shared": 150, "initial": 1540, "outputs": [212, 95, 61], '
        '"appends": [1830, 240], "gaps": [0.8, 2.35]}'
    )
    (s,) = load_shapes(_write(tmp_path, [line]))
    assert s.source == "django__django-11099"
    assert s.shared_tokens == 150 and s.initial_tokens == 1540
    assert s.prompt_tokens() == [1540, 3582, 3917]
    assert s.max_context() == 3978
    assert s.gaps == (0.8, 2.35)


@pytest.mark.parametrize("name", ["t.jsonl", "t.jsonl.gz"])
def test_round_trip(tmp_path: Path, name: str) -> None:
    shapes = [
        _shape("a", 100, [5, 6, 7], [20, 30], gaps=[0.5, 1.25], shared=10),
        _shape("b", 50, [9], [], gaps=[]),
        _shape("c", 70, [1, 2], [0], gaps=None),
    ]
    path = tmp_path / name
    write_shapes(shapes, path)
    if name.endswith(".gz"):
        assert path.read_bytes()[:2] == b"\x1f\x8b"
    assert load_shapes(path) == shapes
    # and the text is the documented keys only
    data = gzip.decompress(path.read_bytes()) if name.endswith(".gz") else path.read_bytes()
    first = json.loads(data.splitlines()[0])
    assert set(first) == {"id", "shared", "initial", "outputs", "appends", "gaps"}
    assert "shared" not in shape_to_json(shapes[1]) and "gaps" not in shape_to_json(shapes[2])


def test_gzip_detected_by_content_not_name(tmp_path: Path) -> None:
    p = tmp_path / "plain-name.jsonl"
    p.write_bytes(gzip.compress((json.dumps(GOOD) + "\n").encode()))
    assert load_shapes(p)[0].source == "a"


@settings(max_examples=50, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.integers(0, 500),
            st.integers(1, 5000),
            st.lists(st.tuples(st.integers(1, 800), st.integers(0, 3000), st.floats(0, 600)), max_size=8),
            st.integers(1, 800),
        ),
        min_size=1,
        max_size=6,
    )
)
def test_round_trip_property(tmp_path_factory: pytest.TempPathFactory, raw) -> None:
    shapes = []
    for i, (shared, unique, turns, last_out) in enumerate(raw):
        shapes.append(
            _shape(
                f"s{i}",
                shared + unique,
                [t[0] for t in turns] + [last_out],
                [t[1] for t in turns],
                gaps=[t[2] for t in turns],
                shared=shared,
            )
        )
    path = tmp_path_factory.mktemp("rt") / "t.jsonl.gz"
    write_shapes(shapes, path)
    assert load_shapes(path) == shapes


def test_shared_override(tmp_path: Path) -> None:
    p = _write(tmp_path, [json.dumps(GOOD), json.dumps({**GOOD, "id": "b", "shared": 0})])
    assert [s.shared_tokens for s in load_shapes(p)] == [10, 0]
    assert [s.shared_tokens for s in load_shapes(p, shared_tokens=40)] == [40, 40]
    with pytest.raises(UsageError, match=r"trace\.jsonl:1: shared prefix of 101 tokens is longer"):
        load_shapes(p, shared_tokens=101)


def test_missing_shared_and_null_gaps(tmp_path: Path) -> None:
    obj = {k: v for k, v in GOOD.items() if k != "shared"} | {"gaps": None}
    (s,) = load_shapes(_write(tmp_path, [json.dumps(obj)]))
    assert s.shared_tokens == 0 and s.gaps is None


# --- truncation ------------------------------------------------------------------------------------------------


def test_truncation_stats(tmp_path: Path) -> None:
    shapes = [
        _shape("fits", 100, [10, 10], [10], gaps=[1.0]),  # max context 100+10+10+10 = 130
        _shape("cut", 100, [10, 10, 10], [100, 100], gaps=[1.0, 2.0]),  # prompts 100, 210, 320
        _shape("gone", 300, [10], []),  # first turn needs 310
    ]
    path = tmp_path / "t.jsonl"
    write_shapes(shapes, path)
    ts = load_trace(path, max_context=250)
    assert [s.source for s in ts.shapes] == ["fits", "cut"]
    cut = ts.shapes[1]
    assert cut.outputs == (10, 10) and cut.appends == (100,) and cut.gaps == (1.0,)
    assert all(s.max_context() <= 250 for s in ts.shapes)
    st_ = ts.stats
    assert (st_.sessions_read, st_.sessions_kept, st_.sessions_truncated, st_.sessions_dropped) == (3, 2, 1, 1)
    assert (st_.turns_read, st_.turns_kept, st_.turns_dropped) == (6, 4, 2)
    assert st_.frac_sessions_cut == pytest.approx(2 / 3)
    assert st_.frac_turns_dropped == pytest.approx(2 / 6)
    d = st_.as_dict()
    assert d["max_context"] == 250 and json.dumps(d)

    untouched = load_trace(path)
    assert untouched.stats.sessions_truncated == 0 and len(untouched.shapes) == 3

    with pytest.raises(UsageError, match=r"t\.jsonl: no session fits in max context 100 \(.*needs 110\)"):
        load_trace(path, max_context=100)


@pytest.mark.parametrize("kwargs", [{"max_context": 0}, {"max_context": 1.5}, {"shared_tokens": -1}])
def test_bad_limits(tmp_path: Path, kwargs) -> None:
    with pytest.raises(UsageError):
        load_trace(_write(tmp_path, [json.dumps(GOOD)]), **kwargs)


# --- malformed input -------------------------------------------------------------------------------------------


def _bad(**changes) -> str:
    obj = dict(GOOD)
    for k, v in changes.items():
        if v is KeyError:
            obj.pop(k)
        else:
            obj[k] = v
    return json.dumps(obj)


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ('{"id": "x", "initial": 5,', "invalid JSON"),
        ("[1, 2, 3]", "expected a JSON object, got list"),
        (_bad(initial=KeyError), "missing key 'initial'"),
        (_bad(output=[1]), "unknown key 'output'"),
        (_bad(id=""), "'id' must be a non-empty string"),
        (_bad(id=7), "'id' must be a non-empty string"),
        (_bad(initial=0), "'initial' must be a positive integer"),
        (_bad(initial=12.5), "'initial' must be a positive integer"),
        (_bad(outputs=[5, 0, 7]), "'outputs' must be a list of positive integers"),
        (_bad(outputs=[5, True, 7]), "'outputs' must be a list of positive integers"),
        (_bad(outputs="5,6,7"), "'outputs' must be a list of positive integers"),
        (_bad(outputs=[], appends=[], gaps=[]), "'outputs' must not be empty"),
        (_bad(appends=[20, -1]), "'appends' must be a list of non-negative integers"),
        (_bad(appends=[20]), "'appends' must have one entry fewer than 'outputs' (2), got 1"),
        (_bad(gaps=[0.5, -1.0]), "'gaps' must be a list of non-negative numbers"),
        (_bad(gaps=[0.5]), "'gaps' must have one entry fewer than 'outputs' (2), got 1"),
        (_bad(gaps=[0.5, "1"]), "'gaps' must be a list of non-negative numbers"),
        (_bad(shared=-3), "'shared' must be a non-negative integer"),
        (_bad(shared=101), "shared prefix of 101 tokens is longer than the first prompt"),
        (_bad(id="first"), "duplicate session id 'first' (first on line 2)"),
    ],
)
def test_malformed_line_names_file_and_line(tmp_path: Path, line: str, message: str) -> None:
    # line 1 blank (skipped but counted), line 2 good, line 3 good, line 4 the bad one
    lines = ["", json.dumps({**GOOD, "id": "first"}), json.dumps({**GOOD, "id": "second"}), line]
    path = _write(tmp_path, lines)
    with pytest.raises(UsageError) as exc:
        load_shapes(path)
    msg = str(exc.value)
    assert msg.startswith(f"{path}:4: "), msg
    assert message in msg
    assert "\n" not in msg


def test_nan_gap_rejected(tmp_path: Path) -> None:
    path = _write(tmp_path, [json.dumps(GOOD).replace("[0.5, 1.0]", "[0.5, NaN]")])
    with pytest.raises(UsageError, match=r":1: 'gaps' must be a list of non-negative numbers"):
        load_shapes(path)


def test_unreadable_files(tmp_path: Path) -> None:
    missing = tmp_path / "nope.jsonl"
    with pytest.raises(UsageError, match=r"nope\.jsonl: cannot read: No such file"):
        load_shapes(missing)
    with pytest.raises(UsageError, match=r"cannot read"):
        load_shapes(tmp_path)  # a directory
    bad_gz = tmp_path / "bad.jsonl.gz"
    bad_gz.write_bytes(b"\x1f\x8b" + b"garbage" * 10)
    with pytest.raises(UsageError, match=r"bad\.jsonl\.gz: cannot read"):
        load_shapes(bad_gz)
    truncated_gz = tmp_path / "cut.jsonl.gz"
    truncated_gz.write_bytes(gzip.compress((json.dumps(GOOD) + "\n").encode() * 50)[:-20])
    with pytest.raises(UsageError, match=r"cut\.jsonl\.gz: cannot read"):
        load_shapes(truncated_gz)
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes((json.dumps(GOOD) + "\n").encode() + b'{"id": "caf\xe9"}\n')
    with pytest.raises(UsageError, match=r"latin\.jsonl:2: not UTF-8"):
        load_shapes(latin)
    empty = _write(tmp_path, ["", "   "], name="empty.jsonl")
    with pytest.raises(UsageError, match=r"empty\.jsonl: no sessions"):
        load_shapes(empty)


# --- importer --------------------------------------------------------------------------------------------------

SAMPLE = [
    # 4 calls; the last append is negative (3000 - 2900 - 400) and gets clipped
    {
        "session": "repo__repo-1",
        "exit_status": "Submitted",
        "calls": [[0, 1500, 100, 0], [5, 2600, 240, 0], [7, 2900, 400, 2048], [30, 3000, 50, 2048]],
    },
    {"session": "repo__repo-2", "exit_status": "Submitted", "calls": [[0, 1400, 60, 0]]},  # one call
    {"session": "repo__repo-3", "exit_status": "LimitsExceeded", "calls": []},  # no calls: dropped
]


def _sample(tmp_path: Path, rows=SAMPLE) -> Path:
    return _write(tmp_path, [json.dumps(r) for r in rows], name="src.jsonl")


@pytest.mark.parametrize("dst_name", ["shapes.jsonl", "shapes.jsonl.gz"])
def test_import_mini_swe_agent(tmp_path: Path, dst_name: str) -> None:
    dst = tmp_path / dst_name
    stats = import_mini_swe_agent(_sample(tmp_path), dst, latency_s=1.7)
    json.dumps(stats)  # printable
    a, b = load_shapes(dst)
    assert a.source == "repo__repo-1" and a.shared_tokens == MINI_SWE_AGENT_SHARED_TOKENS
    assert a.initial_tokens == 1500
    assert a.outputs == (100, 240, 400, 50)
    # 2600-1500-100 = 1000; 2900-2600-240 = 60; 3000-2900-400 = -300 -> 0
    assert a.appends == (1000, 60, 0)
    assert a.gaps == (tool_gap(5, 100), tool_gap(2, 240), tool_gap(23, 400))
    assert a.gaps[0] == round(5 - 1.7 - 100 / 120, 2)
    assert a.gaps[1] == 0.0  # 2 - 1.7 - 240/120 < 0: clipped
    assert a.gaps[2] == 17.97  # 23 - 1.7 - 400/120
    assert b.source == "repo__repo-2" and b.turns == 1 and b.gaps == ()
    assert stats["sessions_read"] == 3
    assert stats["sessions_written"] == 2
    assert stats["sessions_without_calls_dropped"] == 1
    assert stats["one_turn_sessions"] == 1
    assert stats["calls"] == 5
    assert stats["appends"] == 3 and stats["appends_clipped"] == 1 and stats["clipped_tokens"] == 300
    assert stats["min_first_prompt"] == 1400
    assert stats["max_last_prompt_excess"] == pytest.approx(3300 / 3000 - 1, abs=1e-4)


def test_import_options(tmp_path: Path) -> None:
    dst = tmp_path / "raw.jsonl"
    import_mini_swe_agent(_sample(tmp_path), dst, shared_tokens=0, latency_s=0, decode_tok_s=math.inf)
    a = load_shapes(dst)[0]
    assert a.shared_tokens == 0 and a.gaps == (5.0, 2.0, 23.0)  # raw gaps
    with pytest.raises(UsageError, match=r"src\.jsonl:2: shared prefix of 1450 tokens is longer"):
        import_mini_swe_agent(_sample(tmp_path), dst, shared_tokens=1450)
    with pytest.raises(UsageError, match="decode speed"):
        import_mini_swe_agent(_sample(tmp_path), dst, decode_tok_s=0)


def test_import_sets_the_latency_for_the_papers_median_gap(tmp_path: Path) -> None:
    # gaps of 3 s (model latency and generation, no tool time to speak of) and one 30 s tool run per session
    rows = [{"session": f"s{i}", "calls": [[0, 1500, 60, 0], [3, 1700, 60, 0], [6, 1900, 60, 0], [36, 2000, 60, 0]]}
            for i in range(20)]
    dst = tmp_path / "out.jsonl"
    stats = import_mini_swe_agent(_sample(tmp_path, rows), dst, median_gap_s=0.15)
    gaps = sorted(g for s in load_shapes(dst) for g in (s.gaps or ()))
    assert stats["median_gap_s"] == pytest.approx(0.15, abs=0.01)
    assert gaps[len(gaps) // 2] <= 0.16 and max(gaps) > 20  # the tail is the trace's own
    other = import_mini_swe_agent(_sample(tmp_path, rows), dst, median_gap_s=1.0)
    assert other["latency_s"] < stats["latency_s"]  # a longer median needs less latency removed


def test_tool_gap() -> None:
    assert tool_gap(14, 1200, decode_tok_s=120, latency_s=1.7) == 2.3  # 14 - 1.7 - 10
    assert tool_gap(10, 1200, decode_tok_s=120, latency_s=1.7) == 0.0  # clipped
    assert tool_gap(3, 0, decode_tok_s=120, latency_s=1.0) == 2.0
    assert tool_gap(1, 5000) == 0.0


@pytest.mark.parametrize(
    ("row", "message"),
    [
        ({"session": "x", "calls": [[0, 100, 10, 0], [5, 0, 10, 0]]}, "call 1: prompt tokens must be a positive"),
        ({"session": "x", "calls": [[0, 100, 10, 0], [5, 200, -1, 0]]}, "call 1: completion tokens"),
        ({"session": "x", "calls": [[3, 100, 10, 0], [1, 200, 10, 0]]}, "call 1: time 1 is earlier"),
        ({"session": "x", "calls": [[0, 100]]}, "call 0: expected [t_s, prompt, completion, cached]"),
        ({"session": "x"}, "'calls' must be a list"),
        ({"calls": []}, "'session' must be a non-empty string"),
        ({"session": "repo__repo-1", "calls": [[0, 100, 10, 0]]}, "duplicate session 'repo__repo-1'"),
    ],
)
def test_import_malformed_source(tmp_path: Path, row, message: str) -> None:
    src = _sample(tmp_path, [SAMPLE[0], row])
    with pytest.raises(UsageError) as exc:
        import_mini_swe_agent(src, tmp_path / "out.jsonl")
    assert str(exc.value).startswith(f"{src}:2: ") and message in str(exc.value)
    assert not (tmp_path / "out.jsonl").exists()


def test_import_unwritable_destination(tmp_path: Path) -> None:
    with pytest.raises(UsageError, match="cannot write"):
        import_mini_swe_agent(_sample(tmp_path), tmp_path / "no-such-dir" / "out.jsonl")


# --- bundled set -----------------------------------------------------------------------------------------------


def test_bundled_shapes_load() -> None:
    ts = load_trace(bundled_shapes_path())
    assert ts.stats.sessions_read == 500 and ts.stats.turns_read == 20163
    assert all(s.gaps is not None for s in ts.shapes)
    assert {s.shared_tokens for s in ts.shapes} == {MINI_SWE_AGENT_SHARED_TOKENS}
    assert len({s.source for s in ts.shapes}) == 500
    cut = load_trace(bundled_shapes_path(), max_context=PAPER_MAX_CONTEXT)
    assert max(s.max_context() for s in cut.shapes) <= PAPER_MAX_CONTEXT
    assert cut.stats.sessions_dropped == 0
    assert 0 < cut.stats.sessions_truncated < 500
    d = describe(cut.shapes)
    assert d["sessions"] == 500 and 10_000 < d["median_prompt"] < 20_000


def test_trace_workload() -> None:
    wl = trace_workload(None, max_context=PAPER_MAX_CONTEXT)
    assert isinstance(wl, Workload) and wl.name == "trace:mini-swe-agent"
    assert len(wl.pool) == 500 and not wl.phases
    assert wl.max_context() <= PAPER_MAX_CONTEXT
    assert wl.shapes() == wl.pool
    shared = trace_workload(None, shared_tokens=1200, think_mean_s=2.0)
    assert {s.shared_tokens for s in shared.pool} == {1200} and shared.think_mean_s == 2.0


def test_trace_workload_from_file(tmp_path: Path) -> None:
    path = tmp_path / "mine.jsonl.gz"
    write_shapes([_shape("a", 100, [5, 6], [20])], path)
    wl = trace_workload(path)
    assert wl.name == "trace:mine" and wl.pool[0].gaps is None and wl.think_mean_s == 5.0


@pytest.mark.skipif(not SHARED_DATA.exists(), reason="source data not available")
def test_bundled_file_is_reproducible(tmp_path: Path) -> None:
    dst = tmp_path / "mini-swe-agent-shapes.jsonl.gz"
    stats = import_mini_swe_agent(SHARED_DATA, dst)
    assert stats["sessions_written"] == 500
    assert dst.read_bytes() == Path(str(bundled_shapes_path())).read_bytes()
