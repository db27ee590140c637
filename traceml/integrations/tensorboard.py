"""TraceML's verdict and key figures in TensorBoard event files.

::

    writer = SummaryWriter("runs/exp1")
    with traceml.integrations.tensorboard.track(writer):
        train()

Every ``every_s`` seconds (and once more at the end) the figures of ``traceml.summary()`` are
written as scalars (``traceml/step_time_ms``, ``traceml/input_wait_pct``, ...) at
``global_step`` = the training step (steps this rank completed), and flushed; the words are
text summaries (``traceml/verdict``, ``traceml/severity``, ``traceml/ranks``, ...), written at
the step where they change. See :mod:`traceml.integrations.tracking` for what is shared by every
tracker.

Given a directory instead of a writer, :func:`track` opens a
``torch.utils.tensorboard.SummaryWriter`` there (which needs the ``tensorboard`` package) and
closes it at the end; a writer of your own (``torch.utils.tensorboard``'s or ``tensorboardX``'s)
is flushed, never closed.
"""

from __future__ import annotations

import os

from traceml.integrations import tracking

#: What :func:`track` writes with: a writer without one of these is refused.
WRITER_METHODS = ("add_scalar", "add_text", "flush")


def track(
    writer, *, every_s: float | None = tracking.LIVE_EVERY_S, prefix: str = "traceml/"
) -> tracking.Tracker:
    """Log TraceML's figures to TensorBoard, live and at the end.

    Args:
        writer: a ``SummaryWriter`` (anything with ``add_scalar``, ``add_text``, ``flush``), or
            a log directory (str or path) to open one in.
        every_s: period of the live writes, s; None: only at :meth:`Tracker.finish`.
        prefix: prepended to every tag.

    Returns:
        The :class:`~traceml.integrations.tracking.Tracker`: inert on ranks other than 0
        (silently: no directory, no event file); inert after one warning line when a directory
        is given and ``tensorboard`` is not installed or the writer cannot be opened there.

    Raises:
        ValueError: ``every_s`` is not a positive number or None, or ``writer`` is neither a
            directory nor has ``add_scalar``, ``add_text`` and ``flush`` (None included); on
            every rank.
        ImportError: ``tensorboard`` is not installed and ``TRACEML_STRICT=1``.
        Exception: under ``TRACEML_STRICT=1``, what opening the ``SummaryWriter`` raised.
    """
    is_dir = isinstance(writer, (str, os.PathLike))
    if not is_dir and not all(callable(getattr(writer, m, None)) for m in WRITER_METHODS):
        raise ValueError(
            "writer must be a SummaryWriter (with add_scalar, add_text, flush) or a log "
            f"directory, got {writer!r}"
        )
    if (other := tracking.elsewhere("tensorboard", every_s)) is not None:
        return other  # no event file on a rank that logs nothing
    close = None
    if is_dir:
        if tracking.require("tensorboard", "tensorboard") is None:
            return tracking.Tracker("tensorboard", None)
        try:
            from torch.utils.tensorboard import SummaryWriter

            writer = SummaryWriter(os.fspath(writer))
        except Exception as exc:
            return tracking.setup_failed("tensorboard", exc)
        close = writer.close

    def write(metrics: dict, labels: dict, step: int) -> None:
        for name, value in metrics.items():
            writer.add_scalar(name, value, global_step=step)
        for name, value in labels.items():
            writer.add_text(name, value, global_step=step)
        writer.flush()

    return tracking.Tracker("tensorboard", write, every_s, prefix, close=close)
