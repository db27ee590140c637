"""The in-process SDK: a rank's step tracer, telemetry client, samplers and GPU timing,
behind the public API of :mod:`traceml` (``traceml.init()``, ``traceml.trace_step()``, ...)."""
