"""The analysis window: the steps every rank completed, after warm-up, aligned by step index.

Ranks are compared step for step (in DDP, step k of every rank ends with the same all-reduce),
so the step-time analysis only looks at step indices that every rank with step data stored.
The first :data:`~traceml.analysis.thresholds.WARMUP_STEPS` of them are left out
while enough remain.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from traceml.analysis import thresholds
from traceml.analysis.rundata import RunData, StepTable

if TYPE_CHECKING:
    from traceml.analysis.digest import RankDigest


@dataclass(frozen=True)
class Window:
    """Aligned steps of the ranks that reported steps.

    Attributes:
        steps: rank -> that rank's window steps (columns of step fields, µs), in step order;
            only ranks with step data appear.
        indices: the window's step indices (the same for every rank), ascending.
        warmup_skipped: steps left out at the start.
        ranks_without_steps: ranks of the world that stored no step at all.
        digests: rank -> its :class:`~traceml.analysis.digest.RankDigest`, for the ranks whose
            steps are a sample (their profiles come from it).
        steps_per_index: how many steps one window index stands for: 1 when every rank's steps
            are all there; with sampled ranks, the most steps a digest counts divided by the
            window's indices (what a count of window steps is scaled by, e.g. a straggler's
            ``cost_steps``).
    """

    steps: dict[int, StepTable] = field(default_factory=dict)
    indices: list[int] = field(default_factory=list)
    warmup_skipped: int = 0
    ranks_without_steps: list[int] = field(default_factory=list)
    digests: dict[int, RankDigest] = field(default_factory=dict)
    steps_per_index: float = 1.0

    @property
    def ranks(self) -> list[int]:
        """Ranks in the window, ascending."""
        return sorted(self.steps)


def align(run: RunData) -> Window:
    """The window of ``run``: step indices stored by every rank that has steps, minus warm-up."""
    with_steps = {r: rd.steps for r, rd in run.ranks.items() if rd.steps}
    without = sorted(r for r, rd in run.ranks.items() if not rd.steps)
    if not with_steps:
        return Window(ranks_without_steps=without)
    common = set.intersection(*(set(steps["step"]) for steps in with_steps.values()))
    indices = sorted(common)
    skip = min(thresholds.WARMUP_STEPS, max(0, len(indices) - thresholds.MIN_WINDOW_STEPS))
    indices = indices[skip:]
    keep = set(indices)
    digests = {r: d for r in with_steps if (d := run.ranks[r].digest) is not None}
    counted = max((d.counted for d in digests.values()), default=0)
    return Window(
        steps={r: steps.where("step", keep) for r, steps in with_steps.items()},
        indices=indices,
        warmup_skipped=skip,
        ranks_without_steps=without,
        digests=digests,
        steps_per_index=max(1.0, counted / len(indices)) if digests and indices else 1.0,
    )
