"""``TraceMLCallback`` for the Hugging Face ``transformers.Trainer``.

``Trainer(..., callbacks=[TraceMLCallback()])``: no subclass, nothing replaced. At
``on_train_begin`` the rank's telemetry starts (``traceml.init()``, which needs ``traceml run`` or
``TRACEML_AGGREGATOR``/``TRACEML_RUN_NAME``) and zero-code steps are turned on, with the
Trainer's model timed as forward. A step is one optimizer step (an update of
``gradient_accumulation_steps`` micro-batches): ``state.global_step`` steps per rank.

``transformers`` is imported when ``TraceMLCallback`` is first used, not with this module.
"""

from __future__ import annotations

from traceml.integrations import lazy_callback


def _callback_class() -> type:
    from transformers import TrainerCallback

    class TraceMLCallback(TrainerCallback):
        """Turns on TraceML steps for this Trainer (see :mod:`traceml.integrations.hf`)."""

        def on_train_begin(self, args, state, control, model=None, **kwargs):
            from traceml.sdk import auto

            auto.start(model)

    TraceMLCallback.__module__, TraceMLCallback.__qualname__ = __name__, "TraceMLCallback"
    return TraceMLCallback


__getattr__ = lazy_callback(__name__, _callback_class)
