"""One node's part of a launch: its torchrun, its relay, its sampler and its session with node 0.

:class:`NodeLaunch` is what every node does, node 0 included: node r > 0 first waits for node
0's aggregator and the run token and claims its rank (:meth:`NodeLaunch.join`); node 0 opens
its session once its own aggregator serves (:meth:`NodeLaunch.open_session`). Then the node
relay, torchrun and the node sampler run, the session brings what the aggregator pushes (the
run's failure, node 0's stalls and partial summaries: :mod:`traceml.launcher.session`), and at
the end the node reports its torchrun's exit up the session and closes it. Fail-open
throughout: the relay, the sampler and the session cost a warning at most, never the training.
"""

from __future__ import annotations

import signal
import time

from traceml import settings
from traceml.core import log
from traceml.core.ends import is_interrupted
from traceml.core.rundir import Manifest, RunDir
from traceml.launcher import aggregator, claim, credentials
from traceml.launcher.config import LaunchConfig
from traceml.launcher.torchrun import TorchrunProcess

_log = log.get("launcher")

#: How long a launcher waits for the aggregator's verdict on its claim, and for its exit
#: report to be stored, s.
SESSION_ANSWER_S = 10.0
#: How long a node whose torchrun failed of itself, in a run of several nodes, waits for node
#: 0 to say the run cannot go on (:meth:`NodeLaunch.hear_run_failure`), s: node 0 pushes it
#: within ms of hearing that another node's launcher got a stop signal, or of the exit report
#: of a node whose torchrun ended before it started its ranks.
RUN_FAILURE_WAIT_S = 2.0


class NodeLaunch:
    """This node's torchrun, sampler and session (see the module docstring).

    Args:
        config: the launch's flags.
        run_dir: the run directory.
    """

    def __init__(self, config: LaunchConfig, run_dir: RunDir) -> None:
        self.config = config
        self.run_dir = run_dir
        self.torchrun = TorchrunProcess(config, run_dir)
        self.sampler = None
        #: This node's relay (:class:`~traceml.launcher.relay.NodeRelay`; None: off or failed).
        self.relay = None
        #: This node's session with node 0's aggregator (None until opened).
        self.session = None
        #: Why the run cannot go on (it cannot rendezvous; another node's launcher was
        #: stopped), once node 0's aggregator says so ("" until then).
        self.run_failure = ""
        #: Whether node 0 was told of this launcher's stop signal (:meth:`say_interrupted`).
        self._said_interrupted = False

    # --- before training (node r > 0) ------------------------------------------------------
    def join(self) -> str:
        """Node r > 0: wait for node 0's aggregator and the run token, then claim this node's
        rank; "" once accepted, else the node's end status (``aggregator_unreachable``,
        ``no_run_token``, ``claim_refused``), said on stderr."""
        return self._wait_for_owner() or ("" if self._register() else "claim_refused")

    def _wait_for_owner(self) -> str:
        """Wait for node 0's aggregator, then for the run token, both within
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

    def _register(self) -> bool:
        """Open this node's session, its claim first; False when refused.

        An aggregator that does not answer the claim within :data:`SESSION_ANSWER_S` (another
        run name, an old version) costs only the check: a warning, and the launch goes on.
        """
        self.open_session()
        reply = self.session.wait_claim(SESSION_ANSWER_S)
        if reply is None:
            _log.warning(
                "warning: node 0's aggregator did not take this node's claim "
                f"({self.session.error or f'no answer within {SESSION_ANSWER_S:g} s'})"
            )
            return True
        if not reply.accepted:
            self.close_session()
            _log.error(f"error: node 0 refused this node: {reply.reason}")
        return reply.accepted

    def open_session(self) -> None:
        """Open this node's session with node 0's aggregator (its claim first)."""
        self.session = claim.open_session(self.config)
        self._relay_heartbeats()

    def _relay_heartbeats(self) -> None:
        """Once this node has both its relay and its session, the relay carries the session's
        heartbeats (:meth:`~traceml.launcher.relay.NodeRelay.carry_heartbeats`)."""
        if self.relay is not None and self.session is not None:
            self.relay.carry_heartbeats(self.session, self.config.node_rank)

    # --- training --------------------------------------------------------------------------
    def start_relay(self) -> None:
        """With ``--node-relay`` (the default), start this node's relay before its torchrun,
        whose ranks then stream through it (:mod:`traceml.launcher.relay`); fail-open: a relay
        that cannot start costs a warning, and the ranks stream straight to node 0."""
        from traceml.core.transport import Credentials
        from traceml.launcher.relay import NodeRelay

        if not self.config.node_relay:
            return
        try:
            relay = NodeRelay(
                self.config.launcher_target,
                Credentials.from_env(),
                settings.read(settings.RPC_TIMEOUT_SEC),
            )
            relay.start()
        except Exception as exc:
            _log.warning(f"warning: node relay not started ({exc}); ranks stream to node 0")
            return
        self.relay, self.torchrun.relay_address = relay, relay.address
        self._relay_heartbeats()

    def start_sampler(self) -> None:
        """Start this node's system and process sampler (fail-open: a warning at most)."""
        from traceml.sdk.samplers import start_node_sampler

        relay = self.relay.address if self.relay is not None else ""
        try:
            self.sampler = start_node_sampler(self.config, self.torchrun.process.pid, relay)
        except Exception as exc:
            _log.warning(f"warning: node sampler not started ({exc})")

    def stop_senders(self) -> None:
        """Stop the sampler, then the relay (a warning if the sampler does not stop cleanly).
        The ranks are gone by then: what they sent is acknowledged, or theirs to resend."""
        if self.sampler is not None:
            try:
                self.sampler.close()
            except Exception as exc:
                _log.warning(f"warning: node sampler did not stop cleanly ({exc})")
        if self.relay is not None:
            self.relay.close()

    def say_interrupted(self, signum: int) -> None:
        """Tell node 0's aggregator, once, that this launcher got stop signal ``signum``
        while training ran, so that it stops every other node at once (:meth:`watch_claims`)
        instead of their ranks dying of their peers' end. Called from the launcher's signal
        handler: it only queues a message (the main thread queues none while training runs);
        a failure is said, never raised."""
        if self._said_interrupted or self.session is None:
            return
        self._said_interrupted = True
        try:
            self.session.say_interrupted(signum)
        except Exception as exc:  # fail-open: the stop goes on without telling the others
            _log.warning(
                f"warning: could not tell node 0 of the stop ({type(exc).__name__}: {exc})"
            )

    def watch_claims(self, manifest: Manifest) -> None:
        """Stop torchrun (once) when the session brought the run's failure.

        The aggregator pushes it down every open session once it refused another launcher's
        claim before every node had joined: that node never starts its torchrun, so this
        one would wait in the rendezvous until torchrun's own timeout. Another node's
        launcher that got a stop signal (scancel, Ctrl-C) is said as the run's interruption,
        not as an error, and torchrun is stopped as by this launcher's own (and not again,
        when it is stopping already).
        """
        if self.session is None or self.run_failure or not self.session.run_failure:
            return
        self.run_failure = self.session.run_failure
        if is_interrupted(self.run_failure):
            manifest.event("run_interrupted", interrupted=self.run_failure)
            if self.torchrun.stop_sent:  # this launcher's own signal came first
                return
            ended = self.torchrun.process is None or self.torchrun.process.poll() is not None
            then = (
                "this node's training ended with it"
                if ended
                else "stopping training on this node too"
            )
            _log.info(f"the run was {self.run_failure}; {then}")
        else:
            manifest.event("rendezvous_failed", rendezvous_failure=self.run_failure)
            _log.error(
                f"error: the run cannot rendezvous: {self.run_failure}; stopping training on "
                "this node"
            )
        self.torchrun.forward_signal(signal.SIGTERM)

    def stopped_cannot_rendezvous(self) -> bool:
        """Whether this launcher stopped its torchrun because the run cannot rendezvous (the
        run's failure, not its interruption: :meth:`watch_claims`)."""
        return (
            bool(self.run_failure)
            and not is_interrupted(self.run_failure)
            and self.torchrun.stop_sent
        )

    def hear_run_failure(self, manifest: Manifest, returncode: int, interrupted: int | None):
        """When this node's torchrun failed of itself (no stop signal of this launcher's) in a
        run of several nodes, wait up to :data:`RUN_FAILURE_WAIT_S` for node 0's word that
        the run cannot go on, and take it (:meth:`watch_claims`): another node's end (its
        launcher stopped, its torchrun failed in the rendezvous) ends this node's ranks or
        rendezvous too (a collective's or the store's connection closes), within ms of node
        0 hearing of it, and is the cause to report, not the error they then died of. Node
        0's torchrun that never started its ranks failed of its own (it hosts the
        rendezvous)."""
        if (
            returncode == 0
            or interrupted
            or self.config.nnodes == 1
            or self.session is None
            or self.run_failure
            or self.config.owns_aggregator
            and not self.torchrun.ranks_started()
        ):
            return
        if self.session.wait_run_failure(RUN_FAILURE_WAIT_S):
            self.watch_claims(manifest)

    # --- after training --------------------------------------------------------------------
    def end_training(self, returncode: int, interrupted: int | None):
        """Stop the sampler and say what training output was not saved; this node's
        :class:`~traceml.wire.NodeExit` (``interrupted``: the launcher's first signal)."""
        self.stop_senders()
        report = self.torchrun.node_exit(returncode, interrupted, self.run_failure)
        for tee in self.torchrun.tees:
            if tee.bytes_not_saved:
                _log.warning(
                    f"warning: {tee.bytes_not_saved} bytes of training output are missing from "
                    f"{tee.log_path} ({tee.log_error or 'the log fell behind'})"
                )
        return report

    def report_exit(self, report) -> bool:
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

    def close_session(self, timeout_s: float = 2.0) -> None:
        """End this node's session cleanly (the aggregator then knows it done, not lost)."""
        if self.session is not None:
            self.session.close(timeout_s)
