"""The run as the analysis sees it: plain dataclasses, filled by the aggregator's loader.

:func:`traceml_aggregator.load.load` turns the SQLite tables into these; the functions in
:mod:`traceml.analysis` then work on :class:`RunData` alone and never touch the store.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RankData:
    """One rank (its latest attempt) as stored.

    ``steps`` holds one dict per stored step of that attempt, in step order, with the
    step fields of :mod:`traceml.wire.records` (µs, bytes; None when not measured).
    """

    rank: int
    restart: int = 0
    identity: dict | None = None
    steps: list[dict] = field(default_factory=list)
    finish: dict | None = None
    end: dict | None = None  # from the node launcher's report, when any
    process_samples: list[dict] = field(default_factory=list)
    earlier_attempts: dict[int, int] = field(default_factory=dict)  # restart -> steps stored


@dataclass
class RunData:
    """The whole run: ranks by global rank, node exits and system samples by node rank."""

    run_name: str
    world_size: int
    ranks: dict[int, RankData]
    node_exits: dict[int, dict]
    system_samples: dict[int, list[dict]]
    gpu_samples: dict[int, list[dict]]
    missing: list[int]
    #: The aggregator's stall record when ranks stopped making progress (a hang; see
    #: :mod:`traceml.analysis.hang` for its fields), else None.
    stall: dict | None = None
    #: Node 0's aggregator restarts on this run's store, in order: ``{"reason": str,
    #: "gap_s": float (s without an aggregator), "restarted_unix_s": float}``.
    aggregator_restarts: list[dict] = field(default_factory=list)
    #: Calls the aggregator refused, by kind (``unauthenticated``, ``rank_out_of_range``, ...:
    #: see traceml_aggregator/senders.py); empty when none was.
    rejected: dict[str, int] = field(default_factory=dict)
