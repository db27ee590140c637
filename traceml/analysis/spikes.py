"""Spikes: a part of the step that is small in the median step but costs much in a few steps.

A checkpoint saved inside the step every K steps leaves the median step untouched (so no
median-based rule sees it) while the few slow steps cost a large share of the run. A *spike* is
a step where a part exceeds its own median by at least SPIKE_MIN_PCT of the rank's median step
time; a rank's part *spikes* when it has at least 2 of them and their excess over the median
costs at least SPIKE_SHARE_PCT of the summed wall time of the window steps. Backward is never
tested: in DDP it holds the all-reduce, where the other ranks wait out one rank's spike.

Slow steps at the start of the window are warm-up, not spikes: every spike before the first
three normal steps in a row is left out (and counted as ``warmup_steps_left_out``).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TypedDict

from traceml.analysis import thresholds as th
from traceml.analysis.findings import SUMMED, Finding, ranks_text
from traceml.analysis.outside import period
from traceml.analysis.phases import Clock, Profile
from traceml.analysis.stats import median, median_of

STEP_SPIKES = "STEP_SPIKES"
#: Parts tested for spikes (backward holds the DDP all-reduce: see the module docstring).
SPIKE_PARTS = ("input_wait", "h2d", "forward", "optimizer", "residual")
#: What to do about spikes, by part.
_ACTIONS = {
    "residual": "If these are checkpoint saves or other periodic work inside the step: "
    "checkpoint less often, save asynchronously (torch.distributed.checkpoint.async_save), "
    "or move the work out of the step (after the trace_step block, or to another thread).",
    "optimizer": "If these are checkpoint saves or LR-schedule work done in optimizer.step(): "
    "checkpoint less often, save asynchronously (torch.distributed.checkpoint.async_save), "
    "or move the work out of the step.",
    "input_wait": "Some batches are much slower to load: a slow shard or file, loader workers "
    "restarting every epoch (persistent_workers=True), too little prefetching "
    "(prefetch_factor, num_workers).",
    "forward": "Some forwards are much slower: recompilation (torch.compile guards on changing "
    "shapes), garbage collection, or inputs of varying size; pad or bucket the shapes.",
    "h2d": "Some host-to-device copies are much slower: unpinned or very large batches; use "
    "pin_memory=True and non_blocking copies.",
}


class Spikes(TypedDict):
    """The spikes of one part on one rank (:func:`rank_spikes`); ms unless named otherwise."""

    statistic: str
    count: int
    size_ms: float
    excess_ms: float
    median_ms: float
    period_steps: int | None
    share_of_wall_pct: float
    total_excess_ms: float
    wall_ms: float
    steps: list[int]
    warmup_steps_left_out: int


def rank_spikes(
    steps: Sequence[int], wall_us: Sequence[int], part_us: Sequence[int | None]
) -> Spikes | None:
    """The spikes of one part on one rank, or None.

    Args:
        steps: step indices.
        wall_us: each step's wall time, µs (the share's denominator is their sum).
        part_us: the part's time per step, µs (None: not measured).

    Returns:
        ``{"statistic", "count", "size_ms" (median of the spiking steps' part time),
        "excess_ms" (median excess over the part's median), "median_ms", "period_steps",
        "share_of_wall_pct" (100 x ``total_excess_ms`` / ``wall_ms``), "steps" (at most 50),
        "warmup_steps_left_out"}``.
    """
    med = median(part_us)
    step_med = median(wall_us)
    if med is None or not step_med:
        return None
    floor = step_med * th.SPIKE_MIN_PCT / 100.0
    high = [v is not None and v - med >= floor for v in part_us]
    start = next((i for i in range(len(high)) if not any(high[i : i + 3])), len(high))
    idx = [i for i in range(start, len(high)) if high[i]]
    warmup = sum(high[:start])
    if len(idx) < 2:
        return None
    spiking = [v for i in idx if (v := part_us[i]) is not None]  # all of them (high)
    excess = [v - med for v in spiking]
    share = 100.0 * sum(excess) / sum(wall_us)
    if share < th.SPIKE_SHARE_PCT:
        return None
    return {
        "statistic": SUMMED,
        "count": len(idx),
        "size_ms": round(median_of(spiking) / 1000.0, 3),
        "excess_ms": round(median_of(excess) / 1000.0, 3),
        "median_ms": round(med / 1000.0, 3),
        "period_steps": period([steps[i] for i in idx]),
        "share_of_wall_pct": round(share, 1),
        "total_excess_ms": round(sum(excess) / 1000.0, 3),
        "wall_ms": round(sum(wall_us) / 1000.0, 3),
        "steps": [steps[i] for i in idx][:50],
        "warmup_steps_left_out": warmup,
    }


def findings(
    per_rank: Mapping[int, Mapping[str, Spikes | None]], window_steps: int
) -> list[Finding]:
    """One STEP_SPIKES finding per spiking part, naming every rank where it spikes; the
    figures are the worst rank's (largest share). ``per_rank``: rank -> part ->
    :func:`rank_spikes`. ``impact_ms`` is the summed excess spread over the window steps."""
    out: list[Finding] = []
    for part in SPIKE_PARTS:
        hit = {r: s for r, parts in per_rank.items() if (s := parts.get(part))}
        if not hit:
            continue
        worst = max(hit, key=lambda r: (hit[r]["share_of_wall_pct"], -r))
        s = hit[worst]
        every = f", one every {s['period_steps']} steps" if s["period_steps"] else ""
        shown = ", ".join(map(str, s["steps"][:8])) + (", ..." if len(s["steps"]) > 8 else "")
        out.append(
            Finding(
                STEP_SPIKES,
                "warning",
                f"{ranks_text(list(hit)).capitalize()} {part.replace('_', ' ')} spikes: "
                f"{s['count']} steps of about {s['size_ms']:.0f} ms (median "
                f"{s['median_ms']:.1f} ms){every}, costing {s['share_of_wall_pct']:.0f}% of "
                f"the run (share of summed time, rank {worst}; steps {shown}).",
                _ACTIONS[part],
                evidence={"part": part, "rank": worst, **s},
                ranks=list(hit),
                impact_ms=s["total_excess_ms"] / window_steps if window_steps else None,
            )
        )
    return out


def window_findings(clock: Clock, profiles: dict[int, Profile], window_steps: int) -> list[Finding]:
    """:func:`findings` over every rank's steps on ``clock`` (the parts of its profile, its
    wall time)."""
    per_rank: dict[int, dict[str, Spikes | None]] = {}
    for rank, steps in clock.steps.items():
        columns = profiles[rank].parts
        index, wall = list(steps["step"]), list(steps["step_us"])
        per_rank[rank] = {p: rank_spikes(index, wall, columns[p]) for p in SPIKE_PARTS}
    return findings(per_rank, window_steps)
