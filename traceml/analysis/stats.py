"""Order statistics over one series of numbers that may hold None (not measured).

The lower median is :func:`statistics.median_low`. Medians and percentiles are
:func:`percentile`, linear interpolation between the closest ranks (what
``statistics.quantiles(method="inclusive")`` computes), kept here on purpose: the standard
library computes the same values with other floating-point operations (``(a + b) / 2`` for a
median, where this is ``a + (b - a) * 0.5``), and the summary rounds to 0.001 ms a value that,
from integer µs, often lies exactly halfway. On a real 2-rank run the node's median backward
time came out 13.428 instead of 13.429, so the standard library would change published figures.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import TypedDict


class Description(TypedDict):
    """What :func:`describe` gives: the median, mean, 95th percentile and largest of the
    values (their unit) and how many there were."""

    median: float
    mean: float
    p95: float
    max: float
    count: int


def _present(values: Iterable[float | None]) -> list[float]:
    return [v for v in values if v is not None]


def percentile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100) of already sorted values, linear interpolation.

    Raises:
        ValueError: the series is empty.
    """
    if not sorted_values:
        raise ValueError("percentile of an empty series")
    pos = (len(sorted_values) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def describe(values: Iterable[float | None]) -> Description | None:
    """``{"median", "mean", "p95", "max", "count"}`` of the non-None values; None if none."""
    return describe_sorted(sorted(_present(values)))


def describe_sorted(present: Sequence[float]) -> Description | None:
    """:func:`describe` of values already sorted, none of them None (a NumPy column's
    ``np.sort(...).tolist()``, for example); None when there are none."""
    if not present:
        return None
    return {
        "median": percentile(present, 50),
        "mean": sum(present) / len(present),
        "p95": percentile(present, 95),
        "max": present[-1],
        "count": len(present),
    }


def ms(us: float) -> float:
    """``us`` µs as ms rounded to the µs (3 decimals): how the summary writes a duration."""
    return round(float(us) / 1000.0, 3)


def median_of(values: Sequence[float]) -> float:
    """The median of ``values``, none of them None: :func:`median`'s figure where there is one.

    Raises:
        ValueError: ``values`` is empty.
    """
    return percentile(sorted(values), 50)


def median(values: Iterable[float | None]) -> float | None:
    """Median of the non-None values (as a float), or None."""
    present = sorted(_present(values))
    return percentile(present, 50) if present else None


def lower_median(values: Iterable[float | None]) -> float | None:
    """The lower median of the non-None values (for two values, the smaller), or None.

    Used for "the typical rank": a value that more than half of the ranks reach, so one
    outlying rank never moves it (the plain median of two ranks would be their mean).
    """
    present = _present(values)
    return statistics.median_low(present) if present else None


def bucket_medians(
    xs: Sequence[int], ys: Sequence[float], max_points: int
) -> tuple[list[int], list[float]]:
    """Shrink a series to at most ``max_points`` points: consecutive equal-size buckets, each
    as (its first x, the median of its y). Series already short enough come back unchanged."""
    if len(xs) <= max_points:
        return list(xs), list(ys)
    size = math.ceil(len(xs) / max_points)
    out_x, out_y = [], []
    for start in range(0, len(xs), size):
        out_x.append(xs[start])
        out_y.append(percentile(sorted(ys[start : start + size]), 50))
    return out_x, out_y
