"""The one way TraceML tells the user something: the ``traceml`` logger, printed as
``traceml: <message>`` lines on stderr.

Every part logs to ``logging.getLogger("traceml")`` or a child (``traceml.sdk``,
``traceml.launcher``, ...; :func:`get`). Importing this module installs, once per process, one
:class:`StderrHandler` on the ``traceml`` logger, sets that logger to INFO unless the user already
gave it a level, and stops its records from also reaching the root logger (a training script's
``logging.basicConfig`` would otherwise print every line twice). A line reads
``traceml: <message>``, or ``traceml-aggregator: <message>`` for the ``traceml.aggregator``
logger and its children (the aggregator command's lines). The level is not printed: a message
that needs the word says it (``error: ...``, ``warning: ...``), as the lines always have.
Levels: INFO for progress (``summary: <path>``), WARNING for trouble that TraceML works around,
ERROR for a refusal or a failure that ends a TraceML part.

The standard ways work: ``logging.getLogger("traceml").setLevel(logging.ERROR)`` silences the
warnings, ``logging.getLogger("traceml.sdk").setLevel(logging.CRITICAL)`` only the SDK's; to send
the lines elsewhere add a handler to the ``traceml`` logger and remove :data:`HANDLER` (or set
``propagate = True`` to hand them to the root logger's handlers too).

Fail-open and fork-safe: the handler takes no lock (a training step never waits for another
thread's write to stderr, and a fork() cannot inherit a held one), and a write that fails (stderr
closed or a broken pipe) is dropped without a word, never raised into training.
"""

from __future__ import annotations

import logging
import sys

#: The logger every TraceML part logs under.
ROOT = "traceml"
#: The aggregator command's logger: its lines start with ``traceml-aggregator:``.
AGGREGATOR = "traceml.aggregator"


class LineFormatter(logging.Formatter):
    """``<prefix>: <message>``: exactly the lines TraceML printed before it logged."""

    def format(self, record: logging.LogRecord) -> str:
        name = record.name
        ours = name == AGGREGATOR or name.startswith(AGGREGATOR + ".")
        prefix = "traceml-aggregator" if ours else "traceml"
        return f"{prefix}: {record.getMessage()}"


class StderrHandler(logging.Handler):
    """Writes each record as one line to the current ``sys.stderr`` and flushes it.

    ``sys.stderr`` is looked up at each record, so a redirected stderr (pytest's capture, a
    ``contextlib.redirect_stderr``) gets the lines. No lock is taken and no error is raised:
    see the module docstring.
    """

    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.setFormatter(LineFormatter())

    def createLock(self) -> None:  # noqa: N802 (logging's name)
        self.lock = None

    def acquire(self) -> None:
        pass

    def release(self) -> None:
        pass

    def handle(self, record: logging.LogRecord) -> bool:
        """Filter, then emit without the handler lock that :meth:`logging.Handler.handle` takes."""
        rv = self.filter(record)
        if isinstance(rv, logging.LogRecord):
            record = rv
        if rv:
            self.emit(record)
        return bool(rv)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            stream = sys.stderr
            if stream is None:  # pythonw, or a daemon that closed it
                return
            stream.write(self.format(record) + "\n")
            stream.flush()
        except Exception:
            pass  # closed stderr, broken pipe, a message that cannot be formatted: say nothing


def _install() -> StderrHandler:
    root = logging.getLogger(ROOT)
    for handler in root.handlers:
        if isinstance(handler, StderrHandler):  # installed by an earlier import (a reload)
            return handler
    handler = StderrHandler()
    root.addHandler(handler)
    if root.level == logging.NOTSET:
        root.setLevel(logging.INFO)
    root.propagate = False
    return handler


#: The handler that prints TraceML's lines (remove it to route them elsewhere).
HANDLER = _install()


def get(part: str = "") -> logging.Logger:
    """The logger of ``part`` (``"sdk"`` gives ``traceml.sdk``; "" the ``traceml`` logger)."""
    return logging.getLogger(f"{ROOT}.{part}" if part else ROOT)
