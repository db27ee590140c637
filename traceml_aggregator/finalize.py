"""End of a run: who is done, who is dead, who is missing, and when to write the summary.

:class:`RunState` follows every rank from what has been stored: finish markers from the ranks,
and node exits from the launchers (a node's torchrun exited, so every local rank that did not
finish is dead, never waited for). :class:`Finalizer` answers the launcher's ``Finalize`` RPC:
wait until every expected rank is done or the budget runs out, then (briefly) for the node
launchers' exit reports that carry the ranks' exit codes, drain the writer, checkpoint, write
``final_summary.*``. Its watchdog writes a partial summary on its own when the first rank
of the latest attempt has ended and the others are still not done after the budget (a hung
rank keeps its torchrun, and so the launcher, from ever asking). A rank is done once it
finished its latest attempt: after a torchrun restart (``--max-restarts``), the earlier
attempt's finish markers do not end the new attempt's ranks.
"""

from __future__ import annotations

import asyncio
import math
import sqlite3
import time
from dataclasses import dataclass, field
from pathlib import Path

#: Once every rank is done, how long finalization still waits for node launchers that have
#: not reported their torchrun's exit, s (within the budget). A torchrun exits 0.1-2 s after
#: its last rank; its report carries the exit codes and signals the summary shows, and a node
#: whose report arrives after the aggregator stopped warns that it could not report.
NODE_REPORT_GRACE_S = 10.0


@dataclass
class RunState:
    """What the aggregator knows of the run's ranks (updated on the event loop).

    Args:
        world_size: ranks expected (``--world-size``); None to take it from the ranks'
            identities.
        nnodes: node launchers expected to report their torchrun's exit (``--nnodes``);
            None when no launcher reports (ranks under plain torchrun).
    """

    world_size: int | None = None
    nnodes: int | None = None
    #: rank -> the latest torchrun attempt (``restart_count``) it finished.
    finished: dict[int, int] = field(default_factory=dict)
    #: rank -> its latest attempt heard of (a finish of an earlier one does not end it).
    attempts: dict[int, int] = field(default_factory=dict)
    #: The run's latest attempt: the first end and the watchdog's budget are this attempt's.
    attempt: int = 0
    exited_nodes: dict[int, set[int]] = field(default_factory=dict)
    first_end_monotonic: float | None = None
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    #: Set with :attr:`first_end_monotonic` (the watchdog sleeps on it, not on a timer);
    #: cleared when a later attempt starts (torchrun restarted the workers).
    first_end: asyncio.Event = field(default_factory=asyncio.Event)

    def restore(self, store) -> None:
        """Take what an earlier aggregator of this run stored (a restart on the same store):
        the ranks that finished and their attempts, the nodes whose exit was reported, and
        the world size."""
        if self.world_size is None:
            known = store.meta().get("world_size")
            self.world_size = int(known) if known else None
        for table, seen in (("ranks", self.attempts), ("rank_finish", self.finished)):
            for rank, restart in store.query(
                f"SELECT rank, MAX(restart) FROM {table} GROUP BY rank", by_name=False
            ):
                seen[rank] = max(restart, seen.get(rank, 0))
                self.attempts[rank] = max(restart, self.attempts.get(rank, 0))
        self.attempt = max(self.attempts.values(), default=0)
        for (node_rank,) in store.query("SELECT node_rank FROM node_exits", by_name=False):
            self.exited_nodes.setdefault(node_rank, set())
        for node_rank, rank in store.query("SELECT node_rank, rank FROM rank_ends", by_name=False):
            self.exited_nodes.setdefault(node_rank, set()).add(rank)
        if self.exited_nodes or self.attempt in self.finished.values():
            self._mark_end()

    def on_batch(self, batch) -> None:
        """Account a stored batch (identity, attempt and finish marker)."""
        if batch.HasField("identity") and self.world_size is None:
            self.world_size = batch.identity.world_size
        if batch.WhichOneof("sender") != "rank":
            return
        restart = batch.restart_count
        self.attempts[batch.rank] = max(restart, self.attempts.get(batch.rank, 0))
        if restart > self.attempt:  # torchrun restarted the workers: their ends start afresh
            self.attempt = restart
            self.first_end_monotonic = None
            self.first_end.clear()
            self.changed.set()
        if batch.HasField("finish"):
            self.finished[batch.rank] = max(restart, self.finished.get(batch.rank, 0))
            if restart == self.attempt:
                self._mark_end()

    def on_node_exit(self, report) -> None:
        """Account a node's torchrun exit: its ranks are done, finished or not."""
        self.exited_nodes[report.node_rank] = {r.rank for r in report.ranks}
        self._mark_end()

    def give_up_on(self, nodes: set[int]) -> None:
        """Count ``nodes`` done, as if they had exited, none of their ranks heard of: no
        launcher of theirs ever claimed a place in a run that can no longer rendezvous, so
        none will report (their ranks are then ``never_reported``, not awaited). A node that
        reports after all replaces this. Their ranks are ``world_size / nnodes`` a node, as
        ``traceml run`` starts them."""
        if not self.world_size or not self.nnodes:
            return
        per_node = self.world_size // self.nnodes
        for node in nodes - self.exited_nodes.keys():
            self.exited_nodes[node] = set(range(node * per_node, (node + 1) * per_node))
        self._mark_end()

    def _mark_end(self) -> None:
        if self.first_end_monotonic is None:
            self.first_end_monotonic = time.monotonic()
            self.first_end.set()
        self.changed.set()

    def is_done(self, rank: int, attempt: int | None = None) -> bool:
        """The rank finished ``attempt`` (default: the run's latest, or the rank's own when
        later) or a later one, or its node's torchrun exited."""
        if attempt is None:
            attempt = max(self.attempts.get(rank, 0), self.attempt)
        return self.finished.get(rank, -1) >= attempt or any(
            rank in r for r in self.exited_nodes.values()
        )

    def expected(self) -> set[int]:
        """Ranks 0..world_size-1 (empty while the world size is unknown)."""
        return set(range(self.world_size or 0))

    def unreported_nodes(self) -> list[int]:
        """Expected nodes whose launcher has not reported its torchrun's exit, sorted."""
        return sorted(set(range(self.nnodes or 0)) - self.exited_nodes.keys())

    def missing(self) -> list[int]:
        """Expected ranks that neither finished their latest attempt nor belong to an exited
        node, sorted."""
        return sorted(r for r in self.expected() if not self.is_done(r))

    async def wait_done(self, deadline: float, attempt: int | None = None) -> list[int]:
        """Wait until no rank is missing or ``deadline`` (monotonic s), or, with ``attempt``,
        until a later attempt starts; the missing ranks."""
        await self._wait_for(
            lambda: (
                bool(self.world_size)
                and not self.missing()
                or attempt is not None
                and self.attempt != attempt
            ),
            deadline,
        )
        return self.missing()

    async def wait_attempt_after(self, attempt: int) -> None:
        """Wait until an attempt later than ``attempt`` starts (torchrun restarts the workers;
        may never happen)."""
        await self._wait_for(lambda: self.attempt != attempt, math.inf)

    async def wait_reported(self, deadline: float) -> list[int]:
        """Wait until every expected node reported or ``deadline``; the unreported nodes."""
        await self._wait_for(lambda: not self.unreported_nodes(), deadline)
        return self.unreported_nodes()

    async def _wait_for(self, condition, deadline: float) -> None:
        while not condition() and time.monotonic() < deadline:
            # Re-check at least every 0.2 s: several waiters share the event, and a set()
            # between one waiter's check and its clear() must not be slept through.
            self.changed.clear()
            try:
                await asyncio.wait_for(
                    self.changed.wait(), min(0.2, max(0.0, deadline - time.monotonic()))
                )
            except asyncio.TimeoutError:
                pass


@dataclass
class Outcome:
    """What one finalization produced: the ranks it gave up on, the report files written
    (None: not written), the summary's text and ``run.status`` ("" when no summary was
    built), and why the files could not be written ("" when they were)."""

    missing: list[int]
    json_path: Path | None = None
    text_path: Path | None = None
    html_path: Path | None = None
    text: str = ""
    error: str = ""
    run_status: str = ""


class Finalizer:
    """Writes the reports once the run is over (see the module docstring).

    Args:
        state: the run state.
        writer: the store's writer.
        write_reports: ``fn(store, missing, steps, deadline) -> Outcome`` run on the writer
            thread, ``deadline`` being the finalization's (``time.monotonic()``).
        budget_s: default finalization budget (the launcher's ``--finalize-timeout-sec``).
        steps: ``async fn() -> steps`` awaited on the event loop once the writer drained,
            whose result is ``write_reports``'s ``steps`` (the live aggregates' snapshot,
            :meth:`traceml_aggregator.live.LiveAggregates.final_steps`, once a replacement's
            catch-up is over).
    """

    def __init__(self, state: RunState, writer, write_reports, budget_s: float, steps) -> None:
        #: ``fn(Outcome)``, called on the event loop with each partial summary the watchdog
        #: wrote (the server pushes it down the node sessions); None: nobody hears.
        self.on_partial = None
        #: ``async fn()``, awaited once the ranks are waited for and before the run's reports
        #: are written (the server marks lost the nodes that vanished meanwhile); None: none.
        self.before_reports = None
        self.state = state
        self._steps = steps
        self.writer = writer
        self._write_reports = write_reports
        self.budget_s = budget_s
        self._lock = asyncio.Lock()
        self.last: Outcome | None = None
        self._partial_attempt: int | None = None  # the attempt of the watchdog's last partial

    async def finalize(self, budget_s: float | None = None) -> Outcome:
        """Wait for every rank (bounded), drain, checkpoint and write the reports.

        ``budget_s`` (the caller's) is capped by the aggregator's own budget: a Finalize
        with an endless one (inf, 1e300) must not leave a call waiting for ever; one that
        is not > 0 (0, NaN) means the aggregator's own.
        """
        self._partial_attempt = None  # the reports from now on are this finalization's
        budget = min(budget_s, self.budget_s) if budget_s and budget_s > 0 else self.budget_s
        deadline = time.monotonic() + budget
        missing = await self.state.wait_done(deadline)
        if not missing:
            grace_end = min(deadline, time.monotonic() + NODE_REPORT_GRACE_S)
            await self.state.wait_reported(grace_end)
        if self.before_reports is not None:
            await self.before_reports()
        return await self._write(missing, deadline)

    async def _write(self, missing: list[int], deadline: float) -> Outcome:
        """Drain the writer, fold the WAL in, write the reports; an outcome that says when the
        store stopped committing, if it has (:attr:`~traceml_aggregator.writer.Writer.
        store_failure`: the summary then covers only what was stored before)."""
        async with self._lock:
            await self.writer.drain(max(0.5, deadline - time.monotonic()))
            try:
                try:
                    await self.writer.call(self.writer.store.checkpoint)
                except (sqlite3.Error, OSError):
                    pass  # a full disk: the WAL stays (SQLite reads it), the summary is written
                steps = await self._steps()
                outcome = await self.writer.call(
                    self._write_reports, self.writer.store, missing, steps, deadline
                )
            except Exception as exc:
                outcome = Outcome(missing, error=f"{type(exc).__name__}: {exc}")
            if self.writer.store_failure is not None:
                since, error = self.writer.store_failure
                at = time.strftime("%H:%M:%S UTC", time.gmtime(since))
                failure = (
                    f"the store has failed to commit since {at} ({error}): the summary covers "
                    "only what was stored before"
                )
                outcome.error = "; ".join(e for e in (failure, outcome.error) if e)
            self.last = outcome
            return outcome

    async def finalize_on_stop(self) -> Outcome | None:
        """At shutdown: write the reports now, with what is stored, unless a finalization
        already did (the standalone aggregator under plain torchrun is stopped this way)."""
        if self.last is not None:
            return None
        return await self._write(self.state.missing(), time.monotonic() + 5.0)

    async def watchdog(self) -> None:
        """Write a partial summary if ranks are still missing a budget after the first end of
        the run's latest attempt (a torchrun restart re-arms it: the new attempt's ranks are
        missing until they end, and its budget runs from its own first end)."""
        while True:
            await self.state.first_end.wait()
            attempt = self.state.attempt
            deadline = self.state.first_end_monotonic + self.budget_s
            missing = await self.state.wait_done(deadline, attempt)
            if self.state.attempt != attempt:
                continue
            # Not once a finalization wrote the reports, unless that was this watch's partial
            # summary of an earlier attempt.
            if missing and (self.last is None or self._partial_attempt is not None):
                self._partial_attempt = attempt
                outcome = await self._write(missing, deadline)
                if not outcome.error and self.on_partial is not None:
                    self.on_partial(outcome)
            # This attempt is over or given up on: the end of the run, or torchrun restarts
            # the workers (the later attempt's partial summary replaces this one's).
            await self.state.wait_attempt_after(attempt)
