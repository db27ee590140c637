"""Checkpoints of the live aggregates, so that a replacement aggregator starts from the latest
one instead of replaying every stored step.

What a restart needs of the live aggregates (:class:`~traceml_aggregator.live.LiveAggregates`)
is of two kinds:

* O(ranks + nodes), read whole from the store's small tables at every start: identities,
  finish markers, the nodes' and ranks' ends;
* O(the run's length) to rebuild, so checkpointed: each rank's steps (its
  :class:`~traceml_aggregator.aggregates.StepState`: window, series, digest; its step count,
  latest step, earlier attempts) and the sample windows (each rank attempt's latest
  :data:`~traceml_aggregator.live.analysis_process.WINDOW_SAMPLES` process samples, each node's
  latest system and GPU samples, in time order), and each group's bounded series of its
  samples (:class:`~traceml_aggregator.sample_series.SampleSeries`: what the final summary's
  sample figures are taken from, so a finalization reads no sample row the checkpoint covers).

A checkpoint holds the second kind with, for each part, the store's rowid up to which it covers
its table: each rank's steps in a row of its own (``live_checkpoint_ranks``: its mark and its
state), the sample windows and series, with the mark below which every rank's steps are in its
row, in one :class:`Checkpoint` (the ``live_checkpoint`` row). The rows of an SQLite table
without an ``INTEGER PRIMARY KEY`` get increasing rowids as they are inserted (nothing vacuums
the store during a run, and the retention's prune, :mod:`traceml_aggregator.retention`, deletes
only rows at or below a committed checkpoint's mark, never the highest one), so "the rows stored
after the checkpoint" is the rowid range above its mark: a range scan of the table's b-tree,
O(those rows). A replacement loads the checkpoint (:meth:`LiveAggregates.restore`) and folds in
only those rows, while it serves (:meth:`LiveAggregates.catch_up`); with no checkpoint (a new
store, one an older TraceML wrote, or one this version cannot read) it folds in every row, which
is the full replay, and the two give the same aggregates (tests/test_checkpoint.py).

Where it is kept: rows of the store, each replaced in a transaction of its own, so a SIGKILL
at any moment leaves each one old or new, whole, in the same file as the rows it covers; a
checkpoint names rowids of rows that were committed before it, so it is never ahead of the
store. The ranks' rows go first (:meth:`~traceml_aggregator.store.Store.
write_live_checkpoint_ranks`, a slice of ranks at a time), then the ``live_checkpoint`` row
(:meth:`~traceml_aggregator.store.Store.write_live_checkpoint`) whose ``steps_from`` says that
they are all in: a kill between them leaves the previous ``steps_from`` with some ranks' rows
newer, each still exact up to its own mark, which is all a restart reads of it. An atomic file
beside the store would need its own fsync ordering against the WAL and could outlive a store
that was replaced; a row cannot.

How it is taken (:meth:`Checkpointer.write`), every ``TRACEML_AGGREGATOR_CHECKPOINT_SEC``
(further apart where checkpoints would take more than :data:`CHECKPOINT_MAX_PCT` of the
time, at most :data:`CHECKPOINT_MAX_INTERVALS` intervals) and at a clean stop:

* the ranks' steps come from the live aggregates, pickled on the event loop and written on
  the writer thread :data:`SNAPSHOT_SLICE_RANKS` ranks at a time, so what is held at once is
  one slice's copies (~3 MB), not every rank's (~99 MB at 1,024 ranks), and nothing of them
  is kept between checkpoints. The writer folds each transaction's batches into the live
  aggregates at one go after its commit and notes the transaction's highest ``steps`` rowid
  (:attr:`Writer.steps_rowid_seen`), so a rank's copy covers exactly the step rows at or below
  the mark noted when it was copied. A rank whose step count and attempt did not move since
  its row was written is not written again (a finished rank costs nothing). A rank's final
  series (its digest and sample: :class:`~traceml_aggregator.aggregates.StepState`) changes
  only as a chunk of :data:`~traceml_aggregator.aggregates.FOLD_STEPS` steps is folded in,
  so it is a row of its own (``live_checkpoint_series``: the rank's attempt, the chunks
  folded, the series), written in the same transaction as the rank's row when it changed
  since its last row; the rank's row names it by those two numbers, and a restart that
  finds another series beside a row replays every step. In steady state (a checkpoint
  interval of 30 steps a rank) that is 0.44 times the CPU and 0.65 times the bytes of a
  checkpoint that pickled each rank's series again every time, at an 8,000-rank world's
  series bound, and 0.24 and 0.35 times at 64 ranks' (``benchmarks/checkpoint_cost.py``).
  A rank's window (its latest steps, up to 512) is in rows of its own too
  (``live_checkpoint_window``: spans of the attempt's steps, each ending where the next
  begins): a checkpoint adds a row of the steps the rank stored since its last one and
  deletes the rows the window no longer reaches, and writes the window whole, in one row,
  once it is in :data:`WINDOW_ROWS` rows, or for a new attempt; the rank's row names the
  window's fields and steps, and a restart that finds fewer steps in the rows that chain
  back from the rank's latest one replays every step. In steady state that is 0.66 times
  the CPU and 0.22 times the bytes of a checkpoint that wrote each window whole every time
  (113 against 171 µs, 6.5 against 29.5 KiB a rank, at 30 steps a rank between two), for a
  restart's read of a rank's rows ~1.2 times as long (~0.50 against ~0.41 ms);
* the sample windows and series are kept here, from the store: each checkpoint reads the
  sample rows stored since the previous one (on the writer thread, O(those rows)) into them,
  the same way a restart and a finalization do.

Cost (the 2-core machine, quiet): a checkpoint in steady state takes ~0.11 ms of CPU (the
loop's pickling and the writer thread's SQLite) and ~6.5 KiB of the store per rank that moved,
on average over :data:`WINDOW_ROWS` checkpoints, the first ~0.4 ms and ~46 KiB (every series
and window written whole; ``benchmarks/checkpoint_cost.py``: 1,024 ranks of an 8,000-rank
world, 2,048 steps each, then 30 a checkpoint, the means of 16); the store holds ~97 KB a rank
in all after a whole write (98.8 MiB at 1,024 ranks of a 1,024-rank world,
``benchmarks/restart.py``), up to :data:`WINDOW_ROWS` - 1 spans of steps more between two; a
restart unpickles the rows, a rank at a time, at about the cost of its first checkpoint a
rank and folds the steps stored after it, about ``checkpoint interval x steps stored per
second`` of them. So
a restart is O(ranks), not O(the run): at 64 ranks 2.8 s to serving at 10 M stored steps
(against 273-381 s of replay); at 1,024 ranks 0.96 s at 10 M stored steps (median of 3,
``--simulate``), most of it unpickling the ranks' windows and digests. Since the windows are
packed int64 columns (checkpoint version 4) a rank's state pickles and unpickles in about
half the time it took as one deque of Python ints per field (in-process: 133 against 260 µs,
401 against 871 µs), and takes more room (pickled small ints are 2-5 bytes: 63.9 MiB at
1,024 ranks before, serving in 1.20 s; docs/distributed-training.md). The sample series are
pickled as a few arrays per table, not per group.

The state is pickled; :func:`loads` unpickles only the classes a checkpoint holds (the
aggregates' own, NumPy arrays, ``array.array``, deques), so a crafted store cannot make the
aggregator run code.
"""

from __future__ import annotations

import asyncio
import copyreg
import io
import operator
import pickle
import sys
import time
from array import array
from dataclasses import dataclass, field

import numpy as np

from traceml.analysis.rundata import RunData, SampleColumns
from traceml.core import log
from traceml.core.records import GpuSample, ProcessSample, Record, SystemSample
from traceml_aggregator.aggregates import StepState
from traceml_aggregator.live.analysis_process import WINDOW_GPU_SAMPLES, WINDOW_SAMPLES
from traceml_aggregator.load import sample_groups
from traceml_aggregator.sample_series import SampleSeries, pack, unpack
from traceml_aggregator.store import STORE_INT_MAX

_log = log.get("aggregator")

#: Layout of :class:`Checkpoint` and the ranks' rows; a checkpoint of another version is not
#: read (full replay). 3: the ranks' states in rows of their own (2 held them in the one row);
#: 4: their windows in packed columns (3 held one deque of Python ints per step field); 5: a
#: digest's sketches as plain bytes (4 pickled their NumPy arrays); 6: each rank's series (its
#: digest and sample) in a row of its own, written only when it changed (5 held it in the
#: rank's row, pickled again at every checkpoint); 7: each rank's window in rows of its own, a
#: span of the steps since the last checkpoint at a time (6 held the whole window in the rank's
#: row, pickled again at every checkpoint).
CHECKPOINT_VERSION = 7
#: Most rows a rank's checkpointed window is written in since it was last written whole: past
#: this the next checkpoint writes it whole again (one row), so a restart reads at most this
#: many rows a rank, and a checkpoint writes on average ~1/this of a window a rank beside the
#: steps since the last one.
WINDOW_ROWS = 8
#: Ranks copied between two returns to the event loop while a checkpoint is taken, and written
#: in one transaction (at ~0.5 ms and ~97 KB a rank, ~16 ms of the loop and ~3 MB at a time).
SNAPSHOT_SLICE_RANKS = 32
#: The most of the aggregator's wall time its periodic checkpoints take, %. A checkpoint costs
#: O(the ranks that moved since the last one) (~0.11 ms of CPU a rank in steady state, quiet:
#: the module docstring), so at 8,000 ranks one every 30 s takes ~3 % of the one core that
#: also ingests, more on a slower or busier core; past this the checkpoints are spaced out
#: instead (:func:`next_checkpoint_in`), and a restart folds in that many more seconds of
#: steps.
CHECKPOINT_MAX_PCT = 5.0
#: The longest gap between two periodic checkpoints, in checkpoint intervals: a stall of the
#: disk or the writer under one checkpoint does not put off the next (and the retention's
#: prune, and a restart's catch-up) for longer.
CHECKPOINT_MAX_INTERVALS = 10
#: The sample windows: the sample record (:mod:`traceml.core.records`: its table, grouped and
#: ordered as :func:`~traceml_aggregator.load.sample_groups` reads it), and the latest samples
#: kept per group (what :meth:`LiveAggregates.seed` seeds the windows with).
SAMPLE_WINDOWS = (
    (ProcessSample, WINDOW_SAMPLES),
    (SystemSample, WINDOW_SAMPLES),
    (GpuSample, WINDOW_GPU_SAMPLES),
)

#: The globals a checkpoint may name (module, name): see :func:`loads`.
_ALLOWED = frozenset(
    {
        ("array", "array"),
        ("array", "_array_reconstructor"),
        ("collections", "deque"),
        ("numpy", "dtype"),
        ("numpy", "ndarray"),
        ("numpy._core.numeric", "_frombuffer"),
        ("numpy.core.numeric", "_frombuffer"),
        ("numpy._core.multiarray", "_reconstruct"),
        ("numpy.core.multiarray", "_reconstruct"),
        ("traceml_aggregator.aggregates", "StepState"),
        ("traceml_aggregator.aggregates", "_Series"),
        ("traceml.analysis.digest", "RankDigest"),
        ("traceml.analysis.digest", "LogHistogram"),
        ("traceml.analysis.digest", "_Clock"),
        ("traceml_aggregator.checkpoint", "Checkpoint"),
    }
)


def next_checkpoint_in(interval_s: float, took_s: float) -> float:
    """Seconds from the end of a checkpoint that took ``took_s`` s (wall time) to the start of
    the next: ``interval_s`` (``TRACEML_AGGREGATOR_CHECKPOINT_SEC``), or longer where checkpoints
    would otherwise take more than :data:`CHECKPOINT_MAX_PCT` of the time, at most
    :data:`CHECKPOINT_MAX_INTERVALS` intervals."""
    spaced_s = max(interval_s, took_s * 100 / CHECKPOINT_MAX_PCT - took_s)
    return min(spaced_s, CHECKPOINT_MAX_INTERVALS * interval_s)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str):
        if (module, name) not in _ALLOWED:
            raise pickle.UnpicklingError(f"a checkpoint does not hold {module}.{name}")
        return super().find_class(module, name)


#: How a rank's row pickles (a copy of :mod:`copyreg`'s, the pickler's default): its steps
#: without their series and window (:meth:`~traceml_aggregator.aggregates.StepState.
#: reduce_to_row`).
_RANK_ROW_REDUCERS = copyreg.dispatch_table | {StepState: StepState.reduce_to_row}


def _rank_row(part: tuple) -> bytes:
    """A rank's row: its :meth:`~traceml_aggregator.live.windows.RankLive.steps_part`, pickled
    without its steps' series and window (rows of their own)."""
    data = io.BytesIO()
    pickler = pickle.Pickler(data, 5)
    pickler.dispatch_table = _RANK_ROW_REDUCERS
    pickler.dump(part)
    return data.getvalue()


def loads(data: bytes):
    """Unpickle ``data`` written by this module, allowing no class but those a checkpoint
    holds.

    Raises:
        pickle.UnpicklingError: ``data`` names another class, or is not a pickle.
        Exception: whatever unpickling corrupt data raises (EOFError, ValueError, ...).
    """
    return _Unpickler(io.BytesIO(data)).load()


@dataclass
class Checkpoint:
    """The live aggregates' part that grows with the run but the ranks' steps (those are rows
    of their own: :func:`read_ranks`), and the rowids it covers (see the module docstring). An
    empty one (the default) covers nothing: seeding from it replays the whole store.

    Attributes:
        steps_from: every rank with a ``steps`` row at or below this rowid has a row in
            ``live_checkpoint_ranks``; rows above it are folded at a restart, each rank's from
            its own row's mark. 0: no rank's row is read (a full replay).
        windows: sample table -> (the rowid its windows cover, key -> the latest samples as
            row dicts, in time order); keys are the values of the record's ``GROUP`` columns
            (``(rank, restart)`` or ``(node_rank,)``).
        series: sample table -> key -> the group's :class:`SampleSeries`, covering the table
            up to the same rowid as ``windows``.
    """

    steps_from: int = 0
    windows: dict[str, tuple[int, dict[tuple, list[dict]]]] = field(default_factory=dict)
    series: dict[str, dict[tuple, SampleSeries]] = field(default_factory=dict)
    version: int = CHECKPOINT_VERSION

    def __getstate__(self) -> dict:
        """Pickled with each table's series packed (:func:`~traceml_aggregator.
        sample_series.pack`)."""
        state = dict(self.__dict__)
        state["series"] = {table: pack(groups) for table, groups in self.series.items()}
        return state

    def __setstate__(self, state: dict) -> None:
        series = state.get("series", {})
        self.__dict__.update(state)
        self.series = {table: unpack(packed) for table, packed in series.items()}

    def advance_windows(self, store) -> None:
        """Fold the sample rows stored since :attr:`windows` covered their tables into the
        windows and the series (on the thread that owns ``store``); O(those rows)."""
        for record, keep in SAMPLE_WINDOWS:
            table = record.TABLE
            mark, windows = self.windows.get(table, (0, {}))
            series = self.series.setdefault(table, {})
            top = store.max_rowid(table)
            if top > mark:
                by_time = operator.itemgetter(*record.ORDER)
                for key, columns in sample_groups(store, record, after_rowid=mark):
                    series.setdefault(key, SampleSeries()).fold(columns)
                    new = list(columns[-keep:])
                    old = windows.get(key)
                    # Stored earlier, so first among equal times, as in a full read.
                    windows[key] = sorted(old + new, key=by_time)[-keep:] if old else new
            self.windows[table] = (top, windows)

    def window(self, table: str, key: tuple) -> list[dict]:
        """The latest samples of ``key`` in ``table`` (row dicts in time order; [] if none)."""
        return self.windows.get(table, (0, {}))[1].get(key, [])

    def samples(self, record: type[Record], key: tuple) -> SampleColumns:
        """The series of ``key`` among ``record``'s samples as :class:`SampleColumns` in time
        order (empty if none): what the final summary reads of that group."""
        series = self.series.get(record.TABLE, {}).get(key) or SampleSeries()
        return series.samples(record.ORDER)

    def series_times(self) -> dict[str, tuple[int, dict[tuple, np.ndarray]]]:
        """Each sample table's mark (the rowid its windows and series cover it up to) and,
        per group, the ``unix_us`` of the rows its series holds (float64; the arrays are
        never changed in place, a fold replaces them): what the retention's prune of the
        sample rows keeps (:class:`~traceml_aggregator.retention.SamplePruner`); O(groups)."""
        empty = np.empty(0, dtype=np.float64)
        out = {}
        for record, _ in SAMPLE_WINDOWS:
            table = record.TABLE
            groups = self.series.get(table, {})
            out[table] = (
                self.windows.get(table, (0, {}))[0],
                {key: s.columns.get("unix_us", empty) for key, s in groups.items()},
            )
        return out

    def keys(self, table: str) -> list[tuple]:
        """The keys ``table``'s windows hold."""
        return list(self.windows.get(table, (0, {}))[1])

    def sampled_ranks(self) -> set[int]:
        """The ranks with process samples (of any attempt)."""
        return {r for r, _ in self.keys(ProcessSample.TABLE)}

    def with_samples(self, run: RunData) -> RunData:
        """``run``, loaded without samples (:func:`~traceml_aggregator.load.load` with
        ``samples=False, sampled_ranks=self.sampled_ranks()``), with the series as its samples:
        each rank's latest attempt's process samples, each node's system and GPU samples (see
        :mod:`~traceml_aggregator.sample_series`); O(ranks + nodes), whatever the run's
        length. Returns ``run``."""
        for rank, restart in self.keys(ProcessSample.TABLE):
            rd = run.ranks.get(rank)
            if rd is not None and restart == rd.restart:
                rd.process_samples = self.samples(ProcessSample, (rank, restart))
        run.system_samples = {
            n: self.samples(SystemSample, (n,)) for (n,) in sorted(self.keys(SystemSample.TABLE))
        }
        run.gpu_samples = {
            n: self.samples(GpuSample, (n,)) for (n,) in sorted(self.keys(GpuSample.TABLE))
        }
        return run


def read_ranks(store) -> dict[int, tuple[int, tuple]]:
    """Each checkpointed rank's ``(mark, state)``: the ``steps`` rowid its state covers, and
    the state (:meth:`~traceml_aggregator.live.windows.RankLive.steps_part`), unpickled one row
    at a time.

    Raises:
        Exception: what :func:`loads` raises for a row that cannot be read.
    """
    ranks = {}
    for rank, mark, state, attempt, _, series in store.live_checkpoint_ranks():
        part = loads(state)
        if part[1] is not None:  # its steps, which wait for their series and window
            if series is None or attempt != part[0]:
                raise ValueError(f"rank {rank}'s series row is not its attempt {part[0]}'s")
            part[1].attach_series(loads(series))
            part[1].attach_window(_window_spans(store.live_checkpoint_window(rank), part))
        ranks[rank] = (mark, part)
    return ranks


def _window_spans(rows: list[tuple], part: tuple) -> list[tuple[int, dict]]:
    """The spans of a rank's window rows (``(upto, attempt, steps, columns)`` by ``upto``)
    that its state ``part`` (:meth:`~traceml_aggregator.live.windows.RankLive.steps_part`,
    unpickled) needs: from the latest back, each ending where the next one begins, until they
    hold its window's steps, oldest first.

    Raises:
        ValueError: a row of another attempt, or one that does not end where the next one
            begins (a row missing).
    """
    attempt, stored, size = part[0], part[2], part[1].columns[1]
    spans: list[tuple[int, dict]] = []
    held = 0
    for upto, row_attempt, steps, columns in reversed(rows):
        if held >= size:
            break
        if row_attempt != attempt or upto != stored - held:
            raise ValueError(
                f"a rank's window row of attempt {row_attempt} ending at step {upto}, not one "
                f"of attempt {attempt} ending at {stored - held}"
            )
        spans.append((steps, _window_columns(columns, steps)))
        held += steps
    return spans[::-1]


def _window_row_columns(columns: dict[str, array]) -> bytes:
    """A window row's columns (field -> packed int64, one length): the fields' names and their
    values, one field after the other, little-endian, pickled as a tuple of builtins (a
    pickled dict of arrays named a class per field, each looked up in the allow-list of
    :func:`loads`: most of what a restart spent on a rank's window rows)."""
    packed = array("q")
    for column in columns.values():
        packed.extend(column)
    if sys.byteorder == "big":
        packed.byteswap()
    return pickle.dumps((tuple(columns), packed.tobytes()), 5)


def _window_columns(data: bytes, steps: int) -> dict[str, array]:
    """The columns of a window row of ``steps`` steps (:func:`_window_row_columns`).

    Raises:
        ValueError: its values are not ``steps`` a field.
        Exception: what :func:`loads` raises for a row that cannot be read.
    """
    names, values = loads(data)
    packed = array("q")
    packed.frombytes(values)
    if sys.byteorder == "big":
        packed.byteswap()
    if len(packed) != steps * len(names):
        raise ValueError(f"a rank's window row of {steps} steps holds {len(packed)} values")
    return {name: packed[i * steps : (i + 1) * steps] for i, name in enumerate(names)}


def read(store) -> Checkpoint:
    """The store's latest checkpoint; an empty one (a full replay) when there is none, or
    when it cannot be read (another version of TraceML wrote it, it is corrupt: said)."""
    data = store.live_checkpoint()
    if data is None:
        return Checkpoint()
    try:
        checkpoint = loads(data)
        if not isinstance(checkpoint, Checkpoint) or checkpoint.version != CHECKPOINT_VERSION:
            raise ValueError(f"layout {getattr(checkpoint, 'version', '?')}")
    except Exception as exc:
        _log.warning(
            f"cannot read the live aggregates' checkpoint ({type(exc).__name__}: {exc}): "
            "replaying every stored step"
        )
        return Checkpoint()
    return checkpoint


class Checkpointer:
    """Takes the checkpoints of one aggregator (see the module docstring).

    Args:
        checkpoint: the one the aggregates were seeded from, its windows advanced to the
            store as it was then (:meth:`LiveAggregates.seed` does it).
        live: the live aggregates (their ``ranks``: rank -> RankLive).
        writer: the store's writer (its thread writes; its ``steps_rowid_seen`` marks).
    """

    def __init__(self, checkpoint: Checkpoint, live, writer) -> None:
        self.checkpoint = checkpoint
        self.live = live
        self.writer = writer
        #: rank -> (attempt, steps stored, its window's rows since it was written whole) when
        #: its row was written, set once that row committed: a write cancelled (a stop)
        #: before then leaves the rank to the next one.
        self._row_of: dict[int, tuple[int, int, int]] = {}
        #: rank -> (attempt, series.folds) of its series row, set once it committed.
        self._series_of: dict[int, tuple[int, int]] = {}
        #: Checkpoints written, and the bytes the last one wrote (its ranks' rows and its row).
        self.written = 0
        #: The ``steps_from`` of the latest checkpoint committed (0: none yet).
        self.committed_from = 0
        #: The latest committed checkpoint's :meth:`Checkpoint.series_times` (sample table ->
        #: its mark, and each group's series' sample times; {}: none yet).
        self.committed_samples: dict[str, tuple[int, dict[tuple, np.ndarray]]] = {}
        self.last_bytes = 0
        #: Seconds from the end of the latest periodic checkpoint to the start of the next
        #: (:func:`next_checkpoint_in`; None before the first).
        self.next_in_s: float | None = None

    async def _write_ranks(self) -> tuple[int, int]:
        """Write the rows of the ranks that moved since their rows were written, with the
        span of their windows since (:meth:`_window_row`), and the series rows of those
        whose series changed (a chunk folded in), a slice at a time (pickled on the loop,
        written on the writer thread), once a replacement's catch-up is over (before, the
        aggregates lack steps below the mark); returns (the mark every rank's row now covers
        its steps up to, bytes written)."""
        await self.live.caught_up()
        steps_from = self.writer.steps_rowid_seen
        ranks = list(self.live.ranks.items())
        written = 0
        for first in range(0, len(ranks), SNAPSHOT_SLICE_RANKS):
            rows, series_rows, windows, dropped = [], [], [], []
            moved, series_moved = {}, {}
            for r, rl in ranks[first : first + SNAPSHOT_SLICE_RANKS]:
                before = self._row_of.get(r)
                if before is not None and before[:2] == (rl.restart, rl.steps_stored):
                    continue  # no step stored since: its rows hold
                rows.append((r, self.writer.steps_rowid_seen, _rank_row(rl.steps_part())))
                spans, drop, window = self._window_row(rl, before)
                dropped.append(drop)
                if window is not None:
                    windows.append(window)
                key = (rl.restart, rl.steps.series.folds)
                if self._series_of.get(r) != key:
                    series_moved[r] = key
                    series_rows.append((r, *key, pickle.dumps(rl.steps.series, 5)))
                moved[r] = (rl.restart, rl.steps_stored, spans)
            if rows:
                await self.writer.call(
                    self.writer.store.write_live_checkpoint_ranks,
                    rows,
                    series_rows,
                    windows,
                    dropped,
                )
                self._row_of.update(moved)
                self._series_of.update(series_moved)
                written += sum(len(row[2]) for row in rows)
                written += sum(len(row[3]) for row in series_rows)
                written += sum(len(row[4]) for row in windows)
            else:
                await asyncio.sleep(0)
        return steps_from, written

    @staticmethod
    def _window_row(
        rl, before: tuple[int, int, int] | None
    ) -> tuple[int, tuple[int, int, int], tuple | None]:
        """What a checkpoint writes of the window of ``rl`` (a RankLive that moved; ``before``:
        its attempt, steps stored and window rows when its row was last written, None if never
        by this aggregator): ``(its window's rows after, the rows to delete (the store's
        ``dropped``), the row to add (None: no step to add))``. The steps stored since
        ``before`` in a row of their own, the rows that end before the window deleted, and
        any that ends within the new row's steps (a checkpoint cancelled after its rows
        committed: its row is superseded); the whole window in one row, every earlier row
        deleted, where ``before`` is of another attempt or none, the steps since fill the
        window, or the window is in :data:`WINDOW_ROWS` rows already."""
        steps, stored, size = rl.steps, rl.steps_stored, rl.steps.size
        new = stored - before[1] if before is not None and before[0] == rl.restart else size
        if new >= size or before is None or before[2] >= WINDOW_ROWS:
            spans, new, dropped = 1, size, (rl.rank, STORE_INT_MAX, STORE_INT_MAX)
        else:
            spans, dropped = before[2] + 1, (rl.rank, stored - size, stored - new)
        if not new:
            return spans, dropped, None
        columns = _window_row_columns(steps.window_tail(new))
        return spans, dropped, (rl.rank, stored, rl.restart, new, columns)

    async def write(self) -> None:
        """Take a checkpoint and store it: the ranks' rows, then the sample windows advanced
        and the checkpoint's row replaced on the writer thread, in one call (no transaction
        of batches in between).

        Raises:
            sqlite3.Error: the store could not take it (the previous ``steps_from`` stays).
        """
        steps_from, rank_bytes = await self._write_ranks()
        row_bytes, samples = await self.writer.call(self._store, steps_from)
        self.last_bytes = rank_bytes + row_bytes
        self.written += 1
        first_with_steps = steps_from > 0 and self.committed_from == 0
        self.committed_from, self.committed_samples = steps_from, samples
        if self.written == 1 or first_with_steps:  # then silent: one every interval
            _log.info(
                f"live aggregates checkpointed ({self.last_bytes} bytes, "
                f"{len(self._row_of)} ranks, the steps stored up to row {steps_from})"
            )

    def _store(self, steps_from: int) -> tuple[int, dict]:
        checkpoint = self.checkpoint
        checkpoint.advance_windows(self.writer.store)
        checkpoint.steps_from = steps_from
        data = pickle.dumps(checkpoint, 5)
        self.writer.store.write_live_checkpoint(data, time.time_ns() // 1000)
        return len(data), checkpoint.series_times()  # as committed

    async def run(self, interval_s: float) -> None:
        """Write a checkpoint every ``interval_s`` s, or less often where they would take more
        than :data:`CHECKPOINT_MAX_PCT` of the time (said when they begin to be spaced out);
        a failed one is said and tried again at the next (a restart then folds in more steps,
        nothing is lost)."""
        wait_s = interval_s
        while True:
            await asyncio.sleep(wait_s)
            await self.live.caught_up()  # a replacement's catch-up is no checkpoint's cost
            started = time.monotonic()
            try:
                await self.write()
            except Exception as exc:
                _log.warning(f"cannot store the live aggregates' checkpoint: {exc}")
            took_s = time.monotonic() - started
            wait_s = next_checkpoint_in(interval_s, took_s)
            if wait_s > interval_s and (self.next_in_s or 0) <= interval_s:
                _log.info(
                    f"a checkpoint of the live aggregates took {took_s:.1f} s: the next ones "
                    f"{wait_s:.0f} s apart, not {interval_s:g} s (at most "
                    f"{CHECKPOINT_MAX_PCT:g} % of the time)"
                )
            self.next_in_s = wait_s
