"""Automatic phase timing: hooks that attribute time inside a step to its phases.

Installed once by :func:`install` (called from ``traceml.init()``); each hook costs one
attribute check when no step is open. The forward timer is the exception: it is in place only
while a step of its model is open, so the model is untouched between steps. What is timed, on
the CPU clock:

* forward — the outermost call of the model passed to ``trace_step(model)``, during that step
  (:class:`ForwardTimer`; not its submodules: a DDP or FSDP wrapper is timed as the call the
  user makes);
* backward — ``torch.autograd.backward``, which ``Tensor.backward`` also goes through;
* optimizer — ``Optimizer.step`` of any ``torch.optim.Optimizer`` (fused and foreach included),
  through torch's global optimizer step hooks;
* DataLoader — ``__next__`` of every DataLoader iterator, also of iterators created before
  ``init()`` (the method is replaced on the iterator base class); the batch's samples and
  tokens are read from its shapes (:func:`traceml.sdk.workload.batch_counts`);
* H2D — ``Tensor.to`` and ``Tensor.cuda`` calls that turn a host tensor into a CUDA tensor
  (``non_blocking=True`` and pinned memory included), made by the thread that called
  ``init()`` inside a step and outside the other phases (a copy inside the forward, backward,
  optimizer step or DataLoader ``__next__`` is that phase's time, so phases never overlap).
  Installed by :func:`install_h2d` only when CUDA is available, and reported once the rank
  uses a CUDA device; on CPU-only runs H2D is absent, never 0.

On a GPU-timed step (:mod:`traceml.sdk.timing`) the same hooks also record CUDA events around
each phase: the start event before the CPU clock starts and the end event after it stops, so
recording them (µs each) is not counted in the CPU phases.

Code the automatic mode cannot see can be timed with :func:`traceml.phase`.

Each hook also stores the phase it opens in :attr:`StepTracer.phase` and puts the outer one
back as it closes (one attribute store each way, no lock): the sender thread reads that slot
for the ``Progress`` it ships, which is how a hang is localised (the rank still in forward while
the others wait in backward's all-reduce).
"""

from __future__ import annotations

import copy
import functools
import threading
import time
import weakref

from traceml.core import phases
from traceml.sdk import step as step_mod
from traceml.sdk import workload
from traceml.sdk.step import StepTracer
from traceml.sdk.timing import BACKWARD, FORWARD, H2D, OPTIMIZER

_now_ns = time.perf_counter_ns
_tracer: StepTracer | None = None
_installed = False
_is_compiling = None  # torch.compiler.is_compiling, bound by install()
_grad_enabled = None  # torch.is_grad_enabled, bound by install()
_h2d_thread: int | None = None  # thread whose copies count as H2D (the one that called init())

#: Phase names accepted by :func:`add_phase` (and ``traceml.phase``): the phases the hooks time
#: inside the step body (:data:`traceml.core.phases.GPU_PHASES`), in table order.
PHASES = tuple(p.name for p in phases.GPU_PHASES)


def install(tracer: StepTracer) -> None:
    """Route phase timings to ``tracer`` and install the global hooks (once per process)."""
    global _tracer, _installed, _is_compiling, _grad_enabled
    _tracer = tracer
    if _installed:
        return
    import torch
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )
    from torch.utils.data import dataloader

    _is_compiling = torch.compiler.is_compiling
    _grad_enabled = torch.is_grad_enabled
    torch.autograd.backward = _timed_backward(torch.autograd.backward)
    register_optimizer_step_pre_hook(_optimizer_pre)
    register_optimizer_step_post_hook(_optimizer_post)
    base = dataloader._BaseDataLoaderIter
    base.__next__ = _timed_next(base.__next__)
    _installed = True


def install_h2d() -> None:
    """Time host-to-device copies (``Tensor.to``, ``Tensor.cuda``) made by the calling thread
    inside a step; call once CUDA is known to be available (idempotent)."""
    global _h2d_thread
    import torch

    _h2d_thread = threading.get_ident()
    if getattr(torch.Tensor.to, "__traceml_original__", None) is None:
        torch.Tensor.to = _timed_copy(torch.Tensor.to)
        torch.Tensor.cuda = _timed_copy(torch.Tensor.cuda)


def add_phase(name: str, elapsed_ns: int) -> None:
    """Add ``elapsed_ns`` to phase ``name`` (one of :data:`PHASES`) of the open step."""
    tr = _tracer
    if tr is None or not tr.in_step:
        return
    attr = f"{name}_ns"
    setattr(tr, attr, (getattr(tr, attr) or 0) + elapsed_ns)


# --- hooks ---------------------------------------------------------------------------------------
class ForwardTimer:
    """Times the forward phase of one model: its outermost call inside a step.

    :meth:`install` (as a step of the model opens) puts this callable in the model instance's
    ``__dict__`` under ``forward``, shadowing the class's method the way ``torch.compile``'s
    ``OptimizedModule`` does; :meth:`remove` (as the step closes) restores what was there. The
    model keeps torch's hook-free fast call path (module forward hooks made every call of the
    traced model take the slow path: 4-8 µs per call, see benchmarks/hot_path.py), and between
    steps it is exactly the user's model (calls outside a step cost nothing, ``state_dict``,
    pickling and copies see no TraceML). A model pickled or deep-copied during a step gets its
    own ``forward`` back (:meth:`__reduce_ex__`, :meth:`__deepcopy__`).

    Args:
        model: the ``torch.nn.Module`` passed to ``trace_step`` (held weakly).

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
    """

    __slots__ = ("_model", "_forward", "_saved")

    def __init__(self, model) -> None:
        import torch

        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"trace_step(model) takes a torch.nn.Module, not {type(model).__name__}"
            )
        self._model = weakref.ref(model)
        self._forward = None  # the model's own forward, while installed
        self._saved = _ABSENT  # what the instance ``__dict__`` held under "forward"

    def watches(self, model) -> bool:
        """True when this timer is ``model``'s."""
        return self._model() is model

    def install(self) -> None:
        """Time the model's forward from now on (a step of it opens)."""
        model = self._model()
        if model is None or model.__dict__.get("forward") is self:  # gone, or a nested step
            return
        state = model.__dict__
        self._forward = model.forward
        self._saved = state.get("forward", _ABSENT)
        state["forward"] = self

    def remove(self) -> None:
        """Give the model its own forward back (the step closes); a forward the step body
        assigned itself is left in place."""
        model = self._model()
        if model is not None and model.__dict__.get("forward") is self:
            if self._saved is _ABSENT:
                del model.__dict__["forward"]
            else:
                model.__dict__["forward"] = self._saved
        self._forward = None
        self._saved = _ABSENT

    def __call__(self, *args, **kwargs):
        forward = self._forward
        if forward is None:  # a reference kept from inside a step, called after it closed
            forward = self._model().forward
        if _is_compiling():  # first: a graph traced by torch.compile never sees the state below
            return forward(*args, **kwargs)
        tr = _tracer
        if tr is None or not tr.in_step or tr.forward_depth:  # forward_depth: a nested call
            return forward(*args, **kwargs)
        gpu = tr.gpu_step
        if gpu is not None:
            gpu.begin(FORWARD)
        tr.forward_depth = 1
        outer, tr.phase = tr.phase, step_mod.FORWARD
        counter = None
        if _grad_enabled():  # a training forward: its model FLOPs count (see workload)
            tr.train_forwards += 1
            if tr.flops_counter is not None and tr.steps_completed >= workload.COUNT_STEP:
                counter = tr.flops_counter
        start = _now_ns()
        try:
            if counter is not None:
                return counter.count(tr, self._model(), forward, args, kwargs)
            return forward(*args, **kwargs)
        finally:
            tr.forward_ns = (tr.forward_ns or 0) + (_now_ns() - start)
            tr.forward_depth = 0
            tr.phase = outer
            if gpu is not None:
                gpu.end(FORWARD)

    @property
    def __wrapped__(self):
        """The model's own forward, so ``inspect.signature(model.forward)`` still names its
        parameters (the HF Trainer keeps the dataset columns the forward takes)."""
        return self._forward

    def __reduce_ex__(self, protocol):
        return self._forward.__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return copy.deepcopy(self._forward, memo)


_ABSENT = object()  # no instance attribute "forward" before install()


_optimizer_start_ns = 0
_optimizer_inner_ns = 0  # forward + backward of the open step when its optimizer step began


def _optimizer_pre(optimizer, args, kwargs):
    global _optimizer_start_ns, _optimizer_inner_ns
    tr = _tracer
    if tr is not None:
        tr.optimizer_depth += 1
        if tr.optimizer_depth > 1:  # an inner optimizer's step inside a wrapper's: counted once
            return
        if tr.auto is not None:
            tr.auto.before_optimizer(optimizer)
        if tr.in_step:
            tr.phase_depth += 1
            tr.phase = step_mod.OPTIMIZER
            if tr.gpu_step is not None:
                tr.gpu_step.begin(OPTIMIZER)
            _optimizer_inner_ns = (tr.forward_ns or 0) + (tr.backward_ns or 0)
    _optimizer_start_ns = _now_ns()


def _optimizer_post(optimizer, args, kwargs):
    """The optimizer phase is the outermost step call, less the forward and backward that a
    closure (``step(closure)``: LBFGS, Lightning) ran inside it, so phases never overlap."""
    tr = _tracer
    if tr is None:
        return
    tr.optimizer_depth -= 1
    if tr.optimizer_depth > 0:
        return
    tr.optimizer_depth = 0
    if tr.in_step:
        inner = (tr.forward_ns or 0) + (tr.backward_ns or 0) - _optimizer_inner_ns
        tr.optimizer_ns = (tr.optimizer_ns or 0) + (_now_ns() - _optimizer_start_ns - inner)
        tr.phase_depth = max(0, tr.phase_depth - 1)
        tr.phase = step_mod.STEP
        if tr.gpu_step is not None:
            tr.gpu_step.end(OPTIMIZER)
        if tr.auto is not None:
            tr.auto.after_optimizer(optimizer)


def _timed_backward(original):
    @functools.wraps(original)
    def backward(*args, **kwargs):
        tr = _tracer
        if tr is None:
            return original(*args, **kwargs)
        if not tr.in_step:
            if tr.auto is None:
                return original(*args, **kwargs)
            tr.auto.open()
        gpu = tr.gpu_step
        if gpu is not None:
            gpu.begin(BACKWARD)
        tr.phase_depth += 1
        outer, tr.phase = tr.phase, step_mod.BACKWARD
        start = _now_ns()
        try:
            return original(*args, **kwargs)
        finally:
            tr.backward_ns = (tr.backward_ns or 0) + (_now_ns() - start)
            tr.phase_depth -= 1
            tr.phase = outer
            if gpu is not None:
                gpu.end(BACKWARD)

    backward.__traceml_original__ = original
    return backward


def _timed_next(original):
    @functools.wraps(original)
    def __next__(self):
        tr = _tracer
        if tr is None:
            return original(self)
        if not tr.in_step and tr.auto is not None:
            tr.auto.open()  # a zero-code step opens with its first batch
        tr.phase_depth += 1  # a copy made by the loader (collate_fn) is input time, not H2D
        outer, tr.phase = tr.phase, step_mod.DATALOADER
        batch = None
        start = _now_ns()
        try:
            batch = original(self)
            return batch
        finally:
            elapsed = _now_ns() - start
            tr.add_dataloader(elapsed, id(self), *workload.batch_counts(batch))
            tr.phase_depth -= 1
            tr.phase = outer

    __next__.__traceml_original__ = original
    return __next__


def _timed_copy(original):
    """Wrap ``Tensor.to``/``Tensor.cuda``: a call that returns a CUDA tensor for a host tensor is
    an H2D copy. A call on a CUDA tensor passes through after one attribute check (the cost
    of the wrapper is measured by benchmarks/gpu_check.py); under ``torch.compile`` tracing
    the wrapper reads no TraceML state (no guards, no graph break)."""

    @functools.wraps(original)
    def timed_copy(self, *args, **kwargs):
        if self.is_cuda or _is_compiling():  # first: a traced graph never sees the state below
            return original(self, *args, **kwargs)
        tr = _tracer
        if (
            tr is None
            or not tr.in_step
            or tr.forward_depth
            or tr.phase_depth
            or threading.get_ident() != _h2d_thread
        ):
            return original(self, *args, **kwargs)
        gpu = tr.gpu_step
        if gpu is not None:
            gpu.begin(H2D)
        tr.phase = step_mod.H2D
        start = _now_ns()
        try:
            out = original(self, *args, **kwargs)
        except BaseException:
            if gpu is not None:
                gpu.cancel(H2D)
            raise
        finally:
            tr.phase = step_mod.STEP  # an H2D copy is counted only outside the other phases
        elapsed = _now_ns() - start
        if out.is_cuda:
            tr.h2d_ns += elapsed
            if gpu is not None:
                gpu.end(H2D)
        elif gpu is not None:
            gpu.cancel(H2D)
        return out

    timed_copy.__traceml_original__ = original
    return timed_copy
