"""The run as the analysis sees it: plain dataclasses, filled by the aggregator's loader.

:func:`traceml_aggregator.load.load` turns the SQLite tables into these; the functions in
:mod:`traceml.analysis` then work on :class:`RunData` alone and never touch the store.

A rank's steps stay columns from the store to the analysis (:class:`StepColumns`), as they
travel on the wire: the analysis of a million steps builds no object per step.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from traceml.wire.records import STEP_OPTIONAL_FIELDS, STEP_REQUIRED_FIELDS

if TYPE_CHECKING:
    from traceml.analysis.digest import RankDigest

#: Every step field, in column order: :data:`STEP_REQUIRED_FIELDS`, then the optional ones.
STEP_FIELDS = STEP_REQUIRED_FIELDS + STEP_OPTIONAL_FIELDS


@dataclass(frozen=True)
class StepColumns:
    """One attempt's steps as columns, in step order.

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
    def from_rows(cls, rows: Iterable[Sequence[int | None]]) -> StepColumns:
        """Columns of ``rows``, each a tuple of the :data:`STEP_FIELDS` in that order (as the
        store returns them); transposed in C, with no Python code per step."""
        columns = list(zip(*rows)) or [()] * len(STEP_FIELDS)
        return cls(dict(zip(STEP_FIELDS, columns, strict=True)))

    @classmethod
    def from_dicts(cls, steps: Iterable[Mapping[str, int | None]]) -> StepColumns:
        """Columns of one mapping per step (fields it lacks are None): for hand-built runs."""
        return cls.from_rows(tuple(s.get(name) for name in STEP_FIELDS) for s in steps)

    def __len__(self) -> int:
        return len(self.columns["step"])

    def __getitem__(self, name: str) -> Sequence[int | None]:
        """The column of step field ``name``.

        Raises:
            KeyError: ``name`` is not a step field.
        """
        return self.columns[name]

    def take(self, positions: Sequence[int]) -> StepColumns:
        """The steps at ``positions`` (indices into these columns, ascending), as columns."""
        if len(positions) == len(self):
            return self
        if positions and positions[-1] - positions[0] + 1 == len(positions):
            window = slice(positions[0], positions[-1] + 1)  # contiguous: copy, no lookups
            return StepColumns({k: c[window] for k, c in self.columns.items()})
        if not positions:
            return NO_STEPS
        pick = operator.itemgetter(*positions)  # two or more: a tuple, built in C
        return StepColumns({k: pick(c) for k, c in self.columns.items()})

    def where(self, name: str, keep: set[int] | frozenset[int]) -> StepColumns:
        """The steps whose field ``name`` (usually ``step``) is in ``keep``."""
        return self.take([i for i, v in enumerate(self.columns[name]) if v in keep])


#: No steps (a rank that stored none).
NO_STEPS = StepColumns.from_rows(())


@dataclass
class RankData:
    """One rank (its latest attempt) as stored.

    ``steps`` holds the steps of that attempt as :class:`StepColumns`, in step order, with the
    step fields of :mod:`traceml.wire.records` (µs, bytes; None when not measured): all of
    them, or, when ``digest`` is set, a uniform sample of them (the same step indices on every
    rank; see :mod:`traceml_aggregator.aggregates`) whose per-rank figures come from the digest.
    """

    rank: int
    restart: int = 0
    identity: dict | None = None
    steps: StepColumns = NO_STEPS
    finish: dict | None = None
    #: The latest running totals the rank's client sent (``records_produced``,
    #: ``records_dropped``, ``steps_produced``, ``steps_dropped``; see ``SenderCounts`` in
    #: ``proto/traceml/wire/v1/finish.proto``), with the ``seq`` of the batch that carried
    #: them; None when no batch carried them.
    counts: dict | None = None
    end: dict | None = None  # from the node launcher's report, when any
    process_samples: list[dict] = field(default_factory=list)
    earlier_attempts: dict[int, int] = field(default_factory=dict)  # restart -> steps stored
    #: How the rank counted its model FLOPs (``rank_flops`` row: step, forward_flops,
    #: count_us, dtype, device_name, peak_tflops), None when it did not.
    flops: dict | None = None

    #: The attempt's step statistics (:class:`traceml.analysis.digest.RankDigest`) when
    #: ``steps`` is a sample of its steps; None when ``steps`` holds them all.
    digest: RankDigest | None = None

    @property
    def steps_stored(self) -> int:
        """Steps of this attempt stored (exact, sampled series or not)."""
        return self.digest.stored if self.digest is not None else len(self.steps)


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
    #: Nodes the aggregator lost (a launcher's session stream broke and did not come back in
    #: time; see traceml_aggregator/sessions.py), in order: ``{"node_rank": int, "hostname":
    #: str | None, "last_heard_unix_s", "lost_unix_s", "resumed_unix_s" (None: never came
    #: back), "lost_after_s"}`` (times: Unix s; ``lost_after_s``: the bound, s).
    node_losses: list[dict] = field(default_factory=list)
    #: Calls the aggregator refused, by kind (``unauthenticated``, ``rank_out_of_range``, ...:
    #: see traceml_aggregator/senders.py); empty when none was.
    rejected: dict[str, int] = field(default_factory=dict)
    #: How each sender's latest stream ended (see traceml_aggregator/streams.py for the
    #: fields), ranks first; empty when the aggregator recorded none.
    sender_streams: list[dict] = field(default_factory=list)
