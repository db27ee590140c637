"""A stop signal the launcher passed on to torchrun, and a torchrun that cannot take it
(``TorchrunProcess.end_stuck_stop``): killed once the grace is over only when it ran no rank at
the signal nor since. The stand-in torchrun is a real process that ignores SIGTERM, as torchrun
does while it blocks in torch's C++ store (its Python handler never runs there), with or
without a child process standing for its ranks. A whole launcher in the rendezvous:
tests/test_lifecycle_runs.py."""

from __future__ import annotations

import signal
import subprocess
import sys
import time

import pytest
from helpers.waiting import wait_for

from traceml.core.rundir import RunDir
from traceml.launcher import torchrun as torchrun_module
from traceml.launcher.torchrun import TorchrunProcess

GRACE_S = 0.3

#: Ignores SIGTERM; with an argument, first starts a child (``sleep``) that stands for a rank.
STUCK = """
import signal, subprocess, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
child = subprocess.Popen(["sleep", "60"]) if len(sys.argv) > 1 else None
print("ready", flush=True)
time.sleep(60)
"""


@pytest.fixture
def stuck(monkeypatch, tmp_path):
    """``start(with_rank)``: a :class:`TorchrunProcess` over a started stand-in; each is killed
    with whatever runs under it at teardown."""
    monkeypatch.setattr(torchrun_module, "STOP_WITHOUT_RANKS_GRACE_S", GRACE_S)
    started: list[TorchrunProcess] = []

    def start(with_rank: bool) -> TorchrunProcess:
        process = subprocess.Popen(
            [sys.executable, "-c", STUCK] + (["rank"] if with_rank else []),
            stdout=subprocess.PIPE,
            text=True,
        )
        assert process.stdout is not None and process.stdout.readline() == "ready\n"
        run_dir = RunDir(tmp_path / "run", 0)  # no record of torchrun_main's in it
        torchrun = TorchrunProcess(None, run_dir)  # type: ignore[arg-type]  # config unused
        torchrun.process = process
        started.append(torchrun)
        return torchrun

    yield start
    for torchrun in started:
        torchrun.kill()
        torchrun.process.wait(10)


def test_a_torchrun_without_ranks_that_ignores_the_stop_is_killed_after_the_grace(stuck):
    torchrun = stuck(with_rank=False)
    signalled = time.monotonic()
    torchrun.forward_signal(signal.SIGTERM)
    assert torchrun.end_stuck_stop() is None  # within the grace
    assert torchrun.process.poll() is None
    # killed: its return code is plain torchrun's, which dies of the signal before it has
    # started ranks (no handler of torch's yet)
    code = wait_for(torchrun.end_stuck_stop, 30, "the stuck torchrun killed", poll_s=0.05)
    assert code == -signal.SIGTERM
    assert time.monotonic() - signalled >= GRACE_S
    assert torchrun.process.returncode == -signal.SIGKILL
    assert torchrun.end_stuck_stop() is None  # once


def test_a_torchrun_with_ranks_at_the_stop_is_never_killed_here(stuck):
    torchrun = stuck(with_rank=True)
    torchrun.forward_signal(signal.SIGTERM)
    time.sleep(GRACE_S * 2)
    assert torchrun.end_stuck_stop() is None
    assert torchrun.process.poll() is None  # torch's own stop ends its ranks, then it


def test_without_a_stop_signal_nothing_is_killed(stuck):
    torchrun = stuck(with_rank=False)
    time.sleep(GRACE_S * 2)
    assert torchrun.end_stuck_stop() is None
    assert torchrun.process.poll() is None
