"""The phase table: every measured part of a training step, in one place.

A step (``step_us``: end of the previous step to the end of this one) is split into *phases*
measured by the SDK and the *residual*, the time inside the step outside every measured phase,
which the analysis computes. :data:`PHASES` names each phase once: its summary name, its fields
in ``StepColumns`` (``proto/traceml/wire/v1/step.proto``; µs), its labels and colour in the
reports, whether the residual needs it, and its place in every list (the table's order). Every
other phase list derives from it: the SDK's step fields and GPU-timed phases
(:mod:`traceml.sdk.step`, :mod:`traceml.sdk.timing`), the names ``traceml.phase()`` accepts
(:mod:`traceml.sdk.instrumentation`), the wire's column order (:mod:`traceml.wire.records`), the
analysis (:mod:`traceml.analysis.phases`), the reports and the live view.

The step fields and their order. :data:`STEP_FIELDS` lists every field of a step in one
canonical order: :data:`STEP_REQUIRED_FIELDS`, the phases' CPU-clock fields in table order,
:data:`GPU_STEP_FIELD`, the phases' GPU-clock fields in table order, then
:data:`MEMORY_FIELDS`, :data:`WORKLOAD_FIELDS` and :data:`ARRIVAL_FIELDS`. It is the order of
the fields in ``StepColumns`` and of the store's ``steps`` columns; within each clock the
phases' field numbers increase in table order.
``tests/test_phase_table.py`` checks all of that against the generated descriptor and the
.proto file.

Adding a phase ``name`` takes:

1. one row at the end of :data:`PHASES` (a new phase goes last, so its field numbers, the next
   free ones, stay in table order);
2. its fields in ``StepColumns``: ``<name>_us`` declared after the last CPU-clock phase field
   and, if it is timed on the GPU too, ``gpu_<name>_us`` after the last GPU-clock one, with
   the next free field numbers (a field number is never reused or changed); then regenerate
   the Python code (``tools/gen_proto.sh``, see ``docs/wire.md``);
3. its measurement in the SDK (:mod:`traceml.sdk.step`): a ``<name>_ns`` total on
   ``StepTracer`` (reset in ``begin``, copied to the measurement in ``end``), a ``<name>_ns``
   slot on ``StepMeasurement`` and its line in ``StepMeasurement.fields`` (the conversion to
   µs, kept explicit for the sender's CPU; the test above fails until it is there); the hook
   that adds to the total (:mod:`traceml.sdk.instrumentation`); and, if GPU-timed, the hook's
   ``GpuStep.begin``/``end`` calls with the phase's index in
   :data:`traceml.sdk.timing.PHASE_FIELDS` (a constant next to the other indices there).

The store, the wire, the analysis (clock, parts, residual, shares), the JSON/text/HTML reports,
``traceml compare``, ``traceml.summary()`` and the live view follow from the row. The summary's
JSON Schema (``docs/final_summary.schema.json``: the keys of ``phase_median_ms`` and
``phase_share_pct``) and the field tables of ``docs/telemetry.md`` and ``docs/wire.md`` are
documents that must say so too; a finding rule about the new phase (``traceml.analysis``) is a
separate change.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Part:
    """A part of the step time as the reports show it.

    Attributes:
        name: summary name: the key in ``phase_median_ms``/``phase_share_pct`` of
            final_summary.json and the prefix of the flat metrics (``<name>_ms``, ``<name>_pct``).
        label: human label (HTML chart legend and table header).
        short: label of at most 5 characters for narrow views (text table header, live view);
            None for a phase that is not a part of the step.
        color: colour in the HTML phase chart (``#rrggbb``); None when not charted.
    """

    name: str
    label: str
    short: str | None
    color: str | None


@dataclass(frozen=True)
class Phase(Part):
    """One measured phase of a step (a row of :data:`PHASES`).

    Attributes:
        cpu_field: its ``StepColumns`` field on the CPU clock (µs, ``time.perf_counter_ns``).
        gpu_field: its ``StepColumns`` field on the GPU clock (µs, CUDA events), or None when
            it is host time only.
        required: the residual is meaningless without it (it would absorb the phase), so the
            summary says when it was never measured.
        part: it is a part of the step (it adds up with the others and the residual to the step
            time); False for supporting evidence that overlaps a part (DataLoader next lies
            inside the input wait).
    """

    cpu_field: str
    gpu_field: str | None = None
    required: bool = False
    part: bool = True


#: The phases, in order: the order of the reports' columns and of the step's fields per clock.
PHASES = (
    # Phase(name, label, short, colour, CPU field, GPU field, required)
    Phase("input_wait", "input wait", "input", "#e15759", "input_wait_us"),
    Phase("dataloader_next", "DataLoader next", None, None, "dataloader_next_us", part=False),
    Phase("h2d", "H2D", "h2d", "#f28e2b", "h2d_us", "gpu_h2d_us"),
    Phase("forward", "forward", "fwd", "#4e79a7", "forward_us", "gpu_forward_us", True),
    Phase("backward", "backward", "bwd", "#76b7b2", "backward_us", "gpu_backward_us", True),
    Phase("optimizer", "optimizer", "opt", "#59a14f", "optimizer_us", "gpu_optimizer_us", True),
    # The training thread waiting in collectives, taken out of the phase that held it
    # (traceml.sdk.collectives): host time only.
    Phase("comm", "communication", "comm", "#edc948", "comm_us"),
)

#: The time inside the step outside every measured phase (computed by the analysis, never sent).
RESIDUAL = Part("residual", "residual", "resid", "#bab0ac")

#: Every part of the step in the reports, in order: the phases that are parts, then the residual.
PARTS: tuple[Part, ...] = tuple(p for p in PHASES if p.part) + (RESIDUAL,)

#: The phases timed on the GPU clock too, in table order: those the SDK's hooks time inside the
#: step body (on both clocks), which are also the names ``traceml.phase()`` accepts.
GPU_PHASES = tuple(p for p in PHASES if p.gpu_field)

#: Fields every step has, in order: its index within the attempt, its end (µs since the rank's
#: start) and its wall time on the CPU clock (µs).
STEP_REQUIRED_FIELDS = ("step", "end_us", "step_us")
#: The step body on the GPU clock (µs): present on GPU-timed steps.
GPU_STEP_FIELD = "gpu_step_us"
#: Peaks of the CUDA caching allocator (bytes): present on steps that read memory.
MEMORY_FIELDS = ("peak_allocated_bytes", "peak_reserved_bytes")
#: Work done by the step (:mod:`traceml.sdk.workload`): samples and token ids of its DataLoader
#: batches (counts), its model FLOPs (present once the rank counted them).
WORKLOAD_FIELDS = ("samples", "tokens", "flops")
#: The step's arrival at a collective (:mod:`traceml.sdk.collectives`): of the collectives the
#: step waited in (those its ``comm`` counts), the last one the rank entered: its entry (µs
#: since the rank's start, as ``end_us``), its process group (the CRC-32 of the group's name)
#: and its sequence number in that group. Node 0 aligns them across ranks
#: (:mod:`traceml.analysis.skew`); present on the steps that waited in a collective.
ARRIVAL_FIELDS = ("arrive_us", "arrive_group", "arrive_seq")

#: Fields a step may lack (not measured), in the canonical order.
STEP_OPTIONAL_FIELDS = (
    tuple(p.cpu_field for p in PHASES)
    + (GPU_STEP_FIELD,)
    + tuple(p.gpu_field for p in GPU_PHASES if p.gpu_field)  # all of them (GPU_PHASES)
    + MEMORY_FIELDS
    + WORKLOAD_FIELDS
    + ARRIVAL_FIELDS
)
#: Every field of a step, in the canonical order (that of ``StepColumns``).
STEP_FIELDS = STEP_REQUIRED_FIELDS + STEP_OPTIONAL_FIELDS
