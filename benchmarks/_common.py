"""Shared by the benchmarks: a real aggregator process, order statistics, paths.

The benchmarks share :class:`LiveAggregator` (``aggregator_process.py``, beside them) with the
test suite: a real ``traceml-aggregator`` subprocess on a free port, as ``traceml run`` starts
it. Nothing here imports from ``tests/``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

from aggregator_process import LiveAggregator, free_port

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["ROOT", "LiveAggregator", "free_port", "in_tree", "median", "p99"]


def median(values) -> float:
    """Median of a non-empty series."""
    return statistics.median(values)


def p99(values) -> float:
    """99th percentile (linear interpolation) of a series of at least two values."""
    return statistics.quantiles(values, n=100, method="inclusive")[98]


def in_tree(tree: Path, argv: list[str]) -> dict:
    """Run ``python argv`` in a fresh process that imports the TraceML source tree ``tree``
    (``--baseline``: another tree, or this one; its working directory), and return the JSON
    object its last line of output is.

    Raises:
        subprocess.CalledProcessError: it exited with another code than 0.
    """
    out = subprocess.run(
        [sys.executable, *argv],
        env=dict(os.environ, PYTHONPATH=str(tree)),
        check=True,
        capture_output=True,
        text=True,
        cwd=tree,
    ).stdout
    return json.loads(out.splitlines()[-1])
