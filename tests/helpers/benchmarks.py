"""Running a benchmark script (``benchmarks/``) as a user does, for the tests of its CI run."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def run_benchmark(
    script: str, *args: str, timeout_s: float, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess:
    """``python benchmarks/<script> <args>`` from ``benchmarks/``, in a user's environment (no
    run token of the tests': a benchmark that starts an aggregator sets its own, and a stray
    one would have every call refused) plus ``env``; its output captured as text. Asserts
    exit code 0 (the message: the end of its stderr).

    Raises:
        subprocess.TimeoutExpired: it ran past ``timeout_s`` s.
    """
    result = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        cwd=BENCHMARKS,
        env={k: v for k, v in os.environ.items() if k != "TRACEML_RUN_TOKEN"} | (env or {}),
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    return result
