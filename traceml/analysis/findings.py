"""A finding: one diagnosed fact about the run, with its evidence and what to do next.

The primary diagnosis and every per-section finding of ``final_summary.json`` have this shape
(see ``docs/reading-output.md`` for each ``kind``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Annotated, Any

from traceml.analysis.schema import Schema

#: Severities, mildest first: ``info`` needs no action, ``warning`` costs time or risks the
#: run, ``critical`` dominates the step or lost a rank.
SEVERITIES = ("info", "warning", "critical")

#: Every kind of finding, by section of ``final_summary.json`` (``step_time`` kinds are also
#: possible primary diagnoses: :data:`PRIMARY_KINDS`). docs/reading-output.md explains each one.
KINDS = {
    "step_time": (
        "INPUT_BOUND",
        "H2D_BOUND",
        "COMPUTE_BOUND",
        "RESIDUAL_HEAVY",
        "COMM_BOUND",
        "INPUT_STRAGGLER",
        "H2D_STRAGGLER",
        "COMPUTE_STRAGGLER",
        "STRAGGLER",
        "NODE_STRAGGLER",
        "LATE_ARRIVAL",
        "OUTSIDE_STEP_TIME",
        "STEP_SPIKES",
        "SLOWDOWN",
        "STEP_TIME_DRIFT",
        "INSUFFICIENT_DATA",
    ),
    "memory": ("MEMORY_PRESSURE", "MEMORY_IMBALANCE", "MEMORY_CREEP", "HOST_MEMORY_CREEP"),
    "system": (
        "LOW_GPU_UTILIZATION",
        "MODERATE_GPU_UTILIZATION",
        "HIGH_CPU",
        "HIGH_RAM",
        "NODE_RAM_GROWTH",
        "HIGH_GPU_TEMPERATURE",
    ),
    "health": (
        "RANK_CRASHED",
        "RANK_HUNG",
        "RUN_INTERRUPTED",
        "RANK_TERMINATED",
        "RANK_MISSING",
        "RANK_NEVER_REPORTED",
        "NODE_FAILED",
        "NODE_LOST",
        "RANK_WITHOUT_STEPS",
        "TELEMETRY_DROPPED",
        "GPU_TIMING_UNRESOLVED",
        "RESTARTED",
        "AGGREGATOR_RESTARTED",
        "AGGREGATOR_LOST",
        "TELEMETRY_REFUSED",
        "SCRIPT_PROCESS_GROUP",
    ),
}

#: The possible primary diagnoses: the step-time kinds but LATE_ARRIVAL (it names who makes the
#: others wait, not why; :mod:`traceml.analysis.skew`), RANK_HUNG when a hang lost more
#: wall time than the step-time verdict costs over the run (:func:`~.health.hang_first`), and,
#: when too few steps came for a diagnosis, the health finding that says why
#: (:func:`~.health.why_too_few_steps_first`).
PRIMARY_KINDS = tuple(k for k in KINDS["step_time"] if k != "LATE_ARRIVAL") + (
    "RANK_HUNG",
    "NODE_FAILED",
    "RANK_CRASHED",
    "RUN_INTERRUPTED",
)

#: ``evidence.statistic`` of a step-time finding: its headline figure, its percentage and its
#: evidence are all medians per step (the percentage is one median over another) ...
MEDIAN = "median_per_step"
#: ... or all totals over the window steps (the percentage is a share of the summed time:
#: time outside the steps, spikes).
SUMMED = "share_of_summed_time"
#: ``evidence.statistic`` of a memory or system finding: the highest reading over the run
#: (the CUDA allocator's running peaks, the hottest GPU reading, the fullest RAM sample) ...
PEAK = "peak_over_run"
#: ... the median of a sampler's readings over the window's span (GPU utilisation, CPU) ...
SAMPLED_MEDIAN = "median_over_samples"
#: ... or the growth between the medians of the first and last thirds of the readings after
#: warm-up (memory creep, :mod:`traceml.analysis.memory`).
TREND = "growth_between_thirds"
#: ... or the Theil-Sen slope (the median of the slopes between every two readings) of the
#: later half of a memory series after warm-up (host memory creep, node RAM growth:
#: :func:`traceml.analysis.memory.growth`).
SLOPE = "theil_sen_slope"
#: ``evidence.statistic`` of a health finding and of INSUFFICIENT_DATA: what happened to ranks,
#: nodes or the telemetry, or what is missing (end states, restarts, counts of records), not a
#: statistic of a series.
EVENTS = "events"
#: Every ``evidence.statistic``: each finding states the one its figures use.
STATISTICS = (MEDIAN, SUMMED, PEAK, SAMPLED_MEDIAN, TREND, SLOPE, EVENTS)


@dataclass
class Finding:
    """One diagnosis.

    Attributes:
        kind: upper-case name, e.g. ``INPUT_STRAGGLER`` (listed in docs/reading-output.md).
        severity: one of :data:`SEVERITIES`.
        summary: one sentence with the numbers that prove it.
        action: what to try next.
        evidence: named figures behind the summary (units in the names: ``_ms``, ``_pct``,
            ``_bytes``).
        ranks: global ranks involved (the slow ones for a straggler).
        nodes: node ranks involved.
        impact_ms: step time this finding costs every step, ms (step-time findings only;
            the primary diagnosis is the one with the largest).
    """

    kind: Annotated[str, Schema(pattern="^[A-Z][A-Z0-9_]*$")]
    severity: Annotated[str, Schema(enum=list(SEVERITIES))]
    summary: Annotated[str, Schema(minLength=1)]
    action: Annotated[str, Schema(minLength=1)]
    evidence: dict[str, Any] = field(default_factory=dict)
    ranks: list[int] = field(default_factory=list)
    nodes: list[int] = field(default_factory=list)
    impact_ms: Annotated[
        float | None,
        Schema(description="step time this finding costs every step, ms (step-time findings)"),
    ] = None

    def to_json(self) -> dict[str, Any]:
        """The JSON object written to the summary."""
        return {
            "kind": self.kind,
            "severity": self.severity,
            "summary": self.summary,
            "action": self.action,
            "evidence": self.evidence,
            "ranks": sorted(self.ranks),
            "nodes": sorted(self.nodes),
            "impact_ms": None if self.impact_ms is None else round(self.impact_ms, 3),
        }


def ranks_text(ranks: list[int]) -> str:
    """``"rank 3"`` or ``"ranks 1, 4, 7"`` (at most 8 named, then a count)."""
    return numbered_text("rank", ranks)


def numbered_text(noun: str, numbers: list[int]) -> str:
    """``"node 3"`` or ``"nodes 1, 4, 7"`` for ``noun`` "node", sorted (at most 8 named, then
    a count)."""
    numbers = sorted(numbers)
    if len(numbers) == 1:
        return f"{noun} {numbers[0]}"
    shown = ", ".join(str(n) for n in numbers[:8])
    more = f" and {len(numbers) - 8} more" if len(numbers) > 8 else ""
    return f"{noun}s {shown}{more}"
