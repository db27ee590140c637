"""Automatic phase timing: hooks that attribute time inside a step to its phases.

Installed once by :func:`install` (called from ``traceml.init()``); each hook costs one
attribute check when no step is open. What is timed, on the CPU clock:

* forward — the outermost call of each model passed to ``trace_step(model)`` (a forward
  pre-hook and hook on that module only, not on its submodules; a DDP or FSDP wrapper is timed
  as the call the user makes);
* backward — ``torch.autograd.backward``, which ``Tensor.backward`` also goes through;
* optimizer — ``Optimizer.step`` of any ``torch.optim.Optimizer`` (fused and foreach included),
  through torch's global optimizer step hooks;
* DataLoader — ``__next__`` of every DataLoader iterator, also of iterators created before
  ``init()`` (the method is replaced on the iterator base class);
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
"""

from __future__ import annotations

import functools
import threading
import time
import weakref

from traceml.sdk.step import StepTracer
from traceml.sdk.timing import BACKWARD, FORWARD, H2D, OPTIMIZER

_now_ns = time.perf_counter_ns
_tracer: StepTracer | None = None
_hooked_models: "weakref.WeakSet" = weakref.WeakSet()
_installed = False
_h2d_thread: int | None = None  # thread whose copies count as H2D (the one that called init())

#: Phase names accepted by :func:`add_phase` (and ``traceml.phase``).
PHASES = ("forward", "backward", "optimizer", "h2d")


def install(tracer: StepTracer) -> None:
    """Route phase timings to ``tracer`` and install the global hooks (once per process)."""
    global _tracer, _installed
    _tracer = tracer
    if _installed:
        return
    import torch
    from torch.optim.optimizer import (
        register_optimizer_step_post_hook,
        register_optimizer_step_pre_hook,
    )
    from torch.utils.data import dataloader

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


def uninstall() -> None:
    """Stop attributing time (hooks stay in place and pass through)."""
    global _tracer
    _tracer = None


def watch_model(model) -> None:
    """Time the outermost forward call of ``model`` (an ``nn.Module``); idempotent."""
    if model is None or model in _hooked_models:
        return
    model.register_forward_pre_hook(_forward_pre)
    model.register_forward_hook(_forward_post, always_call=True)
    _hooked_models.add(model)


def add_phase(name: str, elapsed_ns: int) -> None:
    """Add ``elapsed_ns`` to phase ``name`` (one of :data:`PHASES`) of the open step."""
    tr = _tracer
    if tr is None or not tr.in_step:
        return
    attr = f"{name}_ns"
    setattr(tr, attr, (getattr(tr, attr) or 0) + elapsed_ns)


# --- hooks ---------------------------------------------------------------------------------------
_forward_start_ns = 0


def _forward_pre(module, args):
    global _forward_start_ns
    tr = _tracer
    if tr is not None and tr.in_step:
        if tr.forward_depth == 0:
            if tr.gpu_step is not None:
                tr.gpu_step.begin(FORWARD)
            _forward_start_ns = _now_ns()
        tr.forward_depth += 1


def _forward_post(module, args, output):
    tr = _tracer
    if tr is not None and tr.in_step and tr.forward_depth > 0:
        tr.forward_depth -= 1
        if tr.forward_depth == 0:
            tr.forward_ns = (tr.forward_ns or 0) + (_now_ns() - _forward_start_ns)
            if tr.gpu_step is not None:
                tr.gpu_step.end(FORWARD)


_optimizer_start_ns = 0


def _optimizer_pre(optimizer, args, kwargs):
    global _optimizer_start_ns
    tr = _tracer
    if tr is not None and tr.in_step:
        tr.phase_depth += 1
        if tr.gpu_step is not None:
            tr.gpu_step.begin(OPTIMIZER)
    _optimizer_start_ns = _now_ns()


def _optimizer_post(optimizer, args, kwargs):
    tr = _tracer
    if tr is not None and tr.in_step:
        tr.optimizer_ns = (tr.optimizer_ns or 0) + (_now_ns() - _optimizer_start_ns)
        tr.phase_depth = max(0, tr.phase_depth - 1)
        if tr.gpu_step is not None:
            tr.gpu_step.end(OPTIMIZER)


def _timed_backward(original):
    @functools.wraps(original)
    def backward(*args, **kwargs):
        tr = _tracer
        if tr is None or not tr.in_step:
            return original(*args, **kwargs)
        gpu = tr.gpu_step
        if gpu is not None:
            gpu.begin(BACKWARD)
        tr.phase_depth += 1
        start = _now_ns()
        try:
            return original(*args, **kwargs)
        finally:
            tr.backward_ns = (tr.backward_ns or 0) + (_now_ns() - start)
            tr.phase_depth -= 1
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
        tr.phase_depth += 1  # a copy made by the loader (collate_fn) is input time, not H2D
        start = _now_ns()
        try:
            return original(self)
        finally:
            tr.add_dataloader(_now_ns() - start)
            tr.phase_depth -= 1

    __next__.__traceml_original__ = original
    return __next__


def _timed_copy(original):
    """Wrap ``Tensor.to``/``Tensor.cuda``: a call that returns a CUDA tensor for a host tensor is
    an H2D copy. A call on a CUDA tensor passes through after one attribute check (the cost
    of the wrapper is measured by benchmarks/gpu_check.py); under ``torch.compile`` tracing
    the wrapper reads no TraceML state (no guards, no graph break)."""
    import torch

    is_compiling = torch.compiler.is_compiling

    @functools.wraps(original)
    def copy(self, *args, **kwargs):
        if self.is_cuda or is_compiling():  # first: a traced graph never sees the state below
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
        start = _now_ns()
        try:
            out = original(self, *args, **kwargs)
        except BaseException:
            if gpu is not None:
                gpu.cancel(H2D)
            raise
        elapsed = _now_ns() - start
        if out.is_cuda:
            tr.h2d_ns += elapsed
            if gpu is not None:
                gpu.end(H2D)
        elif gpu is not None:
            gpu.cancel(H2D)
        return out

    copy.__traceml_original__ = original
    return copy
