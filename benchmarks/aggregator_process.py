"""A real ``traceml-aggregator`` process: start, stop, kill, restart, read its store.

The benchmarks, and the tests that exercise the wire without the launcher (the client,
resends, forks, fail-open: ``tests/helpers/aggregator.py``), run the aggregator exactly as
``traceml run`` does, as a subprocess serving gRPC on a free port, and read the SQLite store
once it has stopped (the store holds an exclusive lock while open). Also here: a free port,
the records and the SDK client they send them with. Needs only the package and the standard
library (no pytest), so a benchmark runs in a user's environment.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import random
import re
import signal
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path

from traceml import wire
from traceml.launcher.aggregator import wait_serving
from traceml.sdk.client import ClientConfig, TelemetryClient

#: The run token of the aggregators started here and of the senders that play the run's
#: processes (a real run's launcher makes one per run and hands it to its ranks). A caller that
#: set ``TRACEML_RUN_TOKEN`` already (the test suite: ``TEST_RUN_TOKEN``) keeps its own.
BENCHMARK_RUN_TOKEN = "traceml-benchmark-run-token"
os.environ.setdefault("TRACEML_RUN_TOKEN", BENCHMARK_RUN_TOKEN)


#: Where :func:`free_port` picks: below the kernel's ephemeral range (Linux's default is
#: 32768-60999), so no outgoing connection (a rank's gloo or TCPStore socket, a gRPC channel)
#: takes the port between the moment it is handed out and the moment a server binds it. A port
#: from ``bind(port 0)`` is one of those ephemeral ports: on a busy machine one was taken by a
#: connection first, and the aggregator could not serve.
FREE_PORTS = range(10_000, 32_768)
#: The slices of :data:`FREE_PORTS`: each pytest-xdist worker (``gw0``, ``gw1``, ...) picks in
#: its own, so two workers never hand out the same port.
PORT_SLICES = 16
_next_port = itertools.count(random.randrange(len(FREE_PORTS) // PORT_SLICES))


def free_port() -> int:
    """A TCP port that nothing listens on, on any interface, right now, and that no outgoing
    connection takes later (:data:`FREE_PORTS`); this process never hands it out twice before
    it has handed out its whole slice (tests and benchmarks never use the defaults).

    Raises:
        OSError: every port of this process's slice is taken.
    """
    worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0").removeprefix("gw")
    size = len(FREE_PORTS) // PORT_SLICES
    first = FREE_PORTS.start + (int(worker) % PORT_SLICES if worker.isdigit() else 0) * size
    for _ in range(size):
        port = first + next(_next_port) % size
        with socket.socket() as s:
            try:
                s.bind(("", port))
            except OSError:
                continue
            return port
    raise OSError(f"no free port in {first}-{first + size - 1}")


def query(run_dir: Path, sql: str, params: tuple = ()) -> list[tuple]:
    """Rows of ``sql`` on the run's SQLite database (after the aggregator closed it).

    The connection is closed on return: an open one keeps a shared lock (WAL mode) that would
    stop an aggregator from reopening the database.
    """
    with contextlib.closing(sqlite3.connect(Path(run_dir) / "telemetry.sqlite")) as db:
        return db.execute(sql, params).fetchall()


#: The aggregator's last log line (see traceml_aggregator.server.serve).
_STORED_LINE = re.compile(
    r"stored (?P<records>\d+) records in (?P<batches>\d+) batches; "
    r"(?P<duplicates>\d+) resent batches were already stored"
)
#: Its line of what the node relays carried (see traceml_aggregator.server.serve).
_RELAY_LINE = re.compile(r"node relays: (\d+) calls carried (\d+) messages")


def stored_counters(log: str) -> list[dict[str, int]]:
    """``{"records", "batches", "duplicates"}`` of each clean stop in an aggregator's ``log``
    (its stderr), in order."""
    return [{k: int(v) for k, v in m.groupdict().items()} for m in _STORED_LINE.finditer(log)]


def relay_counts(log: str) -> tuple[int, int]:
    """``(Relay calls, RelayUp messages)`` an aggregator served, from the last clean stop in
    its ``log`` (its stderr).

    Raises:
        IndexError: the log has no such line (the aggregator did not stop cleanly).
    """
    calls, messages = _RELAY_LINE.findall(log)[-1]
    return int(calls), int(messages)


class LiveAggregator:
    """One aggregator of run ``run_name`` over ``run_dir`` on 127.0.0.1 (a free port).

    The same object can be started again after :meth:`stop` or :meth:`kill`: same run
    directory, same port, so its clients reconnect to it. As a context manager it starts, and
    kills on the way out whatever is still running.
    """

    def __init__(
        self,
        run_dir: Path,
        run_name: str,
        *,
        world_size: int | None = None,
        extra_args: tuple[str, ...] = (),
        env: dict[str, str] | None = None,
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_name = run_name
        self.world_size = world_size
        #: More ``traceml-aggregator`` flags (``--nnodes``, ``--finalize-timeout-sec``, ...).
        self.extra_args = list(extra_args)
        #: More environment variables of the process (the caller's own, plus these).
        self.env = dict(env or {})
        self.port = free_port()
        self.process: subprocess.Popen | None = None
        self.starts = 0

    @property
    def target(self) -> str:
        """``host:port`` for clients."""
        return f"127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        """stderr of every start of this aggregator, appended."""
        return self.run_dir.parent / f"{self.run_dir.name}.aggregator.log"

    def start(self, timeout_s: float = 60.0) -> LiveAggregator:
        """Start the process and wait until its health service says SERVING."""
        argv = [
            sys.executable,
            "-m",
            "traceml_aggregator",
            "--run-dir",
            str(self.run_dir),
            "--run-name",
            self.run_name,
            "--port",
            str(self.port),
        ]
        if self.world_size is not None:
            argv += ["--world-size", str(self.world_size)]
        argv += self.extra_args
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=log,
                env={**os.environ, **self.env},
            )
        self.starts += 1
        wait_serving(self.target, timeout_s, self.process)
        return self

    def __enter__(self) -> LiveAggregator:
        return self.start()

    def __exit__(self, *exc_info) -> None:
        """Kill the process if it still runs (a failed test or benchmark left it)."""
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait()

    def stop(self, timeout_s: float = 30.0) -> int:
        """SIGTERM (a clean stop: drain, checkpoint); returns the exit code."""
        return self._end(signal.SIGTERM, timeout_s)

    def kill(self) -> int:
        """SIGKILL: no drain, no checkpoint, no goodbye (what committed is in the WAL)."""
        return self._end(signal.SIGKILL, 30.0)

    def _end(self, sig: int, timeout_s: float) -> int:
        assert self.process is not None
        if self.process.poll() is None:
            os.kill(self.process.pid, sig)
        return self.process.wait(timeout_s)

    def log(self) -> str:
        """Everything the aggregator wrote to stderr so far."""
        return self.log_path.read_text(errors="replace")

    def counters(self) -> list[dict[str, int]]:
        """``{"records", "batches", "duplicates"}`` of each clean stop, in order."""
        return stored_counters(self.log())

    def query(self, sql: str, params: tuple = ()) -> list[tuple]:
        """Rows of ``sql`` on the store; the aggregator must be stopped."""
        assert self.process is None or self.process.poll() is not None, "stop it first"
        return query(self.run_dir, sql, params)


def step(i: int) -> dict[str, int]:
    """A plausible step's wire fields (µs), as the client takes them."""
    return {"step": i, "end_us": 1000 * (i + 1), "step_us": 1000, "forward_us": 300}


def finish(steps: int) -> wire.RankFinish:
    """A completed rank's finish marker."""
    return wire.RankFinish(steps_completed=steps, end_state=wire.EndState.END_STATE_COMPLETED)


def make_client(
    target: str, run_name: str, warnings: list[str], rank: int = 0, relay: str = "", **config
) -> TelemetryClient:
    """Rank ``rank``'s client, quick to flush (20 ms), its warnings appended to ``warnings``,
    streaming through the node relay at ``relay`` ("": straight to ``target``); ``config``
    overrides :class:`ClientConfig` fields."""
    defaults = {
        "flush_interval_s": 0.02,
        "batch_max_records": 512,
        "buffer_max_records": 65536,
        "rpc_timeout_s": 2.0,
    }
    defaults.update(config)
    return TelemetryClient(
        target,
        run_name,
        rank=rank,
        config=ClientConfig(**defaults),
        warn=warnings.append,
        relay=relay,
    )
