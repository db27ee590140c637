"""Steps as columns on the wire, and the record count of a batch.

A rank's steps travel in ``Batch.step_groups``: one :class:`~traceml.wire.StepColumns` per set
of fields measured, each field a packed column with one entry per step of the group (see
``proto/traceml/wire/v1/step.proto``). Both ends go through this module: the SDK's sender
thread builds the groups with :func:`add_steps`, the aggregator reads them back with
:func:`~traceml.core.records.step_group_columns` (the record model's, re-exported here).
Neither touches a step as a message: a column is filled from a Python list in one ``extend``
and read back as one sequence, which is what keeps the sender's CPU per step and the
aggregator's CPU per stored step low.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from traceml.core import phases
from traceml.core.records import step_group_columns

__all__ = ["add_steps", "record_count", "step_group_columns"]

#: Position of each step field in the canonical order (:data:`traceml.core.phases.STEP_FIELDS`).
_FIELD_RANK = {name: i for i, name in enumerate(phases.STEP_FIELDS)}


def add_steps(batch, steps: Iterable[Mapping[str, int]]) -> None:
    """Append ``steps`` to ``batch.step_groups``, one group per set of fields measured.

    The order contract: steps with the same fields measured land in one group, whatever order
    their mappings list the fields in. The SDK builds every step in the canonical order
    (:data:`traceml.core.phases.STEP_FIELDS`; :meth:`traceml.sdk.step.StepMeasurement.fields`),
    which is the fast path: one dict look-up per step, as cheap as grouping by the order as
    given. A step in another order has its values put in the canonical order and joins the
    same group; how a step's fields are ordered is worked out once per distinct order in a
    call, not once per step.

    Args:
        batch: a :class:`~traceml.wire.Batch`.
        steps: one mapping per step, field name -> value (µs or bytes), holding the
            :data:`traceml.core.phases.STEP_REQUIRED_FIELDS` and the optional fields that were
            measured.

    Raises:
        ValueError: a field is not a step field, or a value is negative or does not fit 64
            bits (protobuf's own error).
    """
    groups: dict[tuple[str, ...], list[tuple[int, ...]]] = {}  # canonical names -> rows
    appenders: dict[tuple[str, ...], list | _Reordered] = {}  # names as a step lists them -> ...
    for step in steps:
        names = tuple(step)
        rows = appenders.get(names)
        if rows is None:
            rows = appenders[names] = _appender(names, groups)
        rows.append(tuple(step.values()))
    for names, rows in groups.items():
        group = batch.step_groups.add()
        for name, column in zip(names, zip(*rows, strict=True), strict=True):
            getattr(group, name).extend(column)


class _Reordered:
    """Appends the values of a step whose fields come in another order to its group's rows,
    in the canonical order (``order``: the index of each canonical field in the step's)."""

    __slots__ = ("rows", "order")

    def __init__(self, rows: list, order: tuple[int, ...]) -> None:
        self.rows = rows
        self.order = order

    def append(self, values: tuple[int, ...]) -> None:
        self.rows.append(tuple(map(values.__getitem__, self.order)))


def _appender(names: tuple[str, ...], groups: dict) -> list | _Reordered:
    """Where the values of a step with fields ``names`` go: the rows of its group in
    ``groups`` (made if new) when ``names`` is in the canonical order, else a
    :class:`_Reordered` in front of them.

    Raises:
        ValueError: a name is not a step field.
    """
    unknown = [name for name in names if name not in _FIELD_RANK]
    if unknown:
        raise ValueError(f"not a step field: {', '.join(unknown)}")
    canonical = tuple(sorted(names, key=_FIELD_RANK.__getitem__))
    rows = groups.setdefault(canonical, [])
    return rows if canonical == names else _Reordered(rows, tuple(map(names.index, canonical)))


def record_count(batch) -> int:
    """Records in ``batch`` (a Batch): steps (the entries of its groups' ``step`` columns),
    process samples, system samples and FLOPs counts."""
    steps = sum(len(group.step) for group in batch.step_groups)
    return steps + len(batch.process_samples) + len(batch.system_samples) + len(batch.flops_counts)
