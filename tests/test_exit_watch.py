"""The launcher's wait for its children (``traceml.launcher.exits.ExitWatch``), on real
processes: it wakes as one of them exits (pidfds, and the polling fallback), sleeps its whole
timeout when none does, and holds a pidfd only for the processes it is asked about."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from traceml.launcher.exits import ExitWatch


def _sleeper(seconds: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", f"import time; time.sleep({seconds})"])


@pytest.fixture
def children():
    started = []
    yield lambda seconds: started.append(_sleeper(seconds)) or started[-1]
    for proc in started:
        proc.kill()
        proc.wait()


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.parametrize("pidfds", [True, False], ids=["pidfd", "polling"])
def test_it_wakes_as_any_child_exits(children, pidfds):
    """The second of two children exits after 0.5 s: the wait (timeout 60 s) returns then."""
    watch = ExitWatch()
    watch._pidfds = watch._pidfds and pidfds
    long, short = children(60), children(0.5)
    start = time.monotonic()
    # The polling fallback waits on the first process only: the one that exits goes first.
    watch.wait([long, short] if pidfds else [short, long], 60)
    while time.monotonic() - start < 60 and short.poll() is None:
        watch.wait([long, short] if pidfds else [short, long], 60)
    assert short.poll() == 0 and long.poll() is None
    assert time.monotonic() - start < 30
    watch.close()


def test_it_sleeps_the_whole_timeout_when_no_child_exits(children):
    watch = ExitWatch()
    proc = children(60)
    start = time.monotonic()
    watch.wait([proc], 0.3)
    assert time.monotonic() - start >= 0.3 and proc.poll() is None
    watch.close()


def test_a_pidfd_is_held_only_for_the_processes_asked_about(children):
    """A restarted aggregator replaces the dead one: the old pidfd is closed on the next wait,
    and close() closes the rest."""
    if not hasattr(os, "pidfd_open"):
        pytest.skip("no pidfd_open on this platform")
    watch = ExitWatch()
    first, second = children(60), children(60)
    before = _open_fds()
    watch.wait([first], 0)
    assert _open_fds() == before + 1
    watch.wait([second], 0)
    assert _open_fds() == before + 1
    watch.close()
    assert _open_fds() == before
