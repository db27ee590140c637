"""The telemetry client: bounded buffer -> batches -> one stream -> acknowledgements.

One :class:`TelemetryClient` serves one sender (a rank's SDK, or a node's sampler). The
training thread only calls :meth:`TelemetryClient.submit`, which appends to a bounded deque
(no lock, no I/O, no allocation beyond the deque slot). A daemon thread wakes every
``TRACEML_FLUSH_INTERVAL_SEC`` (or the longer interval node 0's Acks ask for:
:attr:`TelemetryClient.flush_interval_s`), on its node's ticks of the monotonic clock
(:func:`flush_wait_s`: a node's senders flush together, the nodes apart), or when
``TRACEML_BATCH_MAX_RECORDS`` records wait, and, for a rank, at its first record (see
:attr:`ClientConfig.first_record_at_once`); it turns buffered items into one
:class:`~traceml.wire.Batch` with the next sequence number, and sends it on the sender's one
bidirectional ``Stream`` (:class:`traceml.sdk.stream.BatchStream`, the transport: opened
lazily, reopened after a failure). One batch is in flight at a time: the
aggregator acknowledges the highest sequence number it has durably stored, and until the batch
is covered by an acknowledgement it is resent (after a failed stream, on a new one, with
exponential backoff from 0.2 s to 5 s); new records wait in the buffer meanwhile. The
aggregator ignores a sequence number it already stored, so a resend is never stored twice.

Every channel comes from :func:`traceml.core.transport.open_channel`: it carries the run
token (``TRACEML_RUN_TOKEN``) with every call, over TLS when ``TRACEML_TLS_CA`` is set. An
aggregator that answers ``UNAUTHENTICATED`` (another token) is treated like one that rejected
the run: one warning, nothing more sent; so is one of another wire version (``FAILED_PRECONDITION``,
one line naming both versions). A batch refused alone (the aggregator cannot store it: its Ack
names the batch's own sequence number) is dropped and its records counted, and the next one
is sent; a value the store cannot hold (above 2**63 - 1) is dropped by the aggregator and
counted there, never the batch. One whose writer is behind pushes back (an Ack carrying
``retry_after_ms``, or ``RESOURCE_EXHAUSTED`` when it serves its bound of calls): the client
keeps the batch and sends it again after the retry-after the aggregator names (its own backoff
without one), with no warning.

A batch stays below :data:`MAX_BATCH_BYTES` (half the wire's message bound), whatever
``TRACEML_BATCH_MAX_RECORDS`` says: the client closes a batch before the record that would
pass it, and a single record above it (a sample with a huge string) is dropped with a warning
and counted.

What the client had to give up is counted, never silently lost: records refused because the
buffer was full (``TRACEML_BUFFER_MAX_RECORDS``, the only bound: while the aggregator is out of
reach, records accumulate there), steps holding a value the wire cannot carry, records
too large for any batch, and records still buffered when a bounded :meth:`TelemetryClient.close`
had to send its finish marker (unsent at exit). The running totals travel in every batch
(:class:`~traceml.wire.SenderCounts`), so the aggregator knows them even when no finish marker
arrives; the total dropped is also in the rank's :class:`~traceml.wire.RankFinish`.
:class:`ClientStats` also counts failed calls and resends.

Fork safety (DataLoader workers fork the rank). grpcio is not fork-safe while a call is in
flight; measured with grpcio 1.85, streaming during fork() killed children and broke the parent's
stream. gRPC's own fork handlers, on by default in grpcio builds, hung fork() itself (about one
run in ten of ``tests/scripts/fork_outage.py``'s 200 forks during an outage): importing this
module turns them off (``GRPC_ENABLE_FORK_SUPPORT=false`` unless the user set it, before the
SDK imports grpc; see :data:`traceml.core.transport.GRPC_FORK_SUPPORT_ENV`), and so does
``traceml run`` for its ranks (for a script that imports grpc before traceml: gRPC reads the
variable once, at its import). And an ``os.register_at_fork`` hook
ends every client's stream before fork() (a clean close, waiting a bounded 0.2 s, cancelled
after that: an unreachable aggregator must not make fork() wait for a deadline; see
:mod:`traceml.sdk.stream`), cancels its one-off call in flight (made again after the fork),
and holds the client's gRPC lock until fork() returns: every channel, stream and one-off call
is made and closed under that lock, so none is created during a fork, also while the client
has no stream (its first connection, or reconnecting during an outage); the next batch
reopens the stream. The hook waits at most :data:`FORK_WAIT_MAX_S` in all. A forked child
marks every client dead and never touches gRPC: its copy of the sender thread does not
exist, and :meth:`submit` becomes a no-op there.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from traceml import settings
from traceml.core.backoff import Backoff
from traceml.core.phases import STEP_FIELDS
from traceml.core.threads import name_os_thread
from traceml.core.transport import (
    MAX_MESSAGE_BYTES,
    RELAY_GONE_CODE,
    RELAY_STATUS_PREFIX,
    RETRY_AFTER_METADATA_KEY,
    disable_grpc_fork_handlers,
)
from traceml.sdk import failopen

# Before any import of grpc by the SDK: gRPC's own fork() handlers can hang a fork() (see
# GRPC_FORK_SUPPORT_ENV); the fork hooks below make forks safe without them.
disable_grpc_fork_handlers(os.environ)

# grpc and the wire modules are imported by the sender thread as it starts, not by init(): they
# cost ~0.2 s of CPU (most of it protobuf's), which then overlaps the script's set-up (model,
# data, process group) instead of blocking it, or landing in the first training steps.


class PendingStep(Protocol):
    """A buffered step whose fields may only be known later (CUDA events pending)."""

    def ready(self) -> bool:
        """True once :meth:`fields` holds every measurement."""

    def fields(self) -> dict[str, int]:
        """The step's fields (see :func:`traceml.wire.records.add_steps`)."""


#: Bound of one batch's serialized size, bytes: half the wire's message bound leaves room for
#: the identity, the finish marker and the estimate's slack.
MAX_BATCH_BYTES = MAX_MESSAGE_BYTES // 2
#: Most bytes one step may take in a batch: a varint (at most 10 bytes) per field, plus its
#: share of the group's column headers. An upper bound: steps are never measured one by one.
_STEP_FIELD_BYTES, _STEP_OVERHEAD_BYTES = 11, 128

#: Most memory one buffered record takes, bytes: the buffer's bound in memory is
#: ``TRACEML_BUFFER_MAX_RECORDS`` times this (128 MiB at the default 65,536 records). A CPU step
#: (its :class:`~traceml.sdk.step.StepMeasurement`, its integers and the deque slot) takes about
#: 580 bytes, measured with tracemalloc (``tests/test_client.py`` checks it against this bound),
#: and about 900 bytes of resident memory in a 30 s partition (``tests/test_telemetry_loss.py``);
#: a GPU-timed step holds its CUDA events too, which come from a fixed pool, and a sample is a
#: small protobuf message.
BUFFERED_RECORD_MAX_BYTES = 2048

#: What a bounded close keeps for the finish marker alone, s: past ``timeout_s`` minus this (or
#: half of ``timeout_s``, whichever is later), records still buffered are counted as unsent and
#: the next batch carries the finish marker.
FINISH_RESERVE_S = 0.5

#: Longest wait, s, for the aggregator to end the stream after the last acknowledgement.
_CLOSE_WAIT_S = 1.0
#: First pause before the sender reconnects after a failed send, s (then doubling).
FIRST_BACKOFF_S = 0.2
#: How far apart the flush ticks of successive nodes are, in flush intervals (see
#: :func:`flush_wait_s`): the golden ratio's fraction, so the ticks of any number of nodes lie
#: evenly spread over the interval, never two nodes on one tick.
NODE_PHASE_STEP = 0.6180339887498949

_STEP_FIELDS = frozenset(STEP_FIELDS)


def flush_wait_s(now_s: float, interval_s: float, node_rank: int) -> float:
    """Seconds from ``now_s`` (``time.monotonic()``) to node ``node_rank``'s next flush tick:
    the instants ``phase + k * interval_s`` of the system's monotonic clock, ``phase`` being
    ``node_rank * NODE_PHASE_STEP`` intervals (its fraction); in ``(0, interval_s]``.

    Every sender of a node (its ranks and its sampler) reads the same clock (``CLOCK_MONOTONIC``
    is one per host), so they flush within a few ms of each other and the node relay carries
    their batches in one message (:mod:`traceml.launcher.relay`), while the nodes' ticks are
    spread over the interval, so node 0 is not sent every node's message at once.
    """
    phase_s = (node_rank * NODE_PHASE_STEP) % 1.0 * interval_s
    return interval_s - (now_s - phase_s) % interval_s


#: Kinds of record a client can carry (the Batch fields they go to).
STEPS = "step_groups"
PROCESS_SAMPLES = "process_samples"
SYSTEM_SAMPLES = "system_samples"


@dataclass(frozen=True)
class ClientConfig:
    """Tuning of one client; every field defaults from :mod:`traceml.settings`."""

    flush_interval_s: float = field(
        default_factory=lambda: settings.read(settings.FLUSH_INTERVAL_SEC)
    )
    batch_max_records: int = field(
        default_factory=lambda: settings.read(settings.BATCH_MAX_RECORDS)
    )
    buffer_max_records: int = field(
        default_factory=lambda: settings.read(settings.BUFFER_MAX_RECORDS)
    )
    rpc_timeout_s: float = field(default_factory=lambda: settings.read(settings.RPC_TIMEOUT_SEC))
    #: Longest time without a batch while the client has a ``progress`` slot, seconds: a
    #: progress-only batch goes out then (the aggregator's evidence that the rank lives).
    heartbeat_s: float = field(default_factory=lambda: settings.read(settings.HEARTBEAT_SEC))
    #: Longest pause between reconnect attempts, seconds (the backoff doubles from
    #: :data:`FIRST_BACKOFF_S`, jittered: :class:`~traceml.core.backoff.Backoff`).
    max_backoff_s: float = 5.0
    #: Send the first record at once rather than a flush interval later (a rank's SDK sets it):
    #: opening the stream, and the aggregator's intake of the sender's first batch (its
    #: identity), are one-off costs that then come with the first step, in the warm-up, instead
    #: of landing an interval into training, and the aggregator knows the rank from its first
    #: step on.
    first_record_at_once: bool = False


@dataclass
class ClientStats:
    """Counters of one client (records unless named otherwise)."""

    submitted: int = 0
    dropped_buffer_full: int = 0
    #: Records larger than :data:`MAX_BATCH_BYTES` on their own (never sendable).
    dropped_oversized: int = 0
    #: Sends the aggregator pushed back (its writer behind): sent again later.
    pushed_back: int = 0
    #: Records in batches the aggregator acknowledged.
    acked: int = 0
    #: Sends that returned an acknowledgement (batches).
    batches_sent: int = 0
    #: Batches covered by an acknowledgement.
    batches_acked: int = 0
    #: Sends that failed (unreachable, no acknowledgement in time, stream ended by the
    #: aggregator or by a fork).
    send_failures: int = 0
    #: Sends of a batch already sent once (after a failure or a stale ack).
    resends: int = 0
    #: Pending records converted at close before they were ready (steps whose CUDA events
    #: never completed: sent without GPU fields).
    unresolved: int = 0
    #: Steps with a value the wire cannot carry (negative, or beyond 64 bits): a bug of the
    #: measurement, never a reason to lose the rest of their batch; and the records of
    #: batches the aggregator refused alone (:attr:`batches_refused`).
    dropped_invalid: int = 0
    #: Batches the aggregator refused alone (one it cannot store, ``malformed``): dropped,
    #: and the next one sent.
    batches_refused: int = 0
    #: Records still buffered when a bounded close gave the rest of its time to the finish
    #: marker (:data:`FINISH_RESERVE_S`).
    dropped_unsent: int = 0
    #: Steps handed to :meth:`TelemetryClient.submit` (buffered or refused).
    steps_produced: int = 0
    #: Of :attr:`dropped`, steps.
    steps_dropped: int = 0

    @property
    def dropped(self) -> int:
        """All records this client gave up on (never sent, or refused before the buffer)."""
        return (
            self.dropped_buffer_full
            + self.dropped_invalid
            + self.dropped_oversized
            + self.dropped_unsent
        )

    @property
    def produced(self) -> int:
        """All records handed to the client: :attr:`submitted` plus those the full buffer
        refused."""
        return self.submitted + self.dropped_buffer_full


# --- fork hooks: shared by every client of the process ------------------------------------
_clients: weakref.WeakSet[TelemetryClient] = weakref.WeakSet()
_in_forked_child = False
#: Aggregators some client of this process reported unreachable and has not reached since: a
#: rank and the node sampler it hosts share one endpoint, and the user gets one warning for it.
_unreachable_targets: set[str] = set()


def in_forked_child() -> bool:
    """True in a process forked from one that had clients (a DataLoader worker)."""
    return _in_forked_child


#: The streams and one-off locks the fork hook holds through fork() (released in the parent).
_held_for_fork: list = []


#: Longest a fork() waits for the telemetry clients of its process, s, all of them together:
#: for a client's gRPC lock (held only while a channel, stream or one-off call is made or
#: closed), then for its stream to end (cleanly within ``FORK_CLOSE_WAIT_S`` = 0.2 s of
#: :mod:`traceml.sdk.stream`, else cancelled) and its one-off call to be cancelled. A client
#: not quiet by then is left as it is: the fork goes ahead.
FORK_WAIT_MAX_S = 1.2


def _before_fork() -> None:
    deadline = time.monotonic() + FORK_WAIT_MAX_S
    for client in list(_clients):
        try:
            client._quiesce_for_fork(deadline)
        except Exception as exc:  # fail-open: the fork goes ahead, the other clients quiesce
            client._warn(f"telemetry fork hook error ({type(exc).__name__}: {exc})")


def _after_fork_in_parent() -> None:
    while _held_for_fork:
        _held_for_fork.pop()()


def _after_fork_in_child() -> None:
    global _in_forked_child
    _in_forked_child = True
    _held_for_fork.clear()  # locks of the parent's threads: never used here
    for client in list(_clients):
        client._dead = True
    _clients.clear()


os.register_at_fork(
    before=_before_fork,
    after_in_parent=_after_fork_in_parent,
    after_in_child=_after_fork_in_child,
)


class TelemetryClient:
    """Ships one sender's records to the aggregator; never raises into the caller.

    Args:
        target: ``host:port`` of the aggregator.
        run_name: run the records belong to; the aggregator rejects other runs.
        rank: global rank of the sending SDK, or None for a node sampler.
        node_rank: the sender's node rank: a node sampler's sender id, and for every sender
            the phase of its flushes (:func:`flush_wait_s`).
        restart_count: torchrun attempt (``TORCHELASTIC_RESTART_COUNT``); keeps attempts apart.
        identity: callable returning the :class:`~traceml.wire.RankIdentity` to send with the
            first batch (called on the sender thread when that batch is built), or None.
        progress: callable returning ``(steps_completed, phase)`` (see ``Progress`` in
            ``proto/traceml/wire/v1/step.proto``), read on the sender thread for every batch;
            with it, a batch goes out at least every ``config.heartbeat_s`` even when nothing
            else is buffered. None for a node sampler.
        progress_detail: callable taking the batch's ``wire.Progress`` once ``progress`` is
            in it, to add what the rank is doing while its step stays open
            (:class:`traceml.sdk.stall.StallDetail`; on the sender thread), or None.
        config: tuning; defaults from the ``TRACEML_*`` environment.
        warn: where one-line warnings go (stderr by default).
        credentials: the run token and TLS CA; from the environment by default (read when
            the first channel opens, on the sender thread).
        relay: the node relay's local address (``unix-abstract:NAME``, ``TRACEML_RELAY``)
            the stream goes to instead of ``target``, without TLS (the run token still rides
            every call); "" for none. One-off calls (``Summarize``) still go to ``target``.
    """

    def __init__(
        self,
        target: str,
        run_name: str,
        *,
        rank: int | None = None,
        node_rank: int = 0,
        restart_count: int = 0,
        identity=None,
        progress: Callable[[], tuple[int, str]] | None = None,
        progress_detail: Callable[[Any], None] | None = None,
        config: ClientConfig | None = None,
        warn: Callable[[str], None] | None = None,
        credentials=None,
        relay: str = "",
    ) -> None:
        self.target = target
        self.relay = relay
        self.run_name = run_name
        self.rank = rank
        self.node_rank = node_rank
        self.restart_count = restart_count
        self.identity = identity
        self.progress = progress
        self.progress_detail = progress_detail
        self._last_batch_at = time.monotonic()  # when the last batch was built (heartbeats)
        self.config = config or ClientConfig()
        self.credentials = credentials
        self.stats = ClientStats()
        self._warn = warn or failopen.warn
        self._buffer: collections.deque = collections.deque()
        self._pending = None  # the Batch sent (or about to be) and not yet acknowledged
        self._sent_seq = 0  # highest sequence number ever put on the wire
        self._next_seq = 1
        self._acked_seq = 0
        self._ever_acked = False
        self._pushed_back_ever = False  # the aggregator answered, if only to push back
        self._rejected = False
        self._dead = False  # set in a forked child, or once the client is closed
        self._closing = False  # set by close(): the sender thread finishes the stream
        #: The count of submitted records each :meth:`flush` caller under way waits to see
        #: acknowledged: until they are, this sender's batches are ``urgent``.
        self._awaiting: list[int] = []
        #: Why node 0 last pushed a batch back because its store cannot commit (a full disk),
        #: "" otherwise: a closing client then stops waiting for acknowledgements.
        self._store_failing = ""
        self._unreachable_sends = 0  # sends that found no aggregator (the first one warns)
        self._retry_after_s = 0.0  # the aggregator's retry-after, once it pushed back
        #: Node 0's pace, s: the flush interval its latest Ack asked for (0.0: none; see
        #: :attr:`flush_interval_s`).
        self._pace_s = 0.0
        self._finish = None  # RankFinish to send last, set by close()
        self._unsent_cutoff = float("inf")  # monotonic s: a closing client sends the finish next
        #: Held while a gRPC object of this client (channel, stream, one-off call) is made or
        #: closed, never across a wait on the network; the fork hook holds it through fork().
        self._grpc_lock = threading.Lock()
        self._one_off = None  # the one-off call in flight (a grpc future) and its channel
        self._wake = threading.Event()
        self._done = threading.Event()  # set by the sender thread when closing is over
        self._delivered = False  # everything, finish marker included, was acknowledged
        self._stream = None  # the BatchStream on self._channel, once connected
        self._channel = None
        _clients.add(self)
        self._thread = threading.Thread(
            target=self._run, name=f"traceml-client-{target}", daemon=True
        )
        self._thread.start()

    # --- training thread --------------------------------------------------------------------
    def submit(self, kind: str, item) -> None:
        """Buffer one record: O(1), no I/O, never raises, never blocks.

        Args:
            kind: :data:`STEPS`, :data:`PROCESS_SAMPLES` or :data:`SYSTEM_SAMPLES`.
            item: for :data:`STEPS` a dict of the step's fields or a :class:`PendingStep`;
                otherwise a protobuf message of that kind.
        """
        if self._dead:
            return
        stats = self.stats
        if kind == STEPS:
            stats.steps_produced += 1
        if len(self._buffer) >= self.config.buffer_max_records:
            stats.dropped_buffer_full += 1
            if kind == STEPS:
                stats.steps_dropped += 1
            return
        self._buffer.append((kind, item))
        stats.submitted += 1
        if len(self._buffer) >= self.config.batch_max_records or (
            stats.submitted == 1 and self.config.first_record_at_once
        ):
            self._wake.set()

    # --- shutdown ---------------------------------------------------------------------------
    def close(self, finish=None, timeout_s: float = 10.0) -> bool:
        """Send what is buffered, then ``finish`` (a RankFinish) last; wait up to ``timeout_s``.

        The finish marker gets the end of the time: records still buffered once
        ``timeout_s - FINISH_RESERVE_S`` (at least half of ``timeout_s``) has passed are given up,
        counted in ``stats.dropped_unsent`` and in the finish marker's ``records_dropped``, and
        the next batch carries the marker. Records that were never acknowledged when the time is
        over are named in one warning line (unless the aggregator was never reached: that
        was said already).

        Returns True when every batch was acknowledged. Returns False without waiting longer
        when the aggregator rejected the run, when a send fails and the aggregator was never
        reached (training has paid the warning, not the time), or when node 0 pushed the last
        batch back because its store cannot commit (a full disk: the warning says so); False
        after ``timeout_s`` when the aggregator stopped answering. Afterwards the client is
        closed: :meth:`submit` is a no-op, the sender thread ends, a second ``close()`` returns
        False at once.
        """
        if self._dead:
            return False
        start = time.monotonic()
        self._unsent_cutoff = start + max(timeout_s - FINISH_RESERVE_S, timeout_s / 2)
        self._finish = finish
        self._closing = True  # after _finish: the sender thread reads them in this order
        self._wake.set()
        self._done.wait(timeout_s)
        self._dead = True
        self._wake.set()
        if not self._delivered and not self._rejected and self._ever_acked:
            self._warn_undelivered(time.monotonic() - start)
        return self._delivered

    def _warn_undelivered(self, waited_s: float) -> None:
        """One line: records this closed client never had acknowledged (buffered or in flight)."""
        from traceml.wire.records import record_count

        pending = self._pending
        waiting = len(self._buffer) + (record_count(pending) if pending is not None else 0)
        if waiting:
            why = self._store_failing or f"no acknowledgement within {waited_s:.1f} s"
            self._warn(
                f"telemetry not delivered at exit: {waiting} records ({why}); "
                f"{self.stats.dropped} dropped before"
            )

    def wait_closed(self, timeout_s: float) -> bool:
        """Wait, at most ``timeout_s``, for a :meth:`close` under way on another thread (or one
        interrupted by a signal handler on this one) to finish; True when it did."""
        return self._done.wait(timeout_s)

    # --- caller's thread: flush and one-off calls ---------------------------------------------
    def flush(self, timeout_s: float) -> bool:
        """Wait until every record submitted so far is acknowledged, at most ``timeout_s``.

        For a caller that needs the aggregator to hold this sender's data now
        (``traceml.summary()``). Returns False (never raises) on timeout, when the aggregator
        was never reached or rejected the run, and in a forked child.
        """
        deadline = time.monotonic() + timeout_s
        target = self.stats.submitted
        self._awaiting.append(target)
        unreachable_before = self._unreachable_sends
        try:
            while self.stats.acked < target:
                # Never reached: a send made since this call found no aggregator, and none
                # ever succeeded. One before it (an aggregator that came up after this rank's
                # first send) does not count: the woken sender tries again now.
                never_reached = (
                    not self._ever_acked and self._unreachable_sends > unreachable_before
                )
                if self._dead or self._rejected or never_reached or time.monotonic() >= deadline:
                    return False
                self._wake.set()
                time.sleep(0.02)
            return not self._rejected
        finally:
            self._awaiting.remove(target)

    def call(self, method: str, request, timeout_s: float):
        """One unary RPC of the aggregator (e.g. ``"Summarize"``) with this client's
        credentials, on a channel of its own, within ``timeout_s``. A fork() (a DataLoader
        worker) never waits for it: the fork hook cancels it, and it is made again once the
        fork is over, within the same ``timeout_s``.

        Raises:
            grpc.RpcError: the call failed or timed out.
            RuntimeError: called in a forked child, which must never touch gRPC.
        """
        import grpc

        from traceml import wire
        from traceml.core.transport import open_channel
        from traceml.sdk.stream import StreamError

        if _in_forked_child:  # before the lock: a child inherits it held by the fork hook
            raise RuntimeError("no telemetry RPC from a forked child")
        deadline = time.monotonic() + timeout_s
        while True:
            with self._grpc_lock:
                channel = open_channel(self.target, credentials=self._credentials())
                stub = getattr(wire.AggregatorStub(channel), method)
                future = stub.future(request, timeout=max(0.001, deadline - time.monotonic()))
                self._one_off = (future, channel)
            try:
                return future.result()
            except grpc.FutureCancelledError:  # by the fork hook: again, after the fork
                if time.monotonic() >= deadline:
                    raise StreamError(
                        grpc.StatusCode.DEADLINE_EXCEEDED, f"no answer within {timeout_s:g} s"
                    ) from None
            finally:
                with self._grpc_lock:
                    self._one_off = None
                    _close_quietly(channel)

    def _quiesce_for_fork(self, deadline: float) -> None:
        """The fork hook's part for this client: take its gRPC lock, cancel its one-off call,
        end its stream, and hold both locks through fork(); every wait ends at ``deadline``
        (monotonic, s), after which the client is left as it is."""
        if not self._grpc_lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return
        _held_for_fork.append(self._grpc_lock.release)
        if self._one_off is not None:
            from traceml.sdk.stream import wait_calls_done

            future, channel = self._one_off
            future.cancel()
            wait_calls_done(channel, deadline)
        stream = self._stream  # set and cleared under the lock: no stream opens meanwhile
        if stream is not None and stream.quiesce_for_fork(deadline):
            _held_for_fork.append(stream.resume_after_fork)

    @property
    def flush_interval_s(self) -> float:
        """The interval this sender flushes at, s: its own (``TRACEML_FLUSH_INTERVAL_SEC``), or
        node 0's pace when that is longer (the latest Ack's ``flush_interval_ms``: node 0
        bounds the messages it is sent, ``traceml_aggregator/pace.py``)."""
        return max(self.config.flush_interval_s, self._pace_s)

    # --- sender thread ----------------------------------------------------------------------
    def _run(self) -> None:
        name_os_thread()
        backoff, wait = Backoff(FIRST_BACKOFF_S, self.config.max_backoff_s), 0.0
        try:
            try:
                _load_wire()
            except ImportError:
                pass  # the first send fails on it and says so
            while not self._dead:
                interval_s = self.flush_interval_s
                self._wake.wait(wait or flush_wait_s(time.monotonic(), interval_s, self.node_rank))
                self._wake.clear()
                if self._dead:
                    return
                try:
                    ok = self._flush()
                except Exception as exc:  # fail-open: a bug here must not kill training
                    self._warn(f"telemetry sender error ({type(exc).__name__}: {exc}); retrying")
                    ok = False
                if ok:
                    backoff.reset()
                wait = 0.0 if ok else backoff.next()
                if self._retry_after_s and not ok:
                    wait, self._retry_after_s = self._retry_after_s, 0.0
                if self._closing and self._close_over(ok):
                    with self._grpc_lock:
                        if self._stream is not None:  # a clean end: the aggregator sees a close
                            self._stream.close(_CLOSE_WAIT_S)
                    self._done.set()
                    return
        finally:
            self._close_channel()

    def _close_over(self, ok: bool) -> bool:
        """Whether a closing client is done: all delivered, rejected, or never reached (an
        aggregator that pushed back was reached: the client keeps sending until close times out)."""
        if self._rejected:
            return True
        if ok and self._pending is None and not self._buffer and self._finish is None:
            self._delivered = self.stats.batches_refused == 0  # a refused one was not
            return True
        if not ok and self._store_failing:  # node 0's store cannot take them: waiting is vain
            return True
        return not ok and not (self._ever_acked or self._pushed_back_ever)

    def _flush(self) -> bool:
        """Send the pending batch, then the records buffered when this flush began (all of them
        when closing) in as many batches as they take; False once a send fails. Records
        buffered meanwhile wait for the next flush, so a sender's flushes stay on its node's
        ticks (:func:`flush_wait_s`) however long node 0 takes to answer.

        A batch this sender waits on is ``urgent``, and node 0 then stores it without holding it
        for other senders' batches to share its transaction: each batch of a flush but its
        last (more of it follows at once), every batch while closing, and every batch while a
        :meth:`flush` caller waits for records not yet acknowledged. Set at each send, so a
        batch sent again after a caller began to wait is urgent then."""
        if self._rejected:
            self._buffer.clear()
            return True
        due = len(self._buffer)
        while True:
            if self._pending is None:
                buffered = len(self._buffer)
                self._pending = self._take_batch()
                if self._pending is None:
                    return True
                due -= buffered - len(self._buffer)
            awaited = max(self._awaiting, default=0)  # (a list a caller's thread changes)
            self._pending.urgent = due > 0 or self._closing or self.stats.acked < awaited
            if not self._send(self._pending):
                return False
            if due <= 0 and not self._closing:
                return True

    def _take_batch(self):
        from traceml import wire
        from traceml.wire.records import add_steps

        records = size = 0
        batch = wire.Batch(run_name=self.run_name, restart_count=self.restart_count)
        if self.rank is not None:
            batch.rank = self.rank
        else:
            batch.node_rank = self.node_rank
        steps = []
        if self._closing and self._finish is not None and time.monotonic() >= self._unsent_cutoff:
            self._give_up_buffer()  # the finish marker goes in this batch
        while self._buffer and records < self.config.batch_max_records:
            kind, item = self._buffer[0]
            if kind == STEPS:
                if not isinstance(item, dict):
                    if not item.ready():
                        if not self._closing:
                            break  # keep step order; resolved on a later wake
                        self.stats.unresolved += 1
                    item = item.fields()
                    self._buffer[0] = (kind, item)  # resolved once, even if left for later
                item_bytes = _STEP_OVERHEAD_BYTES + _STEP_FIELD_BYTES * len(item)
            else:
                item_bytes = item.ByteSize() + 8
                if item_bytes > MAX_BATCH_BYTES:
                    self._buffer.popleft()
                    self._drop_oversized(kind, item_bytes)
                    continue
            if records and size + item_bytes > MAX_BATCH_BYTES:
                break  # the rest goes in the next batch
            if kind == STEPS:
                steps.append(item)
            else:
                getattr(batch, kind).append(item)
            self._buffer.popleft()
            size += item_bytes
            records += 1
        try:
            add_steps(batch, steps)
        except (ValueError, TypeError):  # a value the wire cannot carry: drop that step alone
            del batch.step_groups[:]
            valid = [step for step in steps if _fits_wire(step)]
            self.stats.dropped_invalid += len(steps) - len(valid)
            self.stats.steps_dropped += len(steps) - len(valid)
            add_steps(batch, valid)
        last = not self._buffer and self._closing and self._finish is not None
        now = time.monotonic()
        progress = self.progress() if self.progress is not None else None
        # A heartbeat (a batch of progress alone) waits for the first completed step: before
        # it the hang watch ignores the rank, and the first batch carries the identity, whose
        # parallelism is known only once a step has seen the model.
        if (
            records == 0
            and not last
            and (
                progress is None
                or progress[0] == 0
                or now - self._last_batch_at < self.config.heartbeat_s
            )
        ):
            return None
        self._last_batch_at = now
        if progress is not None:
            batch.progress.steps_completed, batch.progress.phase = progress
            if self.progress_detail is not None:
                self.progress_detail(batch.progress)
        stats = self.stats
        counts = batch.counts
        counts.records_produced = stats.produced
        counts.records_dropped = stats.dropped
        counts.steps_produced = stats.steps_produced
        counts.steps_dropped = stats.steps_dropped
        batch.seq = self._next_seq
        self._next_seq += 1
        if batch.seq == 1 and self.identity is not None:
            batch.identity.CopyFrom(self.identity())
        if last:
            self._finish.last_seq = batch.seq
            self._finish.records_dropped = self.stats.dropped
            self._finish.steps_gpu_unresolved = self.stats.unresolved
            batch.finish.CopyFrom(self._finish)
            self._finish = None
        return batch

    def _send(self, batch) -> bool:
        """Send ``batch`` on the stream; True once an acknowledgement covers it (or the run was
        rejected), False when it must be sent again."""
        import grpc

        from traceml.sdk.stream import ForkInterrupted
        from traceml.wire.records import record_count

        if self._dead:
            return False
        if batch.seq <= self._sent_seq:
            self.stats.resends += 1
        self._sent_seq = max(self._sent_seq, batch.seq)
        try:
            ack = self._connect().push(batch, self.config.rpc_timeout_s)
        except ForkInterrupted:  # the fork hook ended the stream: resent after the fork
            self.stats.send_failures += 1
            return False
        except grpc.RpcError as exc:
            self.stats.send_failures += 1
            code = exc.code() if hasattr(exc, "code") else None
            if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.FAILED_PRECONDITION):
                return self._give_up(f"{exc.details()} ({code.name})")
            if self.relay and code == grpc.StatusCode[RELAY_GONE_CODE]:  # node 0's is gone
                return self._give_up(exc.details(), said="telemetry stopped")
            if code == grpc.StatusCode.RESOURCE_EXHAUSTED:  # the aggregator's bound of calls
                self.stats.pushed_back += 1
                self._pushed_back_ever = True
                self._retry_after_s = _retry_after_s(exc)
                return False
            self._store_failing = ""  # node 0 no longer answers: what its store said is stale
            self._on_unreachable(exc)
            return False
        self.stats.batches_sent += 1
        if ack.rejected and ack.stored_seq >= batch.seq:
            return self._drop_refused(batch, ack.reason)
        if ack.rejected:
            return self._give_up(ack.reason)
        if ack.retry_after_ms:  # the writer is behind: this batch is not acknowledged
            self.stats.pushed_back += 1
            self._pushed_back_ever = True
            self._retry_after_s = min(ack.retry_after_ms / 1000.0, 30.0)
            self._store_failing = ack.reason  # "": the queue is full; else the store failed
            return False
        self._store_failing = ""
        if not self._ever_acked and self.target in _unreachable_targets:
            _unreachable_targets.discard(self.target)
            self._warn(f"aggregator at {self.target} reached; telemetry flowing")
        self._ever_acked = True
        self._pace_s = ack.flush_interval_ms / 1000.0
        self._acked_seq = max(self._acked_seq, ack.stored_seq)
        if batch.seq > self._acked_seq:  # not stored (yet): the aggregator is not keeping up
            return False
        self._pending = None
        self.stats.batches_acked += 1
        self.stats.acked += record_count(batch)
        return True

    def _give_up(self, reason: str, said: str = "aggregator rejected telemetry") -> bool:
        """The aggregator refused this sender for good, or the node relay says it is gone
        for good (``said``: "telemetry stopped"): say why once, send nothing more."""
        self._rejected = True
        self._warn(f"{said}: {reason}; sending no more")
        self._pending = None
        self._buffer.clear()
        return True

    def _drop_refused(self, batch, reason: str) -> bool:
        """The aggregator refused this batch alone (its Ack names the batch's own sequence
        number): count its records as dropped, warn for the first one, send the next."""
        from traceml.wire.records import record_count

        self._pending = None
        self.stats.dropped_invalid += record_count(batch)
        self.stats.steps_dropped += sum(len(group.step) for group in batch.step_groups)
        self.stats.batches_refused += 1
        if self.stats.batches_refused == 1:
            self._warn(
                f"aggregator refused a batch: {reason}; its records are dropped and counted, "
                "telemetry goes on (further ones are only counted)"
            )
        return True

    def _give_up_buffer(self) -> None:
        """Count every buffered record as unsent and empty the buffer (a bounded close whose
        time for records is over)."""
        buffer = self._buffer
        steps = sum(1 for kind, _ in buffer if kind == STEPS)
        self.stats.dropped_unsent += len(buffer)
        self.stats.steps_dropped += steps
        buffer.clear()

    def _drop_oversized(self, kind: str, size_bytes: int) -> None:
        """Count a record too large for any batch; warn for the first one."""
        self.stats.dropped_oversized += 1
        if self.stats.dropped_oversized == 1:
            self._warn(
                f"dropped a {kind} record of {size_bytes} bytes: one batch may carry at most "
                f"{MAX_BATCH_BYTES} bytes; further ones are only counted (records_dropped)"
            )

    def _credentials(self):
        from traceml.core.transport import Credentials

        if self.credentials is None:
            self.credentials = Credentials.from_env()
        return self.credentials

    def _connect(self):
        """The stream (on a channel of this client's), opened on first use (never during a
        fork: under the gRPC lock)."""
        if self._stream is None:
            from traceml.core.transport import open_channel
            from traceml.sdk.stream import BatchStream

            credentials = self._credentials()
            if self.relay:  # a local socket of this node's launcher: no TLS
                credentials = dataclasses.replace(credentials, tls_ca=None)
            with self._grpc_lock:
                self._channel = open_channel(
                    self.relay or self.target, [("grpc.enable_retries", 0)], credentials
                )
                self._stream = BatchStream(self._channel)
        return self._stream

    def _on_unreachable(self, exc) -> None:
        """A send failed: warn once per process and endpoint, drop the channel to node 0 (a
        channel kept would wait out gRPC's own reconnect backoff once node 0 is back). A
        channel to the node relay is kept: its local socket is up while the launcher lives
        (the relay said why node 0 failed), and a new connection per retry cost the rank
        ~300 KiB of RSS over a 15 s partition (tests/test_telemetry_loss.py). A relay that
        failed the stream without saying why (``UNAVAILABLE`` without
        :data:`~traceml.core.transport.RELAY_STATUS_PREFIX`: its socket closed or refused)
        is gone with its launcher: the sender says so once and streams straight to node 0
        from then on, so that what it still has (a rank stopped by its torchrun as the
        launcher died: its last steps and finish marker) reaches node 0, stored once."""
        if self.relay and _relay_gone(exc):
            self._warn(
                f"the node relay {self.relay} is gone (its launcher exited); telemetry goes "
                f"straight to the aggregator at {self.target}"
            )
            self.relay = ""
            self._close_channel()
            return
        self._unreachable_sends += 1
        if self._unreachable_sends == 1:
            if self.target not in _unreachable_targets:
                _unreachable_targets.add(self.target)
                code = exc.code() if hasattr(exc, "code") else None
                self._warn(
                    f"aggregator at {self.target} unreachable ({getattr(code, 'name', code)}); "
                    "training continues, telemetry is kept and resent"
                )
        if not self.relay:
            self._close_channel()

    def _close_channel(self) -> None:
        """End the stream and close the channel (never during a fork: under the gRPC lock,
        until gRPC's channel thread is done with it, at most :data:`FORK_WAIT_MAX_S`)."""
        with self._grpc_lock:
            if self._stream is not None:
                self._stream.cancel()
            if self._channel is not None:
                _close_quietly(self._channel)
            self._channel = None
            self._stream = None


def _relay_gone(exc) -> bool:
    """Whether ``exc`` (a failed stream to the node relay) is the relay's socket failing, not
    the relay answering (see :meth:`TelemetryClient._on_unreachable`)."""
    import grpc

    code = exc.code() if hasattr(exc, "code") else None
    details = (exc.details() if hasattr(exc, "details") else "") or ""
    return code == grpc.StatusCode.UNAVAILABLE and not details.startswith(RELAY_STATUS_PREFIX)


def _close_quietly(channel) -> None:
    """Close ``channel`` and wait (at most :data:`FORK_WAIT_MAX_S`) until gRPC's channel
    thread is done with its calls: a fork() right after finds no thread inside gRPC."""
    from traceml.sdk.stream import wait_calls_done

    try:
        channel.close()
    except Exception:
        pass
    wait_calls_done(channel, time.monotonic() + FORK_WAIT_MAX_S)


def _fits_wire(step: dict) -> bool:
    """Whether every field of ``step`` is a step field holding an integer a uint64 column
    takes (the aggregator stores up to 2**63 - 1 and drops, counted, a value above: see
    ``traceml_aggregator/senders.py``)."""
    return all(
        name in _STEP_FIELDS and type(v) is int and 0 <= v < 1 << 64 for name, v in step.items()
    )


def _retry_after_s(exc) -> float:
    """The retry-after (s) in a pushed-back call's trailing metadata; 0.0 when it has none."""
    try:
        for key, value in exc.trailing_metadata() or ():
            if key == RETRY_AFTER_METADATA_KEY:
                return max(0.0, min(float(value) / 1000.0, 30.0))
    except (AttributeError, TypeError, ValueError):
        pass
    return 0.0


def _load_wire() -> None:
    """Import what the first send needs (see the note on imports at the top)."""
    import grpc  # noqa: F401

    from traceml import wire  # noqa: F401
    from traceml.sdk import stream  # noqa: F401
