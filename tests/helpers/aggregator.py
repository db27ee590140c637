"""A real aggregator process for the tests (:class:`LiveAggregator`), a free port, the store.

One implementation, shared with the benchmarks: ``benchmarks/aggregator_process.py`` (the
benchmarks import nothing from ``tests/``, so it lives beside them).
"""

from __future__ import annotations

import sys
from pathlib import Path

_BENCHMARKS = str(Path(__file__).resolve().parents[2] / "benchmarks")
if _BENCHMARKS not in sys.path:
    sys.path.append(_BENCHMARKS)

from aggregator_process import (  # noqa: E402
    LiveAggregator,
    finish,
    free_port,
    make_client,
    query,
    step,
)

__all__ = ["LiveAggregator", "finish", "free_port", "make_client", "query", "relay_calls", "step"]


def relay_calls(log: str) -> int:
    """The ``Relay`` calls an aggregator served, from its ``log`` (its stderr): the last
    ``node relays: N calls carried M messages`` line, which it writes at a clean stop.

    Raises:
        IndexError: the log has no such line (the aggregator did not stop cleanly).
    """
    return int(log.rsplit("node relays: ", 1)[1].split(" calls", 1)[0])
