"""The run as the analysis sees it: plain dataclasses, filled by the aggregator's loader.

:func:`traceml_aggregator.load.load` turns the SQLite tables into these; the functions in
:mod:`traceml.analysis` then work on :class:`RunData` alone and never touch the store.

A rank's steps stay columns from the store to the analysis (:class:`StepTable`), as they
travel on the wire: the analysis of a million steps builds no object per step. Samples
(process, system, GPU) load as NumPy columns (:class:`SampleColumns`): a million samples are a
few arrays, not a million dicts.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal, overload

import numpy as np

from traceml.core.phases import STEP_FIELDS
from traceml.core.records import (
    AggregatorLoss,
    AggregatorRestart,
    Finish,
    Flops,
    HangRecord,
    Identity,
    LostNode,
    NodeClock,
    NodeExit,
    RankEnd,
    ScriptWorld,
    SenderCounts,
    StreamEnd,
)

if TYPE_CHECKING:
    from traceml.analysis.digest import RankDigest


@dataclass(frozen=True)
class StepTable:
    """One attempt's steps as columns, in step order (the analysis's table of them; the wire's
    message of the same columns is ``StepColumns``).

    Attributes:
        columns: step field (every name of :data:`STEP_FIELDS`) -> one value per step (µs, or
            bytes for the memory peaks; None where the step did not measure it). The required
            fields (``step``, ``end_us``, ``step_us``) are never None.

    Raises:
        ValueError: a field is missing or unknown, or the columns differ in length.
    """

    columns: Mapping[str, Sequence[int | None]]

    def __post_init__(self) -> None:
        if set(self.columns) != set(STEP_FIELDS):
            raise ValueError(
                f"step columns {sorted(self.columns)} are not the step fields {STEP_FIELDS}"
            )
        lengths = {len(column) for column in self.columns.values()}
        if len(lengths) > 1:
            raise ValueError(f"step columns of different lengths: {sorted(lengths)}")

    @classmethod
    def from_rows(cls, rows: Iterable[Sequence[int | None]]) -> StepTable:
        """Columns of ``rows``, each a tuple of the :data:`STEP_FIELDS` in that order (as the
        store returns them); transposed in C, with no Python code per step."""
        columns = list(zip(*rows, strict=True)) or [()] * len(STEP_FIELDS)
        return cls(dict(zip(STEP_FIELDS, columns, strict=True)))

    @classmethod
    def from_dicts(cls, steps: Iterable[Mapping[str, int | None]]) -> StepTable:
        """Columns of one mapping per step (fields it lacks are None): for hand-built runs."""
        return cls.from_rows(tuple(s.get(name) for name in STEP_FIELDS) for s in steps)

    def __len__(self) -> int:
        return len(self.columns["step"])

    @overload
    def __getitem__(self, name: Literal["step", "end_us", "step_us"]) -> Sequence[int]: ...

    @overload
    def __getitem__(self, name: str) -> Sequence[int | None]: ...

    def __getitem__(self, name: str) -> Sequence[int | None]:
        """The column of step field ``name``.

        Raises:
            KeyError: ``name`` is not a step field.
        """
        return self.columns[name]

    def take(self, positions: Sequence[int]) -> StepTable:
        """The steps at ``positions`` (indices into these columns, ascending), as columns."""
        if len(positions) == len(self):
            return self
        if positions and positions[-1] - positions[0] + 1 == len(positions):
            window = slice(positions[0], positions[-1] + 1)  # contiguous: copy, no lookups
            return StepTable({k: c[window] for k, c in self.columns.items()})
        if not positions:
            return NO_STEPS
        pick = operator.itemgetter(*positions)  # two or more: a tuple, built in C
        return StepTable({k: pick(c) for k, c in self.columns.items()})

    def where(self, name: str, keep: set[int] | frozenset[int]) -> StepTable:
        """The steps whose field ``name`` (usually ``step``) is in ``keep``."""
        return self.take([i for i, v in enumerate(self.columns[name]) if v in keep])


#: No steps (a rank that stored none).
NO_STEPS = StepTable.from_rows(())


@dataclass(frozen=True, eq=False)
class SampleColumns:
    """Samples of one kind (a rank's process samples, a node's system or GPU samples) as NumPy
    columns, one entry per sample, in the order loaded (time order).

    It also reads as a sequence of row dicts (``len``, ``[i]``, iteration, ``[a:b]`` gives
    columns), so code written for a list of dicts keeps working; analysis over many samples
    uses :meth:`column`, :meth:`present`, :meth:`max`, :meth:`take` and :meth:`between`
    instead, which build no object per sample.

    Attributes:
        columns: column name (the store's: ``unix_us``, ``cpu_percent``, ``rss_bytes``, ...)
            -> 1-D array: float64 for numbers (NaN where not measured; integers, µs and bytes,
            are exact below 2**53), object for text (None where absent).
        ints: the columns whose values are integers (a row, and :meth:`max`, give them back as
            ``int``).
    """

    columns: Mapping[str, np.ndarray]
    ints: frozenset[str] = frozenset()

    @classmethod
    def of(cls, samples: SampleColumns | Iterable[Mapping[str, object]]) -> SampleColumns:
        """``samples`` as columns: unchanged when they are, else from one dict per sample
        (hand-built runs, the live windows). A column whose values are all numbers (or None)
        is numeric; an integer one when every present value is an ``int``."""
        if isinstance(samples, SampleColumns):
            return samples
        rows = list(samples)
        names = list(dict.fromkeys(name for row in rows for name in row))
        columns: dict[str, np.ndarray] = {}
        ints: set[str] = set()
        for name in names:
            values = [row.get(name) for row in rows]
            present = [v for v in values if v is not None]
            if all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in present):
                columns[name] = np.array(values, dtype=np.float64)
                if all(isinstance(v, int) for v in present):
                    ints.add(name)
            else:
                columns[name] = np.array(values, dtype=object)
        return cls(columns, frozenset(ints))

    def __len__(self) -> int:
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def __bool__(self) -> bool:
        return len(self) > 0

    @overload
    def __getitem__(self, key: int) -> dict[str, Any]: ...

    @overload
    def __getitem__(self, key: slice) -> SampleColumns: ...

    def __getitem__(self, key: int | slice) -> dict[str, Any] | SampleColumns:
        """Row ``key`` as a dict (None where not measured), or the rows of a slice as columns.

        Raises:
            IndexError: no such row.
        """
        if isinstance(key, slice):
            return self.take(key)
        return self.row(key)

    def __iter__(self) -> Iterator[dict[str, Any]]:
        """One dict per sample (for the few consumers that want rows; costs a dict each): each
        column made Python values at one go (:meth:`_values`), not value by value."""
        names = list(self.columns)
        values = [self._values(name, column) for name, column in self.columns.items()]
        return (dict(zip(names, row, strict=True)) for row in zip(*values, strict=True))

    def row(self, i: int) -> dict[str, Any]:
        """Sample ``i`` (negative counts from the end) as ``{column: value}``.

        Raises:
            IndexError: no such row.
        """
        n = len(self)
        if not -n <= i < n:
            raise IndexError(f"sample {i} of {n}")
        i %= n
        return next(iter(self.take(slice(i, i + 1))))

    def _values(self, name: str, column: np.ndarray) -> list[Any]:
        """Column ``name`` as Python values: a number column's as ``float`` (``int`` for the
        :attr:`ints`), ``None`` where NaN (not measured); a text column's as stored."""
        values: list[Any] = column.tolist()
        if column.dtype != np.float64:
            return values
        missing = np.isnan(column)
        pairs = zip(values, missing.tolist(), strict=True)
        if name in self.ints:
            return [None if gone else int(v) for v, gone in pairs]
        if missing.any():
            return [None if gone else v for v, gone in pairs]
        return values

    def column(self, name: str) -> np.ndarray:
        """The column ``name`` (all NaN, or all None for text, when no sample has it)."""
        column = self.columns.get(name)
        return column if column is not None else np.full(len(self), np.nan)

    def present(self, name: str) -> np.ndarray:
        """The measured values of numeric column ``name`` (NaN left out), float64."""
        column = self.column(name)
        present: np.ndarray = column[~np.isnan(column)]  # numpy types a masked read as Any
        return present

    def max(self, name: str) -> int | float | None:
        """The largest measured value of numeric column ``name`` (``int`` for an integer
        column), None when none was measured."""
        present = self.present(name)
        if not len(present):
            return None
        top = present.max()
        return int(top) if name in self.ints else float(top)

    def last_text(self, name: str) -> str | None:
        """The latest non-empty value of text column ``name``, None when there is none."""
        column = self.columns.get(name)
        if column is None or column.dtype != object:  # absent, or never given (all NaN)
            return None
        filled = np.flatnonzero(np.frompyfunc(bool, 1, 1)(column).astype(bool))
        return str(column[filled[-1]]) if len(filled) else None

    def take(self, index: slice | np.ndarray) -> SampleColumns:
        """The samples at ``index`` (a slice, a boolean mask or positions), as columns."""
        return SampleColumns({k: c[index] for k, c in self.columns.items()}, self.ints)

    def between(self, first_us: int, last_us: int) -> SampleColumns:
        """The samples with ``first_us <= unix_us <= last_us``."""
        t = self.column("unix_us")
        return self.take((t >= first_us) & (t <= last_us))


#: No samples.
NO_SAMPLES = SampleColumns({})


@dataclass
class RankData:
    """One rank (its latest attempt) as stored.

    Its records are those of :mod:`traceml.core.records` (units in their docstrings):
    ``identity``, ``finish``, ``counts``, ``end``, ``flops``, each None when none arrived; its
    process samples have the columns of :class:`~traceml.core.records.ProcessSample`.

    ``steps`` holds the steps of that attempt as :class:`StepTable`, in step order, with the
    step fields of :data:`traceml.core.phases.STEP_FIELDS` (µs, bytes; None when not
    measured): all of them, or, when ``digest`` is set, a uniform sample of them (the same step
    indices on every rank; see :mod:`traceml_aggregator.aggregates`) whose per-rank figures
    come from the digest.
    """

    rank: int
    restart: int = 0
    identity: Identity | None = None
    steps: StepTable = NO_STEPS
    finish: Finish | None = None
    #: The latest running totals the rank's client sent, with the ``seq`` of the batch that
    #: carried them; None when no batch carried them.
    counts: SenderCounts | None = None
    end: RankEnd | None = None  # from the node launcher's report, when any
    #: The attempt's process samples (the store's ``process_samples`` columns), oldest first:
    #: :class:`SampleColumns` as loaded from the store, or a list of row dicts (hand-built
    #: runs, the live windows); :meth:`SampleColumns.of` reads either as columns.
    process_samples: SampleColumns | list[dict[str, Any]] = field(default_factory=list)
    earlier_attempts: dict[int, int] = field(default_factory=dict)  # restart -> steps stored
    #: How the rank counted its model FLOPs, None when it did not.
    flops: Flops | None = None

    #: The attempt's step statistics (:class:`traceml.analysis.digest.RankDigest`) when
    #: ``steps`` is a sample of its steps; None when ``steps`` holds them all.
    digest: RankDigest | None = None

    @property
    def steps_stored(self) -> int:
        """Steps of this attempt stored (exact, sampled series or not)."""
        return self.digest.stored if self.digest is not None else len(self.steps)


@dataclass
class RunData:
    """The whole run: ranks by global rank, node exits and system samples by node rank
    (assembled by :func:`run_data`).

    ``node_exits`` are :class:`~traceml.core.records.NodeExit` records; system and GPU samples
    have the columns of :class:`~traceml.core.records.SystemSample` and
    :class:`~traceml.core.records.GpuSample`. The run's own records (``stall``,
    ``script_world``, ...) are the aggregator's JSON entries read as their records of
    :mod:`traceml.core.records` (``META_RECORDS`` in ``traceml_aggregator/load.py`` lists them).

    ``system_samples`` and ``gpu_samples`` hold each node's samples (oldest first; GPUs by NVML
    index within a time) as :class:`SampleColumns` when loaded from the store, or lists of
    row dicts (see :attr:`RankData.process_samples`).
    """

    run_name: str
    world_size: int
    ranks: dict[int, RankData]
    node_exits: dict[int, NodeExit]
    system_samples: dict[int, SampleColumns | list[dict[str, Any]]]
    gpu_samples: dict[int, SampleColumns | list[dict[str, Any]]]
    missing: list[int]
    #: The aggregator's stall record when ranks stopped making progress (a hang), else None.
    stall: HangRecord | None = None
    #: Node 0's aggregator restarts on this run's store, in order.
    aggregator_restarts: list[AggregatorRestart] = field(default_factory=list)
    #: Node 0's aggregator lost for good (the launcher did not restart it), else None: the
    #: store holds nothing sent after it.
    aggregator_loss: AggregatorLoss | None = None
    #: Nodes the aggregator lost (nothing came from a launcher in time: its session stream
    #: broke, or it stalled; see traceml_aggregator/sessions.py), in order.
    node_losses: list[LostNode] = field(default_factory=list)
    #: Each node's clock offset from node 0's, as its launcher estimated it (by node rank);
    #: empty when no launcher sent one (ranks without a launcher, an older launcher).
    node_clocks: list[NodeClock] = field(default_factory=list)
    #: Calls the aggregator refused, by kind (``unauthenticated``, ``rank_out_of_range``, ...:
    #: see traceml_aggregator/senders.py); empty when none was.
    rejected: dict[str, int] = field(default_factory=dict)
    #: The first refusal's reason of each kind in ``rejected`` (one line each).
    rejected_reasons: dict[str, str] = field(default_factory=dict)
    #: The world the script built itself, when the aggregator took it as the run's; None when
    #: the world is torchrun's.
    script_world: ScriptWorld | None = None
    #: How each sender's latest stream ended (see traceml_aggregator/streams.py), ranks first;
    #: empty when the aggregator recorded none.
    sender_streams: list[StreamEnd] = field(default_factory=list)


def run_data(
    run_name: str,
    world_size: int | None,
    ranks: dict[int, RankData],
    **fields: Any,
) -> RunData:
    """The run of ``ranks`` (rank -> its data, changed in place: filled in), the one way a
    RunData is assembled (the store's loader, the live windows).

    Ranks ``0 .. world size - 1`` all appear (a :class:`RankData` of their own when nothing
    of them arrived), in rank order; the world size is ``world_size``, else (None or 0) the
    largest an identity names, else the ranks known. ``fields`` are RunData's other fields
    (``node_exits``, ``system_samples``, ``gpu_samples``, ``missing``, the run's records).
    """
    world_size = world_size or max(
        [rd.identity.world_size or 0 for rd in ranks.values() if rd.identity] + [len(ranks)]
    )
    for rank in range(world_size):
        ranks.setdefault(rank, RankData(rank))
    return RunData(
        run_name=run_name, world_size=world_size, ranks=dict(sorted(ranks.items())), **fields
    )
