"""``traceml run``: one node's whole launch, from validated flags to torchrun's exit code.

Node 0::

    check claim, port -> run dir -> run token file -> start aggregator -> torchrun
    -> wait SERVING -> open the node session (claim) -> node sampler
    -> wait (watching the aggregator: restart it on the store if it died)
    -> report node exit -> finalize (bounded; from the store if the aggregator is lost)
    -> print summary -> close the session -> stop aggregator -> exit code

Node r > 0::

    check claim -> run dir -> wait for node 0's aggregator and the run token (bounded)
    -> open the node session (claim; refused: stop)
    -> node sampler -> torchrun -> wait -> report node exit -> close the session -> exit code

Each node's launcher holds one session stream with node 0's aggregator
(:mod:`traceml.launcher.session`): claim, heartbeats, the node's exit and node 0's
finalization go up it, the run's failure and the summary come down. A node-rank claim that
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

import errno
import json
import os
import signal
import socket
import sys
import threading
import time

from traceml import __version__, settings
from traceml.core import endpoint, log
from traceml.core.heap import freeze_startup_objects
from traceml.launcher import aggregator, claim, credentials
from traceml.launcher.config import LaunchConfig, LaunchError
from traceml.launcher.exits import ExitWatch
from traceml.launcher.live import LiveView, node0_view_line
from traceml.launcher.stall import StallNotice
from traceml.core.rundir import Manifest, RunDir
from traceml.launcher.torchrun import TorchrunProcess, exit_code


#: How often node 0's launcher looks for a partial summary and a stall while training runs, s.
WATCH_INTERVAL_S = 1.0
#: How long a launcher waits for the aggregator's verdict on its claim, and for its exit
#: report to be stored, s.
SESSION_ANSWER_S = 10.0
#: Longest finalization after the launcher was interrupted (SIGTERM, SIGINT), s: Slurm sends
#: SIGKILL 30 s after its SIGTERM (KillWait), and the summary must be written before.
INTERRUPTED_FINALIZE_BUDGET_S = 10.0
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


def check_port_free(host: str, port: int, flag: str = "--aggregator-port") -> None:
    """Raise :class:`LaunchError` when a socket listens on ``host:port`` right now.

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
            why = "already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            what = "aggregator" if flag == "--aggregator-port" else "dashboard"
            raise LaunchError(
                f"{what} port {host}:{port} is not available ({why}); pick another with {flag}"
            ) from None


def preflight(config: LaunchConfig) -> None:
    """Checks that need the outside world, before anything starts (raises LaunchError).

    The node-rank claim comes first: a second node 0 would otherwise only learn that the
    aggregator port is taken (on machines that share one port space).

    Raises:
        ClaimError: this node's ``--node-rank`` cannot be right (see
            :func:`traceml.launcher.claim.check`).
    """
    claim.check(config)
    if config.owns_aggregator:
        if RunDir(config.run_dir, config.node_rank).database.exists():
            raise LaunchError(
                f"{config.run_dir} already holds a run's telemetry; use another --run-name"
            )
        check_port_free(config.aggregator_bind_host, config.aggregator_port)
        if config.mode == "dashboard":
            check_port_free(config.aggregator_bind_host, config.dashboard_port, "--dashboard-port")


class Launch:
    """One node's launch (see the module docstring)."""

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.run_dir = RunDir(config.run_dir, config.node_rank)
        self.aggregator_process = None
        #: Node 0's aggregator, as the run manifest records it; ``restarts`` lists each
        #: replacement: ``{"reason", "gap_s"}`` (s from the death seen to serving again).
        self.health = {
            "status": "not_started",
            "reason": None,
            "pid": None,
            "exit_code": None,
            "restarts": [],
        }
        self.sampler = None
        #: Why the run cannot rendezvous, once node 0's aggregator says so ("" until then).
        self.run_failure = ""
        #: This node's session with node 0's aggregator (None until opened).
        self.session = None
        self.torchrun: TorchrunProcess | None = None
        #: The first SIGTERM/SIGINT the launcher got (None: not interrupted), and how many.
        self.interrupted: int | None = None
        self._signals = 0
        #: True once training ended: a signal then cuts finalization short.
        self._finalizing = False
        #: True once node 0's aggregator served (there is a store to summarize).
        self._served = False
        #: Node 0's live view while training runs (``--mode cli``/``dashboard``).
        self.live_view: LiveView | None = None
        #: Armed by a signal during finalization: signals the launcher again once
        #: FINALIZE_INTERRUPT_GRACE_S has passed (see :meth:`_on_signal`).
        self._overdue: threading.Timer | None = None

    def run(self) -> int:
        """Launch, wait, finish; returns the exit code for the launcher."""
        config, run_dir = self.config, self.run_dir
        owner = config.owns_aggregator
        run_dir.create(owner=owner)
        node_manifest = Manifest(
            run_dir.node_manifest,
            {
                "traceml_version": __version__,
                "node_rank": config.node_rank,
                "hostname": socket.gethostname(),
                "launch": config.to_manifest(),
                "status": "starting",
                "artifacts": (
                    {
                        "training_stdout": str(run_dir.training_stdout),
                        "training_stderr": str(run_dir.training_stderr),
                    }
                    if config.save_training_output
                    else {}
                ),
            },
        )
        node_manifest.event("started")
        run_manifest = None
        if owner:
            run_manifest = Manifest(
                run_dir.run_manifest,
                {
                    "traceml_version": __version__,
                    "run_name": config.run_name,
                    "launch": config.to_manifest(),
                    "status": "starting",
                    "aggregator": self.health,
                    "artifacts": {
                        "database": str(run_dir.database),
                        "aggregator_stderr": str(run_dir.aggregator_stderr),
                        "nodes": str(run_dir.root / "nodes"),
                        "run_token": str(run_dir.token_file),
                    },
                },
            )
            run_manifest.event("started")
            try:
                credentials.prepare_owner(config, run_dir)
            except OSError as exc:
                _log.info(f"error: cannot write the run token to {run_dir.token_file}: {exc}")
                run_manifest.event("ended", status="failed", exit_code=1)
                return 1
            self._start_aggregator()
        elif (failure := self._wait_for_owner()):
            node_manifest.event("ended", status=failure)
            return 1
        elif not self._register():
            node_manifest.event("ended", status="claim_refused")
            return 2

        torchrun = self.torchrun = TorchrunProcess(config, run_dir)
        self.live_view = self._live_view() if owner else None
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        returncode = None
        try:
            torchrun.start(self.live_view.consoles() if self.live_view else None)
            if self.interrupted:  # signalled while torchrun was starting
                torchrun.forward_signal(self.interrupted)
            node_manifest.event(
                "training_started", status="training", torchrun_pid=torchrun.process.pid
            )
            if run_manifest:
                run_manifest.event("training_started", status="training")
                self._wait_aggregator_serving(run_manifest)
                if self.health["status"] == "serving":
                    self.session = claim.open_session(config)
            if self.health["status"] != "failed":  # node 0's sampler needs its own aggregator
                self._start_sampler()
            returncode = self._wait_training(torchrun, run_manifest or node_manifest)
            self._close_live_view()
            self._finalizing = True
            self._after_training(torchrun, returncode, node_manifest, run_manifest)
        except Abandon as abandon:
            return self._abandon(abandon.signum, returncode, node_manifest, run_manifest)
        except Exception as exc:  # fail-open: telemetry never changes the training's outcome
            self._close_live_view()
            if returncode is None:
                raise
            _log.warning(
                f"warning: TraceML failed after training ({type(exc).__name__}: {exc}); "
                f"exit code {exit_code(returncode)} is torchrun's"
            )
        finally:
            if self._overdue is not None:
                self._overdue.cancel()
        return exit_code(returncode)

    def _on_signal(self, signum: int, _frame=None) -> None:
        """SIGTERM/SIGINT: the first stops training (passed on to torchrun, which stops the
        ranks) or, once training ended, cuts finalization short; the summary follows. A
        second one ends the launcher at once (:class:`Abandon`)."""
        self._signals += 1
        if self._signals > 1:
            raise Abandon(signum)
        self.interrupted = signum
        name = signal.Signals(signum).name
        if self._finalizing:
            _log.info(
                f"got {name}: writing the summary with what is stored now, within "
                f"{FINALIZE_INTERRUPT_GRACE_S:g} s (again: end at once)"
            )
            # The main thread may wait on an aggregator that no longer answers (stopped, or
            # writing a huge summary): past the grace, end as after a second signal.
            self._overdue = threading.Timer(FINALIZE_INTERRUPT_GRACE_S, self._end_overdue, (signum,))
            self._overdue.daemon = True
            self._overdue.start()
        else:
            _log.info(f"got {name}: stopping training; the summary follows (again: end at once)")
            self.torchrun.forward_signal(signum)

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
        self._close_live_view()
        _log.info(f"got {signal.Signals(signum).name} again: ending now, without a summary")
        if returncode is None and self.torchrun.process is not None:
            self.torchrun.kill()
            self.torchrun.wait(5.0)
        code = exit_code(returncode) if returncode is not None else 128 + signum
        self._stop_sampler()
        self._close_session(0.5)
        if self.aggregator_process is not None:
            self.health["exit_code"] = exit_code(aggregator.stop(self.aggregator_process, 2.0))
            self.health["status"] = "stopped"
        for manifest in (run_manifest, node_manifest):
            if manifest is not None:
                manifest.event("ended", status="abandoned", exit_code=code, signal=signum)
        return code

    def _wait_training(self, torchrun: TorchrunProcess, manifest: Manifest) -> int:
        """torchrun's return code, once it exits.

        It sleeps until torchrun or its aggregator exits (:class:`ExitWatch`: a dead
        aggregator is restarted as it dies) or its next watch is due. Meanwhile node 0 looks at
        its aggregator every :data:`WATCH_INTERVAL_S` and says, once each, when it died
        (training goes on without telemetry) and when its watchdog wrote a partial summary
        because ranks never finished (training goes on: TraceML never stops a job; the user
        decides). The one exception, on every node: a node-rank claim the
        aggregator refused means a node will never join the rendezvous, so torchrun is stopped
        (:meth:`_watch_claims`). A failure of this watch only ends the watch.
        """
        owner = self.config.owns_aggregator
        self._say_where_the_view_is(owner)
        freeze_startup_objects()  # start-up is over: see traceml/core/heap.py
        started_unix_s = time.time()
        partial_seen = False
        stall = StallNotice(self.run_dir.stall_file) if owner else None
        live = self.live_view
        next_watch = time.monotonic() + WATCH_INTERVAL_S
        exits = ExitWatch()  # wakes as torchrun or the aggregator exits, or at the next watch
        try:
            while True:
                running = [
                    p for p in (torchrun.process, self.aggregator_process)
                    if p is not None and p.returncode is None
                ]
                exits.wait(running, next_watch - time.monotonic())
                returncode = torchrun.wait(0)
                if returncode is not None:
                    return returncode
                try:
                    self._watch_claims(torchrun, manifest)
                    if owner:
                        self._watch_aggregator(manifest)
                    if time.monotonic() < next_watch:
                        continue
                    next_watch = time.monotonic() + WATCH_INTERVAL_S
                    if not owner:
                        continue
                    if live is not None and not live.tick():
                        live = None
                    partial_seen = partial_seen or self._watch_partial(manifest, started_unix_s)
                    stall.poll(_log.warning)
                except Exception as exc:
                    _log.warning(
                        f"warning: stopped watching the aggregator ({type(exc).__name__}: {exc})"
                    )
                    return torchrun.wait()
        finally:
            exits.close()

    def _live_view(self) -> LiveView | None:
        """Node 0's ``--mode cli`` view of every node; None for ``summary`` and for
        ``dashboard``, whose page the aggregator serves (:meth:`_say_where_the_view_is`)."""
        config = self.config
        if config.mode != "cli":
            return None
        return LiveView(config.launcher_target, str(config.run_name))

    def _say_where_the_view_is(self, owner: bool) -> None:
        """One line, once: node 0 in ``--mode dashboard`` prints the page's URL (when its
        aggregator serves); every other node prints where node 0's view is."""
        config = self.config
        if config.mode == "summary":
            return
        if owner:
            if config.mode == "dashboard" and self.health["status"] == "serving":
                _log.info(
                    f"dashboard: {config.dashboard_url} (from another machine: see "
                    "docs/dashboard.md for an SSH tunnel)"
                )
            return
        node0_host = config.aggregator_host or config.master_addr
        url = None
        if config.mode == "dashboard" and config.run_token:
            url = endpoint.dashboard_url(node0_host, config.dashboard_port, str(config.run_token))
        _log.info(node0_view_line(
            config.mode, node0_host, config.aggregator_target, str(config.run_name), url
        ))  # fmt: skip

    def _close_live_view(self) -> None:
        """End node 0's live view (the summary is printed next)."""
        if self.live_view is not None:
            self.live_view.close()

    def _watch_aggregator(self, manifest: Manifest) -> None:
        """Restart node 0's aggregator on the run's store when its process has exited, up to
        ``--aggregator-max-restarts`` times (the ranks and samplers resend what it had not
        acknowledged); past that, record and report (once) that it is lost. Its exit code is
        a shell's (137: killed by SIGKILL)."""
        returncode = self.aggregator_process.poll()
        if returncode is None or self.health["status"] != "serving":
            return
        down_since = time.time()
        code = exit_code(returncode)
        self.health["exit_code"] = code
        reason = f"exited with code {code} during the run"
        while len(self.health["restarts"]) < self.config.aggregator_max_restarts:
            if self._restart_aggregator(manifest, reason, down_since):
                return
            reason = self.health["reason"]
        self._aggregator_lost(manifest, reason)

    def _restart_aggregator(self, manifest: Manifest, reason: str, down_since: float) -> bool:
        """Start a replacement aggregator on the same store; True once it serves."""
        config = self.config
        restarts = self.health["restarts"]
        self.aggregator_process = aggregator.start(
            config, self.run_dir, restart_reason=reason, down_since_unix_s=down_since
        )
        restarts.append({"reason": reason, "gap_s": None})
        self.health.update(status="starting", pid=self.aggregator_process.pid, exit_code=None)
        try:
            aggregator.wait_serving(
                config.launcher_target, config.aggregator_start_sec, self.aggregator_process
            )
        except Exception as exc:  # fail-open: AggregatorUnavailable, or gRPC failing
            self.health["exit_code"] = exit_code(aggregator.stop(self.aggregator_process, 2.0))
            self.health.update(status="failed", reason=f"restart did not serve ({exc})")
            return False
        gap_s = round(time.time() - down_since, 3)
        restarts[-1]["gap_s"] = gap_s
        self.health.update(status="serving", reason=None)
        manifest.event("aggregator_restarted", aggregator=self.health)
        _log.warning(
            f"warning: the aggregator {reason}; restarted it on the run's store after "
            f"{gap_s:.1f} s (restart {len(restarts)} of {config.aggregator_max_restarts}, "
            f"--aggregator-max-restarts); the ranks resend what it had not stored"
        )
        return True

    def _aggregator_lost(self, manifest: Manifest, reason: str) -> None:
        """Node 0's aggregator is not serving (``reason``) and will not be restarted: record
        it and warn; training goes on, and the summary is written from the store at the end."""
        self.health.update(status="failed", reason=reason)
        manifest.event("aggregator_failed", aggregator=self.health)
        _log.warning(
            f"warning: the aggregator {reason}; training continues without telemetry; the "
            f"summary will hold what was stored until now (see {self.run_dir.aggregator_stderr})"
        )

    def _watch_partial(self, manifest: Manifest, since_unix_s: float) -> bool:
        """True once the aggregator's watchdog has written a partial summary (said once)."""
        path = self.run_dir.final_summary_json
        try:
            if path.stat().st_mtime < since_unix_s:
                return False
            missing = json.loads(path.read_text(encoding="utf-8"))["run"]["missing_ranks"]
        except (OSError, ValueError, KeyError, TypeError):
            return False  # not written yet, being replaced, or not a summary
        if not missing:
            return False
        manifest.event("partial_summary", partial_summary={"path": str(path), "missing_ranks": missing})
        _log.info(
            f"partial summary written to {path}: ranks {missing} have not finished "
            f"{self.config.finalize_timeout_sec:g} s (--finalize-timeout-sec) after the first "
            "rank ended; training keeps running (TraceML never stops it; Ctrl-C does)"
        )
        return True

    def _watch_claims(self, torchrun: TorchrunProcess, manifest: Manifest) -> None:
        """Stop torchrun (once) when the session brought the run's failure.

        The aggregator pushes it down every open session once it refused another launcher's
        claim before every node had joined: that node never starts its torchrun, so this
        one would wait in the rendezvous until torchrun's own timeout.
        """
        if self.session is None or self.run_failure or not self.session.run_failure:
            return
        self.run_failure = self.session.run_failure
        manifest.event("rendezvous_failed", rendezvous_failure=self.run_failure)
        _log.error(
            f"error: the run cannot rendezvous: {self.run_failure}; stopping training on this "
            "node (no summary: nothing ran)"
        )
        torchrun.forward_signal(signal.SIGTERM)

    def _after_training(
        self,
        torchrun: TorchrunProcess,
        returncode: int,
        node_manifest: Manifest,
        run_manifest: Manifest | None,
    ) -> None:
        """Stop the sampler, report this node's exit, finalize and stop the aggregator (node
        0), and record the end in the manifests."""
        code = exit_code(returncode)
        status = "interrupted" if self.interrupted else "completed" if code == 0 else "failed"
        self._stop_sampler()
        report = torchrun.node_exit(returncode, self.interrupted)
        self._say_output_not_saved(torchrun)
        node_manifest.event(
            "training_ended",
            status="reporting" if run_manifest is None else "finalizing",
            torchrun_exit_code=code,
            ranks=[_rank_end_json(r) for r in report.ranks],
        )
        if run_manifest is not None:
            self._watch_aggregator(run_manifest)  # a dead one is restarted before the report
        # Node 0 whose aggregator is lost has said so once; reporting to it would only fail.
        own_aggregator_lost = run_manifest is not None and self.health["status"] == "failed"
        telemetry_ok = not own_aggregator_lost and self._report_node_exit(report)
        if run_manifest is not None:
            try:
                if not self._finalize(run_manifest):
                    self._finalize_from_store(run_manifest, report)
            finally:
                self._close_session()
                self._stop_aggregator()
            run_manifest.event("ended", status=status, exit_code=code, aggregator=self.health)
        else:
            self._close_session()
        node_manifest.event("ended", status=status, exit_code=code, telemetry_reported=telemetry_ok)

    def _say_output_not_saved(self, torchrun: TorchrunProcess) -> None:
        """Say how much training output reached the console but not its log (once per log)."""
        for tee in torchrun.tees:
            if tee.bytes_not_saved:
                _log.warning(
                    f"warning: {tee.bytes_not_saved} bytes of training output are missing from "
                    f"{tee.log_path} ({tee.log_error or 'the log fell behind'})"
                )

    # --- steps -------------------------------------------------------------------------------
    def _start_aggregator(self) -> None:
        """Start node 0's aggregator process; :meth:`_wait_aggregator_serving` waits for it."""
        self.aggregator_process = aggregator.start(self.config, self.run_dir)
        self.health.update(status="starting", pid=self.aggregator_process.pid)

    def _wait_aggregator_serving(self, manifest: Manifest) -> None:
        """Wait (at most ``TRACEML_AGGREGATOR_START_SEC``) until node 0's aggregator serves.

        Training has already started: an aggregator that never serves is stopped, recorded
        and reported, and the run goes on without telemetry.
        """
        config = self.config
        try:
            aggregator.wait_serving(
                config.launcher_target, config.aggregator_start_sec, self.aggregator_process
            )
        except Exception as exc:  # fail-open: AggregatorUnavailable, or gRPC failing to load
            self._stop_aggregator()
            self._aggregator_lost(manifest, f"did not serve ({exc})")
            return
        self.health.update(status="serving")
        self._served = True
        manifest.event("aggregator_serving", aggregator=self.health)

    def _register(self) -> bool:
        """Node r > 0: open this node's session, its claim first; False when refused.

        An aggregator that does not answer the claim within :data:`SESSION_ANSWER_S` (another
        run name, an old version) costs only the check: a warning, and the launch goes on.
        """
        self.session = claim.open_session(self.config)
        reply = self.session.wait_claim(SESSION_ANSWER_S)
        if reply is None:
            _log.warning(
                "warning: node 0's aggregator did not take this node's claim "
                f"({self.session.error or f'no answer within {SESSION_ANSWER_S:g} s'})"
            )
            return True
        if not reply.accepted:
            self._close_session()
            _log.error(f"error: node 0 refused this node: {reply.reason}")
        return reply.accepted

    def _wait_for_owner(self) -> str:
        """Node r > 0: wait for node 0's aggregator, then for the run token, both within
        ``TRACEML_AGGREGATOR_WAIT_SEC``; "" once both are there, else the node's end status."""
        wait_s = self.config.aggregator_wait_sec
        target = self.config.aggregator_target
        deadline = time.monotonic() + wait_s
        _log.info(
            f"node {self.config.node_rank}: waiting up to {wait_s:g} s for node 0's aggregator "
            f"at {target}"
        )
        try:
            aggregator.wait_serving(target, wait_s)
        except aggregator.AggregatorUnavailable as exc:
            _log.error(
                f"error: {exc} (is node 0 running `traceml run` with the same --run-name, "
                f"and is port {self.config.aggregator_port} reachable? raise the wait with "
                f"{settings.AGGREGATOR_WAIT_SEC.name})"
            )
            return "aggregator_unreachable"
        missing = credentials.obtain(self.config, self.run_dir, deadline)
        if missing:
            _log.info(f"error: {missing}")
            return "no_run_token"
        return ""

    def _start_sampler(self) -> None:
        """Start this node's system and process sampler (fail-open: a warning at most)."""
        from traceml.sdk.samplers import start_node_sampler

        try:
            self.sampler = start_node_sampler(self.config, self.torchrun.process.pid)
        except Exception as exc:
            _log.warning(f"warning: node sampler not started ({exc})")

    def _stop_sampler(self) -> None:
        if self.sampler is not None:
            try:
                self.sampler.close()
            except Exception as exc:
                _log.warning(f"warning: node sampler did not stop cleanly ({exc})")

    def _report_node_exit(self, report) -> bool:
        """Send this node's exit up its session; True once stored (a warning otherwise)."""
        if self.session is None:
            return False
        if self.session.report_exit(report, SESSION_ANSWER_S):
            return True
        _log.warning(
            "warning: could not report this node's exit to the aggregator "
            f"({self.session.error or f'not stored within {SESSION_ANSWER_S:g} s'})"
        )
        return False

    def _close_session(self, timeout_s: float = 2.0) -> None:
        """End this node's session cleanly (the aggregator then knows it done, not lost)."""
        if self.session is not None:
            self.session.close(timeout_s)

    def _stop_aggregator(self) -> None:
        """Stop node 0's aggregator (SIGKILL after 10 s, 2 s once interrupted); its exit code
        goes into the health fields."""
        timeout_s = 2.0 if self.interrupted else 10.0
        self.health["exit_code"] = exit_code(aggregator.stop(self.aggregator_process, timeout_s))
        if self.health["status"] == "serving":
            self.health["status"] = "stopped"

    def _finalize(self, manifest: Manifest) -> bool:
        """Ask node 0's aggregator for the final summary and print it.

        The budget is ``--finalize-timeout-sec``, at most :data:`INTERRUPTED_FINALIZE_BUDGET_S`
        once the launcher was interrupted. A signal during finalization cuts it short: the
        summary is written at once with what is stored (a second signal abandons it).

        Returns:
            False when the aggregator could not finalize because it is gone (the caller
            writes the summary from the store), True otherwise.
        """
        config = self.config
        self._watch_aggregator(manifest)
        if self.run_failure:
            return True  # said by _watch_claims: nothing ran, no summary
        if self.health["status"] != "serving":
            return not self._served  # lost (said by _aggregator_lost), or never served
        from traceml.launcher.session import SessionBroken

        budget = config.finalize_timeout_sec
        if self.interrupted:
            budget = min(budget, INTERRUPTED_FINALIZE_BUDGET_S)
        signals_before = self._signals
        gone = lambda: self.aggregator_process.poll() is not None  # noqa: E731
        try:
            reply = self.session.finalize(
                str(config.run_name),
                budget,
                cancelled=lambda: self._signals != signals_before,
                gone=gone,
            )
            if reply is None:  # a signal during the wait: now, with what is stored
                reply = self.session.finalize(str(config.run_name), 0.01, gone=gone)
        except SessionBroken as exc:
            if self.aggregator_process.poll() is not None:  # it died while finalizing
                restarts = len(self.health["restarts"])
                self._watch_aggregator(manifest)
                if len(self.health["restarts"]) > restarts and self.health["status"] == "serving":
                    return self._finalize(manifest)  # a replacement serves: ask it
                return False
            self.health.update(status="failed", reason=f"finalize failed: {exc}")
            manifest.update(aggregator=self.health)
            _log.warning(f"warning: no final summary: the aggregator failed ({exc})")
            return True
        if reply.error:
            self.health.update(status="failed", reason=reply.error)
            _log.warning(f"warning: no final summary: {reply.error}")
        else:
            self._print_summary(reply.summary_text)
            if reply.missing_ranks:
                _log.info(f"partial summary: ranks {list(reply.missing_ranks)} never finished")
            _log.info(f"summary: {reply.summary_json_path}")
        self._record_summary(
            manifest,
            {
                "final_summary_json": reply.summary_json_path,
                "final_summary_txt": reply.summary_text_path,
                "final_summary_html": reply.summary_html_path,
            },
            status="finalize_failed" if reply.error else "finalized",
            complete=reply.complete,
            missing_ranks=list(reply.missing_ranks),
        )
        return True

    def _finalize_from_store(self, manifest: Manifest, report) -> None:
        """Node 0's aggregator is gone for good: write the summary from the run's store with
        ``traceml-aggregator --finalize-only`` (this node's exit report included) and print it."""
        from traceml.core.rundir import SUMMARY_HTML_NAME, SUMMARY_JSON_NAME, SUMMARY_TEXT_NAME

        aggregator.stop(self.aggregator_process, 2.0)  # its store lock must be released
        node_exit_file = self.run_dir.node_dir / "node_exit.pb"
        node_exit_file.write_bytes(report.SerializeToString())
        root = self.run_dir.root
        try:
            code = aggregator.finalize_offline(self.config, self.run_dir, node_exit_file)
        except Exception as exc:  # fail-open: a timeout, or no python to run
            code = f"{type(exc).__name__}: {exc}"
        if code != 0:
            _log.warning(f"warning: no final summary: writing it from the store failed ({code}; see "
                f"{self.run_dir.aggregator_stderr})")
            manifest.event("finalized", status="finalize_failed", aggregator=self.health)
            return
        text = (root / SUMMARY_TEXT_NAME).read_text(encoding="utf-8")
        self._print_summary(text)
        _log.info(f"summary (written from the store: the aggregator was lost): {root / SUMMARY_JSON_NAME}")
        summary = json.loads((root / SUMMARY_JSON_NAME).read_text(encoding="utf-8"))
        html = root / SUMMARY_HTML_NAME
        self._record_summary(
            manifest,
            {
                "final_summary_json": str(root / SUMMARY_JSON_NAME),
                "final_summary_txt": str(root / SUMMARY_TEXT_NAME),
                "final_summary_html": str(html) if html.exists() else "",
            },
            status="finalized_from_store",
            complete=summary["run"]["complete"],
            missing_ranks=summary["run"]["missing_ranks"],
        )

    def _print_summary(self, text: str) -> None:
        """The summary text on stdout; a closed stdout (``| head``) costs only the text."""
        try:
            sys.stdout.write(text)
            sys.stdout.flush()
        except (OSError, ValueError):
            _log.warning("warning: stdout is closed; the summary is only in the files")

    def _record_summary(self, manifest: Manifest, paths: dict[str, str], **fields) -> None:
        """The ``finalized`` event: the summary's paths (those written) in the artifacts."""
        artifacts = dict(manifest.data["artifacts"])
        artifacts.update({key: path for key, path in paths.items() if path})
        manifest.event("finalized", aggregator=self.health, artifacts=artifacts, **fields)


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
