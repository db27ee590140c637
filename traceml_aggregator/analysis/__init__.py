"""Pure functions from :class:`~traceml_aggregator.rundata.RunData` to the summary's figures."""
