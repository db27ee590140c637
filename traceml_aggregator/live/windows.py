"""Live aggregates: what the live views, ``traceml.summary()`` and the final summary read, kept
as batches commit.

The :class:`~traceml_aggregator.writer.Writer` calls :meth:`LiveAggregates.on_batch` on the
event loop with every batch right after its transaction committed (never a duplicate, never a
refused one): the hook sits after the commit, whatever transport brought the batch. Everything
here is touched from the event loop only and needs no lock. Each call costs O(the batch): per
rank its steps (:class:`~traceml_aggregator.aggregates.StepState`: a rolling window of its most
recent :data:`WINDOW_STEPS` steps as columns, the bounded series and digest of the final
summary), its step count, its latest step and the wall clock of its end (``last_step_unix_s``),
its identity and finish marker, its latest :data:`WINDOW_SAMPLES` process samples; per node its
latest :data:`WINDOW_SAMPLES` system samples and GPU samples; the nodes' torchrun exits. After an
aggregator restart (or for ``--finalize-only``), what the store already holds is folded in, so
the aggregates are those of an aggregator that saw every batch: from the latest checkpoint of
the aggregates on (:mod:`traceml_aggregator.checkpoint`), not from the run's first step.
:meth:`LiveAggregates.seed` does it at once (``--finalize-only``); a restarted aggregator
restores the checkpoint (:meth:`LiveAggregates.restore`), serves, and folds in the steps stored
after it while serving (:meth:`LiveAggregates.catch_up`), holding the batches stored meanwhile
to fold them in after those steps; the views wait for it (:meth:`LiveAggregates.caught_up`).

:meth:`LiveAggregates.summary` answers ``Summarize``: it runs the same
:func:`~traceml.analysis.summary.build_summary` as the final summary over the windows, in a
process of its own (spawned on the first query, at a low CPU priority: see
:mod:`traceml_aggregator.live.analysis_process`), so the analysis never takes the GIL from the
thread that stores batches and the loop that sends acknowledgements. The process keeps a mirror
of the windows; each computation ships it only what changed since the previous one, so a query costs
the loop O(the data that arrived since the last query). The analysis covers each rank's latest
:func:`~traceml_aggregator.live.analysis_process.analysis_steps` steps (512 up to 32 ranks, fewer
beyond); while every rank has stored at most that many, the live verdict and the final summary
are computed from the same steps and agree. :meth:`LiveAggregates.snapshot` builds the
dashboard's snapshot in the same process, from the same mirror.
:meth:`LiveAggregates.final_steps` gives the final summary its steps (O(ranks)).

Cost control: concurrent viewers share one computation, an unchanged run is answered from the
last result, and a new computation starts at most :data:`ANALYSIS_DUTY` of the time (after a
computation of t seconds the next waits ``t * (1 / ANALYSIS_DUTY - 1)``, at most
:data:`ANALYSIS_MAX_GAP_S`), so any number of viewers keep the analysis process at or below
that fraction of a core while a computation takes under 0.55 s.
"""

from __future__ import annotations

import asyncio
import collections
import concurrent.futures
import itertools
import operator
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

from traceml.analysis.rundata import RankData, RunData
from traceml.core import log, records
from traceml.core.phases import STEP_FIELDS
from traceml.core.records import step_group_columns
from traceml_aggregator.aggregates import SERIES_STEPS, StepState, series_steps
from traceml_aggregator.checkpoint import SAMPLE_WINDOWS, Checkpoint, read_ranks
from traceml_aggregator.live import analysis_process
from traceml_aggregator.live.analysis_process import (
    WINDOW_GPU_SAMPLES,
    WINDOW_SAMPLES,
    WINDOW_STEPS,
    LiveDelta,
    RankDelta,
    Tail,
    analysis_steps,
    windows_run_data,
)
from traceml_aggregator.load import load

_log = log.get("aggregator")

#: Largest fraction of wall time the live analysis may run (see the module docstring).
ANALYSIS_DUTY = 0.1
#: Longest pause between two computations, s: a viewer (``traceml.summary()`` waits 30 s at
#: most) gets an answer within this plus one computation even when the analysis is slow.
ANALYSIS_MAX_GAP_S = 5.0
#: Ranks copied into a delta between two returns to the event loop (see ``_delta``).
DELTA_SLICE_RANKS = 32
#: Oldest a ``/metrics`` text may be when it answers a scrape, s: scrapes closer together than
#: this share one computation (Prometheus's usual scrape interval is 15 s), so any number of
#: scrapers cost the event loop one delta every this many seconds at most.
METRICS_MAX_AGE_S = 5.0
#: Stored step rows a replay reads at one call on the writer's thread (~10-40 ms of it, so
#: batches are stored between two chunks while a replacement catches up).
REPLAY_CHUNK_ROWS = 8192
#: Held batches folded between two returns to the event loop at the end of a catch-up.
HELD_SLICE = 256


@dataclass
class StepReplay:
    """The stored steps a seed folds in after its checkpoint: the rows ``after < rowid <=
    upto`` of the ``steps`` table, ``upto`` being the store's highest when the seed began
    (the rows above it are this aggregator's own batches, folded as they commit).

    Attributes:
        after: the highest rowid read so far (the checkpoint's ``steps_from`` at first).
        upto: the highest rowid to read.
        marks: rank -> the rowid up to which its checkpointed state holds its steps.
        steps: rows read so far.
    """

    after: int
    upto: int
    marks: dict[int, int]
    steps: int = 0

    def chunk(self, store) -> tuple[list[str], list[tuple]] | None:
        """The next :data:`REPLAY_CHUNK_ROWS` rows or fewer, ``(names, rows)`` for
        :meth:`LiveAggregates.fold_stored`, rows ``(rowid, *names, rank, restart)`` in rowid
        order (the order they were stored; a range of the table's b-tree, no sort); None once
        every row was read. ``names`` are
        the step fields some row of the chunk carries: most are NULL on every row of a run
        (no GPU, no collectives, ...), and turning rows into Python tuples is most of a
        replay's time (one ``count()`` per column over the same rows, in SQLite, is a small
        part). On the thread that owns ``store``."""
        if self.after >= self.upto:
            return None
        ((last,),) = store.query(
            "SELECT max(rowid) FROM (SELECT rowid FROM steps WHERE rowid > ? AND rowid <= ? "
            "ORDER BY rowid LIMIT ?)",
            (self.after, self.upto, REPLAY_CHUNK_ROWS),
            by_name=False,
        )
        if last is None:
            self.after = self.upto
            return None
        where = f" WHERE rowid > {int(self.after)} AND rowid <= {int(last)}"
        (counts,) = store.query(
            f"SELECT {', '.join(f'count({f})' for f in STEP_FIELDS)} FROM steps{where}",
            by_name=False,
        )
        names = [name for name, count in zip(STEP_FIELDS, counts, strict=True) if count]
        rows = store.query(
            f"SELECT rowid, {', '.join(names)}, rank, restart FROM steps{where} ORDER BY rowid",
            by_name=False,
        )
        self.after = last
        self.steps += len(rows)
        return names, rows


@dataclass
class RankLive:
    """One rank's live aggregates (its latest attempt, ``restart``).

    Attributes:
        steps: the attempt's steps (:class:`~traceml_aggregator.aggregates.StepState`): the
            latest :data:`WINDOW_STEPS` as columns, the final summary's bounded series and
            digest.
        steps_stored: steps of this attempt stored so far (all of them, not only the window).
        last_step: the highest step index stored, None before the first.
        last_step_unix_s: wall clock at the end of that step, s (``start_unix_us + end_us``).
    """

    rank: int
    restart: int = 0
    identity: records.Identity | None = None
    finish: records.Finish | None = None
    series_steps: int = SERIES_STEPS
    steps: StepState = field(init=False)
    steps_stored: int = 0
    last_step: int | None = None
    last_step_unix_s: float | None = None
    process_samples: Tail = field(default_factory=Tail)
    earlier_attempts: dict[int, int] = field(default_factory=dict)
    flops: records.Flops | None = None
    #: The attempt's latest running totals, as the store's sender_counts row
    #: (records.SenderCounts), None before a batch with them.
    counts: records.SenderCounts | None = None
    #: The step groups folded since the last delta to the live analysis process, as the wire
    #: sent them (serialized StepColumns), in arrival order; None when the next delta sends
    #: the window's tail instead (nothing shipped of this attempt yet, or more steps arrived
    #: than the analysis covers). See :meth:`hold`.
    unshipped: list[bytes] | None = None
    #: Steps in :attr:`unshipped`.
    unshipped_steps: int = 0

    def __post_init__(self) -> None:
        self.steps = StepState(WINDOW_STEPS, self.series_steps, offset=self.rank)

    def latest(self, count: int) -> dict[str, list]:
        """The window's last ``count`` steps (:meth:`StepState.latest`)."""
        return self.steps.latest(count)

    def attempt(self, restart: int) -> bool:
        """Whether data of attempt ``restart`` belongs here: a later attempt starts afresh
        (the earlier one's step count moves to ``earlier_attempts``); an earlier one is
        ignored, as the loader ignores it."""
        if restart > self.restart:
            if self.steps_stored:
                self.earlier_attempts[self.restart] = self.steps_stored
            fresh = RankLive(
                self.rank,
                restart,
                earlier_attempts=self.earlier_attempts,
                process_samples=self.process_samples,
                series_steps=self.series_steps,
            )
            self.__dict__.update(fresh.__dict__)
        return restart == self.restart

    def hold(self, group, limit: int) -> None:
        """Keep the step group ``group`` (a wire StepColumns, just folded) for the next delta,
        serialized (20-40 bytes a step; a reference would keep its whole batch alive): the
        delta then hands the groups over instead of reading the window's tail field by field
        (at 1,024 ranks that read was ~10 ms of the event loop a refresh). Past ``limit``
        steps (those the analysis covers) they are dropped and the next delta sends the tail:
        at most ``limit`` steps a rank are held, whether or not anyone asks for a delta."""
        if self.unshipped is None:
            return
        self.unshipped_steps += len(group.step)
        if self.unshipped_steps > limit:
            self.unshipped = None
        else:
            self.unshipped.append(group.SerializeToString())

    def steps_part(self) -> tuple:
        """What of this rank a checkpoint keeps (:mod:`traceml_aggregator.checkpoint`): its
        attempt and everything its steps made, ``(restart, steps, steps_stored, last_step,
        last_step_unix_s, earlier_attempts)``; :meth:`restore_steps` takes it back."""
        return (
            self.restart,
            self.steps,
            self.steps_stored,
            self.last_step,
            self.last_step_unix_s,
            self.earlier_attempts,
        )

    def restore_steps(self, part: tuple) -> None:
        """Take a :meth:`steps_part` back (the rest of the rank stays as it is)."""
        (
            self.restart,
            self.steps,
            self.steps_stored,
            self.last_step,
            self.last_step_unix_s,
            self.earlier_attempts,
        ) = part

    def fold_steps(self, names, columns) -> None:
        """Fold one group of this attempt's steps in (``names``, one column per name; steps
        in step order)."""
        self.steps.fold(names, columns)
        self.steps_stored += len(columns[0])
        last = self.steps.last
        if last is not None and last["step"] != self.last_step:
            self.last_step = last["step"]
            start_us = (self.identity.start_unix_us if self.identity else 0) or 0
            self.last_step_unix_s = (start_us + last["end_us"]) / 1e6


def _tail(tails: dict, key, maxlen: int) -> Tail:
    """``tails[key]``, a new empty :class:`Tail` of ``maxlen`` items put there the first time
    (``setdefault`` would build a Tail, a deque, at every call: two a system sample)."""
    tail = tails.get(key)
    if tail is None:
        tail = tails[key] = Tail(maxlen=maxlen)
    return tail


class LiveAggregates:
    """The run's live aggregates (see the module docstring); event-loop use only.

    Args:
        run_name: the run's name (``run.run_name`` of the summary).
        world_size: ranks expected (the ``--world-size`` flag), None to take it from the
            ranks' identities.
        executor: where the analysis runs; None (the aggregator's) for a spawned process of
            its own, started on the first query (so the analysis never holds the GIL of the
            process that stores batches and sends acknowledgements).
    """

    def __init__(
        self,
        run_name: str,
        world_size: int | None = None,
        executor: concurrent.futures.Executor | None = None,
    ) -> None:
        self.run_name = run_name
        self.world_size = world_size
        self.ranks: dict[int, RankLive] = {}
        self.system_samples: dict[int, Tail] = {}
        self.gpu_samples: dict[int, Tail] = {}
        self.node_exits: dict[int, records.NodeExit] = {}
        self.rank_ends: dict[int, records.RankEnd] = {}
        #: Changes applied so far (a summary computed at version v covers everything before).
        self.version = 0
        self._pool = executor
        self._lock: asyncio.Lock | None = None  # the live summary's: one computation at a time
        self._ship_lock: asyncio.Lock | None = None  # see _in_analysis_process
        self._result: tuple[int, dict, dict] | None = None  # (version, run records, summary)
        self._metrics_lock: asyncio.Lock | None = None  # one /metrics text at a time
        #: (version covered, loop.time() when computed, the last /metrics text)
        self._metrics: tuple[int, float, bytes] | None = None
        self._next_start = 0.0  # loop.time() before which no computation starts
        # What the analysis process was last sent: per rank (restart, process samples
        # appended; its steps are RankLive.unshipped), per node (system, GPU samples
        # appended); what changed since.
        self._shipped: dict[int, tuple[int, int]] = {}
        self._shipped_nodes: dict[int, tuple[int, int]] = {}
        self._changed_ranks: set[int] = set()
        self._changed_ends: set[int] = set()
        self._changed_exits: set[int] = set()
        self._ship_whole = True  # the next delta is a whole one (a new analysis process)
        #: Gives the run's own records a live summary shows (the aggregator's stall record,
        #: node losses, refused calls, restarts: RunData field of ``load.META_RECORDS`` ->
        #: value); called on the loop at each query. None: no such records (set by the server).
        self.run_records: Callable[[], dict] | None = None
        #: The world size the first identity named (sizes the ranks' series without the flag).
        self._identity_world_size = 0
        #: While a replacement catches up (:meth:`restore` to :meth:`catch_up`): the batches
        #: and node exits stored meantime, (fold, its arguments) in the order they came.
        self._pending: collections.deque | None = None
        #: Set while nothing is held: the live views wait for it (:meth:`caught_up`).
        self._caught_up = asyncio.Event()
        self._caught_up.set()

    def _rank(self, rank: int) -> RankLive:
        rl = self.ranks.get(rank)
        if rl is None:
            world = self.world_size or self._identity_world_size or len(self.ranks) + 1
            rl = self.ranks[rank] = RankLive(rank, series_steps=series_steps(world))
        return rl

    # --- updates (O(the batch)) ------------------------------------------------------------------
    def on_batch(self, batch, groups: list[tuple] | None = None) -> None:
        """Fold a committed batch (a wire Batch of this run) into the aggregates; while a
        replacement catches up (:meth:`catch_up`), hold it to fold in after the stored steps.
        ``groups``: its step groups already decoded, ``(names, columns)`` of
        :func:`~traceml.core.records.step_group_columns` each in its order (the store's,
        :attr:`~traceml_aggregator.store.WriteResult.groups`); None to decode them here."""
        self._fold_or_hold(self._fold_batch, batch, groups)

    def _fold_or_hold(self, fold: Callable[..., None], *items) -> None:
        """``fold(*items, received_unix_us)`` now, or after the catch-up (held in order)."""
        args = (*items, time.time_ns() // 1000)
        if self._pending is not None:
            self._pending.append((fold, args))
        else:
            fold(*args)

    def _fold_batch(self, batch, groups: list[tuple] | None, received_unix_us: int) -> None:
        self.version += 1
        if not self._identity_world_size and batch.HasField("identity"):
            self._identity_world_size = batch.identity.world_size
        sender = batch.WhichOneof("sender") or "rank"
        restart = batch.restart_count
        if sender == "rank":
            self._rank_data(batch, groups, self._rank(batch.rank), restart, received_unix_us)
            self._changed_ranks.add(batch.rank)
        if batch.process_samples:  # (a look first: iterating an empty one costs 3 times it)
            for s in batch.process_samples:
                # A node sampler reports for its local workers; a rank for itself.
                rank, attempt = (
                    (s.rank, s.restart_count) if sender == "node_rank" else (batch.rank, restart)
                )
                # Kept whatever the attempt: a sampler's rows of a new attempt may come before
                # the rank's own first batch; run_data() keeps those of its latest attempt.
                self._rank(rank).process_samples.append(
                    records.ProcessSample.wire_dict(s, rank=rank, restart=attempt)
                )
                self._changed_ranks.add(rank)
        if batch.system_samples:
            for s in batch.system_samples:
                node = s.node_rank
                _tail(self.system_samples, node, WINDOW_SAMPLES).append(
                    records.SystemSample.wire_dict(s)
                )
                gpus = _tail(self.gpu_samples, node, WINDOW_GPU_SAMPLES)
                if s.gpus:
                    gpus.extend(
                        records.GpuSample.wire_dict(g, node_rank=s.node_rank, unix_us=s.unix_us)
                        for g in s.gpus
                    )

    def _rank_data(
        self, batch, groups: list[tuple] | None, rl: RankLive, restart: int, received_unix_us: int
    ) -> None:
        if not rl.attempt(restart):
            return
        if batch.HasField("identity"):
            rl.identity = records.Identity.from_wire(batch.identity)
        decoded = map(step_group_columns, batch.step_groups) if groups is None else groups
        for names, columns in decoded:
            if names:
                rl.fold_steps(names, columns)
        if rl.unshipped is not None:  # (the batch's groups are touched again only then)
            limit = analysis_steps(self._world())
            for group in batch.step_groups:
                if group.step:
                    rl.hold(group, limit)
        if batch.HasField("counts"):
            rl.counts = records.SenderCounts.from_wire(
                batch.counts, rank=rl.rank, restart=restart, seq=batch.seq
            )
        if batch.flops_counts:  # the latest count is the rank's
            rl.flops = records.Flops.from_wire(
                batch.flops_counts[-1], rank=rl.rank, restart=restart
            )
        if batch.HasField("finish"):
            rl.finish = records.Finish.from_wire(
                batch.finish,
                rank=rl.rank,
                restart=restart,
                received_unix_us=received_unix_us,
            )

    def on_node_exit(self, report) -> None:
        """Fold a node's torchrun exit (a wire NodeExit) in, as the store keeps it (held like
        a batch while a replacement catches up)."""
        self._fold_or_hold(self._fold_node_exit, report)

    def _fold_node_exit(self, report, received_unix_us: int) -> None:
        self.version += 1
        self._changed_exits.add(report.node_rank)
        self.node_exits[report.node_rank] = records.NodeExit.from_wire(
            report, received_unix_us=received_unix_us
        )
        for r in report.ranks:
            self._changed_ends.add(r.rank)
            self.rank_ends[r.rank] = records.RankEnd.from_wire(r, node_rank=report.node_rank)

    # --- reads -----------------------------------------------------------------------------------
    def run_data(self) -> RunData:
        """The windows as a RunData (copies: the analysis may run while batches keep coming);
        O(ranks x window). Ranks ``0 .. world_size - 1`` all appear (empty when nothing of
        them arrived), the world size being the flag's, else the largest an identity names,
        else the ranks seen."""
        return windows_run_data(
            self.run_name,
            self.world_size,
            self.ranks,
            self.rank_ends,
            self.node_exits,
            self.system_samples,
            self.gpu_samples,
            self._run_records(),
        )

    def _world(self) -> int:
        """The world size: the flag's, else the first identity's, else the ranks seen."""
        return self.world_size or self._identity_world_size or len(self.ranks)

    def _run_records(self) -> dict:
        return self.run_records() if self.run_records is not None else {}

    async def _delta(self, whole: bool, records: dict) -> LiveDelta:
        """What changed since the last delta sent to the analysis process (everything when
        ``whole``), with the run's ``records``; the marks of what was sent move on. A rank's
        steps are the groups held since the last delta (:meth:`RankLive.hold`), or, after a
        whole delta, a new attempt or more new steps than the analysis covers, the window's
        latest :func:`analysis_steps` steps: O(the data that arrived since), O(ranks x
        analysis steps) at most. The loop is given back every :data:`DELTA_SLICE_RANKS` ranks
        (a delta may copy windows, far slower when the writer's thread holds the GIL), so no
        acknowledgement waits for a whole delta; what arrives meanwhile is in this delta or the
        next one, never lost: each rank is copied, and its marks moved, at one go."""
        keep = analysis_steps(self._world())
        delta = LiveDelta(whole, self.run_name, self.world_size, keep, run_records=records)
        ranks = list(self.ranks if whole else self._changed_ranks)
        exits = list(self.node_exits if whole else self._changed_exits)
        ends = list(self.rank_ends if whole else self._changed_ends)
        self._changed_ranks, self._changed_exits, self._changed_ends = set(), set(), set()
        for i, r in enumerate(ranks):
            if i and not i % DELTA_SLICE_RANKS:
                await asyncio.sleep(0)
            rl = self.ranks.get(r)
            if rl is None:
                continue
            restart, appended = (-1, 0) if whole else self._shipped.get(r, (-1, 0))
            groups = rl.unshipped
            reset = groups is None or restart != rl.restart
            delta.ranks[r] = RankDelta(
                restart=rl.restart,
                reset=reset,
                steps=rl.steps.tail(keep) if reset else {},
                groups=[] if reset else groups,
                process_samples=rl.process_samples.since(appended),
                identity=rl.identity,
                finish=rl.finish,
                flops=rl.flops,
                earlier_attempts=dict(rl.earlier_attempts),
                steps_stored=rl.steps_stored,
                last_step_unix_s=rl.last_step_unix_s,
                counts=rl.counts,
            )
            rl.unshipped, rl.unshipped_steps = [], 0
            self._shipped[r] = (rl.restart, rl.process_samples.appended)
        for n in self.system_samples.keys() | self.gpu_samples.keys():
            system, gpus = self.system_samples.get(n, Tail()), self.gpu_samples.get(n, Tail())
            sent_system, sent_gpus = (0, 0) if whole else self._shipped_nodes.get(n, (0, 0))
            if system.appended != sent_system:
                delta.system_samples[n] = system.since(sent_system)
            if gpus.appended != sent_gpus:
                delta.gpu_samples[n] = gpus.since(sent_gpus)
            self._shipped_nodes[n] = (system.appended, gpus.appended)
        delta.node_exits = {n: self.node_exits[n] for n in exits}
        delta.rank_ends = {r: self.rank_ends[r] for r in ends}
        return delta

    def seed(self, store, checkpoint: Checkpoint | None = None) -> Checkpoint:
        """Fold in what is already stored for the run at one go: :meth:`restore`, then
        :meth:`replay`. Returns the checkpoint as :meth:`restore` does."""
        checkpoint, replay = self.restore(store, checkpoint)
        self.replay(store, replay)
        return checkpoint

    def replay(self, store, replay: StepReplay) -> None:
        """Fold in every step of ``replay`` (from :meth:`restore`) at once, on the thread that
        owns ``store`` (``--finalize-only``: nothing comes meanwhile)."""
        while (chunk := replay.chunk(store)) is not None:
            self.fold_stored(replay, *chunk)
        self._caught_up_now()

    def restore(self, store, checkpoint: Checkpoint | None = None) -> tuple[Checkpoint, StepReplay]:
        """Start folding in what is already stored for the run: an earlier aggregator of this
        run (a restart on the same store), or the whole run for ``--finalize-only``. Once the
        steps of the returned :class:`StepReplay` are folded in (:meth:`replay` at one go,
        :meth:`catch_up` while serving), the aggregates are what they would be had this
        aggregator received every stored batch: the identities, finish markers, node exits and
        latest samples, and every stored step folded in arrival order.

        From ``checkpoint`` (:func:`traceml_aggregator.checkpoint.read`) and the ranks' rows
        (:func:`~traceml_aggregator.checkpoint.read_ranks`, read when it covers steps), only what
        was stored after it is read: here the ranks' and nodes' small tables and the samples above
        its marks (O(ranks + nodes + samples stored since)), and in the replay the steps above its
        mark (O(steps stored since)). Without one, or with an empty one, the replay is every stored
        step; both give the same aggregates. Until the replay is folded in, batches and node exits
        are held (:meth:`on_batch`) and the live views wait (:meth:`caught_up`).
        Returns the checkpoint, its sample windows advanced to the store as it is now (what
        the next one starts from: :class:`~traceml_aggregator.checkpoint.Checkpointer`), and
        the replay.
        """
        self.version += 1
        self._ship_whole = True
        self._pending = collections.deque()
        self._caught_up.clear()
        checkpoint = checkpoint or Checkpoint()
        process = records.ProcessSample.TABLE
        try:
            parts = read_ranks(store) if checkpoint.steps_from else {}
            run = _small_tables(store, checkpoint)
            if any(
                part[0] > run.ranks[r].restart and not part[2]
                for r, (_, part) in parts.items()
                if r in run.ranks
            ):
                # A later attempt known from a batch with neither identity nor steps, of which
                # the store keeps no trace: a full replay gives what the store says.
                raise ValueError("a rank's attempt is ahead of the store")
        except Exception as exc:
            _log.warning(
                f"cannot seed from the live aggregates' checkpoint ({exc}): "
                "replaying every stored step"
            )
            checkpoint, parts = Checkpoint(), {}
            run = _small_tables(store, checkpoint)
        self._identity_world_size = self._identity_world_size or run.world_size
        for r, (_, part) in parts.items():
            self._rank(r).restore_steps(part)
        for r, rd in run.ranks.items():
            rl = self._rank(r)
            if r not in parts:
                rl.restart = rd.restart
            elif rl.restart > rd.restart:  # steps of an attempt that sent no identity yet
                rd.identity = rd.finish = None
            else:
                rl.attempt(rd.restart)
            rl.identity, rl.finish = rd.identity, rd.finish
            rl.process_samples.extend(checkpoint.window(process, (r, rd.restart)))
            if rd.end is not None:
                self.rank_ends[r] = rd.end
        for record, keep in SAMPLE_WINDOWS[1:]:
            tails = self.system_samples if record is records.SystemSample else self.gpu_samples
            for key in checkpoint.keys(record.TABLE):
                tails[key[0]] = Tail(checkpoint.window(record.TABLE, key), maxlen=keep)
        self.node_exits.update(run.node_exits)
        marks = {r: mark for r, (mark, _) in parts.items()}
        return checkpoint, StepReplay(checkpoint.steps_from, store.steps_rowid, marks)

    def fold_stored(self, replay: StepReplay, names: list[str], rows: list[tuple]) -> None:
        """Fold in one chunk of :meth:`StepReplay.chunk`: stored step rows ``(rowid,
        *names, rank, restart)`` in the order they were stored, so every rank's steps are
        folded in their arrival order, as the aggregator that received them folded them; a
        rank's rows at or below its checkpoint's mark are in its checkpointed state already."""
        self.version += 1
        for (rank, restart), group in itertools.groupby(rows, _attempt):
            mark = replay.marks.get(rank, 0)
            group = [row for row in group if row[0] > mark]
            if not group:
                continue
            rl = self._rank(rank)
            if rl.attempt(restart):
                # the fields the rank measured, as its batches carried them (not NULL)
                columns = list(zip(*group, strict=True))[1 : len(names) + 1]
                carried = [
                    (name, column)
                    for name, column in zip(names, columns, strict=True)
                    if column.count(None) != len(column)
                ]
                rl.fold_steps(*zip(*carried, strict=True))
            else:
                rl.earlier_attempts[restart] = rl.earlier_attempts.get(restart, 0) + len(group)

    async def catch_up(self, replay: StepReplay, writer) -> None:
        """Fold in ``replay``'s stored steps while the aggregator serves, then the batches and
        node exits held meanwhile, in the order they were stored: the aggregates are then
        those of :meth:`seed`, plus what came since. Each chunk is read on the thread of
        ``writer`` (:class:`traceml_aggregator.writer.Writer`: the only one that touches the
        store), between two of its transactions of batches, and folded on the event loop;
        the held items are folded :data:`HELD_SLICE` at a time between two returns to the
        loop. Logs how long it took.

        Raises:
            sqlite3.Error: a chunk could not be read (the aggregator cannot go on).
        """
        started = time.monotonic()
        while (chunk := await writer.call(replay.chunk, writer.store)) is not None:
            self.fold_stored(replay, *chunk)
        held = len(self._pending or ())
        while self._pending:
            for _ in range(min(HELD_SLICE, len(self._pending))):
                fold, args = self._pending.popleft()
                try:
                    fold(*args)
                except Exception as exc:  # a bug: said, and the rest still folded in
                    _log.warning(f"cannot fold a held batch into the live aggregates: {exc}")
            await asyncio.sleep(0)
        self._caught_up_now()
        if replay.steps:
            _log.info(
                f"caught up in {time.monotonic() - started:.2f} s: {replay.steps} stored "
                f"steps after the checkpoint, then {held} batches held meanwhile"
            )

    def _caught_up_now(self) -> None:
        """Nothing is held any more: batches fold in as they come, and the views are open."""
        self._pending = None
        self._caught_up.set()

    async def caught_up(self) -> None:
        """Return once every stored step is folded in: at once, but while a replacement
        catches up (:meth:`catch_up`)."""
        await self._caught_up.wait()

    def final_steps(self) -> dict[int, tuple]:
        """Each rank's steps for the final summary (on the event loop, then read anywhere):
        rank -> ``(restart, series, digest or None, earlier_attempts)``, the series being all
        the attempt's steps or, with a digest, their sample (see
        :mod:`traceml_aggregator.aggregates`); the digest is a copy, so batches that still
        arrive do not change it under the analysis."""
        return {
            r: (rl.restart, *rl.steps.final(), dict(rl.earlier_attempts))
            for r, rl in self.ranks.items()
        }

    async def summary(self) -> dict:
        """The live summary document (``build_summary(..., live=True)``) over the windows,
        covering every batch folded in before the call.

        Raises:
            Exception: whatever the analysis raised (the caller reports it).
        """
        wanted = self.version
        if self._current(wanted):
            return self._result[2]
        if self._lock is None:
            self._lock = asyncio.Lock()
        async with self._lock:  # one computation at a time, shared by every waiting viewer
            if self._current(wanted):
                return self._result[2]
            loop = asyncio.get_running_loop()
            await asyncio.sleep(max(0.0, self._next_start - loop.time()))
            version, records = self.version, self._run_records()
            started = loop.time()
            summary = await self._in_analysis_process(records, analysis_process.analyse)
            took = loop.time() - started
            gap = min(took * (1.0 / ANALYSIS_DUTY - 1.0), ANALYSIS_MAX_GAP_S)
            self._next_start = loop.time() + gap
            self._result = (version, records, summary)
            return summary

    def _current(self, wanted: int) -> bool:
        """Whether the last summary covers version ``wanted`` and the run's records as they
        are now (a hang changes the stall record while no batch comes)."""
        return (
            self._result is not None
            and self._result[0] >= wanted
            and self._result[1] == self._run_records()
        )

    async def snapshot(self, summary: dict | None, version: int):
        """The dashboard's :class:`~traceml_aggregator.dashboard.frames.Snapshot` of the
        windows with ``summary`` (the live verdict), built in the analysis process from its
        mirror (:func:`traceml_aggregator.live.analysis_process.snapshot`): the event loop pays the
        delta only, not a copy of every window, and the building (~0.3 s at 256 ranks) holds
        no GIL of the aggregator. It never waits for the live summary's pause between two
        computations (the dashboard bounds its own share of the time).

        Raises:
            Exception: whatever building it raised (the process's death included).
        """
        return await self._in_analysis_process(
            self._run_records(), analysis_process.snapshot, summary, version
        )

    async def metrics(self) -> bytes:
        """The Prometheus ``/metrics`` text of the windows
        (:func:`traceml_aggregator.metrics.exposition`), covering every batch folded in before
        the call or computed at most :data:`METRICS_MAX_AGE_S` ago, written in the analysis
        process from its mirror: the event loop pays the delta only. Concurrent callers share
        one computation; while nothing new arrived, or the last text is younger than
        :data:`METRICS_MAX_AGE_S`, the last text is the answer.

        Raises:
            Exception: whatever building it raised (the process's death included).
        """
        wanted = self.version
        if self._metrics_lock is None:
            self._metrics_lock = asyncio.Lock()
        loop = asyncio.get_running_loop()
        async with self._metrics_lock:
            last = self._metrics
            if last is None or (last[0] < wanted and loop.time() - last[1] >= METRICS_MAX_AGE_S):
                version = self.version
                text = await self._in_analysis_process(
                    self._run_records(), analysis_process.metrics
                )
                self._metrics = (version, loop.time(), text)
            return self._metrics[2]

    async def in_analysis_process(self, fn, *args):
        """``fn(delta, *args)`` in the analysis process, with the run's records as they are
        now (see :meth:`_in_analysis_process`): for what exports the mirror from there (the
        OTLP push, :mod:`traceml_aggregator.otlp`). The event loop pays the delta only.

        Raises:
            Exception: whatever ``fn`` raised (the process's death included).
        """
        return await self._in_analysis_process(self._run_records(), fn, *args)

    async def _in_analysis_process(self, records: dict, fn, *args):
        """``fn(delta, *args)`` in the analysis process (a function of
        :mod:`traceml_aggregator.live.analysis_process`), ``delta`` being what changed since the
        last call, with the run's ``records``. Deltas reach the process in the order they were made
        (one process, calls queued in order). The process is started on first use, and again
        when it died (e.g. killed: that call fails, the next one works, sent the whole run)."""
        await self.caught_up()  # a view of part of the run would be wrong, not late
        if self._ship_lock is None:
            self._ship_lock = asyncio.Lock()
        pool = None
        try:
            async with self._ship_lock:  # a delta made and queued at one go
                if self._pool is None:
                    self._pool = analysis_process.spawn(os.getpid())
                    self._ship_whole = True
                pool = self._pool
                delta = await self._delta(whole=self._ship_whole, records=records)
                self._ship_whole = False
                result = asyncio.get_running_loop().run_in_executor(pool, fn, delta, *args)
            return await result
        except concurrent.futures.process.BrokenProcessPool:
            if self._pool is pool:
                pool.shutdown(wait=False)
                self._pool = None
            raise
        except Exception:  # the mirror may hold part of the delta: start it afresh
            self._ship_whole = True
            raise

    def close(self) -> None:
        """Stop the analysis process now, its running computation (if any) with it: at shutdown
        nobody waits for a live view any more, and a computation at the process's low priority
        on a saturated node can take minutes (CI saw a SIGTERMed aggregator still waiting for
        one after 30 s). What the run's end needs (the final summary, the OTLP push's last
        figures) was computed before this is called. SIGKILL, which also ends a stopped
        process; the process holds nothing of the run's."""
        pool, self._pool = self._pool, None
        if pool is None:
            return
        # The pool's one worker (none in a thread pool, as some tests use); ProcessPoolExecutor
        # has no public way to stop it before Python 3.14.
        workers = list((getattr(pool, "_processes", None) or {}).values())
        pool.shutdown(wait=False, cancel_futures=True)
        for worker in workers:
            worker.kill()
        for worker in workers:
            worker.join()


def _small_tables(store, checkpoint: Checkpoint) -> RunData:
    """The run without steps or samples (:func:`~traceml_aggregator.load.load`: O(ranks +
    nodes)), after ``checkpoint``'s sample windows were advanced to the store: its ranks those
    of a full load (the ranks known from process samples alone included)."""
    checkpoint.advance_windows(store)
    return load(store, [], steps=False, samples=False, sampled_ranks=checkpoint.sampled_ranks())


def with_steps(run: RunData, steps: dict[int, tuple]) -> RunData:
    """``run`` (loaded without steps: :func:`traceml_aggregator.load.load` with
    ``steps=False``) with each rank's steps of :meth:`LiveAggregates.final_steps`; returns
    ``run``."""
    for r, (restart, series, digest, earlier) in steps.items():
        rd = run.ranks.setdefault(r, RankData(r))
        if restart < rd.restart:
            continue
        if restart > rd.restart:  # steps of an attempt that sent no identity yet
            rd.restart, rd.identity, rd.finish = restart, None, None
        rd.steps, rd.digest, rd.earlier_attempts = series, digest, earlier
    if run.ranks:
        run.ranks = dict(sorted(run.ranks.items()))
    return run


_attempt = operator.itemgetter(-2, -1)  # (rank, restart) of a steps row
_unix_us = operator.itemgetter("unix_us")
_unix_index = operator.itemgetter("unix_us", "nvml_index")
