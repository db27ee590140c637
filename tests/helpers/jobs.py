"""Running ``traceml run`` (and ``traceml view``/``compare``) for real, and reading what it left:
the command, its environment, its artifacts (summary, store), its processes."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import psutil

from helpers.aggregator import free_port, query
from helpers.waiting import wait_for

__all__ = [
    "EXAMPLES",
    "GRPC_LINE",
    "HANG_AFTER_THE_LAST_STEP",
    "HANG_TIMING_ENV",
    "ROOT",
    "SCRIPTS",
    "TEST_RUN_TOKEN",
    "aggregator_of",
    "assert_all_gone",
    "assert_rejected",
    "assert_rejected_on_a_free_port",
    "descendant_of",
    "listens",
    "load_summary",
    "process_family",
    "query",
    "reaped",
    "run_args",
    "run_traceml",
    "signal_and_wait",
    "start_traceml",
    "traceml_cmd",
    "traceml_env",
    "wait_all",
    "wait_training",
    "wait_training_started",
]

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "scripts"
EXAMPLES = ROOT / "examples"

#: The run token of the aggregators the tests start themselves (tests/helpers/aggregator.py):
#: the test process, and the scripts it runs under plain torchrun, play that run's own
#: processes, so they carry it through the environment (tests/conftest.py sets it), as the
#: ranks of a real run do.
TEST_RUN_TOKEN = "traceml-test-run-token"

#: gRPC C-core log lines (glog style: "E0521 12:00:00.000000 123 fork_posix.cc:75] ..."), and
#: anything else that names gRPC, absl or an HTTP/2 GOAWAY (``too_many_pings``).
GRPC_LINE = re.compile(
    r"^[IWEF]\d{4} \d\d:\d\d:\d\d\.\d+\s+\d+ \S+\.(cc|h|cpp):\d+\]|grpc|absl|goaway|too_many_pings",
    re.IGNORECASE,
)


#: The arguments of ``tests/scripts/faulty_ddp.py`` for a job whose rank 1 trains its 6 steps and
#: then sleeps forever, alive (its torchrun, and so the launcher, too): a hang after its last step.
HANG_AFTER_THE_LAST_STEP = ("--fail", "hang", "--fail-rank", "1", "--steps", "6")
#: The environment of a job whose hang is timed: batches every 0.2 s and progress every 0.5 s, so
#: the hang is timed to within a fraction of a second.
HANG_TIMING_ENV = {"TRACEML_FLUSH_INTERVAL_SEC": "0.2", "TRACEML_HEARTBEAT_SEC": "0.5"}


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


def run_args(
    tmp_path: Path, script: str | Path, name: str, port: int, *more: str, nproc: int = 2
) -> list[str]:
    """The arguments of ``traceml run`` (for :func:`run_traceml`, :func:`start_traceml`) of
    ``script`` on ``nproc`` ranks of one node: run ``name``, its aggregator on ``port``, its
    run directory ``tmp_path/logs/name`` (where :func:`wait_training` looks); then ``more``:
    more launcher flags, and the script's own arguments (after ``--`` where one could be
    taken for a launcher flag)."""
    return [
        "run",
        str(script),
        f"--nproc-per-node={nproc}",
        "--run-name",
        name,
        "--aggregator-port",
        str(port),
        "--logs-dir",
        str(tmp_path / "logs"),
        *more,
    ]


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


def start_traceml(
    args: list[str],
    cwd: Path,
    log_prefix: Path,
    *,
    env: dict | None = None,
    prefix: list[str] | None = None,
) -> subprocess.Popen:
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


def assert_rejected_on_a_free_port(tmp_path, args: list[str], expected: str) -> None:
    """:func:`assert_rejected` of ``traceml run ARGS --aggregator-port PORT`` on a free ``PORT``,
    which only this invocation's processes would carry on their command line (the marker)."""
    port = str(free_port())
    assert_rejected(tmp_path, [*args, "--aggregator-port", port], expected, marker=port)


def wait_training_started(
    run_dir: Path, launcher: subprocess.Popen, err_path: Path, timeout_s: float = 240
) -> None:
    """Wait until rank 0 of ``tests/scripts/faulty_ddp.py`` began its first step (its line
    in node 0's training log); fails if the launcher exits first (with its stderr)."""
    log = run_dir / "nodes" / "node_0" / "training.stdout.log"

    def started() -> bool:
        assert launcher.poll() is None, err_path.read_text()
        return log.exists() and "faulty_ddp: training" in log.read_text()

    wait_for(started, timeout_s, "training to start", poll_s=0.1)


def wait_training(tmp_path: Path, name: str, launcher: subprocess.Popen) -> None:
    """:func:`wait_training_started` of run ``name`` under ``tmp_path/logs``, whose launcher
    was started with :func:`start_traceml` and log prefix ``tmp_path/name``."""
    wait_training_started(tmp_path / "logs" / name, launcher, tmp_path / f"{name}.err")


@contextlib.contextmanager
def reaped(procs: dict):
    """On the way out (also when the block fails), kill whichever of ``procs`` (name ->
    Popen) still runs, and wait for it."""
    try:
        yield
    finally:
        for p in procs.values():
            if p.poll() is None:
                p.kill()
                p.wait()


def wait_all(procs: dict, timeout_s: float) -> dict:
    """Exit codes of ``procs`` (name -> Popen) once all have exited; kills the rest and
    fails after ``timeout_s``."""
    with reaped(procs):
        wait_for(
            lambda: all(p.poll() is not None for p in procs.values()),
            timeout_s,
            "every process to exit",
            poll_s=0.2,
        )
    return {n: p.returncode for n, p in procs.items()}


def signal_and_wait(process: subprocess.Popen, signum: int, timeout_s: float) -> tuple[int, float]:
    """Send ``signum`` to ``process`` and wait up to ``timeout_s`` for its exit: (its exit
    code, seconds from the signal to the exit). Kills it if it outlives the wait (raising
    subprocess.TimeoutExpired)."""
    sent = time.monotonic()
    process.send_signal(signum)
    try:
        code = process.wait(timeout_s)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    return code, time.monotonic() - sent


def descendant_of(launcher: subprocess.Popen, marker: str, poll_s: float = 0.2) -> psutil.Process:
    """The first process under ``launcher`` whose command line holds ``marker`` (waits up to
    60 s for it, looking every ``poll_s`` s)."""

    def found() -> psutil.Process | None:
        for child in psutil.Process(launcher.pid).children(recursive=True):
            try:
                if marker in " ".join(child.cmdline()):
                    return child
            except psutil.NoSuchProcess:  # a short-lived child of the start-up
                pass
        return None

    return wait_for(found, 60, f"a process running {marker}", poll_s=poll_s)


def listens(process: psutil.Process, port: int) -> bool:
    """Whether ``process`` listens on TCP ``port`` (torchrun's store: it is in its
    rendezvous)."""
    return any(
        c.laddr.port == port and c.status == psutil.CONN_LISTEN
        for c in process.net_connections("tcp")
    )


def aggregator_of(launcher: subprocess.Popen) -> psutil.Process:
    """Node 0's aggregator process under ``launcher`` (waits up to 60 s for it)."""
    return descendant_of(launcher, "traceml_aggregator")


def process_family(pid: int) -> list[psutil.Process]:
    """``pid`` and every process under it (torchrun's ranks, node 0's aggregator)."""
    root = psutil.Process(pid)
    return [root] + root.children(recursive=True)


def signal_all(processes: list[psutil.Process], signum: int) -> float:
    """Send ``signum`` to each of ``processes`` that still runs; the wall-clock time (s since
    the epoch) once all were sent."""
    for p in processes:
        try:
            p.send_signal(signum)
        except psutil.NoSuchProcess:
            pass
    return time.time()


def tmp_leftovers(tmpdir: Path) -> list[str]:
    """What a run left in its ``TMPDIR``: the names of its entries, torch's compile cache
    (``torchinductor_<user>``, one per user, reused by every run) left out."""
    return sorted(p.name for p in tmpdir.iterdir() if not p.name.startswith("torchinductor_"))


def assert_all_gone(processes: list[psutil.Process], timeout_s: float = 30) -> None:
    """Every one of ``processes`` exits within ``timeout_s``."""
    _, alive = psutil.wait_procs(processes, timeout=timeout_s)
    assert alive == [], [p.pid for p in alive]
