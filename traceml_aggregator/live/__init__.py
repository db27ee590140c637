"""The live engine: what the live views, ``traceml.summary()`` and the final summary read, kept
on the aggregator's event loop as batches commit.

Its entry point is :class:`LiveAggregates` (``from traceml_aggregator.live import
LiveAggregates``). Its parts:

- :mod:`.windows`: :class:`LiveAggregates`, each rank's and node's windows, folded in per
  committed batch (per-rank steps in :mod:`traceml_aggregator.aggregates`, whose classes the
  checkpoint pickles by that module's name);
- :mod:`.analysis_process`: the process that runs the analysis over a mirror of those windows
  (``Summarize``, the dashboard's snapshots);
- :mod:`.rows`: the ``Summarize`` reply's one row per rank, which ``traceml run --mode cli``
  draws (:mod:`traceml.launcher.terminal_view`).

The entry point is imported on first use (module ``__getattr__``), so that importing a part
does not import :mod:`.windows`: :mod:`traceml_aggregator.checkpoint`, which :mod:`.windows`
imports, imports :mod:`.analysis_process`, and the spawned analysis process imports only its
own module, as before this package existed.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from traceml_aggregator.live.windows import (
        WINDOW_SAMPLES,
        WINDOW_STEPS,
        LiveAggregates,
        StepReplay,
        with_steps,
    )

__all__ = ["WINDOW_SAMPLES", "WINDOW_STEPS", "LiveAggregates", "StepReplay", "with_steps"]


def __getattr__(name: str) -> Any:
    """The entry point's names (:data:`__all__`) from :mod:`.windows`, imported on first use;
    AttributeError for any other name."""
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from traceml_aggregator.live import windows

    return getattr(windows, name)
