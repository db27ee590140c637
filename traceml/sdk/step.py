"""One training step: the clock around it and the phases measured inside it.

:class:`StepTracer` owns the per-rank step state. :meth:`StepTracer.begin` and
:meth:`StepTracer.end` (called by the ``with traceml.trace_step(model):`` context) time one step
on the CPU clock (``time.perf_counter_ns``); the hooks in :mod:`traceml.sdk.instrumentation` add
each phase's duration to the tracer while a step is open. At the end of a step the tracer hands
one :class:`StepMeasurement` to the telemetry client, which puts its fields on the wire off the
training thread.

Definitions (all durations per step, in ns here and µs on the wire):

* step time: from the end of the previous step to the end of this one (for the first step, from
  its start), so it includes the input wait;
* input wait (``input_wait_us`` on the wire): from the end of the previous step to the start
  of this one, plus DataLoader ``__next__`` time spent inside the step body; absent for the
  first step. It is the whole gap between two steps: the analysis
  (:mod:`traceml.analysis.outside`) keeps only the DataLoader part as input wait when a
  DataLoader fed the step, and calls the rest time outside the steps (evaluation,
  checkpoints, logging between steps);
* DataLoader next: time inside ``__next__`` of the DataLoader iterator that fed this step:
  its calls since the previous step (only the last run of calls to one iterator: an
  evaluation loader iterated between two steps is not this step's input) plus its calls
  inside the step body. A loop without a DataLoader has no DataLoader next, and its whole gap
  is its fetch;
* forward, backward, optimizer, H2D: see :mod:`traceml.sdk.instrumentation`;
* samples, tokens: of the DataLoader batches the DataLoader-next figure covers, from their
  shapes; flops: the step's model FLOPs once the rank counted them (both
  :mod:`traceml.sdk.workload`);
* residual (computed by the analysis): step time minus the phases that were measured.
"""

from __future__ import annotations

import time
from collections.abc import Callable

_now_ns = time.perf_counter_ns

#: Model FLOPs of a training forward and its backward per forward FLOP (see
#: :mod:`traceml.sdk.workload`).
FWD_BWD_FACTOR = 3

#: What a rank is doing now (:attr:`StepTracer.phase`, sent as ``Progress.phase``): between
#: steps, inside a step but outside the phases below, or in one of them.
IDLE = "idle"
STEP = "step"
DATALOADER = "dataloader"
H2D = "h2d"
FORWARD = "forward"
BACKWARD = "backward"
OPTIMIZER = "optimizer"


class StepMeasurement:
    """One finished step as measured on the training thread (ns), awaiting conversion.

    GPU timings, when present, are resolved later from CUDA events (see
    :mod:`traceml.sdk.timing`); :meth:`ready` tells the client when that can happen.
    """

    __slots__ = (
        "step",
        "end_ns",
        "step_ns",
        "input_wait_ns",
        "dataloader_next_ns",
        "h2d_ns",
        "forward_ns",
        "backward_ns",
        "optimizer_ns",
        "comm_ns",
        "gpu",
        "peak_allocated_bytes",
        "peak_reserved_bytes",
        "samples",
        "tokens",
        "flops",
        "arrival",
        "origin_ns",
    )

    def __init__(self) -> None:
        self.gpu = None
        self.peak_allocated_bytes = None
        self.peak_reserved_bytes = None
        self.samples = self.tokens = self.flops = None
        self.comm_ns = None
        #: ``(entry perf_counter_ns, group CRC-32, seq)`` of the last collective the step
        #: waited in (:meth:`traceml.sdk.collectives.Recorder.close_step`), else None.
        self.arrival = None

    def ready(self) -> bool:
        """True when no GPU timing is pending."""
        return self.gpu is None or self.gpu.ready()

    def fields(self) -> dict[str, int]:
        """The step's fields for the wire (µs, bytes; see :mod:`traceml.wire.records`), in
        the canonical order (:data:`traceml.core.phases.STEP_FIELDS`); a phase that was not
        measured is left out, never sent as 0.

        One line per phase of the table, spelled out rather than looped over: the sender
        converts every step, and a loop over the table costs about 0.45 µs of CPU more per
        step (0.79 -> 1.24 µs, measured side by side). ``tests/test_phase_table.py`` checks
        that every phase of the table is converted, in order."""
        fields = {
            "step": self.step,
            "end_us": (self.end_ns - self.origin_ns) // 1000,
            "step_us": self.step_ns // 1000,
        }
        if self.input_wait_ns is not None:
            fields["input_wait_us"] = self.input_wait_ns // 1000
        if self.dataloader_next_ns is not None:
            fields["dataloader_next_us"] = self.dataloader_next_ns // 1000
        if self.h2d_ns is not None:
            fields["h2d_us"] = self.h2d_ns // 1000
        if self.forward_ns is not None:
            fields["forward_us"] = self.forward_ns // 1000
        if self.backward_ns is not None:
            fields["backward_us"] = self.backward_ns // 1000
        if self.optimizer_ns is not None:
            fields["optimizer_us"] = self.optimizer_ns // 1000
        if self.comm_ns is not None:
            fields["comm_us"] = self.comm_ns // 1000
        if self.gpu is not None:
            self.gpu.fill(fields)
        if self.peak_allocated_bytes is not None:
            fields["peak_allocated_bytes"] = self.peak_allocated_bytes
            fields["peak_reserved_bytes"] = self.peak_reserved_bytes
        if self.samples is not None:
            fields["samples"] = self.samples
        if self.tokens is not None:
            fields["tokens"] = self.tokens
        if self.flops is not None:
            fields["flops"] = self.flops
        if self.arrival is not None:
            entry_ns, group, seq = self.arrival
            fields["arrive_us"] = max(0, entry_ns - self.origin_ns) // 1000
            fields["arrive_group"] = group
            fields["arrive_seq"] = seq
        return fields


class StepTracer:
    """Per-rank step state: the open step's phase totals and the step counter.

    Args:
        emit: called with each finished :class:`StepMeasurement` (the client's submit).
        origin_ns: ``perf_counter_ns()`` at init; step end times are offsets from it.
        h2d_measured: whether host-to-device copies are instrumented (CUDA present);
            without it the H2D phase is reported as absent, never as 0.
    """

    def __init__(
        self,
        emit: Callable[[StepMeasurement], None],
        origin_ns: int,
        *,
        h2d_measured: bool = False,
    ) -> None:
        self._emit = emit
        self.origin_ns = origin_ns
        self.h2d_measured = h2d_measured
        self.steps_completed = 0
        self.in_step = False
        #: The phase the training thread is in now (:data:`IDLE`, :data:`STEP`, ...): one
        #: attribute store as a phase opens and closes, read without a lock by the sender
        #: thread, which ships it with ``steps_completed`` in every batch (hang localisation).
        self.phase = IDLE
        self._last_end_ns: int | None = None
        self._start_ns = 0
        # Phase totals of the open step (ns); None until a phase is seen.
        self.forward_ns: int | None = None
        self.backward_ns: int | None = None
        self.optimizer_ns: int | None = None
        self.h2d_ns = 0
        self.dataloader_in_step_ns = 0
        #: DataLoader ``__next__`` time since the previous step ended (ns), of the iterator
        #: called last (``_pending_iterator``, its ``id()``).
        self.dataloader_pending_ns: int | None = None
        self._pending_iterator: int | None = None
        #: Samples and tokens of those batches (:func:`traceml.sdk.workload.batch_counts`):
        #: ``[samples, tokens]`` fetched since the previous step, and inside the open step.
        self._pending_work: list = [None, None]
        self._step_work: list = [None, None]
        #: Training forwards (autograd on) of the open step, and the FLOPs of one (set once
        #: counted by :attr:`flops_counter`, a :class:`traceml.sdk.workload.FlopsCounter`,
        #: which is None once it ran or when counting is off).
        self.train_forwards = 0
        self.forward_flops: int | None = None
        self.flops_counter = None
        self.forward_depth = 0
        #: Backward or optimizer calls in progress (a host-to-device copy inside one is its time).
        self.phase_depth = 0
        #: Called with the step index as a step opens; returns its GPU timing object or None
        #: (a :class:`traceml.sdk.timing.GpuTimer`, set when CUDA is available).
        self.gpu_step_factory = None
        self.gpu_step = None
        #: Called at step end to read memory peaks every N steps (CUDA only).
        self.memory_reader = None
        #: Optimizer steps in progress (a wrapper's step runs its inner optimizer's step).
        self.optimizer_depth = 0
        #: Zero-code step boundaries (a :class:`traceml.sdk.auto.AutoSteps`), None when the
        #: script marks its own steps; the first explicit :meth:`begin` turns them off.
        self.auto = None
        #: Called once a step has ended and been emitted, when set: a SIGTERM that came inside
        #: the step (:mod:`traceml.sdk.sigterm`) ends the process there.
        self.on_step_end: Callable[[], None] | None = None
        #: The rank's collective recorder (:class:`traceml.sdk.collectives.Recorder`), which
        #: sets each step's ``comm_ns`` and takes it out of the phases that held it; None when
        #: collectives are not recorded.
        self.comm = None

    @property
    def last_end_ns(self) -> int | None:
        """``perf_counter_ns`` at the end of the last step (completed or abandoned), None
        before the first (read by the sender thread: :mod:`traceml.sdk.stall`)."""
        return self._last_end_ns

    # -- phases: called by the instrumentation hooks --------------------------------------------
    def add_dataloader(
        self,
        elapsed_ns: int,
        iterator: int = 0,
        samples: int | None = None,
        tokens: int | None = None,
    ) -> None:
        """Account one DataLoader ``__next__`` call (inside or between steps).

        Args:
            elapsed_ns: time inside the call.
            iterator: ``id()`` of the DataLoader iterator. Between steps only the calls of the
                iterator called last count (a call to another iterator starts over), so the
                batches of an evaluation loader read between two steps are not input wait.
            samples, tokens: the batch's counts (None: unknown, or no batch came).
        """
        if self.in_step:
            self.dataloader_in_step_ns += elapsed_ns
            work = self._step_work
        elif iterator == self._pending_iterator and self.dataloader_pending_ns is not None:
            self.dataloader_pending_ns += elapsed_ns
            work = self._pending_work
        else:
            self._pending_iterator = iterator
            self.dataloader_pending_ns = elapsed_ns
            work = self._pending_work = [None, None]
        if samples is not None:
            work[0] = samples if work[0] is None else work[0] + samples
        if tokens is not None:
            work[1] = tokens if work[1] is None else work[1] + tokens

    # -- the step ---------------------------------------------------------------------------------
    def begin(self) -> None:
        """Open a step (the ``with`` block of ``trace_step`` is entered).

        An explicit step wins over zero-code steps: the first one ends them for the rest of
        the process (the zero-code step open now is dropped, never counted).
        """
        if self.auto is not None:
            self.auto.stop()
        self.open(_now_ns())

    def open(self, start_ns: int) -> None:
        """Open a step that started at ``start_ns`` (``perf_counter_ns``)."""
        self._start_ns = start_ns
        self.in_step = True
        self.phase = STEP
        self.forward_ns = self.backward_ns = self.optimizer_ns = None
        self.h2d_ns = 0
        self.dataloader_in_step_ns = 0
        self._step_work = [None, None]
        self.train_forwards = 0
        self.forward_depth = self.phase_depth = self.optimizer_depth = 0
        if self.gpu_step_factory is not None:
            self.gpu_step = self.gpu_step_factory(self.steps_completed)

    def end(self) -> None:
        """Close the step and emit its measurement.

        The GPU end event and the memory read (one step in N) come before the clock stops:
        their cost is this step's (its residual), never the next step's input wait.
        """
        m = StepMeasurement()
        m.step = self.steps_completed
        if self.gpu_step is not None:
            self.gpu_step.close()
            m.gpu = self.gpu_step
            self.gpu_step = None
        if self.memory_reader is not None:
            self.memory_reader(m)
        end_ns = _now_ns()
        self.in_step = False
        self.phase = IDLE
        m.origin_ns = self.origin_ns
        m.end_ns = end_ns
        prev_end = self._last_end_ns
        dataloader = self.dataloader_pending_ns
        if self.dataloader_in_step_ns:
            dataloader = (dataloader or 0) + self.dataloader_in_step_ns
        if prev_end is None:
            m.step_ns = end_ns - self._start_ns
            m.input_wait_ns = None
        else:
            m.step_ns = end_ns - prev_end
            m.input_wait_ns = (self._start_ns - prev_end) + self.dataloader_in_step_ns
        m.dataloader_next_ns = dataloader
        m.h2d_ns = self.h2d_ns if self.h2d_measured else None
        m.forward_ns = self.forward_ns
        m.backward_ns = self.backward_ns
        m.optimizer_ns = self.optimizer_ns
        if self.comm is not None:
            self.comm.close_step(m)
        m.samples, m.tokens = _work_sum(self._pending_work, self._step_work)
        m.flops = (
            self.forward_flops * FWD_BWD_FACTOR * self.train_forwards
            if self.forward_flops is not None and self.train_forwards
            else None
        )
        self._last_end_ns = end_ns
        self.dataloader_pending_ns = self._pending_iterator = None
        self._pending_work = [None, None]
        self.steps_completed += 1
        self._emit(m)
        if self.on_step_end is not None:
            self.on_step_end()

    def next_step(self) -> None:
        """Close the open step and open the next one at the same instant (zero-code steps
        are contiguous: the time between two optimizer steps is all in a step)."""
        self.end()
        self.open(self._last_end_ns)

    def drop(self) -> None:
        """Forget the open step as if it had never opened: nothing is emitted, and its
        DataLoader time counts as time between steps (the next step's input evidence)."""
        self.in_step = False
        self.gpu_step = None
        fetched = self.dataloader_in_step_ns
        if fetched:
            self.dataloader_pending_ns = (self.dataloader_pending_ns or 0) + fetched
            self._pending_work = list(_work_sum(self._pending_work, self._step_work))

    def abandon(self) -> None:
        """Close a step whose body raised: nothing is emitted, the counter does not move."""
        self.in_step = False
        self.phase = IDLE
        self.gpu_step = None
        self._last_end_ns = _now_ns()
        self.dataloader_pending_ns = self._pending_iterator = None
        self._pending_work = [None, None]


def _work_sum(a: list, b: list) -> tuple[int | None, int | None]:
    """``(samples, tokens)`` of two ``[samples, tokens]`` counts (None + None is None)."""
    return tuple(x if y is None else y if x is None else x + y for x, y in zip(a, b, strict=True))
