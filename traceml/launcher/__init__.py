"""The ``traceml`` command: validates flags, lays out the run directory, starts the aggregator
(node 0), runs torchrun with telemetry, reports the node's exit and, on node 0, finalizes."""
