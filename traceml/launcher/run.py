"""``traceml run``: one node's whole launch, from validated flags to torchrun's exit code.

Node 0::

    check claim, port -> run dir -> run token file -> start aggregator -> torchrun -> wait SERVING -> node sampler
    -> wait (watching the aggregator and the node claims) -> report node exit
    -> Finalize (bounded) -> print summary -> stop aggregator -> exit code

Node r > 0::

    check claim -> run dir -> wait for node 0's aggregator and the run token (bounded)
    -> register the claim
    -> node sampler -> torchrun -> wait -> report node exit -> exit code

A node-rank claim that cannot be right (see :mod:`traceml.launcher.claim`) stops the launch
before torchrun on the node that makes it, and node 0 stops its torchrun once its aggregator
says the run cannot rendezvous.

Node 0 starts torchrun without waiting for its aggregator to serve: the aggregator is ready in
well under a second, while each rank imports torch and joins the process group for longer than
that before its first send (and the SDK keeps and resends what it could not send). The checks
that can refuse a launch (flags, claim, port) all run before either process starts.

The exit code is torchrun's, always. Once training has started, a telemetry failure (node 0's
aggregator not serving, or dying) is a warning on stderr and a field in the manifest, never a
different exit code.

gRPC (about 0.2 s of imports) is imported where it is first used, after torchrun has started.
"""

from __future__ import annotations

import errno
import json
import signal
import socket
import sys
import time

from traceml import __version__, settings
from traceml.launcher import aggregator, claim, credentials
from traceml.launcher.config import LaunchConfig, LaunchError
from traceml.launcher.live import LiveView
from traceml.core.rundir import Manifest, RunDir
from traceml.launcher.torchrun import TorchrunProcess, exit_code, install_signal_forwarding


#: How often node 0's launcher looks at its aggregator while training runs, s.
WATCH_INTERVAL_S = 1.0


def say(message: str) -> None:
    """One ``traceml:`` line on stderr."""
    print(f"traceml: {message}", file=sys.stderr, flush=True)


def check_port_free(host: str, port: int) -> None:
    """Raise :class:`LaunchError` when ``host:port`` cannot be bound right now."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((host, port))
        except OSError as exc:
            why = "already in use" if exc.errno == errno.EADDRINUSE else exc.strerror
            raise LaunchError(
                f"aggregator port {host}:{port} is not available ({why}); "
                "pick another with --aggregator-port"
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


class Launch:
    """One node's launch (see the module docstring)."""

    def __init__(self, config: LaunchConfig) -> None:
        self.config = config
        self.run_dir = RunDir(config.run_dir, config.node_rank)
        self.aggregator_process = None
        self.health = {"status": "not_started", "reason": None, "pid": None, "exit_code": None}
        self.sampler = None
        #: Why the run cannot rendezvous, once node 0's aggregator says so ("" until then).
        self.run_failure = ""

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
                "artifacts": {
                    "training_stdout": str(run_dir.training_stdout),
                    "training_stderr": str(run_dir.training_stderr),
                },
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
                say(f"error: cannot write the run token to {run_dir.token_file}: {exc}")
                run_manifest.event("ended", status="failed", exit_code=1)
                return 1
            self._start_aggregator()
        elif (failure := self._wait_for_owner()):
            node_manifest.event("ended", status=failure)
            return 1
        elif not self._register():
            node_manifest.event("ended", status="claim_refused")
            return 2

        torchrun = TorchrunProcess(config, run_dir)
        torchrun.start()
        install_signal_forwarding(torchrun)
        node_manifest.event("training_started", status="training", torchrun_pid=torchrun.process.pid)
        if run_manifest:
            run_manifest.event("training_started", status="training")
            self._wait_aggregator_serving(run_manifest)
        if self.health["status"] != "failed":  # node 0's sampler needs its own aggregator
            self._start_sampler()
        returncode = self._wait_training(torchrun, run_manifest)
        code = exit_code(returncode)
        try:
            self._after_training(torchrun, returncode, node_manifest, run_manifest)
        except Exception as exc:  # fail-open: telemetry never changes the training's outcome
            say(
                f"warning: TraceML failed after training ({type(exc).__name__}: {exc}); "
                f"exit code {code} is torchrun's"
            )
        return code

    def _wait_training(self, torchrun: TorchrunProcess, run_manifest: Manifest | None) -> int:
        """torchrun's return code, once it exits.

        Meanwhile node 0 looks at its aggregator every :data:`WATCH_INTERVAL_S` and says, once
        each, when it died (training goes on without telemetry) and when its watchdog wrote a
        partial summary because ranks never finished (training goes on: TraceML never stops a
        job; the user decides). The one exception: a node-rank claim the aggregator refused
        means a node will never join the rendezvous, so torchrun is stopped
        (:meth:`_watch_claims`). A failure of this watch only ends the watch.
        """
        if run_manifest is None:
            return torchrun.wait()
        started_unix_s = time.time()
        partial_seen = False
        live = self._live_view()
        while True:
            returncode = torchrun.wait(WATCH_INTERVAL_S)
            if returncode is not None:
                return returncode
            if live is not None:
                live.tick()
            try:
                self._watch_aggregator(run_manifest)
                partial_seen = partial_seen or self._watch_partial(run_manifest, started_unix_s)
                self._watch_claims(torchrun, run_manifest)
            except Exception as exc:
                say(f"warning: stopped watching the aggregator ({type(exc).__name__}: {exc})")
                return torchrun.wait()

    def _live_view(self) -> LiveView | None:
        """The ``--mode cli``/``dashboard`` view of a single-node run (None otherwise)."""
        config = self.config
        if config.mode == "summary":
            return None
        if config.nnodes > 1:
            say(f"--mode {config.mode} is a single-node live view; this run shows the summary only")
            return None
        return LiveView(config.mode, config.launcher_target, str(config.run_name))

    def _watch_aggregator(self, manifest: Manifest) -> None:
        """Record and report (once) that node 0's aggregator process has exited; its exit
        code is a shell's (137: killed by SIGKILL)."""
        returncode = self.aggregator_process.poll()
        if returncode is None or self.health["status"] != "serving":
            return
        code = exit_code(returncode)
        self.health["exit_code"] = code
        self._aggregator_lost(manifest, f"exited with code {code} during the run")

    def _aggregator_lost(self, manifest: Manifest, reason: str) -> None:
        """Node 0's aggregator is not serving (``reason``): record it and warn; training goes on."""
        self.health.update(status="failed", reason=reason)
        manifest.event("aggregator_failed", aggregator=self.health)
        say(
            f"warning: the aggregator {reason}; training continues without telemetry and no "
            f"final summary will be written (see {self.run_dir.aggregator_stderr})"
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
        say(
            f"partial summary written to {path}: ranks {missing} have not finished "
            f"{self.config.finalize_timeout_sec:g} s (--finalize-timeout-sec) after the first "
            "rank ended; training keeps running (TraceML never stops it; Ctrl-C does)"
        )
        return True

    def _watch_claims(self, torchrun: TorchrunProcess, manifest: Manifest) -> None:
        """Node 0 of several: renew its claim; stop torchrun (once) when the run has failed.

        The reply's ``run_failure`` is set once the aggregator refused another launcher's
        claim before every node had joined: that node never starts its torchrun, so this
        one would wait in the rendezvous until torchrun's own timeout.
        """
        if self.config.nnodes < 2 or self.run_failure:
            return
        import grpc

        try:
            reply = claim.register(self.config, timeout_s=WATCH_INTERVAL_S)
        except grpc.RpcError:
            return  # the aggregator's own health is _watch_aggregator's
        self.run_failure = reply.run_failure or reply.reason
        if not self.run_failure:
            return
        manifest.event("rendezvous_failed", rendezvous_failure=self.run_failure)
        say(
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
        status = "completed" if code == 0 else "failed"
        self._stop_sampler()
        report = torchrun.node_exit(returncode)
        node_manifest.event(
            "training_ended",
            status="reporting" if run_manifest is None else "finalizing",
            torchrun_exit_code=code,
            ranks=[_rank_end_json(r) for r in report.ranks],
        )
        # Node 0 whose aggregator is lost has said so once; reporting to it would only fail.
        own_aggregator_lost = run_manifest is not None and self.health["status"] == "failed"
        telemetry_ok = not own_aggregator_lost and self._report_node_exit(report)
        if run_manifest is not None:
            try:
                self._finalize(run_manifest)
            finally:
                self._stop_aggregator()
            run_manifest.event("ended", status=status, exit_code=code, aggregator=self.health)
        node_manifest.event("ended", status=status, exit_code=code, telemetry_reported=telemetry_ok)

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
        manifest.event("aggregator_serving", aggregator=self.health)

    def _register(self) -> bool:
        """Node r > 0: claim this node's rank at node 0's aggregator; False when refused.

        An aggregator that cannot take the claim (another run name, an old version) costs
        only the check: a warning, and the launch goes on.
        """
        import grpc

        try:
            reply = claim.register(self.config)
        except grpc.RpcError as exc:
            say(
                f"warning: node 0's aggregator did not take this node's claim "
                f"({exc.code().name}: {exc.details()})"
            )
            return True
        if not reply.accepted:
            say(f"error: node 0 refused this node: {reply.reason}")
        return reply.accepted

    def _wait_for_owner(self) -> str:
        """Node r > 0: wait for node 0's aggregator, then for the run token, both within
        ``TRACEML_AGGREGATOR_WAIT_SEC``; "" once both are there, else the node's end status."""
        wait_s = self.config.aggregator_wait_sec
        target = self.config.aggregator_target
        deadline = time.monotonic() + wait_s
        say(f"node {self.config.node_rank}: waiting up to {wait_s:g} s for node 0's aggregator at {target}")
        try:
            aggregator.wait_serving(target, wait_s)
        except aggregator.AggregatorUnavailable as exc:
            say(
                f"error: {exc} (is node 0 running `traceml run` with the same --run-name, "
                f"and is port {self.config.aggregator_port} reachable? raise the wait with "
                f"{settings.AGGREGATOR_WAIT_SEC.name})"
            )
            return "aggregator_unreachable"
        missing = credentials.obtain(self.config, self.run_dir, deadline)
        if missing:
            say(f"error: {missing}")
            return "no_run_token"
        return ""

    def _start_sampler(self) -> None:
        """Start this node's system and process sampler (fail-open: a warning at most)."""
        from traceml.sdk.samplers import start_node_sampler

        try:
            self.sampler = start_node_sampler(self.config)
        except Exception as exc:
            say(f"warning: node sampler not started ({exc})")

    def _stop_sampler(self) -> None:
        if self.sampler is not None:
            try:
                self.sampler.close()
            except Exception as exc:
                say(f"warning: node sampler did not stop cleanly ({exc})")

    def _report_node_exit(self, report) -> bool:
        import grpc

        try:
            aggregator.report_node_exit(self.config.launcher_target, report)
            return True
        except grpc.RpcError as exc:
            say(f"warning: could not report this node's exit to the aggregator ({exc.code().name})")
            return False

    def _stop_aggregator(self) -> None:
        """Stop node 0's aggregator; its exit code goes into the health fields."""
        self.health["exit_code"] = exit_code(aggregator.stop(self.aggregator_process))
        if self.health["status"] == "serving":
            self.health["status"] = "stopped"

    def _finalize(self, manifest: Manifest) -> None:
        config = self.config
        self._watch_aggregator(manifest)
        if self.health["status"] != "serving" or self.run_failure:
            return  # said by _aggregator_lost or _watch_claims
        import grpc

        try:
            reply = aggregator.finalize(
                config.launcher_target, str(config.run_name), config.finalize_timeout_sec
            )
        except grpc.RpcError as exc:
            self.health.update(status="failed", reason=f"finalize failed: {exc.code().name}")
            manifest.update(aggregator=self.health)
            say(f"warning: no final summary: the aggregator failed ({exc.code().name})")
            return
        if reply.error:
            self.health.update(status="failed", reason=reply.error)
            say(f"warning: no final summary: {reply.error}")
        else:
            sys.stdout.write(reply.summary_text)
            sys.stdout.flush()
            if reply.missing_ranks:
                say(f"partial summary: ranks {list(reply.missing_ranks)} never finished")
            say(f"summary: {reply.summary_json_path}")
        artifacts = dict(manifest.data["artifacts"])
        for key, path in (
            ("final_summary_json", reply.summary_json_path),
            ("final_summary_txt", reply.summary_text_path),
            ("final_summary_html", reply.summary_html_path),
        ):
            if path:
                artifacts[key] = path
        manifest.event(
            "finalized",
            status="finalize_failed" if reply.error else "finalized",
            aggregator=self.health,
            artifacts=artifacts,
            complete=reply.complete,
            missing_ranks=list(reply.missing_ranks),
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
