"""The GPU clock: CUDA events around a step and its phases, resolved later without synchronizing.

What is measured. One step in N (``TRACEML_GPU_TIMING_EVERY_N_STEPS``, default 10; the steps
whose index is a multiple of N) is *GPU-timed*: an event is recorded on the current stream when
the step opens and when it closes, and around each phase the hooks of
:mod:`traceml.sdk.instrumentation` see (H2D copies, forward, backward, optimizer step). The
elapsed times between those events, read once they have completed, are the step's
``gpu_step_us`` (step body, open to close: it excludes the input wait that the CPU step time
includes) and ``gpu_<phase>_us`` (sum over the phase's occurrences in the step), in µs.

Why one step in N. Recording an event costs the training thread up to 8-10 µs (measured on an
H200 for issue 5); a step with a forward, a backward, an optimizer step and two copies records
about 12, so timing every step of a 2 ms step would cost ~5 %. One step in 10 costs ~0.5 % on
average, and the medians over the timed steps describe the run.

How it is resolved. Nothing here ever synchronizes the device or the stream: the telemetry
client, on its own thread, calls :meth:`GpuStep.ready` (``Event.query()``, ~0.3 µs each) before
converting a step, keeping steps in order; once every event of the step has completed, it reads
their ``elapsed_time`` and returns them to the :class:`EventPool`, and :meth:`GpuStep.fill`
adds the fields. At the end of the run,
:meth:`GpuTimer.close` polls the events of every timed step still pending for at most
``TRACEML_GPU_FINISH_WAIT_SEC`` (default 2 s; on the exit path, after training, never inside a
step); steps still pending after that are sent without GPU fields and counted in
``RankFinish.steps_gpu_unresolved``.

Safety. Every CUDA call takes the device index found by
:class:`~traceml.sdk.device.RankDevice`, so no context is created on another GPU. CUDA graph
captures: in the default ``global`` capture mode, an ``Event.query()`` or ``elapsed_time`` from
*any* thread while *any* capture is under way invalidates the user's capture (CUDAGraph.cpp;
the same fault crashed NCCL's watchdog, pytorch #104487). The stream check on the capturing
thread cannot see a capture begun on another thread, nor a capture that begins while the
sender thread is half-way through its queries. So :func:`install_capture_guard` wraps
``torch.cuda.CUDAGraph.capture_begin``/``capture_end`` (which ``torch.cuda.graph``,
``make_graphed_callables`` and ``torch.compile``'s CUDA graphs all go through) to keep a
process-wide count of captures in progress, :data:`CAPTURES`, behind one lock: the sender
thread holds the lock across its queries and makes none while a capture is counted, and a
capture begins only after the lock is free (a wait of a few µs, never across I/O). The training
thread records no event while a capture is counted or its current stream captures. A capture
begun outside ``CUDAGraph`` (a C++ extension calling ``cudaStreamBeginCapture``) is not seen
by the count. A CUDA error while recording drops the GPU timing of that phase, never raises
into training.
"""

from __future__ import annotations

import collections
import functools
import threading
import time
from collections.abc import Callable

import torch

from traceml.core import phases
from traceml.sdk.device import RankDevice

#: The wire field (µs) of each GPU-timed phase (:data:`traceml.core.phases.GPU_PHASES`), by
#: phase index: the index the hooks pass to :meth:`GpuStep.begin`/:meth:`GpuStep.end`.
PHASE_FIELDS = tuple(p.gpu_field for p in phases.GPU_PHASES)
H2D, FORWARD, BACKWARD, OPTIMIZER = (
    [p.name for p in phases.GPU_PHASES].index(name)
    for name in ("h2d", "forward", "backward", "optimizer")
)

#: Events kept for reuse; more are created when needed, surplus ones are left to the GC.
POOL_MAX_EVENTS = 256

# Private in torch; absent in CPU builds. One C call returning the current stream's handle, so
# the Stream object is built only when the stream changes, not once per event (the per-event
# cost of both paths is measured by benchmarks/gpu_check.py).
_raw_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


class CaptureGuard:
    """CUDA graph captures in progress in the process (see "Safety" in the module docstring).

    Attributes:
        lock: held by a thread querying events, and taken by a capture as it begins.
        active: captures begun and not yet ended (any thread).
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.active = 0

    def wrap_begin(self, original):
        """``capture_begin`` counting the capture first (after any query in flight ended)."""

        @functools.wraps(original)
        def capture_begin(graph, *args, **kwargs):
            with self.lock:
                self.active += 1
            try:
                return original(graph, *args, **kwargs)
            except BaseException:
                self.end()
                raise

        capture_begin.__traceml_original__ = original
        return capture_begin

    def wrap_end(self, original):
        """``capture_end`` uncounting the capture once it ended (also when it raised)."""

        @functools.wraps(original)
        def capture_end(graph, *args, **kwargs):
            try:
                return original(graph, *args, **kwargs)
            finally:
                self.end()

        capture_end.__traceml_original__ = original
        return capture_end

    def end(self) -> None:
        """One capture ended."""
        with self.lock:
            self.active = max(0, self.active - 1)


#: The process's captures in progress.
CAPTURES = CaptureGuard()


def install_capture_guard(graph_class=None) -> None:
    """Count CUDA graph captures in :data:`CAPTURES`: wrap ``capture_begin`` and
    ``capture_end`` of ``graph_class`` (default ``torch.cuda.CUDAGraph``, whose Python methods
    ``torch.cuda.graph`` calls). Idempotent; call before training captures anything."""
    if graph_class is None:
        graph_class = torch.cuda.CUDAGraph
    if getattr(graph_class.capture_begin, "__traceml_original__", None) is None:
        graph_class.capture_begin = CAPTURES.wrap_begin(graph_class.capture_begin)
        graph_class.capture_end = CAPTURES.wrap_end(graph_class.capture_end)


class TorchCuda:
    """The CUDA operations the GPU clock needs, on one device (explicit index).

    Args:
        index: CUDA device index of the rank.
    """

    def __init__(self, index: int) -> None:
        self.index = index
        self._raw = None
        self._stream = None

    @staticmethod
    def new_event():
        """A timing event (created on the device at its first record)."""
        return torch.cuda.Event(enable_timing=True)

    def current_stream(self):
        """The training thread's current stream on the rank's device (cached while unchanged)."""
        if _raw_stream is None:
            return torch.cuda.current_stream(self.index)
        raw = _raw_stream(self.index)
        if raw != self._raw:
            self._stream = torch.cuda.current_stream(self.index)
            self._raw = raw
        return self._stream

    def capturing(self) -> bool:
        """True while the rank's current stream captures a CUDA graph (no event may be
        recorded). Asked of the rank's device: a rank that never called ``set_device`` has
        current device 0, and a stream call there would create a context on GPU 0."""
        if torch.cuda.current_device() == self.index:
            return torch.cuda.is_current_stream_capturing()
        with self.device_guard():
            return torch.cuda.is_current_stream_capturing()

    def device_guard(self):
        """Context manager making the rank's device current on the calling thread (the sender
        thread, whose own current device is 0): a CUDA runtime call there then binds the
        rank's context, never creates one on device 0. torch restores the previous device
        without creating a context on it."""
        return torch.cuda.device(self.index)


class EventPool:
    """Reusable timing events: taken on the training thread, given back by the sender thread.

    ``deque.append``/``pop`` are atomic in CPython, so no lock is needed. An event is given
    back only after its elapsed times were read, so a reused event is never still pending.
    """

    def __init__(self, new_event: Callable[[], object], max_events: int = POOL_MAX_EVENTS):
        self._new = new_event
        self._max = max_events
        self._free: collections.deque = collections.deque()

    def take(self):
        """A free event, or a new one."""
        try:
            return self._free.pop()
        except IndexError:
            return self._new()

    def give(self, events) -> None:
        """Return completed events for reuse (beyond the bound they are dropped)."""
        free = self._free
        for event in events:
            if len(free) < self._max:
                free.append(event)


class GpuStep:
    """The events of one GPU-timed step (the tracer's ``gpu_step``).

    Training thread: :meth:`begin`/:meth:`end`/:meth:`cancel` around phases, :meth:`close` at the
    step's end. Sender thread (and :meth:`GpuTimer.close` on the exit path): :meth:`ready`,
    which reads the elapsed times once every event completed, then :meth:`fill`.
    """

    __slots__ = ("_timer", "_start", "_stop", "_open", "_intervals", "_fields")

    def __init__(self, timer: GpuTimer, start) -> None:
        self._timer = timer
        self._start = start
        self._stop = None
        self._open = [None] * len(PHASE_FIELDS)  # start event of the phase in progress
        self._intervals: list = []  # (phase, start event, end event)
        self._fields: dict | None = None  # the GPU fields (µs), once read

    # --- training thread ------------------------------------------------------------------
    def begin(self, phase: int) -> None:
        """A phase starts: record its start event."""
        self._open[phase] = self._timer.record()

    def end(self, phase: int) -> None:
        """The phase started by :meth:`begin` ends: record its end event."""
        start = self._open[phase]
        if start is not None:
            self._open[phase] = None
            stop = self._timer.record()
            if stop is not None:
                self._intervals.append((phase, start, stop))
            else:
                self._timer.pool.give((start,))

    def cancel(self, phase: int) -> None:
        """Forget a phase started by :meth:`begin` (the call turned out not to be one); its
        start event goes back to the pool."""
        start = self._open[phase]
        if start is not None:
            self._open[phase] = None
            self._timer.pool.give((start,))

    def close(self) -> None:
        """The step ends: record its end event (phases still open are forgotten)."""
        self._stop = self._timer.record()
        self._timer.pool.give([event for event in self._open if event is not None])
        self._open = [None] * len(PHASE_FIELDS)

    # --- sender thread --------------------------------------------------------------------
    @property
    def done(self) -> bool:
        """True when nothing is left to wait for: the fields were read, or cannot be (the end
        event was never recorded, or a CUDA error)."""
        return self._fields is not None or self._stop is None

    def ready(self) -> bool:
        """True once every event has completed (``Event.query()``; never waits); the elapsed
        times are then read at once and the events go back to the pool.

        False, without a CUDA call, while a CUDA graph capture is under way anywhere in the
        process (:data:`CAPTURES`). A step whose events cannot be queried (a CUDA error)
        counts as ready and is sent without GPU fields, so it never holds the telemetry
        stream back.
        """
        if self.done:
            return True
        with CAPTURES.lock:
            if CAPTURES.active:
                return False
            if self.done:  # another thread (the exit path) read it meanwhile
                return True
            try:
                with self._timer.cuda.device_guard():
                    if not (
                        self._stop.query()
                        and self._start.query()
                        and all(a.query() and b.query() for _, a, b in self._intervals)
                    ):
                        return False
                    fields = {"gpu_step_us": _us(self._start.elapsed_time(self._stop))}
                    totals = [None] * len(PHASE_FIELDS)
                    for phase, start, stop in self._intervals:
                        totals[phase] = (totals[phase] or 0.0) + start.elapsed_time(stop)
            except Exception:
                self._stop = None
                return True
            for phase, total in enumerate(totals):
                if total is not None:
                    fields[PHASE_FIELDS[phase]] = _us(total)
            self._fields = fields
        events = [self._start, self._stop]
        for _, start, stop in self._intervals:
            events += (start, stop)
        self._timer.pool.give(events)
        return True

    def fill(self, fields: dict[str, int]) -> None:
        """Add the GPU fields (µs) read by :meth:`ready` to ``fields`` (a step's wire fields).

        A step converted before its events completed (the run ended first) keeps its GPU
        fields absent.
        """
        if self._fields:
            fields.update(self._fields)


def _us(ms: float) -> int:
    """CUDA's elapsed time (ms, float, ~0.5 µs resolution) as integer µs."""
    return max(0, int(ms * 1000.0 + 0.5))


class GpuTimer:
    """The tracer's ``gpu_step_factory``: a :class:`GpuStep` for one step in N, else None.

    Args:
        device: the rank's device; GPU timing starts once the training thread has used it.
        every_n: time one step in ``every_n`` (steps whose index is a multiple of it).
        on_device: called once, on the training thread, when the device is found.
        cuda: factory of the CUDA operations for a device index (:class:`TorchCuda`).
        finish_wait_s: bound of :meth:`close`'s wait for pending events, s.
    """

    def __init__(
        self,
        device: RankDevice,
        every_n: int,
        *,
        on_device: Callable[[], None] | None = None,
        cuda: Callable[[int], TorchCuda] = TorchCuda,
        finish_wait_s: float = 2.0,
    ) -> None:
        self.device = device
        self.every_n = every_n
        self.finish_wait_s = finish_wait_s
        self._on_device = on_device
        self._make_cuda = cuda
        #: The device's CUDA operations, once the device is found.
        self.cuda: TorchCuda | None = None
        self.pool: EventPool | None = None
        #: GPU-timed steps not yet known done, oldest first (what :meth:`close` waits for);
        #: bounded, as a step the client dropped is never resolved.
        self.pending: collections.deque = collections.deque(maxlen=POOL_MAX_EVENTS)

    def __call__(self, step: int) -> GpuStep | None:
        """Called by the tracer as step ``step`` opens, on the training thread (the device is
        looked for at every step until found, so H2D is measured from then on)."""
        if self.cuda is None:
            if not self.device.poll():
                return None
            self.cuda = self._make_cuda(self.device.index)
            self.pool = EventPool(self.cuda.new_event)
            if self._on_device is not None:
                self._on_device()
        if step % self.every_n:
            return None
        start = self.record()
        if start is None:
            return None
        pending = self.pending
        while pending and pending[0].done:
            pending.popleft()
        step = GpuStep(self, start)
        pending.append(step)
        return step

    def record(self):
        """An event recorded on the current stream, or None (a CUDA graph capture under way
        in the process or on this stream, a CUDA error)."""
        cuda = self.cuda
        try:
            if CAPTURES.active or cuda.capturing():
                return None
            event = self.pool.take()
            event.record(cuda.current_stream())
            return event
        except Exception:
            return None

    def close(self, timeout_s: float | None = None) -> None:
        """Wait, bounded by ``finish_wait_s`` in all (and by ``timeout_s``, s, the exit's
        budget left, when given), for the events of every GPU-timed step still pending (their
        phases may be on different streams, so the last step completing says nothing of the
        earlier ones).

        Runs on the exit path (``RankState.close``), after the last step: it polls
        ``Event.query()`` every millisecond and never calls a synchronize.
        """
        wait_s = self.finish_wait_s if timeout_s is None else min(self.finish_wait_s, timeout_s)
        deadline = time.monotonic() + wait_s
        for step in list(self.pending):
            while not step.ready() and time.monotonic() < deadline:
                time.sleep(0.001)
