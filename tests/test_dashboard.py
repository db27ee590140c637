"""The browser dashboard, for real: ``traceml run --mode dashboard`` of a 2-rank job with a
planted input straggler, opened in headless Chromium while it trains, then
``traceml view RUN_DIR --serve`` over the stored run.

The live page must show both ranks, a step-time chart whose point count grows between two
looks, and the planted finding; it must load nothing but its own origin. A screenshot is saved
in ``$TRACEML_TEST_ARTIFACTS`` (else the test's tmp dir); with ``TRACEML_UPDATE_DOCS=1`` it
also replaces docs/dashboard.png. A wrong or missing token is answered 401 with a one-line
body. Skipped when no Chromium is installed (Debian: ``apt-get install chromium``).
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from chromium import CHROMIUM, DevTools
from conftest import ROOT, SCRIPTS, free_port, load_summary, traceml_cmd, traceml_env

pytestmark = [
    pytest.mark.torchrun,
    pytest.mark.browser,
    pytest.mark.slow,
    pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed"),
]

STEPS = 600
STATIC = ROOT / "traceml_aggregator" / "dashboard" / "static"
WIDTH = 1200
URL_LINE = re.compile(
    r"dashboard(?: of the stored run \S+)?: (http://\S+/) \(open the link in (\S+), mode 0600"
)
#: What the test reads of the page: the ranks' rows, the step chart's points, the findings.
LOOK = """JSON.stringify({
  ranks: [...document.querySelectorAll('#ranks tr[data-rank]')].map(r => +r.dataset.rank),
  points: +(document.getElementById('chart-steps').dataset.points || 0),
  canvases: document.querySelectorAll('#chart-steps canvas').length,
  verdict: document.getElementById('verdict').dataset.kind || null,
  findings: [...document.querySelectorAll('#findings li[data-kind]')].map(li => li.dataset.kind),
  nodes: [...document.querySelectorAll('#nodes tr[data-node]')].map(r => r.cells[3].textContent),
  frames: +(document.body.dataset.frames || 0),
})"""


def opened(m: re.Match, lines: list[str]) -> tuple[str, str]:
    """``(link, token)`` of the dashboard whose line ``m`` (of :data:`URL_LINE`) named the link
    file: the printed URL with the token, read from that file (mode 0600); no line printed
    holds the token."""
    link_file = Path(m.group(2))
    assert link_file.stat().st_mode & 0o777 == 0o600
    link = link_file.read_text().strip()
    url, token = link.split("?token=")
    assert url == m.group(1) and len(token) == 43
    assert not any(token in line for line in lines)
    return link, token


class Lines:
    """The lines a process writes to a pipe, collected by a thread."""

    def __init__(self, stream) -> None:
        self.lines: list[str] = []
        self._thread = threading.Thread(target=self._read, args=(stream,), daemon=True)
        self._thread.start()

    def _read(self, stream) -> None:
        for line in stream:
            self.lines.append(line)

    def wait_for(self, pattern: re.Pattern, process: subprocess.Popen, timeout_s: float):
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            for line in self.lines:
                if (m := pattern.search(line)) is not None:
                    return m
            assert process.poll() is None, self.told()
            time.sleep(0.1)
        raise AssertionError(f"no line matching {pattern.pattern}: {self.told()}")

    def told(self) -> str:
        """The lines so far, and the logs they point at ("see PATH.log")."""
        text = "".join(self.lines)
        for log in sorted(set(re.findall(r"see (\S+\.log)\)", text))):
            text += f"\n--- {log}:\n{Path(log).read_text(errors='replace')[-4000:]}"
        return text


def _get(url: str) -> tuple[int, bytes]:
    try:
        with urllib.request.urlopen(url, timeout=10) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def _assert_token_required(base: str, token: str) -> None:
    """Every route but the static files answers 401 without ``token`` (one line)."""
    for path in ("/", "/api/frame", "/api/events", "/static/../api/frame", "/nothing"):
        for query in ("", "?token=wrong", "?token=", f"?token={token[:-1]}"):
            status, body = _get(base + path + query)
            assert status == 401, (path, query, status)
            assert body.decode().count("\n") == 1 and body.startswith(b"401 Unauthorized: ")
    status, body = _get(f"{base}/static/uplot/uPlot.iife.min.js")  # no run data: no token
    assert status == 200 and body == (STATIC / "uplot" / "uPlot.iife.min.js").read_bytes()


def _look(chrome: DevTools, session: str) -> dict:
    return json.loads(chrome.evaluate(session, LOOK))


def _wait_look(chrome, session, ok, timeout_s: float) -> dict:
    deadline = time.monotonic() + timeout_s
    while True:
        look = _look(chrome, session)
        if ok(look) or time.monotonic() > deadline:
            return look
        time.sleep(0.25)


def _requested(chrome: DevTools) -> list[str]:
    return [
        e["params"]["request"]["url"]
        for e in chrome.events
        if e.get("method") == "Network.requestWillBeSent"
    ]


def _artifact_dir(tmp_path: Path) -> Path:
    where = Path(os.environ.get("TRACEML_TEST_ARTIFACTS") or tmp_path)
    where.mkdir(parents=True, exist_ok=True)
    return where


def _start(args: list[str], cwd: Path) -> tuple[subprocess.Popen, Lines]:
    """``traceml ARGS`` in ``cwd``, and the lines of its stderr."""
    process = subprocess.Popen(
        traceml_cmd() + args,
        cwd=cwd,
        env=traceml_env(launcher=True),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    return process, Lines(process.stderr)


def _stop(process: subprocess.Popen) -> None:
    if process.poll() is None:
        process.kill()
        process.wait()


def test_live_dashboard_then_stored_run(tmp_path):
    port, dashboard_port = free_port(), free_port()
    launcher, err = _start(
        [
            "run",
            str(SCRIPTS / "planted_ddp.py"),
            "--nproc-per-node=2",
            "--mode=dashboard",
            f"--dashboard-port={dashboard_port}",
            f"--aggregator-port={port}",
            "--run-name=dash",
            f"--logs-dir={tmp_path / 'logs'}",
            "--",
            "--scenario",
            "input_straggler",
            "--steps",
            str(STEPS),
            "--delay-ms",
            "20",
        ],
        tmp_path,
    )
    chrome = None
    try:
        m = err.wait_for(URL_LINE, launcher, 120)
        url, token = opened(m, err.lines)
        origin = f"http://127.0.0.1:{dashboard_port}/"
        assert url == f"{origin}?token={token}"
        assert sum(bool(URL_LINE.search(line)) for line in err.lines) == 1  # printed once
        _assert_token_required(origin.rstrip("/"), token)

        chrome = DevTools(tmp_path / "profile")
        session = chrome.open_page(url, WIDTH)
        first = _wait_look(chrome, session, lambda k: k["ranks"] == [0, 1] and k["points"], 60)
        assert first["ranks"] == [0, 1] and first["points"] > 0 and first["canvases"] == 1, first
        second = _wait_look(chrome, session, lambda k: k["points"] > first["points"], 30)
        assert second["points"] > first["points"], (first, second)
        found = _wait_look(chrome, session, lambda k: k["verdict"] == "INPUT_STRAGGLER", 60)
        assert found["verdict"] == "INPUT_STRAGGLER", found
        assert "INPUT_STRAGGLER" in found["findings"] and found["nodes"] == ["running"], found
        assert launcher.poll() is None  # all of it while the job trains
        png = _artifact_dir(tmp_path) / "dashboard.png"
        chrome.screenshot(session, png, WIDTH)
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 30_000
        if os.environ.get("TRACEML_UPDATE_DOCS") == "1":
            shutil.copyfile(png, ROOT / "docs" / "dashboard.png")
        print(f"screenshot for review: {png}")
        requested = _requested(chrome)
        assert requested and all(u.startswith(origin) for u in requested), requested
        # One page load and one event stream: the page updated itself, never reloaded.
        assert (
            requested.count(url) == 1 and requested.count(f"{origin}api/events?token={token}") == 1
        )
        assert found["frames"] > first["frames"] >= 1
        chrome.close()
        chrome = None
        assert launcher.wait(240) == 0, "".join(err.lines)
    finally:
        if chrome is not None:
            chrome.close()
        _stop(launcher)
    run_dir = tmp_path / "logs" / "dash"
    summary = load_summary(run_dir)
    assert summary["primary_diagnosis"]["kind"] == "INPUT_STRAGGLER"

    # After the run: the same page over the stored run (a fresh token: the process's own).
    stored_files = sorted(p.name for p in run_dir.iterdir())
    view_port = free_port()
    view, err = _start(["view", str(run_dir), "--serve", f"--port={view_port}"], tmp_path)
    chrome = None
    try:
        m = err.wait_for(URL_LINE, view, 60)
        url, token = opened(m, err.lines)
        origin = f"http://127.0.0.1:{view_port}"
        _assert_token_required(origin, token)
        status, body = _get(f"{origin}/api/frame?token={token}")
        assert status == 200
        frame = json.loads(body)
        assert frame["run"] == {
            **frame["run"],
            "run_name": "dash",
            "world_size": 2,
            "live": False,
            "status": "completed",
        }
        assert [r["rank"] for r in frame["ranks"]] == [0, 1]
        assert [r["steps"] for r in frame["ranks"]] == [STEPS, STEPS]
        assert {r: len(s["step"]) for r, s in frame["steps"].items()} == {"0": STEPS, "1": STEPS}
        assert frame["steps"]["1"]["step"] == list(range(STEPS))
        assert frame["verdict"]["kind"] == "INPUT_STRAGGLER"
        assert frame["verdict"]["summary"] == summary["primary_diagnosis"]["summary"]
        assert [n["state"] for n in frame["nodes"]] == ["exited 0"]
        chrome = DevTools(tmp_path / "profile-view")
        session = chrome.open_page(url, WIDTH)
        look = _wait_look(chrome, session, lambda k: k["points"] == 2 * STEPS, 30)
        assert look["ranks"] == [0, 1] and look["points"] == 2 * STEPS, look
        assert look["verdict"] == "INPUT_STRAGGLER" and look["nodes"] == ["exited 0"], look
        assert all(u.startswith(origin) for u in _requested(chrome))
        chrome.close()
        chrome = None
        view.send_signal(signal.SIGINT)
        assert view.wait(20) == 0, "".join(err.lines)
    finally:
        if chrome is not None:
            chrome.close()
        _stop(view)
    assert sorted(p.name for p in run_dir.iterdir()) == stored_files  # read-only: no -wal, -shm


def _view_serve_refusal(run_dir) -> str:
    """The whole stderr of ``traceml view RUN_DIR --serve`` (a free port), which must refuse
    the directory (exit code 2)."""
    result = subprocess.run(
        traceml_cmd() + ["view", str(run_dir), "--serve", f"--port={free_port()}"],
        env=traceml_env(launcher=True),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    return result.stderr


def test_view_serve_refuses_a_directory_without_a_store(tmp_path):
    assert _view_serve_refusal(tmp_path) == (
        f"traceml: error: {tmp_path} holds no TraceML store (telemetry.sqlite)\n"
    )


def test_view_serve_refuses_a_file_that_is_not_a_database(tmp_path):
    """The same one line as ``traceml-aggregator --finalize-only``'s for the same file
    (traceml_aggregator.store.open_run_store)."""
    (tmp_path / "telemetry.sqlite").write_bytes(random.Random(7).randbytes(64 * 1024))
    assert _view_serve_refusal(tmp_path) == (
        f"traceml: error: cannot read {tmp_path / 'telemetry.sqlite'}: file is not a database\n"
    )


def test_two_nodes_one_dashboard(tmp_path):
    """Two launchers on this machine (2 nodes x 1 rank): node 0's dashboard shows both nodes
    and both ranks while they train, at the URL node 0 printed (every interface, by name)."""
    port, dashboard_port, logs = free_port(), free_port(), tmp_path / "logs"
    common = [
        "run",
        str(SCRIPTS / "faulty_ddp.py"),
        "--nnodes=2",
        "--nproc-per-node=1",
        "--run-name=two",
        "--master-addr=127.0.0.1",
        f"--master-port={free_port()}",
        f"--aggregator-port={port}",
        f"--logs-dir={logs}",
        "--mode=dashboard",
        f"--dashboard-port={dashboard_port}",
    ]
    script = ["--", "--steps", "300", "--step-sleep", "0.05"]
    node1, err1 = _start(common + ["--node-rank=1"] + script, tmp_path)
    node0, err0 = _start(common + ["--node-rank=0"] + script, tmp_path)
    try:
        m = err0.wait_for(URL_LINE, node0, 120)
        link, token = opened(m, err0.lines + err1.lines)
        assert link == f"http://{socket.gethostname()}:{dashboard_port}/?token={token}"
        frame_url = f"http://127.0.0.1:{dashboard_port}/api/frame?token={token}"
        deadline = time.monotonic() + 120
        while True:
            frame = json.loads(_get(frame_url)[1])
            placed = {r["rank"]: r["node_rank"] for r in frame["ranks"] if r["steps"]}
            states = [(n["node_rank"], n["state"]) for n in frame["nodes"]]
            if placed == {0: 0, 1: 1} and states == [(0, "running"), (1, "running")]:
                break
            assert time.monotonic() < deadline, frame
            time.sleep(0.5)
        assert sorted(frame["steps"]) == ["0", "1"] and sorted(frame["system"]) == ["0", "1"]
        assert not any(URL_LINE.search(line) for line in err1.lines)  # node 1 serves no page
        assert node0.wait(240) == 0, "".join(err0.lines)
        assert node1.wait(60) == 0, "".join(err1.lines)
    finally:
        _stop(node0)
        _stop(node1)
