"""Pure functions from :class:`~traceml.analysis.rundata.RunData` to the summary's figures."""
