"""The TraceML aggregator: gRPC server, SQLite store, finalization, analysis and reports.

Data path: :mod:`.server` (gRPC) -> :mod:`.writer` -> :mod:`.store` (SQLite) ->
:mod:`.rundata` -> :mod:`.analysis` -> :mod:`.report`; :mod:`.finalize` decides when.
"""
