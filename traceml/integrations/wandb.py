"""TraceML's verdict and key figures in a Weights & Biases run.

::

    run = wandb.init(...)
    with traceml.integrations.wandb.track(run):
        train()
    run.finish()

Every ``every_s`` seconds (and once more at the end) the figures of ``traceml.summary()`` are
logged with ``run.log`` as ``traceml/step_time_ms``, ``traceml/input_wait_pct``, ..., together
with ``traceml/step``, the training step (steps this rank completed). ``traceml/*`` is
declared with ``run.define_metric(..., step_metric="traceml/step")``, so their charts are drawn
against the training step, whatever W&B's own ``_step`` is: the rows are logged without
``step=``, as the Hugging Face and Lightning W&B loggers do. The words (``traceml/verdict``,
``traceml/severity``, ``traceml/ranks``, ...) are fields of ``run.summary`` (the runs table).
See :mod:`traceml.integrations.tracking` for what is shared by every tracker.

``wandb`` is imported only by :func:`track` without a run; a run object needs no import.
"""

from __future__ import annotations

from traceml.integrations import tracking


def track(
    run=None, *, every_s: float | None = tracking.LIVE_EVERY_S, prefix: str = "traceml/"
) -> tracking.Tracker:
    """Log TraceML's figures to the W&B run ``run`` (default ``wandb.run``), live and at the end.

    Args:
        run: a ``wandb.Run`` (``wandb.init()``'s); None: the current ``wandb.run``.
        every_s: period of the live logs, s; None: only at :meth:`Tracker.finish`.
        prefix: prepended to every name; ``{prefix}step`` is the step metric.

    Returns:
        The :class:`~traceml.integrations.tracking.Tracker`: inert on ranks other than 0
        (silently: ``run`` is not touched); inert after one warning line when ``wandb`` is not
        installed, there is no run, or ``run`` refuses the set-up (a finished run, something
        that is not a run).

    Raises:
        ValueError: ``every_s`` is not a positive number or None (on every rank).
        ImportError: ``wandb`` is not installed and ``TRACEML_STRICT=1``.
        Exception: under ``TRACEML_STRICT=1``, what ``run.define_metric`` raised.
    """
    if (other := tracking.elsewhere("wandb", every_s)) is not None:
        return other
    if run is None:
        wandb = tracking.require("wandb", "wandb")
        if wandb is None:
            return tracking.Tracker("wandb", None)
        run = wandb.run
        if run is None:
            return tracking.inert("wandb", "no W&B run (call wandb.init() first, or pass its run)")
    step_key = f"{prefix}step"
    try:
        run.define_metric(step_key)
        run.define_metric(f"{prefix}*", step_metric=step_key)
    except Exception as exc:
        return tracking.setup_failed("wandb", exc)

    def write(metrics: dict, labels: dict, step: int) -> None:
        run.log({**metrics, step_key: step})
        if labels:
            run.summary.update(labels)

    return tracking.Tracker("wandb", write, every_s, prefix)
