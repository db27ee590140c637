"""Steps as columns on the wire, and the record count of a batch.

A rank's steps travel in ``Batch.step_groups``: one :class:`~traceml.wire.StepColumns` per set
of fields measured, each field a packed column with one entry per step of the group (see
``proto/traceml/wire/v1/step.proto``). Both ends go through this module: the SDK's sender
thread builds the groups with :func:`add_steps`, the aggregator reads them back with
:func:`step_group_columns`. Neither touches a step as a message: a column is filled from a
Python list in one ``extend`` and read back as one sequence, which is what keeps the sender's
CPU per step and the aggregator's CPU per stored step low.
"""

from __future__ import annotations

from typing import Iterable, Mapping, Sequence

#: Fields every step has (a full column in every group), in column order.
STEP_REQUIRED_FIELDS = ("step", "end_us", "step_us")

#: Fields a step may lack (not measured), in column order: µs, or bytes for the peaks.
STEP_OPTIONAL_FIELDS = (
    "input_wait_us",
    "dataloader_next_us",
    "h2d_us",
    "forward_us",
    "backward_us",
    "optimizer_us",
    "gpu_step_us",
    "gpu_h2d_us",
    "gpu_forward_us",
    "gpu_backward_us",
    "gpu_optimizer_us",
    "peak_allocated_bytes",
    "peak_reserved_bytes",
)


def add_steps(batch, steps: Iterable[Mapping[str, int]]) -> None:
    """Append ``steps`` to ``batch.step_groups``, one group per set of fields measured.

    Args:
        batch: a :class:`~traceml.wire.Batch`.
        steps: one mapping per step, field name -> value (µs or bytes), holding the
            :data:`STEP_REQUIRED_FIELDS` and the optional fields that were measured, in the
            order of :data:`STEP_OPTIONAL_FIELDS` (steps whose fields come in another order
            only land in a group of their own).

    Raises:
        ValueError: a value is negative or does not fit 64 bits (protobuf's own error).
    """
    groups: dict[tuple[str, ...], list[tuple[int, ...]]] = {}
    for step in steps:
        names = tuple(step)
        rows = groups.get(names)
        if rows is None:
            rows = groups[names] = []
        rows.append(tuple(step.values()))
    for names, rows in groups.items():
        group = batch.step_groups.add()
        for name, column in zip(names, zip(*rows)):
            getattr(group, name).extend(column)


def step_group_columns(group) -> tuple[tuple[str, ...], list[Sequence[int]]]:
    """The names and columns of the fields measured in ``group`` (a StepColumns).

    Returns:
        ``(names, columns)``: the non-empty columns in field order, each with one entry per
        step of the group (µs or bytes); ``((), [])`` for an empty group.

    Raises:
        ValueError: the group is malformed: a required column is missing, or the columns
            differ in length (the sender's bug; nothing of its batch may be stored).
    """
    fields = group.ListFields()  # the non-empty columns, in field number order
    if not fields:
        return (), []
    names = tuple(fd.name for fd, _ in fields)
    columns = [column for _, column in fields]
    steps = len(group.step)
    lacking = [name for name in STEP_REQUIRED_FIELDS if name not in names]
    uneven = [name for name, column in zip(names, columns) if len(column) != steps]
    if lacking or uneven:
        raise ValueError(
            f"malformed step group: {steps} steps, "
            + (f"no {', '.join(lacking)} column" if lacking else "")
            + ("; " if lacking and uneven else "")
            + (f"columns of another length: {', '.join(uneven)}" if uneven else "")
        )
    return names, columns


def record_count(batch) -> int:
    """Records in ``batch`` (a Batch): steps (the entries of its groups' ``step`` columns),
    process samples and system samples."""
    steps = sum(len(group.step) for group in batch.step_groups)
    return steps + len(batch.process_samples) + len(batch.system_samples)
