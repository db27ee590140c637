"""Zero-code steps: step boundaries from the optimizer, forward from the model that owns it.

Used by ``traceml run`` for a script that never calls ``trace_step`` (see
:mod:`traceml.sdk.autorun`) and by the framework callbacks in :mod:`traceml.integrations`.
The phase hooks are the SDK's own (:mod:`traceml.sdk.instrumentation`); this module only
decides where steps begin and end, and which model's forward is timed:

* a step ends when the *step optimizer* (the first optimizer whose ``step()`` runs) finishes a
  step, seen through torch's global optimizer step hooks; the next step opens at that instant,
  so steps are contiguous and the time between two optimizer steps (``zero_grad``, an LR
  scheduler, logging) is in the step, as residual;
* the first step opens at the first DataLoader ``__next__``, backward or optimizer step;
* input wait is the DataLoader ``__next__`` time inside the step (a loop that reads its
  batches some other way has an input wait of 0);
* forward is the outermost call of each *root model*: the outermost module holding an
  optimizer's first parameter (a DDP/FSDP wrapper when there is one), for the optimizers that
  exist as the first step opens and for each optimizer as it first steps. It is looked for in
  the calling frames first (:func:`frame_root_models`: the training loop's locals, a
  Trainer's attributes), and only when they hold no such module in the garbage collector's
  objects (:func:`root_models`, tenths of a second). A forward that ran before the first step
  opened (step 0's in a plain loop without a DataLoader) is not timed;
* an explicit ``trace_step`` wins: its first step ends zero-code steps for the rest of the
  process (the zero-code step open then is dropped as if it had never opened), so no step is
  counted twice.

``docs/frameworks.md`` says what a step is with gradient accumulation, two optimizers,
``torch.compile`` and an LR scheduler. Fail-open: an error here is one warning, and zero-code
steps stop; training goes on unchanged.
"""

from __future__ import annotations

import gc
import sys
import weakref
from collections.abc import Callable

from traceml.sdk import instrumentation
from traceml.sdk.rank_state import RankState, fail_open
from traceml.sdk.step import StepTracer


class AutoSteps:
    """A rank's zero-code step boundaries (the tracer's ``auto``; made by :func:`enable`).

    Called only from the SDK's hooks, on the training thread.

    Args:
        tracer: the rank's step tracer (its ``auto`` is this object while zero-code steps last).
        on_model: called with each model whose forward is timed (``RankState.note_model``).
    """

    def __init__(self, tracer: StepTracer, on_model: Callable[[object], None]) -> None:
        self._on_model = on_model
        self._tracer = tracer
        self._optimizers: dict[int, weakref.ref] = {}  # id -> optimizer, each seen once
        self._step_optimizer: weakref.ref | None = None
        self._step_optimizer_id = 0
        self._timers: list[instrumentation.ForwardTimer] = []
        self._opened = False
        self._rooted: dict[int, weakref.ref] = {}  # id -> optimizer whose root is timed

    def open(self) -> None:
        """Open a step now. As the first one opens (at the first DataLoader batch, backward or
        optimizer step), the root models of the optimizers that exist then are timed, so the
        first step's forward is seen too when the optimizer was made before it."""
        self._tracer.open(instrumentation._now_ns())
        if not self._opened:
            self._opened = True
            try:
                self._time_roots(None)
            except Exception as exc:
                self._fail(exc)

    def time_forward(self, model) -> None:
        """Time the outermost calls of ``model`` (a ``torch.nn.Module``) as forward."""
        if any(timer.watches(model) for timer in self._timers):
            return
        timer = instrumentation.ForwardTimer(model)
        timer.install()
        self._timers.append(timer)
        self._on_model(model)

    def _time_roots(self, optimizers) -> None:
        """Time the root models of ``optimizers`` (None: every live optimizer), found in the
        calling frames, else by the scan of live objects (the optimizers the frames did not
        root)."""
        models, rooted = frame_root_models(sys._getframe(1), optimizers)
        if optimizers is None:
            left = None if not rooted else []  # no optimizer in the frames: every live one
        else:
            done = {id(optimizer) for optimizer in rooted}
            left = [optimizer for optimizer in optimizers if id(optimizer) not in done]
        if left is None or left:
            scanned_models, scanned = root_models(left)
            models, rooted = models + scanned_models, rooted + scanned
        for optimizer in rooted:  # their roots are timed: nothing to find at their first step
            self._rooted[id(optimizer)] = weakref.ref(optimizer)
        for model in models:
            self.time_forward(model)

    def before_optimizer(self, optimizer) -> None:
        """An outermost optimizer step begins: open the step; on this optimizer's first step,
        make it the step optimizer if there is none (or it is gone) and time its root model."""
        if not self._tracer.in_step:
            self.open()
        ref = self._optimizers.get(id(optimizer))
        if ref is not None and ref() is optimizer:
            return
        try:
            self._optimizers[id(optimizer)] = weakref.ref(optimizer)
            step = self._step_optimizer
            if step is None or step() is None:
                self._step_optimizer = weakref.ref(optimizer)
                self._step_optimizer_id = id(optimizer)
            ref = self._rooted.get(id(optimizer))
            if ref is None or ref() is not optimizer:
                self._time_roots([optimizer])
        except Exception as exc:
            self._fail(exc)

    def after_optimizer(self, optimizer) -> None:
        """An outermost optimizer step ended: after the step optimizer's, the next step."""
        if id(optimizer) != self._step_optimizer_id:
            return
        try:
            self._tracer.next_step()
        except Exception as exc:
            self._fail(exc)

    def stop(self) -> None:
        """End zero-code steps: the model's forward is its own again, the open step is
        dropped, the tracer is the script's (``trace_step``) from now on."""
        for timer in self._timers:
            timer.remove()
        self._timers.clear()
        tracer = self._tracer
        tracer.auto = None
        if tracer.in_step:
            tracer.drop()

    def _fail(self, exc: BaseException) -> None:
        self.stop()
        fail_open("zero-code step tracing", exc)


def start(model=None) -> bool:
    """Start this rank's telemetry (``traceml.init()``) and zero-code steps; never raises.

    Args:
        model: as for :func:`enable`.

    Returns:
        True when zero-code steps are on; False when telemetry is off (one warning), the
        script already uses ``trace_step``, or starting failed (one warning).
    """
    import traceml
    from traceml.sdk import rank_state

    try:
        return traceml.init() and enable(rank_state.current(), model) is not None
    except Exception as exc:
        fail_open("zero-code instrumentation", exc)
        return False


def enable(state: RankState | None, model=None) -> AutoSteps | None:
    """Turn on zero-code steps for ``state`` (idempotent); time ``model``'s forward too.

    Does nothing (returns None) without a rank state, or once the script has used
    ``trace_step`` (its steps win).

    Args:
        state: the rank's state (``traceml.sdk.rank_state.current()``).
        model: a ``torch.nn.Module`` to time as forward now (a framework callback knows it
            before the first optimizer step), or None to find it from the optimizer.
    """
    if state is None or state.step_context is not None:
        return None
    tracer = state.tracer
    auto = tracer.auto
    if auto is None:
        auto = tracer.auto = AutoSteps(tracer, state.note_model)
    if model is not None:
        auto.time_forward(model)
    return auto


#: Most calling frames :func:`frame_root_models` looks at (a Trainer's stack is ~30 deep).
MAX_FRAMES = 200


def frame_root_models(frame, optimizers=None) -> tuple[list, list]:
    """The root model of each optimizer, from what the calling frames hold: the outermost
    ``torch.nn.Module`` among them that holds the optimizer's first parameter.

    Looked at, in each frame from ``frame`` outwards (at most :data:`MAX_FRAMES`, TraceML's own
    frames skipped): its local variables, and the attributes (``__dict__``) of its ``self``
    (a Trainer's ``model``, ``model_wrapped``, ``optimizer``; a Lightning strategy's
    ``_model``). The training loop holds its model and optimizer there in a plain loop and in
    the HF ``Trainer``: microseconds to a millisecond, once per optimizer, against tenths of a
    second for :func:`root_models`' scan. (Lightning fetches its first batch where no frame
    holds the optimizer: the scan finds it then.) Among modules holding
    the parameter, the one that contains the others (a DDP wrapper contains its module) wins.
    On Python < 3.13, reading a function frame's locals makes CPython keep a snapshot of them
    in the frame until it returns or they are read again (``frame.f_locals``): objects those
    locals held at that instant (the loop's current batch, say) may live that long.

    Args:
        frame: the innermost frame to look at (``sys._getframe()``).
        optimizers: ``torch.optim.Optimizer`` objects, or None for those the frames hold.

    Returns:
        ``(root models, the optimizers whose root was found)``; an optimizer whose parameter
        no module in the frames holds is left out (the scan's to find), one without
        parameters counts as found (nothing to time).
    """
    import torch

    module_type, optimizer_type = torch.nn.Module, torch.optim.Optimizer
    modules: dict[int, torch.nn.Module] = {}
    found: dict[int, torch.optim.Optimizer] = {}
    for value in _frame_values(frame):
        kind = type(value)
        if issubclass(kind, module_type):
            modules.setdefault(id(value), value)
        elif optimizers is None and issubclass(kind, optimizer_type):
            found.setdefault(id(value), value)
    roots, rooted = [], []
    for optimizer in found.values() if optimizers is None else optimizers:
        try:
            first = next((p for group in optimizer.param_groups for p in group["params"]), None)
        except Exception:  # an optimizer-like object in a frame, not usable
            if optimizers is not None:
                raise
            continue
        if first is not None:
            owners = [m for m in modules.values() if any(p is first for p in m.parameters())]
            if not owners:
                continue
            owner_ids = {id(m) for m in owners}
            root = max(owners, key=lambda m: sum(id(sub) in owner_ids for sub in m.modules()))
            if all(root is not r for r in roots):
                roots.append(root)
        rooted.append(optimizer)
    return roots, rooted


def _frame_values(frame):
    """The local variables of ``frame`` and of each outer frame (TraceML's own left out), and
    the attributes of each frame's ``self``; told apart by real type, never ``__class__``."""
    for _ in range(MAX_FRAMES):
        if frame is None:
            return
        if not str(frame.f_globals.get("__name__", "")).startswith("traceml."):
            local = frame.f_locals
            yield from list(local.values())
            owner = local.get("self")
            if owner is not None:
                try:
                    state = object.__getattribute__(owner, "__dict__")
                except Exception:  # no __dict__ (slots, builtins)
                    state = None
                if type(state) is dict:
                    yield from list(state.values())
        frame = frame.f_back


def root_models(optimizers=None) -> tuple[list, list]:
    """The root model of each optimizer: the outermost module holding its first parameter.

    Args:
        optimizers: ``torch.optim.Optimizer`` objects, or None for every live one.

    Returns:
        ``(root models, the optimizers looked at)``.

    One pass over the garbage collector's objects (every live ``torch.nn.Module`` and, with
    None, optimizer): 0.2-0.5 s for 288k objects on a loaded 2-core machine; made only for
    what :func:`frame_root_models` did not find. Among several parents of a module, the first
    one found is followed. Objects are told apart by their real type (``type(obj)``), never
    ``obj.__class__``, which some objects compute (and warn or raise on).
    """
    import torch

    module_type, optimizer_type = torch.nn.Module, torch.optim.Optimizer
    modules, found = [], []
    for obj in gc.get_objects():
        kind = type(obj)
        if issubclass(kind, module_type):
            modules.append(obj)
        elif optimizers is None and issubclass(kind, optimizer_type):
            found.append(obj)
    firsts = set()
    for optimizer in found if optimizers is None else optimizers:
        try:
            first = next((p for group in optimizer.param_groups for p in group["params"]), None)
        except Exception:  # an optimizer-like object found by the scan, not usable
            if optimizers is not None:
                raise
            continue
        if first is not None:
            firsts.add(id(first))
    parent: dict[int, torch.nn.Module] = {}
    owners = []
    for module in modules:
        state = module.__dict__  # a module still in its __init__ may have neither dict yet
        for child in (state.get("_modules") or {}).values():
            if child is not None:
                parent.setdefault(id(child), module)
        if any(id(p) in firsts for p in (state.get("_parameters") or {}).values()):
            owners.append(module)
    roots = []
    for owner in owners:
        seen = set()
        while id(owner) in parent and id(owner) not in seen:
            seen.add(id(owner))
            owner = parent[id(owner)]
        if all(owner is not root for root in roots):
            roots.append(owner)
    return roots, found if optimizers is None else list(optimizers)
