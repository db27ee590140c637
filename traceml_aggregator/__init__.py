"""The TraceML aggregator: gRPC server, SQLite store, finalization.

Data path: :mod:`.server` (gRPC) -> :mod:`.writer` -> :mod:`.store` (SQLite) -> :mod:`.load`
-> :mod:`traceml.analysis` -> :mod:`traceml.report` (files written by :mod:`.reports`);
:mod:`.finalize` decides when.
"""
