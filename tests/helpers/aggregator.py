"""A real aggregator process for the tests (:class:`LiveAggregator`), its command line, a free
port and one that something listens on, the store.

One implementation, shared with the benchmarks: ``benchmarks/aggregator_process.py`` (the
benchmarks import nothing from ``tests/``, so it lives beside them).
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
from collections.abc import Iterator
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
    relay_counts,
    step,
)

__all__ = [
    "LiveAggregator",
    "aggregator_cmd",
    "finish",
    "free_port",
    "listening_port",
    "make_client",
    "query",
    "relay_calls",
    "run_finalize_only",
    "step",
]


def aggregator_cmd(run_dir: Path, run_name: str, *flags: str) -> list[str]:
    """The command line of a ``traceml-aggregator`` of run ``run_name`` over ``run_dir`` (this
    environment's Python running ``-m traceml_aggregator``), with more ``flags``."""
    return [
        sys.executable,
        "-m",
        "traceml_aggregator",
        "--run-dir",
        str(run_dir),
        "--run-name",
        run_name,
        *flags,
    ]


def run_finalize_only(run_dir: Path, run_name: str, *flags: str) -> subprocess.CompletedProcess:
    """``traceml-aggregator --finalize-only`` of run ``run_name`` (world size 1) over
    ``run_dir``, with more ``flags``, run to its end (at most 120 s); the CompletedProcess
    (text, captured)."""
    return subprocess.run(
        aggregator_cmd(run_dir, run_name, "--world-size", "1", "--finalize-only", *flags),
        capture_output=True,
        text=True,
        timeout=120,
    )


@contextlib.contextmanager
def listening_port(*, reuseport: bool = False) -> Iterator[int]:
    """A port of 127.0.0.1 that a socket listens on while the ``with`` lasts (with
    ``SO_REUSEPORT`` if ``reuseport``, as a gRPC server listens by default)."""
    with socket.socket() as busy:
        if reuseport:
            busy.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        yield busy.getsockname()[1]


def relay_calls(log: str) -> int:
    """The ``Relay`` calls an aggregator served, from its ``log`` (its stderr): the last
    ``node relays: N calls carried M messages`` line, which it writes at a clean stop.

    Raises:
        IndexError: the log has no such line (the aggregator did not stop cleanly).
    """
    return relay_counts(log)[0]
