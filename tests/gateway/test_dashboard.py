"""The gateway's live page in headless Chromium (Debian's ``chromium``; ``.ci/install-browser.sh``), under a driven
load: ``kvgate drive`` -> ``kvgate gateway`` -> ``kvgate engine`` at a time scale, as real processes. The page must
load, poll, and show the gateway's numbers changing without a reload; the admin token guards it.

``KVGATE_DASHBOARD_SHOT=path.png`` also saves the last screenshot there (docs/dashboard.png is made so)."""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import aiohttp
import pytest

from kvgate.gateway.dashboard import park_waits, quantile
from support.ports import free_port, wait_health

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
SCALE = 60.0
TOKEN = "s3cret"


def test_quantile_of_a_histogram() -> None:
    bounds = (1.0, 2.0, 5.0)
    assert quantile(bounds, [0, 0, 0, 0], 0.5) is None
    assert quantile(bounds, [1, 1, 0, 0], 0.5) == 1.0
    assert quantile(bounds, [1, 1, 0, 0], 0.9) == 2.0
    assert quantile(bounds, [0, 0, 0, 3], 0.9) == float("inf")
    pw = park_waits(bounds, [0, 2, 2, 0], 10.0)
    assert pw == {"count": 4, "mean_s": 2.5, "p50_le_s": 2.0, "p90_le_s": 5.0}


def _get(url: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers or {}), timeout=10) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


class Browser:
    """Headless Chromium driven over the DevTools protocol (one page)."""

    def __init__(self) -> None:
        assert CHROMIUM is not None
        self.dir = tempfile.mkdtemp(prefix="kvgate-chromium-")
        self.proc = subprocess.Popen(
            [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
             "--no-first-run", "--no-default-browser-check", "--disable-dev-shm-usage", f"--user-data-dir={self.dir}",
             "--remote-debugging-address=127.0.0.1", "--remote-debugging-port=0", "--window-size=1100,760",
             "about:blank"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        self.ws: aiohttp.ClientWebSocketResponse | None = None
        self.http: aiohttp.ClientSession | None = None
        self._id = 0

    async def open(self) -> None:
        port_file = Path(self.dir) / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not port_file.exists() or not port_file.read_text().strip():
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise AssertionError("chromium did not start its DevTools endpoint")
            await asyncio.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        self.http = aiohttp.ClientSession()
        async with self.http.get(f"http://127.0.0.1:{port}/json/list") as r:
            pages = [t for t in await r.json() if t["type"] == "page"]
        self.ws = await self.http.ws_connect(pages[0]["webSocketDebuggerUrl"], max_msg_size=64 * 1024 * 1024)

    async def call(self, method: str, **params: Any) -> dict[str, Any]:
        assert self.ws is not None
        self._id += 1
        mid = self._id
        await self.ws.send_json({"id": mid, "method": method, "params": params})
        while True:
            msg = await self.ws.receive_json(timeout=30)
            if msg.get("id") == mid:
                if "error" in msg:
                    raise AssertionError(f"{method}: {msg['error']}")
                return msg["result"]  # type: ignore[no-any-return]

    async def eval(self, expr: str) -> Any:
        r = await self.call("Runtime.evaluate", expression=expr, returnByValue=True)
        return r["result"].get("value")

    async def text(self, *ids: str) -> dict[str, str]:
        return await self.eval("({" + ",".join(f'"{i}": document.getElementById("{i}").textContent' for i in ids)
                               + "})")

    async def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.ws is not None:
                await self.ws.close()
        if self.http is not None:
            await self.http.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=15)
        shutil.rmtree(self.dir, ignore_errors=True)


FIELDS = ("polls", "hit5", "hit1", "dc", "in_system", "admitted", "parked", "alarm", "finished", "control", "now")


@pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (.ci/install-browser.sh installs it)")
@pytest.mark.slow
def test_dashboard_updates_live_in_headless_chromium(tmp_path: Path) -> None:
    py = [sys.executable, "-m", "kvgate.cli"]
    ep, gp = free_port(), free_port()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        eng = subprocess.Popen([*py, "engine", "--port", str(ep), "--time-scale", str(SCALE), "--kv-pool", "150000"],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(eng)
        wait_health(ep, eng)
        gw = subprocess.Popen([*py, "gateway", "--upstream", f"http://127.0.0.1:{ep}", "--port", str(gp),
                               "--time-scale", str(SCALE), "--log-level", "warning", "--admin-token", TOKEN,
                               "--control", "none"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        procs.append(gw)
        wait_health(gp, gw)
        base = f"http://127.0.0.1:{gp}"
        # the admin token guards the page and its data; a wrong one is refused as JSON
        status, body = _get(base + "/dashboard")
        assert status == 401 and json.loads(body)["error"]["type"]
        assert _get(base + "/kvgate/dashboard.json?token=wrong")[0] == 401
        status, page = _get(base + f"/dashboard?token={TOKEN}")
        assert status == 200 and b"<canvas" in page
        assert b"http://" not in page and b"https://" not in page  # self-contained: nothing from elsewhere
        drive = subprocess.Popen(
            [*py, "drive", "--endpoint", base, "--lam", "0.06", "--minutes", "30", "--seed", "3",
             "--time-scale", str(SCALE), "--out", str(tmp_path / "run")],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        procs.append(drive)
        seen = asyncio.run(_watch(base + f"/dashboard?token={TOKEN}", drive))
        status, body = _get(base + "/kvgate/dashboard.json", {"X-Admin-Token": TOKEN})
        assert status == 200
        final = json.loads(body)
    finally:
        for p in reversed(procs):
            if p.poll() is None:
                p.terminate()
                p.wait(timeout=20)
    first, last = seen[0], seen[-1]
    assert int(last["polls"]) > int(first["polls"]) >= 1  # it polls without a reload
    assert last["control"] == "none"
    assert float(last["now"]) > float(first["now"])
    # under the load the numbers move: turns finish, sessions come and go, the hit ratio and D/C show up
    assert int(last["finished"]) > int(first["finished"])
    assert len({(s["in_system"], s["dc"], s["hit5"]) for s in seen}) > 1
    assert any(s["hit5"] != "-" for s in seen) and any(float(s["dc"]) > 0 for s in seen if s["dc"] != "-")
    # what the page shows is the gateway's own data (read after the browser's last poll: never behind it)
    assert final["turns"].get("finished", 0) >= int(last["finished"])
    assert final["control"] == last["control"]


async def _watch(url: str, drive: subprocess.Popen[bytes]) -> list[dict[str, str]]:
    b = Browser()
    try:
        await b.open()
        await b.call("Page.enable")
        await b.call("Emulation.setDeviceMetricsOverride", width=1100, height=760, deviceScaleFactor=1, mobile=False)
        await b.call("Page.navigate", url=url)
        seen: list[dict[str, str]] = []
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(seen) < 40:
            await asyncio.sleep(0.5)
            got = await b.eval("document.getElementById('polls') ? 1 : 0")
            if not got:
                continue
            seen.append(await b.text(*FIELDS))
            if drive.poll() is not None:
                break
        shot = base64.b64decode((await b.call("Page.captureScreenshot", format="png"))["data"])
        assert shot[:8] == b"\x89PNG\r\n\x1a\n"
        out = os.environ.get("KVGATE_DASHBOARD_SHOT")
        if out:
            Path(out).write_bytes(shot)
        return seen
    finally:
        await b.close()
