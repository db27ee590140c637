"""The verdict and key figures as flat name -> value pairs (what ``traceml.summary()`` returns).

Numbers go to ``metrics`` (``wandb.log``, ``mlflow.log_metrics``, TensorBoard scalars), words to
``labels`` (``mlflow.set_tags``, TensorBoard text). Names carry their unit: ``_ms``, ``_pct``,
``_bytes``; a figure that was not measured is left out, never sent as 0.
"""

from __future__ import annotations

from traceml.analysis.document import PARTS
from traceml.analysis.findings import SEVERITIES
from traceml.analysis.stats import median
from traceml.report.fmt import gpu_util


def flatten(summary: dict) -> tuple[dict[str, float], dict[str, str]]:
    """``(metrics, labels)`` of a summary document.

    Metrics: ``step_time_ms`` (typical median), ``step_time_p95_ms`` (worst rank),
    ``<part>_ms`` and ``<part>_pct`` for each part of the step (typical rank), ``window_steps``,
    ``world_size``, ``severity_level`` (0 info, 1 warning, 2 critical), ``impact_ms``,
    ``straggler_gap_ms``, ``gpu_util_pct`` (median over nodes), ``peak_allocated_bytes`` (max
    over ranks), ``findings_warning``/``findings_critical`` (counts), ``samples_per_s``,
    ``tokens_per_s``, ``achieved_tflops`` and ``mfu_pct`` (the job's: sums over ranks).
    Labels: ``verdict`` (the primary kind), ``severity``, ``clock``, ``run_name``, and the
    ``ranks`` and ``nodes`` the verdict singles out (a straggler), comma-separated.
    """
    p = summary["primary_diagnosis"]
    typ = summary["analysis"]["typical"]
    metrics: dict[str, float | None] = {
        "step_time_ms": typ["step_time_ms"],
        "step_time_p95_ms": max(
            (r["step_time_ms"]["p95"] for r in summary["ranks"] if r["step_time_ms"]), default=None
        ),
        "window_steps": summary["analysis"]["window"]["steps"],
        "world_size": summary["run"]["world_size"],
        "severity_level": SEVERITIES.index(p["severity"]),
        "impact_ms": p["impact_ms"],
        "straggler_gap_ms": p["evidence"].get("gap_ms"),
        "gpu_util_pct": median(gpu_util(n) for n in summary["nodes"]),
        "peak_allocated_bytes": max(
            (
                r["memory"]["peak_allocated_bytes"]
                for r in summary["ranks"]
                if r["memory"]["peak_allocated_bytes"] is not None
            ),
            default=None,
        ),
    }
    job = summary["analysis"].get("throughput") or {}  # absent from summaries made before it
    for name in ("samples_per_s", "tokens_per_s", "achieved_tflops", "mfu_pct"):
        metrics[name] = job.get(name)
    for part in PARTS:
        metrics[f"{part}_ms"] = typ["phase_median_ms"].get(part)
        metrics[f"{part}_pct"] = typ["phase_share_pct"].get(part)
    everything = [f for items in summary["findings"].values() for f in items] + [p]
    for level in ("warning", "critical"):
        metrics[f"findings_{level}"] = sum(1 for f in everything if f["severity"] == level)
    labels = {
        "verdict": p["kind"],
        "severity": p["severity"],
        "clock": summary["analysis"]["clock"]["name"],
        "run_name": summary["run"]["run_name"],
        "ranks": ",".join(map(str, p["ranks"])) if len(p["ranks"]) < len(summary["ranks"]) else "",
        "nodes": ",".join(map(str, p["nodes"])) if len(p["nodes"]) < len(summary["nodes"]) else "",
    }
    return (
        {k: float(v) for k, v in metrics.items() if v is not None},
        {k: v for k, v in labels.items() if v},
    )
