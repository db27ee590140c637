"""``traceml run``: one node's whole launch, from validated flags to torchrun's exit code.

The launch moves through the phases of :mod:`traceml.launcher.states` (starting, training,
finalizing, then completed, failed, interrupted or abandoned), and :class:`Launch` reads as
those phases, left to right; its parts do the work:

* :class:`~traceml.launcher.node.NodeLaunch`: this node's torchrun, sampler and session;
* :class:`~traceml.launcher.supervisor.AggregatorSupervisor` (node 0): its aggregator process,
  restarted on the run's store if it dies;
* :class:`~traceml.launcher.finalization.Finalization` (node 0): the summary, from the
  aggregator or, once it is lost, from the store.

Node 0::

    starting:   check claim, port -> run dir -> run token file -> start aggregator
    training:   torchrun -> wait SERVING -> open the node session (claim) -> node sampler
                -> wait (restart a dead aggregator; say stalls and partial summaries)
    finalizing: report node exit -> finalize (bounded; from the store if the aggregator is
                lost) -> print summary -> close the session -> stop aggregator -> exit code

Node r > 0::

    starting:   check claim -> run dir -> wait for node 0's aggregator and the run token
                (bounded) -> open the node session (claim; refused: stop)
    training:   torchrun -> node sampler -> wait
    finalizing: report node exit -> close the session -> exit code

Each node's launcher holds one session stream with node 0's aggregator
(:mod:`traceml.launcher.session`), its one channel from the aggregator: claim, heartbeats,
the node's exit and node 0's finalization go up it; the run's failure, the stall record, the
watchdog's partial summary and the summary come down. A node-rank claim that
cannot be right (see :mod:`traceml.launcher.claim`) stops the launch before torchrun on the
node that makes it, and every node whose session is open stops its torchrun once the
aggregator pushes that the run cannot rendezvous.

Node 0 starts torchrun without waiting for its aggregator to serve: the aggregator is ready in
well under a second, while each rank imports torch and joins the process group for longer than
that before its first send (and the SDK keeps and resends what it could not send). The checks
that can refuse a launch (flags, claim, port) all run before either process starts.

The exit code is torchrun's, except after a second SIGTERM/SIGINT, which ends the launch at
once (128 + the signal). The first one is passed on to torchrun, and the summary of the steps
so far follows (status interrupted). Once training has started, a telemetry failure (node 0's
aggregator not serving, or dying) is a warning on stderr and a field in the manifest, never a
different exit code. The launcher owns its processes: the aggregator ends when the launcher's
pipe to it closes and torchrun gets SIGTERM when the launcher dies, however it dies.

gRPC (about 0.2 s of imports) is imported where it is first used, after torchrun has started.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import socket
import threading
import time

from traceml import __version__
from traceml.core import log
from traceml.core.ends import is_interrupted
from traceml.core.heap import freeze_startup_objects
from traceml.core.rundir import Manifest, RunDir
from traceml.launcher import claim, credentials
from traceml.launcher.config import LaunchConfig, LaunchError
from traceml.launcher.exits import ExitWatch
from traceml.launcher.finalization import Finalization
from traceml.launcher.hang import HangNotice
from traceml.launcher.node import NodeLaunch
from traceml.launcher.states import LAUNCH_TRANSITIONS, AggregatorStatus, Machine, Phase
from traceml.launcher.supervisor import AggregatorSupervisor
from traceml.launcher.terminal_view import TerminalView, node0_view_line
from traceml.launcher.torchrun import exit_code

#: How often node 0's launcher looks at what its session brought (a stall, a partial summary)
#: and refreshes its live view while training runs, s.
WATCH_INTERVAL_S = 1.0
#: Longest time from a signal during finalization to the launcher's return, s: a summary that
#: takes longer (an aggregator that stopped answering, a huge store) is given up, as after a
#: second signal.
FINALIZE_INTERRUPT_GRACE_S = 5.0


class Abandon(BaseException):
    """A second SIGTERM/SIGINT: the launcher ends at once (raised by its signal handler)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


_log = log.get("launcher")


def check_port_free(
    host: str, port: int, flag: str = "--aggregator-port", host_flag: str = "--aggregator-bind-host"
) -> None:
    """Raise :class:`LaunchError` when a socket listens on ``host:port`` right now, or
    ``host`` is no address of this machine (the error names ``flag`` or ``host_flag``).

    The probe binds with ``SO_REUSEADDR`` and listens, as the aggregator's gRPC server does:
    TIME_WAIT sockets (left by an aggregator that was killed while ranks were connected, for
    60 s) never block it, while any listener does, including one that set ``SO_REUSEPORT``
    (gRPC's default), with which a second server would otherwise share the port silently;
    the probe itself never sets ``SO_REUSEPORT``.
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            sock.bind((host, port))
            sock.listen(1)
        except OSError as exc:
            in_use = exc.errno == errno.EADDRINUSE
            what = {"--aggregator-port": "aggregator", "--metrics-port": "/metrics"}.get(
                flag, "dashboard"
            )
            fix = f"pick another with {flag}" if in_use else f"check {host_flag}"
            raise LaunchError(
                f"{what} port {host}:{port} is not available "
                f"({'already in use' if in_use else exc.strerror}); {fix}"
            ) from None


def preflight(config: LaunchConfig) -> None:
    """Checks that need the outside world, before anything starts (raises LaunchError).

    The node-rank claim comes first: a second node 0 would otherwise only learn that the
    aggregator port is taken (on machines that share one port space).

    The run directory is made last, so that one that cannot be (``--logs-dir`` not writable,
    a file, under ``/proc``) is a LaunchError too, and a launch refused earlier makes none;
    then node 0 writes the run token into it (a full disk: a LaunchError, and the directories
    just made, empty, are removed).

    Raises:
        ClaimError: this node's ``--node-rank`` cannot be right (see
            :func:`traceml.launcher.claim.check`).
    """
    claim.check(config)
    run_dir = RunDir(config.run_dir, config.node_rank)
    if config.owns_aggregator:
        if run_dir.database.exists():
            raise LaunchError(
                f"{config.run_dir} already holds a run's telemetry; use another --run-name"
            )
        check_port_free(config.aggregator_bind_host, config.aggregator_port)
        if config.mode == "dashboard":
            check_port_free(config.aggregator_bind_host, config.dashboard_port, "--dashboard-port")
        if config.metrics_port is not None:
            check_port_free(
                config.metrics_bind_host,
                config.metrics_port,
                "--metrics-port",
                "--metrics-bind-host",
            )
    try:
        made = run_dir.create(owner=config.owns_aggregator)
    except OSError as exc:
        raise LaunchError(
            f"cannot make the run directory {config.run_dir} (--logs-dir "
            f"{config.logs_dir}): {exc.strerror or exc}"
        ) from None
    if config.owns_aggregator:
        try:
            credentials.prepare_owner(config, run_dir)
        except OSError as exc:
            for directory in made:
                with contextlib.suppress(OSError):  # not empty: another node's files
                    directory.rmdir()
            raise LaunchError(
                f"cannot write the run token to {run_dir.token_file}: {exc.strerror or exc}"
            ) from None


class Launch:
    """One node's launch (see the module docstring): its phase (:mod:`traceml.launcher.states`)
    and its parts: the node's torchrun, sampler and session (:class:`NodeLaunch`), node 0's
    aggregator (:class:`AggregatorSupervisor`) and summary (:class:`Finalization`)."""

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.run_dir = RunDir(config.run_dir, config.node_rank)
        self.phase = Machine("launch", LAUNCH_TRANSITIONS, Phase.STARTING)
        self.node = NodeLaunch(config, self.run_dir)
        owner = config.owns_aggregator
        self.supervisor = AggregatorSupervisor(config, self.run_dir) if owner else None
        self.finalization = (
            Finalization(config, self.run_dir, self.supervisor, lambda: self._signals)
            if owner
            else None
        )
        #: The first SIGTERM/SIGINT the launcher got (None: not interrupted), and how many.
        self.interrupted: int | None = None
        self._signals = 0
        #: Node 0's live view while training runs (``--mode cli``/``dashboard``).
        self.terminal_view: TerminalView | None = None
        #: Armed by a signal during finalization: signals the launcher again once
        #: FINALIZE_INTERRUPT_GRACE_S has passed (see :meth:`_on_signal`).
        self._overdue: threading.Timer | None = None

    def run(self) -> int:
        """Launch, wait, finish (the run directory made by :func:`preflight`); returns the exit
        code for the launcher."""
        owner = self.config.owns_aggregator
        node_manifest = self._node_manifest()
        run_manifest = self._run_manifest() if owner else None
        refused = self._start(node_manifest, run_manifest)
        if refused is not None:
            return refused
        return self._train_and_finish(node_manifest, run_manifest)

    def _start(self, node_manifest: Manifest, run_manifest: Manifest | None) -> int | None:
        """Phase starting: node 0 starts its aggregator (its run token written by
        :func:`preflight`); node r > 0 waits for it and claims its rank. None to go on, else
        the launch's exit code (it failed, said on stderr and recorded)."""
        if run_manifest is not None:
            self.supervisor.start()
        elif failure := self.node.join():
            self.phase.to(Phase.FAILED, failure)
            node_manifest.event("ended", status=failure)
            return 2 if failure == "claim_refused" else 1
        return None

    def _train_and_finish(self, node_manifest: Manifest, run_manifest: Manifest | None) -> int:
        """Phases training and finalizing, and the end; torchrun's exit code (128 + N after a
        second signal N that came before torchrun exited)."""
        owner = run_manifest is not None
        self.terminal_view = self._terminal_view() if owner else None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        returncode = outcome = None
        try:
            self._start_training(node_manifest, run_manifest)
            returncode = self._wait_training(run_manifest or node_manifest)
            self.node.hear_run_failure(run_manifest or node_manifest, returncode, self.interrupted)
            outcome = self._outcome(returncode)
            self.phase.to(Phase.FINALIZING)
            self._close_terminal_view()
            self._after_training(returncode, outcome, node_manifest, run_manifest)
        except Abandon as abandon:
            return self._abandon(abandon.signum, returncode, node_manifest, run_manifest)
        except Exception as exc:  # fail-open: telemetry never changes the training's outcome
            self._close_terminal_view()
            if returncode is None:
                raise
            self.phase.to(outcome, "TraceML failed after training")
            _log.warning(
                f"warning: TraceML failed after training ({type(exc).__name__}: {exc}); "
                f"exit code {self._exit_code(returncode)} is torchrun's"
            )
        finally:
            if self._overdue is not None:
                self._overdue.cancel()
        return self._exit_code(returncode)

    def _exit_code(self, returncode: int) -> int:
        """The launch's exit code: torchrun's (:func:`exit_code`), as plain torchrun would
        return it; so 1, not the 143 of the SIGTERM that stopped it, for a torchrun this
        launcher stopped because the run cannot rendezvous (:meth:`NodeLaunch.watch_claims`:
        plain torchrun fails its rendezvous with 1 at its timeout)."""
        if returncode != 0 and not self.interrupted and self.node.stopped_cannot_rendezvous():
            return 1
        return exit_code(returncode)

    def _start_training(self, node_manifest: Manifest, run_manifest: Manifest | None) -> None:
        """Phase training begins: the node relay and torchrun, then (node 0) its aggregator
        serving and its session, then the node sampler (node 0's needs its own aggregator)."""
        node, supervisor = self.node, self.supervisor
        node.start_relay()
        if supervisor is not None and node.relay is not None:
            supervisor.on_lost = node.relay.upstream_gone
        node.torchrun.start(self.terminal_view.consoles() if self.terminal_view else None)
        if self.interrupted:  # signalled while torchrun was starting
            node.torchrun.forward_signal(self.interrupted)
            node.say_interrupted(self.interrupted)
        self.phase.to(Phase.TRAINING)
        pid = node.torchrun.process.pid
        run_dir = self.run_dir
        saved = {
            "training_stdout": str(run_dir.training_stdout),
            "training_stderr": str(run_dir.training_stderr),
        }
        node_manifest.event(
            "training_started",
            status=Phase.TRAINING.value,
            torchrun_pid=pid,
            artifacts=saved if self.config.save_training_output else {},
        )
        if run_manifest is not None:
            run_manifest.event("training_started", status=Phase.TRAINING.value)
            supervisor.wait_serving(run_manifest)
            if supervisor.status is AggregatorStatus.SERVING:
                node.open_session()
        if supervisor is None or supervisor.status is not AggregatorStatus.FAILED:
            node.start_sampler()

    def _node_manifest(self) -> Manifest:
        """This node's manifest, its ``started`` event recorded; its artifacts (the training
        output files) are named once torchrun starts writing them (:meth:`_start_training`):
        a node that never trains (refused, node 0 unreachable) names none."""
        config = self.config
        return self._manifest(
            self.run_dir.node_manifest,
            {"node_rank": config.node_rank, "hostname": socket.gethostname()},
            {"artifacts": {}},
        )

    def _run_manifest(self) -> Manifest:
        """Node 0's run manifest, its ``started`` event recorded."""
        run_dir = self.run_dir
        artifacts = {
            "database": str(run_dir.database),
            "aggregator_stderr": str(run_dir.aggregator_stderr),
            "nodes": str(run_dir.root / "nodes"),
            "run_token": str(run_dir.token_file),
        }
        return self._manifest(
            run_dir.run_manifest,
            {"run_name": self.config.run_name},
            {"aggregator": self.supervisor.health, "artifacts": artifacts},
        )

    def _manifest(self, path, head: dict, tail: dict) -> Manifest:
        """The manifest at ``path``: the version, ``head``, the launch's flags, the status
        (starting) and ``tail``, in that order; its ``started`` event recorded."""
        fields = {"traceml_version": __version__, **head, "launch": self.config.to_manifest()}
        manifest = Manifest(path, {**fields, "status": Phase.STARTING.value, **tail})
        manifest.event("started")
        return manifest

    def _outcome(self, returncode: int) -> Phase:
        """How the launch ends, decided as training ends: interrupted by a signal (to this
        launcher, or to another node's: :meth:`NodeLaunch.watch_claims`), else completed
        (torchrun exited 0) or failed."""
        if self.interrupted or is_interrupted(self.node.run_failure):
            return Phase.INTERRUPTED
        return Phase.COMPLETED if exit_code(returncode) == 0 else Phase.FAILED

    def _on_signal(self, signum: int, _frame=None) -> None:
        """SIGTERM/SIGINT: the first stops training (passed on to torchrun, which stops the
        ranks) or, once training ended, cuts finalization short; the summary follows. A
        second one ends the launcher at once (:class:`Abandon`)."""
        self._signals += 1
        if self._signals > 1:
            raise Abandon(signum)
        self.interrupted = signum
        name = signal.Signals(signum).name
        if self.phase.state is Phase.FINALIZING:
            _log.info(
                f"got {name}: writing the summary with what is stored now, within "
                f"{FINALIZE_INTERRUPT_GRACE_S:g} s (again: end at once)"
            )
            # The main thread may wait on an aggregator that no longer answers (stopped, or
            # writing a huge summary): past the grace, end as after a second signal.
            self._overdue = threading.Timer(
                FINALIZE_INTERRUPT_GRACE_S, self._end_overdue, (signum,)
            )
            self._overdue.daemon = True
            self._overdue.start()
        else:
            then = "the summary follows" if self.config.owns_aggregator else "node 0 sums up"
            _log.info(f"got {name}: stopping training; {then} (again: end at once)")
            self.node.torchrun.forward_signal(signum)
            self.node.say_interrupted(signum)  # now: other nodes' ranks die of this one's end

    def _end_overdue(self, signum: int) -> None:
        """Timer thread: the summary after an interrupt is overdue; end as after a second
        signal (the handler, on the main thread, raises :class:`Abandon`)."""
        _log.info(
            f"the summary is not written {FINALIZE_INTERRUPT_GRACE_S:g} s after "
            f"{signal.Signals(signum).name}: ending now"
        )
        os.kill(os.getpid(), signum)

    def _abandon(
        self,
        signum: int,
        returncode: int | None,
        node_manifest: Manifest,
        run_manifest: Manifest | None,
    ) -> int:
        """End at once after a second signal: SIGKILL torchrun's process group if it still
        runs, stop the aggregator without a summary. The exit code is torchrun's if it had
        exited, else a shell's for the signal (128 + N)."""
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, signal.SIG_IGN)  # the end is under way: a third one is moot
        self.phase.to(Phase.ABANDONED)
        self._close_terminal_view()
        _log.info(f"got {signal.Signals(signum).name} again: ending now, without a summary")
        torchrun = self.node.torchrun
        if returncode is None and torchrun.process is not None:
            torchrun.kill()
            torchrun.wait(5.0)
        code = exit_code(returncode) if returncode is not None else 128 + signum
        self.node.stop_senders()
        self.node.close_session(0.5)
        if self.supervisor is not None and self.supervisor.process is not None:
            self.supervisor.abandon()
        for manifest in (run_manifest, node_manifest):
            if manifest is not None:
                manifest.event("ended", status=Phase.ABANDONED.value, exit_code=code, signal=signum)
        return code

    def _wait_training(self, manifest: Manifest) -> int:
        """torchrun's return code, once it exits.

        It sleeps until torchrun or its aggregator exits (:class:`ExitWatch`: a dead
        aggregator is restarted as it dies) or its next watch is due. Meanwhile node 0 looks,
        every :data:`WATCH_INTERVAL_S`, at what its session brought (:meth:`_Node0News.hear`)
        and says, once each, when its aggregator died (training goes on without telemetry), when a
        stall begins and ends, and when the aggregator's watchdog wrote a partial summary
        because ranks never finished (training goes on: TraceML never stops a job; the user
        decides). The one exception, on every node: a node-rank claim the aggregator refused
        means a node will never join the rendezvous, so torchrun is stopped
        (:meth:`NodeLaunch.watch_claims`). A torchrun that a stop signal did not stop within
        seconds while it ran no rank (it waits in torch's store: the rendezvous, or the exit
        barrier of several nodes) is killed (:meth:`TorchrunProcess.end_stuck_stop`); its
        return code is then plain torchrun's there. A failure
        of this watch only ends the watch.
        """
        owner = self.config.owns_aggregator
        torchrun = self.node.torchrun
        self._say_where_the_view_is(owner)
        freeze_startup_objects()  # start-up is over: see traceml/core/heap.py
        news = _Node0News(self.config, self.run_dir, self.terminal_view) if owner else None
        next_watch = time.monotonic() + WATCH_INTERVAL_S
        exits = ExitWatch()  # wakes as torchrun or the aggregator exits, or at the next watch
        try:
            while True:
                aggregator_process = self.supervisor.process if owner else None
                running = [
                    p
                    for p in (torchrun.process, aggregator_process)
                    if p is not None and p.returncode is None
                ]
                exits.wait(running, next_watch - time.monotonic())
                returncode = torchrun.wait(0)
                if returncode is not None:
                    return returncode
                if (killed := torchrun.end_stuck_stop()) is not None:
                    manifest.event("torchrun_killed")
                    return killed  # as plain torchrun would have ended
                torchrun.say_rendezvous_wait()
                try:
                    self.node.watch_claims(manifest)
                    if owner:
                        self.supervisor.watch(manifest)
                    if time.monotonic() < next_watch:
                        continue
                    next_watch = time.monotonic() + WATCH_INTERVAL_S
                    if owner:
                        news.hear(self.node.session, manifest)
                except Exception as exc:
                    _log.warning(
                        f"warning: stopped watching the aggregator ({type(exc).__name__}: {exc})"
                    )
                    return torchrun.wait()
        finally:
            exits.close()

    def _terminal_view(self) -> TerminalView | None:
        """Node 0's ``--mode cli`` view of every node; None for ``summary`` and for
        ``dashboard``, whose page the aggregator serves (:meth:`_say_where_the_view_is`)."""
        config = self.config
        if config.mode != "cli":
            return None
        return TerminalView(config.launcher_target, str(config.run_name))

    def _say_where_the_view_is(self, owner: bool) -> None:
        """One line, once: node 0 in ``--mode dashboard`` prints the page's URL (when its
        aggregator serves); every other node prints where node 0's view is."""
        config = self.config
        if config.mode == "summary":
            return
        if owner:
            if config.mode == "dashboard" and self.supervisor.status is AggregatorStatus.SERVING:
                _log.info(
                    f"dashboard: {config.dashboard_url} (open the link in "
                    f"{self.run_dir.dashboard_link}, mode 0600: it holds the run token; from "
                    "another machine: see docs/dashboard.md for an SSH tunnel)"
                )
            return
        node0_host = config.aggregator_host or config.master_addr
        where = None
        if config.mode == "dashboard":
            where = f"{config.dashboard_url} (the link: node 0's {self.run_dir.dashboard_link})"
        _log.info(
            node0_view_line(
                config.mode, node0_host, config.aggregator_target, str(config.run_name), where
            )
        )

    def _close_terminal_view(self) -> None:
        """End node 0's live view (the summary is printed next)."""
        if self.terminal_view is not None:
            self.terminal_view.close()

    def _after_training(
        self,
        returncode: int,
        outcome: Phase,
        node_manifest: Manifest,
        run_manifest: Manifest | None,
    ) -> None:
        """Report this node's exit, finalize and stop the aggregator (node 0), record the end
        in the manifests, and end the launch in ``outcome``."""
        node, supervisor = self.node, self.supervisor
        code = self._exit_code(returncode)
        report = node.end_training(returncode, self.interrupted)
        node_manifest.event(
            "training_ended",
            status="reporting" if run_manifest is None else Phase.FINALIZING.value,
            torchrun_exit_code=exit_code(returncode),
            ranks=[_rank_end_json(r) for r in report.ranks],
        )
        if run_manifest is not None:
            supervisor.watch(run_manifest)  # a dead one is restarted before the report
        # Node 0 whose aggregator is lost has said so once; reporting to it would only fail.
        own_aggregator_lost = (
            supervisor is not None and supervisor.status is AggregatorStatus.FAILED
        )
        telemetry_ok = not own_aggregator_lost and node.report_exit(report)
        if run_manifest is not None:
            try:
                self.finalization.run(run_manifest, node.session, report)
            finally:
                node.close_session()
                supervisor.stop(2.0 if self.interrupted else 10.0)
            run_manifest.event(
                "ended", status=outcome.value, exit_code=code, aggregator=supervisor.health
            )
        else:
            node.close_session()
        node_manifest.event(
            "ended", status=outcome.value, exit_code=code, telemetry_reported=telemetry_ok
        )
        self.phase.to(outcome)


class _Node0News:
    """What node 0's launcher says while training runs, from its session (the stall record,
    the watchdog's partial summary) and its live view; no file of the aggregator's is read."""

    def __init__(self, config: LaunchConfig, run_dir: RunDir, live: TerminalView | None) -> None:
        self.config = config
        self.run_dir = run_dir
        self.live = live
        self.hang = HangNotice()
        self.partial_said = False

    def hear(self, session, manifest: Manifest) -> None:
        """Refresh the live view; say a new stall (or its end) and, once, a partial summary."""
        if self.live is not None and not self.live.tick():
            self.live = None
        if session is None:
            return  # the aggregator never served: nothing to hear
        self.hang.hear(session.hang_record, _log.warning)
        partial = session.partial_summary
        if self.partial_said or partial is None or not partial.missing_ranks:
            return
        self.partial_said = True
        path = self.run_dir.final_summary_json
        missing = list(partial.missing_ranks)
        manifest.event(
            "partial_summary", partial_summary={"path": str(path), "missing_ranks": missing}
        )
        _log.info(
            f"partial summary written to {path}: ranks {missing} have not finished "
            f"{self.config.finalize_timeout_sec:g} s (--finalize-timeout-sec) after the first "
            "rank ended; training keeps running (TraceML never stops it; Ctrl-C does)"
        )


def _rank_end_json(end) -> dict:
    from traceml import wire

    return {
        "rank": end.rank,
        "local_rank": end.local_rank,
        "end_state": wire.end_state_name(end.end_state),
        "exit_code": end.exit_code if end.HasField("exit_code") else None,
        "signal": end.signal if end.HasField("signal") else None,
        "reason": end.reason or None,
    }
