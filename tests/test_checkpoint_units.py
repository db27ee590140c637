"""The live aggregates' checkpoint (traceml_aggregator/checkpoint.py), in process on a real
store: seeding from a checkpoint plus the rows stored after it gives exactly the aggregates of
a full replay, whatever was stored after it (more steps, a new attempt, new ranks, samples).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import pickle
import sqlite3
import threading
from pathlib import Path

import numpy as np
import pytest
from helpers.batches import node_batch, rank_batch

from traceml import wire
from traceml.analysis.rundata import SampleColumns
from traceml.core.records import GpuSample
from traceml_aggregator import checkpoint as ckpt
from traceml_aggregator.live import LiveAggregates
from traceml_aggregator.load import load
from traceml_aggregator.reports import write_reports
from traceml_aggregator.sample_series import SERIES_TICKS, SampleSeries
from traceml_aggregator.store import Store
from traceml_aggregator.writer import Writer

RANKS = 4
RUN = "r"


def state_of(live: LiveAggregates) -> dict:
    """Everything of ``live`` a restart rebuilds, as plain values (NaN as a string), so two
    aggregates compare with ``==``."""
    return {
        "ranks": {r: _plain(rl.__dict__) for r, rl in live.ranks.items()},
        "system": {n: list(t) for n, t in live.system_samples.items()},
        "gpu": {n: list(t) for n, t in live.gpu_samples.items()},
        "node_exits": live.node_exits,
        "rank_ends": live.rank_ends,
        "world": live._identity_world_size,
    }


def _plain(x):
    if isinstance(x, np.ndarray):
        return (str(x.dtype), x.shape, _plain(x.tolist()))
    if isinstance(x, float) and x != x:
        return "nan"
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)) or type(x).__name__ in ("deque", "Tail"):
        return [_plain(v) for v in x]
    if hasattr(x, "__slots__"):
        return {k: _plain(getattr(x, k)) for k in x.__slots__}
    if hasattr(x, "__dict__"):  # what it pickles: a cache it leaves out is not state
        return _plain(x.__getstate__())
    return x


def _row(i: int) -> dict:
    return {
        "step": i,
        "end_us": 1000 * (i + 1) + i % 7,
        "step_us": 900 + i % 13,
        "forward_us": 300 + i % 5,
        "input_wait_us": 10 + i % 3,
    }


def _identity(rank: int, restart: int) -> wire.RankIdentity:
    return wire.RankIdentity(
        rank=rank,
        restart_count=restart,
        world_size=RANKS,
        hostname="h0",
        pid=100 + 10 * restart + rank,
        start_unix_us=1_700_000_000_000_000,
    )


class _Run:
    """A run fed to a real Writer over a real store, its live aggregates kept as the
    aggregator keeps them."""

    def __init__(self, path) -> None:
        self.store = Store(path)
        self.live = LiveAggregates(RUN, RANKS)
        self.seeded = self.live.seed(self.store)
        self.writer = Writer(self.store, self.live.on_batch)
        #: Takes its checkpoints, as the aggregator's does.
        self.checkpointer = ckpt.Checkpointer(self.seeded, self.live, self.writer)
        self.seq: dict[tuple, int] = {}

    async def steps(self, rank: int, steps: range, restart: int = 0, per_batch: int = 37):
        for first in range(steps.start, steps.stop, per_batch):
            key = (rank, restart)
            seq = self.seq[key] = self.seq.get(key, 0) + 1
            extra = {"identity": _identity(rank, restart)} if seq == 1 else {}
            batch = rank_batch(
                seq,
                range(first, min(first + per_batch, steps.stop)),
                rank=rank,
                restart=restart,
                row=_row,
                run_name=RUN,
                **extra,
            )
            batch.process_samples.add(unix_us=10_000 * first + rank, cpu_percent=float(first))
            await self.writer.queue_batch(batch)

    async def node_samples(self, seq: int, t: int) -> None:
        batch = node_batch(seq, run_name=RUN)
        s = batch.system_samples.add(node_rank=0, unix_us=t, hostname="h0", cpu_percent=1.0)
        for g in range(2):
            s.gpus.add(nvml_index=g, uuid=f"GPU-{g}", util_percent=float(t % 100))
        # a sampler's process sample of a rank that never sent a batch of its own
        batch.process_samples.add(rank=RANKS + 1, restart_count=0, unix_us=t, cpu_percent=2.0)
        await self.writer.queue_batch(batch)


def _seeded(store, checkpoint=None) -> LiveAggregates:
    live = LiveAggregates(RUN, RANKS)
    live.seed(store, checkpoint)
    return live


@pytest.mark.parametrize("after", ["more_steps", "new_attempt", "nothing"])
def test_seed_from_checkpoint_equals_full_replay(tmp_path, after):
    path = tmp_path / "telemetry.sqlite"

    async def feed() -> int:
        run = _Run(path)
        run.writer.start()
        for i in range(3):
            await run.node_samples(i + 1, 5_000 * i)
        for r in range(RANKS - 1):  # more than FOLD_STEPS: the series and digest are folded
            await run.steps(r, range(0, 1300 + 100 * r))
        await run.checkpointer.write()
        covered = run.writer.steps_rowid_seen
        if after == "more_steps":
            for r in range(RANKS):  # rank 3 is new since the checkpoint
                await run.steps(r, range(1300 + 100 * r, 1900 + 100 * r))
            await run.node_samples(4, 999)  # earlier than samples already kept: sorted in
        elif after == "new_attempt":
            await run.steps(1, range(0, 700), restart=1)
            await run.steps(0, range(1300, 1320))
        await run.writer.close()
        return covered

    covered = asyncio.run(feed())
    store = Store(path)
    checkpoint = ckpt.read(store)
    assert checkpoint.steps_from == covered == sum(1300 + 100 * r for r in range(RANKS - 1))
    assert sorted(ckpt.read_ranks(store)) == [0, 1, 2, RANKS + 1]
    restarted, replayed = _seeded(store, checkpoint), _seeded(store)
    assert state_of(restarted) == state_of(replayed)
    # and the full replay is what the store holds: steps and the windows load() reads
    run = load(store, [])
    for r, rd in run.ranks.items():
        rl = replayed.ranks[r]
        assert rl.steps_stored == len(rd.steps or ()), r
        assert list(rl.process_samples) == list(rd.process_samples[-256:]), r
    assert list(replayed.gpu_samples[0]) == list(run.gpu_samples[0])
    assert [s["unix_us"] for s in replayed.system_samples[0]] == (
        [0, 999, 5000, 10000] if after == "more_steps" else [0, 5000, 10000]
    )
    assert replayed.ranks[1].restart == (1 if after == "new_attempt" else 0)
    assert replayed.ranks[1].earlier_attempts == ({0: 1400} if after == "new_attempt" else {})
    store.close()


@pytest.mark.parametrize("cancelled_in", ["the writer thread", "the copy"])
def test_a_cancelled_checkpoint_leaves_the_next_one_whole(tmp_path, monkeypatch, cancelled_in):
    """A stop cancels the periodic checkpoint while its row is being written on the writer
    thread, or while it copies the ranks (it returns to the loop between two slices of ranks:
    one rank a slice here), then writes one of its own: that one's copy of each rank is the
    newest, so that the rows at or below its mark (which retention may delete) are in it, not
    only replayed."""
    if cancelled_in == "the copy":
        monkeypatch.setattr(ckpt, "SNAPSHOT_SLICE_RANKS", 1)
    path = tmp_path / "telemetry.sqlite"

    async def feed() -> None:
        run = _Run(path)
        run.writer.start()
        for r in range(RANKS):
            await run.steps(r, range(0, 500))
        await run.checkpointer.write()
        for r in range(RANKS):
            await run.steps(r, range(500, 900))
        gate = threading.Event()
        busy = asyncio.ensure_future(run.writer.call(gate.wait))  # the writer thread is busy
        periodic = asyncio.ensure_future(run.checkpointer.write())
        await asyncio.sleep(0)  # its copies taken (or the first slice), its row not written
        periodic.cancel()
        at_stop = asyncio.ensure_future(run.checkpointer.write())
        await asyncio.sleep(0)  # copies taken before the cancelled one's row was written
        gate.set()
        await busy
        await at_stop
        assert periodic.cancelled()
        await run.writer.close()

    asyncio.run(feed())
    store = Store(path)
    checkpoint = ckpt.read(store)
    assert checkpoint.steps_from == RANKS * 900
    assert {r: mark for r, (mark, _) in ckpt.read_ranks(store).items()} == {
        r: RANKS * 900 for r in range(RANKS)
    }
    full = state_of(_seeded(store))
    store.close()
    with contextlib.closing(sqlite3.connect(path)) as db, db:  # what a prune may delete
        db.execute("DELETE FROM steps WHERE rowid <= ?", (checkpoint.steps_from,))
    store = Store(path)
    assert state_of(_seeded(store, ckpt.read(store))) == full
    store.close()


def test_a_checkpoint_writes_only_the_ranks_that_moved_and_a_kill_before_its_row_keeps_it_exact(
    tmp_path, monkeypatch
):
    """The ranks' rows are written a slice at a time (one rank a slice here), only for ranks
    whose steps moved since their rows, with the span of their windows since (the rows that
    end before the window deleted), and a rank's series (digest and sample) only when a
    chunk of its steps was folded into it since its series row; a checkpoint whose own row
    then fails (as a kill between the two) leaves the previous ``steps_from`` with newer
    ranks' rows, some beside older series rows, and seeding from that is still exactly a
    full replay (rank 2's window of 512 steps from its two window rows, of 100 and 450)."""
    monkeypatch.setattr(ckpt, "SNAPSHOT_SLICE_RANKS", 1)
    path = tmp_path / "telemetry.sqlite"
    slices: list[tuple[list, list, list, list]] = []

    async def feed() -> None:
        run = _Run(path)
        write_ranks = run.store.write_live_checkpoint_ranks

        def recording(rows, series, windows, dropped):
            slices.append(
                (
                    [row[:2] for row in rows],
                    [row[:3] for row in series],
                    [row[:4] for row in windows],  # rank, upto, attempt, steps
                    dropped,
                )
            )
            write_ranks(rows, series, windows, dropped)

        monkeypatch.setattr(run.store, "write_live_checkpoint_ranks", recording)
        run.writer.start()
        for r in range(RANKS):
            await run.steps(r, range(0, 100))
        await run.checkpointer.write()
        # rank 2's first chunk (FOLD_STEPS less its offset, 2) is folded into its series
        await run.steps(2, range(100, 550))
        await run.checkpointer.write()
        await run.steps(1, range(100, 120))

        def full_disk(*args):
            raise sqlite3.OperationalError("database or disk is full")

        monkeypatch.setattr(run.store, "write_live_checkpoint", full_disk)
        with pytest.raises(sqlite3.OperationalError):
            await run.checkpointer.write()
        await run.steps(0, range(100, 130))
        await run.writer.close()

    asyncio.run(feed())
    first, second = RANKS * 100, RANKS * 100 + 450
    whole = (ckpt.STORE_INT_MAX, ckpt.STORE_INT_MAX)  # a window written whole: every row
    assert slices == [
        ([(r, first)], [(r, 0, 0)], [(r, 100, 0, 100)], [(r, *whole)]) for r in range(RANKS)
    ] + [
        # the rows that end before the window, or within the new row's steps
        ([(2, second)], [(2, 0, 1)], [(2, 550, 0, 450)], [(2, 550 - 512, 100)]),
        ([(1, second + 20)], [], [(1, 120, 0, 20)], [(1, 0, 100)]),
    ]
    store = Store(path)
    assert [row[:3] for r in range(RANKS) for row in store.live_checkpoint_window(r)] == [
        (100, 0, 100),
        (100, 0, 100),
        (120, 0, 20),
        (100, 0, 100),
        (550, 0, 450),
        (100, 0, 100),
    ]
    store.close()
    store = Store(path)
    assert ckpt.read(store).steps_from == second
    ranks = ckpt.read_ranks(store)
    assert {r: mark for r, (mark, _) in ranks.items()} == {
        0: first,
        1: second + 20,
        2: second,
        3: first,
    }
    assert [ranks[r][1][1].series.folds for r in range(RANKS)] == [0, 0, 1, 0]
    restarted = _seeded(store, ckpt.read(store))
    assert state_of(restarted) == state_of(_seeded(store))
    assert [restarted.ranks[r].steps_stored for r in range(RANKS)] == [130, 120, 550, 100]
    store.close()


def test_a_ranks_window_is_written_a_span_at_a_time_and_whole_every_window_rows(
    tmp_path, monkeypatch
):
    """Each checkpoint adds the steps a rank stored since the last one to its window rows,
    deleting those that end before its window (512 steps); past WINDOW_ROWS rows the window is
    written whole again, in one row, and so is a new attempt's (the last one's rows deleted);
    seeding from each equals a full replay; a window row missing sets the checkpoint aside (a
    full replay)."""
    monkeypatch.setattr(ckpt, "WINDOW_ROWS", 3)
    path = tmp_path / "telemetry.sqlite"
    rows: list[list[tuple[int, int, int]]] = []  # rank 0's (upto, attempt, steps) each time

    async def feed(spans: list[range], restart: int) -> None:
        run = _Run(path)
        run.writer.start()
        for steps in spans:
            await run.steps(0, steps, restart=restart, per_batch=50)
            await run.checkpointer.write()
            window = await run.writer.call(run.store.live_checkpoint_window, 0)
            rows.append([row[:3] for row in window])
        await run.writer.close()

    asyncio.run(feed([range(150 * i, 150 * (i + 1)) for i in range(5)] + [range(750, 1200)], 0))
    assert rows == [
        [(150, 0, 150)],
        [(150, 0, 150), (300, 0, 150)],
        [(150, 0, 150), (300, 0, 150), (450, 0, 150)],
        [(600, 0, 512)],  # a fourth row: the window whole instead
        [(600, 0, 512), (750, 0, 150)],
        [(750, 0, 150), (1200, 0, 450)],  # the row ending at step 600 is before the window
    ]
    store = Store(path)
    full = state_of(_seeded(store))
    assert state_of(_seeded(store, ckpt.read(store))) == full
    assert ckpt.read_ranks(store)[0][1][1].size == 512
    store.close()
    with contextlib.closing(sqlite3.connect(path)) as db, db:
        db.execute("DELETE FROM live_checkpoint_window WHERE upto = 750")
    store = Store(path)
    with pytest.raises(ValueError, match="window rows hold fewer than its 512 steps"):
        ckpt.read_ranks(store)
    assert state_of(_seeded(store, ckpt.read(store))) == full
    store.close()
    # a new attempt: its window whole, the last attempt's rows deleted
    rows.clear()
    asyncio.run(feed([range(0, 30)], 1))
    assert rows == [[(30, 1, 30)]]
    store = Store(path)
    assert state_of(_seeded(store, ckpt.read(store))) == state_of(_seeded(store))
    store.close()


def test_a_window_row_of_a_checkpoint_cancelled_after_its_commit_is_superseded(
    tmp_path, monkeypatch
):
    """A stop cancels a checkpoint while the writer thread commits its ranks' rows, so this
    aggregator does not count them written; the next checkpoint writes the steps since the
    last one it counted, and deletes the cancelled one's window row (within those steps), so
    the rows still chain and seeding from them is exactly a full replay."""
    path = tmp_path / "telemetry.sqlite"

    async def feed() -> list[tuple]:
        run = _Run(path)
        run.writer.start()
        await run.steps(0, range(0, 100))
        await run.checkpointer.write()
        await run.steps(0, range(100, 200))
        write_ranks = run.store.write_live_checkpoint_ranks
        committed, release = threading.Event(), threading.Event()

        def commit_then_wait(*rows) -> None:
            write_ranks(*rows)
            committed.set()
            release.wait()

        monkeypatch.setattr(run.store, "write_live_checkpoint_ranks", commit_then_wait)
        cancelled = asyncio.ensure_future(run.checkpointer.write())
        await asyncio.get_running_loop().run_in_executor(None, committed.wait)
        cancelled.cancel()
        monkeypatch.setattr(run.store, "write_live_checkpoint_ranks", write_ranks)
        release.set()
        with contextlib.suppress(asyncio.CancelledError):
            await cancelled
        window = await run.writer.call(run.store.live_checkpoint_window, 0)
        assert [row[:3] for row in window] == [(100, 0, 100), (200, 0, 100)]
        await run.steps(0, range(200, 260))
        await run.checkpointer.write()
        window = await run.writer.call(run.store.live_checkpoint_window, 0)
        await run.writer.close()
        return [row[:3] for row in window]

    assert asyncio.run(feed()) == [(100, 0, 100), (260, 0, 160)]
    store = Store(path)
    assert state_of(_seeded(store, ckpt.read(store))) == state_of(_seeded(store))
    store.close()


def test_unreadable_or_foreign_checkpoint_falls_back_to_a_full_replay(tmp_path):
    path = tmp_path / "telemetry.sqlite"

    async def feed() -> None:
        run = _Run(path)
        run.writer.start()
        await run.steps(0, range(0, 600))
        await run.checkpointer.write()
        await run.writer.close()

    asyncio.run(feed())
    store = Store(path)
    good = ckpt.read(store)
    assert good.steps_from == 600
    full = state_of(_seeded(store))
    # a pickle that names a class no checkpoint holds is refused, never run
    for data in (b"not a pickle", pickle.dumps(print), pickle.dumps({"version": 1})):
        store.write_live_checkpoint(data, 0)
        checkpoint = ckpt.read(store)
        assert checkpoint == ckpt.Checkpoint()
        assert state_of(_seeded(store, checkpoint)) == full
    # ... in a rank's row too, or in its series row, or a rank's row that names another
    # series than its series row holds: the whole checkpoint is set aside
    store.write_live_checkpoint(pickle.dumps(good, 5), 0)
    ((row, folds, series),) = store.query(
        "SELECT r.state, s.folds, s.state FROM live_checkpoint_ranks r "
        "JOIN live_checkpoint_series s",
        by_name=False,
    )
    assert folds == 1  # 600 steps: one chunk of FOLD_STEPS folded into the series
    for rows, series_rows in (
        ([(0, 600, b"not a pickle")], []),
        ([(0, 600, pickle.dumps(print))], []),
        ([(0, 600, row)], [(0, 0, 2, series)]),  # a series of 2 chunks: not the row's
        ([(0, 600, row)], [(0, 0, 1, pickle.dumps(print))]),
    ):
        store.write_live_checkpoint_ranks(rows, series_rows, [], [])
        assert state_of(_seeded(store, ckpt.read(store))) == full
    store.write_live_checkpoint_ranks([], [(0, 0, 1, series)], [], [])
    assert state_of(_seeded(store, ckpt.read(store))) == full
    assert ckpt.read_ranks(store)[0][1][2] == 600  # the good rows read back: 600 steps stored
    store.close()


def test_checkpoints_are_spaced_out_where_they_would_take_more_than_their_share():
    """At 8,000 ranks a checkpoint takes seconds (O(ranks)): the next one then waits so that
    checkpoints take at most CHECKPOINT_MAX_PCT of the time; a quick one keeps the interval."""
    assert ckpt.CHECKPOINT_MAX_PCT == 5.0
    assert ckpt.next_checkpoint_in(30.0, 0.5) == 30.0
    assert ckpt.next_checkpoint_in(30.0, 1.5) == 30.0  # exactly 5 % of 30 s
    assert ckpt.next_checkpoint_in(30.0, 4.0) == 76.0  # 4 s of 80 s
    assert ckpt.next_checkpoint_in(1.0, 0.4) == 7.6
    assert ckpt.CHECKPOINT_MAX_INTERVALS == 10
    assert ckpt.next_checkpoint_in(1.0, 2.0) == 10.0  # 38 s, but at most 10 intervals
    assert ckpt.next_checkpoint_in(30.0, 60.0) == 300.0  # a disk stall: 300 s, not 1,140


def test_the_periodic_checkpointer_waits_as_its_last_checkpoint_took(tmp_path, monkeypatch):
    """Checkpointer.run spaces its checkpoints by next_checkpoint_in of the one it wrote: with
    a share of a millionth of the time, a checkpoint of a real store (well over 0.1 ms) sends
    the next one the most intervals away (here 100 s), not the 10 ms interval."""
    monkeypatch.setattr(ckpt, "CHECKPOINT_MAX_PCT", 1e-4)
    monkeypatch.setattr(ckpt, "CHECKPOINT_MAX_INTERVALS", 10_000)

    async def feed() -> ckpt.Checkpointer:
        run = _Run(tmp_path / "telemetry.sqlite")
        run.writer.start()
        await run.steps(0, range(0, 100))
        periodic = asyncio.ensure_future(run.checkpointer.run(0.01))

        async def first_written() -> None:
            while not run.checkpointer.written:
                await asyncio.sleep(0.01)

        await asyncio.wait_for(first_written(), 30)
        await asyncio.sleep(0.2)  # twenty intervals: no second checkpoint in them
        periodic.cancel()
        await run.writer.close()
        return run.checkpointer

    checkpointer = asyncio.run(feed())
    assert checkpointer.written == 1
    assert checkpointer.next_in_s == 100.0


def test_a_store_without_the_checkpoint_table_opens_and_replays(tmp_path):
    """A store an older TraceML wrote has no ``live_checkpoint`` table, nor the ranks' rows',
    their series' and windows' tables: they are added on open, the checkpoint is empty, and
    seeding replays every step."""
    path = tmp_path / "telemetry.sqlite"

    async def feed() -> None:
        run = _Run(path)
        run.writer.start()
        await run.steps(0, range(0, 100))
        await run.writer.close()

    asyncio.run(feed())
    db = sqlite3.connect(path)
    db.execute("DROP TABLE live_checkpoint")
    db.execute("DROP TABLE live_checkpoint_ranks")
    db.execute("DROP TABLE live_checkpoint_series")
    db.execute("DROP TABLE live_checkpoint_window")
    db.commit()
    db.close()
    store = Store(path)
    assert ckpt.read(store) == ckpt.Checkpoint() and ckpt.read_ranks(store) == {}
    assert _seeded(store, ckpt.read(store)).ranks[0].steps_stored == 100
    store.close()


#: A checkpoint written by ee76ee0's code, before issue 22.4's renames (the pickle names
#: ``traceml_aggregator.aggregates``, ``traceml_aggregator.checkpoint`` and
#: ``traceml.analysis.digest``), of layout 1 (the ranks' states in the one row): run "r",
#: rank 0's 1,100 steps and rank 1's 60 (0, 1, ...), 50 a batch, written by
#: :class:`~traceml_aggregator.checkpoint.Checkpointer` after them.
OLD_CHECKPOINT = Path(__file__).parent / "data" / "checkpoint_ee76ee0.pickle"


def test_a_checkpoint_of_an_earlier_layout_loads_and_seeds_as_a_full_replay(tmp_path):
    """Existing stores hold checkpoints naming the modules of their day: one written by
    ee76ee0's code still loads (its ranks' states too, which name the classes a rank's row
    names now), and, being of layout 1, is not read: seeding replays every step."""
    path = tmp_path / "telemetry.sqlite"

    async def feed() -> None:  # the steps the old checkpoint was written after
        store = Store(path)
        writer = Writer(store, LiveAggregates("r", 2).on_batch)
        writer.start()
        for rank, steps in ((0, 1100), (1, 60)):
            for seq, first in enumerate(range(0, steps, 50), 1):
                last = min(first + 50, steps)
                await writer.queue_batch(rank_batch(seq, range(first, last), rank=rank))
        await writer.close()

    asyncio.run(feed())
    old = ckpt.loads(OLD_CHECKPOINT.read_bytes())
    assert (old.steps_from, sorted(old.ranks)) == (1160, [0, 1])
    # each rank's state: (restart, StepState, steps_stored, ...); seeding would replay the
    # store, not fail, if it could not be read, so it is read here
    parts = [ckpt.loads(old.ranks[r][1]) for r in (0, 1)]
    assert [(type(p[1]).__name__, p[2]) for p in parts] == [("StepState", 1100), ("StepState", 60)]
    store = Store(path)
    store.write_live_checkpoint(OLD_CHECKPOINT.read_bytes(), 0)
    assert old.version == 1 and ckpt.read(store) == ckpt.Checkpoint()
    restarted, replayed = _seeded(store, ckpt.read(store)), _seeded(store)
    assert state_of(restarted) == state_of(replayed)
    assert [restarted.ranks[r].steps_stored for r in (0, 1)] == [1100, 60]
    store.close()


#: The functions (not classes) a checkpoint may name: the standard library's rebuilders.
_FUNCTIONS = {("array", "_array_reconstructor")}


def test_every_class_a_checkpoint_may_name_is_where_it_names_it():
    """The unpickler's allow-list names classes by module: moving one of them (a rename)
    would make every stored checkpoint unreadable, so each must still be found there."""
    for module, name in sorted(ckpt._ALLOWED):
        if module.startswith("numpy"):
            continue  # numpy's own spelling, one of the two per version
        found = getattr(importlib.import_module(module), name)
        assert isinstance(found, type) or (module, name) in _FUNCTIONS, (module, name)


def _gpu_columns(ticks: range) -> SampleColumns:
    """A node's GPU samples at ``ticks`` (unix_us = 1,000 x tick), two GPUs a tick, in the
    order :func:`~traceml_aggregator.load.sample_groups` yields them."""
    t = np.repeat(np.array(ticks, dtype=np.float64) * 1000, 2)
    return SampleColumns(
        {
            "unix_us": t,
            "nvml_index": np.tile([0.0, 1.0], len(ticks)),
            "util_percent": t % 97,
            "uuid": np.array(["GPU-0", "GPU-1"] * len(ticks), dtype=object),
        },
        frozenset({"unix_us", "nvml_index"}),
    )


@pytest.mark.parametrize("ticks", [SERIES_TICKS, 5_000])
def test_sample_series_keeps_every_sample_up_to_its_bound_then_a_uniform_sample(ticks):
    whole, chunked = SampleSeries(), SampleSeries()
    whole.fold(_gpu_columns(range(ticks)))
    for first in range(0, ticks, 37):  # as checkpoints fold what was stored since the last
        chunked.fold(_gpu_columns(range(first, min(first + 37, ticks))))
    order = GpuSample.ORDER
    kept = whole.samples(order)
    assert _plain(dict(chunked.samples(order).columns)) == _plain(dict(kept.columns))
    if ticks <= SERIES_TICKS:  # every sample: what a full read gives
        assert _plain(dict(kept.columns)) == _plain(dict(_gpu_columns(range(ticks)).columns))
        assert kept.ints == frozenset({"unix_us", "nvml_index"})
    else:  # every 16th tick (5,000 / 8 > 512 >= 5,000 / 16), both GPUs of each
        assert whole.level == 4 and whole.ticks == 5_000
        assert kept.column("unix_us").tolist() == [
            1000.0 * t for t in range(0, 5_000, 16) for _ in range(2)
        ]
        assert kept.column("nvml_index").tolist() == [0.0, 1.0] * 313


def test_finalization_reads_no_sample_row_its_checkpoint_covers(tmp_path):
    """The final summary's samples come from the checkpoint's series plus the rows stored
    after it: the same summary as a full read of every sample row, and the same again once
    the rows the checkpoint covers are gone from the store."""
    path = tmp_path / "telemetry.sqlite"

    async def feed() -> None:
        run = _Run(path)
        run.writer.start()
        for i in range(3):
            await run.node_samples(i + 1, 5_000 * i)
        for r in range(RANKS):
            await run.steps(r, range(0, 400))
        await run.checkpointer.write()
        for r in range(RANKS):  # after the checkpoint: read from the store
            await run.steps(r, range(400, 500))
        await run.node_samples(4, 20_000)
        await run.writer.close()

    asyncio.run(feed())

    def summary(samples: bool) -> dict:
        store = Store(path)
        live = LiveAggregates(RUN, RANKS)
        checkpoint = live.seed(store, ckpt.read(store))
        steps = live.final_steps()
        out = tmp_path / f"out{samples}"
        out.mkdir(exist_ok=True)
        write_reports(
            store, out, [], html=False, steps=steps, samples=checkpoint if samples else None
        )
        store.close()
        doc = json.loads((out / "final_summary.json").read_text())
        doc.pop("generated_unix_s")
        return doc

    full = summary(samples=False)
    assert full["nodes"][0]["system"]["samples"] == 4
    assert summary(samples=True) == full
    store = Store(path)
    read = ckpt.read(store)  # the checkpoint with its series (not an empty one: a replay)
    assert sorted(read.series["process_samples"]) == [(r, 0) for r in range(RANKS)] + [
        (RANKS + 1, 0)
    ]
    marks = {t: mark for t, (mark, _) in read.windows.items()}
    store.close()
    with contextlib.closing(sqlite3.connect(path)) as db:
        for table, mark in marks.items():
            assert db.execute(f"DELETE FROM {table} WHERE rowid <= ?", (mark,)).rowcount > 0
        db.commit()
    assert summary(samples=True) == full


def test_a_ranks_row_holds_its_digest_in_plain_bytes_and_reads_back_equal():
    """A rank's checkpoint row pickles its digest's sketches as bytes, not NumPy arrays (an
    array cost ~2 µs to pickle, ~20 a rank, most empty: 80 % of a row's pickling): the row
    names no NumPy global, and reads back to the same figures and sketches."""
    live = LiveAggregates(RUN, 8000)  # 8,000 ranks: a series short enough to sample
    for seq, first in enumerate(range(0, 1024, 64), 1):
        live.on_batch(rank_batch(seq, range(first, first + 64), run_name=RUN))
    steps = live.ranks[0].steps
    assert (steps.series_level, steps.digest.stored) == (3, 1024)
    row = pickle.dumps(live.ranks[0].steps_part(), 5)
    assert b"numpy" not in row
    again = ckpt.loads(row)[1]
    assert again.digest.figures("cpu") == steps.digest.figures("cpu")
    sketch, read = steps.digest.in_step, again.digest.in_step
    assert (read.zeros, read.offset, read.counts.tolist()) == (
        sketch.zeros,
        sketch.offset,
        sketch.counts.tolist(),
    )
    assert read.counts.flags.writeable and read.counts.dtype == np.int64
