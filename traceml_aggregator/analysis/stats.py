"""Order statistics over one series of numbers (no numpy needed for a few thousand steps)."""

from __future__ import annotations

import math
from typing import Iterable


def percentile(sorted_values: list[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of already sorted values, linear interpolation.

    Raises:
        ValueError: the list is empty.
    """
    if not sorted_values:
        raise ValueError("percentile of an empty series")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def describe(values: Iterable[float | None]) -> dict | None:
    """``{"median", "mean", "p95", "max", "count"}`` of the non-None values; None if none."""
    present = sorted(v for v in values if v is not None)
    if not present:
        return None
    return {
        "median": percentile(present, 50),
        "mean": sum(present) / len(present),
        "p95": percentile(present, 95),
        "max": present[-1],
        "count": len(present),
    }


def median(values: Iterable[float | None]) -> float | None:
    """Median of the non-None values, or None."""
    present = sorted(v for v in values if v is not None)
    return percentile(present, 50) if present else None
