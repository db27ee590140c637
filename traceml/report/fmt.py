"""Number formatting and the row selection shared by the text and HTML reports.

A ``None`` figure (not measured) is shown as ``-``, never as 0.
"""

from __future__ import annotations

from traceml.analysis.findings import ranks_text
from traceml.analysis.stats import median

MIB = 1024 * 1024
#: Most ranks listed row by row in a report's tables; the rest are counted (the JSON has all).
MAX_RANK_ROWS = 16
#: Placeholder for a figure that was not measured.
NA = "-"


def num(value: float | int | None, digits: int = 1) -> str:
    """``12.3``; ``-`` for None."""
    return NA if value is None else f"{value:.{digits}f}"


def mib(value: int | None) -> str:
    """Bytes as whole MiB; ``-`` for None."""
    return NA if value is None else f"{value / MIB:.0f}"


def end_text(end: dict) -> str:
    """``failed, exit code 7, signal 9 (reason)`` from a rank's ``end`` object."""
    parts = [end["state"]]
    if end.get("exit_code") is not None:
        parts.append(f"exit code {end['exit_code']}")
    if end.get("signal") is not None:
        parts.append(f"signal {end['signal']}")
    reason = f" ({end['reason']})" if end.get("reason") else ""
    return ", ".join(parts) + reason


def missing_text(summary: dict) -> str:
    """What a partial summary lacks, from ``run.missing_ranks`` and their end states:
    ``rank 1 never finished (its data may be incomplete); ranks 2, 3 never reported (no
    data)``; "" when none is missing."""
    missing = summary["run"]["missing_ranks"]
    silent = {r["rank"] for r in summary["ranks"] if r["end"]["state"] == "never_reported"}
    said = []
    if unfinished := [r for r in missing if r not in silent]:
        its = "its" if len(unfinished) == 1 else "their"
        said.append(f"{ranks_text(unfinished)} never finished ({its} data may be incomplete)")
    if never := [r for r in missing if r in silent]:
        said.append(f"{ranks_text(never)} never reported (no data)")
    return "; ".join(said)


def featured_ranks(summary: dict) -> set[int]:
    """Ranks a report shows first: those the verdict singles out, and its typical rank."""
    p = summary["primary_diagnosis"]
    featured = set(p["ranks"]) if len(p["ranks"]) < len(summary["ranks"]) else set()
    typical = p["evidence"].get("typical_rank")
    return featured | ({typical} if typical is not None else set())


def rank_rows(summary: dict) -> tuple[list[dict], int]:
    """Ranks to list row by row, in rank order: all of them, or at most :data:`MAX_RANK_ROWS`
    chosen as the featured ranks then the slowest by median step time; and how many were
    left out."""
    ranks = summary["ranks"]
    if len(ranks) <= MAX_RANK_ROWS:
        return list(ranks), 0
    featured = featured_ranks(summary)

    def key(r: dict):
        step_ms = (r["step_time_ms"] or {}).get("median") or 0.0
        return (r["rank"] not in featured, -step_ms, r["rank"])

    shown = sorted(sorted(ranks, key=key)[:MAX_RANK_ROWS], key=lambda r: r["rank"])
    return shown, len(ranks) - len(shown)


def gpu_util(node: dict) -> float | None:
    """Median utilisation over a node's GPUs that report one (%), or None."""
    return median(g["util_percent_median"] for g in node["system"]["gpus"])


def gpu_temp(node: dict) -> float | None:
    """Hottest GPU of a node (°C), or None."""
    values = [
        g["temperature_c_max"] for g in node["system"]["gpus"] if g["temperature_c_max"] is not None
    ]
    return max(values) if values else None
