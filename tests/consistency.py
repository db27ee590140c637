"""One statistic per claim (issue 15): every finding states ``evidence.statistic``, and its
headline figure, its percentage and its evidence agree with it and with one another.

Used by tests/test_diagnosis_truth.py (every finding of every planted run) and
tests/test_diagnosis_truth_units.py (every finding of the hand-built runs)."""

from __future__ import annotations

from traceml.analysis.findings import (
    EVENTS,
    KINDS,
    MEDIAN,
    PEAK,
    SAMPLED_MEDIAN,
    SLOPE,
    STATISTICS,
    SUMMED,
    TREND,
)

MIB = 1024 * 1024
#: The statistic each memory and system kind uses (a step-time kind: MEDIAN or SUMMED).
KIND_STATISTIC = {
    "MEMORY_PRESSURE": PEAK,
    "MEMORY_IMBALANCE": PEAK,
    "MEMORY_CREEP": TREND,
    "HOST_MEMORY_CREEP": SLOPE,
    "NODE_RAM_GROWTH": SLOPE,
    "LOW_GPU_UTILIZATION": SAMPLED_MEDIAN,
    "MODERATE_GPU_UTILIZATION": SAMPLED_MEDIAN,
    "HIGH_GPU_TEMPERATURE": PEAK,
    "HIGH_CPU": SAMPLED_MEDIAN,
    "HIGH_RAM": PEAK,
    **dict.fromkeys(KINDS["health"], EVENTS),
}


def all_findings(summary: dict) -> list[dict]:
    """The primary diagnosis and every finding of every section."""
    return [summary["primary_diagnosis"]] + [
        f for section in summary["findings"].values() for f in section
    ]


def check_consistent(f: dict, where: str) -> None:
    """``f`` states its statistic, and its numbers agree with it (see the module docstring)."""
    ev, text, kind = f["evidence"], f["summary"], f["kind"]
    stat = ev.get("statistic")
    assert stat in STATISTICS, (where, f)
    if kind == "INSUFFICIENT_DATA":
        assert stat == EVENTS and ev["missing"], (where, f)
    elif kind in KINDS["step_time"]:
        _step_time(ev, text, stat)
    else:
        assert stat == KIND_STATISTIC[kind], (where, f)
        _memory_and_system(kind, ev, text)
        # "median" is said exactly where the figure is one
        assert ("median" in text) == (stat == SAMPLED_MEDIAN), (where, f)
    assert ("medians per step" in text) == (stat == MEDIAN), (where, f)


def _step_time(ev: dict, text: str, stat: str) -> None:
    assert stat in (MEDIAN, SUMMED)
    if "gap_ms" in ev:  # stragglers
        assert abs(100 * ev["gap_ms"] / ev["step_time_ms"] - ev["gap_pct_of_step"]) <= 0.1
        assert f"{ev['gap_ms']:.1f} ms" in text
    if "typical_share_pct" in ev:  # job-wide bounds
        assert abs(100 * ev["typical_ms"] / ev["step_time_ms"] - ev["typical_share_pct"]) <= 0.1
        assert f"{ev['typical_ms']:.1f} ms per step ({ev['typical_share_pct']:.0f}%" in text
    if "transfer_share_pct" in ev:  # COMM_BOUND
        assert abs(100 * ev["transfer_ms"] / ev["step_time_ms"] - ev["transfer_share_pct"]) <= 0.1
        assert f"{ev['transfer_ms']:.1f} ms per step ({ev['transfer_share_pct']:.0f}%" in text
    if "held_pct" in ev:  # LATE_ARRIVAL
        assert ev["last_pct"] >= ev["held_pct"] >= ev["threshold_pct"]
        assert ev["late_ms"] >= ev["floor_ms"] >= 2 * ev["clock_error_ms"]
        assert f"held up {ev['held_pct']:.0f}% of the {ev['collectives']} collectives" in text
        assert f"arriving last {ev['late_ms']:.1f} ms after the others' median" in text
        assert f"waited {ev['others_wait_ms']:.1f} ms a step" in text
    if "compute_share_pct" in ev:
        assert abs(100 * ev["compute_ms"] / ev["step_time_ms"] - ev["compute_share_pct"]) <= 0.1
    if "share_of_wall_pct" in ev:
        assert stat == SUMMED
        total = ev["total_ms"] if "total_ms" in ev else ev["total_excess_ms"]
        assert abs(100 * total / ev["wall_ms"] - ev["share_of_wall_pct"]) <= 0.1
        assert f"{ev['share_of_wall_pct']:.0f}%" in text


def _memory_and_system(kind: str, ev: dict, text: str) -> None:
    if kind == "MEMORY_PRESSURE":
        # the headline's rank is the worst, and its share is its peak over the GPU's total
        assert ev["pressure_pct"] == max(ev["per_rank_pressure_pct"].values())
        assert ev["per_rank_pressure_pct"][str(ev["rank"])] == ev["pressure_pct"]
        share = 100 * ev["peak_reserved_bytes"] / ev["gpu_total_bytes"]
        assert abs(share - ev["pressure_pct"]) <= 0.1
        assert f"{ev['pressure_pct']:.0f}% of the GPU's memory (rank {ev['rank']}: " in text
        assert f"{ev['peak_reserved_bytes'] / MIB:.0f} of {ev['gpu_total_bytes'] / MIB:.0f}" in text
        assert all(v >= ev["threshold_pct"] for v in ev["per_rank_pressure_pct"].values())
    elif kind == "MEMORY_IMBALANCE":
        high, low = ev["highest_bytes"], ev["lowest_bytes"]
        assert abs(100 * (high - low) / high - ev["spread_pct"]) <= 0.1
        assert f"({ev['spread_pct']:.0f}% apart)" in text
        assert ev["spread_pct"] >= ev["threshold_pct"]
    elif kind == "MEMORY_CREEP":
        trends = ev["per_rank_trend"]
        t = trends[str(ev["rank"])]
        assert t["growth_bytes"] == max(x["growth_bytes"] for x in trends.values())
        for x in trends.values():
            assert x["growth_bytes"] == x["end_bytes"] - x["start_bytes"] > 0
        assert f"{t['start_bytes'] / MIB:.0f} to {t['end_bytes'] / MIB:.0f} MiB" in text
        assert f"(+{t['bytes_per_1k_steps'] / MIB:.0f} MiB per 1000 steps)" in text
    elif kind == "HOST_MEMORY_CREEP":
        growth = ev["per_rank_growth"]
        g = growth[str(ev["rank"])]
        assert (
            g["bytes_per_hour"]
            == ev["bytes_per_hour"]
            == max(x["bytes_per_hour"] for x in growth.values())
        )
        assert all(
            x["name"] == "creep" and x["kendall_z"] >= ev["threshold_z"] for x in growth.values()
        )
        assert f"{g['bytes_per_hour'] / MIB:.0f} MiB per hour (Theil-Sen slope)" in text
        assert f"from {g['start_bytes'] / MIB:.0f} to {g['end_bytes'] / MIB:.0f} MiB" in text
    elif kind == "NODE_RAM_GROWTH":
        for row in ev["nodes"]:
            assert (
                row["unexplained_bytes_per_hour"]
                == (row["bytes_per_hour"] - row["ranks_rss_bytes_per_hour"])
                or abs(
                    row["unexplained_bytes_per_hour"]
                    - row["bytes_per_hour"]
                    + row["ranks_rss_bytes_per_hour"]
                )
                <= 1
            )
            assert row["unexplained_bytes_per_hour"] >= (
                row["bytes_per_hour"] * ev["threshold_pct"] / 100 - 1
            )
        assert "(Theil-Sen slope; page cache not counted)" in text
    elif kind in ("LOW_GPU_UTILIZATION", "MODERATE_GPU_UTILIZATION"):
        utils = [g["util_percent_median"] for g in ev["gpus"]]
        assert all(u < ev["threshold_pct"] for u in utils)
        assert f"busy {min(utils):.0f}% of the time (median;" in text
    elif kind == "HIGH_GPU_TEMPERATURE":
        temps = [g["temperature_c_max"] for g in ev["gpus"]]
        assert all(t >= ev["threshold_c"] for t in temps)
        assert f"reached {max(temps):.0f}°C" in text
    elif kind in ("HIGH_CPU", "HIGH_RAM"):
        per_node = ev[
            "per_node_cpu_percent_median" if kind == "HIGH_CPU" else "per_node_ram_used_pct_max"
        ]
        for node, value in per_node.items():
            assert value >= ev["threshold_pct"]
            assert f"{node} ({value:.0f}%)" in text
