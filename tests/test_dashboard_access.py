"""The dashboard's access (issue 24.5): the run token is never printed, the page is opened
through a link written to the run directory (mode 0600), it is served over the run's TLS when
the aggregator has a certificate, and a standalone aggregator restarted on its run directory
keeps the run's token, so ranks that still send with it are not locked out.

No browser: an HTTPS client that trusts the run's certificate (the CA the ranks get) is what a
browser would do."""

from __future__ import annotations

import json
import re
import ssl
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
from conftest import SCRIPTS, free_port, load_summary, make_cert, start_traceml
from helpers.waiting import LOADED_CALL_S
from live_aggregator import LiveAggregator

from traceml import wire
from traceml.core import endpoint, transport

pytestmark = [pytest.mark.slow, pytest.mark.torchrun, pytest.mark.aggregator]

LINE = re.compile(r"dashboard: (https://127\.0\.0\.1:(\d+)/) \(open the link in (\S+), mode 0600")
#: Files of a run directory that hold the token on purpose (mode 0600), and the store.
PRIVATE = {"run_token", "dashboard_link"}


def get(url: str, context: ssl.SSLContext | None = None) -> tuple[int, bytes]:
    try:
        # the first frame waits on the live analysis (nice 19): late on a loaded machine
        with urllib.request.urlopen(url, timeout=LOADED_CALL_S, context=context) as reply:
            return reply.status, reply.read()
    except urllib.error.HTTPError as exc:
        return exc.code, exc.read()


def wait_for_line(path: Path, pattern: re.Pattern, process, timeout_s: float) -> re.Match:
    deadline = time.monotonic() + timeout_s
    while True:
        m = pattern.search(path.read_text(errors="replace") if path.exists() else "")
        if m:
            return m
        assert process.poll() is None, path.read_text(errors="replace")[-3000:]
        assert time.monotonic() < deadline, path.read_text(errors="replace")[-3000:]
        time.sleep(0.2)


def test_a_dashboard_run_over_tls_prints_no_token(tmp_path):
    cert, key = make_cert(tmp_path, "aggregator")
    logs, dashboard_port = tmp_path / "logs", free_port()
    launcher = start_traceml(
        [
            "run",
            str(SCRIPTS / "faulty_ddp.py"),
            "--nproc-per-node=2",
            "--run-name=dash-tls",
            f"--logs-dir={logs}",
            f"--aggregator-port={free_port()}",
            "--mode=dashboard",
            f"--dashboard-port={dashboard_port}",
            f"--tls-cert={cert}",
            f"--tls-key={key}",
            "--",
            "--steps",
            "200",
            "--step-sleep",
            "0.05",
        ],
        tmp_path,
        tmp_path / "launcher",
    )
    try:
        m = wait_for_line(tmp_path / "launcher.err", LINE, launcher, 120)
        url, port, link_file = m.group(1), int(m.group(2)), Path(m.group(3))
        run_dir = logs / "dash-tls"
        assert port == dashboard_port and link_file == run_dir / "dashboard_link"
        assert link_file.stat().st_mode & 0o777 == 0o600
        token = (run_dir / "run_token").read_text().strip()
        assert link_file.read_text() == f"{url}?token={token}\n"
        context = ssl.create_default_context(cafile=str(cert))
        status, body = get(f"{url}api/frame?token={token}", context)
        assert status == 200 and json.loads(body)["run"]["run_name"] == "dash-tls"
        assert get(f"{url}api/frame?token=wrong", context)[0] == 401
        with pytest.raises((urllib.error.URLError, ConnectionError)):  # no plain HTTP
            get(f"http://127.0.0.1:{port}/api/frame?token={token}")
        assert launcher.wait(240) == 0, (tmp_path / "launcher.err").read_text()[-3000:]
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait()
    summary = load_summary(run_dir)
    assert {r["rank"]: r["steps_completed"] for r in summary["ranks"]} == {0: 200, 1: 200}
    # The token is in its two private files only: not on the console, not in any log.
    printed = [tmp_path / "launcher.out", tmp_path / "launcher.err"] + [
        p
        for p in run_dir.rglob("*")
        if p.is_file() and p.name not in PRIVATE and not p.name.startswith("telemetry.sqlite")
    ]
    assert len(printed) > 5
    assert [p for p in printed if token.encode() in p.read_bytes()] == []


def test_a_restarted_aggregator_keeps_the_run_directorys_token(tmp_path, monkeypatch):
    monkeypatch.delenv("TRACEML_RUN_TOKEN")  # the aggregator makes the run's own
    agg = LiveAggregator(tmp_path / "run", "keep", world_size=1)
    with agg:
        token = transport.read_token_file(tmp_path / "run" / "run_token")
        assert token is not None and token not in agg.log()
        credentials = transport.Credentials(token=token)
        for seq in (1, 2):
            if seq == 2:
                assert agg.stop() == 0
                agg.start()  # the same run directory, no TRACEML_RUN_TOKEN
            batch = wire.Batch(run_name="keep", rank=0, seq=seq)
            ack = endpoint.call(agg.target, "Push", batch, 10.0, credentials)
            assert ack.stored_seq == seq and not ack.rejected, ack
        assert transport.read_token_file(tmp_path / "run" / "run_token") == token
        assert "run token read from" in agg.log() and token not in agg.log()
        assert agg.stop() == 0
