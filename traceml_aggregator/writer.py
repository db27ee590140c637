"""The single SQLite writer: batches from every stream, one transaction per drain.

RPC handlers on the event loop hand batches to :meth:`Writer.store_batch` and await the result.
The writer task takes everything queued at that moment (up to
:data:`MAX_BATCHES_PER_TRANSACTION`), stores it in one transaction on its own thread (the only
thread that touches the :class:`~traceml_aggregator.store.Store`), and resolves each handler's
future with the batch's :class:`~traceml_aggregator.store.WriteResult` (the stream's highest
stored sequence number, whether the batch was a duplicate or refused), from which the handler
builds the acknowledgement. A batch is acknowledged only after its transaction committed, so
an acknowledged batch survives the aggregator process dying in any way; a commit that fails (a
full disk) acknowledges nothing, and its senders resend. The store commits with
``synchronous=NORMAL`` (see :mod:`traceml_aggregator.store` for why): an operating-system crash
of node 0 can lose the last commits, a process crash cannot.

The queue is bounded in bytes (:data:`MAX_QUEUED_BYTES` of serialized batches): a batch that
would exceed it raises :class:`QueueFull` at once, which the handler answers
``RESOURCE_EXHAUSTED`` with a retry-after; the client keeps the batch and sends it again
later. Memory stays bounded when the store falls behind, instead of the queue growing.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from typing import Any, Callable

from traceml.wire.records import record_count
from traceml_aggregator.store import Store, WriteResult

#: Upper bound of batches folded into one transaction (keeps a transaction under ~100 ms).
MAX_BATCHES_PER_TRANSACTION = 2048
#: Bound of the writer's queue, bytes of serialized batches waiting to be stored (256 MiB).
MAX_QUEUED_BYTES = 256 * 1024 * 1024


class QueueFull(RuntimeError):
    """The writer's queue holds :data:`MAX_QUEUED_BYTES` already: send the batch again later."""


class Writer:
    """Owns the store and its thread; all store access goes through it.

    Args:
        store: the run's store (used only on the writer thread from now on).
        on_stored: called on the event loop with each batch after it committed
            (the run state tracks finish markers this way).
    """

    def __init__(
        self,
        store: Store,
        on_stored: Callable[[Any], None],
        max_queued_bytes: int = MAX_QUEUED_BYTES,
    ) -> None:
        self.store = store
        self.max_queued_bytes = max_queued_bytes
        self._queued_bytes = 0
        self._on_stored = on_stored
        self._queue: asyncio.Queue = asyncio.Queue()
        self._pool = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="traceml-sqlite")
        self._task: asyncio.Task | None = None
        #: Batches queued, and batches through a transaction (stored, duplicate or refused),
        #: since the start: :meth:`drain` waits for the second to reach the first.
        self._queued_total = 0
        self._written_total = 0
        self._written: asyncio.Condition | None = None
        #: Batches and records stored, and resent batches found already stored (not stored).
        self.batches_stored = 0
        self.records_stored = 0
        self.batches_duplicate = 0
        #: Batches refused because the queue was full (their senders send them again).
        self.batches_pushed_back = 0

    def start(self) -> None:
        """Start the writer task on the running event loop."""
        self._task = asyncio.get_running_loop().create_task(self._run())

    async def store_batch(self, batch) -> WriteResult:
        """Queue ``batch`` and wait until it is durably stored, found to be a duplicate, or
        refused. Its serialized size counts against the queue's bound while it waits.

        Raises:
            QueueFull: the queue holds :attr:`max_queued_bytes` already (nothing was queued).
            sqlite3.Error: the store could not take it (disk full, I/O error); nothing of it
                was stored.
        """
        size_bytes = batch.ByteSize()
        if self._queued_bytes and self._queued_bytes + size_bytes > self.max_queued_bytes:
            self.batches_pushed_back += 1
            raise QueueFull(
                f"{self._queued_bytes} bytes of batches wait to be stored "
                f"(bound {self.max_queued_bytes})"
            )
        future = asyncio.get_running_loop().create_future()
        self._queued_bytes += size_bytes
        self._queued_total += 1
        self._queue.put_nowait((batch, future))
        try:
            return await future
        finally:
            self._queued_bytes -= size_bytes

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
            while len(items) < MAX_BATCHES_PER_TRANSACTION and not self._queue.empty():
                items.append(self._queue.get_nowait())
            try:
                await self._write(items)
            finally:
                self._written_total += len(items)
                if self._written is not None:
                    async with self._written:
                        self._written.notify_all()

    async def _write(self, items: list) -> None:
        """Store ``items`` ((batch, future) pairs) in one transaction and resolve the futures.

        When the transaction fails, each batch is tried again in a transaction of its own: a
        batch the store cannot take (a value beyond SQLite's 64-bit integers, a malformed step
        group) fails alone and is refused as ``malformed`` (its sender must not send it again),
        and the batches of other ranks that shared its transaction are stored. Any other
        failure (the disk) reaches the batch's handler as the exception.
        """
        loop = asyncio.get_running_loop()
        batches = [batch for batch, _ in items]
        try:
            results = await loop.run_in_executor(
                self._pool, self.store.write_batches, batches, time.time_ns() // 1000
            )
        except Exception as exc:
            if len(items) > 1:
                for item in items:
                    await self._write([item])
                return
            _, future = items[0]
            if future.done():
                return
            if isinstance(exc, (ValueError, OverflowError)):
                future.set_result(WriteResult(0, False, f"a malformed batch ({exc})", "malformed"))
            else:  # its handler learns why
                future.set_exception(exc)
            return
        for (batch, future), result in zip(items, results):
            if result.rejected:
                pass
            elif result.duplicate:
                self.batches_duplicate += 1
            else:
                self.batches_stored += 1
                self.records_stored += record_count(batch)
                self._on_stored(batch)
            if not future.done():
                future.set_result(result)

    async def close(self) -> None:
        """Stop the task, checkpoint and close the store."""
        if self._task is not None:
            self._task.cancel()
        await self.call(self.store.close)
        self._pool.shutdown(wait=True)
