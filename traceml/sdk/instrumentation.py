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
  ``init()`` (the method is replaced on the iterator base class).

Code the automatic mode cannot see can be timed with :func:`traceml.phase`.
"""

from __future__ import annotations

import functools
import time
import weakref

from traceml.sdk.step import StepTracer

_now_ns = time.perf_counter_ns
_tracer: StepTracer | None = None
_hooked_models: "weakref.WeakSet" = weakref.WeakSet()
_installed = False

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
            _forward_start_ns = _now_ns()
        tr.forward_depth += 1


def _forward_post(module, args, output):
    tr = _tracer
    if tr is not None and tr.in_step and tr.forward_depth > 0:
        tr.forward_depth -= 1
        if tr.forward_depth == 0:
            tr.forward_ns = (tr.forward_ns or 0) + (_now_ns() - _forward_start_ns)


_optimizer_start_ns = 0


def _optimizer_pre(optimizer, args, kwargs):
    global _optimizer_start_ns
    _optimizer_start_ns = _now_ns()


def _optimizer_post(optimizer, args, kwargs):
    tr = _tracer
    if tr is not None and tr.in_step:
        tr.optimizer_ns = (tr.optimizer_ns or 0) + (_now_ns() - _optimizer_start_ns)


def _timed_backward(original):
    @functools.wraps(original)
    def backward(*args, **kwargs):
        tr = _tracer
        if tr is None or not tr.in_step:
            return original(*args, **kwargs)
        start = _now_ns()
        try:
            return original(*args, **kwargs)
        finally:
            tr.backward_ns = (tr.backward_ns or 0) + (_now_ns() - start)

    backward.__traceml_original__ = original
    return backward


def _timed_next(original):
    @functools.wraps(original)
    def __next__(self):
        tr = _tracer
        if tr is None:
            return original(self)
        start = _now_ns()
        try:
            return original(self)
        finally:
            tr.add_dataloader(_now_ns() - start)

    __next__.__traceml_original__ = original
    return __next__
