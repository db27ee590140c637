"""Everything the analysis needs, read from the store in one pass (the only I/O before it).

:func:`load` turns the SQLite tables into the plain dataclasses of
:mod:`traceml.analysis.rundata`; the analysis then works on :class:`RunData` alone.
"""

from __future__ import annotations

import itertools
import json
import operator

from traceml.analysis.hang import STALL_META_KEY
from traceml.analysis.rundata import STEP_FIELDS, RankData, RunData, StepColumns
from traceml_aggregator.store import (
    NODE_LOSSES_META_KEY,
    REJECTED_META_KEY,
    RESTARTS_META_KEY,
    Store,
)
from traceml_aggregator.streams import STREAMS_META_KEY


_attempt = operator.itemgetter(-2, -1)  # (rank, restart) of a steps row


def load(store: Store, missing: list[int], *, steps: bool = True) -> RunData:
    """Read the run from ``store``; ``missing`` lists the ranks finalization gave up on.

    With ``steps=False`` the steps table is not read at all (no rank has steps, and a rank's
    latest attempt is known from its identity and finish marker): the caller brings the steps,
    as the final summary does from the live aggregates (:mod:`traceml_aggregator.live`).
    """
    meta = store.meta()
    ranks: dict[int, RankData] = {}

    def rank_data(rank: int) -> RankData:
        return ranks.setdefault(rank, RankData(rank))

    step_attempts = " UNION ALL SELECT rank, restart FROM steps" if steps else ""
    latest = {
        row["rank"]: row["restart"]
        for row in store.query(
            "SELECT rank, MAX(restart) AS restart FROM ("
            f" SELECT rank, restart FROM ranks{step_attempts}"
            " UNION ALL SELECT rank, restart FROM rank_finish) GROUP BY rank"
        )
    }
    for rank, restart in latest.items():
        rank_data(rank).restart = restart
    for row in store.query("SELECT * FROM ranks ORDER BY rank, restart"):
        rd = rank_data(row["rank"])
        if row["restart"] == rd.restart:
            rd.identity = dict(row)
    # One sorted scan of the steps (the table has no index), one group per attempt, each
    # transposed into columns in C: no Python object per step. rank and restart come last, so
    # each row's first len(STEP_FIELDS) values are the step fields in column order.
    steps_sql = (
        f"SELECT {', '.join(STEP_FIELDS)}, rank, restart FROM steps ORDER BY rank, restart, step"
    )
    fields = slice(0, len(STEP_FIELDS))
    for (rank, restart), rows in itertools.groupby(
        store.query(steps_sql, by_name=False) if steps else (), _attempt
    ):
        rd = rank_data(rank)
        if restart == rd.restart:
            columns = list(zip(*rows))[fields]
            rd.steps = StepColumns(dict(zip(STEP_FIELDS, columns, strict=True)))
        else:
            rd.earlier_attempts[restart] = sum(1 for _ in rows)
    for row in store.query("SELECT * FROM rank_finish"):
        rd = rank_data(row["rank"])
        if row["restart"] == rd.restart:
            rd.finish = dict(row)
    for row in store.query("SELECT * FROM rank_flops"):
        rd = rank_data(row["rank"])
        if row["restart"] == rd.restart:
            rd.flops = dict(row)
    for row in store.query("SELECT * FROM sender_counts"):
        rd = rank_data(row["rank"])
        if row["restart"] == rd.restart:
            rd.counts = dict(row)
    for row in store.query("SELECT * FROM rank_ends"):
        rank_data(row["rank"]).end = dict(row)
    for row in store.query("SELECT * FROM process_samples ORDER BY unix_us"):
        rd = rank_data(row["rank"])
        if row["restart"] == rd.restart:
            rd.process_samples.append(dict(row))
    system: dict[int, list[dict]] = {}
    for row in store.query("SELECT * FROM system_samples ORDER BY unix_us"):
        system.setdefault(row["node_rank"], []).append(dict(row))
    gpus: dict[int, list[dict]] = {}
    for row in store.query("SELECT * FROM gpu_samples ORDER BY unix_us, nvml_index"):
        gpus.setdefault(row["node_rank"], []).append(dict(row))
    node_exits = {row["node_rank"]: dict(row) for row in store.query("SELECT * FROM node_exits")}
    world_size = int(meta.get("world_size") or 0) or max(
        [(rd.identity or {}).get("world_size") or 0 for rd in ranks.values()] + [len(ranks)]
    )
    for rank in range(world_size):
        rank_data(rank)
    return RunData(
        run_name=meta.get("run_name", ""),
        world_size=world_size,
        ranks=dict(sorted(ranks.items())),
        node_exits=node_exits,
        system_samples=system,
        gpu_samples=gpus,
        missing=list(missing),
        stall=json.loads(meta[STALL_META_KEY]) if meta.get(STALL_META_KEY) else None,
        aggregator_restarts=json.loads(meta.get(RESTARTS_META_KEY) or "[]"),
        node_losses=json.loads(meta.get(NODE_LOSSES_META_KEY) or "[]"),
        rejected=json.loads(meta.get(REJECTED_META_KEY) or "{}"),
        sender_streams=json.loads(meta.get(STREAMS_META_KEY) or "[]"),
    )
