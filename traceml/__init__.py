"""TraceML: why is my PyTorch training slow?

Public API (everything else is internal)::

    import traceml

    traceml.init()                      # once per rank, after torch.distributed is set up
    for batch in loader:
        with traceml.trace_step(model):  # one optimizer step
            ...
    metrics = traceml.summary()         # rank 0: the verdict so far, as a flat dict

Run the script with ``traceml run train.py --nproc-per-node=N``; see ``docs/quickstart.md``.
"""

from __future__ import annotations

import contextlib
import time

__version__ = "0.1.0"
__all__ = ["init", "trace_step", "phase", "summary", "shutdown", "__version__"]


def init(aggregator: str | None = None, run_name: str | None = None) -> bool:
    """Start telemetry for this rank. Safe to call more than once; never raises.

    Reads the rank's identity from the variables torchrun exports (``RANK``, ``LOCAL_RANK``,
    ``GROUP_RANK``, ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``, ``TORCHELASTIC_RESTART_COUNT``) and the
    aggregator endpoint and run name from ``TRACEML_AGGREGATOR``/``TRACEML_RUN_NAME`` (exported
    by ``traceml run``), unless given here.

    Args:
        aggregator: ``host:port`` of a ``traceml-aggregator``; overrides the environment.
        run_name: the run's name; overrides the environment.

    Returns:
        True when telemetry is on; False (after one warning line) when no aggregator is
        configured, ``TRACEML_DISABLE=1``, or the SDK could not start.
    """
    from traceml.sdk import failopen, rank_state

    try:
        return rank_state.start(aggregator, run_name) is not None
    except Exception as exc:
        failopen.fail_open("traceml.init()", exc)
        return False


class _StepContext:
    """The context manager returned by :func:`trace_step` (reused: no allocation per step).

    ``forward`` times the forward of the model of the step being opened (a
    :class:`~traceml.sdk.instrumentation.ForwardTimer`, None without a model); it is in place
    only between ``__enter__`` and ``__exit__``.
    """

    __slots__ = ("_state", "forward")

    def __init__(self, state) -> None:
        self._state = state
        self.forward = None

    def __enter__(self):
        try:
            self._state.tracer.begin()
            if self.forward is not None:
                self.forward.install()
        except Exception as exc:
            _fail(exc)
        return self

    def __exit__(self, exc_type, exc, tb):
        try:
            if self.forward is not None:
                self.forward.remove()
            if exc_type is None:
                self._state.tracer.end()
            else:
                self._state.tracer.abandon()
        except Exception as error:
            _fail(error)
        return False


def _fail(exc: BaseException) -> None:
    from traceml.sdk import failopen

    failopen.fail_open("trace_step", exc)


_NULL = contextlib.nullcontext()


def _current_state():
    """The process's rank state (``traceml.sdk.rank_state.current``), imported on the first call.

    The import is not at the top of this module: the launcher imports the package too, and does
    not need the SDK. Nor is it in :func:`trace_step`: ``from package import module`` runs
    importlib's Python-level ``_handle_fromlist`` on every call, ~1 µs a step.
    """
    global _current_state
    from traceml.sdk.rank_state import current

    _current_state = current
    return current()


def trace_step(model=None):
    """Mark one optimizer step: ``with traceml.trace_step(model): ...``.

    Measures the step time and, automatically, input wait, forward (the outermost call of
    ``model``), backward, optimizer step and DataLoader ``__next__`` time on the CPU clock (ms in
    the reports, µs on the wire). Without a rank state it is a no-op context; so is a
    ``trace_step`` opened inside an open step (its time is the outer step's, with one warning).

    Args:
        model: the ``torch.nn.Module`` the step runs (a DDP/FSDP wrapper is fine), or None
            to time the step without a forward phase.
    """
    state = _current_state()
    if state is None:
        return _NULL
    # Nested by mistake: the inner block is part of the open step. An open zero-code step is
    # no such step: the explicit one takes over from it (StepTracer.begin).
    if state.tracer.in_step and state.tracer.auto is None:
        state.note_nested_step()
        return _NULL
    ctx = state.step_context
    if ctx is None:
        ctx = state.step_context = _StepContext(state)
    if model is None:
        ctx.forward = None
    elif ctx.forward is None or not ctx.forward.watches(model):  # a model new to this context
        try:
            from traceml.sdk import instrumentation

            ctx.forward = instrumentation.ForwardTimer(model)
            state.note_model(model)
        except Exception as exc:
            ctx.forward = None
            _fail(exc)
    return ctx


@contextlib.contextmanager
def phase(name: str):
    """Time a block as phase ``name`` of the open step, for code the hooks cannot see.

    Args:
        name: one of ``"forward"``, ``"backward"``, ``"optimizer"``, ``"h2d"``.

    Raises:
        ValueError: ``name`` is not a known phase.
    """
    from traceml.sdk import instrumentation

    if name not in instrumentation.PHASES:
        raise ValueError(f"unknown phase {name!r}; expected one of {instrumentation.PHASES}")
    start = time.perf_counter_ns()
    try:
        yield
    finally:
        instrumentation.add_phase(name, time.perf_counter_ns() - start)


def summary(prefix: str = "traceml/", timeout_s: float | None = None) -> dict:
    """The verdict so far and its key figures, as one flat dict (rank 0; ``{}`` elsewhere).

    Call it at the end of training, before the script exits: the aggregator analyses what it
    has stored (this rank's steps are flushed first) and answers with, e.g.::

        {"traceml/verdict": "INPUT_BOUND", "traceml/severity": "critical",
         "traceml/step_time_ms": 41.2, "traceml/input_wait_ms": 30.1,
         "traceml/input_wait_pct": 73.0, ...}

    Numbers (``*_ms``, ``*_pct``, ``*_bytes``, counts) suit ``wandb.log`` and
    ``mlflow.log_metrics``; strings (``verdict``, ``severity``, ``clock``, ...) suit
    ``mlflow.set_tags``. Unmeasured figures are absent. See ``docs/reading-output.md``.

    Args:
        prefix: prepended to every name.
        timeout_s: bound of the whole call, s (default ``TRACEML_SUMMARY_TIMEOUT_SEC``, 30).

    Returns:
        The dict; ``{}`` on ranks other than 0, and (after one warning) without a rank state or
        when the aggregator cannot answer. Never raises (unless ``TRACEML_STRICT=1``).
    """
    from traceml.sdk import failopen, summary_query

    try:
        return summary_query.fetch(prefix, timeout_s)
    except Exception as exc:
        failopen.fail_open("traceml.summary()", exc)
        return {}


def shutdown() -> None:
    """Flush telemetry and send this rank's finish marker now (also done at exit)."""
    from traceml.sdk import rank_state

    s = rank_state.current()
    if s is not None:
        s.close()
