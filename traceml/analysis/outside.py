"""Time outside the steps: the gap between two steps that is not spent waiting for data.

The SDK sends the whole gap from the end of one step to the start of the next as
``input_wait_us`` (plus DataLoader time inside the step), and beside it ``dataloader_next_us``:
the time inside ``__next__`` of the DataLoader iterator that fed the step. On a rank that reads
a DataLoader, only that is input wait; the rest of the gap is *outside-step time*: evaluation,
checkpoint saving, logging done between two steps. It is reported on its own
(``ranks[].outside_steps`` and the OUTSIDE_STEP_TIME finding) and never feeds INPUT_BOUND.

A rank that reads no DataLoader (its own generator, a queue) has no ``dataloader_next_us``:
its gap is its fetch, so it all stays input wait and its outside-step time is ``null``.

The first step of a rank (step 0) has no gap: the time before it is start-up (process group,
model build, DataLoader workers) and is never measured. Its second step's gap can still hold
start-up (a lazily started loader, the first evaluation); it is reported as ``first_gap_ms``
and kept out of every share and count. Shares are of the wall time of the window steps.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypedDict, cast

from traceml.analysis import thresholds as th
from traceml.analysis.findings import SUMMED, Finding, ranks_text
from traceml.analysis.rundata import NO_STEPS, StepTable
from traceml.analysis.stats import median_of

OUTSIDE_STEP_TIME = "OUTSIDE_STEP_TIME"


def split_gap(
    input_wait_us: Sequence[int | None], dataloader_next_us: Sequence[int | None]
) -> tuple[list[int | None], list[int | None]]:
    """One rank's (input wait, outside-step time) per step, µs.

    Args:
        input_wait_us: the wire's ``input_wait_us`` column (the whole gap; None: no gap).
        dataloader_next_us: the wire's ``dataloader_next_us`` column (None: no DataLoader call).

    Returns:
        Two columns as long as the inputs. When the rank read a DataLoader on any of these
        steps, input wait is its DataLoader time (0 on a step without a call) and outside-step
        time is the rest of the gap (at least 0); otherwise input wait is the gap and
        outside-step time is None (not separable).
    """
    if all(d is None for d in dataloader_next_us):
        return list(input_wait_us), [None] * len(input_wait_us)
    if None not in input_wait_us and None not in dataloader_next_us:  # the common case, 4x faster
        gaps, loaders = cast(Sequence[int], input_wait_us), cast(Sequence[int], dataloader_next_us)
        return (
            list(map(min, gaps, loaders)),
            [
                gap - loader if gap > loader else 0
                for gap, loader in zip(gaps, loaders, strict=True)
            ],
        )
    wait: list[int | None] = []
    outside: list[int | None] = []
    for gap, loader in zip(input_wait_us, dataloader_next_us, strict=True):
        if gap is None:
            wait.append(loader)
            outside.append(None)
        else:
            wait.append(min(gap, loader or 0))
            outside.append(max(0, gap - (loader or 0)))
    return wait, outside


def outside_column(steps: StepTable) -> list[int | None]:
    """The outside-step time of each of ``steps``, µs (:func:`split_gap`)."""
    return split_gap(steps["input_wait_us"], steps["dataloader_next_us"])[1]


def long_gaps(outside_us: list[int | None], step_ms: float) -> list[int]:
    """Indices into ``outside_us`` of the gaps that count as time outside the steps: at least
    OUTSIDE_GAP_MIN_PCT of the rank's median step time ``step_ms``, and at least 1 ms."""
    floor_us = max(1000.0, step_ms * 1000.0 * th.OUTSIDE_GAP_MIN_PCT / 100.0)
    return [i for i, v in enumerate(outside_us) if v is not None and v >= floor_us]


def period(steps: list[int]) -> int | None:
    """The median distance in steps between successive ``steps`` (None for fewer than 2)."""
    gaps = [b - a for a, b in zip(steps, steps[1:], strict=False)]
    return None if not gaps else int(round(median_of(gaps)))


class OutsideSteps(TypedDict):
    """One rank's time outside the window steps (:func:`rank_outside`), ms unless named."""

    statistic: str
    #: Of the summed wall time of the window steps, %; None when that is 0.
    share_of_wall_pct: float | None
    total_ms: float
    wall_ms: float
    #: The long gaps (:func:`long_gaps`): how many, their median and largest (None: none).
    gaps: int
    gap_median_ms: float | None
    gap_max_ms: float | None
    period_steps: int | None
    gap_steps: list[int]
    in_step_median_ms: float
    first_gap_ms: float | None


def rank_outside(
    steps: list[int],
    step_us: list[int],
    outside_us: list[int | None],
    first_gap_us: int | None,
) -> OutsideSteps | None:
    """``ranks[].outside_steps``: one rank's time outside the window steps.

    Args:
        steps: the window steps' indices.
        step_us: their wall time (end of the previous step to the end of this one), µs.
        outside_us: their outside-step time (:func:`split_gap`), µs.
        first_gap_us: outside-step time of the rank's first gap (before its step 1), µs.

    Returns:
        None when outside-step time is not separable (no DataLoader).
    """
    if all(v is None for v in outside_us):
        return None
    wall_us = sum(step_us)
    in_step_us = [s - (o or 0) for s, o in zip(step_us, outside_us, strict=True)]
    in_step_ms = median_of(in_step_us) / 1000.0
    idx = long_gaps(outside_us, in_step_ms)
    sizes = [v / 1000.0 for i in idx if (v := outside_us[i]) is not None]  # all: long gaps
    total_us = sum(v for v in outside_us if v is not None)
    return {
        "statistic": SUMMED,
        "share_of_wall_pct": round(100.0 * total_us / wall_us, 1) if wall_us else None,
        "total_ms": round(total_us / 1000.0, 3),
        "wall_ms": round(wall_us / 1000.0, 3),
        "gaps": len(idx),
        "gap_median_ms": None if not sizes else round(median_of(sizes), 3),
        "gap_max_ms": None if not sizes else round(max(sizes), 3),
        "period_steps": period([steps[i] for i in idx]),
        "gap_steps": [steps[i] for i in idx][:50],
        "in_step_median_ms": round(in_step_ms, 3),
        "first_gap_ms": None if first_gap_us is None else round(first_gap_us / 1000.0, 3),
    }


def _cause(section: OutsideSteps) -> str:
    """The likely cause, from the pattern of the gaps (a hypothesis, said as one)."""
    step_ms = section["in_step_median_ms"] or 0.0
    gap_ms = section["gap_median_ms"]  # None exactly when there are no gaps
    if gap_ms is not None and gap_ms >= 5 * step_ms and (section["period_steps"] or 0) >= 2:
        return (
            f"long pauses every {section['period_steps']} steps look like periodic evaluation "
            "or checkpoint saving between steps"
        )
    return "short pauses between most steps look like logging, metrics or host work between steps"


def finding(sections: Mapping[int, OutsideSteps | None], steps_in_window: int) -> Finding | None:
    """OUTSIDE_STEP_TIME when the ranks spend at least OUTSIDE_STEP_PCT of their wall time
    outside the steps (share of summed time, the lower median across ranks so one rank alone
    does not make it); None otherwise.

    Args:
        sections: rank -> :func:`rank_outside` (None where not separable).
        steps_in_window: the window's step count (``impact_ms`` is the outside-step time
            spread over the window steps: ms per step).
    """
    share = {
        r: pct for r, s in sections.items() if s and (pct := s["share_of_wall_pct"]) is not None
    }
    if not share:
        return None
    ordered = sorted(share, key=lambda r: (share[r], r))
    rank = ordered[(len(ordered) - 1) // 2]
    s = sections[rank]
    assert s is not None  # it has a share
    if share[rank] < th.OUTSIDE_STEP_PCT:
        return None
    affected = sorted(r for r, pct in share.items() if pct >= th.OUTSIDE_STEP_PCT)
    gaps = (
        f"{s['gaps']} gaps of median {s['gap_median_ms']:.0f} ms (max {s['gap_max_ms']:.0f} ms)"
        + (f", one every {s['period_steps']} steps" if s["period_steps"] else "")
        if s["gaps"]
        else "many short gaps"
    )
    first = (
        f" The gap before step 1 ({s['first_gap_ms']:.0f} ms, start-up) is left out."
        if s["first_gap_ms"] and s["first_gap_ms"] >= s["in_step_median_ms"]
        else ""
    )
    return Finding(
        OUTSIDE_STEP_TIME,
        "warning",
        f"{ranks_text(affected).capitalize()} spend {s['share_of_wall_pct']:.0f}% of the wall "
        f"time outside the steps (share of summed time, rank {rank}: {s['total_ms']:.0f} ms "
        f"over {steps_in_window} steps): {gaps}. Hypothesis: {_cause(s)}.{first}",
        "This is not input wait: the DataLoader was not what the ranks waited for. Evaluate or "
        "checkpoint less often, save checkpoints asynchronously (torch.distributed.checkpoint."
        "async_save), log less often, or move the work to another process.",
        evidence={"statistic": SUMMED, "rank": rank, **s},
        ranks=affected,
        impact_ms=s["total_ms"] / steps_in_window if steps_in_window else None,
    )


def sections(
    window_steps: Mapping[int, StepTable], all_steps: Mapping[int, StepTable]
) -> dict[int, OutsideSteps | None]:
    """rank -> :func:`rank_outside` of each window rank, from its step columns (``all_steps``
    gives the first gap, which lies before the window)."""
    out: dict[int, OutsideSteps | None] = {}
    for rank, steps in window_steps.items():
        rank_steps = all_steps.get(rank, NO_STEPS)
        first = next((i for i, v in enumerate(rank_steps["input_wait_us"]) if v is not None), None)
        out[rank] = rank_outside(
            list(steps["step"]),
            list(steps["step_us"]),
            outside_column(steps),
            None if first is None else outside_column(rank_steps.take([first]))[0],
        )
    return out
