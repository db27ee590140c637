"""The summary document (``final_summary.json``) as typed dataclasses.

:func:`traceml.analysis.summary.build_summary` builds a :class:`Summary`; the finding rules read
its parts (:class:`RankSummary`, :class:`NodeSummary`, :class:`Typical`, ...), and
:func:`~traceml.analysis.schema.plain` turns it into the JSON written to disk: the field order
here is the key order there. ``docs/final_summary.schema.json`` is generated from these classes
(:func:`summary_schema`; ``python -m traceml.analysis.document docs/final_summary.schema.json``),
and a test fails when the committed file is stale.

Units: every duration in milliseconds (``*_ms``), every size in bytes (``*_bytes``), shares in
percent (``*_pct``); a figure that was never measured is None (``null``), never 0.
"""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from traceml.analysis import thresholds
from traceml.analysis.findings import KINDS, PRIMARY_KINDS, SUMMED, Finding
from traceml.analysis.schema import Keys, Refine, Schema, json_schema
from traceml.core import phases as table
from traceml.core.ends import COMPLETED, FAILED, REPORTED_END_STATES

#: Version of the summary document's layout; see docs/final_summary.schema.json.
SCHEMA_VERSION = 1

#: End states of a rank, as in ``ranks[].end.state`` (:func:`traceml.analysis.health.end_state`
#: decides them): those a rank or its launcher reports (:mod:`traceml.core.ends`), and two that
#: only the analysis knows.
RUNNING = "running"  # no end known yet (live summary) or given up on at finalization
NEVER_REPORTED = "never_reported"
END_STATES = REPORTED_END_STATES + (RUNNING, NEVER_REPORTED)
#: ``run.status`` values besides COMPLETED, FAILED and RUNNING (see :func:`~.health.run_status`).
INTERRUPTED = "interrupted"
INCOMPLETE = "incomplete"
RUN_STATUSES = (RUNNING, FAILED, INTERRUPTED, INCOMPLETE, COMPLETED)

#: Clocks of an analysis, as in ``analysis.clock.name`` (picked by
#: :func:`traceml.analysis.phases.choose_clock`): the host's (``time.perf_counter_ns``) or CUDA
#: events'.
CPU = "cpu"
GPU = "gpu"

#: Allocated-memory trends of a rank (see :mod:`traceml.analysis.memory`).
PLATEAU = "plateau"
CREEP = "creep"

#: Every part of a step, as the summary keys it (``phase_share_pct``): the phases that are parts,
#: then the residual, in the order of :data:`traceml.core.phases.PARTS`.
PARTS = tuple(p.name for p in table.PARTS)
#: Parts of ``ranks[].phase_median_ms``: the parts of the step, then the DataLoader's own time.
MEDIAN_PARTS = PARTS + ("dataloader_next",)

Count = Annotated[int, Schema(minimum=0)]
Ms = float
MaybeMs = float | None
MsByPart = dict[str, MaybeMs]  # part name -> ms (None: not measured)


def _kinds(section: str) -> Refine:
    """What refines a finding of ``section``: its ``kind`` is one of that section's kinds."""
    return Refine({"properties": {"kind": {"enum": list(KINDS[section])}}})


@dataclass
class RunInfo:
    """``run``: identity, topology and completeness."""

    run_name: str
    world_size: Count
    nodes: Annotated[list[int], Schema(description="node ranks seen")]
    complete: Annotated[bool, Schema(description="every expected rank finished or is known dead")]
    missing_ranks: Annotated[
        list[int],
        Schema(description="ranks finalization gave up waiting for (a partial summary)"),
    ]
    attempt: Annotated[
        int,
        Schema(minimum=0, description="latest torchrun attempt (restart count) analysed"),
    ]
    status: Annotated[
        str,
        Schema(
            enum=list(RUN_STATUSES),
            description="running (live); failed: a rank failed or died of a signal; "
            "interrupted: ranks stopped by their launcher's SIGTERM/SIGINT (scancel, "
            "preemption, Ctrl-C); incomplete: ranks missing or never reported; completed",
        ),
    ]
    telemetry_health: TelemetryHealth
    rejected: Annotated[
        dict[str, Annotated[int, Schema(minimum=1)]],
        Schema(
            description="calls the aggregator refused, by kind (unauthenticated, foreign_run, "
            "rank_out_of_range, world_size_mismatch, identity_mismatch, not_a_rank, "
            "node_rank_out_of_range, restart_regressed, second_sender, script_world_mismatch, "
            "script_parent, bad_sequence, malformed, value_out_of_range, node_claim): see "
            "docs/wire.md; findings.health's TELEMETRY_REFUSED gives each kind's first reason"
        ),
    ]


@dataclass
class AggregatorOutage:
    """``run.telemetry_health.aggregator_outages[]``: one restart of node 0's aggregator
    (:attr:`~traceml.analysis.rundata.RunData.aggregator_restarts`)."""

    reason: Annotated[str, Schema(description="why the previous aggregator ended")]
    gap_s: Annotated[
        float,
        Schema(
            minimum=0,
            description="seconds from the death the launcher saw to the replacement serving",
        ),
    ]
    restarted_unix_s: Annotated[
        float, Schema(description="when the replacement aggregator served, unix seconds")
    ]


@dataclass
class AggregatorLoss:
    """``run.telemetry_health.aggregator_loss``: node 0's aggregator stopped storing for good
    (it died and the launcher did not restart it, or its store stopped committing)
    (:attr:`~traceml.analysis.rundata.RunData.aggregator_loss`): the telemetry sent after
    ``lost_unix_s`` was not stored."""

    reason: Annotated[
        str,
        Schema(
            description="why: the launcher's words, or `its store failed to commit: ERROR` (a "
            "full disk)"
        ),
    ]
    lost_unix_s: Annotated[
        float,
        Schema(
            description="when the launcher saw the aggregator lost, or the store's first "
            "failed commit, unix seconds"
        ),
    ]


@dataclass
class RankDelivery:
    """``run.telemetry_health.ranks[]``: what one rank's client produced and gave up, from the
    running totals that every batch carries (``SenderCounts``), so known even for a rank whose
    finish marker never arrived (a rank SIGKILLed after an outage)."""

    rank: Count
    steps_produced: Annotated[
        int,
        Schema(
            minimum=0, description="steps the rank handed to its client, as of its latest batch"
        ),
    ]
    steps_received: Annotated[int, Schema(minimum=0, description="steps stored")]
    steps_dropped: Annotated[
        int,
        Schema(
            minimum=0,
            description="steps the client gave up: buffer full, unsendable, "
            "unsent at exit (TRACEML_BUFFER_MAX_RECORDS, TRACEML_SIGTERM_FLUSH_SEC)",
        ),
    ]
    steps_unaccounted: Annotated[
        int,
        Schema(
            minimum=0,
            description="steps produced as of the latest batch, neither stored "
            "nor dropped: still buffered when the rank was last heard from (lost when it "
            "was killed); 0 when the finish marker arrived",
        ),
    ]
    records_dropped: Annotated[
        int, Schema(minimum=0, description="records (steps and samples) the client gave up")
    ]
    final: Annotated[
        bool,
        Schema(
            description="the figures came with the rank's finish marker (its last word); "
            "false: from its latest batch, the rank never finished its stream"
        ),
    ]


@dataclass
class NodeLoss:
    """``run.telemetry_health.node_losses[]``: a node the aggregator lost: nothing came from
    its launcher for ``lost_after_s`` (its session stream broke, or the launcher or its host
    stalled) (:attr:`~traceml.analysis.rundata.RunData.node_losses`)."""

    node_rank: Count
    hostname: Annotated[str | None, Schema(description="the node's host, as its claim named it")]
    last_heard_unix_s: Annotated[
        float, Schema(description="the last message of the node's launcher, unix seconds")
    ]
    lost_unix_s: Annotated[
        float, Schema(description="when the aggregator marked the node lost, unix seconds")
    ]
    resumed_unix_s: Annotated[
        float | None,
        Schema(description="when the node's session came back, unix seconds; null: never"),
    ]
    lost_after_s: Annotated[
        float,
        Schema(
            minimum=0,
            description="seconds of silence after which the node was marked lost: the bound, "
            "or less when its session broke and it reported no exit before the summary",
        ),
    ]


@dataclass
class SenderStream:
    """``run.telemetry_health.sender_streams[]``: how one sender's latest stream to the
    aggregator ended (``traceml_aggregator/streams.py``). A rank that exited cleanly has
    ``closed`` and ``finished``; one that vanished (killed, host lost) has ``lost``."""

    sender: Annotated[
        str, Schema(enum=["rank", "node"], description="a rank's SDK or a node's sampler")
    ]
    id: Annotated[int, Schema(minimum=0, description="the rank, or the node rank")]
    restart: Annotated[int, Schema(minimum=0, description="torchrun attempt")]
    state: Annotated[
        str,
        Schema(
            enum=["open", "closed", "lost"],
            description="open: still open when the summary was built; closed: the sender "
            "closed it; lost: cancelled, connection reset, or no keepalive answer (within "
            "40 s of the sender vanishing)",
        ),
    ]
    finished: Annotated[bool, Schema(description="the sender's finish marker was stored")]
    streams: Annotated[
        int,
        Schema(
            minimum=1,
            description="streams the sender opened (one more after each "
            "fork, outage or aggregator restart)",
        ),
    ]
    since_unix_s: Annotated[float, Schema(description="when the state was reached, unix seconds")]


@dataclass
class TelemetryHealth:
    """``run.telemetry_health``: what happened to the telemetry path during the run."""

    aggregator_restarts: Annotated[
        int,
        Schema(
            minimum=0,
            description="times node 0's launcher restarted a dead aggregator on the run's store",
        ),
    ]
    aggregator_outages: Annotated[
        list[AggregatorOutage], Schema(description="each restart, in order")
    ]
    aggregator_loss: Annotated[
        AggregatorLoss | None,
        Schema(
            description="node 0's aggregator stopped storing for good (not restarted, or its "
            "store failed): the summary covers "
            "only what was stored until then; null: not lost"
        ),
    ]
    ranks: Annotated[
        list[RankDelivery],
        Schema(description="per rank (those whose batches carried their totals), by rank"),
    ]
    sender_streams: Annotated[
        list[SenderStream],
        Schema(description="per sender and attempt, ranks first: how its stream ended"),
    ]
    node_losses: Annotated[
        list[NodeLoss], Schema(description="each node the aggregator lost, in order")
    ]


@dataclass
class Findings:
    """``findings``: the findings of each section (besides the primary diagnosis)."""

    step_time: list[Annotated[Finding, _kinds("step_time")]]
    memory: list[Annotated[Finding, _kinds("memory")]]
    system: list[Annotated[Finding, _kinds("system")]]
    health: list[Annotated[Finding, _kinds("health")]]


@dataclass
class ClockInfo:
    """``analysis.clock``: the clock of the analysis and why (see :mod:`~.phases`)."""

    name: Annotated[str, Schema(enum=[CPU, GPU])]
    reason: str
    steps: Annotated[
        int,
        Schema(
            minimum=0,
            description="steps per rank the parts of the step are measured over (on the GPU "
            "clock: the GPU-timed ones)",
        ),
    ]


@dataclass
class WindowInfo:
    """``analysis.window``: the aligned steps every rank completed (see :mod:`~.window`)."""

    first_step: int | None
    last_step: int | None
    steps: Count
    warmup_steps_skipped: Count
    ranks: list[int]
    ranks_without_steps: list[int]


@dataclass
class Typical:
    """``analysis.typical``: the typical rank, per figure the lower median across the window
    ranks (so the parts need not add up to the step)."""

    step_time_ms: MaybeMs
    phase_median_ms: MsByPart
    phase_share_pct: MsByPart


@dataclass
class CommSplit:
    """``analysis.comm``: the ranks' ``comm`` phase split into the collectives' transfer and each
    rank's wait for its peers (:mod:`traceml.analysis.comm`), medians per step, ms; ``null``
    when no step of the window has ``comm`` on every rank."""

    statistic: str
    steps: Annotated[Count, Schema(description="window steps with comm on every rank")]
    transfer_ms: Annotated[Ms, Schema(description="per step, the least comm of any rank")]
    comm_ms: Annotated[dict[str, Ms], Schema(description="rank -> its comm per step")]
    wait_ms: Annotated[dict[str, Ms], Schema(description="rank -> its comm minus the transfer")]


@dataclass
class ArrivalSkew:
    """``analysis.skew``: who arrives last at the ranks' collectives (:mod:`traceml.analysis.
    skew`), from each step's arrival (its last collective waited in) on node 0's clock;
    ``null`` when fewer than two window ranks sent arrivals at the same collectives."""

    statistic: str
    collectives: Annotated[Count, Schema(description="collectives compared: one per step")]
    mismatched: Annotated[
        Count, Schema(description="window steps whose ranks were at different collectives")
    ]
    ranks_without: Annotated[
        list[int], Schema(description="window ranks that sent no arrival (left out)")
    ]
    last_pct: Annotated[
        dict[str, float], Schema(description="rank -> share of the collectives it arrived last, %")
    ]
    late_ms: Annotated[
        dict[str, Ms],
        Schema(description="rank -> median lateness after the others' median when it arrived last"),
    ]
    wait_ms: Annotated[
        dict[str, Ms], Schema(description="rank -> median wait for the last arrival")
    ]
    clock_offsets_ms: Annotated[
        dict[str, Ms], Schema(description="node -> its clock's offset from node 0's")
    ]
    clock_error_ms: Annotated[
        MaybeMs,
        Schema(
            description="largest error bound of the compared nodes' offsets (0: one node; "
            "null: a node sent none)"
        ),
    ]
    withheld: Annotated[
        str | None,
        Schema(description="why no LATE_ARRIVAL is raised whatever the figures, or null"),
    ]


@dataclass
class Analysis:
    """``analysis``: how the figures were made."""

    clock: ClockInfo
    window: WindowInfo
    typical: Typical
    comm: CommSplit | None
    skew: ArrivalSkew | None
    throughput: JobThroughput
    thresholds: Annotated[dict[str, float], Keys(thresholds.as_dict())]


@dataclass
class RankEnd:
    """``ranks[].end``: how the rank ended (see :func:`~.health.end_state`)."""

    state: Annotated[str, Schema(enum=list(END_STATES))]
    exit_code: int | None
    signal: int | None
    reason: str | None


@dataclass
class StepTime:
    """``ranks[].step_time_ms``: the rank's step time over the window, ms."""

    median: Annotated[Ms, Schema(description="median step time, ms")]
    mean: Annotated[Ms, Schema(description="mean step time, ms")]
    p95: Annotated[Ms, Schema(description="p95 step time, ms")]
    max: Annotated[Ms, Schema(description="max step time, ms")]


@dataclass(frozen=True)
class Trend:
    """``ranks[].memory.trend``: a rank's allocated-memory trend after warm-up.

    Attributes:
        name: :data:`PLATEAU` or :data:`CREEP`.
        start_bytes: median of the first third of the readings after warm-up.
        end_bytes: median of the last third.
        growth_bytes: ``end_bytes - start_bytes``.
        bytes_per_1k_steps: growth rate between the two thirds' middle steps (written
            rounded to a whole byte).
        readings: readings the test used (after warm-up).
    """

    name: Annotated[str, Schema(enum=[PLATEAU, CREEP])]
    start_bytes: int
    end_bytes: int
    growth_bytes: int
    bytes_per_1k_steps: float
    readings: int

    def to_json(self) -> dict[str, Any]:
        """The JSON object written to the summary."""
        return {
            "name": self.name,
            "start_bytes": self.start_bytes,
            "end_bytes": self.end_bytes,
            "growth_bytes": self.growth_bytes,
            "bytes_per_1k_steps": round(self.bytes_per_1k_steps),
            "readings": self.readings,
        }


@dataclass(frozen=True)
class Growth:
    """A memory series' growth test (:func:`traceml.analysis.memory.growth`): a rank's RSS
    (``ranks[].memory.host_growth``), its CUDA allocator's peaks (``ranks[].memory.gpu_growth``)
    or a node's used RAM (``nodes[].system.ram_growth``).

    Attributes:
        name: :data:`CREEP` (still growing after warm-up, significantly and by enough) or
            :data:`PLATEAU`.
        statistic: :data:`~traceml.analysis.findings.SLOPE`: the rates are Theil-Sen slopes
            (the median of the slopes between every two readings) over the readings from the
            growth's onset on (at least MEMORY_MIN_SAMPLES of them), else over the later half
            of the readings after warm-up (and always for a plateau).
        start_bytes: median of the first readings after warm-up (a tenth of them, at least 1).
        end_bytes: median of the last readings (as many).
        bytes_per_step: growth per training step (None for a node's RAM).
        bytes_per_hour: growth per hour of wall time.
        kendall_z: Mann-Kendall z of that later half (how sure the rise is: 3 is p ~ 0.001).
        onset_step: the step at which the growth began (a flat level, then a line: the split
            of least squared error); None for a node's RAM or a plateau.
        onset_unix_s: the same moment in unix seconds (None for a plateau).
        readings: readings the test used (after warm-up).
    """

    name: Annotated[str, Schema(enum=[PLATEAU, CREEP])]
    statistic: str
    start_bytes: int
    end_bytes: int
    bytes_per_step: float | None
    bytes_per_hour: float
    kendall_z: float
    onset_step: int | None
    onset_unix_s: float | None
    readings: Count

    def to_json(self) -> dict[str, Any]:
        """The JSON object written to the summary (rates rounded to a whole byte)."""
        return {
            "name": self.name,
            "statistic": self.statistic,
            "start_bytes": self.start_bytes,
            "end_bytes": self.end_bytes,
            "bytes_per_step": None if self.bytes_per_step is None else round(self.bytes_per_step),
            "bytes_per_hour": round(self.bytes_per_hour),
            "kendall_z": round(self.kendall_z, 2),
            "onset_step": self.onset_step,
            "onset_unix_s": None if self.onset_unix_s is None else round(self.onset_unix_s, 3),
            "readings": self.readings,
        }


@dataclass
class RankMemory:
    """``ranks[].memory``: CUDA allocator peaks (bytes), the GPU's total, pressure, trend, and
    the growth of the process's RSS (host memory)."""

    peak_allocated_bytes: int | None
    peak_reserved_bytes: int | None
    gpu_total_bytes: int | None
    pressure_pct: float | None
    trend: Trend | None
    unavailable_reason: str | None
    host_growth: Annotated[
        Growth | None,
        Schema(
            description="the process's RSS over the steps (node sampler, about once a "
            "second); null: fewer than MEMORY_MIN_SAMPLES readings after warm-up"
        ),
    ] = None
    gpu_growth: Annotated[
        Growth | None,
        Schema(
            description="the CUDA allocator's peak allocated readings under the same "
            "growth test; null: fewer than MEMORY_MIN_SAMPLES readings after warm-up"
        ),
    ] = None


@dataclass
class RankProcess:
    """``ranks[].process``: the rank's process as the node sampler saw it."""

    samples: Count
    cpu_percent_median: float | None
    rss_bytes_max: int | None
    gpu_allocated_bytes_max: int | None
    gpu_reserved_bytes_max: int | None


@dataclass
class Series:
    """``ranks[].series``: the charted series (bucket medians past SERIES_MAX_POINTS)."""

    step: list[int]
    step_ms: list[float]
    memory_step: list[int]
    peak_allocated_bytes: list[int]
    peak_reserved_bytes: list[int]


@dataclass
class OutsideSteps:
    """``ranks[].outside_steps``: the rank's time outside the window steps (evaluation,
    checkpoints, logging between steps; :func:`traceml.analysis.outside.rank_outside`)."""

    statistic: Annotated[
        str, Schema(const=SUMMED, description="the share is of summed time, not a median")
    ]
    share_of_wall_pct: Annotated[
        float | None,
        Schema(description="outside-step time as a share of the window steps' wall time, %"),
    ]
    total_ms: Annotated[Ms, Schema(description="outside-step time over the window, ms")]
    wall_ms: Annotated[Ms, Schema(description="summed wall time of the window steps, ms")]
    gaps: Annotated[
        int,
        Schema(
            minimum=0,
            description="gaps long enough to count (OUTSIDE_GAP_MIN_PCT of the in-step median)",
        ),
    ]
    gap_median_ms: Annotated[MaybeMs, Schema(description="median of those gaps, ms")]
    gap_max_ms: Annotated[MaybeMs, Schema(description="longest of those gaps, ms")]
    period_steps: Annotated[
        int | None, Schema(description="median steps between two such gaps (null: under 2)")
    ]
    gap_steps: Annotated[list[int], Schema(description="steps after such a gap (at most 50)")]
    in_step_median_ms: Annotated[
        Ms, Schema(description="median step time without outside-step time, ms")
    ]
    first_gap_ms: Annotated[
        MaybeMs,
        Schema(
            description="outside-step time before the rank's step 1 (start-up), ms; "
            "kept out of every share and count"
        ),
    ]


@dataclass
class Mfu:
    """``ranks[].throughput.mfu``: the rank's model FLOPs and MFU over the window
    (:mod:`traceml.analysis.throughput`; counted by :mod:`traceml.sdk.workload`)."""

    statistic: Annotated[
        str,
        Schema(
            const=SUMMED, description="FLOPs summed over the window steps / their summed wall time"
        ),
    ]
    counted_step: Annotated[
        int | None, Schema(description="step whose first training forward was counted")
    ]
    forward_flops: Annotated[
        int | None,
        Schema(description="FLOPs of that forward (FlopCounterMode; a multiply-add is 2)"),
    ]
    flops_per_step: Annotated[
        int | None,
        Schema(
            description="median model FLOPs of a window step: 3 x forward "
            "FLOPs x training forwards in the step"
        ),
    ]
    count_ms: Annotated[
        MaybeMs, Schema(description="wall time of the counted forward, counting included, ms")
    ]
    dtype: Annotated[str | None, Schema(description="matmul dtype of the counted forward")]
    device_name: Annotated[
        str | None, Schema(description="the rank's device (cpu, or the CUDA device's name)")
    ]
    achieved_tflops: Annotated[float | None, Schema(description="model TFLOP/s achieved")]
    peak_tflops: Annotated[
        float | None, Schema(description="dense peak TFLOPS it is measured against")
    ]
    peak_source: Annotated[
        str | None,
        Schema(description="--peak-tflops, or 'table: <GPU> <dtype> dense' (null: no peak)"),
    ]
    mfu_pct: Annotated[
        float | None,
        Schema(
            description="achieved / peak, % (null: no peak or no FLOPs: see unavailable_reason)"
        ),
    ]
    unavailable_reason: str | None


@dataclass
class RankThroughput:
    """``ranks[].throughput``: samples, tokens and MFU over the window steps
    (:mod:`traceml.analysis.throughput`; samples and tokens read from the DataLoader's batch
    shapes by :mod:`traceml.sdk.workload`)."""

    statistic: Annotated[
        str,
        Schema(
            const=SUMMED,
            description="totals over the window steps / their summed "
            "wall time (step time, input wait and outside-step time included)",
        ),
    ]
    steps: Annotated[
        int,
        Schema(
            minimum=0,
            description="window steps with a sample count (a step without one "
            "adds its time, no samples: a loader that fetches ahead)",
        ),
    ]
    samples_per_s: Annotated[
        float | None,
        Schema(description="samples per second (null: no DataLoader batch with a tensor seen)"),
    ]
    tokens_per_s: Annotated[
        float | None,
        Schema(description="token ids per second (null: the batches hold no token ids)"),
    ]
    samples_per_step: Annotated[float | None, Schema(description="median samples per step")]
    tokens_per_step: Annotated[float | None, Schema(description="median tokens per step")]
    mfu: Mfu


@dataclass
class JobThroughput:
    """``analysis.throughput``: the job's throughput and MFU, sums over the window ranks
    (right for data parallelism; see :mod:`traceml.analysis.throughput`)."""

    statistic: Annotated[str, Schema(const=SUMMED)]
    samples_per_s: Annotated[float | None, Schema(description="samples/s, summed over ranks")]
    tokens_per_s: Annotated[float | None, Schema(description="tokens/s, summed over ranks")]
    achieved_tflops: Annotated[float | None, Schema(description="model TFLOP/s, summed")]
    peak_tflops: Annotated[float | None, Schema(description="peaks, summed")]
    mfu_pct: Annotated[
        float | None,
        Schema(description="achieved / peak, % (null unless every window rank has both)"),
    ]
    mfu_unavailable_reason: str | None


@dataclass
class RankSummary:
    """``ranks[]``: one rank's identity, end, counts, window figures, memory and process."""

    rank: Count
    restart: Count
    node_rank: int | None
    local_rank: int | None
    hostname: str | None
    device: str | None
    end: RankEnd
    steps_completed: Count
    records_received: Count
    records_dropped: int | None
    steps_gpu_unresolved: int | None
    step_time_ms: StepTime | None
    phase_median_ms: Annotated[MsByPart, Keys(MEDIAN_PARTS, "median {} per step, ms")]
    phase_share_pct: Annotated[MsByPart, Keys(PARTS, "{} share of the step time, %")]
    memory: RankMemory
    process: RankProcess
    earlier_attempts: Annotated[
        dict[str, int], Schema(description="earlier attempt number -> steps stored")
    ]
    series: Series
    outside_steps: Annotated[
        OutsideSteps | None,
        Schema(
            description="time outside the steps; null when not separable (no DataLoader) "
            "or the rank is outside the window"
        ),
    ]
    relative_score: Annotated[
        Annotated[
            MsByPart,
            Keys(
                PARTS,
                "{}: the fastest rank's median / this rank's (1.0 fastest; null: not measured)",
            ),
        ]
        | None,
        Schema(
            description="per part, how this rank compares with the fastest (null: rank "
            "outside the window)"
        ),
    ]
    step_time_sample_ms: Annotated[
        list[float],
        Schema(
            description="window step times without outside-step time, ms, every k-th "
            "step so that at most STEP_SAMPLE_MAX remain (traceml compare's bootstrap)"
        ),
    ]
    throughput: Annotated[
        RankThroughput | None, Schema(description="null: the rank is outside the window")
    ]


@dataclass
class CpuPercent:
    """``nodes[].system.cpu_percent``: the node's CPU use, % of all cores."""

    median: float
    p95: float
    max: float


@dataclass
class GpuFigures:
    """``nodes[].system.gpus[]``: one GPU as NVML saw it."""

    nvml_index: int
    uuid: str | None
    util_percent_median: float | None
    memory_used_bytes_max: int | None
    memory_total_bytes: int | None
    temperature_c_max: float | None
    power_w_median: float | None
    unavailable_reason: str | None


@dataclass
class NodeSystem:
    """``nodes[].system``: the node's host and GPUs over the window's span."""

    samples: Count
    cpu_percent: CpuPercent | None
    ram_used_pct_max: float | None
    ram_total_bytes: int | None
    gpus: list[GpuFigures]
    unavailable_reason: str | None
    ram_growth: Annotated[
        Growth | None,
        Schema(
            description="the node's used RAM (total - available: page cache is not used) "
            "over the window's span; null: fewer than MEMORY_MIN_SAMPLES samples"
        ),
    ] = None


@dataclass
class NodeSummary:
    """``nodes[]``: each node's ranks, torchrun exit, step time over its ranks, system."""

    node_rank: Count
    hostname: str | None
    ranks: list[int]
    exit_code: int | None
    restart_count: int | None
    step_time_ms_median: MaybeMs
    phase_median_ms: MsByPart
    system: NodeSystem


@dataclass
class Summary:
    """The whole document."""

    schema_version: Annotated[int, Schema(const=SCHEMA_VERSION)]
    generated_unix_s: Annotated[
        float, Schema(description="when the summary was built, unix seconds")
    ]
    live: Annotated[
        bool,
        Schema(description="true for a live summary (traceml.summary()), false at finalization"),
    ]
    run: RunInfo
    primary_diagnosis: Annotated[
        Finding, Refine({"properties": {"kind": {"enum": list(PRIMARY_KINDS)}}})
    ]
    findings: Findings
    analysis: Analysis
    ranks: list[RankSummary]
    nodes: list[NodeSummary]


def summary_schema() -> dict[str, Any]:
    """The JSON Schema of ``final_summary.json`` (what docs/final_summary.schema.json holds)."""
    return json_schema(
        Summary,
        defs={"finding": Finding, "rank": RankSummary, "node": NodeSummary},
        title="TraceML final_summary.json",
        description=(
            f"The run summary written at the end of a traceml run (schema_version "
            f"{SCHEMA_VERSION}). Durations in ms (*_ms), sizes in bytes (*_bytes), shares in "
            "percent (*_pct); null = not measured. See docs/reading-output.md."
        ),
    )


def main(argv: list[str]) -> int:
    """``python -m traceml.analysis.document [PATH]``: write the summary's schema
    (:func:`summary_schema`) to PATH (default: standard output)."""
    text = json.dumps(summary_schema(), indent=2, ensure_ascii=False) + "\n"
    if argv:
        Path(argv[0]).write_text(text, encoding="utf-8")
    else:
        sys.stdout.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
