"""The ``Summarize`` reply: the flat verdict plus one row per rank for the live views.

``traceml run --mode cli`` (:mod:`traceml.launcher.terminal_view`) draws a table of every rank
of every node from this reply. The figures come from two places, both on the aggregator's event
loop:

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
from traceml_aggregator.live.windows import LiveAggregates

#: Latest step times sent per rank for the sparkline (the window's last ones). With them a
#: row is about 350 bytes: 2.7 MiB for 8,000 ranks, inside gRPC's 4 MiB default message size.
SPARK_STEPS = 24


def summarize_reply(
    summary: dict, live: LiveAggregates, rows: LiveRows | None
) -> wire.SummarizeReply:
    """The reply to ``Summarize`` for the live summary document ``summary`` of ``live``.

    ``metrics``/``labels`` are :func:`~traceml.report.flat.flatten`'s (what
    ``traceml.summary()`` returns); ``ranks``, when ``rows`` are given (the launcher's live view
    asks ``with_ranks``; a rank's ``traceml.summary()`` does not), one
    :class:`~traceml.wire.LiveRank` per rank of the summary, by rank (:meth:`LiveRows.fill`);
    ``now_unix_s`` this process's wall clock, s; ``verdict_summary`` the primary diagnosis's
    sentence, which states its evidence.
    """
    metrics, labels = flatten(summary)
    reply = wire.SummarizeReply(
        metrics=metrics,
        labels=labels,
        now_unix_s=time.time(),
        verdict_summary=summary["primary_diagnosis"]["summary"],
    )
    if rows is not None:
        rows.fill(reply, summary, live)
    return reply


class LiveRows:
    """The rows of ``Summarize`` replies: one per rank of the summary (every rank of the
    world, in order). A row's summary figures are built once per live summary (viewers are
    answered from the same summary until the next computation); each reply copies them and
    adds the aggregates' own, current figures (at 256 ranks ~0.6 ms a reply, against ~8 ms to
    build the rows each time). Event-loop use only.

    Per rank, from the summary: ``step_time_ms`` the window's median (ms); ``phase_median_ms``
    each measured part's median (ms, names of :data:`traceml.core.phases.PARTS` plus
    ``dataloader_next``); ``input_wait_pct`` the input wait's share of the step (%);
    ``cpu_pct`` the median of its process samples (%, 100 = one core); ``gpu_util_pct`` the
    median utilisation of its GPU (the node's GPU whose UUID its identity names, %);
    ``gpu_memory_bytes`` the CUDA allocator's peak allocated over the window, else its GPU's
    largest memory used (bytes); ``recent_step_ms`` the last :data:`SPARK_STEPS` step times of
    the window (ms, oldest first). From the aggregates, at each reply: ``steps_stored`` and
    ``last_step_unix_s`` (the rank's clock), and ``node_rank`` and ``hostname`` when its identity
    arrived after the summary was built (a row never shows a rank's steps without its node).
    Unmeasured figures stay unset.
    """

    def __init__(self) -> None:
        self._summary: dict | None = None
        self._rows: list[wire.LiveRank] = []

    def fill(self, reply: wire.SummarizeReply, summary: dict, live: LiveAggregates) -> None:
        """Append the rows of ``summary`` and ``live`` to ``reply.ranks``."""
        if summary is not self._summary:
            self._summary, self._rows = summary, _summary_rows(summary, live)
        for row in self._rows:
            out = reply.ranks.add()
            out.CopyFrom(row)
            rl = live.ranks.get(row.rank)
            if rl is not None:
                out.steps_stored = rl.steps_stored
                if rl.last_step_unix_s is not None:
                    out.last_step_unix_s = rl.last_step_unix_s
                identity = rl.identity  # arrived after the summary was built: its node now
                if not out.HasField("node_rank") and identity and identity.node_rank is not None:
                    out.node_rank, out.hostname = identity.node_rank, identity.hostname or ""


def _summary_rows(summary: dict, live: LiveAggregates) -> list[wire.LiveRank]:
    """The rows' figures that come from ``summary`` (see :class:`LiveRows`)."""
    gpus = {g["uuid"]: g for n in summary["nodes"] for g in n["system"]["gpus"] if g.get("uuid")}
    rows = []
    for r in summary["ranks"]:
        rl = live.ranks.get(r["rank"])
        identity = rl.identity if rl else None
        gpu = gpus.get((identity.gpu_uuid if identity else "") or "", {})
        peak = r["memory"]["peak_allocated_bytes"]
        optional = {
            "node_rank": r["node_rank"],
            "step_time_ms": (r["step_time_ms"] or {}).get("median"),
            "input_wait_pct": r["phase_share_pct"].get("input_wait"),
            "cpu_pct": r["process"]["cpu_percent_median"],
            "gpu_util_pct": gpu.get("util_percent_median"),
            "gpu_memory_bytes": peak if peak is not None else gpu.get("memory_used_bytes_max"),
        }
        rows.append(
            wire.LiveRank(
                rank=r["rank"],
                hostname=r["hostname"] or "",
                phase_median_ms={k: v for k, v in r["phase_median_ms"].items() if v is not None},
                recent_step_ms=r["series"]["step_ms"][-SPARK_STEPS:],
                end_state=r["end"]["state"],
                **{name: value for name, value in optional.items() if value is not None},
            )
        )
    return rows
