"""Automatic phase timing: hooks that attribute time inside a step to its phases.

Installed once by :func:`install` (called from ``traceml.init()``); each hook costs one
attribute check when no step is open. The forward timer is the exception: it is in place only
while a step of its model is open, so the model is untouched between steps. What is timed, on
the CPU clock:

* forward — the outermost call of the model passed to ``trace_step(model)``, during that step
  (:class:`ForwardTimer`; not its submodules: a DDP or FSDP wrapper is timed as the call the
  user makes);
* backward — the outermost ``torch.autograd.backward``, which ``Tensor.backward`` also goes
  through. Inner calls are part of it: reentrant activation checkpointing
  (``checkpoint(use_reentrant=True)``, the default of Hugging Face and many trainers) runs
  ``torch.autograd.backward`` again from inside the backward, on an autograd thread on GPUs,
  so the count of backward calls in progress is per process, not per thread. A forward of
  the traced model recomputed there, and an optimizer step run from a backward hook (the
  "optimizer step in backward" pattern), are backward time too: phases never overlap, so
  they never sum to more than the step. Zero-code steps still end at such an optimizer step:
  the boundary is taken as the outermost backward ends;
* optimizer — ``Optimizer.step`` of any ``torch.optim.Optimizer`` (fused and foreach included),
  through torch's global optimizer step hooks;
* DataLoader — ``__next__`` of every DataLoader iterator, also of iterators created before
  ``init()`` (the method is replaced on the iterator base class); the batch's samples and
  tokens are read from its shapes (:func:`traceml.sdk.workload.batch_counts`);
* H2D — ``Tensor.to`` and ``Tensor.cuda`` calls that turn a host tensor into a CUDA tensor
  (``non_blocking=True`` and pinned memory included), made by the thread that called
  ``init()`` inside a step and outside the other phases (a copy inside the forward, backward,
  optimizer step or DataLoader ``__next__`` is that phase's time, so phases never overlap).
  Installed by :func:`install_h2d` only when torch is built with CUDA, and reported once the
  rank uses a CUDA device; on CPU-only runs H2D is absent, never 0. The first copy's
  destination tells the rank's device (:meth:`traceml.sdk.device.RankDevice.note_copy`).

In a forked child (a DataLoader worker) every hook passes through: the child inherits the
parent's thread identity and its open step, and the H2D path would make CUDA calls there.

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
import os
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
_rank_device = None  # the RankDevice told of H2D copies' destination, until it is found
#: ``torch.autograd.backward`` calls in progress in the process (any thread): the outermost
#: one is timed, inner ones (reentrant checkpointing) are part of it.
_backward_depth = 0
#: Optimizers whose step ran inside the backward in progress (zero-code step boundaries).
_stepped_in_backward: list = []

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


def install_h2d(device=None) -> None:
    """Time host-to-device copies (``Tensor.to``, ``Tensor.cuda``) made by the calling thread
    inside a step; call once torch is known to be built with CUDA (idempotent).

    Args:
        device: the rank's :class:`~traceml.sdk.device.RankDevice`, told where the first
            copy went (None: nobody is told).
    """
    global _h2d_thread, _rank_device
    import torch

    _h2d_thread = threading.get_ident()
    _rank_device = device
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

    A model that has forward pre-hooks runs them before its ``forward``: FSDP2's root
    (``fully_shard``) unshards its parameters there (an all-gather and its wait). For such a
    model the timer also puts a pre-hook of its own first, while installed, and the forward is
    timed from there (before, the unshard landed in the step's residual). The model already
    takes torch's slow call path for its own hooks, so this adds one hook call, not a path.

    Args:
        model: the ``torch.nn.Module`` passed to ``trace_step`` (held weakly).

    Raises:
        TypeError: ``model`` is not a ``torch.nn.Module``.
    """

    __slots__ = ("_model", "_forward", "_saved", "_hook", "_early")

    def __init__(self, model) -> None:
        import torch

        if not isinstance(model, torch.nn.Module):
            raise TypeError(
                f"trace_step(model) takes a torch.nn.Module, not {type(model).__name__}"
            )
        self._model = weakref.ref(model)
        self._forward = None  # the model's own forward, while installed
        self._saved = _ABSENT  # what the instance ``__dict__`` held under "forward"
        self._hook = None  # handle of the pre-hook put first, while installed
        self._early = None  # (start ns, GPU step) of a forward opened by the pre-hook

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
        if model._forward_pre_hooks:
            self._hook = model.register_forward_pre_hook(_FirstPreHook(self), prepend=True)

    def remove(self) -> None:
        """Give the model its own forward back (the step closes); a forward the step body
        assigned itself is left in place."""
        model = self._model()
        if model is not None and model.__dict__.get("forward") is self:
            if self._saved is _ABSENT:
                del model.__dict__["forward"]
            else:
                model.__dict__["forward"] = self._saved
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        self._forward = None
        self._saved = _ABSENT
        self._early = None

    def _timing(self):
        """The tracer when a call starting now is the step's forward, else None."""
        tr = _tracer
        # forward_depth: a nested call; _backward_depth: recomputed by checkpointing
        if tr is None or not tr.in_step or tr.forward_depth or _backward_depth:
            return None
        return tr

    def _pre_hook(self) -> None:
        """First of the model's pre-hooks: the forward starts here, before theirs."""
        if _is_compiling():
            return
        tr = self._timing()
        if tr is not None:
            gpu = tr.gpu_step
            if gpu is not None:
                gpu.begin(FORWARD)
            self._early = (_now_ns(), gpu)

    def __call__(self, *args, **kwargs):
        forward = self._forward
        if forward is None:  # a reference kept from inside a step, called after it closed
            forward = self._model().forward
        if _is_compiling():  # first: a graph traced by torch.compile never sees the state below
            return forward(*args, **kwargs)
        early, self._early = self._early, None
        tr = self._timing()
        if tr is None:
            return forward(*args, **kwargs)
        if early is None:
            gpu = tr.gpu_step
            if gpu is not None:
                gpu.begin(FORWARD)
        else:
            gpu = early[1]
        tr.forward_depth = 1
        outer, tr.phase = tr.phase, step_mod.FORWARD
        counter = None
        if _grad_enabled():  # a training forward: its model FLOPs count (see workload)
            tr.train_forwards += 1
            if tr.flops_counter is not None and tr.steps_completed >= workload.COUNT_STEP:
                counter = tr.flops_counter
        start = _now_ns() if early is None else early[0]
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


def _no_hook(module, args) -> None:
    """What a copy of :class:`_FirstPreHook` is: nothing."""


class _FirstPreHook:
    """A :class:`ForwardTimer`'s pre-hook on its model, while the timer is installed. A model
    pickled or deep-copied during a step gets :func:`_no_hook` in its place, never the timer."""

    __slots__ = ("_timer",)

    def __init__(self, timer: ForwardTimer) -> None:
        self._timer = timer

    def __call__(self, module, args) -> None:
        if self._timer._model() is module:
            self._timer._pre_hook()

    def __reduce_ex__(self, protocol):
        return _no_hook.__reduce_ex__(protocol)

    def __deepcopy__(self, memo):
        return _no_hook


_optimizer_start_ns = 0
_optimizer_inner_ns = 0  # forward + backward of the open step when its optimizer step began


def _optimizer_pre(optimizer, args, kwargs):
    global _optimizer_start_ns, _optimizer_inner_ns
    tr = _tracer
    if _backward_depth:  # a step from a backward hook: backward time (see the docstring)
        if tr is not None and tr.auto is not None and optimizer not in _stepped_in_backward:
            _stepped_in_backward.append(optimizer)
        return
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
    if tr is None or _backward_depth:
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
        global _backward_depth
        tr = _tracer
        if tr is None or _backward_depth:  # an inner call (reentrant checkpointing)
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
        _backward_depth += 1
        start = _now_ns()
        try:
            return original(*args, **kwargs)
        finally:
            tr.backward_ns = (tr.backward_ns or 0) + (_now_ns() - start)
            _backward_depth -= 1
            tr.phase_depth -= 1
            tr.phase = outer
            if gpu is not None:
                gpu.end(BACKWARD)
            if _stepped_in_backward:
                _end_steps_in_backward(tr)

    backward.__traceml_original__ = original
    return backward


def _end_steps_in_backward(tr: StepTracer) -> None:
    """Zero-code step boundaries of the optimizer steps a backward ran (see the docstring)."""
    stepped = list(_stepped_in_backward)
    _stepped_in_backward.clear()
    for optimizer in stepped:
        if tr.auto is None:
            return
        tr.auto.before_optimizer(optimizer)
        if tr.auto is not None:
            tr.auto.after_optimizer(optimizer)


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
            device = _rank_device
            if device is not None and device.index is None:
                device.note_copy(out.get_device())
        elif gpu is not None:
            gpu.cancel(H2D)
        return out

    timed_copy.__traceml_original__ = original
    return timed_copy


def _after_fork_in_child() -> None:
    """A forked child (a DataLoader worker): every hook passes through from now on."""
    global _tracer, _h2d_thread, _rank_device, _backward_depth
    _tracer = _h2d_thread = _rank_device = None
    _backward_depth = 0
    _stepped_in_backward.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)
