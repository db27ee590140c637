"""Framework callbacks: TraceML steps for runs that ``traceml run``'s zero-code mode does not start.

* :mod:`traceml.integrations.hf` — ``TraceMLCallback`` for the Hugging Face ``Trainer``;
* :mod:`traceml.integrations.lightning` — ``TraceMLCallback`` for the Lightning ``Trainer``.

Each module imports its framework only when its callback class is first used, so ``traceml``
imports without either framework. The callbacks turn on the same zero-code steps as
``traceml run`` (:mod:`traceml.sdk.auto`), so the numbers mean the same either way, and a run
with both counts every step once. See ``docs/frameworks.md``.
"""
