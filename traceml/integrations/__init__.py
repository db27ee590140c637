"""Framework callbacks, and the verdict in the trackers where people log.

Framework callbacks: TraceML steps for runs that ``traceml run``'s zero-code mode does not start.

* :mod:`traceml.integrations.hf` — ``TraceMLCallback`` for the Hugging Face ``Trainer``;
* :mod:`traceml.integrations.lightning` — ``TraceMLCallback`` for the Lightning ``Trainer``.

Each module imports its framework only when its callback class is first used, so ``traceml``
imports without either framework. The callbacks turn on the same zero-code steps as
``traceml run`` (:mod:`traceml.sdk.auto`), so the numbers mean the same either way, and a run
with both counts every step once. See ``docs/frameworks.md``.

Trackers: ``track()`` in :mod:`traceml.integrations.wandb`, :mod:`traceml.integrations.mlflow`
and :mod:`traceml.integrations.tensorboard` logs the verdict and key figures of
``traceml.summary()`` to that tracker, live and at the end of the run
(:mod:`traceml.integrations.tracking`). Each imports its tracker only when ``track()`` needs
it. See ``docs/trackers.md``.
"""

from __future__ import annotations

import functools
from collections.abc import Callable


def lazy_callback(module: str, build: Callable[[], type]) -> Callable[[str], type]:
    """The module ``__getattr__`` (PEP 562) of an integration: ``TraceMLCallback`` is
    ``build()``, called once, when it is first looked up (``build`` imports the framework).

    Raises (from the returned function):
        AttributeError: any other name.
        ImportError: the framework is not installed.
    """
    build = functools.cache(build)

    def __getattr__(name: str) -> type:
        if name == "TraceMLCallback":
            return build()
        raise AttributeError(f"module {module!r} has no attribute {name!r}")

    return __getattr__
