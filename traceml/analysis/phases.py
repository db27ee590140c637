"""Where each rank's step time goes: the clock, the parts of a step, per-rank profiles.

A step (``step_us``: end of the previous step to the end of this one) is split into parts:
input wait, host-to-device copies (H2D), forward, backward, optimizer, and the residual — the
time inside the step outside every measured phase (loss outside the model, ``zero_grad``,
logging, ``.item()`` syncs, ...).

One clock per analysis. With CUDA, the CPU clock of a phase only measures kernel launches, so
the GPU clock (CUDA events) is used for H2D, forward, backward and optimizer when enough steps
of the window carry it on every rank (the SDK times one step in N on the GPU; the parts are then
measured over those steps); otherwise the CPU clock is used for all ranks, and the summary says
why. Input wait is always host time: the GPU has nothing to do while the host
waits for data.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass, field

from traceml.analysis import thresholds as th
from traceml.analysis.document import CPU, GPU, PARTS
from traceml.analysis.outside import outside_column, split_gap
from traceml.analysis.rundata import StepTable
from traceml.analysis.stats import Description, describe, median
from traceml.analysis.window import Window
from traceml.core import phases as table

#: Measured phases that are parts of the step: (summary name, CPU-clock field, GPU-clock field
#: or None), all µs, in the order of :data:`traceml.core.phases.PHASES`.
PHASES = tuple((p.name, p.cpu_field, p.gpu_field) for p in table.PHASES if p.part)
#: Phases without which the residual is meaningless (it would absorb them).
REQUIRED_PHASES = tuple(p.name for p in table.PHASES if p.required)
#: GPU-clock fields that must be present on every window step for the GPU clock.
_GPU_NEEDED = tuple(p.gpu_field for p in table.PHASES if p.required and p.gpu_field)


@dataclass(frozen=True)
class Clock:
    """The clock of one analysis.

    Attributes:
        name: ``"cpu"`` or ``"gpu"``.
        reason: why this clock (for the summary).
        steps: rank -> the window steps the parts of the step are measured over: every window
            step on the CPU clock; on the GPU clock the GPU-timed ones (the SDK times one step
            in ``TRACEML_GPU_TIMING_EVERY_N_STEPS`` on the GPU), the same indices on every rank.
    """

    name: str
    reason: str
    steps: dict[int, StepTable] = field(default_factory=dict, compare=False)

    def phase_field(self, cpu_field: str, gpu_field: str | None) -> str:
        """The step field to read for a phase on this clock."""
        return gpu_field if self.name == GPU and gpu_field else cpu_field

    @functools.cached_property
    def phase_fields(self) -> tuple[tuple[str, str], ...]:
        """(phase name, step field to read on this clock) of every phase, in :data:`PHASES`
        order (worked out once, not once per step)."""
        return tuple((name, self.phase_field(cpu, gpu)) for name, cpu, gpu in PHASES)


def choose_clock(window: Window) -> Clock:
    """GPU when at least MIN_GPU_TIMED_STEPS window steps are GPU-timed on every rank and
    carry every needed GPU phase; else CPU, with the reason."""
    if not window.steps:
        return Clock(CPU, "no step data")
    timed = set(window.indices)
    for steps in window.steps.values():
        timed &= {
            i for i, gpu in zip(steps["step"], steps["gpu_step_us"], strict=True) if gpu is not None
        }
    if not timed:
        return Clock(
            CPU,
            "no CUDA event timings (CPU training, or GPU timing unavailable)",
            dict(window.steps),
        )
    gpu_steps = {r: steps.where("step", timed) for r, steps in window.steps.items()}
    lacking = sorted(
        r for r, steps in gpu_steps.items() if any(None in steps[f] for f in _GPU_NEEDED)
    )
    if lacking:
        return Clock(
            CPU,
            f"GPU-timed steps of ranks {lacking} lack forward, backward or optimizer CUDA "
            "timings; CPU clock for every rank",
            dict(window.steps),
        )
    if len(timed) < th.MIN_GPU_TIMED_STEPS:
        return Clock(
            CPU,
            f"only {len(timed)} GPU-timed steps in the window (MIN_GPU_TIMED_STEPS = "
            f"{th.MIN_GPU_TIMED_STEPS}); CPU clock for every rank",
            dict(window.steps),
        )
    return Clock(
        GPU,
        f"CUDA event timings on {len(timed)} GPU-timed steps of the window, common to every "
        "rank; phases are measured over those steps",
        gpu_steps,
    )


def part_columns(steps: StepTable, clock: Clock) -> dict[str, Sequence[int | None]]:
    """Each part of ``steps`` on ``clock``, as a column: part name
    (:data:`~traceml.analysis.document.PARTS`) -> one value per step in µs (None: not measured),
    plus ``outside``: the time outside the step (:func:`traceml.analysis.outside.split_gap`;
    input wait is then the DataLoader time alone).
    The residual is the step minus its outside-step time and the measured phases, at least 0
    (phases timed on the GPU may overlap host time). Built column by column: the
    analysis of a million steps must not build a dict per step."""
    columns = {name: steps[key] for name, key in clock.phase_fields}
    columns["input_wait"], outside_us = split_gap(
        columns["input_wait"], steps["dataloader_next_us"]
    )
    residual = []
    rows = zip(steps["step_us"], outside_us, *columns.values(), strict=True)
    for step_us, outside, *phases in rows:
        measured = [v for v in phases if v is not None]
        residual.append(max(0, step_us - (outside or 0) - sum(measured)) if measured else None)
    columns["residual"] = residual
    columns["outside"] = outside_us
    return columns


@dataclass
class Profile:
    """One rank's step time and its parts over a set of steps (ms unless named).

    Attributes:
        rank: global rank.
        steps: number of window steps (``step_ms`` covers them all).
        step_ms: ``describe`` of the step time without time outside the steps (median, mean,
            p95, max, count; :func:`in_step_us`).
        median_ms: per part (:data:`~traceml.analysis.document.PARTS`, plus
            ``dataloader_next``), the median over the clock's steps where it was measured;
            None when never measured.
        share_pct: per part, its total over the steps as a share of the total step time
            without time outside the steps (unmeasured steps count 0); None when never
            measured.
        own_compute_ms: median of forward + optimizer per step: compute that never waits on
            other ranks in DDP (backward holds the gradient all-reduce, so it absorbs every
            rank's wait for the slowest); None when neither was measured.
        parts: :func:`part_columns` of the clock's steps (µs), for the per-step analyses
            (spikes, onsets) to reuse.
    """

    rank: int
    steps: int
    step_ms: Description | None
    median_ms: dict[str, float | None]
    share_pct: dict[str, float | None]
    own_compute_ms: float | None
    parts: dict[str, Sequence[int | None]] = field(default_factory=dict, repr=False, compare=False)


def _ms(us: float | None) -> float | None:
    return None if us is None else us / 1000.0


def profile(rank: int, window_steps: StepTable, clock: Clock) -> Profile:
    """The :class:`Profile` of ``rank``: step time over its window steps, parts over the
    clock's steps."""
    steps = clock.steps[rank]
    parts = part_columns(steps, clock)
    total_us = sum(steps["step_us"]) - sum(v or 0 for v in parts["outside"])
    median_ms: dict[str, float | None] = {}
    share_pct: dict[str, float | None] = {}
    for name in PARTS:
        values = parts[name]
        median_ms[name] = _ms(median(values))
        measured = [v for v in values if v is not None]
        share_pct[name] = 100.0 * sum(measured) / total_us if measured and total_us else None
    median_ms["dataloader_next"] = _ms(median(steps["dataloader_next_us"]))
    own = [
        None if forward is None and optimizer is None else (forward or 0) + (optimizer or 0)
        for forward, optimizer in zip(parts["forward"], parts["optimizer"], strict=True)
    ]
    return Profile(
        rank=rank,
        steps=len(window_steps),
        step_ms=describe(_ms(v) for v in in_step_us(window_steps)),
        median_ms=median_ms,
        share_pct=share_pct,
        own_compute_ms=_ms(median(own)),
        parts=parts,
    )


def in_step_us(steps: StepTable) -> list[int]:
    """Each step's time without its outside-step time (µs): input wait plus the step body."""
    return [s - (o or 0) for s, o in zip(steps["step_us"], outside_column(steps), strict=True)]


def profiles(window: Window, clock: Clock) -> dict[int, Profile]:
    """Profiles of every window rank over the window; a rank whose steps are a sample takes
    its figures (step time, part medians and shares, own compute) from its digest
    (:meth:`traceml.analysis.digest.RankDigest.figures`), its ``parts`` from the sample."""
    out = {}
    for rank, steps in window.steps.items():
        prof = out[rank] = profile(rank, steps, clock)
        digest = window.digests.get(rank)
        if digest is not None:
            figures = digest.figures(clock.name)
            prof.steps = digest.counted
            prof.step_ms = figures["step_ms"]
            prof.median_ms = figures["median_ms"]
            prof.share_pct = figures["share_pct"]
            prof.own_compute_ms = figures["own_compute_ms"]
    return out


def missing_phases(clock: Clock) -> dict[str, list[int]]:
    """Required phases never measured on the clock's steps, each with the ranks lacking it."""
    out: dict[str, list[int]] = {}
    for name, cpu, gpu in PHASES:
        if name not in REQUIRED_PHASES:
            continue
        key = clock.phase_field(cpu, gpu)
        lacking = [r for r, steps in clock.steps.items() if all(v is None for v in steps[key])]
        if lacking:
            out[name] = sorted(lacking)
    return out
