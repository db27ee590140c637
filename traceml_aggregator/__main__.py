"""``python -m traceml_aggregator`` is ``traceml-aggregator`` (how ``traceml run`` starts it).

Once :func:`~traceml_aggregator.cli.main` has returned, the store is closed and the reports are
written, and the launcher is waiting for this process to exit before it can: it ends at once
(``os._exit`` after flushing), without the interpreter's teardown of gRPC (about 0.05 s).
"""

import os
import sys

from traceml_aggregator.cli import main

code = main()
sys.stdout.flush()
sys.stderr.flush()
os._exit(code)
