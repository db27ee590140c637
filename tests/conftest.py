"""Shared fixtures: free ports, running `traceml run` for real, reading its artifacts."""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
EXAMPLES = ROOT / "examples"


#: The run token of the aggregators the tests start themselves (tests/live_aggregator.py): the
#: test process, and the scripts it runs under plain torchrun, play that run's own processes,
#: so they carry it through the environment, as the ranks of a real run do.
TEST_RUN_TOKEN = "traceml-test-run-token"
os.environ["TRACEML_RUN_TOKEN"] = TEST_RUN_TOKEN


#: gRPC C-core log lines (glog style: "E0521 12:00:00.000000 123 fork_posix.cc:75] ..."), and
#: anything else that names gRPC, absl or an HTTP/2 GOAWAY (``too_many_pings``).
GRPC_LINE = re.compile(
    r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+\.(cc|h|cpp):\d+\]|grpc|absl|goaway|too_many_pings",
    re.IGNORECASE,
)


def free_port() -> int:
    """A TCP port that is free on 127.0.0.1 right now (tests never use the defaults)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def traceml_cmd() -> list[str]:
    """The `traceml` command of the environment running the tests."""
    return [sys.executable, "-m", "traceml"]


def traceml_env(env: dict | None = None, *, launcher: bool = False) -> dict:
    """The test process's environment without a TraceML endpoint, plus ``env``; for a
    ``launcher`` (``traceml run``) also without the tests' run token: it makes its own."""
    full_env = dict(os.environ)
    full_env.pop("TRACEML_AGGREGATOR", None)
    full_env.pop("TRACEML_RUN_NAME", None)
    if launcher:
        full_env.pop("TRACEML_RUN_TOKEN", None)
    full_env.update(env or {})
    return full_env


def run_traceml(args: list[str], cwd: Path, *, timeout: float = 240, env: dict | None = None):
    """Run `traceml ARGS` in ``cwd``; returns the CompletedProcess (text, captured)."""
    return subprocess.run(
        traceml_cmd() + args,
        cwd=cwd,
        env=traceml_env(env, launcher=True),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_traceml(args: list[str], cwd: Path, log_prefix: Path, *, env: dict | None = None,
                  prefix: list[str] | None = None) -> subprocess.Popen:
    """Start `traceml ARGS` in ``cwd`` (after the command words ``prefix``, such as
    ``ip netns exec NS``) with stdout and stderr in ``<log_prefix>.out``/``.err``."""
    with open(f"{log_prefix}.out", "wb") as out, open(f"{log_prefix}.err", "wb") as err:
        return subprocess.Popen(
            (prefix or []) + traceml_cmd() + args,
            cwd=cwd,
            env=traceml_env(env, launcher=True),
            stdin=subprocess.DEVNULL,
            stdout=out,
            stderr=err,
        )


def load_summary(run_dir: Path) -> dict:
    """``final_summary.json`` of a run directory."""
    return json.loads((run_dir / "final_summary.json").read_text())


def query(run_dir: Path, sql: str, params: tuple = ()) -> list[tuple]:
    """Rows of ``sql`` on the run's SQLite database (after the aggregator closed it).

    The connection is closed on return: an open one keeps a shared lock (WAL mode) that would
    stop an aggregator from reopening the database.
    """
    with contextlib.closing(sqlite3.connect(run_dir / "telemetry.sqlite")) as db:
        return db.execute(sql, params).fetchall()


@pytest.fixture
def port() -> int:
    """A free aggregator port."""
    return free_port()


def assert_rejected(tmp_path, args: list[str], expected: str, *, marker: str) -> None:
    """Run ``traceml run ARGS`` in an empty ``tmp_path/cwd`` and check the refusal.

    ``marker`` is a string only this invocation's processes would carry on their command line
    (its run name or port): no process may carry it afterwards.
    """
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    result = run_traceml(["run", *args], cwd, timeout=60)
    assert result.returncode == 2, result.stderr
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("traceml: error: ") and expected in lines[0], lines[0]
    assert result.stdout == ""
    assert list(cwd.iterdir()) == []  # no logs dir, no run dir (not even ../<name>)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cwd"]
    started = [
        p.info["pid"]
        for p in psutil.process_iter(["pid", "cmdline"])
        if any(marker in part for part in (p.info["cmdline"] or []))
    ]
    assert started == []


def wait_training_started(run_dir: Path, launcher: subprocess.Popen, err_path: Path,
                          timeout_s: float = 240) -> None:
    """Wait until rank 0 of ``tests/scripts/faulty_ddp.py`` began its first step (its line
    in node 0's training log); fails if the launcher exits first (with its stderr)."""
    import time

    log = run_dir / "nodes" / "node_0" / "training.stdout.log"
    deadline = time.monotonic() + timeout_s
    while not (log.exists() and "faulty_ddp: training" in log.read_text()):
        assert launcher.poll() is None, err_path.read_text()
        assert time.monotonic() < deadline, "training never started"
        time.sleep(0.1)


def aggregator_of(launcher: subprocess.Popen) -> psutil.Process:
    """Node 0's aggregator process under ``launcher`` (waits up to 60 s for it)."""
    import time

    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        for child in psutil.Process(launcher.pid).children(recursive=True):
            if "traceml_aggregator" in " ".join(child.cmdline()):
                return child
        time.sleep(0.2)
    raise AssertionError("no aggregator process")


def process_family(pid: int) -> list[psutil.Process]:
    """``pid`` and every process under it (torchrun's ranks, node 0's aggregator)."""
    root = psutil.Process(pid)
    return [root] + root.children(recursive=True)


def assert_all_gone(processes: list[psutil.Process], timeout_s: float = 30) -> None:
    """Every one of ``processes`` exits within ``timeout_s``."""
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    assert alive == [], [p.pid for p in alive]
