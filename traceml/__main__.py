"""``python -m traceml`` is the ``traceml`` command."""

from traceml.launcher.cli import main

main()
