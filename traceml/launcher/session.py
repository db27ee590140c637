"""This node's session with node 0's aggregator: one bidirectional stream for the whole run.

Up, in order: the node's claim (:func:`traceml.launcher.claim.node_claim`; the first message
of every session, a resumed one too), a heartbeat every
:data:`~traceml.core.transport.NODE_HEARTBEAT_INTERVAL_S` or node 0's pace when that is longer
(:meth:`NodeSession.paced`; while node 0 answers those the node
relay carries, :meth:`NodeSession.relay_heartbeat`, only when none went for that long on
either path), the torchrun exit with the ranks'
end states (:meth:`NodeSession.report_exit`), and from node 0 the finalization request
(:meth:`NodeSession.finalize`). Down: the claim's verdict, the run's failure as soon as
another node's claim is refused (:attr:`NodeSession.run_failure`: pushed, never polled), the
exit's acknowledgement, the finalization result, and what the aggregator publishes while the
run goes on: the stall record as it changes (:attr:`NodeSession.hang_record`) and the watchdog's
partial summary (:attr:`NodeSession.partial_summary`), the latest of each again on every
resumed session; and each heartbeat's clock exchange (one as the session opens, then one per
heartbeat), from which the launcher estimates its clock's offset from node 0's, sent to node 0
as soon as it improves (:mod:`traceml.core.clock`).
It is the launcher's one channel from the aggregator: no file of the
aggregator's is polled. The aggregator's side, and how it tells a lost node from one that
ended: ``traceml_aggregator/sessions.py``.

One daemon thread holds the stream. When it breaks (a network cut, node 0's aggregator
restarted on the run's store), the thread opens a new one after a backoff (0.1 s doubling
to :data:`~traceml.core.transport.SESSION_MAX_BACKOFF_S`, with jitter) and sends again what
was not answered (the exit, the finalization request): nothing is lost, and the aggregator
stores an exit report at most once per node (a later one replaces). The channel carries the
run token, TLS and the keepalive policy every channel has
(:func:`~traceml.core.transport.open_channel`).

Fail-open: nothing here raises into the launch; a session that cannot be held costs the
claim check and the pushes, never the training.
"""

from __future__ import annotations

import queue
import threading
import time

from traceml.core import clock, log
from traceml.core.backoff import Backoff
from traceml.core.transport import (
    FINALIZE_SLACK_S,
    NODE_HEARTBEAT_INTERVAL_S,
    SESSION_MAX_BACKOFF_S,
)

_log = log.get("launcher")

#: First wait before a session is opened again, s (doubled per failed attempt).
MIN_BACKOFF_S = 0.1
#: Status codes after which opening the session again cannot help (another run, another
#: token, an aggregator without NodeSession, a claim the aggregator could not parse).
_PERMANENT = ("FAILED_PRECONDITION", "UNAUTHENTICATED", "UNIMPLEMENTED", "INVALID_ARGUMENT")
_CLOSE = object()
#: Queued to send the best clock estimate now (a heartbeat without a new exchange).
_ESTIMATE = object()
#: The node relay's heartbeat is due this much before :data:`NODE_HEARTBEAT_INTERVAL_S`, and
#: while node 0 answers the relay's this stream's own is due this much after it, s, so that the
#: relay (whose messages the node's flush ticks send every interval) carries them all: node 0 then
#: hears each node on its relay's call, not on two streams.
RELAY_HEARTBEAT_LEAD_S = 0.5


class SessionBroken(RuntimeError):
    """The session cannot answer: it gave up (the reason), or the aggregator is gone."""


class _Attempt:
    """One stream: its outgoing queue, and whether it ended."""

    def __init__(self) -> None:
        self.outbox: queue.Queue = queue.Queue()
        self.done = threading.Event()
        self.call = None


class NodeSession:
    """The session of one node's launcher (see the module docstring).

    Args:
        target: node 0's aggregator, ``host:port`` (``LaunchConfig.launcher_target``).
        claim: this launcher's :class:`~traceml.wire.NodeClaim`.
    """

    def __init__(self, target: str, claim) -> None:
        self.target = target
        self._claim = claim
        self._cond = threading.Condition()
        self._attempt = _Attempt()
        self._closing = False
        self._wake = threading.Event()
        #: The aggregator's first verdict on the claim (a NodeClaimReply), None until then.
        self.claim_reply = None
        #: Why the run cannot go on (it cannot rendezvous; another node's launcher was
        #: stopped), once the aggregator said so ("" until then).
        self.run_failure = ""
        #: This launcher's NodeInterrupted message, once sent (:meth:`say_interrupted`).
        self._interrupted = None
        #: The latest stall record the aggregator pushed, as JSON ("": the stall is over;
        #: None: none heard).
        self.hang_record: str | None = None
        #: The latest partial summary the aggregator's watchdog wrote (a FinalizeReply), None
        #: until one is written.
        self.partial_summary = None
        #: Why the session gave up for good ("" while it holds or retries).
        self.error = ""
        #: Streams that broke (each one reopened after a backoff).
        self.breaks = 0
        #: Sessions opened (the first one, and each resumed one).
        self.opened = 0
        #: This node's clock offset from node 0's, from the heartbeats' exchanges.
        self.clock = clock.OffsetEstimator()
        #: Heartbeats sent on this session's stream, each with a clock exchange (a better
        #: estimate told at once is not counted; those the node relay carries neither).
        self.heartbeats_sent = 0
        #: monotonic s of the latest heartbeat node 0 hears: sent on this stream, or carried by
        #: the relay while node 0 answers those (see :meth:`relay_heartbeat`).
        self._last_beat_m = float("-inf")
        self._relay_answers = False  # node 0 answered a heartbeat the relay carried
        #: Seconds between two heartbeats: :data:`NODE_HEARTBEAT_INTERVAL_S`, or node 0's pace
        #: when that is longer (:meth:`paced`).
        self.heartbeat_interval_s = NODE_HEARTBEAT_INTERVAL_S
        #: Unix s of node 0's latest answer: a message on this session's stream, or its answer
        #: to a heartbeat the relay carried; None before the first.
        self.last_answer_unix_s: float | None = None
        self._clock_warned = False
        self._exit = None
        self._exit_stored = False
        self._finalize_request = None
        self._finalized = None
        self._thread = threading.Thread(target=self._run, name="traceml-node-session", daemon=True)

    def start(self) -> NodeSession:
        """Open the session in its thread; returns self."""
        self._thread.start()
        return self

    # --- what the launcher asks ----------------------------------------------------------------
    def wait_claim(self, timeout_s: float):
        """The aggregator's verdict on the claim (NodeClaimReply), or None when none came
        within ``timeout_s`` s or the session gave up (:attr:`error` says why)."""
        with self._cond:
            self._cond.wait_for(lambda: self.claim_reply is not None or self.error, timeout_s)
            return self.claim_reply

    def say_interrupted(self, signum: int) -> None:
        """Tell the aggregator that this launcher got stop signal ``signum`` while training
        ran (sent again on every resumed session): it tells every other node at once."""
        from traceml import wire

        with self._cond:
            self._interrupted = self._up(interrupted=wire.NodeInterrupted(signal=signum))
            self._send(self._interrupted)

    def wait_run_failure(self, timeout_s: float) -> str:
        """:attr:`run_failure` once the aggregator said it, within ``timeout_s`` s ("" if it
        did not, or the session gave up)."""
        with self._cond:
            self._cond.wait_for(lambda: self.run_failure or self.error, timeout_s)
            return self.run_failure

    def report_exit(self, report, timeout_s: float) -> bool:
        """Send this node's :class:`~traceml.wire.NodeExit`; True once the aggregator stored it
        (within ``timeout_s`` s; it is sent again on every resumed session until then)."""
        with self._cond:
            self._exit, self._exit_stored = report, False
            self._send(self._up(exit=report))
            self._cond.wait_for(lambda: self._exit_stored or self.error, timeout_s)
            return self._exit_stored

    def finalize(self, run_name: str, budget_s: float, cancelled=None, gone=None):
        """Ask for the final summary (node 0); the FinalizeReply, or None once
        ``cancelled()`` returned True (checked every 0.2 s; the caller asks again, with a
        shorter budget: the aggregator drops the first request).

        Raises:
            SessionBroken: ``gone()`` returned True (the aggregator process died), the
                session gave up, or no answer came within ``budget_s`` +
                :data:`FINALIZE_SLACK_S`.
        """
        from traceml import wire

        deadline = time.monotonic() + budget_s + FINALIZE_SLACK_S
        with self._cond:
            self._finalize_request = wire.FinalizeRequest(run_name=run_name, timeout_s=budget_s)
            self._finalized = None
            self._send(self._up(finalize=self._finalize_request))
            while self._finalized is None:
                if self.error:
                    raise SessionBroken(self.error)
                if gone is not None and gone():
                    raise SessionBroken("the aggregator exited while finalizing")
                if cancelled is not None and cancelled():
                    return None
                if time.monotonic() >= deadline:
                    raise SessionBroken(
                        f"no finalization result within {budget_s + FINALIZE_SLACK_S:g} s"
                    )
                self._cond.wait(0.2)
            self._finalize_request = None
            return self._finalized

    def close(self, timeout_s: float = 2.0) -> None:
        """End the session cleanly (goodbye, then half-close: the aggregator knows this node
        is done, not lost); a stream still open after ``timeout_s`` s is cancelled."""
        from traceml import wire

        with self._cond:
            self._closing = True
            self._attempt.outbox.put(self._up(goodbye=wire.NodeGoodbye()))
            self._attempt.outbox.put(_CLOSE)
        self._wake.set()
        if self._thread.ident is None:
            return
        self._thread.join(timeout_s)
        call = self._attempt.call
        if self._thread.is_alive() and call is not None:
            call.cancel()
            self._thread.join(1.0)

    # --- the thread ----------------------------------------------------------------------------
    def _up(self, **kind):
        from traceml import wire

        return wire.NodeUp(**kind)

    def _send(self, message) -> None:
        """Queue ``message`` on the current stream (caller holds the condition)."""
        self._attempt.outbox.put(message)

    # --- the node relay's thread ---------------------------------------------------------------
    def relay_heartbeat(self):
        """A heartbeat for the node relay to carry in its next ``RelayUp`` (a NodeHeartbeat
        with a clock exchange), or None when none is due. While node 0 answers the relay's
        (:meth:`relay_answered`), one is due :data:`RELAY_HEARTBEAT_LEAD_S` before the
        heartbeat interval's end and this stream's own as long after it (:meth:`_beat_due_in`):
        the relay carries every heartbeat and this stream sends none. Until then (the relay
        carries one in each ``RelayUp`` until one is answered), and once the relay's call
        failed (:meth:`relay_lost`), this stream sends its own as well."""
        with self._cond:
            since_s = time.monotonic() - self._last_beat_m
            if self._relay_answers and since_s < self.heartbeat_interval_s - RELAY_HEARTBEAT_LEAD_S:
                return None
            beat = self._beat(exchange=True)
            if self._relay_answers:
                self._last_beat_m = time.monotonic()
            return beat

    def relay_answered(self, echo) -> None:
        """Node 0's answer (a ClockEcho) to a heartbeat the relay carried: its clock exchange
        taken, and the relay's heartbeats now stand for this stream's (the answered one counts
        as the latest heartbeat, so the relay's next, at the node's next flush tick, comes
        before this stream's own)."""
        received_ns = clock.unix_ns()  # t3
        with self._cond:
            self.last_answer_unix_s = received_ns / 1e9
            self._last_beat_m = time.monotonic()
            self._relay_answers = True
            self._take_echo(echo, received_ns)

    def _take_echo(self, echo, received_ns: int) -> None:
        """Take node 0's answer ``echo`` (a ClockEcho, received at ``received_ns``: t3) into
        the clock estimate; a better estimate is told node 0 at once (caller holds the
        condition)."""
        if self.clock.add(
            echo.sent_unix_ns, echo.received_unix_ns, echo.answered_unix_ns, received_ns
        ):
            self._attempt.outbox.put(_ESTIMATE)

    def paced(self, pace_s: float) -> None:
        """Node 0 asks its senders to flush every ``pace_s`` at most (0.0: no pace; the Acks
        the relay passed down, ``traceml_aggregator/pace.py``): the node's heartbeats come as
        seldom, so that the relay's ``RelayUp``, sent on the node's flush ticks, still carries
        each one and this stream stays silent."""
        with self._cond:
            self.heartbeat_interval_s = max(NODE_HEARTBEAT_INTERVAL_S, pace_s)

    def relay_lost(self) -> None:
        """The relay's call to node 0 failed: this stream sends its own heartbeats again until
        node 0 answers one the relay carries."""
        with self._cond:
            self._relay_answers = False

    # --- the session's thread ------------------------------------------------------------------
    def _beat_due_in(self) -> float:
        """Seconds until this stream's next heartbeat (0: due now):
        :attr:`heartbeat_interval_s` after the last one on either path, and
        :data:`RELAY_HEARTBEAT_LEAD_S` more while node 0 answers those the relay carries, so
        that the relay's next ``RelayUp`` (the node's next flush tick) carries it,
        and not this stream a few ms before that."""
        with self._cond:
            lead_s = RELAY_HEARTBEAT_LEAD_S if self._relay_answers else 0.0
            due_m = self._last_beat_m + self.heartbeat_interval_s + lead_s
            return max(0.0, due_m - time.monotonic())

    def _requests(self, attempt: _Attempt):
        """The stream's messages: the claim, then what is queued, a heartbeat when idle and
        none was carried by the relay meanwhile."""
        yield self._up(claim=self._claim)
        yield self._heartbeat(exchange=True)  # the first clock exchange at once
        while not attempt.done.is_set():
            try:
                message = attempt.outbox.get(timeout=max(self._beat_due_in(), 0.05))
            except queue.Empty:
                if self._beat_due_in():
                    continue  # the relay carried one meanwhile
                message = self._heartbeat(exchange=True)
            if message is _CLOSE:
                return
            if message is _ESTIMATE:
                message = self._heartbeat(exchange=False)
            yield message

    def _heartbeat(self, exchange: bool):
        """This stream's heartbeat message (:meth:`_beat`): counted, and the next one due an
        interval later."""
        with self._cond:
            self._last_beat_m = time.monotonic()
            if exchange:
                self.heartbeats_sent += 1
        return self._up(heartbeat=self._beat(exchange))

    def _beat(self, exchange: bool):
        """A NodeHeartbeat with the best clock estimate so far, and, with ``exchange``, its
        send time (t0) for a new exchange; a plain heartbeat if either fails (fail-open: the
        session never breaks on its clock)."""
        from traceml import wire

        beat = wire.NodeHeartbeat()
        try:
            best = self.clock.best()
            if best is not None:
                beat.clock.offset_us, beat.clock.error_us = best.offset_us, best.error_us
            if exchange:
                beat.sent_unix_ns = self.clock.sent()  # t0, last: as close to the send as can be
        except Exception as exc:
            beat.Clear()
            if not self._clock_warned:
                self._clock_warned = True
                _log.warning(f"warning: this node's clock exchange failed ({exc}); going on")
        return beat

    def _run(self) -> None:
        try:
            self._hold()
        except Exception as exc:  # fail-open: the session never takes the launch down
            with self._cond:
                self.error = f"{type(exc).__name__}: {exc}"
                self._cond.notify_all()
            _log.warning(f"warning: this node's session with the aggregator ended ({self.error})")

    def _hold(self) -> None:
        """Open the stream, read what comes down, reopen it after a backoff until closed."""
        import grpc

        from traceml import wire
        from traceml.core.transport import open_channel

        options = [
            ("grpc.initial_reconnect_backoff_ms", int(MIN_BACKOFF_S * 1000)),
            ("grpc.min_reconnect_backoff_ms", int(MIN_BACKOFF_S * 1000)),
            ("grpc.max_reconnect_backoff_ms", int(SESSION_MAX_BACKOFF_S * 1000)),
        ]
        backoff = Backoff(MIN_BACKOFF_S, SESSION_MAX_BACKOFF_S)
        with open_channel(self.target, options) as channel:
            stub = wire.AggregatorStub(channel)
            while True:
                with self._cond:
                    if self._closing:
                        return
                    attempt = self._attempt
                attempt.call = stub.NodeSession(self._requests(attempt))
                try:
                    for down in attempt.call:
                        backoff.reset()
                        if not self._take(down):
                            return  # the claim was refused: there is nothing more to say
                except grpc.RpcError as exc:
                    code = exc.code()
                    if code is not None and code.name in _PERMANENT:
                        with self._cond:
                            self.error = f"{code.name}: {exc.details()}"
                            self._cond.notify_all()
                        _log.warning(
                            f"warning: node 0's aggregator ended this node's session ({self.error})"
                        )
                        return
                finally:
                    with self._cond:
                        attempt.done.set()
                        self._attempt = self._resend(_Attempt())
                        closing = self._closing
                if closing:
                    return
                self.breaks += 1
                self._wake.wait(backoff.next())

    def _resend(self, attempt: _Attempt) -> _Attempt:
        """What the next stream sends again: the launcher's stop signal, and the exit and the
        finalization request when they were not answered (caller holds the condition)."""
        if self._interrupted is not None:
            attempt.outbox.put(self._interrupted)
        if self._exit is not None and not self._exit_stored:
            attempt.outbox.put(self._up(exit=self._exit))
        if self._finalize_request is not None:
            attempt.outbox.put(self._up(finalize=self._finalize_request))
        return attempt

    def _take(self, down) -> bool:
        """Act on one message from the aggregator; False when the session is over."""
        received_ns = clock.unix_ns()  # t3 of a clock exchange
        kind = down.WhichOneof("kind")
        with self._cond:
            self.last_answer_unix_s = received_ns / 1e9
            if kind == "claim":
                if self.claim_reply is None:
                    self.claim_reply = down.claim
                self.opened += 1
                self.run_failure = self.run_failure or down.claim.run_failure
            elif kind == "run_failure":
                self.run_failure = self.run_failure or down.run_failure
            elif kind == "exit_stored":
                self._exit_stored = True
            elif kind == "finalized" and self._finalize_request is not None:
                self._finalized = down.finalized
            elif kind == "stall":
                self.hang_record = down.stall.record_json
            elif kind == "partial_summary":
                self.partial_summary = down.partial_summary
            elif kind == "clock":
                self._take_echo(down.clock, received_ns)
            self._cond.notify_all()
        return kind != "claim" or down.claim.accepted
