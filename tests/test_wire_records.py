"""Steps as columns on the wire (``traceml.wire.records``): what the SDK's sender puts in a
batch is what the aggregator reads back, step for step and field for field."""

from __future__ import annotations

import pytest

from traceml import wire
from traceml.core.phases import STEP_FIELDS
from traceml.wire.records import add_steps, record_count, step_group_columns


def cpu_step(i: int) -> dict[str, int]:
    fields = {"step": i, "end_us": 25_000 * (i + 1), "step_us": 25_000}
    if i:  # step 0 has no input wait
        fields["input_wait_us"] = 600 + i
    fields.update(forward_us=800, backward_us=13_000 + i, optimizer_us=1_200)
    return fields


def gpu_step(i: int) -> dict[str, int]:
    return {
        **cpu_step(i),
        "gpu_step_us": 24_000,
        "gpu_forward_us": 700,
        "peak_allocated_bytes": 2**33,
        "peak_reserved_bytes": 2**34,
    }


def read_back(batch: wire.Batch) -> list[dict[str, int]]:
    """Every step of ``batch`` as a dict, sorted by step, from the columns."""
    steps = []
    for group in wire.Batch.FromString(batch.SerializeToString()).step_groups:
        names, columns = step_group_columns(group)
        steps += [dict(zip(names, values, strict=True)) for values in zip(*columns, strict=True)]
    return sorted(steps, key=lambda s: s["step"])


def test_steps_come_back_exactly_grouped_by_the_fields_measured():
    sent = [gpu_step(i) if i % 10 == 5 else cpu_step(i) for i in range(30)]
    batch = wire.Batch(run_name="r", rank=3, seq=1)
    add_steps(batch, sent)
    # step 0 (no input wait), the CPU steps, the GPU-timed steps 5, 15, 25
    assert [len(g.step) for g in batch.step_groups] == [1, 26, 3]
    assert list(batch.step_groups[2].step) == [5, 15, 25]
    assert read_back(batch) == sent
    assert record_count(batch) == 30


def test_an_unmeasured_field_is_an_empty_column_never_zeros():
    batch = wire.Batch()
    add_steps(batch, [cpu_step(1), cpu_step(2)])
    names, columns = step_group_columns(batch.step_groups[0])
    assert names == (
        "step",
        "end_us",
        "step_us",
        "input_wait_us",
        "forward_us",
        "backward_us",
        "optimizer_us",
    )
    assert [list(c) for c in columns] == [
        [1, 2],
        [50_000, 75_000],
        [25_000] * 2,
        [601, 602],
        [800] * 2,
        [13_001, 13_002],
        [1_200] * 2,
    ]
    assert len(batch.step_groups[0].h2d_us) == 0


def test_steps_with_the_same_fields_in_another_order_join_one_group():
    reordered = [dict(reversed(cpu_step(i).items())) for i in (1, 3)]
    sent = [cpu_step(2), *reordered, cpu_step(4)]
    batch = wire.Batch()
    add_steps(batch, sent)
    assert [list(g.step) for g in batch.step_groups] == [[2, 1, 3, 4]]
    assert read_back(batch) == sorted(sent, key=lambda s: s["step"])


def test_a_field_that_is_no_step_field_is_refused_by_name():
    with pytest.raises(ValueError, match="^not a step field: loss_us, images$"):
        add_steps(wire.Batch(), [{**cpu_step(1), "loss_us": 5, "images": 9}])


def test_the_columns_name_every_field_of_the_schema():
    assert tuple(f.name for f in wire.StepColumns.DESCRIPTOR.fields) == STEP_FIELDS


@pytest.mark.parametrize(
    "group, error",
    [
        (
            wire.StepColumns(step=[0, 1], end_us=[5, 6], step_us=[5, 6], forward_us=[1]),
            "malformed step group: 2 steps, columns of another length: forward_us",
        ),
        (
            wire.StepColumns(step=[0], step_us=[5]),
            "malformed step group: 1 steps, no end_us column",
        ),
        (
            wire.StepColumns(step=[0], step_us=[5, 6]),
            "malformed step group: 1 steps, no end_us column; columns of another length: step_us",
        ),
    ],
)
def test_a_malformed_group_is_refused_with_the_reason(group, error):
    with pytest.raises(ValueError) as exc:
        step_group_columns(group)
    assert str(exc.value) == error


def test_an_empty_group_holds_nothing():
    assert step_group_columns(wire.StepColumns()) == ((), [])
