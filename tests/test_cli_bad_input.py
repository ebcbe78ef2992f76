"""Bad input on the command line: one line on stderr and exit 2, before any work starts (never a traceback,
never a run on a misread value). Each case below was, on the tree before, a traceback, a silent fallback, a
hang or an exit 0."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

CASES = [
    # NaN passes every range check written x < 0; an infinite rate or length never ends a run
    (["sim", "--minutes", "1", "--pin-ttl", "nan"], "not a finite number"),
    (["sim", "--minutes", "1", "--lam", "inf"], "not a finite number"),
    (["sim", "--minutes", "1", "--flush-at", "nan"], "not a finite number"),
    (["sim", "--minutes", "1", "--rate-at", "0.5:nan"], "finite"),
    (["sim", "--minutes", "1", "--shrink-at", "1000@nan"], "finite"),
    (["sim", "--minutes", "1", "--client-timeout", "5", "--retry-backoff", "nan"], "not a finite number"),
    (["phase-map", "--jobs", "1", "--seeds", "1", "--minutes", "30", "--lam", "inf", "--burst", "0"], "finite"),
    (["sweep", "--out", "{tmp}/sw", "--set", "lam=1e400", "--set", "minutes=1"], "finite number"),
    # seeds: numpy's traceback for a negative one, a list of 10^11 runs, a pair counted twice
    (["sim", "--minutes", "1", "--seed", "-1"], "range"),
    (["sweep", "--out", "{tmp}/sw", "--set", "seed=-1", "--set", "minutes=1"], "non-negative"),
    (["paired", "--minutes", "1", "--burst", "1.5@0.2+0.5", "--seeds", "1,1"], "given twice"),
    (["paired", "--minutes", "1", "--burst", "1.5@0.2+0.5", "--seeds", "1-99999999999"], "at most"),
    # zero meant "the default" or "off"
    (["sim", "--minutes", "1", "--kv-pool", "0"], "range"),
    (["sim", "--minutes", "1", "--max-context", "0"], "range"),
    (["sim", "--minutes", "1", "--cpu-offload-tokens", "-5"], "range"),
    (["sim", "--minutes", "1", "--max-num-seqs", "0"], "range"),
    (["phase-map", "--jobs", "1", "--seeds", "1", "--minutes", "30", "--lam", "0.03", "--burst", "0", "--pool", "0"],
     "above 0"),
    # ports wrapped modulo 65536 by the socket layer
    (["epp", "--port", "0", "--upstream", "http://127.0.0.1:9", "--grpc-port", "99999"], "not a port"),
    (["epp", "--port", "0", "--upstream", "http://127.0.0.1:9", "--envoy-config", "{tmp}/e.yaml",
      "--envoy-listen", "99999"], "not a port"),
    (["epp", "--port", "0", "--upstream", "http://127.0.0.1:9", "--grpc-port", "0", "--envoy-config",
      "{tmp}/e.yaml", "--envoy-listen", "9000"], "give one"),
    # an empty list meant "everything" (hours of runs)
    (["reproduce", "--only", "", "--out", "{tmp}/r"], "no experiments"),
    # a shapes file read at the first tool call: the server started, then answered 500 to every such request
    (["engine", "--port", "0", "--agent-turns", "{tmp}/file"], "invalid JSON"),
    # a run's record that is not one: tracebacks (a list, bytes, a parquet cut short) or a summary made up from nothing
    (["summary", "{tmp}/runs/list"], "not a run's record"),
    (["summary", "{tmp}/runs/bytes"], "unreadable"),
    (["drain", "{tmp}/runs/parquet", "--cost", "1,0.1"], "unreadable"),
    (["summary", "{tmp}/runs/empty"], "nothing to read"),
    # a spec or a profile that is not text: UnicodeDecodeError
    (["sweep", "{tmp}/bytes.toml", "--out", "{tmp}/sw", "--dry-run"], "not text"),
    (["sim", "--minutes", "1", "--profile", "{tmp}/bytes.json"], "not text"),
    (["doctor", "--endpoint", "http://127.0.0.1:9", "--timeout", "0"], "above 0"),
    # an output folder that cannot be made: a FileNotFoundError traceback
    (["sim", "--minutes", "1", "--out", "{tmp}/file/run"], "{tmp}/file"),
]


@pytest.mark.parametrize("args,message", CASES, ids=[" ".join(a[:1] + a[-2:]) for a, _ in CASES])
def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, args: list[str], message: str) -> None:
    (tmp_path / "file").write_text("a file, not a folder\n")
    noise = bytes(range(128, 256)) * 2
    (tmp_path / "bytes.toml").write_bytes(noise)
    (tmp_path / "bytes.json").write_bytes(noise)
    for name, meta in (("list", b"[1, 2]"), ("bytes", noise), ("parquet", b'{"config": {"minutes": 1}}'),
                       ("empty", b"{}")):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "run.json").write_bytes(meta)
    (tmp_path / "runs" / "parquet" / "turns.parquet").write_bytes(b"PAR1" + noise)
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    p = subprocess.run([sys.executable, "-m", "kvgate.cli", *argv], capture_output=True, text=True, timeout=120,
                       cwd=tmp_path)  # (a default output folder is made in the working directory)
    err = p.stderr.strip()
    assert p.returncode == 2, (argv, p.returncode, err[-600:])
    assert "Traceback" not in err and err.startswith("kvgate: error:"), err[-600:]
    assert message.replace("{tmp}", str(tmp_path)) in err, err
    assert not (tmp_path / "r").exists()  # (nothing run)


def test_import_trace_refuses_to_write_over_its_source(tmp_path: Path) -> None:
    trace = tmp_path / "t.jsonl"  # (mini-SWE-agent's usage trace: calls of [t, prompt, completion, cached])
    trace.write_text(json.dumps({"session": "s1", "exit_status": "Submitted",
                                 "calls": [[0, 1662, 106, 0], [4, 5614, 500, 0], [17, 6131, 27, 4058]]}) + "\n")
    before = trace.read_bytes()
    for dst in (trace, tmp_path / "." / "t.jsonl"):
        p = subprocess.run([sys.executable, "-m", "kvgate.cli", "import-trace", str(trace), str(dst)],
                           capture_output=True, text=True, timeout=120)
        assert p.returncode == 2 and "SRC itself" in p.stderr, p.stderr
    assert trace.read_bytes() == before
    out = tmp_path / "shapes.jsonl"  # (and to another file it converts)
    p = subprocess.run([sys.executable, "-m", "kvgate.cli", "import-trace", str(trace), str(out)],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and out.read_text().strip(), p.stderr
