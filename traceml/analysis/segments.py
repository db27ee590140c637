"""Stragglers for a stretch of the run: a rank slower than the others for part of the window.

The whole-window straggler rule (:mod:`traceml.analysis.step_time`) compares medians over the
window, so a rank slow for its last quarter, or for a stretch in the middle, moves no median.
Here each rank is compared with the other ranks step by step, in each part a straggler can be
attributed to (input wait, H2D, forward + optimizer, residual; the step itself too when the
ranks do not meet in a collective every step):

* the rank's **gap** at a step is its part minus the cross-rank baseline: the lower median of
  the other ranks' part at that step;
* a candidate stretch is a run of steps where the gap's centred running median over
  ONSET_MIN_STEPS steps is at least the stretch floor (:func:`stretch_floor`: STRETCH_GAP_PCT
  of the typical step, twice the whole-window straggler's): the running median keeps a step's
  edge in place and drops isolated slow steps. (One best split of the whole series, as for a
  whole-window straggler's onset, misses a stretch in the middle: both sides' medians are
  below the floor.) Series are first reduced to at most 400 bucket medians;
* each edge is then placed by the onset machinery (:func:`traceml.analysis.onset.change_point`)
  on the steps between the neighbouring stretches and the stretch's middle, when it finds
  the gap crossing the floor there;
* a candidate is cut where the gap's level changes by half or more (a change point whose
  lower median is under half the higher one), so a rank 60 ms slow and then 5 ms slow has two
  stretches;
* a **stretch** lasts STRETCH_MIN_STEPS steps or more and is not the whole window (that is the
  whole-window rule's). Its onset is its first step, its end the first step after it (None:
  the rank was still slow at the window's end). Its cost, as for a whole-window straggler, is
  its median gap (what every rank waited for it per step) times its steps.

Ranks whose slowness moves from one to another step by step (rotating stragglers) form no
stretch: each rank's slow steps are isolated, and a segment's median ignores them.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence, Set
from typing import TypedDict

from traceml.analysis import thresholds as th
from traceml.analysis.cost import part_ms
from traceml.analysis.findings import MEDIAN, Finding
from traceml.analysis.onset import MAX_POINTS, change_point
from traceml.analysis.phases import Clock, Profile
from traceml.analysis.stats import bucket_medians, median, median_of
from traceml.analysis.step_time import STEP_PART, STRAGGLER_PARTS, _Part, severity

_MS_PER_HOUR = 3_600_000.0


def stretch_floor(step_ms: float) -> float:
    """The smallest gap over the other ranks that makes a stretch (ms per step):
    STRETCH_GAP_PCT of the typical step ``step_ms``, at least STRAGGLER_MIN_GAP_MS."""
    return max(th.STRAGGLER_MIN_GAP_MS, step_ms * th.STRETCH_GAP_PCT / 100.0)


def _baseline_gaps(values: dict[int, list[float | None]]) -> dict[int, list[float | None]]:
    """rank -> per step, its value minus the lower median of the other ranks' values (None
    where it or every other rank is unmeasured)."""
    ranks = list(values)
    columns = list(zip(*(values[r] for r in ranks), strict=True))  # per step, every rank's value
    rows: list[list[float | None]] = []
    for col in columns:
        present = sorted(v for v in col if v is not None)
        if len(present) < 2:
            rows.append([None] * len(ranks))
            continue
        # the lower median once the rank's own value is taken out: present[m] when the
        # value lies above it, else the next one
        m = (len(present) - 2) // 2
        low, high = present[m], present[m + 1]
        rows.append([None if v is None else v - (low if v > low else high) for v in col])
    return {r: [row[k] for row in rows] for k, r in enumerate(ranks)}


def _smooth(ys: Sequence[float], width: int) -> list[float]:
    """Centred running median of ``ys`` over ``width`` values (fewer at the ends): a step
    keeps its edge where it is, a run shorter than half the width disappears."""
    h = width // 2
    out = []
    for i in range(len(ys)):
        win = sorted(ys[max(0, i - h) : i + h + 1])
        mid = len(win) // 2
        out.append(win[mid] if len(win) % 2 else (win[mid - 1] + win[mid]) / 2.0)
    return out


def _edge(
    steps: Sequence[int], gaps: Sequence[float], lo: int, hi: int, floor_ms: float, rising: bool
) -> int | None:
    """The change point of ``gaps[lo:hi]`` (:func:`~.onset.change_point`) as an index, when it
    crosses the floor upward (``rising``) or downward; else None."""
    cp = change_point(steps[lo:hi], gaps[lo:hi])
    if cp is None:
        return None
    low, high = (cp["before"], cp["after"]) if rising else (cp["after"], cp["before"])
    if not low < floor_ms <= high:
        return None
    return bisect.bisect_left(steps, cp["onset_step"], lo, hi)


class Stretch(TypedDict):
    """One stretch of a rank's gap series (:func:`stretches`)."""

    onset_step: int
    #: The step after its last one; None: slow to the window's end.
    end_step: int | None
    last_step: int
    #: Window steps in it.
    steps: int
    #: Its median gap, ms.
    gap_ms: float
    #: Its summed gap, ms.
    cost_ms: float


def stretches(steps: Sequence[int], gaps: Sequence[float], floor_ms: float) -> list[Stretch]:
    """The stretches of a rank's gap series (see the module docstring).

    Args:
        steps: the window steps of ``gaps``, ascending.
        gaps: the rank's gap over the cross-rank baseline per step, ms.
        floor_ms: the straggler floor, ms.

    Returns:
        ``{"onset_step", "end_step" (None: slow to the window's end), "last_step", "steps",
        "gap_ms" (median over the stretch), "cost_ms" (its summed gap)}`` per stretch, in
        order.
    """
    out: list[Stretch] = []
    if len(gaps) <= th.STRETCH_MIN_STEPS:
        return out
    xs, ys = bucket_medians(steps, gaps, MAX_POINTS)
    if sum(v >= floor_ms for v in ys) <= th.ONSET_MIN_STEPS // 2:
        return out  # no running median can reach the floor
    slow = [v >= floor_ms for v in _smooth(ys, th.ONSET_MIN_STEPS)] + [False]
    runs: list[tuple[int, int]] = []
    start: int | None = None
    for i, flag in enumerate(slow):
        if flag and start is None:
            start = i
        elif not flag and start is not None:
            runs.append((start, i))
            start = None
    bounds = [bisect.bisect_left(steps, x) for x in xs] + [len(steps)]
    prev_end = 0
    for n, (b0, b1) in enumerate(runs):
        lo, hi = bounds[b0], bounds[b1]
        # the edges, placed by the onset machinery between the neighbouring stretches
        next_lo = bounds[runs[n + 1][0]] if n + 1 < len(runs) else len(steps)
        edge = _edge(steps, gaps, prev_end, (lo + hi) // 2, floor_ms, True)
        lo = lo if edge is None else edge
        edge = _edge(steps, gaps, (lo + hi) // 2, next_lo, floor_ms, False)
        hi = hi if edge is None or hi == len(steps) else edge
        prev_end = hi
        for a, b in _levels(steps, gaps, lo, hi, floor_ms):
            if b - a < th.STRETCH_MIN_STEPS or b - a >= len(steps):
                continue
            out.append(
                {
                    "onset_step": steps[a],
                    "end_step": steps[b] if b < len(steps) else None,
                    "last_step": steps[b - 1],
                    "steps": b - a,
                    "gap_ms": median_of(gaps[a:b]),
                    "cost_ms": sum(gaps[a:b]),
                }
            )
    return out


def _levels(
    steps: Sequence[int], gaps: Sequence[float], lo: int, hi: int, floor_ms: float
) -> list[tuple[int, int]]:
    """``[lo, hi)`` cut where the gap's level changes by half or more (the change point's two
    medians, the lower under half the higher, at least the floor apart), recursively: a rank
    60 ms slow, then 5 ms slow, is two stretches."""
    cp = change_point(steps[lo:hi], gaps[lo:hi])
    if cp is None:
        return [(lo, hi)]
    low, high = sorted((cp["before"], cp["after"]))
    if high - low < floor_ms or low >= high / 2:
        return [(lo, hi)]
    k = bisect.bisect_left(steps, cp["onset_step"], lo, hi)
    return _levels(steps, gaps, lo, k, floor_ms) + _levels(steps, gaps, k, hi, floor_ms)


def findings(
    clock: Clock,
    profiles: dict[int, Profile],
    step_ms: float,
    floor_ms: float,
    *,
    synchronized: bool,
    named: Set[int] = frozenset(),
    world_size: int,
    steps_per_index: float = 1.0,
) -> list[Finding]:
    """One straggler finding per rank slower than the others for a stretch of the window.

    Args:
        clock: the analysis clock (its steps per rank, the same indices on every rank).
        profiles: each window rank's profile.
        step_ms: the typical step time, ms.
        floor_ms: the straggler floor, ms.
        synchronized: the ranks meet in a collective every step (the step time itself then
            names no straggler).
        named: ranks left out (none: every rank is tested).
        world_size: ranks in the job (for the GPU-hours).
        steps_per_index: steps one window step stands for (sampled series).

    The finding's kind is the part's straggler kind; its evidence holds the costliest stretch
    (``onset_step``, ``end_step``, ``before_ms``/``after_ms``: the median gap before it and
    in it, ``outside_ms``: outside every stretch of the rank, ``cost_steps``, ``cost_ms`` =
    ``after_ms`` x ``cost_steps``) and every stretch of
    the rank (``stretches``, each with its summed gap as ``cost_ms``).
    """
    ranks = [r for r in profiles if r in clock.steps]
    if len(ranks) < 2:
        return []
    steps = list(clock.steps[ranks[0]]["step"])
    parts = STRAGGLER_PARTS if synchronized else STRAGGLER_PARTS + (STEP_PART,)
    out: list[Finding] = []
    done = set(named)
    for part in parts:
        values = {r: part_ms(clock.steps[r], profiles[r], part.name) for r in ranks}
        if all(v is None for column in values.values() for v in column):
            continue  # never measured (H2D without CUDA)
        gaps = _baseline_gaps(values)
        for r in ranks:
            if r in done:
                continue
            pairs = [(s, g) for s, g in zip(steps, gaps[r], strict=True) if g is not None]
            found = stretches([s for s, _ in pairs], [g for _, g in pairs], floor_ms)
            if not found:
                continue
            done.add(r)
            out.append(
                _finding(
                    part,
                    r,
                    found,
                    values,
                    gaps[r],
                    steps,
                    step_ms,
                    world_size,
                    steps_per_index,
                    len(steps),
                )
            )
    return out


def _capitalized(text: str) -> str:
    return text[:1].upper() + text[1:]


def _finding(
    part: _Part,
    rank: int,
    found: list[Stretch],
    values: dict[int, list[float | None]],
    gaps: list[float | None],
    steps: list[int],
    step_ms: float,
    world_size: int,
    steps_per_index: float,
    n: int,
) -> Finding:
    worst = max(found, key=lambda s: s["cost_ms"])
    inside = [i for i, s in enumerate(steps) if worst["onset_step"] <= s <= worst["last_step"]]
    own_ms = median(values[rank][i] for i in inside)
    assert own_ms is not None, "a stretch's steps have gaps, so values"
    # the text says what the evidence carries: rounded once, to the evidence's µs (a gap of
    # 20.0500000001 ms would read 20.1 in the text, 20.0 from the evidence's 20.05)
    own = round(own_ms, 3)
    before = median(
        g for s, g in zip(steps, gaps, strict=True) if g is not None and s < worst["onset_step"]
    )
    outside = median(
        g
        for s, g in zip(steps, gaps, strict=True)
        if g is not None and not any(x["onset_step"] <= s <= x["last_step"] for x in found)
    )
    gap = round(worst["gap_ms"], 3)
    cost_steps = round(worst["steps"] * steps_per_index)
    cost_ms = gap * cost_steps
    gpu_hours = round(world_size * cost_ms / _MS_PER_HOUR, 6)
    until = (
        f"to step {worst['end_step']} (then it recovered)"
        if worst["end_step"] is not None
        else f"to the end of the window (step {worst['last_step']})"
    )
    label = part.label if part.name != "step" else "steps"
    summary = (
        f"Rank {rank} was slower than the other ranks from step {worst['onset_step']} {until}, "
        f"in its {label}: {own:.1f} ms per step, {gap:.1f} ms more than the other ranks "
        f"({100.0 * gap / step_ms:.0f}% of the {step_ms:.1f} ms step; medians per step). "
        f"Cost: every rank waited for it about {gap:.1f} ms per step over {cost_steps} steps, "
        f"{cost_ms / 1000.0:.2f} s, {gpu_hours:.4g} GPU-hours (world size {world_size})."
    )
    return Finding(
        part.kind,
        severity(gap, step_ms),
        summary,
        _capitalized(part.action.format(who=f"rank {rank}")),
        evidence={
            "statistic": MEDIAN,
            "part": part.name,
            "slow_rank": rank,
            "slow_ms": own,
            "gap_ms": gap,
            "gap_pct_of_step": round(100.0 * gap / step_ms, 1),
            "step_time_ms": round(step_ms, 3),
            "onset_step": worst["onset_step"],
            "end_step": worst["end_step"],
            "last_step": worst["last_step"],
            "before_ms": None if before is None else round(before, 3),
            "outside_ms": None if outside is None else round(outside, 3),
            "after_ms": gap,
            "wait_ms_per_step": gap,
            "cost_steps": cost_steps,
            "cost_ms": round(cost_ms, 3),
            "world_size": world_size,
            "gpu_hours": gpu_hours,
            "stretches": [
                {k: round(v, 3) if isinstance(v, float) else v for k, v in s.items()} for s in found
            ],
        },
        ranks=[rank],
        impact_ms=cost_ms / (n * steps_per_index),
    )
