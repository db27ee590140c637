"""The phase table (``traceml.core.phases``) against the wire schema, and what derives from it.

The schema is read twice: through the generated descriptor (what the code sends) and by parsing
``proto/traceml/wire/v1/step.proto`` (what a reader of the schema sees), so a stale generated
module fails too.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf.descriptor import FieldDescriptor

from traceml.analysis import document
from traceml.analysis import phases as analysis_phases
from traceml.core import phases
from traceml.launcher import terminal_view
from traceml.report import html
from traceml.sdk import instrumentation, timing
from traceml.sdk.step import StepMeasurement
from traceml.wire.v1.step_pb2 import StepColumns

STEP_PROTO = Path(__file__).resolve().parents[1] / "proto/traceml/wire/v1/step.proto"


def proto_fields() -> list[tuple[str, int]]:
    """(name, number) of every field of ``message StepColumns`` in step.proto, as declared."""
    body = re.search(r"message StepColumns \{(.*?)\n\}", STEP_PROTO.read_text(), re.S).group(1)
    body = re.sub(r"//[^\n]*", "", body)
    fields = re.findall(r"repeated\s+uint64\s+(\w+)\s*=\s*(\d+)\s*;", body)
    assert len(fields) == body.count(";"), "a StepColumns field is not a repeated uint64"
    return [(name, int(number)) for name, number in fields]


def descriptor_fields() -> list[tuple[str, int]]:
    return [(f.name, f.number) for f in StepColumns.DESCRIPTOR.fields]


def test_the_generated_descriptor_matches_the_proto_file():
    assert descriptor_fields() == proto_fields()
    assert {f.type for f in StepColumns.DESCRIPTOR.fields} == {FieldDescriptor.TYPE_UINT64}
    columns = StepColumns(**{name: [1, 2] for name in phases.STEP_FIELDS})  # all repeated
    assert all(len(getattr(columns, name)) == 2 for name in phases.STEP_FIELDS)


@pytest.mark.parametrize("fields", [descriptor_fields, proto_fields], ids=["descriptor", "proto"])
def test_the_step_fields_are_the_schema_fields_in_declaration_order(fields):
    names = [name for name, _ in fields()]
    # every phase field exists, and no field of the schema is unaccounted for
    assert names == list(phases.STEP_FIELDS)
    numbers = dict(fields())
    assert [numbers[name] for name in phases.STEP_REQUIRED_FIELDS] == [1, 2, 3]
    for clock in ("cpu_field", "gpu_field"):
        in_table_order = [numbers[getattr(p, clock)] for p in phases.PHASES if getattr(p, clock)]
        assert in_table_order == sorted(in_table_order), clock
        assert len(set(in_table_order)) == len(in_table_order)


def test_the_table_is_well_formed():
    names = [p.name for p in phases.PARTS] + [p.name for p in phases.PHASES]
    assert len(set(names)) == len(phases.PHASES) + 1  # a phase is named once; residual apart
    for p in phases.PHASES:
        assert p.cpu_field == f"{p.name}_us"
        assert p.gpu_field in (None, f"gpu_{p.name}_us")
        assert not p.required or p.part, p.name
    shorts = [p.short for p in phases.PARTS]
    assert len(set(shorts)) == len(shorts) and all(0 < len(s) <= 5 for s in shorts)
    colors = [p.color for p in phases.PARTS]
    assert len(set(colors)) == len(colors)
    assert all(re.fullmatch(r"#[0-9a-f]{6}", c) for c in colors)
    assert phases.PARTS[-1] is phases.RESIDUAL


def test_every_phase_list_derives_from_the_table():
    parts = [p for p in phases.PHASES if p.part]
    assert analysis_phases.PHASES == tuple((p.name, p.cpu_field, p.gpu_field) for p in parts)
    assert document.PARTS == tuple(p.name for p in parts) + ("residual",)
    assert analysis_phases.REQUIRED_PHASES == tuple(p.name for p in phases.PHASES if p.required)
    gpu = [p for p in phases.PHASES if p.gpu_field]
    assert set(instrumentation.PHASES) == {p.name for p in gpu}
    assert timing.PHASE_FIELDS == tuple(p.gpu_field for p in gpu)
    indices = (timing.H2D, timing.FORWARD, timing.BACKWARD, timing.OPTIMIZER)
    assert [timing.PHASE_FIELDS[i] for i in indices] == [
        "gpu_h2d_us",
        "gpu_forward_us",
        "gpu_backward_us",
        "gpu_optimizer_us",
    ]
    assert list(html.PART_COLORS) == list(document.PARTS)
    assert [name for name, _ in terminal_view._PARTS] == list(document.PARTS)


def test_a_measurement_gives_its_fields_in_the_canonical_order():
    m = StepMeasurement()
    m.step, m.origin_ns, m.end_ns, m.step_ns = 7, 1_000, 9_001_000, 5_000_000
    for i, p in enumerate(phases.PHASES):
        setattr(m, f"{p.name}_ns", (i + 1) * 1_000)
    m.peak_allocated_bytes, m.peak_reserved_bytes = 2**30, 2**31
    m.samples, m.tokens, m.flops = 32, 4096, 3 * 10**12
    fields = m.fields()
    assert list(fields) == [f for f in phases.STEP_FIELDS if f in fields]
    assert fields == {
        "step": 7,
        "end_us": 9_000,
        "step_us": 5_000,
        **{p.cpu_field: i + 1 for i, p in enumerate(phases.PHASES)},
        "peak_allocated_bytes": 2**30,
        "peak_reserved_bytes": 2**31,
        "samples": 32,
        "tokens": 4096,
        "flops": 3 * 10**12,
    }


def test_the_table_imports_nothing_above_the_bottom_layer():
    code = (
        "import sys, traceml.core.phases; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in "
        "('torch', 'grpc', 'google', 'traceml_aggregator') "
        "or m.startswith(('traceml.sdk', 'traceml.launcher', 'traceml.analysis', "
        "'traceml.report', 'traceml.wire'))))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout == "[]\n"
