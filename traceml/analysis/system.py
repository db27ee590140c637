"""System (per node) and process (per rank) figures, and their findings.

The node sampler reports each node's CPU and RAM and each GPU as NVML sees it, about once a
second; the process figures of each rank come from the node sampler (CPU, RSS) and the rank's
SDK (CUDA allocator). Figures are taken over the wall-clock span of the analysis window when
samples fall into it (start-up and shutdown would dilute them), else over every sample. A
figure nobody could measure is ``null`` with a reason: no NVML on a CPU host, no utilisation
on a MIG slice.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, TypedDict, overload

import numpy as np

from traceml.analysis import thresholds as th
from traceml.analysis.document import (
    CREEP,
    CpuPercent,
    GpuFigures,
    NodeSummary,
    NodeSystem,
    RankProcess,
)
from traceml.analysis.findings import PEAK, SAMPLED_MEDIAN, SLOPE, Finding, ranks_text
from traceml.analysis.memory import MIB, growth, hours_text
from traceml.analysis.rundata import RankData, RunData, SampleColumns
from traceml.analysis.stats import Description, describe_sorted
from traceml.analysis.window import Window


def window_span_us(run: RunData, window: Window) -> tuple[int, int] | None:
    """Wall-clock span of the window (unix µs): the first window step's start to the last
    window step's end, over every window rank; None without rank identities."""
    starts, ends = [], []
    for rank, steps in window.steps.items():
        identity = run.ranks[rank].identity
        origin = identity.start_unix_us if identity else None
        if origin is None or not steps:
            continue
        starts.append(origin + steps["end_us"][0] - steps["step_us"][0])
        ends.append(origin + steps["end_us"][-1])
    return (min(starts), max(ends)) if starts else None


def _in_span(
    samples: SampleColumns | list[dict[str, Any]], span: tuple[int, int] | None
) -> SampleColumns:
    """The samples inside ``span`` (unix µs), or all of them when none is (or no span)."""
    samples = SampleColumns.of(samples)
    if span is None:
        return samples
    inside = samples.between(*span)
    return inside or samples


def _describe(samples: SampleColumns, name: str) -> Description | None:
    """:func:`~traceml.analysis.stats.describe` of numeric column ``name``."""
    return describe_sorted(np.sort(samples.present(name)).tolist())


def _median(samples: SampleColumns, name: str) -> float | None:
    figures = _describe(samples, name)
    return figures["median"] if figures else None


@overload
def _round(value: float, digits: int = 1) -> float: ...


@overload
def _round(value: float | None, digits: int = 1) -> float | None: ...


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def _max_int(samples: SampleColumns, name: str) -> int | None:
    """The largest measured value of integer column ``name`` (bytes), None when none was."""
    top = samples.max(name)
    return None if top is None else int(top)


def _by_device(gpus: SampleColumns) -> list[SampleColumns]:
    """GPU samples grouped by device: by UUID, so a MIG slice (its parent's ``nvml_index``,
    its own ``MIG-`` UUID) is a device of its own, never folded into its parent; a sample
    without a UUID (NVML could not read the GPU) by its ``nvml_index``. Ordered by NVML index,
    a parent before its slices, slices in the order first seen."""
    if not gpus:
        return []
    index = gpus.column("nvml_index")
    uuids = gpus.column("uuid").tolist()
    keys = np.array(
        [
            u if isinstance(u, str) and u else f"index {i:g}"
            for u, i in zip(uuids, index.tolist(), strict=True)
        ]
    )
    unique, first = np.unique(keys, return_index=True)
    order = sorted(
        range(len(unique)),
        key=lambda k: (index[first[k]], str(unique[k]).startswith("MIG-"), first[k]),
    )
    return [gpus.take(keys == unique[k]) for k in order]


def _gpu_figures(rows: SampleColumns) -> GpuFigures:
    """One device's figures from its samples."""
    return GpuFigures(
        nvml_index=int(rows.row(-1)["nvml_index"]),
        uuid=rows.row(-1).get("uuid"),
        util_percent_median=_round(_median(rows, "util_percent")),
        memory_used_bytes_max=_max_int(rows, "memory_used_bytes"),
        memory_total_bytes=_max_int(rows, "memory_total_bytes"),
        temperature_c_max=_round(rows.max("temperature_c")),
        power_w_median=_round(_median(rows, "power_w")),
        unavailable_reason=rows.last_text("unavailable_reason"),
    )


def node_system(
    samples: SampleColumns | list[dict[str, Any]],
    gpus: SampleColumns | list[dict[str, Any]],
    span: tuple[int, int] | None,
) -> NodeSystem:
    """``nodes[].system`` of the summary from one node's system and GPU samples (columns, or
    one dict per sample), over ``span`` (unix µs) when samples fall into it."""
    samples = _in_span(samples, span)
    gpus = _in_span(gpus, span)
    if not samples:
        return NodeSystem(
            samples=0,
            cpu_percent=None,
            ram_used_pct_max=None,
            ram_total_bytes=None,
            gpus=[],
            unavailable_reason="no system samples from this node",
            ram_growth=None,
        )
    cpu = _describe(samples, "cpu_percent")
    used, total = samples.column("ram_used_bytes"), samples.column("ram_total_bytes")
    known = ~np.isnan(used) & ~np.isnan(total) & (total != 0)
    ram = 100.0 * used[known] / total[known]
    gpu_rows = [_gpu_figures(rows) for rows in _by_device(gpus)]
    return NodeSystem(
        samples=len(samples),
        cpu_percent=(
            CpuPercent(_round(cpu["median"]), _round(cpu["p95"]), _round(cpu["max"]))
            if cpu
            else None
        ),
        ram_used_pct_max=_round(float(ram.max())) if len(ram) else None,
        ram_total_bytes=_max_int(samples, "ram_total_bytes"),
        gpus=gpu_rows,
        unavailable_reason=samples.last_text("gpu_unavailable_reason") if not gpu_rows else None,
        ram_growth=growth(
            [
                (None, t / 1e6, u)
                for t, u in zip(samples.column("unix_us").tolist(), used.tolist(), strict=True)
                if not math.isnan(u)
            ]
        ),
    )


def ram_available(samples: SampleColumns | list[dict[str, Any]]) -> int | None:
    """A node's RAM available at its latest system sample (total - used, bytes), or None."""
    samples = SampleColumns.of(samples)
    used, total = samples.column("ram_used_bytes"), samples.column("ram_total_bytes")
    known = np.flatnonzero(~np.isnan(used) & ~np.isnan(total) & (total != 0))
    return int(total[known[-1]] - used[known[-1]]) if len(known) else None


def rank_process(rd: RankData, span: tuple[int, int] | None) -> RankProcess:
    """``ranks[].process`` of the summary: CPU (% of one core), RSS and CUDA allocator peaks."""
    samples = _in_span(rd.process_samples, span)
    return RankProcess(
        samples=len(samples),
        cpu_percent_median=_round(_median(samples, "cpu_percent")),
        rss_bytes_max=_max_int(samples, "rss_bytes"),
        gpu_allocated_bytes_max=_max_int(samples, "gpu_allocated_bytes"),
        gpu_reserved_bytes_max=_max_int(samples, "gpu_reserved_bytes"),
    )


class GpuPlace(TypedDict):
    """Where a GPU is (:meth:`Facts.gpu_rows`): its node, NVML index and the ranks on it."""

    node_rank: int
    nvml_index: int
    ranks: list[int]


class GpuUtilization(GpuPlace):
    """A GPU and its median utilisation, % (the utilisation findings' evidence)."""

    util_percent_median: float


class GpuTemperature(GpuPlace):
    """A GPU and its highest temperature, °C (the temperature finding's evidence)."""

    temperature_c_max: float


@dataclass(frozen=True)
class Facts:
    """What the system rules look at: the summary's ``nodes`` (with ``system``),
    ``gpu_ranks``, GPU UUID -> ranks on it (when empty, every GPU with figures counts), and
    ``rss_per_hour``, rank -> its RSS growth rate (bytes per hour, ``host_growth``)."""

    nodes: list[NodeSummary]
    gpu_ranks: dict[str, list[int]]
    rss_per_hour: dict[int, float] = field(default_factory=dict)

    def gpu_rows(self) -> list[tuple[GpuPlace, GpuFigures]]:
        """``(where, figures)`` of every GPU this run used."""
        out: list[tuple[GpuPlace, GpuFigures]] = []
        for node in self.nodes:
            for g in node.system.gpus:
                used_by = self.gpu_ranks.get(g.uuid or "", [])
                if self.gpu_ranks and not used_by:
                    continue  # a GPU no rank of this run used
                out.append(
                    ({"node_rank": node.node_rank, "nvml_index": g.nvml_index, "ranks": used_by}, g)
                )
        return out


def findings(
    nodes: list[NodeSummary],
    gpu_ranks: dict[str, list[int]],
    rss_per_hour: dict[int, float] | None = None,
) -> list[Finding]:
    """GPU utilisation and temperature, CPU and RAM findings over the summary's ``nodes``, one
    per rule of :data:`RULES` that applies.

    Args:
        nodes: ``nodes[]`` of the summary (with ``system``).
        gpu_ranks: GPU UUID -> ranks on it; when empty, every GPU with a utilisation counts.
        rss_per_hour: rank -> its RSS growth rate, bytes per hour (ranks without one: none).
    """
    facts = Facts(nodes, gpu_ranks, rss_per_hour or {})
    found = (rule(facts) for rule in RULES)
    return [f for f in found if f is not None]


def _utilization(
    facts: Facts, below: float, at_least: float, kind: str, severity: str, advice: str
) -> Finding | None:
    """A GPU utilisation finding over the GPUs busy ``at_least`` <= median < ``below`` %."""
    rows = [
        GpuUtilization(**row, util_percent_median=util)
        for row, g in facts.gpu_rows()
        if (util := g.util_percent_median) is not None and at_least <= util < below
    ]
    if not rows:
        return None
    ranks = sorted({r for row in rows for r in row["ranks"]})
    worst = min(rows, key=lambda r: r["util_percent_median"])
    where = ranks_text(ranks) if ranks else f"{len(rows)} GPU(s)"
    return Finding(
        kind,
        severity,
        f"GPUs of {where} are busy {worst['util_percent_median']:.0f}% of the time "
        f"(median; lowest: node {worst['node_rank']} GPU {worst['nvml_index']}), "
        f"below {below:g}%.",
        advice,
        evidence={"statistic": SAMPLED_MEDIAN, "gpus": rows, "threshold_pct": below},
        ranks=ranks,
        nodes=sorted({r["node_rank"] for r in rows}),
    )


def low_gpu_utilization(facts: Facts) -> Finding | None:
    """LOW_GPU_UTILIZATION: GPUs busy less than GPU_UTIL_LOW_PCT of the time (median)."""
    return _utilization(
        facts,
        th.GPU_UTIL_LOW_PCT,
        -math.inf,
        "LOW_GPU_UTILIZATION",
        "warning",
        "The GPUs idle much of the time: the primary diagnosis says what they wait for "
        "(input, copies, a straggler, host work); larger batches or CUDA graphs help "
        "launch-bound small models.",
    )


def moderate_gpu_utilization(facts: Facts) -> Finding | None:
    """MODERATE_GPU_UTILIZATION: GPUs busy less than GPU_UTIL_MODERATE_PCT but not low."""
    return _utilization(
        facts,
        th.GPU_UTIL_MODERATE_PCT,
        th.GPU_UTIL_LOW_PCT,
        "MODERATE_GPU_UTILIZATION",
        "info",
        "There is headroom on the GPUs: see the primary diagnosis for what the step waits "
        "on; overlapping input and copies with compute recovers it.",
    )


def high_gpu_temperature(facts: Facts) -> Finding | None:
    """HIGH_GPU_TEMPERATURE: GPUs that reached GPU_TEMP_HIGH_C (the hottest one named)."""
    hot = [
        GpuTemperature(**row, temperature_c_max=temp)
        for row, g in facts.gpu_rows()
        if (temp := g.temperature_c_max) is not None and temp >= th.GPU_TEMP_HIGH_C
    ]
    if not hot:
        return None
    worst = max(hot, key=lambda r: r["temperature_c_max"])
    return Finding(
        "HIGH_GPU_TEMPERATURE",
        "warning",
        f"GPU {worst['nvml_index']} of node {worst['node_rank']} reached "
        f"{worst['temperature_c_max']:.0f}°C (threshold {th.GPU_TEMP_HIGH_C:g}°C): "
        "it may throttle its clocks and straggle.",
        "Check the node's cooling and fan settings; compare with the straggler "
        "findings (a hot GPU is often the slow rank).",
        evidence={"statistic": PEAK, "gpus": hot, "threshold_c": th.GPU_TEMP_HIGH_C},
        ranks=sorted({r for row in hot for r in row["ranks"]}),
        nodes=sorted({r["node_rank"] for r in hot}),
    )


def high_cpu(facts: Facts) -> Finding | None:
    """HIGH_CPU: nodes whose CPUs are busy at least CPU_HIGH_PCT of the time (median)."""
    busy = [
        (n, cpu.median)
        for n in facts.nodes
        if (cpu := n.system.cpu_percent) is not None and cpu.median >= th.CPU_HIGH_PCT
    ]
    if not busy:
        return None
    return Finding(
        "HIGH_CPU",
        "warning",
        "CPUs of node "
        + ", ".join(f"{n.node_rank} ({median:.0f}%)" for n, median in busy)
        + f" are busy at least {th.CPU_HIGH_PCT:g}% of the time (median): data "
        "loading and kernel launches compete for cores.",
        "Lower DataLoader num_workers or threads (OMP_NUM_THREADS), move decoding to the "
        "GPU, or look for other processes on the node.",
        evidence={
            "statistic": SAMPLED_MEDIAN,
            "per_node_cpu_percent_median": {str(n.node_rank): median for n, median in busy},
            "threshold_pct": th.CPU_HIGH_PCT,
        },
        nodes=[n.node_rank for n, _ in busy],
    )


def high_ram(facts: Facts) -> Finding | None:
    """HIGH_RAM: nodes whose used RAM reached RAM_HIGH_PCT of their total."""
    full = [n for n in facts.nodes if (n.system.ram_used_pct_max or 0) >= th.RAM_HIGH_PCT]
    if not full:
        return None
    return Finding(
        "HIGH_RAM",
        "warning",
        "RAM of node "
        + ", ".join(f"{n.node_rank} ({n.system.ram_used_pct_max:.0f}%)" for n in full)
        + f" reached {th.RAM_HIGH_PCT:g}% of its total: swapping or the OOM killer "
        "are close.",
        "Fewer or lighter DataLoader workers (each holds a copy of the dataset object), "
        "smaller prefetch_factor, memory-mapped datasets.",
        evidence={
            "statistic": PEAK,
            "per_node_ram_used_pct_max": {
                str(n.node_rank): n.system.ram_used_pct_max for n in full
            },
            "threshold_pct": th.RAM_HIGH_PCT,
        },
        nodes=[n.node_rank for n in full],
    )


def node_ram_growth(facts: Facts) -> Finding | None:
    """NODE_RAM_GROWTH: nodes whose used RAM grows (:func:`~.memory.growth`) while their
    ranks' RSS growth explains less than NODE_RAM_UNEXPLAINED_PCT of it. Used RAM is total
    minus available, so the page cache (reclaimable) never counts as growth."""
    rows: list[dict[str, Any]] = []  # the evidence's nodes
    for n in facts.nodes:
        g = n.system.ram_growth
        if g is None or g.name != CREEP or g.bytes_per_hour <= 0:
            continue
        ranks_rate = sum(max(0.0, facts.rss_per_hour.get(r, 0.0)) for r in n.ranks)
        unexplained = g.bytes_per_hour - ranks_rate
        if unexplained < g.bytes_per_hour * th.NODE_RAM_UNEXPLAINED_PCT / 100.0:
            continue
        free = (n.system.ram_total_bytes or 0) - g.end_bytes
        rows.append(
            {
                "node_rank": n.node_rank,
                "bytes_per_hour": round(g.bytes_per_hour),
                "ranks_rss_bytes_per_hour": round(ranks_rate),
                "unexplained_bytes_per_hour": round(unexplained),
                "hours_to_exhaust": round(free / g.bytes_per_hour, 2) if free > 0 else None,
                "growth": g.to_json(),
            }
        )
    if not rows:
        return None
    worst = max(rows, key=lambda r: r["unexplained_bytes_per_hour"])
    when = (
        f"; at that rate it runs out of RAM in {hours_text(worst['hours_to_exhaust'])}"
        if worst["hours_to_exhaust"] is not None
        else ""
    )
    return Finding(
        "NODE_RAM_GROWTH",
        "warning",
        f"Used RAM of node {worst['node_rank']} grows {worst['bytes_per_hour'] / MIB:.0f} MiB "
        f"per hour (Theil-Sen slope; page cache not counted), of which its ranks' RSS "
        f"explains {worst['ranks_rss_bytes_per_hour'] / MIB:.0f} MiB per hour{when}.",
        "The growth is outside the training processes: DataLoader workers (each a process of "
        "its own; persistent workers keep what they cache), files in /dev/shm or tmpfs, or "
        "another process on the node.",
        evidence={
            "statistic": SLOPE,
            "nodes": rows,
            "threshold_pct": th.NODE_RAM_UNEXPLAINED_PCT,
            "threshold_z": th.MEMORY_GROWTH_Z,
        },
        nodes=[r["node_rank"] for r in rows],
    )


#: The system rules, in the order their findings are listed.
RULES = (
    low_gpu_utilization,
    moderate_gpu_utilization,
    high_gpu_temperature,
    high_cpu,
    high_ram,
    node_ram_growth,
)
