"""Fail-open: a script that calls `traceml.init()` trains to the end whatever telemetry does.

No aggregator reachable (an endpoint on a closed port), or no configuration at all: exit code
0, every step trained, exactly one `traceml:` warning line, and no wait at exit.
"""

from __future__ import annotations

import re
import subprocess
import sys
import time

import pytest
from conftest import SCRIPTS, free_port, traceml_env

SCRIPT = SCRIPTS / "fail_open_train.py"

#: What torch itself prints on import in an environment without NumPy (not ours).
_TORCH_NOISE = re.compile(r"Failed to initialize NumPy|^\s*cpu = _conversion_method_template")


def run_script(args: list[str], env: dict, cwd) -> tuple[subprocess.CompletedProcess, float]:
    """Run the script; returns the result and its exit delay after training (s)."""
    result = subprocess.run(
        [sys.executable, str(SCRIPT), *args],
        env=traceml_env(env),
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    ended = re.search(r"training ended at ([\d.]+)", result.stdout)
    delay = time.time() - float(ended.group(1)) if ended else float("inf")
    return result, delay


def traceml_lines(stderr: str) -> list[str]:
    """The SDK's lines; fails on any stderr line that is neither ours nor torch's import noise."""
    ours = [line for line in stderr.splitlines() if line.startswith("traceml:")]
    others = [
        line
        for line in stderr.splitlines()
        if not line.startswith("traceml:") and not _TORCH_NOISE.search(line)
    ]
    assert others == [], stderr
    return ours


@pytest.mark.parametrize(
    "steps, step_sleep",
    [
        (20, 0.0),  # training ends before the client's first send (at exit)
        (30, 0.05),  # sends fail all through training (every 0.1 s, with backoff)
    ],
)
def test_unreachable_aggregator_trains_to_the_end_with_one_warning(tmp_path, steps, step_sleep):
    env = {
        "TRACEML_AGGREGATOR": f"127.0.0.1:{free_port()}",  # nothing listens there
        "TRACEML_RUN_NAME": "fail-open",
        "TRACEML_FLUSH_INTERVAL_SEC": "0.1",
        "TRACEML_FINISH_TIMEOUT_SEC": "60",  # a client that waited for it would be caught
    }
    result, exit_delay = run_script(
        ["--steps", str(steps), "--step-sleep", str(step_sleep)], env, tmp_path
    )
    assert result.returncode == 0, result.stderr
    assert f"trained {steps} steps" in result.stdout
    lines = traceml_lines(result.stderr)
    assert len(lines) == 1, lines
    assert "unreachable" in lines[0] and "training continues" in lines[0]
    assert exit_delay < 15, exit_delay


def test_no_configuration_is_one_warning_then_a_no_op(tmp_path):
    result, exit_delay = run_script(["--steps", "5"], {}, tmp_path)
    assert result.returncode == 0, result.stderr
    assert "trained 5 steps" in result.stdout
    lines = traceml_lines(result.stderr)
    assert len(lines) == 1, lines
    assert "no aggregator configured" in lines[0] and "telemetry is off" in lines[0]
    assert exit_delay < 15, exit_delay
