"""The event loop's longest hold while something runs on it: what the aggregator's bounds on
its loop (``LOOP_HOLD_BOUND_S`` of ``traceml_aggregator.metrics``, the dashboard's refresh)
are measured with, by the benchmarks and the tests.

A ticker task wakes every 1 ms and records the loop thread's CPU time between two of its
turns: what the loop ran meanwhile at one go. CPU time, not wall time, so a busy shared
machine's descheduling is not counted.
"""

from __future__ import annotations

import asyncio
import time


class LoopHold:
    """``async with LoopHold(settle_s) as hold: ...``; then ``hold.max_s``, the longest hold
    (s of the loop thread's CPU time). The ticker runs ``settle_s`` before the block starts."""

    def __init__(self, settle_s: float = 0.05) -> None:
        self.settle_s = settle_s
        self.holds: list[float] = []
        self._done = asyncio.Event()
        self._task: asyncio.Task | None = None

    async def _tick(self) -> None:
        while not self._done.is_set():
            before = time.thread_time()
            await asyncio.sleep(0.001)
            self.holds.append(time.thread_time() - before)

    async def __aenter__(self) -> LoopHold:
        self._task = asyncio.create_task(self._tick())
        await asyncio.sleep(self.settle_s)
        return self

    async def __aexit__(self, *exc: object) -> None:
        self._done.set()
        assert self._task is not None
        await self._task

    @property
    def max_s(self) -> float:
        """The longest hold seen, s."""
        return max(self.holds)
