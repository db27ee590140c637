"""The summary document (``final_summary.json``) built from :class:`RunData`, I/O-free.

The typed model is :mod:`traceml.analysis.document` (``docs/final_summary.schema.json`` is
generated from it; ``docs/reading-output.md`` is the guide). Layout: ``run`` (identity,
topology, completeness), ``primary_diagnosis`` (why the steps are slow), ``findings`` by
section (``step_time``, ``memory``, ``system``, ``health``), ``analysis`` (window, clock,
typical rank, thresholds), ``ranks[]`` and ``nodes[]``.

Units: every duration is in milliseconds (``*_ms``), every size in bytes (``*_bytes``), shares
in percent (``*_pct``). A figure that was never measured is ``null``, never 0.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any, overload

from traceml.analysis import (
    comm,
    cost,
    health,
    memory,
    onset,
    outside,
    segments,
    skew,
    spikes,
    step_time,
    system,
    thresholds,
    throughput,
)
from traceml.analysis.document import (
    MEDIAN_PARTS,
    PARTS,
    SCHEMA_VERSION,
    AggregatorLoss,
    AggregatorOutage,
    Analysis,
    ClockInfo,
    Findings,
    NodeLoss,
    NodeSummary,
    OutsideSteps,
    RankDelivery,
    RankEnd,
    RankSummary,
    RankThroughput,
    RunInfo,
    SenderStream,
    Series,
    StepTime,
    Summary,
    TelemetryHealth,
    WindowInfo,
)
from traceml.analysis.findings import Finding
from traceml.analysis.phases import Clock, Profile, choose_clock, in_step_us, profiles
from traceml.analysis.rundata import RankData, RunData
from traceml.analysis.schema import plain
from traceml.analysis.stats import bucket_medians, median
from traceml.analysis.window import Window, align

#: Most points per rank in the charted series (``ranks[].series``); longer runs are bucketed.
SERIES_MAX_POINTS = 400
#: Most step times per rank in ``ranks[].step_time_sample_ms`` (the compare's bootstrap).
STEP_SAMPLE_MAX = 500

_EMPTY_PHASES = dict.fromkeys(MEDIAN_PARTS)


@overload
def _round(value: float, digits: int = 3) -> float: ...


@overload
def _round(value: float | None, digits: int = 3) -> float | None: ...


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def node_rank(rd: RankData) -> int | None:
    """The rank's node: from its identity, else from its launcher's end report."""
    for source in (rd.identity, rd.end):
        node: int | None = source.node_rank if source else None
        if node is not None:
            return node
    return None


def _series(rd: RankData) -> Series:
    steps = rd.steps
    xs, step_ms = bucket_medians(
        steps["step"], [us / 1000.0 for us in steps["step_us"]], SERIES_MAX_POINTS
    )
    mem = steps.take([i for i, b in enumerate(steps["peak_allocated_bytes"]) if b is not None])
    allocated = [b for b in mem["peak_allocated_bytes"] if b is not None]  # all of them
    mem_x, alloc = bucket_medians(mem["step"], allocated, SERIES_MAX_POINTS)
    _, reserved = bucket_medians(
        mem["step"], [b or 0 for b in mem["peak_reserved_bytes"]], SERIES_MAX_POINTS
    )
    return Series(
        step=xs,
        step_ms=[round(v, 3) for v in step_ms],
        memory_step=mem_x,
        peak_allocated_bytes=[int(v) for v in alloc],
        peak_reserved_bytes=[int(v) for v in reserved],
    )


def _delivery(rd: RankData) -> RankDelivery:
    """``run.telemetry_health.ranks[]`` entry of a rank with ``counts``."""
    c = rd.counts
    assert c is not None, "only a rank with counts has a delivery entry"
    received = rd.steps_stored
    return RankDelivery(
        rank=rd.rank,
        steps_produced=c.steps_produced,
        steps_received=received,
        steps_dropped=c.steps_dropped,
        steps_unaccounted=max(0, c.steps_produced - received - c.steps_dropped),
        records_dropped=c.records_dropped,
        final=bool(rd.finish and rd.finish.last_seq == c.seq),
    )


def rank_summary(
    rd: RankData,
    prof: Profile | None,
    *,
    missing: set[int],
    live: bool,
    gpu_totals: dict[str, int],
    span: tuple[int, int] | None,
    outside_steps: outside.OutsideSteps | None = None,
    relative_score: dict[str, float | None] | None = None,
    in_step_us: Sequence[int] = (),
    work: RankThroughput | None = None,
) -> RankSummary:
    """``ranks[]`` entry: identity, end, counts, step time and phases over the window (None
    outside it), memory, process figures, series for the charts; ``outside_steps``
    (:func:`traceml.analysis.outside.rank_outside`), ``relative_score``
    (:func:`traceml.analysis.cost.relative_scores`) and the window's in-step times (µs, for
    ``step_time_sample_ms``) and ``work`` (:func:`traceml.analysis.throughput.rank_throughput`)
    come from the whole-window analyses."""
    ident, finish, counts = rd.identity, rd.finish, rd.counts
    return RankSummary(
        rank=rd.rank,
        restart=rd.restart,
        node_rank=node_rank(rd),
        local_rank=ident.local_rank if ident else (rd.end.local_rank if rd.end else None),
        hostname=ident.hostname if ident else None,
        device=ident.device if ident else None,
        end=RankEnd(**health.end_state(rd, missing, live=live)),
        steps_completed=(
            finish.steps_completed
            if finish
            else (counts.steps_produced if counts else rd.steps_stored)
        ),
        records_received=rd.steps_stored,
        records_dropped=(
            counts.records_dropped if counts else (finish.records_dropped if finish else None)
        ),
        steps_gpu_unresolved=finish.steps_gpu_unresolved if finish else None,
        step_time_ms=(
            StepTime(*(_round(prof.step_ms[k]) for k in ("median", "mean", "p95", "max")))
            if prof and prof.step_ms
            else None
        ),
        phase_median_ms=(
            {k: _round(v) for k, v in prof.median_ms.items()} if prof else dict(_EMPTY_PHASES)
        ),
        phase_share_pct=(
            {k: _round(prof.share_pct[k], 1) for k in PARTS} if prof else dict.fromkeys(PARTS)
        ),
        memory=memory.rank_memory(rd, gpu_totals),
        process=system.rank_process(rd, span),
        earlier_attempts={str(k): v for k, v in sorted(rd.earlier_attempts.items())},
        series=_series(rd),
        outside_steps=OutsideSteps(**outside_steps) if outside_steps else None,
        relative_score=relative_score,
        step_time_sample_ms=_sample(in_step_us),
        throughput=work,
    )


def node_summaries(
    run: RunData, ranks: list[RankSummary], span: tuple[int, int] | None
) -> list[NodeSummary]:
    """``nodes[]``: each node's ranks, torchrun exit, step time over its ranks, system figures."""
    node_ids = (
        {r.node_rank for r in ranks if r.node_rank is not None}
        | set(run.system_samples)
        | set(run.node_exits)
    )
    out = []
    for n in sorted(node_ids):
        members = [r for r in ranks if r.node_rank == n]
        exit_ = run.node_exits.get(n)
        samples = run.system_samples.get(n, [])
        hostname = (
            (exit_.hostname if exit_ else None)
            or next((r.hostname for r in members if r.hostname), None)
            or (samples[-1].get("hostname") if samples else None)
        )
        stepped = [r for r in members if r.step_time_ms]
        step_medians = [st.median for r in stepped if (st := r.step_time_ms)]
        out.append(
            NodeSummary(
                node_rank=n,
                hostname=hostname,
                ranks=[r.rank for r in members],
                exit_code=exit_.exit_code if exit_ else None,
                restart_count=exit_.restart_count if exit_ else None,
                step_time_ms_median=_round(median(step_medians)),
                phase_median_ms={
                    k: _round(median(r.phase_median_ms[k] for r in stepped)) for k in PARTS
                },
                system=system.node_system(samples, run.gpu_samples.get(n, []), span),
            )
        )
    return out


def _sample(values: Sequence[int]) -> list[float]:
    """``ranks[].step_time_sample_ms``: the window's step times without time outside the
    steps (``values``, µs) in ms, every k-th step so that at most STEP_SAMPLE_MAX remain; what
    ``traceml compare`` bootstraps its interval from."""
    stride = -(-len(values) // STEP_SAMPLE_MAX) if values else 1
    return [round(v / 1000.0, 3) for v in values[::stride]]


def _onsets_and_costs(
    run: RunData,
    window: Window,
    clock: Clock,
    profs: dict[int, Profile],
    in_step: dict[int, tuple[list[int], list[int]]],
    primary: Finding,
    others: list[Finding],
    synchronized: bool,
) -> tuple[Finding, list[Finding]]:
    """Stragglers get their onset and cost; ranks slower than the others for a stretch of the
    window join them (:func:`_stretches`); the job's SLOWDOWN or STEP_TIME_DRIFT joins the
    candidates (a straggler with an onset explains a slowdown); the largest impact leads, and
    when a change (an onset, a drift) and a steady-state bottleneck are both found, the
    primary says which costs the run more (:func:`_weigh`)."""
    found = [primary] + others
    step_ms = step_time.typical(profs).step_time_ms
    assert step_ms is not None, "a diagnosis other than INSUFFICIENT_DATA has a typical step"
    floor = step_time.straggler_floor(step_ms)
    for f in found:
        if f.kind.endswith("STRAGGLER"):
            cost.annotate_straggler(f, clock, profs, run.world_size, floor, window.steps_per_index)
    found = _stretches(
        found,
        segments.findings(
            clock,
            profs,
            step_ms,
            segments.stretch_floor(step_ms),
            synchronized=synchronized,
            world_size=run.world_size,
            steps_per_index=window.steps_per_index,
        ),
    )
    explained = any(f.evidence.get("onset_step") is not None for f in found)
    series = {r: (steps, [v / 1000.0 for v in values]) for r, (steps, values) in in_step.items()}
    waits = {r: [(v or 0) / 1000.0 for v in window.steps[r]["input_wait_us"]] for r in in_step}
    found = [f for f in found if f.kind != step_time.COMPUTE_BOUND] + onset.job_findings(
        series, explained, waits, floor
    )
    if not found:
        return primary, others
    found.sort(key=lambda f: -(f.impact_ms or 0.0))  # every candidate has its impact
    _weigh(found, len(window.indices) * window.steps_per_index)
    return found[0], found[1:]


def _stretches(found: list[Finding], stretched: list[Finding]) -> list[Finding]:
    """``found`` with the stretch stragglers ``stretched`` (:func:`segments.findings`): a
    one-rank straggler is replaced by its rank's stretch in the same part when the rank is not
    slow outside its stretches (its median gap there, ``outside_ms``, under the straggler
    floor): the stretch also says where it began and ended and what it cost. Other ranks the
    findings already name get no stretch; STEP_SPIKES of the stretched ranks whose spikes lie
    mostly in their stretches are the stretches themselves, and go."""
    by_rank = {f.evidence["slow_rank"]: f for f in stretched}
    kept: list[Finding] = []
    for f in found:
        s = by_rank.get(f.ranks[0]) if f.kind.endswith("STRAGGLER") and len(f.ranks) == 1 else None
        replaced = (
            s is not None
            and f.kind != step_time.NODE_STRAGGLER
            and s.evidence["part"] == f.evidence["part"]
            and s.evidence["outside_ms"] is not None
            and s.evidence["outside_ms"] < step_time.straggler_floor(s.evidence["step_time_ms"])
        )
        if not replaced:
            kept.append(f)
    named = {r for f in kept if f.kind.endswith("STRAGGLER") for r in f.ranks}
    stretched = [s for s in stretched if s.evidence["slow_rank"] not in named]
    spans = {
        s.evidence["slow_rank"]: [
            (x["onset_step"], x["last_step"]) for x in s.evidence["stretches"]
        ]
        for s in stretched
    }

    def in_stretches(f: Finding) -> bool:
        hit = spans.get(f.evidence["rank"])
        inside = [x for x in f.evidence["steps"] if any(a <= x <= b for a, b in hit or ())]
        return set(f.ranks) <= set(spans) and 2 * len(inside) >= len(f.evidence["steps"])

    kept = [f for f in kept if f.kind != spikes.STEP_SPIKES or not in_stretches(f)]
    return kept + stretched


def _is_change(f: Finding) -> bool:
    return f.kind in (onset.SLOWDOWN, onset.STEP_TIME_DRIFT) or (
        f.evidence.get("onset_step") is not None
    )


def _weigh(found: list[Finding], steps: float) -> None:
    """When the primary ``found[0]`` is a change of the steady state (an onset, a drift) and a
    steady-state bottleneck is also found, or the other way round, say in the primary which
    costs the run more: each one's ``impact_ms`` over the window's ``steps``
    (``evidence.window_cost_ms``, ms)."""
    primary = found[0]
    rival = next((f for f in found[1:] if _is_change(f) != _is_change(primary)), None)
    if rival is None or primary.kind == step_time.INSUFFICIENT_DATA:
        return
    ours, theirs = primary.impact_ms or 0.0, rival.impact_ms or 0.0  # both candidates: set
    primary.evidence["window_cost_ms"] = round(ours * steps, 3)
    rival.evidence["window_cost_ms"] = round(theirs * steps, 3)
    primary.summary += (
        f" It costs the run more than {rival.kind} does: "
        f"{ours * steps / 1000.0:.2f} s against {theirs * steps / 1000.0:.2f}"
        f" s over the window's {round(steps)} steps."
    )


def _clock_info(clock: Clock) -> ClockInfo:
    return ClockInfo(clock.name, clock.reason, len(next(iter(clock.steps.values()), ())))


def _window_info(window: Window) -> WindowInfo:
    return WindowInfo(
        first_step=window.indices[0] if window.indices else None,
        last_step=window.indices[-1] if window.indices else None,
        steps=len(window.indices),
        warmup_steps_skipped=window.warmup_skipped,
        ranks=window.ranks,
        ranks_without_steps=window.ranks_without_steps,
    )


def build(run: RunData, *, live: bool = False, now_unix_s: float | None = None) -> Summary:
    """The whole summary of ``run``, typed (what :func:`build_summary` writes as JSON).

    Args:
        run: everything stored for the run.
        live: the run is still going (``traceml.summary()``): ranks without an end are
            ``running``, and the run is not ``complete``.
        now_unix_s: when the summary is built (Unix s; default: now): its
            ``generated_unix_s``, and the end of a hang that still lasts.
    """
    now_unix_s = time.time() if now_unix_s is None else now_unix_s
    missing = set(run.missing)
    window = align(run)
    clock = choose_clock(window)
    profs = profiles(window, clock)
    node_of = {r: node_rank(rd) for r, rd in run.ranks.items()}
    synchronized = any(
        rd.identity.parallelism in ("ddp", "fsdp") for rd in run.ranks.values() if rd.identity
    )
    in_step = {  # rank -> (window steps, their time without time outside the steps, µs)
        r: (list(steps["step"]), in_step_us(steps)) for r, steps in window.steps.items()
    }
    outside_steps = outside.sections(window.steps, {r: rd.steps for r, rd in run.ranks.items()})
    extra = [outside.finding(outside_steps, len(window.indices))]
    extra += spikes.window_findings(clock, profs, len(window.indices))
    typ = step_time.typical(profs)
    comm_split = comm.split(profs)
    extra.append(comm.bound(comm_split, typ.step_time_ms))
    primary, step_findings = step_time.diagnose(
        window, clock, profs, node_of, synchronized=synchronized, extra=[f for f in extra if f]
    )
    if primary.kind != step_time.INSUFFICIENT_DATA:
        primary, step_findings = _onsets_and_costs(
            run, window, clock, profs, in_step, primary, step_findings, synchronized
        )
    arrivals = skew.skew(run, window, node_of)
    late = skew.late_arrival(arrivals, typ.step_time_ms, run.world_size, window.steps_per_index)
    if late is not None:  # never the primary diagnosis: it names who, the phases say why
        step_findings.append(late)
    scores = cost.relative_scores(profs)
    work = {r: throughput.rank_throughput(run.ranks[r], steps) for r, steps in window.steps.items()}
    span = system.window_span_us(run, window)
    totals = memory.gpu_totals(run)
    ranks = [
        rank_summary(
            rd,
            profs.get(r),
            missing=missing,
            live=live,
            gpu_totals=totals,
            span=span,
            outside_steps=outside_steps.get(r),
            relative_score=scores.get(r),
            in_step_us=in_step.get(r, ((), []))[1],
            work=work.get(r),
        )
        for r, rd in run.ranks.items()
    ]
    nodes = node_summaries(run, ranks, span)
    primary, step_findings, health_findings = health.why_too_few_steps_first(
        *health.hang_first(
            primary,
            step_findings,
            health.findings(run, ranks, live=live, now_unix_s=now_unix_s),
            max((r.steps_completed or 0 for r in ranks), default=0),
        )
    )
    gpu_ranks: dict[str, list[int]] = {}
    for r, rd in run.ranks.items():
        uuid = rd.identity.gpu_uuid if rd.identity else None
        if uuid:
            gpu_ranks.setdefault(uuid, []).append(r)
    return Summary(
        schema_version=SCHEMA_VERSION,
        generated_unix_s=round(now_unix_s, 3),
        live=live,
        run=RunInfo(
            run_name=run.run_name,
            world_size=run.world_size,
            nodes=[n.node_rank for n in nodes],
            complete=not missing and not live,
            missing_ranks=sorted(missing),
            attempt=max((rd.restart for rd in run.ranks.values()), default=0),
            status=health.run_status(ranks, sorted(missing), live=live),
            telemetry_health=TelemetryHealth(
                aggregator_restarts=len(run.aggregator_restarts),
                aggregator_outages=[
                    AggregatorOutage(**o.to_json()) for o in run.aggregator_restarts
                ],
                aggregator_loss=(
                    AggregatorLoss(**run.aggregator_loss.to_json()) if run.aggregator_loss else None
                ),
                ranks=[_delivery(rd) for rd in run.ranks.values() if rd.counts],
                sender_streams=[SenderStream(**s.to_json()) for s in run.sender_streams],
                node_losses=[NodeLoss(**n.to_json()) for n in run.node_losses],
            ),
            rejected=dict(sorted(run.rejected.items())),
        ),
        primary_diagnosis=primary,
        findings=Findings(
            step_time=step_findings,
            memory=memory.findings(
                {r.rank: r.memory for r in ranks},
                {r.rank: r.node_rank for r in ranks},
                {n: system.ram_available(s) for n, s in run.system_samples.items()},
            ),
            system=system.findings(
                nodes,
                gpu_ranks,
                {
                    r.rank: r.memory.host_growth.bytes_per_hour
                    for r in ranks
                    if r.memory.host_growth is not None
                },
            ),
            health=health_findings,
        ),
        analysis=Analysis(
            clock=_clock_info(clock),
            window=_window_info(window),
            typical=typ,
            comm=comm_split,
            skew=arrivals.doc if arrivals is not None else None,
            throughput=throughput.job_throughput(work),
            thresholds=thresholds.as_dict(),
        ),
        ranks=ranks,
        nodes=nodes,
    )


def build_summary(
    run: RunData, *, live: bool = False, now_unix_s: float | None = None
) -> dict[str, Any]:
    """The whole summary document for ``run``, as the JSON values written to
    ``final_summary.json`` (see :func:`build` for the typed form and the arguments)."""
    document: dict[str, Any] = plain(build(run, live=live, now_unix_s=now_unix_s))
    return document
