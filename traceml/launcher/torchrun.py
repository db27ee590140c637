"""Running torchrun for one node: argv, environment, output tee, signals, exit codes.

torchrun (``torch.distributed.run``) is the engine; this module never re-implements
rendezvous. It runs ``python -m traceml.launcher.torchrun_main`` (torchrun's own ``main``, plus
a record of failed ranks) in a new session, bound to die with the launcher, copies its stdout
and stderr to the console and (training-output saving on, the default) to
``nodes/node_<r>/training.*.log`` (:class:`Tee`), forwards SIGINT and SIGTERM to it, and
turns its exit into a :class:`~traceml.wire.NodeExit` for the aggregator.
"""

from __future__ import annotations

import json
import os
import queue
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from traceml import settings
from traceml.core import log
from traceml.core.ends import (
    CANNOT_RENDEZVOUS_PREFIX,
    interrupted_reason,
    interrupting_node,
    is_interrupted,
)
from traceml.core.rundir import RunDir
from traceml.core.transport import disable_grpc_fork_handlers
from traceml.launcher.config import LaunchConfig
from traceml.launcher.torchrun_main import (
    AUTORUN_MODULE,
    LAUNCHER_PID_ENV,
    LOG_DIR_FLAG,
    RANK_ENDS_FILE_ENV,
    remove_log_dir,
)

_log = log.get("launcher")


#: torchrun's own environment variable for its ``--log-dir`` (its flags' ``PET_`` defaults).
TORCHRUN_LOG_DIR_ENV = "PET_LOG_DIR"
#: How long torchrun may take to stop after the launcher passed it a stop signal, when it ran
#: no rank at the signal nor since, s; then it is SIGKILLed
#: (:meth:`TorchrunProcess.end_stuck_stop`).
#: Waiting in the rendezvous for a node that never comes (or in the exit barrier of several
#: nodes), torchrun blocks inside torch's C++ store, where no Python signal handler runs:
#: ``torchrun_main``'s own before the ranks start, torch's after; either would run only once
#: the store's wait timed out (600 s for the static rendezvous). Without ranks, a kill loses
#: nothing.
STOP_WITHOUT_RANKS_GRACE_S = 5.0
#: torchrun's exit code once it takes a stop signal (torch's ``SignalException`` leaves its
#: ``main``), what plain torchrun returns after SIGTERM or SIGINT while it runs ranks. Before
#: it starts them it has no handler of torch's, and plain torchrun dies of the signal (128 + N).
STOPPED_BY_SIGNAL_CODE = 1
#: torch's switch that makes the single-node (c10d) rendezvous give each attempt a store of its
#: own, hosted by that attempt's rank 0, instead of one store torchrun keeps for every attempt.
UNSHARED_RDZV_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"


def static_rendezvous(config: LaunchConfig) -> bool:
    """Whether torchrun rendezvouses statically on ``--master-addr:--master-port`` (several
    nodes, or a port given); False: a single node's c10d rendezvous on a free port."""
    return config.nnodes > 1 or config.master_port is not None


def torchrun_argv(config: LaunchConfig, log_dir: str | None = None) -> list[str]:
    """The command line: torchrun flags, then the script and its arguments, as torchrun takes them.

    A single-node run without an explicit ``--master-port`` lets torchrun pick a free port
    (as plain ``torchrun --nproc-per-node N`` does); otherwise static rendezvous on
    ``--master-addr:--master-port`` with ``--node-rank``. ``log_dir`` is torchrun's
    ``--log-dir`` (None: none given). With zero-code steps on (the default) torchrun starts
    ``python -u -m traceml.sdk.autorun SCRIPT ARGS`` in each rank (torchrun's ``--module``),
    which instruments the rank and runs the script as ``__main__``.
    """
    argv = [
        sys.executable,
        "-m",
        "traceml.launcher.torchrun_main",
        f"--nnodes={config.nnodes}",
        f"--nproc-per-node={config.nproc_per_node}",
    ]
    if static_rendezvous(config):
        argv += [
            f"--node-rank={config.node_rank}",
            f"--master-addr={config.master_addr}",
            f"--master-port={config.master_port}",
        ]
    if config.max_restarts:
        argv.append(f"--max-restarts={config.max_restarts}")
    if log_dir is not None:
        argv.append(f"{LOG_DIR_FLAG}{log_dir}")
    if config.auto_instrument:
        argv += ["--module", AUTORUN_MODULE]
    argv.append(config.script)
    argv += list(config.script_args)
    return argv


def worker_env(config: LaunchConfig, run_dir: RunDir, relay: str = "") -> dict[str, str]:
    """The environment for torchrun and its ranks: the caller's, plus the TraceML endpoint and
    the node relay's address (``relay``, "" for none), the knobs the ranks read that a flag
    set, gRPC's fork handlers off
    (:func:`~traceml.core.transport.disable_grpc_fork_handlers`), and, for a single node that
    may restart, a rendezvous store per attempt (:data:`UNSHARED_RDZV_STORE_ENV`; a user's own
    setting stands)."""
    env = dict(os.environ)
    env[settings.RUN_NAME.name] = str(config.run_name)
    env[settings.AGGREGATOR.name] = config.aggregator_target
    env.pop(settings.RELAY.name, None)  # an outer launcher's relay is not this one
    if relay:
        env[settings.RELAY.name] = relay
    env[settings.LAUNCHED.name] = "1"
    env[RANK_ENDS_FILE_ENV] = str(run_dir.rank_ends)
    env[LAUNCHER_PID_ENV] = str(os.getpid())
    if config.peak_tflops is not None:
        env[settings.PEAK_TFLOPS.name] = repr(config.peak_tflops)
    if config.hang_timeout_sec is not None:  # the ranks report a stalled step from a share of it
        env[settings.HANG_TIMEOUT_SEC.name] = repr(config.hang_timeout_sec)
    if config.max_restarts and not static_rendezvous(config):
        # torch 2.13's shared store keeps the previous attempt's keys: a restarted rank that
        # reaches init_process_group before its peer reads the peer's old address and fails
        # or waits out the process group's timeout (pytorch/pytorch#135712)
        if not env.get(UNSHARED_RDZV_STORE_ENV):  # torch reads an empty value as unset
            env[UNSHARED_RDZV_STORE_ENV] = "1"
    env.setdefault("PYTHONUNBUFFERED", "1")
    disable_grpc_fork_handlers(env)  # also for a script that imports grpc before traceml
    return env


#: Chunks (each at most 64 KiB) a training-output log may fall behind the console before
#: further chunks skip the log (counted): a log on a slow or stalled filesystem never holds
#: the pipe that the ranks print into.
LOG_QUEUE_CHUNKS = 256


class Tee:
    """Copies one of torchrun's output pipes to the console and, optionally, to a log file.

    The pump thread reads the pipe as bytes arrive and writes them to ``console`` at once; it
    never touches the file. A second thread writes the log from a bounded queue, so a log
    that fails (a full disk: ENOSPC) or blocks (a stalled network filesystem) can cost only
    the log, never the pipe the ranks print into: the first failure is said once on stderr,
    and the log stops; chunks the queue cannot take are skipped and counted. The log file is
    created as the tee starts, and stays empty when nothing is printed: every node launcher
    that saves training output has both of its ``training.*.log`` files.

    Args:
        source: the pipe (binary, with ``read1``).
        console: binary stream of the launcher's stdout or stderr.
        log_path: ``nodes/node_<r>/training.*.log``, or None when training-output saving is
            off.
    """

    def __init__(self, source, console, log_path: Path | None) -> None:
        self.log_path = log_path
        #: Bytes of output the log skipped: the queue was full, or the log had failed (each
        #: counter has one writer thread).
        self.bytes_skipped = 0
        self.bytes_failed = 0
        #: Why the log stopped ("" while it is written, or when there is none).
        self.log_error = ""
        self._console = console
        self._source = source
        self._queue: queue.Queue | None = None
        self._threads = [threading.Thread(target=self._pump, name="traceml-tee", daemon=True)]
        if log_path is not None:
            self._queue = queue.Queue(LOG_QUEUE_CHUNKS)
            self._threads.append(
                threading.Thread(
                    target=self._save, name=f"traceml-log-{log_path.name}", daemon=True
                )
            )
        for thread in self._threads:
            thread.start()

    def _pump(self) -> None:
        console = self._console
        for chunk in iter(lambda: self._source.read1(65536), b""):
            try:
                console.write(chunk)
                console.flush()
            except (OSError, ValueError):  # a closed or broken console: the log still gets it
                pass
            if self._queue is not None:
                try:
                    self._queue.put_nowait(chunk)
                except queue.Full:
                    self.bytes_skipped += len(chunk)
        if self._queue is not None:
            self._queue.put(None)  # the writer drains what it took, then ends

    def _save(self) -> None:
        assert self._queue is not None and self.log_path is not None
        log = None
        try:  # at start, not at the first chunk: a node whose ranks print nothing has its log
            log = open(self.log_path, "ab", buffering=0)
        except OSError as exc:
            self._log_failed(exc)
        while (chunk := self._queue.get()) is not None:
            if self.log_error:
                self.bytes_failed += len(chunk)
                continue
            view = memoryview(chunk)
            try:
                while view:  # unbuffered: a full disk takes part of a chunk, then fails
                    view = view[log.write(view) :]
            except OSError as exc:
                self.bytes_failed += len(view)
                self._log_failed(exc)
        if log is not None:
            try:
                log.close()
            except OSError:
                pass

    def _log_failed(self, exc: OSError) -> None:
        """The log cannot be written (opened or appended to): say why once; it stops."""
        self.log_error = f"{exc.strerror or exc}"
        _log.warning(
            f"warning: cannot save training output to {self.log_path} "
            f"({self.log_error}); it still reaches the console"
        )

    @property
    def bytes_not_saved(self) -> int:
        """Bytes of output that reached the console but not the log."""
        return self.bytes_skipped + self.bytes_failed

    def join(self, timeout_s: float) -> None:
        """Wait (at most ``timeout_s`` per thread) until the pipe is drained and the log written."""
        for thread in self._threads:
            thread.join(timeout_s)


class TorchrunProcess:
    """One node's torchrun, started by :meth:`start`, awaited by :meth:`wait`."""

    def __init__(self, config: LaunchConfig, run_dir: RunDir) -> None:
        self.config = config
        self.run_dir = run_dir
        self.process: subprocess.Popen | None = None
        self.tees: list[Tee] = []
        #: The node relay's address its ranks stream to ("": straight to node 0).
        self.relay_address = ""
        #: torchrun's log directory (see :meth:`start`), until :meth:`wait` removes it.
        self.log_dir: str | None = None
        #: The first stop signal the launcher passed torchrun (0: none), when (monotonic s),
        #: and whether torchrun was seen with a rank since (:meth:`end_stuck_stop`).
        self._stop_signal = 0
        self._stop_sent_at = 0.0
        self._ranks_since_stop = False
        #: When :meth:`start` started torchrun (monotonic s), whether it is known to have
        #: started ranks, and what was said of its wait for them (:meth:`say_rendezvous_wait`:
        #: ``starting``, ``rendezvous``).
        self._started_at = 0.0
        self._ranks_started = False
        self._waits_said: set[str] = set()

    def start(self, consoles: tuple | None = None) -> None:
        """Start torchrun in its own session (signals reach it only through the launcher),
        bound to die with the launcher (``torchrun_main`` sets ``PR_SET_PDEATHSIG`` itself).

        No ``preexec_fn``: with one, Python must ``fork()`` the launcher, whose gRPC threads
        (node r > 0 holds its session stream by then) do not survive a fork made while they
        are busy: gRPC skips its fork handlers, and the launcher aborted in ``epoll_wait``
        (EBADF). Without one, Python starts the child through ``vfork()``, which runs no fork
        handlers and copies no threads.

        torchrun's log directory (``--log-dir``: per restart attempt and local rank, where a
        failed rank writes its error file, which ``torchrun_main`` reads) is a private
        temporary directory of this launcher, on the node's own disk (``TMPDIR``), removed
        once torchrun has exited (:meth:`wait`), unless the caller's environment names one
        (:data:`TORCHRUN_LOG_DIR_ENV`) or none can be made (then torchrun picks its own, as
        plain torchrun does). Without ``--log-dir`` torchrun makes a
        ``/tmp/torchelastic_*`` directory for every run and leaves it; in the run directory it
        would put torchrun's start on a shared filesystem that may stall.

        Args:
            consoles: the binary streams its stdout and stderr are copied to (the launcher's
                ``sys.stdout.buffer`` and ``sys.stderr.buffer`` when None; node 0's live table
                gives streams that print above it,
                :meth:`traceml.launcher.terminal_view.TerminalView.consoles`).
        """
        self.run_dir.rank_ends.unlink(missing_ok=True)
        self._started_at = time.monotonic()
        if not os.environ.get(TORCHRUN_LOG_DIR_ENV):
            try:
                self.log_dir = tempfile.mkdtemp(prefix="traceml-torchrun-")
            except OSError as exc:  # no temporary directory writable: torchrun's own default
                _log.warning(f"cannot make torchrun's log directory ({exc}): torchrun picks one")
        self.process = subprocess.Popen(
            torchrun_argv(self.config, self.log_dir),
            env=worker_env(self.config, self.run_dir, self.relay_address),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
        save = self.config.save_training_output
        out, err = consoles or (sys.stdout.buffer, sys.stderr.buffer)
        self.tees = [
            Tee(self.process.stdout, out, self.run_dir.training_stdout if save else None),
            Tee(self.process.stderr, err, self.run_dir.training_stderr if save else None),
        ]

    def say_rendezvous_wait(self) -> None:
        """Say (a warning) when torchrun has started no rank ``TRACEML_RENDEZVOUS_WARN_SEC``
        after it started, and where it waits: still starting (torchrun_main has not recorded
        that it imported torch: slow on a busy or network file system), or in its rendezvous,
        for a node that has not joined or at an address it cannot reach, where plain torchrun
        says nothing until its timeout (minutes); each once. If either was said, say when the
        ranks then start. Ranks started: torchrun_main's record says so (it writes it as it
        starts them) or torchrun has a child. Called about once a second while training
        runs."""
        if self._ranks_started or self.process is None:
            return
        waited_s = time.monotonic() - self._started_at
        warn_s = float(self.config.rendezvous_warn_sec or settings.RENDEZVOUS_WARN_SEC.value)
        if not self._waits_said and waited_s < warn_s:
            return
        record = _read_record(self.run_dir.rank_ends)
        self._ranks_started = self._ranks_started_by(record) or _has_children(self.process.pid)
        if self._ranks_started:
            if self._waits_said:
                where = " in its rendezvous" if "rendezvous" in self._waits_said else ""
                _log.info(f"torchrun started its ranks after {waited_s:.0f} s{where}")
            return
        stage = "starting" if record is None else "rendezvous"
        if stage in self._waits_said or self.process.poll() is not None:
            return
        self._waits_said.add(stage)
        _log.warning(
            f"warning: torchrun has started no rank in {waited_s:.0f} s: {self._where(stage)}"
        )

    def _where(self, stage: str) -> str:
        """Where torchrun waits at ``stage`` (``starting``, ``rendezvous``), for
        :meth:`say_rendezvous_wait`, and what to check."""
        config = self.config
        if stage == "starting":
            return "it is still starting (importing torch, slow on a busy or network file system)"
        where = f"{config.master_addr}:{config.master_port}" if config.master_port else "node 0"
        return (
            f"it waits in its rendezvous at {where} for all {config.nnodes} nodes (--nnodes) to "
            "join; check that every node runs `traceml run` with the same --master-addr, "
            "--master-port and --nnodes, and can reach that address"
        )

    @property
    def stop_sent(self) -> bool:
        """Whether the launcher passed torchrun a stop signal (:meth:`forward_signal`)."""
        return bool(self._stop_signal)

    def forward_signal(self, signum: int, _frame=None) -> None:
        """Pass SIGINT/SIGTERM on to torchrun (which passes it to the ranks), once: a second
        would cut torch's own stop short (the launcher kills on a second signal of its own)."""
        if self.process is None or self.process.poll() is not None or self._stop_signal:
            return
        self._stop_signal, self._stop_sent_at = signum, time.monotonic()
        self._ranks_since_stop = _has_children(self.process.pid)
        try:
            self.process.send_signal(signum)
        except ProcessLookupError:
            pass

    def end_stuck_stop(self) -> int | None:
        """SIGKILL torchrun (:meth:`kill`) and reap it (:meth:`wait`) when it still runs
        :data:`STOP_WITHOUT_RANKS_GRACE_S` after the first stop signal passed on
        (:meth:`forward_signal`) and ran no rank then nor at any call since: it waits in
        torch's store (the rendezvous, or the exit barrier of several nodes), where the
        signal cannot reach a handler. Returns, if it did (said once, with why), the return
        code plain torchrun has there: killed by the signal (``-N``) when it never started a
        rank (no handler of torch's yet), else :data:`STOPPED_BY_SIGNAL_CODE`; None while it
        did not. Called about once a second while training runs; a torchrun seen with a rank
        stops as torch stops it, never here.
        """
        if not self._stop_signal or self._ranks_since_stop:
            return None
        assert self.process is not None  # a stop was passed on to it
        if self.process.poll() is not None:
            return None
        self._ranks_since_stop = _has_children(self.process.pid)
        waited_s = time.monotonic() - self._stop_sent_at
        if self._ranks_since_stop or waited_s < STOP_WITHOUT_RANKS_GRACE_S:
            return None
        name = signal.Signals(self._stop_signal).name
        _log.warning(
            f"torchrun did not stop within {STOP_WITHOUT_RANKS_GRACE_S:g} s of {name} and runs no "
            "rank (it waits in torch's store, the rendezvous or the exit barrier of several "
            "nodes, where it cannot take the signal): killed"
        )
        self.kill()
        self.wait()
        return STOPPED_BY_SIGNAL_CODE if self.ranks_started() else -self._stop_signal

    def ranks_started(self) -> bool:
        """Whether torchrun is known to have started its ranks: torchrun_main's record says
        so (written as it starts them), or it was seen with a child process (at a stop
        signal, or while its rendezvous was watched: :meth:`say_rendezvous_wait`)."""
        return self._ranks_started_by(_read_record(self.run_dir.rank_ends))

    def _ranks_started_by(self, record: dict | None) -> bool:
        """:meth:`ranks_started`, torchrun_main's ``record`` read already (None: none)."""
        record = record or {}
        return (
            self._ranks_started
            or self._ranks_since_stop
            or record.get("ranks_started", "failed" in record)
        )

    def kill(self) -> None:
        """SIGKILL torchrun and every process under it at once (a second signal to the
        launcher). torchrun starts each rank in a session of its own, so its process group
        does not hold them: the ranks are found as its descendants, before it dies."""
        import psutil

        if self.process is None or self.process.poll() is not None:
            return
        try:
            victims = psutil.Process(self.process.pid).children(recursive=True)
        except psutil.Error:
            victims = []
        for victim in [self.process] + victims:
            try:
                victim.kill()
            except (ProcessLookupError, psutil.Error):
                pass

    def wait(self, timeout_s: float | None = None) -> int | None:
        """torchrun's return code (negative: killed by that signal); None if still running.
        Once it has exited, its log directory is removed (:meth:`start`)."""
        assert self.process is not None
        try:
            code = self.process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            return None
        for tee in self.tees:
            tee.join(5.0)
        if self.log_dir is not None:
            remove_log_dir(self.log_dir)
            self.log_dir = None
        return code

    def node_exit(self, returncode: int, interrupted: int | None = None, stopped: str = ""):
        """The :class:`~traceml.wire.NodeExit` for this node: one RankEnd per local rank.

        Failed ranks come from torchrun's own failure record (``torchrun_main``), which lists
        every local rank that ended with a non-zero code or a signal. When one local rank
        failed, torchrun stopped the others (SIGTERM): those the record marks ``stopped`` are
        ``terminated`` (their signal or exit code kept), not a failure of their own; a rank
        that had ended before the stop began is ``signaled`` or ``failed`` as it ended, even by
        a SIGTERM and even when a neighbour then failed too. A rank the record does not list
        exited 0 (``completed``), unless the record is ``partial``: a stop signal cut torchrun
        short, and it lists only the ranks that had failed before (those keep their failure;
        the launcher's signal ends the rest). Without a list of failures (torchrun itself was
        stopped, or failed before its workers ended) a non-zero exit leaves every rank
        ``terminated``. A torchrun that ended non-zero before it started its ranks
        (:meth:`ranks_started`: its record never said so, and it was never seen with a child,
        which covers a record that could not be written) leaves every rank ``not_started``,
        with why: its error (its rendezvous: a ``--master-port`` in use, node 0 unreachable),
        ``stopped``, the launcher's signal (kept) while it started or waited in its rendezvous
        (a node that never joined), or its exit code.

        ``stopped`` is why the launcher stopped torchrun itself ("": it did not): the run
        cannot rendezvous (:meth:`~traceml.launcher.node.NodeLaunch.watch_claims`), or why it
        ended (:meth:`~traceml.launcher.node.NodeLaunch.hear_run_failure`); when another
        node's launcher got a signal there, that is the ranks' reason (interrupted, not a
        failure), before torchrun's own error (its store closed with that node).

        ``interrupted`` is the signal the launcher got (SIGTERM, SIGINT: scancel, preemption,
        Ctrl-C) before torchrun exited: every rank that did not complete is then
        ``terminated`` with that signal (or the SIGTERM/SIGINT/SIGKILL it died of) and the
        reason "interrupted: ...", not a failure of its own. When another node's launcher got
        it (``stopped`` says so), every rank that did not complete is ``terminated`` with that
        reason, its own exit code or signal kept: a rank that died as its peers on the stopped
        node ended (a collective's connection closed) did not fail of its own.
        """
        from traceml import wire

        config = self.config
        record = _read_record(self.run_dir.rank_ends) or {}
        torchrun_error = record.get("torchrun_error", "")
        failed = {int(r["local_rank"]): r for r in record.get("failed", [])}
        unlisted_completed = returncode == 0 or (
            "failed" in record and not torchrun_error and not record.get("partial")
        )
        not_started = returncode != 0 and not self.ranks_started()
        others_stop = is_interrupted(stopped)  # another node's launcher got a stop signal
        own_stop = interrupted and not torchrun_error and (others_stop or not stopped)
        # A partial record: this launcher's signal cut torchrun short; the failures it lists
        # came before the signal, each the rank's own unless another node's stop came first.
        failed_before_stop = (
            own_stop
            and record.get("partial")
            and (not stopped or interrupting_node(stopped, None) == config.node_rank)
        )
        if own_stop:
            name = signal.Signals(interrupted).name
            not_started_reason = f"{interrupted_reason(name)} before torchrun started its ranks"
        elif others_stop:
            not_started_reason = stopped  # the cause of this torchrun's error, if it had one
        elif torchrun_error:
            not_started_reason = f"torchrun failed: {torchrun_error}"
        elif stopped:
            not_started_reason = CANNOT_RENDEZVOUS_PREFIX + stopped
        else:
            not_started_reason = (
                f"torchrun exited with {exit_code(returncode)} before it started its ranks"
            )
        report = wire.NodeExit(
            run_name=str(config.run_name),
            node_rank=config.node_rank,
            hostname=socket.gethostname(),
            exit_code=exit_code(returncode),
        )
        for local_rank in range(config.nproc_per_node):
            rank = config.node_rank * config.nproc_per_node + local_rank
            end = report.ranks.add(rank=rank, local_rank=local_rank)
            info = failed.get(local_rank)
            if not_started:
                end.end_state = wire.EndState.END_STATE_NOT_STARTED
                end.reason = not_started_reason
                if own_stop:
                    end.signal = interrupted
            elif interrupted and (info is None and not unlisted_completed or _stopped(info)):
                end.end_state = wire.EndState.END_STATE_TERMINATED
                end.signal = (info or {}).get("signal") or interrupted
                end.reason = interrupted_reason(signal.Signals(interrupted).name)
            elif others_stop and not (info is None and unlisted_completed or failed_before_stop):
                # died of its peers' end on the stopped node, or stopped by this launcher
                end.end_state = wire.EndState.END_STATE_TERMINATED
                if info is not None:
                    _keep_code(end, info)
                end.reason = stopped
            elif info is None:
                if unlisted_completed:
                    end.end_state = wire.EndState.END_STATE_COMPLETED
                    end.exit_code = 0
                else:
                    end.end_state = wire.EndState.END_STATE_TERMINATED
                    end.reason = f"torchrun failed: {torchrun_error}" if torchrun_error else ""
            elif info.get("stopped"):
                end.end_state = wire.EndState.END_STATE_TERMINATED
                _keep_code(end, info)
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


def _keep_code(end, info: dict) -> None:
    """Set ``end`` (a RankEnd) to the signal a rank's failure record says it died of, else to
    its exit code."""
    if info.get("signal") is not None:
        end.signal = info["signal"]
    else:
        end.exit_code = info["exit_code"]


def _stopped(info: dict | None) -> bool:
    """A failure record of a rank that died of a stop signal (SIGTERM, SIGINT, SIGKILL)."""
    return info is not None and info.get("signal") in (
        signal.SIGTERM,
        signal.SIGINT,
        signal.SIGKILL,
    )


def _read_record(path: Path) -> dict | None:
    """torchrun_main's record of torchrun's ranks: ``ranks_started`` (false once torch is
    imported and the rendezvous next, true as it first starts them), ``failed`` (one entry a
    failed rank), ``torchrun_error`` (torchrun itself failed); None when there is none
    (torchrun is still importing torch, or never got past it)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _has_children(pid: int) -> bool:
    """Whether process ``pid`` (torchrun) has a child process (its ranks); True when that
    cannot be read (nothing is then killed for want of ranks). Never raises: it runs in the
    launcher's signal handler, before the signal is passed on."""
    try:
        import psutil

        return bool(psutil.Process(pid).children())
    except Exception:
        return True
