"""The live analysis process: a mirror of the live windows, kept from deltas, the analysis and
the dashboard's snapshots.

:class:`~traceml_aggregator.live.LiveAggregates` keeps the windows on the aggregator's event
loop; the analysis (:func:`~traceml.analysis.summary.build_summary`, O(ranks x steps)) and the
dashboard's :class:`~traceml_aggregator.dashboard.frames.Snapshot` are built in a process of its
own, so neither holds the GIL of the process that stores batches and sends acknowledgements.
Each call ships that process only what changed since the previous one (:class:`LiveDelta`: per
rank its new steps, at most those the analysis covers; new process, system and GPU samples; the
small per-rank records that changed), so it costs the event loop O(the data that arrived since
the last call), not O(ranks x window). The process keeps a :class:`Mirror` of the windows from
those deltas and builds the :class:`RunData` there. The analysis covers each rank's latest
:func:`analysis_steps` steps, so that its cost stays bounded as the world grows.

The first delta after the process (re)starts is a whole one (``full``): the mirror starts
afresh from it. The mirror and ``LiveAggregates.run_data()`` build their RunData with the same
:func:`windows_run_data`.

The process runs at the lowest CPU priority (:data:`NICE`): on a saturated node the scheduler
gives it the CPU that training and the aggregator's ingest leave, so the live verdict comes later
rather than taking CPU from them. At 256 ranks on the saturated 2-core test machine a query
waits 4-8 s at nice 19 as at nice 10 (a computation then cost ~0.4 s of CPU: see
:data:`ANALYSIS_POINTS`), while nice 10 still took about a tenth of a core's share.
"""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import operator
import os
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from itertools import repeat
from typing import Any

from traceml.analysis.rundata import RankData, RunData, run_data
from traceml.analysis.summary import build_summary
from traceml.core import records
from traceml.core.phases import STEP_FIELDS
from traceml.core.records import step_group_columns
from traceml.wire import StepColumns
from traceml_aggregator import load
from traceml_aggregator.aggregates import in_step_order, last
from traceml_aggregator.dashboard.frames import Snapshot
from traceml_aggregator.metrics import exposition

#: Most recent steps kept per rank (the live views' window before alignment and warm-up).
WINDOW_STEPS = 512
#: Steps (ranks x steps per rank) the live analysis covers at most, so that it stays cheap as
#: the world grows: ``build_summary`` costs about 0.9 ms a rank plus a few µs a step here (256
#: ranks: 1.5 s of CPU over 512 steps each, 0.48 s over 128, 0.29 s over 64). At 256 ranks and
#: 128 steps each, 4 viewers still cost the 2-core test machine's ingest 3-7 %; at 64, none
#: measurable (``benchmarks/ingest.py --viewers 0 4``). See :func:`analysis_steps`.
ANALYSIS_POINTS = 16_384
#: Fewest steps per rank the live analysis covers, however large the world.
ANALYSIS_MIN_STEPS = 32
#: Most recent process samples per rank, and system samples per node, kept.
WINDOW_SAMPLES = 256
#: GPU samples kept per node (8 GPUs' worth of system samples).
WINDOW_GPU_SAMPLES = WINDOW_SAMPLES * 8
#: The analysis process's nice value (Linux CFS weight 15 against 1,024 at nice 0).
NICE = 19
#: How often the analysis process checks that the aggregator still lives, s.
PARENT_CHECK_S = 0.5


class Tail(deque):
    """A bounded deque that counts what was ever appended, so that a reader can ask for what
    came after its last look (:meth:`since`) in O(the new items)."""

    def __init__(self, items=(), maxlen: int = WINDOW_SAMPLES) -> None:
        super().__init__((), maxlen)
        self.appended = 0
        self.extend(items)

    def append(self, item) -> None:
        super().append(item)
        self.appended += 1

    def extend(self, items) -> None:
        items = list(items)
        super().extend(items)
        self.appended += len(items)

    def since(self, mark: int) -> list:
        """The items appended after the count was ``mark`` (those still held), oldest first."""
        return last(self, self.appended - mark)


@dataclass
class RankDelta:
    """What changed of one rank since the analysis process last heard of it.

    Attributes:
        restart: the rank's attempt.
        reset: the mirror drops the rank's window first (a new attempt, a whole delta, or
            more new steps than the analysis covers).
        steps: on a reset, the window's latest steps (at most as many as the analysis
            covers), oldest first: step field -> tuple, the fields the attempt measured only
            (:attr:`~traceml_aggregator.aggregates.StepState.measured`; the mirror fills the
            others with None); else empty.
        groups: else the step groups that arrived since the last delta, in arrival order, as
            the wire sent them (serialized StepColumns).
        process_samples: the new process samples, oldest first.
        identity, finish, flops, earlier_attempts: the rank's current records (small).
        steps_stored: steps of the attempt stored so far (all of them, not only the window).
        last_step_unix_s: wall clock at the end of the attempt's latest step, s (None before).
        counts: the attempt's latest running totals (the wire's SenderCounts), None before.
    """

    restart: int
    reset: bool
    steps: dict[str, tuple]
    groups: list[bytes]
    process_samples: list[dict]
    identity: records.Identity | None
    finish: records.Finish | None
    flops: records.Flops | None
    earlier_attempts: dict[int, int]
    steps_stored: int = 0
    last_step_unix_s: float | None = None
    counts: records.SenderCounts | None = None

    def step_columns(self) -> dict[str, list]:
        """The steps this delta carries (``steps``, then ``groups``), in arrival order: step
        field -> one value per step, ``step`` and every field any of them measured (None at
        a step that did not)."""
        parts = [self.steps] + [
            dict(zip(*step_group_columns(StepColumns.FromString(g)), strict=True))
            for g in self.groups
        ]
        names = [n for n in STEP_FIELDS if n == "step" or any(n in part for part in parts)]
        columns: dict[str, list] = {name: [] for name in names}
        for part in parts:
            _extend(columns, part)
        return columns


@dataclass
class LiveDelta:
    """What changed of the run since the analysis process last heard of it (see the module
    docstring); ``full`` when it is the whole run (the mirror starts afresh)."""

    full: bool
    run_name: str
    world_size: int | None
    #: Each rank's latest steps the analysis covers (:func:`analysis_steps`); a rank's
    #: ``steps`` hold at most that many.
    analysis_steps: int = WINDOW_STEPS
    ranks: dict[int, RankDelta] = field(default_factory=dict)
    system_samples: dict[int, list[dict]] = field(default_factory=dict)
    gpu_samples: dict[int, list[dict]] = field(default_factory=dict)
    node_exits: dict[int, records.NodeExit] = field(default_factory=dict)
    rank_ends: dict[int, records.RankEnd] = field(default_factory=dict)
    #: The run's own records, whole (each is O(events), not O(ranks x steps)): RunData field
    #: (those of :data:`traceml_aggregator.load.META_RECORDS`) -> its decoded JSON entry.
    run_records: dict = field(default_factory=dict)


@dataclass
class _MirrorRank:
    restart: int = 0
    window: dict[str, deque] = field(default_factory=lambda: _window())
    process_samples: deque = field(default_factory=lambda: deque(maxlen=WINDOW_SAMPLES))
    identity: records.Identity | None = None
    finish: records.Finish | None = None
    flops: records.Flops | None = None
    earlier_attempts: dict[int, int] = field(default_factory=dict)
    steps_stored: int = 0
    last_step_unix_s: float | None = None
    counts: records.SenderCounts | None = None

    def latest(self, count: int) -> dict[str, list]:
        """The window's last ``count`` steps (all when fewer), oldest first, as one list per
        step field (None where not measured)."""
        return {name: last(column, count) for name, column in self.window.items()}


def analysis_steps(world_size: int) -> int:
    """Steps per rank the live analysis covers (each rank's latest ones) in a world of
    ``world_size`` ranks: :data:`ANALYSIS_POINTS` shared among the ranks, between
    :data:`ANALYSIS_MIN_STEPS` and :data:`WINDOW_STEPS` (the whole window up to 32 ranks, 64
    steps at 256 ranks, 32 from 512 ranks on)."""
    return max(ANALYSIS_MIN_STEPS, min(WINDOW_STEPS, ANALYSIS_POINTS // max(1, world_size)))


def _window() -> dict[str, deque]:
    return {name: deque(maxlen=WINDOW_STEPS) for name in STEP_FIELDS}


def _extend(columns: Mapping[str, Any], steps: Mapping[str, Any]) -> None:
    """Append ``steps`` (step field -> one value per step) to ``columns`` (step field ->
    a deque or list); a field they lack (one the rank never measured) gets None at each."""
    count = len(steps.get("step", ()))
    for name, column in columns.items():
        column.extend(steps.get(name) or repeat(None, count))


class Mirror:
    """The live windows as the analysis process knows them, kept from :class:`LiveDelta`\\ s."""

    def __init__(self) -> None:
        self._reset()

    def _reset(self) -> None:
        self.run_name = ""
        self.world_size: int | None = None
        self.analysis_steps = WINDOW_STEPS
        self.ranks: dict[int, _MirrorRank] = {}
        self.system_samples: dict[int, deque] = {}
        self.gpu_samples: dict[int, deque] = {}
        self.node_exits: dict[int, records.NodeExit] = {}
        self.rank_ends: dict[int, records.RankEnd] = {}
        self.run_records: dict = {}

    def apply(self, delta: LiveDelta) -> Mirror:
        """Fold ``delta`` in (a whole one replaces everything); returns this mirror."""
        if delta.full:
            self._reset()
        self.run_name, self.world_size = delta.run_name, delta.world_size
        self.analysis_steps = delta.analysis_steps
        for r, d in delta.ranks.items():
            mr = self.ranks.setdefault(r, _MirrorRank())
            if d.reset:
                mr.window = _window()
            _extend(mr.window, d.step_columns())
            mr.process_samples.extend(d.process_samples)
            mr.restart, mr.identity, mr.finish = d.restart, d.identity, d.finish
            mr.flops, mr.earlier_attempts = d.flops, d.earlier_attempts
            mr.steps_stored, mr.last_step_unix_s, mr.counts = (
                d.steps_stored,
                d.last_step_unix_s,
                d.counts,
            )
        for n, rows in delta.system_samples.items():
            self.system_samples.setdefault(n, deque(maxlen=WINDOW_SAMPLES)).extend(rows)
        for n, rows in delta.gpu_samples.items():
            self.gpu_samples.setdefault(n, deque(maxlen=WINDOW_GPU_SAMPLES)).extend(rows)
        self.node_exits.update(delta.node_exits)
        self.rank_ends.update(delta.rank_ends)
        self.run_records = delta.run_records
        return self

    def run_data(self, steps: int | None = None) -> RunData:
        """The windows as a RunData (:func:`windows_run_data`): each rank's latest ``steps``
        steps, by default those the live analysis covers (the last delta's
        ``analysis_steps``)."""
        return windows_run_data(
            self.run_name,
            self.world_size,
            self.ranks,
            self.rank_ends,
            self.node_exits,
            self.system_samples,
            self.gpu_samples,
            self.run_records,
            steps=steps or self.analysis_steps,
        )


def windows_run_data(
    run_name: str,
    world_size: int | None,
    ranks: Mapping[int, Any],
    rank_ends: Mapping[int, records.RankEnd],
    node_exits: Mapping[int, records.NodeExit],
    system_samples: Mapping[int, deque],
    gpu_samples: Mapping[int, deque],
    run_records: Mapping[str, Any],
    steps: int = WINDOW_STEPS,
) -> RunData:
    """Live windows as a RunData (copies), for the mirror and for the aggregates themselves.

    ``ranks`` maps a rank to its window: anything with ``restart``, ``identity``,
    ``latest(count)`` (its latest steps: step field -> one value per step), ``finish``,
    ``process_samples``, ``earlier_attempts`` and ``flops``.
    The ranks and the world size are :func:`~traceml.analysis.rundata.run_data`'s; a rank's
    process samples are those of its latest attempt; ``run_records`` gives RunData's fields
    of the run's own records it holds (those of :data:`traceml_aggregator.load.META_RECORDS`,
    by field name, as decoded JSON: read into their records by
    :func:`traceml_aggregator.load.run_records`); each rank's latest ``steps`` steps.
    O(ranks x steps).
    """
    out: dict[int, RankData] = {}
    for r, w in ranks.items():
        out[r] = RankData(
            r,
            restart=w.restart,
            identity=w.identity,
            steps=in_step_order(w.latest(steps)),
            finish=w.finish,
            end=rank_ends.get(r),
            process_samples=[p for p in w.process_samples if p["restart"] == w.restart],
            earlier_attempts=dict(w.earlier_attempts),
            flops=w.flops,
        )
    for r, end in rank_ends.items():
        out.setdefault(r, RankData(r, end=end))
    return run_data(
        run_name,
        world_size,
        out,
        node_exits=dict(node_exits),
        system_samples={n: sorted(s, key=_unix_us) for n, s in system_samples.items()},
        gpu_samples={n: sorted(s, key=_unix_index) for n, s in gpu_samples.items()},
        missing=[],
        **load.run_records(run_records),
    )


def spawn(parent_pid: int) -> concurrent.futures.ProcessPoolExecutor:
    """The analysis process (a one-process pool, started now), at a low CPU priority
    (:data:`NICE`) from its first instruction: the pool is made and started by a thread of its
    own that lowers its own priority first (on Linux a nice value belongs to a thread, and a
    child inherits its creator's). Its start-up, a new interpreter importing the aggregator's
    modules and the analysis (~0.6 s of CPU), would otherwise run at the aggregator's priority
    and take that CPU from ingest. Everything the pool starts comes from that thread, so it is
    at :data:`NICE` too: its threads in the aggregator (which pickle the deltas and read the
    results) and multiprocessing's resource tracker. The process exits within
    :data:`PARENT_CHECK_S` once the aggregator ``parent_pid`` is gone."""

    def start() -> concurrent.futures.ProcessPoolExecutor:
        try:
            os.nice(NICE)
        except OSError:
            pass
        pool = concurrent.futures.ProcessPoolExecutor(
            1,
            mp_context=multiprocessing.get_context("spawn"),
            initializer=_watch_parent,
            initargs=(parent_pid,),
        )
        pool.submit(int)  # a pool starts its process and threads at its first call
        return pool

    with concurrent.futures.ThreadPoolExecutor(1, "traceml-live-spawn") as niced:
        return niced.submit(start).result()


# --- in the analysis process ---------------------------------------------------------------------
_mirror = Mirror()


def _watch_parent(parent_pid: int) -> None:
    """Initializer of the analysis process: exit within :data:`PARENT_CHECK_S` once the
    aggregator ``parent_pid`` is gone, however it died (SIGKILL included): a worker waiting for
    its next query would otherwise outlive it."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(PARENT_CHECK_S)
        os._exit(0)

    threading.Thread(target=watch, name="traceml-live-parent", daemon=True).start()


def analyse(delta: LiveDelta) -> dict:
    """Fold ``delta`` into this process's mirror; the live summary document of the windows
    (``build_summary(..., live=True)``)."""
    return build_summary(_mirror.apply(delta).run_data(), live=True)


def snapshot(delta: LiveDelta, summary: dict | None, version: int) -> Snapshot:
    """Fold ``delta`` into this process's mirror; the dashboard's snapshot of the whole
    windows (each rank's latest steps as the mirror holds them: at least those the analysis
    covers, up to :data:`WINDOW_STEPS`) with ``summary``, covering ``version``."""
    run = _mirror.apply(delta).run_data(steps=WINDOW_STEPS)
    return Snapshot(run, summary, live=True, version=version)


def metrics(delta: LiveDelta) -> bytes:
    """Fold ``delta`` into this process's mirror; the Prometheus exposition of the windows
    (:func:`traceml_aggregator.metrics.exposition`, each rank's latest steps the analysis
    covers), UTF-8 text."""
    return exposition(_mirror.apply(delta))


def fold(delta: LiveDelta) -> Mirror:
    """Fold ``delta`` into this process's mirror; the mirror, for what exports it from here
    (:func:`traceml_aggregator.otlp.push`)."""
    return _mirror.apply(delta)


_unix_us = operator.itemgetter("unix_us")
_unix_index = operator.itemgetter("unix_us", "nvml_index")
