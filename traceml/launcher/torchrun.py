"""Running torchrun for one node: argv, environment, output tee, signals, exit codes.

torchrun (``torch.distributed.run``) is the engine; this module never re-implements
rendezvous. It runs ``python -m traceml.launcher.torchrun_main`` (torchrun's own ``main``, plus
a record of failed ranks) in a new session, copies its stdout and stderr to the console and to
``nodes/node_<r>/training.*.log``, forwards SIGINT and SIGTERM to it, and turns its exit into a
:class:`~traceml.wire.NodeExit` for the aggregator.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import threading
from pathlib import Path

from traceml import settings
from traceml.launcher.config import LaunchConfig
from traceml.core.rundir import RunDir
from traceml.launcher.torchrun_main import AUTORUN_MODULE
from traceml.launcher.torchrun_main import RANK_ENDS_FILE_ENV


def torchrun_argv(config: LaunchConfig) -> list[str]:
    """The command line: torchrun flags, then the script and its arguments, as torchrun takes them.

    A single-node run without an explicit ``--master-port`` lets torchrun pick a free port
    (as plain ``torchrun --nproc-per-node N`` does); otherwise static rendezvous on
    ``--master-addr:--master-port`` with ``--node-rank``. With zero-code steps on (the
    default) torchrun starts ``python -u -m traceml.sdk.autorun SCRIPT ARGS`` in each rank
    (torchrun's ``--module``), which instruments the rank and runs the script as ``__main__``.
    """
    argv = [
        sys.executable,
        "-m",
        "traceml.launcher.torchrun_main",
        f"--nnodes={config.nnodes}",
        f"--nproc-per-node={config.nproc_per_node}",
    ]
    if config.nnodes > 1 or config.master_port is not None:
        argv += [
            f"--node-rank={config.node_rank}",
            f"--master-addr={config.master_addr}",
            f"--master-port={config.master_port}",
        ]
    if config.max_restarts:
        argv.append(f"--max-restarts={config.max_restarts}")
    argv += list(config.torchrun_args)
    if config.auto_instrument:
        argv += ["--module", AUTORUN_MODULE]
    argv.append(config.script)
    argv += list(config.script_args)
    return argv


def worker_env(config: LaunchConfig, run_dir: RunDir) -> dict[str, str]:
    """The environment for torchrun and its ranks: the caller's, plus the TraceML endpoint."""
    env = dict(os.environ)
    env[settings.RUN_NAME.name] = str(config.run_name)
    env[settings.AGGREGATOR.name] = config.aggregator_target
    env[settings.LAUNCHED.name] = "1"
    env[RANK_ENDS_FILE_ENV] = str(run_dir.rank_ends)
    env.setdefault("PYTHONUNBUFFERED", "1")
    return env


def _tee(source, console, log_path: Path) -> threading.Thread:
    """Copy ``source`` to ``console`` and ``log_path`` as bytes arrive."""

    def pump() -> None:
        with open(log_path, "ab") as log:
            for chunk in iter(lambda: source.read1(65536), b""):
                log.write(chunk)
                log.flush()
                try:
                    console.write(chunk)
                    console.flush()
                except (OSError, ValueError):
                    pass

    thread = threading.Thread(target=pump, name=f"tee-{log_path.name}", daemon=True)
    thread.start()
    return thread


class TorchrunProcess:
    """One node's torchrun, started by :meth:`start`, awaited by :meth:`wait`."""

    def __init__(self, config: LaunchConfig, run_dir: RunDir) -> None:
        self.config = config
        self.run_dir = run_dir
        self.process: subprocess.Popen | None = None
        self._tees: list[threading.Thread] = []

    def start(self) -> None:
        """Start torchrun in its own session (signals reach it only through the launcher)."""
        self.run_dir.rank_ends.unlink(missing_ok=True)
        self.process = subprocess.Popen(
            torchrun_argv(self.config),
            env=worker_env(self.config, self.run_dir),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        self._tees = [
            _tee(self.process.stdout, sys.stdout.buffer, self.run_dir.training_stdout),
            _tee(self.process.stderr, sys.stderr.buffer, self.run_dir.training_stderr),
        ]

    def forward_signal(self, signum: int, _frame=None) -> None:
        """Pass SIGINT/SIGTERM on to torchrun (which passes it to the ranks)."""
        if self.process is not None and self.process.poll() is None:
            try:
                self.process.send_signal(signum)
            except ProcessLookupError:
                pass

    def wait(self, timeout_s: float | None = None) -> int | None:
        """torchrun's return code (negative: killed by that signal); None if still running."""
        assert self.process is not None
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None
        for tee in self._tees:
            tee.join(5.0)
        return code

    def node_exit(self, returncode: int):
        """The :class:`~traceml.wire.NodeExit` for this node: one RankEnd per local rank.

        Failed ranks come from torchrun's own failure record, which lists every local rank
        that ended with a non-zero code or a signal. When one local rank failed, torchrun
        stopped the others with SIGTERM: those are ``terminated`` (signal 15 kept), not a
        failure of their own; a SIGTERM is the rank's own end only when every failed rank got
        one. A rank the record does not list exited 0 (``completed``). Without a record
        (torchrun itself was stopped, or failed before its workers ended) a non-zero exit
        leaves every rank ``terminated``.
        """
        from traceml import wire

        failed = _read_failures(self.run_dir.rank_ends)
        unlisted_completed = returncode == 0 or failed is not None
        failed = failed or {}
        other_cause = any(f.get("signal") != signal.SIGTERM for f in failed.values())
        config = self.config
        report = wire.NodeExit(
            run_name=str(config.run_name),
            node_rank=config.node_rank,
            hostname=socket.gethostname(),
            exit_code=exit_code(returncode),
        )
        for local_rank in range(config.nproc_per_node):
            rank = config.node_rank * config.nproc_per_node + local_rank
            end = report.ranks.add(rank=rank, local_rank=local_rank)
            info = failed.get(rank)
            if info is None:
                if unlisted_completed:
                    end.end_state = wire.EndState.END_STATE_COMPLETED
                    end.exit_code = 0
                else:
                    end.end_state = wire.EndState.END_STATE_TERMINATED
            elif info.get("signal") == signal.SIGTERM and other_cause:
                end.end_state = wire.EndState.END_STATE_TERMINATED
                end.signal = signal.SIGTERM
                end.reason = "stopped by torchrun after another local rank failed"
            elif info.get("signal") is not None:
                end.end_state = wire.EndState.END_STATE_SIGNALED
                end.signal = info["signal"]
                end.reason = info.get("reason") or ""
            else:
                end.end_state = wire.EndState.END_STATE_FAILED
                end.exit_code = info["exit_code"]
                end.reason = info.get("reason") or ""
        return report


def exit_code(returncode: int) -> int:
    """A process's return code as a shell reports it (killed by signal N -> 128 + N)."""
    return 128 - returncode if returncode < 0 else returncode


def _read_failures(path: Path) -> dict[int, dict] | None:
    """Failed ranks by global rank, from torchrun_main's record; None when there is none."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return {int(r["rank"]): r for r in data.get("failed", [])}


def install_signal_forwarding(proc: TorchrunProcess) -> None:
    """Route the launcher's SIGINT and SIGTERM to torchrun."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, proc.forward_signal)
