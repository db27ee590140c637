"""``TraceMLCallback`` for the Lightning ``Trainer`` (``lightning.pytorch``).

``Trainer(..., callbacks=[TraceMLCallback()])``. At ``on_fit_start`` (after the strategy has
wrapped the model) the rank's telemetry starts (``traceml.init()``, which needs ``traceml run``
or ``TRACEML_AGGREGATOR``/``TRACEML_RUN_NAME``) and zero-code steps are turned on, with the
strategy's model (the DDP wrapper, whose forward runs ``training_step``) timed as forward. A
step is one optimizer step: ``trainer.global_step`` steps per rank. With automatic
optimization Lightning runs ``training_step`` and backward inside ``optimizer.step(closure)``:
they are forward and backward, and the optimizer phase is the rest of the step call.

``lightning`` is imported when ``TraceMLCallback`` is first used, not with this module.
"""

from __future__ import annotations

from traceml.integrations import lazy_callback


def _callback_class() -> type:
    from lightning.pytorch import Callback

    class TraceMLCallback(Callback):
        """Turns on TraceML steps for this Trainer (see :mod:`traceml.integrations.lightning`)."""

        def on_fit_start(self, trainer, pl_module):
            from traceml.sdk import auto

            auto.start(trainer.strategy.model or pl_module)

    TraceMLCallback.__module__, TraceMLCallback.__qualname__ = __name__, "TraceMLCallback"
    return TraceMLCallback


__getattr__ = lazy_callback(__name__, _callback_class)
