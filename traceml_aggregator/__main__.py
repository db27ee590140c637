"""``python -m traceml_aggregator`` is ``traceml-aggregator``."""

import sys

from traceml_aggregator.cli import main

sys.exit(main())
