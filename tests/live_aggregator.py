"""A real ``traceml-aggregator`` process for tests: start, stop, kill, restart, read its store.

Tests that exercise the wire without the launcher (the client, resends, forks, fail-open) run
the aggregator exactly as ``traceml run`` does, as a subprocess serving gRPC on a free port,
and read the SQLite store once it has stopped (the store holds an exclusive lock while open).
Also here: the records and the SDK client those tests send them with.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
from pathlib import Path

from conftest import free_port, query

from traceml import wire
from traceml.launcher.aggregator import wait_serving
from traceml.sdk.client import ClientConfig, TelemetryClient

#: The aggregator's last log line (see traceml_aggregator.server.serve).
_STORED_LINE = re.compile(
    r"stored (?P<records>\d+) records in (?P<batches>\d+) batches; "
    r"(?P<duplicates>\d+) resent batches were already stored"
)


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
    ) -> None:
        self.run_dir = Path(run_dir)
        self.run_name = run_name
        self.world_size = world_size
        #: More ``traceml-aggregator`` flags (``--nnodes``, ``--finalize-timeout-sec``, ...).
        self.extra_args = list(extra_args)
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
            sys.executable, "-m", "traceml_aggregator", "--run-dir", str(self.run_dir),
            "--run-name", self.run_name, "--port", str(self.port),
        ]
        if self.world_size is not None:
            argv += ["--world-size", str(self.world_size)]
        argv += self.extra_args
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(argv, stdin=subprocess.DEVNULL, stdout=log, stderr=log)
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
        return [
            {k: int(v) for k, v in m.groupdict().items()}
            for m in _STORED_LINE.finditer(self.log())
        ]

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


def make_client(target: str, run_name: str, warnings: list[str], **config) -> TelemetryClient:
    """Rank 0's client, quick to flush (20 ms), its warnings appended to ``warnings``;
    ``config`` overrides :class:`ClientConfig` fields."""
    defaults = {
        "flush_interval_s": 0.02,
        "batch_max_records": 512,
        "buffer_max_records": 65536,
        "rpc_timeout_s": 2.0,
    }
    defaults.update(config)
    return TelemetryClient(
        target, run_name, rank=0, config=ClientConfig(**defaults), warn=warnings.append
    )
