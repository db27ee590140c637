"""SIGTERM to a process running the SDK (``tests/scripts/sigterm_rank.py``) against a real
aggregator: the steps it buffered are stored and its finish marker says SIGTERM, it dies of
SIGTERM within the flush budget, and a handler of the script's own is never overridden.

Nothing is sent before the signal (an hour-long flush interval): without the flush on SIGTERM
the store would hold no step at all.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import SCRIPTS, signal_and_wait, traceml_env
from live_aggregator import LiveAggregator

pytestmark = [pytest.mark.aggregator, pytest.mark.serial]

STEPS = 5


@pytest.fixture
def aggregator(tmp_path):
    with LiveAggregator(tmp_path / "run", "sig") as agg:
        yield agg


def run_until_sigterm(aggregator, mode: str, again_after_s: float = 0.0) -> tuple[int, float, str]:
    """Start the script in ``mode``, SIGTERM it once ready (and again ``again_after_s`` later,
    when given); (its return code, s from the first signal to its exit, its stdout after
    ``ready``)."""
    env = traceml_env(
        {
            "TRACEML_AGGREGATOR": aggregator.target,
            "TRACEML_RUN_NAME": "sig",
            "TRACEML_FLUSH_INTERVAL_SEC": "3600",
        }
    )
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "sigterm_rank.py"), "--mode", mode, "--steps", str(STEPS)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert proc.stdout.readline() == "ready\n", proc.stderr.read()
        time.sleep(0.1)
        sent = time.monotonic()
        if again_after_s:
            proc.send_signal(signal.SIGTERM)
            time.sleep(again_after_s)  # into the flush the first one started (2 s)
        code, _ = signal_and_wait(proc, signal.SIGTERM, 30)
        took = time.monotonic() - sent
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return code, took, proc.stdout.read()


@pytest.mark.parametrize("mode, steps", [("idle", STEPS), ("in-step", STEPS + 1), ("stuck", STEPS)])
def test_sigterm_flushes_then_dies_of_sigterm(aggregator, mode, steps):
    """idle: the handler on the main thread; in-step: the open step ends first and is
    counted; stuck: the main thread waits in C, the watcher thread acts after 0.5 s."""
    code, took, _ = run_until_sigterm(aggregator, mode)
    assert code == -signal.SIGTERM
    assert took < 2.0 + 1.5  # the flush budget, plus the interpreter's start of the kill
    assert aggregator.stop() == 0
    assert aggregator.query("SELECT COUNT(*) FROM steps") == [(steps,)]
    assert aggregator.query(
        "SELECT steps_completed, records_dropped, end_state, reason FROM rank_finish"
    ) == [(steps, 0, "signaled", "SIGTERM")]


def test_a_second_sigterm_during_the_flush_does_not_stop_it(aggregator):
    """The aggregator is stopped (SIGSTOP), so the flush the first SIGTERM starts on the main
    thread waits its whole budget (2 s) for acks; a second SIGTERM 0.5 s into it runs its
    handler inside that flush. The flush goes on, and the rank dies of SIGTERM within the
    budget; without the fix the second handler waited for the first, on the same thread,
    for ever."""
    os.kill(aggregator.process.pid, signal.SIGSTOP)
    try:
        code, took, _ = run_until_sigterm(aggregator, "idle", again_after_s=0.5)
    finally:
        os.kill(aggregator.process.pid, signal.SIGCONT)
    assert code == -signal.SIGTERM
    assert 2.0 - 0.2 < took < 2.0 + 1.5  # the whole budget: no ack came
    assert aggregator.stop() == 0


@pytest.mark.parametrize("mode", ["user-after", "user-before"])
def test_a_handler_of_the_script_decides(aggregator, mode):
    """The script's own handler runs (and exits 0): TraceML neither takes SIGTERM from it nor
    ends the process behind its back; the exit's atexit flush still delivers every step."""
    code, _, out = run_until_sigterm(aggregator, mode)
    assert (code, out) == (0, "own handler\n")
    assert aggregator.stop() == 0
    assert aggregator.query("SELECT steps_completed, end_state FROM rank_finish") == [
        (STEPS, "completed")
    ]
