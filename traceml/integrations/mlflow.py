"""TraceML's verdict and key figures in an MLflow run.

::

    with mlflow.start_run(), traceml.integrations.mlflow.track():
        train()

Every ``every_s`` seconds (and once more at the end) the figures of ``traceml.summary()`` are
logged as MLflow metrics (``traceml/step_time_ms``, ``traceml/input_wait_pct``, ...) at
``step`` = the training step (steps this rank completed), in one ``log_batch`` call; the words
are run tags (``traceml/verdict``, ``traceml/severity``, ``traceml/ranks``, ...). The writes
go through an ``MlflowClient`` made by :func:`track` (so they use the tracking URI of that
moment) with the run's id, from TraceML's thread: MLflow's active run is per thread, the
client is not. See :mod:`traceml.integrations.tracking` for what is shared by every tracker.

``mlflow`` (or ``mlflow-skinny``) is imported by :func:`track`, not with this module.
"""

from __future__ import annotations

import time

from traceml.integrations import tracking


def track(
    run_id: str | None = None,
    *,
    every_s: float | None = tracking.LIVE_EVERY_S,
    prefix: str = "traceml/",
) -> tracking.Tracker:
    """Log TraceML's figures to the MLflow run ``run_id`` (default: the active run), live and at
    the end.

    Args:
        run_id: the run's id; None: ``mlflow.active_run()``'s, on the calling thread.
        every_s: period of the live logs, s; None: only at :meth:`Tracker.finish`.
        prefix: prepended to every metric and tag name.

    Returns:
        The :class:`~traceml.integrations.tracking.Tracker`: inert on ranks other than 0
        (silently: ``mlflow`` is not imported); inert after one warning line when ``mlflow`` is
        not installed, there is no run, or its client cannot be made.

    Raises:
        ValueError: ``every_s`` is not a positive number or None (on every rank).
        ImportError: ``mlflow`` is not installed and ``TRACEML_STRICT=1``.
        Exception: under ``TRACEML_STRICT=1``, what making the ``MlflowClient`` raised.
    """
    if (other := tracking.elsewhere("mlflow", every_s)) is not None:
        return other
    mlflow = tracking.require("mlflow", "mlflow")
    if mlflow is None:
        return tracking.Tracker("mlflow", None)
    if run_id is None:
        active = mlflow.active_run()
        if active is None:
            return tracking.inert("mlflow", "no active MLflow run (call mlflow.start_run() first)")
        run_id = active.info.run_id
    from mlflow.entities import Metric, RunTag

    try:
        client = mlflow.MlflowClient()
    except Exception as exc:
        return tracking.setup_failed("mlflow", exc)

    def write(metrics: dict, labels: dict, step: int) -> None:
        now_ms = int(time.time() * 1000)
        client.log_batch(
            run_id,
            metrics=[Metric(k, v, now_ms, step) for k, v in metrics.items()],
            tags=[RunTag(k, v) for k, v in labels.items()],
        )

    return tracking.Tracker("mlflow", write, every_s, prefix)
