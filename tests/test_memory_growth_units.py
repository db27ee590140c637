"""The memory growth test's vectorised statistics (traceml/analysis/memory.py) give exactly the
floats of their definitions, written here pair by pair and bucket by bucket as the module
docstring states them: a finding, an onset or a rate never moves by a rounding."""

from __future__ import annotations

import math

from hypothesis import given, settings
from hypothesis import strategies as st

from traceml.analysis import memory
from traceml.analysis.stats import median, median_of

# RSS-like integers (bytes, exact as floats) and times a second or so apart, some equal.
_bytes = st.integers(min_value=0, max_value=2**40)
_times = st.lists(st.sampled_from([0.0, 0.5, 1.0, 1.25]), min_size=2, max_size=60).map(
    lambda gaps: [1.7e9 + sum(gaps[: i + 1]) for i in range(len(gaps))]
)


def _theil_sen(xs, ys) -> float:
    slopes = [
        (ys[j] - ys[i]) / (xs[j] - xs[i])
        for i in range(len(xs))
        for j in range(i + 1, len(xs))
        if xs[j] != xs[i]
    ]
    return median(slopes) or 0.0


def _kendall_s(ys) -> int:
    n = len(ys)
    return sum((ys[j] > ys[i]) - (ys[j] < ys[i]) for i in range(n) for j in range(i + 1, n))


def _thin(points, max_points):
    if len(points) <= max_points:
        return list(points)
    size = math.ceil(len(points) / max_points)
    return [
        (
            median(p[0] for p in points[i : i + size]),
            median_of([p[1] for p in points[i : i + size]]),
            median_of([p[2] for p in points[i : i + size]]),
        )
        for i in range(0, len(points), size)
    ]


@settings(max_examples=300, deadline=None)
@given(_times, st.data())
def test_theil_sen_and_kendall_equal_their_definitions(xs, data):
    ys = data.draw(st.lists(_bytes, min_size=len(xs), max_size=len(xs)))
    assert memory.theil_sen(xs, ys) == _theil_sen(xs, ys)
    n, s = len(ys), _kendall_s(ys)
    sd = math.sqrt(n * (n - 1) * (2 * n + 5) / 18.0)
    expected = 0.0 if s == 0 else (s - 1) / sd if s > 0 else (s + 1) / sd
    assert memory.kendall_z(ys) == expected


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.one_of(st.none(), st.floats(0, 1e6)),
            st.floats(1.7e9, 1.8e9),
            _bytes,
        ),
        min_size=1,
        max_size=400,
    ),
    st.sampled_from([0, 1, 2]),
    st.integers(min_value=3, max_value=120),
)
def test_bucket_medians_equal_their_definition(points, steps, max_points):
    """Steps all known, all unknown (a node's RAM) or mixed."""
    if steps == 0:
        points = [(None, t, v) for _, t, v in points]
    elif steps == 1:
        points = [(float(i), t, v) for i, (_, t, v) in enumerate(points)]
    assert memory._thin(points, max_points) == _thin(points, max_points)
