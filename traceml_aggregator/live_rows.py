"""The ``Summarize`` reply: the flat verdict plus one row per rank for the live views.

``traceml run --mode cli`` (:mod:`traceml.launcher.live`) draws a table of every rank of every
node from this reply. The figures come from two places, both on the aggregator's event loop:

- the live summary document (:meth:`~traceml_aggregator.live.LiveAggregates.summary`, the same
  analysis as the final summary, over each rank's window): step time and phase medians, input
  wait share, process CPU, GPU utilisation and memory, the step-time series, the end state;
- the live aggregates themselves, which are never behind the last committed batch: steps
  stored and ``last_step_unix_s`` (so a stalled rank shows even while the analysis result is
  reused).
"""

from __future__ import annotations

import time

from traceml import wire
from traceml.report.flat import flatten
from traceml_aggregator.live import LiveAggregates

#: Latest step times sent per rank for the sparkline (the window's last ones). With them a
#: row is about 350 bytes: 2.7 MiB for 8,000 ranks, inside gRPC's 4 MiB default message size.
SPARK_STEPS = 24


def summarize_reply(
    summary: dict, live: LiveAggregates, *, with_ranks: bool
) -> wire.SummarizeReply:
    """The reply to ``Summarize`` for the live summary document ``summary`` of ``live``.

    ``metrics``/``labels`` are :func:`~traceml.report.flat.flatten`'s (what
    ``traceml.summary()`` returns); ``ranks``, when ``with_ranks`` (the launcher's live view
    asks; a rank's ``traceml.summary()`` does not), one :class:`~traceml.wire.LiveRank` per
    rank of the summary, by rank (:func:`live_ranks`); ``now_unix_s`` this process's wall
    clock, s; ``verdict_summary`` the primary diagnosis's sentence, which states its evidence.
    """
    metrics, labels = flatten(summary)
    return wire.SummarizeReply(
        metrics=metrics,
        labels=labels,
        ranks=live_ranks(summary, live) if with_ranks else (),
        now_unix_s=time.time(),
        verdict_summary=summary["primary_diagnosis"]["summary"],
    )


def live_ranks(summary: dict, live: LiveAggregates) -> list[wire.LiveRank]:
    """One row per rank of ``summary["ranks"]`` (every rank of the world, in order).

    Per rank: ``step_time_ms`` the window's median (ms); ``phase_median_ms`` each measured
    part's median (ms, names of :data:`traceml.core.phases.PARTS` plus ``dataloader_next``);
    ``input_wait_pct`` the input wait's share of the step (%); ``cpu_pct`` the median of its
    process samples (%, 100 = one core); ``gpu_util_pct`` the median utilisation of its GPU
    (the node's GPU whose UUID its identity names, %); ``gpu_memory_bytes`` the CUDA
    allocator's peak allocated over the window, else its GPU's largest memory used (bytes);
    ``recent_step_ms`` the last :data:`SPARK_STEPS` step times of the window (ms, oldest
    first); ``steps_stored`` and ``last_step_unix_s`` from the aggregates (the rank's clock).
    Unmeasured figures stay unset.
    """
    gpus = {
        g["uuid"]: g for n in summary["nodes"] for g in n["system"]["gpus"] if g.get("uuid")
    }
    rows = []
    for r in summary["ranks"]:
        rl = live.ranks.get(r["rank"])
        identity = (rl.identity if rl else None) or {}
        gpu = gpus.get(identity.get("gpu_uuid") or "", {})
        peak = r["memory"]["peak_allocated_bytes"]
        row = wire.LiveRank(
            rank=r["rank"],
            hostname=r["hostname"] or "",
            steps_stored=rl.steps_stored if rl else 0,
            phase_median_ms={k: v for k, v in r["phase_median_ms"].items() if v is not None},
            recent_step_ms=r["series"]["step_ms"][-SPARK_STEPS:],
            end_state=r["end"]["state"],
        )
        optional = {
            "node_rank": r["node_rank"],
            "last_step_unix_s": rl.last_step_unix_s if rl else None,
            "step_time_ms": (r["step_time_ms"] or {}).get("median"),
            "input_wait_pct": r["phase_share_pct"].get("input_wait"),
            "cpu_pct": r["process"]["cpu_percent_median"],
            "gpu_util_pct": gpu.get("util_percent_median"),
            "gpu_memory_bytes": peak if peak is not None else gpu.get("memory_used_bytes_max"),
        }
        for name, value in optional.items():
            if value is not None:
                setattr(row, name, value)
        rows.append(row)
    return rows
