"""Step memory: per-rank peaks, the trend over the run, and the memory findings.

The SDK reads the CUDA caching allocator's peaks every N steps (``peak_allocated_bytes``: live
tensors; ``peak_reserved_bytes``: what the allocator holds from the GPU). Allocated memory
normally rises over the first steps while the allocator and the optimizer state warm up, then
stays flat (a plateau); memory that keeps rising after that is creep (a leak: tensors kept
across steps, a growing cache, an ever longer autograd graph).
"""

from __future__ import annotations

import math

from traceml.analysis import thresholds as th
from traceml.analysis.document import CREEP, PLATEAU, RankMemory, Trend
from traceml.analysis.findings import PEAK, TREND, Finding, ranks_text
from traceml.analysis.stats import median
from traceml.analysis.rundata import RankData, RunData

MIB = 1024 * 1024


def readings(rd: RankData) -> list[tuple[int, int]]:
    """``(step, peak_allocated_bytes)`` of the steps that carry a memory reading."""
    steps = rd.steps
    return [
        (step, alloc)
        for step, alloc in zip(steps["step"], steps["peak_allocated_bytes"])
        if alloc is not None
    ]


def trend(points: list[tuple[int, int]]) -> Trend | None:
    """Plateau or creep of ``(step, bytes)`` readings; None with fewer than
    :data:`~th.MEMORY_MIN_SAMPLES` (see docs/reading-output.md for the rule)."""
    if len(points) < th.MEMORY_MIN_SAMPLES:
        return None
    rest = points[math.ceil(len(points) * th.MEMORY_WARMUP_FRACTION) :]
    third = max(1, len(rest) // 3)
    first, last = rest[:third], rest[-third:]
    start = int(median(b for _, b in first))
    end = int(median(b for _, b in last))
    growth = end - start
    span_steps = median(s for s, _ in last) - median(s for s, _ in first)
    creeping = growth >= max(th.MEMORY_CREEP_MIN_BYTES, start * th.MEMORY_CREEP_PCT / 100.0)
    return Trend(
        CREEP if creeping else PLATEAU,
        start,
        end,
        growth,
        1000.0 * growth / span_steps if span_steps > 0 else 0.0,
        len(rest),
    )


def gpu_totals(run: RunData) -> dict[str, int]:
    """Total memory of each GPU by UUID, from the NVML samples (bytes)."""
    totals: dict[str, int] = {}
    for samples in run.gpu_samples.values():
        for g in samples:
            if g.get("uuid") and g.get("memory_total_bytes"):
                totals[g["uuid"]] = g["memory_total_bytes"]
    return totals


def rank_memory(rd: RankData, totals: dict[str, int]) -> RankMemory:
    """``ranks[].memory`` of the summary: peaks (bytes), the GPU's total, pressure, trend."""
    alloc = [b for b in rd.steps["peak_allocated_bytes"] if b is not None]
    reserved = [b for b in rd.steps["peak_reserved_bytes"] if b is not None]
    uuid = (rd.identity or {}).get("gpu_uuid") or None
    total = totals.get(uuid) if uuid else None
    peak_reserved = max(reserved) if reserved else None
    peak_allocated = max(alloc) if alloc else None
    if rd.digest is not None:  # a sampled series: the digest's maxima are exact
        peak_allocated = rd.digest.peak_allocated_bytes
        peak_reserved = rd.digest.peak_reserved_bytes
    if peak_allocated is None:
        reason = "no CUDA memory readings (CPU training, or no step data)"
    elif total is None:
        reason = "GPU total memory unknown (no NVML sample for this rank's GPU)"
    else:
        reason = None
    return RankMemory(
        peak_allocated_bytes=peak_allocated,
        peak_reserved_bytes=peak_reserved,
        gpu_total_bytes=total,
        pressure_pct=(
            round(100.0 * peak_reserved / total, 1) if total and peak_reserved is not None else None
        ),
        trend=trend(readings(rd)),
        unavailable_reason=reason,
    )


def findings(memory: dict[int, RankMemory]) -> list[Finding]:
    """MEMORY_PRESSURE, MEMORY_IMBALANCE and MEMORY_CREEP over ``rank -> ranks[].memory``."""
    found = (rule(memory) for rule in RULES)
    return [f for f in found if f is not None]


def _pressure(memory: dict[int, RankMemory]) -> Finding | None:
    pressed = {
        r: m
        for r, m in memory.items()
        if m.pressure_pct is not None and m.pressure_pct >= th.MEMORY_PRESSURE_PCT
    }
    if not pressed:
        return None
    worst = max(pressed, key=lambda r: pressed[r].pressure_pct)
    m = pressed[worst]
    return Finding(
        "MEMORY_PRESSURE",
        "warning",
        f"{ranks_text(list(pressed)).capitalize()} reserve up to "
        f"{m.pressure_pct:.0f}% of the GPU's memory (rank {worst}: "
        f"{m.peak_reserved_bytes / MIB:.0f} of {m.gpu_total_bytes / MIB:.0f} MiB); "
        "an out-of-memory error or allocator thrashing is close.",
        "Lower the batch per device, use activation checkpointing, mixed precision, or "
        "shard optimizer state (FSDP/ZeRO); set "
        "PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True against fragmentation.",
        evidence={
            "statistic": PEAK,
            "rank": worst,
            "pressure_pct": m.pressure_pct,
            "peak_reserved_bytes": m.peak_reserved_bytes,
            "gpu_total_bytes": m.gpu_total_bytes,
            "threshold_pct": th.MEMORY_PRESSURE_PCT,
            "per_rank_pressure_pct": {str(r): m.pressure_pct for r, m in pressed.items()},
        },
        ranks=list(pressed),
    )


def _imbalance(memory: dict[int, RankMemory]) -> Finding | None:
    peaks = {r: m.peak_allocated_bytes for r, m in memory.items() if m.peak_allocated_bytes}
    if len(peaks) < 2:
        return None
    high = max(peaks, key=peaks.get)
    low = min(peaks, key=peaks.get)
    spread = 100.0 * (peaks[high] - peaks[low]) / peaks[high]
    if spread < th.MEMORY_IMBALANCE_PCT:
        return None
    return Finding(
        "MEMORY_IMBALANCE",
        "warning",
        f"Rank {high} peaks at {peaks[high] / MIB:.0f} MiB allocated, rank {low} at "
        f"{peaks[low] / MIB:.0f} MiB ({spread:.0f}% apart): the busiest rank sets "
        "the memory limit of the whole job.",
        "Balance the work across ranks: uneven batches or sequence lengths, state "
        "kept only on one rank (rank-0 metrics, EMA copies), or an uneven model split.",
        evidence={
            "statistic": PEAK,
            "highest_rank": high,
            "highest_bytes": peaks[high],
            "lowest_rank": low,
            "lowest_bytes": peaks[low],
            "spread_pct": round(spread, 1),
            "threshold_pct": th.MEMORY_IMBALANCE_PCT,
        },
        ranks=[high, low],
    )


def _creep(memory: dict[int, RankMemory]) -> Finding | None:
    creeping = {r: m.trend for r, m in memory.items() if m.trend and m.trend.name == CREEP}
    if not creeping:
        return None
    worst = max(creeping, key=lambda r: creeping[r].growth_bytes)
    t = creeping[worst]
    return Finding(
        "MEMORY_CREEP",
        "warning",
        f"Allocated memory keeps growing after warm-up on {ranks_text(list(creeping))}: "
        f"rank {worst} went from {t.start_bytes / MIB:.0f} to "
        f"{t.end_bytes / MIB:.0f} MiB (+{round(t.bytes_per_1k_steps) / MIB:.0f} MiB per "
        "1000 steps); a longer run will run out of memory.",
        "Look for tensors kept across steps: losses or outputs appended to a list "
        "without .detach()/.item(), caches keyed by step, hooks that store activations, "
        "a graph kept alive by retain_graph=True.",
        evidence={
            "statistic": TREND,
            "rank": worst,
            "per_rank_trend": {str(r): creeping[r].to_json() for r in sorted(creeping)},
            "threshold_pct": th.MEMORY_CREEP_PCT,
            "threshold_bytes": th.MEMORY_CREEP_MIN_BYTES,
        },
        ranks=list(creeping),
    )


#: The memory rules, in the order their findings are listed.
RULES = (_pressure, _imbalance, _creep)
