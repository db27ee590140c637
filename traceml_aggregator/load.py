"""Everything the analysis needs, read from the store in one pass (the only I/O before it).

:func:`load` turns the SQLite tables into the plain dataclasses of
:mod:`traceml.analysis.rundata`; the analysis then works on :class:`RunData` alone. Steps load
as columns of Python values, samples as NumPy columns (:class:`SampleColumns`): read
:data:`SAMPLE_CHUNK_ROWS` rows at a time, so no Python object per sample outlives its chunk.
"""

from __future__ import annotations

import itertools
import json
import operator
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from traceml.analysis.hang import STALL_META_KEY
from traceml.analysis.rundata import (
    RankData,
    RunData,
    SampleColumns,
    StepTable,
    run_data,
)
from traceml.core import records
from traceml.core.phases import STEP_FIELDS
from traceml_aggregator.script_world import SCRIPT_WORLD_META_KEY
from traceml_aggregator.store import (
    LOSS_META_KEY,
    NODE_CLOCKS_META_KEY,
    NODE_LOSSES_META_KEY,
    REJECTED_META_KEY,
    REJECTED_REASONS_META_KEY,
    RESTARTS_META_KEY,
    Store,
)
from traceml_aggregator.streams import STREAMS_META_KEY

_attempt = operator.itemgetter(-2, -1)  # (rank, restart) of a steps row

#: Sample rows read from SQLite at a time (then turned into arrays).
SAMPLE_CHUNK_ROWS = 65536
#: The run's own records, kept as JSON entries of the store's meta table: RunData field ->
#: (meta key, its JSON when the entry is absent, the record (:mod:`traceml.core.records`) the
#: entry is, or each item of a list entry; None for a plain mapping of counts or reasons by
#: kind).
META_RECORDS: dict[str, tuple[str, str, type[records.MetaRecord] | None]] = {
    "stall": (STALL_META_KEY, "null", records.HangRecord),
    "aggregator_restarts": (RESTARTS_META_KEY, "[]", records.AggregatorRestart),
    "aggregator_loss": (LOSS_META_KEY, "null", records.AggregatorLoss),
    "node_losses": (NODE_LOSSES_META_KEY, "[]", records.LostNode),
    "node_clocks": (NODE_CLOCKS_META_KEY, "[]", records.NodeClock),
    "rejected": (REJECTED_META_KEY, "{}", None),
    "rejected_reasons": (REJECTED_REASONS_META_KEY, "{}", None),
    "script_world": (SCRIPT_WORLD_META_KEY, "null", records.ScriptWorld),
    "sender_streams": (STREAMS_META_KEY, "[]", records.StreamEnd),
}
#: The small per-rank records RankData holds (its attribute -> record): each rank's latest
#: attempt's row.
_RANK_RECORDS = {
    "identity": records.Identity,
    "finish": records.Finish,
    "flops": records.Flops,
    "counts": records.SenderCounts,
}


def run_records(entries: Mapping[str, Any]) -> dict[str, Any]:
    """RunData's fields of the run's own records (:data:`META_RECORDS`) from their decoded
    JSON ``entries`` (RunData field -> the entry: a dict, a list of dicts, or None), each as
    its record (a list of records for a list entry; a plain mapping stays as it is): what the
    loader reads from the store, and the live summary from the aggregator's own state.

    Raises:
        TypeError: an entry lacks a field of its record, or has one it does not know.
    """
    out: dict[str, Any] = {}
    for name, entry in entries.items():
        record = META_RECORDS[name][2]
        if record is None or entry is None:
            out[name] = entry
        elif isinstance(entry, list):
            out[name] = [record.from_json(item) for item in entry]
        else:
            out[name] = record.from_json(entry)
    return out


def sample_groups(store: Store, record: type[records.Record], after_rowid: int = 0):
    """The rows of ``record``'s sample table (:data:`traceml.core.records.SAMPLES`) as
    :class:`SampleColumns`, one per value of its ``GROUP`` columns (e.g. ``("rank",
    "restart")``), each sorted by its ``ORDER`` (e.g. ``("unix_us",)``), ties in the order
    they were stored; only the rows stored after rowid ``after_rowid`` (a range of the table's
    b-tree: O(those rows)).

    Read :data:`SAMPLE_CHUNK_ROWS` rows at a time into float64 arrays (NULL: NaN) and, for text
    columns, object arrays of shared strings (a host name is one string, not one per sample);
    sorted with NumPy, not by SQLite. Yields ``(key values as ints, SampleColumns)``, in key
    order.
    """
    table, keys, order = record.TABLE, record.GROUP, record.ORDER
    names, ints, texts = record.names(), record.of_type("INTEGER"), record.of_type("TEXT")
    after = f" WHERE rowid > {int(after_rowid)}"
    (total,) = store.query(f"SELECT COUNT(*) FROM {table}{after}", by_name=False)[0]
    if not total:
        return
    columns = {
        name: np.empty(total, dtype=object if name in texts else np.float64) for name in names
    }
    shared: dict[str, str] = {}
    at = 0
    for chunk in store.stream(f"SELECT {', '.join(names)} FROM {table}{after}", SAMPLE_CHUNK_ROWS):
        rows = np.array(chunk[: total - at], dtype=object)
        end = at + len(rows)
        for j, name in enumerate(names):
            if name in texts:  # one string object per distinct value
                column = rows[:, j]
                columns[name][at:end] = [
                    v if v is None else shared.setdefault(v, v) for v in column
                ]
            else:
                columns[name][at:end] = rows[:, j].astype(np.float64)
        at = end
    ordered = np.lexsort([columns[name][:at] for name in reversed(keys + order)])
    for name in names:  # one column at a time: the run's samples are held once, plus a column
        columns[name] = columns[name][:at][ordered]
    key_values = np.stack([columns[k] for k in keys], axis=1)
    starts = np.flatnonzero(np.any(np.diff(key_values, axis=0) != 0, axis=1)) + 1
    bounds = [0, *starts.tolist(), at]
    for lo, hi in zip(bounds, bounds[1:], strict=False):
        key = tuple(int(v) for v in key_values[lo])
        yield key, SampleColumns({k: c[lo:hi] for k, c in columns.items()}, ints)


def load(
    store: Store,
    missing: list[int],
    *,
    steps: bool = True,
    samples: bool = True,
    sampled_ranks: Iterable[int] = (),
) -> RunData:
    """Read the run from ``store``; ``missing`` lists the ranks finalization gave up on.

    With ``steps=False`` the steps table is not read at all (no rank has steps, and a rank's
    latest attempt is known from its identity and finish marker): the caller brings the steps,
    as the final summary does from the live aggregates (:mod:`traceml_aggregator.live`). With
    ``samples=False`` neither are the sample tables (no rank or node has samples): what is
    left is O(ranks + nodes), whatever the run's length; ``sampled_ranks`` then names the
    ranks that have process samples, so that the ranks and the world size are a full load's.
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
    # One sorted scan of the steps (the table has no index), one group per attempt, each
    # transposed into columns in C: no Python object per step. rank and restart come last, so
    # each row's first len(STEP_FIELDS) values are the step fields in column order.
    # A store written before a phase was added lacks its column: read it as never measured.
    stored = {row[1] for row in store.query("PRAGMA table_info(steps)", by_name=False)}
    selected = ", ".join(f if f in stored else f"NULL AS {f}" for f in STEP_FIELDS)
    steps_sql = f"SELECT {selected}, rank, restart FROM steps ORDER BY rank, restart, step"
    fields = slice(0, len(STEP_FIELDS))
    for (rank, restart), rows in itertools.groupby(
        store.query(steps_sql, by_name=False) if steps else (), _attempt
    ):
        rd = rank_data(rank)
        if restart == rd.restart:
            columns = list(zip(*rows, strict=True))[fields]
            rd.steps = StepTable(dict(zip(STEP_FIELDS, columns, strict=True)))
        else:
            rd.earlier_attempts[restart] = sum(1 for _ in rows)
    for attr, record in _RANK_RECORDS.items():
        for row in store.query(f"SELECT * FROM {record.TABLE}"):
            rd = rank_data(row["rank"])
            if row["restart"] == rd.restart:
                setattr(rd, attr, record.from_row(row))
    for row in store.query(f"SELECT * FROM {records.RankEnd.TABLE}"):
        rank_data(row["rank"]).end = records.RankEnd.from_row(row)
    for rank in sampled_ranks:
        rank_data(rank)
    system, gpus = {}, {}
    if samples:
        for (rank, restart), columns in sample_groups(store, records.ProcessSample):
            rd = rank_data(rank)
            if restart == rd.restart:
                rd.process_samples = columns
        system = {node: columns for (node,), columns in sample_groups(store, records.SystemSample)}
        gpus = {node: columns for (node,), columns in sample_groups(store, records.GpuSample)}
    exits = store.query(f"SELECT * FROM {records.NodeExit.TABLE}")
    return run_data(
        meta.get("run_name", ""),
        int(meta.get("world_size") or 0),
        ranks,
        node_exits={row["node_rank"]: records.NodeExit.from_row(row) for row in exits},
        system_samples=system,
        gpu_samples=gpus,
        missing=list(missing),
        **run_records(
            {
                name: json.loads(meta.get(key) or empty)
                for name, (key, empty, _) in META_RECORDS.items()
            }
        ),
    )
