"""final_summary.html in headless Chromium: it loads with no network request but the page
itself, no failed request, no script, and a full-page screenshot is written for review.

Chromium is driven over the DevTools protocol on a pipe (``--remote-debugging-pipe``: fd 3 in,
fd 4 out, NUL-terminated JSON), so the test sees every request the page makes without any
extra package. Skipped when no Chromium is installed (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import base64
import fcntl
import json
import os
import shutil
import subprocess
import time
from pathlib import Path

import pytest

from planted import planted_run
from rundata_factory import rich_run
from traceml.analysis.summary import build_summary
from traceml.report.html import render_html

CHROMIUM = next(
    (p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p),
    None,
)
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed")

#: Viewport width of the screenshots, CSS px.
WIDTH = 1000


def _high_fd(fd: int) -> int:
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10)
    os.close(fd)
    return high


class DevTools:
    """A headless Chromium and its DevTools connection over a pipe."""

    def __init__(self, profile: Path) -> None:
        # Pipe ends at fd >= 10 so that the shell's redirections onto 3 and 4 cannot clash.
        to_chrome_r, self._to_chrome = (_high_fd(fd) for fd in os.pipe())
        self._from_chrome, from_chrome_w = (_high_fd(fd) for fd in os.pipe())
        args = [
            "--headless",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-quic",
            "--no-first-run",
            "--disable-background-networking",
            "--disable-component-update",
            "--disable-sync",
            "--disable-extensions",
            "--remote-debugging-pipe",
            f"--user-data-dir={profile}",
            "about:blank",
        ]
        self.proc = subprocess.Popen(
            ["bash", "-c", f'exec "$0" "$@" 3<&{to_chrome_r} 4>&{from_chrome_w}', CHROMIUM, *args],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            pass_fds=(to_chrome_r, from_chrome_w),
        )
        os.close(to_chrome_r)
        os.close(from_chrome_w)
        self._buffer = b""
        self._next_id = 0
        self.events: list[dict] = []

    def send(
        self,
        method: str,
        params: dict | None = None,
        session: str | None = None,
        timeout_s: float = 30.0,
    ) -> dict:
        self._next_id += 1
        message = {"id": self._next_id, "method": method, "params": params or {}}
        if session:
            message["sessionId"] = session
        os.write(self._to_chrome, json.dumps(message).encode() + b"\0")
        deadline = time.monotonic() + timeout_s
        while True:
            reply = self._read(deadline)
            if reply.get("id") == self._next_id:
                assert "error" not in reply, reply
                return reply["result"]
            self.events.append(reply)

    def wait_event(self, method: str, timeout_s: float = 30.0) -> dict:
        deadline = time.monotonic() + timeout_s
        while True:
            for event in self.events:
                if event.get("method") == method:
                    return event
            self.events.append(self._read(deadline))

    def _read(self, deadline: float) -> dict:
        while b"\0" not in self._buffer:
            if time.monotonic() > deadline:
                raise TimeoutError("no answer from Chromium")
            chunk = os.read(self._from_chrome, 1 << 20)
            if not chunk:
                raise ConnectionError("Chromium closed the DevTools pipe")
            self._buffer += chunk
        message, self._buffer = self._buffer.split(b"\0", 1)
        return json.loads(message)

    def close(self) -> None:
        try:
            self.send("Browser.close", timeout_s=5)
        except (OSError, TimeoutError, ConnectionError):
            pass
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        os.close(self._to_chrome)
        os.close(self._from_chrome)


def load_and_screenshot(html_path: Path, png_path: Path, profile: Path) -> list[dict]:
    """Open ``html_path``; write a full-page PNG; return the page's network events."""
    chrome = DevTools(profile)
    try:
        target = chrome.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = chrome.send("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"
        ]
        chrome.send("Network.enable", session=session)
        chrome.send("Page.enable", session=session)
        chrome.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": WIDTH, "height": 800, "deviceScaleFactor": 1, "mobile": False},
            session=session,
        )
        chrome.send("Page.navigate", {"url": html_path.as_uri()}, session=session)
        chrome.wait_event("Page.loadEventFired")
        height = chrome.send("Page.getLayoutMetrics", session=session)["cssContentSize"]["height"]
        chrome.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": WIDTH, "height": int(height), "deviceScaleFactor": 1, "mobile": False},
            session=session,
        )
        shot = chrome.send("Page.captureScreenshot", {"format": "png"}, session=session)
        png_path.write_bytes(base64.b64decode(shot["data"]))
        return [e for e in chrome.events if e.get("method", "").startswith("Network.")]
    finally:
        chrome.close()


def _check_page(html_path: Path, tmp_path: Path, name: str) -> Path:
    html = html_path.read_text()
    assert "<script" not in html.lower() and "http://" not in html and "https://" not in html
    png = tmp_path / f"{name}.png"
    events = load_and_screenshot(html_path, png, tmp_path / f"profile-{name}")
    requested = [
        e["params"]["request"]["url"] for e in events if e["method"] == "Network.requestWillBeSent"
    ]
    failed = [e["params"] for e in events if e["method"] == "Network.loadingFailed"]
    assert requested == [html_path.as_uri()]
    assert failed == []
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 20_000
    print(f"screenshot for review: {png}")
    return png


@pytest.mark.slow
def test_real_run_report_loads_offline(tmp_path, tmp_path_factory):
    run = planted_run("input_straggler", tmp_path_factory.getbasetemp() / "planted")
    html = run.run_dir / "final_summary.html"
    text = html.read_text()
    for heading in (
        "Verdict",
        "Step time per rank",
        "Phase breakdown per rank",
        "Memory over the run",
        "Nodes",
        "Rank end states",
    ):
        assert f"<h2>{heading}" in text, heading
    assert "INPUT_STRAGGLER · rank 1" in text
    _check_page(html, tmp_path, "input_straggler")


def test_gpu_multi_node_report_loads_offline(tmp_path):
    html = tmp_path / "final_summary.html"
    html.write_text(render_html(build_summary(rich_run())))
    text = html.read_text()
    assert text.count("<svg") == 3  # step time, phases, memory
    assert "COMPUTE_STRAGGLER · rank 6" in text and "MEMORY_CREEP" in text
    _check_page(html, tmp_path, "gpu_multi_node")
