"""What a straggler costs, when it began, and per-rank relative scores.

Computed after the fact from the stored steps (no collective runs in the training job):

* ``wait_ms_per_step``: what every other rank waits for the straggler per step — its gap over
  the typical rank (median per step), after the onset when it began mid-run;
* ``gpu_hours``: world size x that wait x the window steps it straggled (from the onset), in
  hours: the device time the job spent waiting for it;
* ``relative_score`` per rank and phase (``ranks[].relative_score``): the fastest rank's
  median for that phase divided by this rank's, 1.0 = fastest (the convention of other
  straggler detectors); a rank whose median is 0 scores 1.0, an unmeasured phase ``null``.
"""

from __future__ import annotations

from traceml.analysis import onset
from traceml.analysis.document import PARTS
from traceml.analysis.findings import Finding
from traceml.analysis.phases import Clock, Profile, in_step_us
from traceml.analysis.rundata import StepTable

_MS_PER_HOUR = 3_600_000.0


def part_ms(steps: StepTable, prof: Profile, part: str) -> list[float | None]:
    """One straggler part (``evidence.part``) per step of ``steps`` (the clock's steps of
    the rank of ``prof``), in ms."""
    if part == "step":
        return [v / 1000.0 for v in in_step_us(steps)]
    columns = prof.parts
    if part == "forward_optimizer":
        return [
            None if f is None and o is None else ((f or 0) + (o or 0)) / 1000.0
            for f, o in zip(columns["forward"], columns["optimizer"], strict=True)
        ]
    return [None if v is None else v / 1000.0 for v in columns[part]]


def annotate_straggler(
    finding: Finding,
    clock: Clock,
    profiles: dict[int, Profile],
    world_size: int,
    floor_ms: float,
    steps_per_index: float = 1.0,
) -> None:
    """Add the onset (:func:`onset.straggler_onset`) and the cost to a straggler finding.

    ``steps_per_index``: steps one window step stands for (above 1 when the series are samples:
    :attr:`traceml.analysis.window.Window.steps_per_index`); ``cost_steps`` is scaled by it.
    """
    ev = finding.evidence
    slow_rank, typical_rank = ev["slow_rank"], ev["typical_rank"]
    slow = clock.steps[slow_rank]
    slow_ms = part_ms(slow, profiles[slow_rank], ev["part"])
    typical_ms = part_ms(clock.steps[typical_rank], profiles[typical_rank], ev["part"])
    pairs = [
        (step, a - b)
        for step, a, b in zip(slow["step"], slow_ms, typical_ms, strict=True)
        if a is not None and b is not None
    ]
    onset.straggler_onset(finding, [g for _, g in pairs], [s for s, _ in pairs], floor_ms)
    ev["cost_steps"] = round(ev["cost_steps"] * steps_per_index)
    wait = ev["after_ms"] if ev["onset_step"] is not None else ev["gap_ms"]
    ev["wait_ms_per_step"] = wait
    ev["world_size"] = world_size
    ev["gpu_hours"] = round(world_size * wait * ev["cost_steps"] / _MS_PER_HOUR, 6)
    finding.summary += (
        f" Cost: the other ranks wait {wait:.1f} ms per step, "
        f"{ev['gpu_hours']:.4g} GPU-hours over {ev['cost_steps']} steps (world size {world_size})."
    )


def relative_scores(profiles: dict[int, Profile]) -> dict[int, dict[str, float | None]]:
    """rank -> phase (:data:`~traceml.analysis.document.PARTS`) -> the fastest rank's median /
    this rank's (1.0 fastest)."""
    out: dict[int, dict[str, float | None]] = {r: {} for r in profiles}
    for part in PARTS:
        values = {r: p.median_ms[part] for r, p in profiles.items()}
        known = [v for v in values.values() if v is not None]
        fastest = min(known, default=None)
        for r, v in values.items():
            out[r][part] = (
                None if v is None or fastest is None else 1.0 if not v else round(fastest / v, 3)
            )
    return out
