"""Every server command refuses a port out of range and an address it cannot listen on at start: one line naming
the option, exit 2, before it serves or contacts anything (``--port 99999`` was wrapped by the socket layer into
port 34463, or ended in a traceback; an upstream on port 0 was taken). (A corrupt state DB at start:
``tests/gateway/test_store_corrupt.py``.)"""

from __future__ import annotations

import os
import subprocess
import sys

import click
import pytest

from kvgate.options import BIND_ADDRESS, PORT, url_host

UPSTREAM = ["--upstream", "http://127.0.0.1:9", "--kv-pool", "100000"]
"""(An upstream nobody listens on: the gateway would serve regardless, with its pool given.)"""

CASES = {
    "gateway-port-high": (["gateway", *UPSTREAM, "--port", "99999"], "--port"),
    "gateway-port-negative": (["gateway", *UPSTREAM, "--port", "-1"], "--port"),
    "gateway-host": (["gateway", *UPSTREAM, "--host", "999.1.1.1", "--port", "0"], "--host"),
    "gateway-upstream-port-0": (["gateway", "--upstream", "http://127.0.0.1:0", "--kv-pool", "100000", "--port", "0"],
                                "--upstream"),
    "engine-port-high": (["engine", "--port", "99999"], "--port"),
    "engine-host-empty": (["engine", "--host", "", "--port", "0"], "--host"),
    "engine-host-space": (["engine", "--host", "a b", "--port", "0"], "--host"),
    "real-vllm-port": (["real-vllm", "serve", "--kv-pool", "1024", "--port", "65536"], "--port"),
    "real-sglang-port": (["real-sglang", "serve", "--kv-pool", "1024", "--port", "70000"], "--port"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_server_command_refuses_a_bad_port_or_address(case: str) -> None:
    argv, option = CASES[case]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (os.environ.get("PYTHONPATH"), "src") if p)}
    try:
        r = subprocess.run([sys.executable, "-m", "kvgate.cli", *argv], env=env, capture_output=True, text=True,
                           timeout=60)
    except subprocess.TimeoutExpired as e:  # (it served)
        pytest.fail(f"kvgate {' '.join(argv)} started serving: {e.stderr!r:.500}")
    err = r.stderr.strip()
    assert r.returncode == 2, err[-2000:]
    assert "Traceback" not in err and len(err.splitlines()) == 1, err[-2000:]
    assert option in err and err.startswith("kvgate: error:"), err


def test_ports_and_addresses_as_the_options_read_them() -> None:
    for good in ("0", "1", "8000", "65535", 443):
        assert PORT.convert(good, None, None) == int(good)
    for bad in ("65536", "99999", "-1", "abc", "", "8e3"):
        with pytest.raises(click.BadParameter):
            PORT.convert(bad, None, None)
    for text, read in (("127.0.0.1", "127.0.0.1"), ("0.0.0.0", "0.0.0.0"), ("::1", "::1"), ("[::1]", "::1"),
                       ("::", "::"), ("localhost", "localhost"), ("gw-1.internal.example", "gw-1.internal.example"),
                       ("host.", "host.")):
        assert BIND_ADDRESS.convert(text, None, None) == read
    for bad in ("", " ", "999.1.1.1", "1.2.3", "a b", "-bad.example", "x_y", "http://h", "h:80", "a..b",
                "a" * 64):
        with pytest.raises(click.BadParameter):
            BIND_ADDRESS.convert(bad, None, None)
    assert (url_host("::1"), url_host("127.0.0.1")) == ("[::1]", "127.0.0.1")
