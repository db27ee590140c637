"""The single SQLite writer: batches from every stream, one transaction per drain.

RPC handlers on the event loop queue batches with :meth:`Writer.queue_batch` (a stream's or a
Push's one) or :meth:`Writer.queue_batches` (a relay message's, as one item with one future: a
node's relay pays the queue, its future and its wake-up once per message, not once per rank's
batch) and await the futures they return.
The writer task takes everything queued at that moment (up to
:data:`MAX_BATCHES_PER_TRANSACTION` batches; while node 0 paces its senders, an item that found
it idle first waits :data:`PACED_LINGER_S` for others), stores it in one transaction on its own
thread (the only thread that touches the :class:`~traceml_aggregator.store.Store`), and resolves
each handler's future with the batch's :class:`~traceml_aggregator.store.WriteResult` (the stream's
highest stored sequence number, whether the batch was a duplicate or refused; a relay message's
future with the list of its batches' results), from which the handler builds the
acknowledgement. A batch is acknowledged only after its transaction committed, so
an acknowledged batch survives the aggregator process dying in any way; a commit that fails (a
full disk, an I/O error) acknowledges nothing: its batches are pushed back as a full queue's are
(below), and their senders keep them and send them again, until the store commits again
(:attr:`Writer.store_failure` says since when it has not). The store commits with
``synchronous=NORMAL`` (see :mod:`traceml_aggregator.store` for why): an operating-system crash
of node 0 can lose the last commits, a process crash cannot.

The queue is bounded in bytes (:data:`traceml.settings.MAX_QUEUED_BYTES` of serialized batches): a
batch that
would exceed it raises :class:`QueueFull` at once, which the handler answers with a retry-after
(``retry_after_ms`` on a stream, ``RESOURCE_EXHAUSTED`` on a Push); the client keeps the batch
and sends it again later. Memory stays bounded when the store falls behind, instead of the
queue growing:

* a batch counts against the bound from the moment it is queued until its transaction is over
  (stored, found a duplicate, refused, or failed), whatever happens to the call that brought it:
  a handler cancelled meanwhile (the sender's acknowledgement deadline passed while SQLite was
  slow) leaves it queued and counted;
* a resend of a batch that is still queued (same sender, attempt and sequence number) is not
  queued again: it is pushed back at once, and the copy already queued is stored once;
* a batch still queued :data:`PUSHBACK_AFTER_S` after it arrived is pushed back too (it stays
  queued, and its sender's resend finds it stored): while a stall of the store lasts, every
  sender hears a retry-after before its own deadline instead of cancelling its stream.

:attr:`Writer.peak_queued_bytes` is the most the queue held, in bytes. It is logged at a clean
stop, and whenever it rose, at most every :data:`PEAK_LOG_INTERVAL_S` (a new high is rare once
a run is under way: a few lines a run, more while the store stalls), so that an aggregator
killed in any way has left it (``benchmarks/soak.py`` reads it).

Test-only hook: when the environment variable :data:`COMMIT_STALL_FILE_ENV` names a file, the
writer thread waits before each transaction of batches for as long as that file exists (a
commit stall of a slow shared filesystem: a slow filesystem itself, a FUSE passthrough that
sleeps or ``dm-delay``, needs a FUSE library or root and a device mapper that CI lacks).
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import os
import sqlite3
import time
from collections.abc import Callable
from typing import Any

from traceml import settings
from traceml.core import log
from traceml_aggregator.store import Store, WriteResult, drop_unstorable

#: Upper bound of batches folded into one transaction (keeps a transaction under ~100 ms).
MAX_BATCHES_PER_TRANSACTION = 2048
#: How long a handler waits for its queued batch to be stored before it pushes the sender
#: back (the batch stays queued), s: well under the sender's acknowledgement deadline
#: (``TRACEML_RPC_TIMEOUT_SEC``, 5 s by default), and ~20 transactions of ~100 ms.
PUSHBACK_AFTER_S = 2.0
#: How often the calls whose batches waited :data:`PUSHBACK_AFTER_S` are pushed back, s (one
#: sweep for all of them: a timer per batch doubled the writer's CPU per batch, measured).
PUSHBACK_SWEEP_S = 0.25
#: While node 0 paces its senders (:mod:`traceml_aggregator.pace`: more calls send to it than
#: its budget of messages a second), how long a message that finds the writer idle waits for
#: others to share its transaction, its thread hand-off and its wake-ups, s: ~25 messages at
#: the default budget (125 a second), for at most 0.2 s more until their acknowledgement
#: against a flush every 2-8 s (measured against 0.05 and 0.1 s: docs/scale.md, *The writer's
#: linger at the pace*). A batch its sender waits on (``Batch.urgent``: it drains a backlog, one
#: batch in flight; it is closing; a ``traceml.summary()`` waits for it) never waits, and ends
#: a wait under way, as a :meth:`Writer.drain` does, so a backlog drains at the unpaced rate
#: and no caller pays the wait.
PACED_LINGER_S = 0.2
#: Least seconds between two log lines of a new queue peak.
PEAK_LOG_INTERVAL_S = 5.0
#: Test-only: while the file this variable names exists, every transaction of batches waits.
COMMIT_STALL_FILE_ENV = "TRACEML_TEST_COMMIT_STALL_FILE"

_log = log.get("aggregator")


class QueueFull(RuntimeError):
    """Send the batch again later: the writer's queue holds
    :data:`traceml.settings.MAX_QUEUED_BYTES` already,
    or a copy of the batch is still queued, or it has waited :data:`PUSHBACK_AFTER_S` (queued)."""


class StoreFailed(QueueFull):
    """Send the batch again later: the store failed to commit it (a full disk, an I/O error;
    nothing of it was stored). Its text says why (see :attr:`Writer.store_failure`)."""


def batch_key(batch) -> tuple[str, int, int, int]:
    """``(sender kind, sender id, attempt, sequence number)`` of a Batch: its identity for
    resends (the store's own key for idempotency, plus the sequence number)."""
    sender = batch.WhichOneof("sender") or "rank"
    return (sender, getattr(batch, sender), batch.restart_count, batch.seq)


def _urgent(batches: list) -> bool:
    """Whether a sender of ``batches`` waits on them (``Batch.urgent``): such an item never
    waits for others to share its transaction."""
    return any(batch.urgent for batch in batches)


class Writer:
    """Owns the store and its thread; all store access goes through it.

    Args:
        store: the run's store (used only on the writer thread from now on).
        on_stored: called on the event loop with each batch after it committed, and its
            step groups as the store decoded them (:attr:`WriteResult.groups
            <traceml_aggregator.store.WriteResult.groups>`: the live fold takes them; the run
            state tracks finish markers this way); what it raises is counted in
            :attr:`on_stored_errors`, never stops the writer.
        max_queued_bytes: bound of the queue, bytes of serialized batches.
        pushback_after_s: see :data:`PUSHBACK_AFTER_S`.
    """

    def __init__(
        self,
        store: Store,
        on_stored: Callable[[Any, list[tuple]], None],
        max_queued_bytes: int = settings.MAX_QUEUED_BYTES.value,
        pushback_after_s: float = PUSHBACK_AFTER_S,
    ) -> None:
        self.store = store
        self.max_queued_bytes = max_queued_bytes
        self.pushback_after_s = pushback_after_s
        #: Bytes of the batches queued and not through their transaction yet, and the most
        #: it ever was.
        self._queued_bytes = 0
        self.peak_queued_bytes = 0
        #: The peak last logged, and when (loop time; see :data:`PEAK_LOG_INTERVAL_S`).
        self._peak_logged = (0, -PEAK_LOG_INTERVAL_S)
        #: :func:`batch_key` of every batch counted in ``_queued_bytes`` -> its bytes.
        self._queued: dict[tuple, int] = {}
        #: (loop time when its call is pushed back, its future, its batches) of each item
        #: queued, in order.
        self._pushback_due: collections.deque = collections.deque()
        self._sweeper: asyncio.Task | None = None
        self._stall_file = os.environ.get(COMMIT_STALL_FILE_ENV) or None
        self._on_stored = on_stored
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="traceml-sqlite")
        self._task: asyncio.Task | None = None
        #: How long an item that finds the writer idle waits for others to share its
        #: transaction, s (0: none; :meth:`pace`).
        self.linger_s = 0.0
        self._lingering: asyncio.Event | None = None  # set: the linger under way ends
        #: Items queued (a batch, or a relay message's batches), and items through their
        #: transaction, since the start: :meth:`drain` waits for the second to reach the first.
        self._queued_total = 0
        self._written_total = 0
        self._written: asyncio.Condition | None = None
        #: Batches stored, and resent batches found already stored (not stored).
        self.batches_stored = 0
        self.batches_duplicate = 0
        #: Batches pushed back because the queue was full, or the store failed (their senders
        #: send them again).
        self.batches_pushed_back = 0
        #: Stored batches whose ``on_stored`` call raised (see :meth:`_stored_hook`).
        self.on_stored_errors = 0
        #: ``(since, error)``: the store has failed every commit since ``since`` (Unix s), the
        #: first failure's ``error`` (one line); None while it commits.
        self.store_failure: tuple[float, str] | None = None
        #: The store's highest ``steps`` rowid whose batches ``on_stored`` has seen (read on
        #: the event loop: every step row at or below it reached the live aggregates, none
        #: above it did; see :mod:`traceml_aggregator.checkpoint`).
        self.steps_rowid_seen = store.steps_rowid

    def start(self) -> None:
        """Start the writer task, and the sweep of waiting calls, on the running event loop."""
        loop = asyncio.get_running_loop()
        self._task = loop.create_task(self._run())
        self._sweeper = loop.create_task(self._push_back_waiting())

    def queue_batch(self, batch) -> asyncio.Future:
        """Queue ``batch``; the future is set to its :class:`WriteResult` once it is durably
        stored, found to be a duplicate, or refused, or to the exception below. Its serialized
        size counts against the queue's bound until its transaction is over, whether or not
        anyone still waits on the future then (a cancelled future leaves the batch queued and
        counted).

        Raises:
            QueueFull: nothing was queued: the queue holds :attr:`max_queued_bytes` already,
                or a copy of the batch is still queued.

        The future's exceptions:
            QueueFull: the batch was not stored within :attr:`pushback_after_s` (it stays
                queued): the sender must send it again later.
            StoreFailed: the store failed to commit it (a full disk, an I/O error: nothing of
                it was stored; see :attr:`store_failure`): the same, and it says why.
        """
        refusal = self._take(batch)
        if refusal is not None:
            raise refusal
        future = asyncio.get_running_loop().create_future()
        self._put([batch], future, single=True)
        return future

    def queue_batches(self, batches: list) -> tuple[asyncio.Future | None, dict[int, QueueFull]]:
        """Queue ``batches`` (a relay message's, in its order) as one item with one future,
        each batch counted against the queue's bound as :meth:`queue_batch` counts it.

        Returns:
            ``(future, refused)``: the future of the queued batches' :class:`WriteResult`
            list (in the order of ``batches``, the refused ones left out), set once all of
            them went through their transaction (None when none was queued); and the index
            in ``batches`` of each batch not queued -> its :class:`QueueFull` (what
            :meth:`queue_batch` raises for it: the queue full, or a copy still queued, this
            message's own included).

        The future's exceptions: those of :meth:`queue_batch`'s, for the whole message (a
        batch of it the store could not take fails the message; one it refused as
        malformed is refused alone, in its result).
        """
        future = asyncio.get_running_loop().create_future()
        queued, refused = [], {}
        for i, batch in enumerate(batches):
            refusal = self._take(batch)
            if refusal is None:
                queued.append(batch)
            else:
                refused[i] = refusal
        if not queued:
            return None, refused
        self._put(queued, future, single=False)
        return future, refused

    def _take(self, batch) -> QueueFull | None:
        """Count ``batch`` against the queue's bound; why it cannot be queued, or None."""
        key = batch_key(batch)
        if key in self._queued:
            self.batches_pushed_back += 1
            return QueueFull("a copy of this batch waits to be stored")
        size_bytes = batch.ByteSize()
        if self._queued_bytes and self._queued_bytes + size_bytes > self.max_queued_bytes:
            self.batches_pushed_back += 1
            return QueueFull(
                f"{self._queued_bytes} bytes of batches wait to be stored "
                f"(bound {self.max_queued_bytes})"
            )
        self._queued[key] = size_bytes
        self._queued_bytes += size_bytes
        return None

    def _put(self, batches: list, future: asyncio.Future, single: bool) -> None:
        """Queue ``batches``, already counted (:meth:`_take`), as one item whose ``future`` is
        set to their results (the one result when ``single``)."""
        due = future.get_loop().time() + self.pushback_after_s
        self._pushback_due.append((due, future, len(batches)))
        self.peak_queued_bytes = max(self.peak_queued_bytes, self._queued_bytes)
        self._queued_total += 1
        self._queue.put_nowait((batches, future, single))
        if self._lingering is not None and _urgent(batches):  # its sender waits on it
            self._lingering.set()

    async def _push_back_waiting(self) -> None:
        """Every :data:`PUSHBACK_SWEEP_S`, answer the calls whose batches have waited
        :attr:`pushback_after_s` with :class:`QueueFull`; their batches stay queued. Logs a
        new queue peak (see :data:`PEAK_LOG_INTERVAL_S`)."""
        due = self._pushback_due
        loop = asyncio.get_running_loop()
        while True:
            await asyncio.sleep(PUSHBACK_SWEEP_S)
            now = loop.time()
            peak, logged_at = self.peak_queued_bytes, self._peak_logged[1]
            if peak > self._peak_logged[0] and now >= logged_at + PEAK_LOG_INTERVAL_S:
                self._peak_logged = (peak, now)
                _log.info(f"writer queue peak {peak} bytes (bound {self.max_queued_bytes})")
            while due and due[0][0] <= now:
                _, future, batches = due.popleft()
                if not future.done():
                    self.batches_pushed_back += batches
                    future.set_exception(
                        QueueFull(f"not stored within {self.pushback_after_s:g} s (still queued)")
                    )

    def _dequeued(self, items: list) -> None:
        """``items`` went through their transaction: they no longer count against the bound."""
        for batches, _, _ in items:
            for batch in batches:
                self._queued_bytes -= self._queued.pop(batch_key(batch))

    def pace(self, pace_s: float) -> None:
        """Node 0 now asks its senders for a flush every ``pace_s`` (0: none, they keep their
        own; :class:`~traceml_aggregator.pace.FlushPace`): while it does, a message that finds
        the writer idle waits up to :data:`PACED_LINGER_S` for others to share its transaction
        (see :data:`PACED_LINGER_S` for what ends the wait sooner)."""
        self.linger_s = PACED_LINGER_S if pace_s else 0.0

    async def call(self, fn: Callable, *args):
        """Run ``fn(*args)`` on the writer thread (reads and other writes of the store)."""
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def drain(self, timeout_s: float) -> bool:
        """Wait until every batch queued before this call went through its transaction (later
        ones do not hold it up, so a flood of batches cannot); False when ``timeout_s`` ran
        out first."""
        target = self._queued_total
        if self._written_total >= target:
            return True
        self._end_linger()  # someone waits for what is queued
        if self._written is None:
            self._written = asyncio.Condition()
        try:
            async with self._written:
                await asyncio.wait_for(
                    self._written.wait_for(lambda: self._written_total >= target), timeout_s
                )
        except asyncio.TimeoutError:
            return False
        return True

    async def _run(self) -> None:
        while True:
            items = [await self._queue.get()]
            if self.linger_s and self._queue.empty() and not _urgent(items[0][0]):
                await self._linger()
            count = len(items[0][0])
            while count < MAX_BATCHES_PER_TRANSACTION and not self._queue.empty():
                items.append(self._queue.get_nowait())
                count += len(items[-1][0])
            try:
                await self._write(items)
            except Exception as exc:  # a bug: the batches' handlers learn it, the writer goes on
                _log.exception(f"writer error ({type(exc).__name__}: {exc})")
                for _, future, _ in items:
                    if not future.done():
                        future.set_exception(exc)
            finally:
                self._dequeued(items)
                self._written_total += len(items)
                if self._written is not None:
                    async with self._written:
                        self._written.notify_all()

    async def _linger(self) -> None:
        """Wait :attr:`linger_s` for other items to share the transaction, or less: until an
        item whose sender waits on it comes (:func:`_urgent`), or a :meth:`drain` begins."""
        self._lingering = asyncio.Event()
        try:
            await asyncio.wait_for(self._lingering.wait(), self.linger_s)
        except asyncio.TimeoutError:
            pass
        finally:
            self._lingering = None

    def _end_linger(self) -> None:
        if self._lingering is not None:
            self._lingering.set()

    async def _write(self, items: list) -> None:
        """Store the batches of ``items`` ((batches, future, single) triples) in one
        transaction (:meth:`_store`), then, on the event loop at one go, hand each stored
        batch to ``on_stored``, note the highest ``steps`` rowid (:attr:`steps_rowid_seen`)
        and resolve the futures: an item's with its results (the one result when
        ``single``), or with the first exception one of its batches met."""
        batches = [batch for item in items for batch in item[0]]
        outcomes, steps_rowid = await self._store(batches, time.time_ns() // 1000)
        committed = False
        for batch, outcome in zip(batches, outcomes, strict=True):
            if isinstance(outcome, BaseException) or outcome.rejected:
                continue
            committed = True
            if outcome.duplicate:
                self.batches_duplicate += 1
            else:
                self.batches_stored += 1
                self._stored_hook(batch, outcome.groups)
        if committed and self.store_failure is not None:
            self._store_committed()
        first = 0
        for batches_of, future, single in items:
            mine = outcomes[first : first + len(batches_of)]
            first += len(batches_of)
            if future.done():
                continue
            failed = next((o for o in mine if isinstance(o, BaseException)), None)
            if failed is not None:
                future.set_exception(failed)
            else:
                future.set_result(mine[0] if single else mine)
        self.steps_rowid_seen = max(self.steps_rowid_seen, steps_rowid)

    async def _store(
        self, batches: list, received_unix_us: int, values_dropped: dict[int, int] | None = None
    ) -> tuple[list, int]:
        """Store ``batches`` in one transaction on the writer thread: each one's
        :class:`WriteResult` or the exception that kept it out, with the store's highest
        ``steps`` rowid after it.

        When the transaction fails on an integer the store cannot hold (above
        :data:`~traceml_aggregator.store.STORE_INT_MAX`), those values are dropped from the
        batches (:func:`~traceml_aggregator.store.drop_unstorable`; ``values_dropped``: how
        many, by ``id`` of the batch) and the transaction is tried once more: the batches are
        stored without them, and each result says how many its batch lost. When it fails
        otherwise, each batch is tried again in a transaction of its own: a batch the store
        cannot take (a malformed step group, an unknown end state) fails alone and is refused
        as ``malformed`` (that batch alone: see :data:`~traceml_aggregator.senders.BATCH_ONLY`),
        and the batches of other ranks that shared its transaction are stored. Any other
        failure (the disk) is that batch's outcome, which its handler learns.
        """
        loop = asyncio.get_running_loop()
        try:
            results, steps_rowid = await loop.run_in_executor(
                self._pool, self._write_batches, batches, received_unix_us
            )
        except Exception as exc:
            if isinstance(exc, OverflowError) and values_dropped is None:
                values_dropped = {id(b): n for b in batches if (n := drop_unstorable(b))}
                if values_dropped:
                    return await self._store(batches, received_unix_us, values_dropped)
            if len(batches) > 1:
                outcomes: list = []
                steps_rowid = 0
                for batch in batches:
                    one, rowid = await self._store([batch], received_unix_us, values_dropped)
                    outcomes += one
                    steps_rowid = max(steps_rowid, rowid)
                return outcomes, steps_rowid
            if isinstance(exc, (ValueError, OverflowError)):
                return [WriteResult(0, False, f"a malformed batch ({exc})", "malformed")], 0
            if isinstance(exc, (sqlite3.Error, OSError)):  # rolled back: sent again later
                return [self._store_failed(exc)], 0
            return [exc], 0
        if values_dropped:
            for batch, result in zip(batches, results, strict=True):
                if not (result.rejected or result.duplicate):
                    result.values_dropped = values_dropped.get(id(batch), 0)
        return results, steps_rowid

    def _store_failed(self, exc: Exception) -> StoreFailed:
        """A batch's transaction failed on the store itself (``exc``: a full disk, an I/O
        error; SQLite rolled it back): the :class:`StoreFailed` that pushes the batch back to
        its sender; the first failure since the last commit starts :attr:`store_failure` and
        is logged."""
        error = f"{type(exc).__name__}: {exc}"
        if self.store_failure is None:
            self.store_failure = (time.time(), error)
            _log.warning(
                f"warning: the store cannot commit ({error}); batches are pushed back to their "
                "senders, who keep them and send them again"
            )
        self.batches_pushed_back += 1
        return StoreFailed(f"node 0's store cannot commit ({error})")

    def _store_committed(self) -> None:
        """A transaction committed while :attr:`store_failure` was set: the failure is over
        (logged)."""
        since, error = self.store_failure
        self.store_failure = None
        _log.info(f"the store commits again ({time.time() - since:.1f} s after it failed: {error})")

    def _write_batches(self, batches: list, received_unix_us: int) -> tuple[list[WriteResult], int]:
        """:meth:`Store.write_batches` on the writer thread, after the test-only stall (see
        :data:`COMMIT_STALL_FILE_ENV`); with the store's highest ``steps`` rowid after it."""
        while self._stall_file is not None and os.path.exists(self._stall_file):
            time.sleep(0.01)
        return self.store.write_batches(batches, received_unix_us), self.store.steps_rowid

    def _stored_hook(self, batch, groups: list[tuple]) -> None:
        """``on_stored(batch, groups)``, guarded: its failure (a bug of the live state it feeds) is
        counted in :attr:`on_stored_errors` and logged for the first one; the batch stays
        stored and acknowledged, and the writer goes on."""
        try:
            self._on_stored(batch, groups)
        except Exception as exc:
            self.on_stored_errors += 1
            if self.on_stored_errors == 1:
                _log.exception(
                    f"error after storing a batch ({type(exc).__name__}: {exc}); the batch is "
                    "stored; the live state may lag it (further errors are only counted)"
                )

    async def close(self) -> None:
        """Stop the task, checkpoint and close the store."""
        for task in (self._task, self._sweeper):
            if task is not None:
                task.cancel()
        await self.call(self.store.close)
        self._pool.shutdown(wait=True)
