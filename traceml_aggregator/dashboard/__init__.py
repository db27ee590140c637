"""The browser dashboard: ``traceml run --mode dashboard`` and ``traceml view RUN_DIR --serve``.

Node 0's aggregator serves it over HTTP (aiohttp) on ``--dashboard-port``
(29767, :data:`traceml.settings.DASHBOARD_PORT`), on its own host, in its own event loop, next to
gRPC; after the run,
``python -m traceml_aggregator.dashboard RUN_DIR`` (what ``traceml view RUN_DIR --serve``
runs) serves the same page over the stored run. The page is ``static/index.html`` with its
script, its style and uPlot (vendored, ``static/uplot/``): it loads nothing from the network.

* :mod:`.sources`: where the data comes from (the live aggregates, or the store);
* :mod:`.frames`: what the page draws, as JSON frames;
* :mod:`.app`: the HTTP routes, the run token's check, the server-sent events.
"""
