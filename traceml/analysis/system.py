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
from dataclasses import dataclass

from traceml.analysis import thresholds as th
from traceml.analysis.document import (
    CpuPercent,
    GpuFigures,
    NodeSummary,
    NodeSystem,
    RankProcess,
)
from traceml.analysis.findings import PEAK, SAMPLED_MEDIAN, Finding, ranks_text
from traceml.analysis.stats import describe, median
from traceml.analysis.window import Window
from traceml.analysis.rundata import RankData, RunData


def window_span_us(run: RunData, window: Window) -> tuple[int, int] | None:
    """Wall-clock span of the window (unix µs): the first window step's start to the last
    window step's end, over every window rank; None without rank identities."""
    starts, ends = [], []
    for rank, steps in window.steps.items():
        origin = (run.ranks[rank].identity or {}).get("start_unix_us")
        if origin is None or not steps:
            continue
        starts.append(origin + steps["end_us"][0] - steps["step_us"][0])
        ends.append(origin + steps["end_us"][-1])
    return (min(starts), max(ends)) if starts else None


def _in_span(samples: list[dict], span: tuple[int, int] | None) -> list[dict]:
    if span is None:
        return samples
    inside = [s for s in samples if span[0] <= s["unix_us"] <= span[1]]
    return inside or samples


def _round(value: float | None, digits: int = 1) -> float | None:
    return None if value is None else round(value, digits)


def _max(values) -> float | None:
    present = [v for v in values if v is not None]
    return max(present) if present else None


def node_system(
    samples: list[dict], gpus: list[dict], span: tuple[int, int] | None
) -> NodeSystem:
    """``nodes[].system`` of the summary from one node's system and GPU samples."""
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
        )
    cpu = describe(s["cpu_percent"] for s in samples)
    ram = [
        100.0 * s["ram_used_bytes"] / s["ram_total_bytes"]
        for s in samples
        if s.get("ram_used_bytes") is not None and s.get("ram_total_bytes")
    ]
    by_index: dict[int, list[dict]] = {}
    for g in gpus:
        by_index.setdefault(g["nvml_index"], []).append(g)
    gpu_rows = []
    for index, rows in sorted(by_index.items()):
        util = median(g["util_percent"] for g in rows)
        reasons = [g["unavailable_reason"] for g in rows if g.get("unavailable_reason")]
        gpu_rows.append(
            GpuFigures(
                nvml_index=index,
                uuid=rows[-1].get("uuid"),
                util_percent_median=_round(util),
                memory_used_bytes_max=_max(g["memory_used_bytes"] for g in rows),
                memory_total_bytes=_max(g["memory_total_bytes"] for g in rows),
                temperature_c_max=_round(_max(g["temperature_c"] for g in rows)),
                power_w_median=_round(median(g["power_w"] for g in rows)),
                unavailable_reason=reasons[-1] if reasons else None,
            )
        )
    node_reason = next(
        (s["gpu_unavailable_reason"] for s in reversed(samples) if s.get("gpu_unavailable_reason")),
        None,
    )
    return NodeSystem(
        samples=len(samples),
        cpu_percent=(
            CpuPercent(_round(cpu["median"]), _round(cpu["p95"]), _round(cpu["max"]))
            if cpu
            else None
        ),
        ram_used_pct_max=_round(max(ram)) if ram else None,
        ram_total_bytes=_max(s["ram_total_bytes"] for s in samples),
        gpus=gpu_rows,
        unavailable_reason=node_reason if not gpu_rows else None,
    )


def rank_process(rd: RankData, span: tuple[int, int] | None) -> RankProcess:
    """``ranks[].process`` of the summary: CPU (% of one core), RSS and CUDA allocator peaks."""
    samples = _in_span(rd.process_samples, span)
    cpu = describe(s["cpu_percent"] for s in samples)
    return RankProcess(
        samples=len(samples),
        cpu_percent_median=_round(cpu["median"]) if cpu else None,
        rss_bytes_max=_max(s["rss_bytes"] for s in samples),
        gpu_allocated_bytes_max=_max(s["gpu_allocated_bytes"] for s in samples),
        gpu_reserved_bytes_max=_max(s["gpu_reserved_bytes"] for s in samples),
    )


@dataclass(frozen=True)
class Facts:
    """What the system rules look at: the summary's ``nodes`` (with ``system``) and
    ``gpu_ranks``, GPU UUID -> ranks on it (when empty, every GPU with figures counts)."""

    nodes: list[NodeSummary]
    gpu_ranks: dict[str, list[int]]

    def gpu_rows(self) -> list[tuple[dict, GpuFigures]]:
        """``({"node_rank", "nvml_index", "ranks"}, figures)`` of every GPU this run used."""
        out = []
        for node in self.nodes:
            for g in node.system.gpus:
                used_by = self.gpu_ranks.get(g.uuid or "", [])
                if self.gpu_ranks and not used_by:
                    continue  # a GPU no rank of this run used
                out.append(
                    ({"node_rank": node.node_rank, "nvml_index": g.nvml_index, "ranks": used_by}, g)
                )
        return out


def findings(nodes: list[NodeSummary], gpu_ranks: dict[str, list[int]]) -> list[Finding]:
    """GPU utilisation and temperature, CPU and RAM findings over the summary's ``nodes``, one
    per rule of :data:`RULES` that applies.

    Args:
        nodes: ``nodes[]`` of the summary (with ``system``).
        gpu_ranks: GPU UUID -> ranks on it; when empty, every GPU with a utilisation counts.
    """
    facts = Facts(nodes, gpu_ranks)
    found = (rule(facts) for rule in RULES)
    return [f for f in found if f is not None]


def _utilization(
    facts: Facts, below: float, at_least: float, kind: str, severity: str, advice: str
) -> Finding | None:
    """A GPU utilisation finding over the GPUs busy ``at_least`` <= median < ``below`` %."""
    rows = [
        dict(row, util_percent_median=g.util_percent_median)
        for row, g in facts.gpu_rows()
        if g.util_percent_median is not None and at_least <= g.util_percent_median < below
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
        dict(row, temperature_c_max=g.temperature_c_max)
        for row, g in facts.gpu_rows()
        if g.temperature_c_max is not None and g.temperature_c_max >= th.GPU_TEMP_HIGH_C
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
        n
        for n in facts.nodes
        if n.system.cpu_percent is not None and n.system.cpu_percent.median >= th.CPU_HIGH_PCT
    ]
    if not busy:
        return None
    return Finding(
        "HIGH_CPU",
        "warning",
        "CPUs of node "
        + ", ".join(f"{n.node_rank} ({n.system.cpu_percent.median:.0f}%)" for n in busy)
        + f" are busy at least {th.CPU_HIGH_PCT:g}% of the time (median): data "
        "loading and kernel launches compete for cores.",
        "Lower DataLoader num_workers or threads (OMP_NUM_THREADS), move decoding to the "
        "GPU, or look for other processes on the node.",
        evidence={
            "statistic": SAMPLED_MEDIAN,
            "per_node_cpu_percent_median": {
                str(n.node_rank): n.system.cpu_percent.median for n in busy
            },
            "threshold_pct": th.CPU_HIGH_PCT,
        },
        nodes=[n.node_rank for n in busy],
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


#: The system rules, in the order their findings are listed.
RULES = (
    low_gpu_utilization,
    moderate_gpu_utilization,
    high_gpu_temperature,
    high_cpu,
    high_ram,
)
