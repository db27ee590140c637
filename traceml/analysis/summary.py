"""The summary document (``final_summary.json``) built from :class:`RunData`, I/O-free.

Layout (``docs/final_summary.schema.json`` is the contract, ``docs/reading-output.md`` the
guide): ``run`` (identity, topology, completeness), ``primary_diagnosis`` (why the steps are
slow), ``findings`` by section (``step_time``, ``memory``, ``system``, ``health``),
``analysis`` (window, clock, typical rank, thresholds), ``ranks[]`` and ``nodes[]``.

Units: every duration is in milliseconds (``*_ms``), every size in bytes (``*_bytes``), shares
in percent (``*_pct``). A figure that was never measured is ``null``, never 0.
"""

from __future__ import annotations

import time

from traceml.analysis import (
    cost,
    health,
    memory,
    onset,
    outside,
    spikes,
    step_time,
    system,
    thresholds,
)
from traceml.analysis.phases import PARTS, Profile, choose_clock, in_step_us, profiles
from traceml.analysis.stats import bucket_medians, median
from traceml.analysis.window import align
from traceml.analysis.rundata import RankData, RunData

#: Version of the summary document's layout; see docs/final_summary.schema.json.
SCHEMA_VERSION = 1
#: Most points per rank in the charted series (``ranks[].series``); longer runs are bucketed.
SERIES_MAX_POINTS = 400
#: Most step times per rank in ``ranks[].step_time_sample_ms`` (the compare's bootstrap).
STEP_SAMPLE_MAX = 500

_EMPTY_PHASES = dict.fromkeys(PARTS + ("dataloader_next",))


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def node_rank(rd: RankData) -> int | None:
    """The rank's node: from its identity, else from its launcher's end report."""
    for source in (rd.identity, rd.end):
        if source and source.get("node_rank") is not None:
            return source["node_rank"]
    return None


def _series(rd: RankData) -> dict:
    steps = [s["step"] for s in rd.steps]
    xs, step_ms = bucket_medians(
        steps, [s["step_us"] / 1000.0 for s in rd.steps], SERIES_MAX_POINTS
    )
    mem = [s for s in rd.steps if s.get("peak_allocated_bytes") is not None]
    mem_x, alloc = bucket_medians(
        [s["step"] for s in mem], [s["peak_allocated_bytes"] for s in mem], SERIES_MAX_POINTS
    )
    _, reserved = bucket_medians(
        [s["step"] for s in mem], [s["peak_reserved_bytes"] or 0 for s in mem], SERIES_MAX_POINTS
    )
    return {
        "step": xs,
        "step_ms": [round(v, 3) for v in step_ms],
        "memory_step": mem_x,
        "peak_allocated_bytes": [int(v) for v in alloc],
        "peak_reserved_bytes": [int(v) for v in reserved],
    }


def rank_summary(
    rd: RankData,
    prof: Profile | None,
    *,
    missing: set[int],
    live: bool,
    gpu_totals: dict[str, int],
    span: tuple[int, int] | None,
) -> dict:
    """``ranks[]`` entry: identity, end, counts, step time and phases over the window (null
    outside it), memory, process figures, series for the charts."""
    ident = rd.identity or {}
    finish = rd.finish or {}
    step_ms = (
        {k: _round(prof.step_ms[k]) for k in ("median", "mean", "p95", "max")}
        if prof and prof.step_ms
        else None
    )
    return {
        "rank": rd.rank,
        "restart": rd.restart,
        "node_rank": node_rank(rd),
        "local_rank": ident.get("local_rank", (rd.end or {}).get("local_rank")),
        "hostname": ident.get("hostname"),
        "device": ident.get("device"),
        "end": health.end_state(rd, missing, live=live),
        "steps_completed": finish["steps_completed"] if finish else len(rd.steps),
        "records_received": len(rd.steps),
        "records_dropped": finish.get("records_dropped"),
        "steps_gpu_unresolved": finish.get("steps_gpu_unresolved"),
        "step_time_ms": step_ms,
        "phase_median_ms": (
            {k: _round(v) for k, v in prof.median_ms.items()} if prof else dict(_EMPTY_PHASES)
        ),
        "phase_share_pct": (
            {k: _round(prof.share_pct[k], 1) for k in PARTS} if prof else dict.fromkeys(PARTS)
        ),
        "memory": memory.rank_memory(rd, gpu_totals),
        "process": system.rank_process(rd, span),
        "earlier_attempts": {str(k): v for k, v in sorted(rd.earlier_attempts.items())},
        "series": _series(rd),
    }


def node_summaries(run: RunData, ranks: list[dict], span: tuple[int, int] | None) -> list[dict]:
    """``nodes[]``: each node's ranks, torchrun exit, step time over its ranks, system figures."""
    node_ids = (
        {r["node_rank"] for r in ranks if r["node_rank"] is not None}
        | set(run.system_samples)
        | set(run.node_exits)
    )
    out = []
    for n in sorted(node_ids):
        members = [r for r in ranks if r["node_rank"] == n]
        exit_ = run.node_exits.get(n) or {}
        samples = run.system_samples.get(n, [])
        hostname = (
            exit_.get("hostname")
            or next((r["hostname"] for r in members if r["hostname"]), None)
            or (samples[-1].get("hostname") if samples else None)
        )
        stepped = [r for r in members if r["step_time_ms"]]
        out.append(
            {
                "node_rank": n,
                "hostname": hostname,
                "ranks": [r["rank"] for r in members],
                "exit_code": exit_.get("exit_code"),
                "restart_count": exit_.get("restart_count"),
                "step_time_ms_median": _round(median(r["step_time_ms"]["median"] for r in stepped)),
                "phase_median_ms": {
                    k: _round(median(r["phase_median_ms"][k] for r in stepped)) for k in PARTS
                },
                "system": system.node_system(samples, run.gpu_samples.get(n, []), span),
            }
        )
    return out


def _sample(values: list[int]) -> list[float]:
    """``ranks[].step_time_sample_ms``: the window's step times without time outside the
    steps (``values``, µs) in ms, every k-th step so that at most STEP_SAMPLE_MAX remain; what
    ``traceml compare`` bootstraps its interval from."""
    stride = -(-len(values) // STEP_SAMPLE_MAX) if values else 1
    return [round(v / 1000.0, 3) for v in values[::stride]]


def _onsets_and_costs(run, clock, profs, in_step, primary, others):
    """Stragglers get their onset and cost; the job's SLOWDOWN or STEP_TIME_DRIFT joins the
    candidates (a straggler with an onset explains a slowdown); the largest impact leads."""
    found = [primary] + others
    for f in found:
        if f.kind.endswith("STRAGGLER"):
            floor = step_time.straggler_floor(f.evidence["step_time_ms"])
            cost.annotate_straggler(f, clock, profs, run.world_size, floor)
    explained = any(f.evidence.get("onset_step") is not None for f in found)
    series = {r: (steps, [v / 1000.0 for v in values]) for r, (steps, values) in in_step.items()}
    found = [f for f in found if f.kind != step_time.COMPUTE_BOUND] + onset.job_findings(
        series, explained
    )
    if not found:
        return primary, others
    found.sort(key=lambda f: -f.impact_ms)
    return found[0], found[1:]


def build_summary(run: RunData, *, live: bool = False) -> dict:
    """The whole summary document for ``run``.

    Args:
        run: everything stored for the run.
        live: the run is still going (``traceml.summary()``): ranks without an end are
            ``running``, and the run is not ``complete``.
    """
    missing = set(run.missing)
    window = align(run)
    clock = choose_clock(window)
    profs = profiles(window, clock)
    node_of = {r: node_rank(rd) for r, rd in run.ranks.items()}
    synchronized = any(
        (rd.identity or {}).get("parallelism") in ("ddp", "fsdp") for rd in run.ranks.values()
    )
    in_step = {  # rank -> (window steps, their time without time outside the steps, µs)
        r: ([s["step"] for s in steps], in_step_us(steps)) for r, steps in window.steps.items()
    }
    outside_steps = outside.sections(window.steps, {r: rd.steps for r, rd in run.ranks.items()})
    extra = [outside.finding(outside_steps, len(window.indices))]
    extra += spikes.window_findings(clock, profs, len(window.indices))
    primary, step_findings = step_time.diagnose(
        window, clock, profs, node_of, synchronized=synchronized, extra=[f for f in extra if f]
    )
    if primary.kind != step_time.INSUFFICIENT_DATA:
        primary, step_findings = _onsets_and_costs(
            run, clock, profs, in_step, primary, step_findings
        )
    scores = cost.relative_scores(profs)
    span = system.window_span_us(run, window)
    totals = memory.gpu_totals(run)
    ranks = [
        rank_summary(rd, profs.get(r), missing=missing, live=live, gpu_totals=totals, span=span)
        for r, rd in run.ranks.items()
    ]
    for r in ranks:
        r["outside_steps"] = outside_steps.get(r["rank"])
        r["relative_score"] = scores.get(r["rank"])
        r["step_time_sample_ms"] = _sample(in_step.get(r["rank"], ((), []))[1])
    nodes = node_summaries(run, ranks, span)
    gpu_ranks: dict[str, list[int]] = {}
    for r, rd in run.ranks.items():
        uuid = (rd.identity or {}).get("gpu_uuid")
        if uuid:
            gpu_ranks.setdefault(uuid, []).append(r)
    return {
        "schema_version": SCHEMA_VERSION,
        "generated_unix_s": round(time.time(), 3),
        "live": live,
        "run": {
            "run_name": run.run_name,
            "world_size": run.world_size,
            "nodes": [n["node_rank"] for n in nodes],
            "complete": not missing and not live,
            "missing_ranks": sorted(missing),
            "attempt": max((rd.restart for rd in run.ranks.values()), default=0),
            "status": health.run_status(ranks, sorted(missing), live=live),
            "telemetry_health": {
                "aggregator_restarts": len(run.aggregator_restarts),
                "aggregator_outages": run.aggregator_restarts,
            },
            "rejected": dict(sorted(run.rejected.items())),
        },
        "primary_diagnosis": primary.to_json(),
        "findings": {
            "step_time": [f.to_json() for f in step_findings],
            "memory": [
                f.to_json() for f in memory.findings({r["rank"]: r["memory"] for r in ranks})
            ],
            "system": [f.to_json() for f in system.findings(nodes, gpu_ranks)],
            "health": [f.to_json() for f in health.findings(run, ranks, live=live)],
        },
        "analysis": {
            "clock": clock.to_json(),
            "window": window.to_json(),
            "typical": step_time.typical(profs),
            "thresholds": thresholds.as_dict(),
        },
        "ranks": ranks,
        "nodes": nodes,
    }
