"""Step memory: per-rank peaks, the trend over the run, and the memory findings.

The SDK reads the CUDA caching allocator's peaks every N steps (``peak_allocated_bytes``: live
tensors; ``peak_reserved_bytes``: what the allocator holds from the GPU). Allocated memory
normally rises over the first steps while the allocator and the optimizer state warm up, then
stays flat (a plateau); memory that keeps rising after that is creep (a leak: tensors kept
across steps, a growing cache, an ever longer autograd graph).

Host memory: the node sampler reads each rank's RSS about once a second; :func:`growth` tests
that series (and a node's used RAM, :mod:`traceml.analysis.system`) for steady growth:

* the first MEMORY_WARMUP_FRACTION of the readings are warm-up (imports, allocator and
  first-epoch caches, optimizer state) and left out;
* the later half of the rest must still rise: its Mann-Kendall z (the count of rising minus
  falling pairs of readings over its standard deviation under no trend) at least
  MEMORY_GROWTH_Z, so a cache filled at the start and then flat is a plateau;
* at the Theil-Sen slope of that later half (the median of the slopes between every two
  readings: robust to a few outlying readings) the memory must grow over the readings after
  warm-up by MEMORY_CREEP_PCT of its level and MEMORY_CREEP_MIN_BYTES;
* where the growth began is the split of every reading into a flat level then a straight line
  that leaves the least squared error; the rate (per step and per hour) is the Theil-Sen slope
  of the readings from there on (of the later half, with fewer than MEMORY_MIN_SAMPLES).

Series longer than :data:`GROWTH_MAX_POINTS` are first reduced to bucket medians.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import numpy as np

from traceml.analysis import thresholds as th
from traceml.analysis.document import CREEP, PLATEAU, Growth, RankMemory, Trend
from traceml.analysis.findings import PEAK, SLOPE, TREND, Finding, ranks_text
from traceml.analysis.rundata import RankData, RunData, SampleColumns
from traceml.analysis.stats import median, median_of

MIB = 1024 * 1024
#: Most readings a growth test looks at (longer series become bucket medians): bounds its
#: O(n^2) slopes (~1,300 pairs in the later half) for every rank of a live view.
GROWTH_MAX_POINTS = 100
_S_PER_HOUR = 3600.0


def hours_text(hours: float) -> str:
    """A time to exhaust memory, ``hours`` h: ``"40 min"`` under an hour, else ``"2.5 h"``."""
    return f"{hours * 60:.0f} min" if hours < 1 else f"{hours:.1f} h"


#: A memory reading: ``(step, unix_s, bytes)``; ``step`` (the training step in progress,
#: fractional) None for a series not tied to steps (a node's RAM).
Reading = tuple[float | None, float, float]


def _thin(points: Sequence[Reading], max_points: int) -> list[Reading]:
    """``points`` as at most ``max_points`` bucket medians, coordinate by coordinate
    (:func:`~traceml.analysis.stats.median`'s figure: the steps' median None where none is
    known). Vectorised: a rank's 512 readings cost ~0.1 ms, not ~1 ms (1,024 ranks'
    finalization)."""
    if len(points) <= max_points:
        return list(points)
    size = math.ceil(len(points) / max_points)
    steps = [p[0] for p in points]
    present = [s for s in steps if s is not None]
    step_medians: list[float | None]
    if len(present) == len(steps):
        step_medians = list(_bucket_medians(present, size))
    elif not present:
        step_medians = [None] * len(range(0, len(steps), size))
    else:  # some readings without a step: the median of those with one, bucket by bucket
        step_medians = [median(steps[i : i + size]) for i in range(0, len(steps), size)]
    times = _bucket_medians([p[1] for p in points], size)
    values = _bucket_medians([p[2] for p in points], size)
    return list(zip(step_medians, times, values, strict=True))


def _bucket_medians(values: Sequence[float], size: int) -> list[float]:
    """The median (:func:`~traceml.analysis.stats.percentile`'s, so the same floats) of
    each run of ``size`` values, the last run possibly shorter."""
    full = len(values) // size * size
    out: list[float] = []
    if full:
        rows = np.sort(np.asarray(values[:full], dtype=np.float64).reshape(-1, size), axis=1)
        out = _sorted_median(rows).tolist()
    if full < len(values):
        out.append(median_of(values[full:]))
    return out


def _sorted_median(rows: np.ndarray) -> np.ndarray:
    """Each row's median, rows sorted: ``percentile(row, 50)``'s interpolation."""
    pos = (rows.shape[-1] - 1) * 0.5
    lo = math.floor(pos)
    hi = min(lo + 1, rows.shape[-1] - 1)
    medians: np.ndarray = rows[..., lo] + (rows[..., hi] - rows[..., lo]) * (pos - lo)
    return medians


def _pairs(n: int) -> tuple[np.ndarray, np.ndarray]:
    """Every two indices ``i < j`` of ``n`` items, as two arrays."""
    return np.triu_indices(n, 1)


def theil_sen(xs: Sequence[float], ys: Sequence[float]) -> float:
    """The Theil-Sen slope of ``ys`` over ``xs``: the median of the slopes between every two
    points with different x (0.0 when there are none)."""
    x, y = np.asarray(xs, dtype=np.float64), np.asarray(ys, dtype=np.float64)
    i, j = _pairs(len(x))
    dx = x[j] - x[i]
    apart = dx != 0
    if not apart.any():
        return 0.0
    slopes = np.sort((y[j] - y[i])[apart] / dx[apart])
    return float(_sorted_median(slopes)) or 0.0


def kendall_z(ys: Sequence[float]) -> float:
    """The Mann-Kendall z of ``ys`` (in order): rising minus falling pairs, continuity
    corrected, over their standard deviation when there is no trend (ties left in the
    variance: the test errs towards no trend)."""
    n = len(ys)
    y = np.asarray(ys, dtype=np.float64)
    i, j = _pairs(n)
    s = int(np.sign(y[j] - y[i]).sum())
    sd = math.sqrt(n * (n - 1) * (2 * n + 5) / 18.0)
    if not sd or s == 0:
        return 0.0
    return (s - 1) / sd if s > 0 else (s + 1) / sd


def _onset(ts: Sequence[float], ys: Sequence[float], min_side: int) -> int:
    """Index where a flat level turns into a straight line, by least squared error (sums
    kept running: O(n)); every split leaves ``min_side`` points on each side."""
    n = len(ts)
    t0, y0 = ts[0], ys[0]
    xs = [t - t0 for t in ts]
    vs = [y - y0 for y in ys]
    pre = [(0.0, 0.0, 0)]  # running (sum y, sum y^2, count) of the flat part
    for v in vs:
        a, b, k = pre[-1]
        pre.append((a + v, b + v * v, k + 1))
    suf = [(0.0,) * 6]  # running (x, y, xx, xy, yy, count) of the line, from the end
    for x, v in zip(reversed(xs), reversed(vs), strict=True):
        sx, sy, sxx, sxy, syy, c = suf[-1]
        suf.append((sx + x, sy + v, sxx + x * x, sxy + x * v, syy + v * v, c + 1))
    best, best_k = math.inf, 0
    for k in range(0, n - min_side + 1):
        a, b, m = pre[k]
        flat = b - a * a / m if m else 0.0
        if 0 < m < min_side:
            continue
        sx, sy, sxx, sxy, syy, c = suf[n - k]
        cxx = sxx - sx * sx / c
        cxy = sxy - sx * sy / c
        line = syy - sy * sy / c - (cxy * cxy / cxx if cxx else 0.0)
        if flat + line < best:
            best, best_k = flat + line, k
    return best_k


def growth(points: Sequence[Reading]) -> Growth | None:
    """The growth test of a memory series (see the module docstring).

    Args:
        points: ``(step, unix_s, bytes)`` readings in time order; ``step`` (the training
            step in progress, fractional) None for a series not tied to steps (a node's RAM).

    Returns:
        The :class:`Growth`, or None with fewer than MEMORY_MIN_SAMPLES readings after warm-up.
    """
    points = _thin(points, GROWTH_MAX_POINTS)
    rest = points[math.ceil(len(points) * th.MEMORY_WARMUP_FRACTION) :]
    if len(rest) < th.MEMORY_MIN_SAMPLES:
        return None
    late = rest[len(rest) // 2 :]
    ys = [p[2] for p in late]
    per_s = theil_sen([p[1] for p in late], ys)
    late_steps = [s for p in late if (s := p[0]) is not None]
    stepped = len(late_steps) == len(late)
    per_step = theil_sen(late_steps, ys) if stepped else None
    z = kendall_z(ys)
    k = max(1, len(rest) // 10)
    start = int(median_of([p[2] for p in rest[:k]]))
    end = int(median_of([p[2] for p in rest[-k:]]))
    grown = per_s * (rest[-1][1] - rest[0][1])
    creeping = z >= th.MEMORY_GROWTH_Z and grown >= max(
        th.MEMORY_CREEP_MIN_BYTES, start * th.MEMORY_CREEP_PCT / 100.0
    )
    onset = None
    if creeping:
        k = _onset([p[1] for p in points], [p[2] for p in points], 2)
        onset = points[k]
        grow = points[k:]
        if len(grow) >= th.MEMORY_MIN_SAMPLES:  # the rate over the growth itself
            per_s = theil_sen([p[1] for p in grow], [p[2] for p in grow])
            grow_steps = [s for p in grow if (s := p[0]) is not None]
            if stepped and len(grow_steps) == len(grow):
                per_step = theil_sen(grow_steps, [p[2] for p in grow])
    return Growth(
        name=CREEP if creeping else PLATEAU,
        statistic=SLOPE,
        start_bytes=start,
        end_bytes=end,
        bytes_per_step=per_step,
        bytes_per_hour=per_s * _S_PER_HOUR,
        kendall_z=z,
        onset_step=None if onset is None or onset[0] is None else int(onset[0]),
        onset_unix_s=None if onset is None else onset[1],
        readings=len(rest),
    )


def rss_points(rd: RankData) -> list[tuple[float, float, int]]:
    """``(step, unix_s, rss_bytes)`` of the rank's process samples taken while it ran its
    stored steps (the step in progress interpolated between step ends), in time order."""
    origin = rd.identity.start_unix_us if rd.identity else None
    steps = rd.steps
    if origin is None or len(steps) < 2:
        return []
    ends = np.array([origin + e for e in steps["end_us"]], dtype=np.float64)
    index = np.array(steps["step"], dtype=np.float64)
    samples = SampleColumns.of(rd.process_samples)
    t, rss = samples.column("unix_us"), samples.column("rss_bytes")
    keep = ~np.isnan(rss) & (t >= ends[0]) & (t <= ends[-1])
    if "restart" in samples.columns:
        restart = samples.column("restart")
        keep &= np.isnan(restart) | (restart == rd.restart)
    order = np.argsort(t[keep], kind="stable")
    t, rss = t[keep][order], rss[keep][order]
    i = np.minimum(np.searchsorted(ends, t, side="right"), len(ends) - 1)
    span = ends[i] - ends[i - 1]
    frac = np.divide(t - ends[i - 1], span, out=np.zeros_like(t), where=span > 0)
    at = index[i - 1] + frac * (index[i] - index[i - 1])
    return [(float(a), float(u) / 1e6, int(r)) for a, u, r in zip(at, t, rss, strict=True)]


def readings(rd: RankData) -> list[tuple[int, int]]:
    """``(step, peak_allocated_bytes)`` of the steps that carry a memory reading."""
    steps = rd.steps
    return [
        (step, alloc)
        for step, alloc in zip(steps["step"], steps["peak_allocated_bytes"], strict=True)
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
    start = int(median_of([b for _, b in first]))
    end = int(median_of([b for _, b in last]))
    growth = end - start
    span_steps = median_of([s for s, _ in last]) - median_of([s for s, _ in first])
    creeping = growth >= max(th.MEMORY_CREEP_MIN_BYTES, start * th.MEMORY_CREEP_PCT / 100.0)
    return Trend(
        CREEP if creeping else PLATEAU,
        start,
        end,
        growth,
        1000.0 * growth / span_steps if span_steps > 0 else 0.0,
        len(rest),
    )


def allocator_points(rd: RankData) -> list[tuple[float, float, int]]:
    """``(step, unix_s, peak_allocated_bytes)`` of the steps with a CUDA memory reading (the
    step's end as its time), for :func:`growth`; [] without the rank's start time."""
    origin = rd.identity.start_unix_us if rd.identity else None
    if origin is None:
        return []
    steps = rd.steps
    return [
        (step, (origin + end) / 1e6, alloc)
        for step, end, alloc in zip(
            steps["step"], steps["end_us"], steps["peak_allocated_bytes"], strict=True
        )
        if alloc is not None
    ]


def gpu_totals(run: RunData) -> dict[str, int]:
    """Total memory of each GPU by UUID, from the NVML samples (bytes)."""
    totals: dict[str, int] = {}
    for samples in run.gpu_samples.values():
        samples = SampleColumns.of(samples)
        uuid, total = samples.column("uuid"), samples.column("memory_total_bytes")
        if uuid.dtype != object:  # no sample names its GPU
            continue
        known = np.frompyfunc(bool, 1, 1)(uuid).astype(bool) & ~np.isnan(total) & (total != 0)
        # the latest sample of each GPU wins (a dict built from pairs keeps the last one)
        latest = dict(zip(uuid[known], total[known], strict=True))
        totals.update((u, int(t)) for u, t in latest.items())
    return totals


def rank_memory(rd: RankData, totals: dict[str, int]) -> RankMemory:
    """``ranks[].memory`` of the summary: peaks (bytes), the GPU's total, pressure, trend."""
    alloc = [b for b in rd.steps["peak_allocated_bytes"] if b is not None]
    reserved = [b for b in rd.steps["peak_reserved_bytes"] if b is not None]
    uuid = (rd.identity.gpu_uuid if rd.identity else None) or None
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
        host_growth=growth(rss_points(rd)),
        gpu_growth=growth(allocator_points(rd)),
    )


def findings(
    memory: dict[int, RankMemory],
    node_of: dict[int, int | None] | None = None,
    ram_available: dict[int, int | None] | None = None,
) -> list[Finding]:
    """MEMORY_PRESSURE, MEMORY_IMBALANCE, MEMORY_CREEP and HOST_MEMORY_CREEP over
    ``rank -> ranks[].memory``; ``node_of`` (rank -> node rank) and ``ram_available`` (node
    rank -> RAM available at its latest sample, bytes) give the time to exhaust a node's RAM."""
    found = [rule(memory) for rule in RULES]
    found.append(host_creep(memory, node_of or {}, ram_available or {}))
    return [f for f in found if f is not None]


def host_creep(
    memory: dict[int, RankMemory],
    node_of: dict[int, int | None],
    ram_available: dict[int, int | None],
) -> Finding | None:
    """HOST_MEMORY_CREEP: ranks whose RSS keeps growing after warm-up (:func:`growth`), the
    fastest named, with each node's hours to exhaust its available RAM at the summed rate of
    its growing ranks (None: the node's RAM is unknown)."""
    creeping = {
        r: m.host_growth
        for r, m in memory.items()
        if m.host_growth is not None and m.host_growth.name == CREEP
    }
    if not creeping:
        return None
    worst = max(creeping, key=lambda r: creeping[r].bytes_per_hour)
    g = creeping[worst]
    per_node: dict[str, dict[str, Any]] = {}  # node rank -> its part of the evidence
    for r, rg in sorted(creeping.items()):
        n = node_of.get(r)
        if n is None:
            continue
        row = per_node.setdefault(
            str(n), {"ranks": [], "bytes_per_hour": 0.0, "available_bytes": ram_available.get(n)}
        )
        row["ranks"].append(r)
        row["bytes_per_hour"] += rg.bytes_per_hour
    for row in per_node.values():
        free = row["available_bytes"]
        row["hours_to_exhaust"] = round(free / row["bytes_per_hour"], 2) if free else None
        row["bytes_per_hour"] = round(row["bytes_per_hour"])
    exhaust = [
        (row["hours_to_exhaust"], n) for n, row in per_node.items() if row["hours_to_exhaust"]
    ]
    soonest = min(exhaust) if exhaust else None
    step_rate = (
        f"{g.bytes_per_step / MIB:.2f} MiB per step, " if g.bytes_per_step is not None else ""
    )
    where = f" from step {g.onset_step}" if g.onset_step is not None else ""
    when = (
        f"; at that rate node {soonest[1]} runs out of RAM in {hours_text(soonest[0])}"
        if soonest
        else ""
    )
    return Finding(
        "HOST_MEMORY_CREEP",
        "warning",
        f"Host memory (RSS) keeps growing after warm-up on {ranks_text(list(creeping))}: "
        f"rank {worst} grows {step_rate}{g.bytes_per_hour / MIB:.0f} MiB per hour (Theil-Sen "
        f"slope){where}, from {g.start_bytes / MIB:.0f} to {g.end_bytes / MIB:.0f} MiB{when}.",
        "Look for objects kept across steps on the host: losses or outputs appended to a list "
        "as tensors (use .item()), caches or dicts keyed by step or sample, metrics kept "
        "whole; tracemalloc or memray snapshots two steps apart name the growing allocation.",
        evidence={
            "statistic": SLOPE,
            "rank": worst,
            "bytes_per_step": g.to_json()["bytes_per_step"],
            "bytes_per_hour": round(g.bytes_per_hour),
            "onset_step": g.onset_step,
            "per_rank_growth": {str(r): creeping[r].to_json() for r in sorted(creeping)},
            "per_node": per_node,
            "hours_to_exhaust": soonest[0] if soonest else None,
            "threshold_z": th.MEMORY_GROWTH_Z,
            "threshold_pct": th.MEMORY_CREEP_PCT,
            "threshold_bytes": th.MEMORY_CREEP_MIN_BYTES,
        },
        ranks=list(creeping),
        nodes=sorted({int(n) for n in per_node}),
    )


def _pressure(memory: dict[int, RankMemory]) -> Finding | None:
    pressure = {
        r: pct
        for r, m in memory.items()
        if (pct := m.pressure_pct) is not None and pct >= th.MEMORY_PRESSURE_PCT
    }
    if not pressure:
        return None
    pressed = {r: memory[r] for r in pressure}
    worst = max(pressure, key=pressure.__getitem__)
    m = pressed[worst]
    reserved, total = m.peak_reserved_bytes, m.gpu_total_bytes
    assert reserved is not None and total is not None, "the pressure is reserved / total"
    return Finding(
        "MEMORY_PRESSURE",
        "warning",
        f"{ranks_text(list(pressed)).capitalize()} reserve up to "
        f"{m.pressure_pct:.0f}% of the GPU's memory (rank {worst}: "
        f"{reserved / MIB:.0f} of {total / MIB:.0f} MiB); "
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
    high = max(peaks, key=peaks.__getitem__)
    low = min(peaks, key=peaks.__getitem__)
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
    """MEMORY_CREEP: allocated memory whose thirds rise (:func:`trend`) and, with enough
    readings for it, that still grows in its later half (the growth test, ``gpu_growth``: a
    cache filled over the first steps is no creep); with the rate per hour and the hours
    until the rank's GPU is full at that rate."""
    creeping = {
        r: m.trend
        for r, m in memory.items()
        if m.trend
        and m.trend.name == CREEP
        and (m.gpu_growth is None or m.gpu_growth.name == CREEP)
    }
    if not creeping:
        return None
    worst = max(creeping, key=lambda r: creeping[r].growth_bytes)
    t = creeping[worst]
    growths = {r: g for r in creeping if (g := memory[r].gpu_growth)}
    per_hour = {r: g.bytes_per_hour for r, g in growths.items()}
    hours = {
        r: round((m.gpu_total_bytes - m.peak_reserved_bytes) / per_hour[r], 2)
        for r, m in ((r, memory[r]) for r in per_hour)
        if m.gpu_total_bytes and m.peak_reserved_bytes is not None and per_hour[r] > 0
    }
    when = (
        f"; at {per_hour[worst] / MIB:.0f} MiB per hour (Theil-Sen slope) its GPU is full in "
        f"{hours_text(hours[worst])}"
        if worst in hours
        else "; a longer run will run out of memory"
    )
    return Finding(
        "MEMORY_CREEP",
        "warning",
        f"Allocated memory keeps growing after warm-up on {ranks_text(list(creeping))}: "
        f"rank {worst} went from {t.start_bytes / MIB:.0f} to "
        f"{t.end_bytes / MIB:.0f} MiB (+{round(t.bytes_per_1k_steps) / MIB:.0f} MiB per "
        f"1000 steps){when}.",
        "Look for tensors kept across steps: losses or outputs appended to a list "
        "without .detach()/.item(), caches keyed by step, hooks that store activations, "
        "a graph kept alive by retain_graph=True.",
        evidence={
            "statistic": TREND,
            "rank": worst,
            "per_rank_trend": {str(r): creeping[r].to_json() for r in sorted(creeping)},
            "per_rank_growth": {str(r): growths[r].to_json() for r in sorted(growths)},
            "hours_to_exhaust": {str(r): h for r, h in sorted(hours.items())},
            "threshold_pct": th.MEMORY_CREEP_PCT,
            "threshold_bytes": th.MEMORY_CREEP_MIN_BYTES,
        },
        ranks=list(creeping),
    )


#: The memory rules, in the order their findings are listed.
RULES = (_pressure, _imbalance, _creep)
