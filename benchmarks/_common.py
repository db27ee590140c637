"""Shared by the benchmarks: a real aggregator process, order statistics, paths.

The benchmarks reuse the test suite's :class:`LiveAggregator` (``tests/live_aggregator.py``):
a real ``traceml-aggregator`` subprocess on a free port, as ``traceml run`` starts it.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from conftest import free_port
from live_aggregator import LiveAggregator

__all__ = ["ROOT", "LiveAggregator", "free_port", "median", "p99"]


def median(values) -> float:
    """Median of a non-empty series."""
    return statistics.median(values)


def p99(values) -> float:
    """99th percentile (linear interpolation) of a series of at least two values."""
    return statistics.quantiles(values, n=100, method="inclusive")[98]
