"""The sender's transport: one bidirectional ``Stream`` call, batches up, acknowledgements down.

:class:`BatchStream` is what :class:`traceml.sdk.client.TelemetryClient`'s sender thread sends
through; batching, sequence numbers and accounting stay in the client. :meth:`BatchStream.push`
writes one batch on the stream (opened lazily, on the client's channel) and waits for the
aggregator's Ack, which it sends once the batch is durably stored: one batch is in flight at a
time, so a slow aggregator slows the sender thread, never the training thread.

Threads: gRPC's own consumer of the request iterator (it blocks on a queue), and one reader of
the acknowledgements per open stream, which hands them to :meth:`push` through another queue so
that :meth:`push` waits at most its deadline (``TRACEML_RPC_TIMEOUT_SEC``): a paused or
partitioned aggregator costs the sender a deadline, then the stream is cancelled and reopened
on the next push. The reader asks gRPC for an Ack only while one is due (a batch in flight), and
for the rest of the stream once it ends: grpcio's blocking read wakes every 0.1 s to re-check
its state, and a reader that waited there between batches took about 1 ms of CPU per second per
stream (measured idle on the 2-core test machine), a tenth of a training step's worth on a
2-rank job; between batches it sleeps on its own queue, which no timer wakes.

Fork safety (a DataLoader forks the rank every epoch). grpcio is not fork-safe while a call is
open, so :meth:`quiesce_for_fork` (from the ``os.register_at_fork`` hook) ends the stream
before fork(): it half-closes it, waits at most :data:`FORK_CLOSE_WAIT_S` for the aggregator
to end it (it acknowledges what it holds first), cancels it if that did not happen (an
unreachable aggregator: the fork waits for no network deadline), waits for the reader thread,
every wait within the hook's bound (``FORK_WAIT_MAX_S`` of :mod:`traceml.sdk.client`), and
holds the stream's lock through fork() so that no stream opens (nor is cancelled) meanwhile;
:meth:`resume_after_fork` releases it in the parent, where the next push reopens the stream.
A push whose stream was ended by a fork raises :class:`ForkInterrupted`: the batch is sent
again, nothing is reported.
"""

from __future__ import annotations

import queue
import threading
import time

import grpc

from traceml import wire

#: Longest wait, s, for the aggregator to end a half-closed stream before a fork; then it is
#: cancelled. On loopback or a LAN a clean close takes about a millisecond.
FORK_CLOSE_WAIT_S = 0.2
#: Longest wait, s, for the reader thread of a cancelled stream (gRPC ends it locally).
_CANCEL_WAIT_S = 1.0
_END = object()  # ends the request iterator: the stream's half-close
_DRAIN = object()  # tells the reader to read to the stream's end
_CLOSING = wire.Batch(closing=True)  # the sender ends the stream on purpose (see service.proto)


class ForkInterrupted(Exception):
    """The stream was ended for a fork() while a batch waited for its Ack: send it again."""


class StreamError(grpc.RpcError):
    """The stream failed without a gRPC status of its own: no Ack within the deadline
    (``DEADLINE_EXCEEDED``), or the aggregator ended the stream (``UNAVAILABLE``)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(details)
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        """The status the failure counts as."""
        return self._code

    def details(self) -> str:
        """One line on what happened."""
        return self._details

    def trailing_metadata(self) -> tuple:
        """None was received."""
        return ()


class _Open:
    """One open Stream call: its call object, request and Ack queues, and reader thread."""

    def __init__(self, channel) -> None:
        self.requests: queue.SimpleQueue = queue.SimpleQueue()
        self.acks: queue.SimpleQueue = queue.SimpleQueue()
        #: What the reader is to read next: one Ack per pushed batch, or :data:`_DRAIN`.
        self.due: queue.SimpleQueue = queue.SimpleQueue()
        self.for_fork = False  # ended by quiesce_for_fork
        self.call = wire.AggregatorStub(channel).Stream(iter(self.requests.get, _END))
        self.reader = threading.Thread(target=self._read, name="traceml-acks", daemon=True)
        self.reader.start()

    def expect_ack(self) -> None:
        """A batch was queued: the reader reads its Ack."""
        self.due.put(None)

    def drain(self) -> None:
        """The stream is ending (half-closed, cancelled or failed): the reader reads what is
        left, to its end, then exits."""
        self.due.put(_DRAIN)

    def _read(self) -> None:
        try:
            while self.due.get() is not _DRAIN:
                ack = next(self.call, None)
                if ack is None:
                    break
                self.acks.put(ack)
            else:
                for ack in self.call:
                    self.acks.put(ack)
            self.acks.put(
                StreamError(grpc.StatusCode.UNAVAILABLE, "the aggregator ended the stream")
            )
        except grpc.RpcError as exc:  # the call object itself: code(), details(), trailers
            self.acks.put(exc)
        except Exception as exc:  # fail-open: never kill the thread with a traceback
            self.acks.put(StreamError(grpc.StatusCode.UNKNOWN, f"{type(exc).__name__}: {exc}"))

    def end(self, wait_s: float, cancel_by: float | None = None) -> None:
        """Say ``closing`` (a clean end) and half-close, wait up to ``wait_s`` for the
        aggregator to end the call, else cancel; returns once the reader thread is gone (or
        after :data:`_CANCEL_WAIT_S` more, or at ``cancel_by``: a monotonic time, s)."""
        if wait_s > 0:
            self.requests.put(_CLOSING)
        self.requests.put(_END)
        self.drain()
        self.reader.join(wait_s)
        if self.reader.is_alive():
            self.call.cancel()
            cancel_wait_s = _CANCEL_WAIT_S if cancel_by is None else cancel_by - time.monotonic()
            self.reader.join(max(0.0, cancel_wait_s))


class BatchStream:
    """A sender's stream on ``channel`` (a channel of :func:`traceml.core.transport.open_channel`).

    Used by one sender thread (:meth:`push`, :meth:`close`) and the fork hooks
    (:meth:`quiesce_for_fork`, :meth:`resume_after_fork`); never raises but what
    :meth:`push` documents.
    """

    def __init__(self, channel) -> None:
        self._channel = channel
        self._lock = threading.Lock()  # held briefly, never across a wait on the network
        self._open: _Open | None = None

    def push(self, batch, timeout_s: float):
        """Send ``batch`` (a :class:`~traceml.wire.Batch`) and return the aggregator's
        :class:`~traceml.wire.Ack` for it.

        Raises:
            grpc.RpcError: the stream failed (its status: ``UNAVAILABLE``, ``UNAUTHENTICATED``,
                ``RESOURCE_EXHAUSTED`` when the aggregator serves its bound of calls,
                ``FAILED_PRECONDITION`` from an aggregator of another wire version, ...) or no
                Ack came within ``timeout_s`` (``DEADLINE_EXCEEDED``); it is closed, and the
                next push opens another.
            ForkInterrupted: a fork() ended the stream first.
        """
        with self._lock:
            if self._open is None:
                self._open = _Open(self._channel)
            current = self._open
            current.requests.put(batch)
            current.expect_ack()
        try:
            item = current.acks.get(timeout=timeout_s)
        except queue.Empty:
            item = StreamError(
                grpc.StatusCode.DEADLINE_EXCEEDED, f"no acknowledgement within {timeout_s:g} s"
            )
            with self._lock:  # never during a fork (quiesce_for_fork holds the lock through it)
                current.call.cancel()
            self._drop(current)
        if isinstance(item, wire.Ack):
            return item
        self._drop(current)
        if current.for_fork:
            raise ForkInterrupted()
        raise item

    def close(self, wait_s: float) -> None:
        """End the stream cleanly (half-close; the aggregator then ends it), waiting at most
        ``wait_s`` before cancelling it. The channel stays open."""
        with self._lock:
            current, self._open = self._open, None
        if current is not None:
            current.end(wait_s)

    def cancel(self) -> None:
        """End the stream at once (the channel is about to close)."""
        self.close(0.0)

    def quiesce_for_fork(self, deadline: float) -> bool:
        """Before fork(): end the stream (at most :data:`FORK_CLOSE_WAIT_S` waiting for the
        aggregator, then cancelled), wait until the channel has no call left, and hold the
        lock until :meth:`resume_after_fork`; every wait ends at ``deadline`` (monotonic, s).
        False, holding nothing, when the lock was not free by then; an exception raised here
        leaves the lock free too."""
        if not self._lock.acquire(timeout=max(0.0, deadline - time.monotonic())):
            return False
        try:
            current, self._open = self._open, None
            if current is not None:
                current.for_fork = True
                current.end(min(FORK_CLOSE_WAIT_S, max(0.0, deadline - time.monotonic())), deadline)
                wait_calls_done(self._channel, deadline)
        except BaseException:
            self._lock.release()  # never left held: the sender's next push would wait forever
            raise
        return True

    def resume_after_fork(self) -> None:
        """After fork(), in the parent: the next push opens a stream again."""
        self._lock.release()

    def _drop(self, current: _Open) -> None:
        """Forget a failed stream; end its request iterator, so that gRPC's consumer thread,
        blocked on the request queue, ends too."""
        current.requests.put(_END)
        current.drain()
        with self._lock:
            if self._open is current:
                self._open = None


def wait_calls_done(channel, deadline: float) -> None:
    """Wait, until ``deadline`` (monotonic, s) at the latest, until gRPC's channel thread has
    finished the calls of ``channel`` (a synchronous grpcio channel). A call's last operations
    complete on that thread a moment after its status arrived; a fork() meanwhile finds it
    inside gRPC ("Other threads are currently calling into gRPC, skipping fork() handlers" on
    stderr)."""
    while _managed_calls(channel) and time.monotonic() < deadline:
        time.sleep(0.001)


def _managed_calls(channel) -> int:
    """Calls of a synchronous grpcio channel its channel thread still serves (0 when the
    grpcio version keeps no such count where this looks: nothing is waited for then)."""
    inner = getattr(channel, "_channel", channel)  # an intercepted channel wraps the real one
    return getattr(getattr(inner, "_call_state", None), "managed_calls", 0)
