"""Shared by the benchmarks: a real aggregator process, order statistics, paths.

The benchmarks share :class:`LiveAggregator` (``aggregator_process.py``, beside them) with the
test suite: a real ``traceml-aggregator`` subprocess on a free port, as ``traceml run`` starts
it. Nothing here imports from ``tests/``.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from aggregator_process import LiveAggregator, free_port

ROOT = Path(__file__).resolve().parents[1]

__all__ = ["ROOT", "LiveAggregator", "free_port", "median", "p99"]


def median(values) -> float:
    """Median of a non-empty series."""
    return statistics.median(values)


def p99(values) -> float:
    """99th percentile (linear interpolation) of a series of at least two values."""
    return statistics.quantiles(values, n=100, method="inclusive")[98]
