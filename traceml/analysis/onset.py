"""When a change began, and slow upward drift.

**Change point.** The series (a straggler's gap over the typical rank per step, or the job's
step time) is split in two at the step that best explains it as two flat segments: the split
minimising the summed squared error of the two segments around their means (least-squares
binary segmentation), each segment at least ONSET_MIN_STEPS steps. The split is kept when the
medians of the two segments differ by at least the finding's minimum effect: for a straggler,
a gap below the straggler floor before and at or above it after; for SLOWDOWN, the job's
median step grows by at least SLOWDOWN_PCT (and 1 ms) and the series is no drift (below).
Long series are first reduced to at most 400 bucket medians.

**Start-up.** A change point is no SLOWDOWN when it is the start of the steady state
(:func:`start_up`): at or before STARTUP_PREFETCH_STEPS, a rise that is mostly input wait from
an input wait below the straggler floor is the DataLoader's prefetched batches running out.

**Drift.** A series drifts when a straight line fits it better than two flat segments (smaller
summed squared error) and the line rises by at least DRIFT_PCT of the series' median (and
1 ms) over a window of at least DRIFT_MIN_STEPS steps: STEP_TIME_DRIFT, with the rate per
1,000 steps.
"""

from __future__ import annotations

import bisect
import statistics
from collections.abc import Mapping, Sequence
from typing import TypedDict

from traceml.analysis import thresholds as th
from traceml.analysis.findings import MEDIAN, Finding
from traceml.analysis.stats import bucket_medians, median_of

SLOWDOWN = "SLOWDOWN"
STEP_TIME_DRIFT = "STEP_TIME_DRIFT"
#: Most points a change point or drift looks at (longer series become bucket medians).
MAX_POINTS = 400


def _sse_split(ys: list[float], min_side: int) -> tuple[int, float] | None:
    """(split index, summed squared error of the best two-segment split), or None."""
    n = len(ys)
    if n < 2 * min_side:
        return None
    s1 = [0.0]
    s2 = [0.0]
    for y in ys:
        s1.append(s1[-1] + y)
        s2.append(s2[-1] + y * y)

    def sse(a: int, b: int) -> float:
        k = b - a
        return s2[b] - s2[a] - (s1[b] - s1[a]) ** 2 / k

    return min(
        ((k, sse(0, k) + sse(k, n)) for k in range(min_side, n - min_side + 1)),
        key=lambda t: t[1],
    )


def _line_sse(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(slope per x, summed squared error) of the least-squares line."""
    n = len(xs)
    mx, my = sum(xs) / n, sum(ys) / n
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = 0.0 if not sxx else sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / sxx
    return slope, sum((y - my - slope * (x - mx)) ** 2 for x, y in zip(xs, ys, strict=True))


class ChangePoint(TypedDict):
    """The best split of a series into two flat segments (:func:`change_point`)."""

    #: The first step of the second segment.
    onset_step: int
    #: The segments' medians, in the values' unit.
    before: float
    after: float
    #: The split's summed squared error.
    sse_split: float


class Drift(TypedDict):
    """The upward drift of a series (:func:`drift`), in the values' unit."""

    rate_per_1000_steps: float
    rise: float
    median: float


def change_point(steps: Sequence[int], values: Sequence[float]) -> ChangePoint | None:
    """The best split of ``values`` (one per step of ``steps``) into two flat segments.

    Returns ``{"onset_step", "before", "after", "sse_split"}`` (segment medians, in the
    values' unit) or None with fewer than 2 x ONSET_MIN_STEPS values.
    """
    xs, ys = bucket_medians(steps, values, MAX_POINTS)
    best = _sse_split(ys, max(1, th.ONSET_MIN_STEPS * len(xs) // max(1, len(steps))))
    if best is None:
        return None
    k, err = best
    return {
        "onset_step": xs[k],
        "before": median_of(ys[:k]),
        "after": median_of(ys[k:]),
        "sse_split": err,
    }


def drift(steps: Sequence[int], values: Sequence[float]) -> Drift | None:
    """The upward drift of ``values``: ``{"rate_per_1000_steps", "rise", "median"}`` when a
    line fits better than a change point and rises by DRIFT_PCT of the median (and 1 ms, for
    values in ms) over the steps; else None, also with fewer than DRIFT_MIN_STEPS steps."""
    if len(steps) < th.DRIFT_MIN_STEPS:
        return None
    xs, ys = bucket_medians(steps, values, MAX_POINTS)
    split = _sse_split(ys, th.ONSET_MIN_STEPS)
    if split is None:
        return None
    slope, err = _line_sse([float(x) for x in xs], ys)
    rise = slope * (xs[-1] - xs[0])
    med = median_of(ys)
    if err >= split[1] or rise < max(1.0, med * th.DRIFT_PCT / 100.0):
        return None
    return {"rate_per_1000_steps": slope * 1000.0, "rise": rise, "median": med}


def straggler_onset(
    finding: Finding, gaps_ms: list[float], steps: list[int], floor_ms: float
) -> None:
    """Add the onset to a straggler ``finding`` when its gap began mid-window.

    Args:
        finding: a straggler finding (its evidence names the part, the slow and typical rank).
        gaps_ms: the slow rank's part minus the typical rank's, per step (ms).
        steps: the steps of ``gaps_ms``.
        floor_ms: the straggler floor (the gap that makes a straggler).

    Sets ``evidence.onset_step``, ``before_ms``/``after_ms`` (the slow rank's gap over the
    typical rank, median before/after), ``cost_steps`` (steps from the onset) and ends the
    summary with "from step S"; without an onset ``onset_step`` is None and ``cost_steps``
    is every window step.
    """
    ev = finding.evidence
    cp = change_point(steps, gaps_ms)
    ev["onset_step"] = None
    ev["cost_steps"] = len(steps)
    if cp is None or not (cp["before"] < floor_ms <= cp["after"]):
        return
    ev["onset_step"] = cp["onset_step"]
    ev["before_ms"] = round(cp["before"], 3)
    ev["after_ms"] = round(cp["after"], 3)
    ev["cost_steps"] = sum(1 for s in steps if s >= cp["onset_step"])
    finding.summary += (
        f" It began mid-run: from step {cp['onset_step']} (gap {cp['before']:.1f} ms per step "
        f"before, {cp['after']:.1f} ms after; medians per step)."
    )


def _job(series: Mapping[int, Sequence[float]], n: int) -> list[float]:
    """Per step, the lower median across ranks of ``series`` (rank -> one value per step; at
    least one rank)."""
    return [statistics.median_low([vals[i] for vals in series.values()]) for i in range(n)]


def start_up(cp: ChangePoint, steps: list[int], waits: list[float], floor_ms: float) -> bool:
    """The change point ``cp`` of the job's step time is a start-up transient: at or before
    STARTUP_PREFETCH_STEPS, the job's input wait (``waits``, ms per step of ``steps``) rose
    from below the straggler floor ``floor_ms`` by at least half the step time's rise: the
    DataLoader's prefetched batches ran out and the steady state began."""
    if cp["onset_step"] > th.STARTUP_PREFETCH_STEPS:
        return False
    k = bisect.bisect_left(steps, cp["onset_step"])
    before, after = median_of(waits[:k]), median_of(waits[k:])
    return before < floor_ms and after - before >= (cp["after"] - cp["before"]) / 2


def job_findings(
    series: dict[int, tuple[list[int], list[float]]],
    explained: bool,
    waits: dict[int, list[float]] | None = None,
    floor_ms: float = 0.0,
) -> list[Finding]:
    """SLOWDOWN or STEP_TIME_DRIFT of the job's step time.

    Args:
        series: rank -> (steps, step time per step in ms, without time outside the steps).
        explained: a straggler with an onset already explains a change (no SLOWDOWN then).
        waits: rank -> input wait per step of ``series`` (ms), to set aside a start-up
            transient (:func:`start_up`); None: none is set aside.
        floor_ms: the straggler floor (ms), for :func:`start_up`.

    The job's series is, per step, the lower median across ranks.
    """
    if not series:
        return []
    steps = next(iter(series.values()))[0]
    job = _job({r: vals for r, (_, vals) in series.items()}, len(steps))
    out: list[Finding] = []
    cp = change_point(steps, job)
    d = drift(steps, job)
    if cp and waits and start_up(cp, steps, _job(waits, len(steps)), floor_ms):
        cp = None
    if cp and not explained and d is None:
        effect = cp["after"] - cp["before"]
        if effect >= max(1.0, cp["before"] * th.SLOWDOWN_PCT / 100.0):
            pct = 100.0 * effect / cp["before"]
            out.append(
                Finding(
                    SLOWDOWN,
                    "warning",
                    f"The job slowed down from step {cp['onset_step']}: its median step went "
                    f"from {cp['before']:.1f} to {cp['after']:.1f} ms (+{pct:.0f}%; medians "
                    "per step), on every rank alike.",
                    "Look at what changed at that step: a schedule (sequence length, batch "
                    "size), host load from another job, thermal throttling, a filling disk.",
                    evidence={
                        "statistic": MEDIAN,
                        "onset_step": cp["onset_step"],
                        "before_ms": round(cp["before"], 3),
                        "after_ms": round(cp["after"], 3),
                        "change_pct": round(pct, 1),
                    },
                    ranks=sorted(series),
                    impact_ms=effect * sum(1 for s in steps if s >= cp["onset_step"]) / len(steps),
                )
            )
    if d:
        out.append(
            Finding(
                STEP_TIME_DRIFT,
                "warning",
                f"The job's step time drifts upward by {d['rate_per_1000_steps']:.1f} ms per "
                f"1,000 steps ({d['rise']:.1f} ms over the window, on a median of "
                f"{d['median']:.1f} ms; medians per step).",
                "A slow leak: growing input wait (a dataset cache that grows, files piling up),"
                " growing host work (lists of losses or metrics kept across steps), memory "
                "fragmentation; see which part grows in the series of the HTML report.",
                evidence={
                    "statistic": MEDIAN,
                    "rate_ms_per_1000_steps": round(d["rate_per_1000_steps"], 3),
                    "rise_ms": round(d["rise"], 3),
                    "step_time_ms": round(d["median"], 3),
                },
                ranks=sorted(series),
                impact_ms=d["rise"] / 2,
            )
        )
    return out
