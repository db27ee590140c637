"""A headless Chromium driven over the DevTools protocol on a pipe, for the page tests.

``--remote-debugging-pipe``: fd 3 in, fd 4 out, NUL-terminated JSON, so a test sees every
request a page makes and can read its DOM without any extra package (Debian: ``apt-get
install chromium``; :data:`CHROMIUM` is None when none is installed).
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

CHROMIUM = next(
    (p for p in (shutil.which(n) for n in ("chromium", "chromium-browser", "google-chrome")) if p),
    None,
)


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

    def open_page(self, url: str, width: int) -> str:
        """A new tab of ``width`` CSS px (network and page events on) at ``url``, once its load
        event fired; its DevTools session id."""
        target = self.send("Target.createTarget", {"url": "about:blank"})["targetId"]
        session = self.send("Target.attachToTarget", {"targetId": target, "flatten": True})[
            "sessionId"
        ]
        self.send("Network.enable", session=session)
        self.send("Page.enable", session=session)
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": 800, "deviceScaleFactor": 1, "mobile": False},
            session=session,
        )
        self.send("Page.navigate", {"url": url}, session=session)
        self.wait_event("Page.loadEventFired")
        return session

    def evaluate(self, session: str, expression: str):
        """The value of a JavaScript ``expression`` in the page (JSON-serialisable)."""
        reply = self.send(
            "Runtime.evaluate", {"expression": expression, "returnByValue": True}, session=session
        )
        assert "exceptionDetails" not in reply, reply
        return reply["result"].get("value")

    def screenshot(self, session: str, png_path: Path, width: int) -> None:
        """Write the whole page (its full height, ``width`` CSS px) to ``png_path``."""
        height = self.send("Page.getLayoutMetrics", session=session)["cssContentSize"]["height"]
        self.send(
            "Emulation.setDeviceMetricsOverride",
            {"width": width, "height": int(height), "deviceScaleFactor": 1, "mobile": False},
            session=session,
        )
        shot = self.send("Page.captureScreenshot", {"format": "png"}, session=session)
        png_path.write_bytes(base64.b64decode(shot["data"]))

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
