"""The store's retention policy: which raw step and sample rows stay once the live aggregates
hold them.

What the summary and the live views read is not the ``steps`` table but the live aggregates
(:mod:`traceml_aggregator.aggregates`: per rank its window, its series at the report's
resolution, its :class:`~traceml.analysis.digest.RankDigest` of exact counts, sums and maxima
and quantile sketches), checkpointed in the store (:mod:`traceml_aggregator.checkpoint`). So a
raw row is needed only until a committed checkpoint covers it, and after that only as
evidence a person may want to read back. Past that point the :class:`Pruner` keeps, of each
rank's latest attempt (docs/storage.md; the knobs are in :mod:`traceml.settings`):

* its first ``TRACEML_STORE_FIRST_STEPS`` steps (step index below it: start-up, warm-up);
* its latest ``TRACEML_STORE_LAST_STEPS`` steps (the end, the hung step of a hang): the
  rows within that many steps of the rank's latest step when a prune runs are held back
  (in memory) and decided with the rank's next rows, so what stays is the rank's last steps
  when the run ends (or when it stopped sending), not the latest steps of every prune;
* a uniform sample: one step in ``TRACEML_STORE_SAMPLE_EVERY``, chosen by the series' hash
  of the step index (so the same indices on every rank, aligned step for step), and every step
  the rank's final series may still hold (the hash at the series' current level: the series
  only ever drops steps, so every step it ends with stays raw);
* a finding's evidence, at most ``TRACEML_STORE_EVIDENCE_STEPS`` per rank over the run:
  the spikes (a step at least :data:`SPIKE_FACTOR` times the rank's median step) and the
  neighbourhood (:data:`ONSET_NEIGHBOURHOOD_STEPS` either side) of an onset (the best
  two-segment split of the rank's step time, :func:`traceml.analysis.onset.change_point`,
  whose segments differ by the straggler floor: STRAGGLER_GAP_PCT and STRAGGLER_MIN_GAP_MS);
* every row of an earlier attempt, and of a rank the live aggregates do not know.

The sample tables (process, system and GPU samples: :data:`traceml.core.records.SAMPLES`) are
summarized from each group's bounded series (:mod:`traceml_aggregator.sample_series`, in the
same checkpoint), so past a committed checkpoint the :class:`SamplePruner` keeps, of each group
(a rank attempt's process samples, a node's system or GPU samples), the rows of:

* its first ``TRACEML_STORE_FIRST_SAMPLES`` sample times (distinct ``unix_us``, in time order);
* its last ``TRACEML_STORE_LAST_SAMPLES`` sample times: the latest ones a prune sees are held
  back (their rowids in memory) and decided with the group's next rows, so what stays is the
  group's last sample times when the run ends (or when it stopped sending: a dead rank, an
  earlier attempt), not the latest ones of every prune;
* every sample time its series still holds (the series only ever drops times, so every time
  it ends with stays raw);
* every row of a group the series do not know.

Crash safety: a row is deleted only at or below the mark of a checkpoint that has committed
(``steps_from`` for the steps, each sample table's own mark for its rows: every state in the
checkpoint covers the rows up to there), and never the table's highest rowid (SQLite would hand
it out again, below a later checkpoint's mark). A replacement aggregator seeds from that
checkpoint and folds only the rows above its marks, which are all there. The rowid the pruning
of a table reached is kept in ``meta`` (:data:`PRUNED_META_KEY`, :func:`sample_meta_keys`) in
the transaction of each chunk's deletes, so an aggregator killed mid-prune leaves a store
whose rows below the mark are partly pruned, which the next prune finishes. With the mark that
ends a round goes the pruner's state (:data:`STATE_META_KEY`: each rank's evidence count and
the rowids of the rows held for the next prune; for a sample table, each group's count of
sample times decided, against its first ``TRACEML_STORE_FIRST_SAMPLES``), so a restart keeps
counting from there. The rows held back as a rank's last steps or a group's last sample times
are not in that state (millions of rowids at 8,000 ranks): an aggregator killed keeps them for
good (at most the last-steps knob a rank, the last-samples knob a group, per kill; whole
sample times, as a round of the sample tables ends between two times). A clean
stop prunes once more after its last checkpoint, deciding the held rows as the ranks' and
groups' last, so the bounds (:func:`most_rows_kept`, :func:`most_sample_times_kept`)
hold at the end of the run too.

Ingest: the rows are read, and deleted, :data:`CHUNK_ROWS` at a time, each in one call on the
writer's thread (its own transaction), so a transaction of batches waits at most one chunk; the
choice of rows runs on a thread of its own. Both kinds of table are pruned by the same sweep
(:class:`_TablePrune`); only the choice of rows differs.
"""

from __future__ import annotations

import asyncio
import json
import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from traceml import settings
from traceml.analysis import thresholds as th
from traceml.analysis.onset import MAX_POINTS, change_point
from traceml.core import log
from traceml.core.records import SAMPLES, Record
from traceml_aggregator.aggregates import keep_mask
from traceml_aggregator.sample_series import SERIES_TICKS

_log = log.get("aggregator")

#: ``meta`` key: the ``steps`` rowid up to which the rows were pruned (absent: never).
PRUNED_META_KEY = "steps_pruned_upto"
#: ``meta`` key: the :meth:`Pruner.state` (evidence kept a rank, held rows) at that mark.
STATE_META_KEY = "steps_prune_state"
#: Rows read, or deleted, in one call of the writer's thread (one transaction): ~15-80 ms of it
#: (benchmarks/retention.py), as long as a transaction of batches at most.
CHUNK_ROWS = 16_384
#: Rows (by rowid) whose keep is decided at a time: bounds the memory of a prune (5 int64
#: columns: 10 MiB, and ~50 MiB of rows while read) when a large backlog is pruned at once.
ROUND_ROWS = 1 << 18
#: A step at least this many times its rank's median step is kept as a spike's evidence: a
#: spike (traceml/analysis/spikes.py) is a part exceeding its median by SPIKE_MIN_PCT of the
#: median step, so its step is about 1 + SPIKE_MIN_PCT / 100 medians; half that excess
#: leaves room for the other parts being short that step.
SPIKE_FACTOR = 1.0 + th.SPIKE_MIN_PCT / 100.0 / 2.0
#: Steps kept either side of an onset.
ONSET_NEIGHBOURHOOD_STEPS = 4 * th.ONSET_MIN_STEPS
#: Rows of each rank held back from one prune to the next, so that an onset near the end of
#: a prune's range is seen with the rows after it (a few per rank stay when an aggregator
#: stops).
HELD_STEPS = 4 * ONSET_NEIGHBOURHOOD_STEPS


@dataclass(frozen=True)
class Policy:
    """The retention knobs (see the module docstring), steps."""

    first_steps: int = settings.STORE_FIRST_STEPS.value
    last_steps: int = settings.STORE_LAST_STEPS.value
    sample_every: int = settings.STORE_SAMPLE_EVERY.value
    evidence_steps: int = settings.STORE_EVIDENCE_STEPS.value
    #: Sample times of each sample group kept from its start, and at its end.
    first_samples: int = settings.STORE_FIRST_SAMPLES.value
    last_samples: int = settings.STORE_LAST_SAMPLES.value

    @classmethod
    def from_settings(cls) -> Policy:
        """The policy of the ``TRACEML_STORE_*`` variables (a bad one: its default, said)."""
        return cls(
            settings.read(settings.STORE_FIRST_STEPS),
            settings.read(settings.STORE_LAST_STEPS),
            settings.read(settings.STORE_SAMPLE_EVERY),
            settings.read(settings.STORE_EVIDENCE_STEPS),
            settings.read(settings.STORE_FIRST_SAMPLES),
            settings.read(settings.STORE_LAST_SAMPLES),
        )


@dataclass(frozen=True)
class RankPlan:
    """What the live aggregates know of one rank, for its rows' keep: its latest attempt, its
    highest step index, its series' sampling level, its median step (µs; None: unknown)."""

    restart: int
    last_step: int
    series_level: int
    median_step_us: float | None


def most_rows_kept(policy: Policy, run_steps: int, series_bound: int) -> int:
    """Most raw rows the policy keeps of one rank attempt of ``run_steps`` steps whose series
    holds at most ``series_bound`` steps (:func:`traceml_aggregator.aggregates.series_steps`):
    its first and last steps, its sample, its evidence cap, the rows held for the next prune,
    and the steps its series held when each prune ran: all of them while the series is at
    level 0 (``series_bound``), then about half the bound for each level it goes through (the
    steps stored while it is at level L, ``series_bound x 2**(L-1)``, of which one in 2**L),
    one level more for the hash's spread. Used to size the defaults (docs/storage.md)."""
    levels = max(0, math.ceil(math.log2(max(1, run_steps) / series_bound)))
    return (
        policy.first_steps
        + policy.last_steps
        + run_steps // policy.sample_every
        + policy.evidence_steps
        + series_bound
        + (levels + 1) * series_bound // 2
        + HELD_STEPS
    )


def most_sample_times_kept(policy: Policy, ticks: int) -> int:
    """Most sample times the policy keeps of one sample group of ``ticks`` sample times (its
    rows: that times the rows a time, 1 for process and system samples, the node's GPUs for
    GPU samples; the table's highest row is kept besides): its first and last times, and the
    times its series held when each prune ran: all of them while the series is at level 0
    (:data:`~traceml_aggregator.sample_series.SERIES_TICKS`), then half that bound for each
    level it goes through (the times folded while it is at level L, ``SERIES_TICKS x
    2**(L-1)``, of which one in 2**L), one level more for the folds' spread. Used to size the
    defaults (docs/storage.md)."""
    levels = max(0, math.ceil(math.log2(max(1, ticks) / SERIES_TICKS)))
    return (
        policy.first_samples + policy.last_samples + SERIES_TICKS + (levels + 1) * SERIES_TICKS // 2
    )


def sample_meta_keys(table: str) -> tuple[str, str]:
    """The ``meta`` keys of a sample table's prune: the rowid up to which its rows were pruned,
    and the :meth:`SamplePruner.state` at that mark."""
    return f"{table}_pruned_upto", f"{table}_prune_state"


def sampled(steps: np.ndarray, every: int) -> np.ndarray:
    """Which of ``steps`` (int64 step indices) the uniform sample keeps: one in ``every``,
    by the series' hash of the index (:func:`traceml_aggregator.aggregates.keep_mask`;
    ``every`` a power of two: exactly its level)."""
    if every <= 1:
        return np.ones(len(steps), dtype=bool)
    level = every.bit_length() - 1
    if every == 1 << level:
        return keep_mask(steps, level)
    mixed = (steps.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(32)
    return (mixed % np.uint64(every)) == 0


def evidence(steps: np.ndarray, step_us: np.ndarray, median_step_us: float | None) -> np.ndarray:
    """Which of one rank's rows (its step indices and step times, µs, in any order) are a
    finding's evidence: spikes and an onset's neighbourhood (see the module docstring)."""
    keep = np.zeros(len(steps), dtype=bool)
    if median_step_us:
        keep |= step_us >= SPIKE_FACTOR * median_step_us
    # the onset is looked for without the spikes: a spike in a short range would otherwise be
    # its best split, and its neighbourhood would use up the cap before a real onset comes
    flat = np.flatnonzero(~keep)
    steps, step_us = steps[flat], step_us[flat]
    if len(steps) >= 2 * th.ONSET_MIN_STEPS:
        order = np.argsort(steps, kind="stable")
        cp = change_point(steps[order].tolist(), (step_us[order] / 1000.0).tolist())
        if cp is not None:
            gap = abs(cp["after"] - cp["before"])
            floor = max(
                th.STRAGGLER_MIN_GAP_MS,
                min(cp["before"], cp["after"]) * th.STRAGGLER_GAP_PCT / 100.0,
            )
            if gap >= floor:  # the onset is a bucket's first step: its bucket is near too
                ordered = steps[order]
                bucket = math.ceil(len(steps) / MAX_POINTS) if len(steps) > MAX_POINTS else 0
                at = int(np.searchsorted(ordered, cp["onset_step"]))
                lo = ordered[max(0, at - bucket)] - ONSET_NEIGHBOURHOOD_STEPS
                hi = ordered[min(len(steps) - 1, at + bucket)] + ONSET_NEIGHBOURHOOD_STEPS
                keep[flat] |= (steps >= lo) & (steps <= hi)
    return keep


class _TablePrune:
    """The sweep of one table's rows that both pruners share (see the module docstring: the
    marks, the chunks, the state kept with each round's mark); a subclass chooses the rows.

    Args:
        store: the run's store (its ``meta`` read here once, before the writer starts).
        table: the table pruned.
        columns: the columns the choice reads besides ``rowid`` (INTEGER columns).
        mark_key, state_key: the ``meta`` keys of the prune's mark and state.
    """

    def __init__(
        self, store, table: str, columns: tuple[str, ...], mark_key: str, state_key: str
    ) -> None:
        self.table, self.columns = table, columns
        self.mark_key, self.state_key = mark_key, state_key
        meta = store.meta()
        #: The rowid up to which the rows were pruned.
        self.done_upto = int(meta.get(mark_key) or 0)
        #: The state stored with that mark (JSON; {} when none).
        self.stored_state: dict = json.loads(meta.get(state_key) or "{}")
        #: Rows deleted by this aggregator.
        self.deleted = 0

    def state(self) -> str:
        """The pruner's state a restart needs, as JSON (stored with each round's mark)."""
        raise NotImplementedError

    def _saved(self):
        """A copy of what a round changes (taken back with :meth:`_restore` when it fails)."""
        raise NotImplementedError

    def _restore(self, saved) -> None:
        raise NotImplementedError

    async def _sweep(
        self, writer, upto: int, choose: Callable[[dict[str, np.ndarray], bool], np.ndarray]
    ) -> int:
        """Delete the rows above :attr:`done_upto` and at or below ``upto`` (a committed
        checkpoint's mark; never the table's highest rowid) that ``choose(rows, last_round)``
        lets go (``rows``: int64 columns ``rowid`` and :attr:`columns`, in rowid order, at
        most :data:`ROUND_ROWS` of them, less the trailing ones :meth:`_whole` leaves to the
        next round; ``last_round``: the round reaches the mark), :data:`CHUNK_ROWS` a
        transaction on ``writer``'s thread; returns how many were deleted.

        Raises:
            sqlite3.Error: the store failed (what was deleted stays deleted, and is recorded).
        """
        deleted = 0
        top = min(upto, await writer.call(writer.store.max_rowid, self.table) - 1)
        backlog = top - self.done_upto > ROUND_ROWS  # a store kept whole so far
        if backlog:
            _log.info(f"retention: pruning a backlog of {top - self.done_upto} {self.table} rows")
        while self.done_upto < top:
            hi = min(top, self.done_upto + ROUND_ROWS)
            last_round = hi == top
            rows = await self._read(writer, self.done_upto, hi)
            if hi < upto:  # not a checkpoint's mark, where a batch ended: cut at a whole unit
                rows = self._whole(rows)
                if len(rows["rowid"]):
                    hi = int(rows["rowid"][-1])
            before = self._saved()
            try:
                drop = (await asyncio.to_thread(choose, rows, last_round)).tolist()
                for start in range(0, max(1, len(drop)), CHUNK_ROWS):
                    chunk = drop[start : start + CHUNK_ROWS]
                    meta = {self.mark_key: str(self.done_upto)}
                    if start + CHUNK_ROWS >= len(drop):  # the round's mark and state with it
                        meta = {self.mark_key: str(hi), self.state_key: self.state()}
                    await writer.call(writer.store.delete_rows, self.table, chunk, meta)
            except BaseException:  # the round is taken up again from the state before it
                self._restore(before)
                raise
            deleted += len(drop)
            self.done_upto = hi
            if last_round:  # the rows _whole() left wait for the next prune
                break
            if backlog and hi < top:
                _log.info(f"retention: backlog pruned up to rowid {hi} of {top} ({self.table})")
        self.deleted += deleted
        return deleted

    def _whole(self, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``rows`` (a round's, read up to a rowid that may fall inside a batch's rows) without
        the trailing rows that must be decided with rows after them, which the next round
        reads: none here (a step row is decided alone)."""
        return rows

    async def _read(self, writer, lo: int, hi: int) -> dict[str, np.ndarray]:
        """The rows of the table with ``lo < rowid <= hi``, as int64 columns."""
        parts = []
        at = lo
        while at < hi:
            end = min(hi, at + CHUNK_ROWS)
            parts += await writer.call(_rows, writer.store, self.table, self.columns, at, end)
            at = end
        names = ("rowid", *self.columns)
        table = np.array(parts, dtype=np.int64).reshape(-1, len(names))
        return {name: table[:, i] for i, name in enumerate(names)}


class Pruner(_TablePrune):
    """Deletes the step rows the :class:`Policy` lets go (see the module docstring).

    Args:
        store: the run's store (read here once, before the writer starts).
        policy: what to keep.
    """

    def __init__(self, store, policy: Policy) -> None:
        super().__init__(
            store, "steps", ("rank", "restart", "step", "step_us"), PRUNED_META_KEY, STATE_META_KEY
        )
        self.policy = policy
        state = self.stored_state
        #: rank -> rows kept as evidence (bounded by the policy), over every aggregator start
        #: of the run (stored with the prune's mark).
        self.evidence_kept: dict[int, int] = {
            int(rank): n for rank, n in state.get("evidence_kept", {}).items()
        }
        #: rank -> its rows held back for its next prune (see :meth:`drop`): columns
        #: ``rowid``, ``step``, ``step_us`` and the attempt, ``restart`` (their rowids are
        #: stored with the prune's mark, and read back here after a restart).
        self.held: dict[int, dict] = {}
        #: rank -> its rows within ``last_steps`` of its latest step at the last prune, held
        #: back undecided (same columns; in memory only: an aggregator killed keeps them).
        self.pending: dict[int, dict] = {}
        held = state.get("held", [])
        for start in range(0, len(held), 500):
            part = held[start : start + 500]
            found = store.query(
                "SELECT rowid, rank, restart, step, step_us FROM steps WHERE rowid IN "
                f"({','.join('?' * len(part))}) ORDER BY rowid",
                tuple(part),
                by_name=False,
            )
            for rowid, rank, restart, step, step_us in found:
                h = self.held.setdefault(rank, {"rowid": [], "step": [], "step_us": []})
                h["restart"] = restart
                for name, value in (("rowid", rowid), ("step", step), ("step_us", step_us)):
                    h[name].append(value)
        for h in self.held.values():
            for name in ("rowid", "step", "step_us"):
                h[name] = np.array(h[name], dtype=np.int64)

    def state(self) -> str:
        """The pruner's state a restart needs (:data:`STATE_META_KEY`): the evidence kept a
        rank and the held rows' rowids, as JSON."""
        held = [int(r) for h in self.held.values() for r in h["rowid"]]
        evidence = {str(rank): n for rank, n in self.evidence_kept.items()}
        return json.dumps({"evidence_kept": evidence, "held": held}, separators=(",", ":"))

    def _saved(self):
        return dict(self.held), dict(self.pending), dict(self.evidence_kept)

    def _restore(self, saved) -> None:
        self.held, self.pending, self.evidence_kept = saved

    def drop(
        self, plans: dict[int, RankPlan], rows: dict[str, np.ndarray], final: bool = False
    ) -> np.ndarray:
        """The rowids of ``rows`` (int64 columns ``rowid``, ``rank``, ``restart``, ``step``,
        ``step_us``, one value per row, in rowid order) that the policy lets go; ``plans``:
        the ranks the live aggregates know; ``final``: the run's end.

        A rank's rows within ``last_steps`` of its latest step are held back undecided (in
        :attr:`pending`) and decided with its next rows, unless ``final`` (then they are its
        last steps, kept). Each rank's latest :data:`HELD_STEPS` rows that would go are held
        back (in :attr:`held`) and decided with the rank's next rows: an onset is found in the
        rank's rows wherever a prune's range cut them, and its neighbourhood is still there."""
        policy = self.policy
        out = []
        order = np.argsort(rows["rank"], kind="stable")
        bounds = np.flatnonzero(np.diff(rows["rank"][order])) + 1
        for part in np.split(order, bounds) if len(order) else ():
            rank = int(rows["rank"][part[0]])
            plan = plans.get(rank)
            if plan is None:
                continue  # a rank the live aggregates do not know: kept
            part = part[rows["restart"][part] == plan.restart]  # earlier attempts: kept
            mine = {name: rows[name][part] for name in ("rowid", "step", "step_us")}
            for earlier in (self.pending.pop(rank, None), self.held.pop(rank, None)):
                if earlier is not None and earlier["restart"] == plan.restart:
                    mine = {name: np.concatenate([earlier[name], mine[name]]) for name in mine}
            s = mine["step"]
            if not len(s):
                continue
            last = s > plan.last_step - policy.last_steps
            keep = (
                (s < policy.first_steps)
                | sampled(s, policy.sample_every)
                | keep_mask(s, plan.series_level)
            )
            if final:
                keep |= last
            else:
                undecided = np.flatnonzero(last & ~keep)
                if len(undecided):
                    self.pending[rank] = {name: c[undecided] for name, c in mine.items()}
                    self.pending[rank]["restart"] = plan.restart
                keep |= last
            room = policy.evidence_steps - self.evidence_kept.get(rank, 0)
            if room > 0:
                proof = evidence(s, mine["step_us"], plan.median_step_us) & ~keep
                chosen = np.flatnonzero(proof)[:room]
                keep[chosen] = True
                self.evidence_kept[rank] = self.evidence_kept.get(rank, 0) + len(chosen)
            going = np.flatnonzero(~keep)
            hold = going[np.argsort(s[going], kind="stable")[-HELD_STEPS:]]
            if len(hold):
                self.held[rank] = {name: c[hold] for name, c in mine.items()}
                self.held[rank]["restart"] = plan.restart
            out.append(np.setdiff1d(mine["rowid"][going], mine["rowid"][hold]))
        return np.concatenate(out) if out else np.zeros(0, dtype=np.int64)

    async def prune(
        self, writer, steps_from: int, plans: dict[int, RankPlan], *, final: bool = False
    ) -> int:
        """Delete the rows above :attr:`done_upto` and at or below ``steps_from`` (the mark of
        a committed checkpoint) that the policy lets go, :data:`CHUNK_ROWS` a transaction on
        ``writer``'s thread; ``final``: the run's end (the rows held as the ranks' last steps
        are decided); returns how many were deleted.

        Raises:
            sqlite3.Error: the store failed (what was deleted stays deleted, and is recorded).
        """
        return await self._sweep(
            writer, steps_from, lambda rows, last: self.drop(plans, rows, final and last)
        )


class SamplePruner(_TablePrune):
    """Deletes the rows of one sample table the :class:`Policy` lets go (see the module
    docstring).

    Args:
        store: the run's store (read here once, before the writer starts).
        record: the sample record (:data:`traceml.core.records.SAMPLES`) of the table.
        policy: what to keep.
    """

    def __init__(self, store, record: type[Record], policy: Policy) -> None:
        super().__init__(
            store, record.TABLE, (*record.GROUP, "unix_us"), *sample_meta_keys(record.TABLE)
        )
        self.record = record
        self.policy = policy
        #: group -> its sample times decided so far (at most the first-samples knob: only
        #: whether a time is among the group's first counts), stored with the prune's mark.
        self.seen: dict[tuple, int] = {
            tuple(int(v) for v in key.split(",")): n
            for key, n in self.stored_state.get("seen", {}).items()
        }
        #: group -> its rows of its latest sample times, held back undecided (see the module
        #: docstring): int64 columns ``rowid`` and ``unix_us``, in time order.
        self.held: dict[tuple, dict[str, np.ndarray]] = {}

    def _whole(self, rows: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """``rows`` without the trailing rows of the last row's sample time (its group's): the
        rows of one group's sample time are consecutive (one batch's, each system sample's
        GPUs stored together by the store's ``_batch_rows``), so a round never ends
        inside one, a time's rows are decided together, and an aggregator killed after the
        round keeps whole times. A round of a single time is kept whole."""
        if not len(rows["rowid"]):
            return rows
        same = np.ones(len(rows["rowid"]), dtype=bool)
        for name in (*self.record.GROUP, "unix_us"):
            same &= rows[name] == rows[name][-1]
        other = np.flatnonzero(~same)
        if not len(other):
            return rows
        return {name: column[: other[-1] + 1] for name, column in rows.items()}

    def state(self) -> str:
        """Each group's count of sample times decided (:attr:`seen`), as JSON."""
        seen = {",".join(map(str, key)): n for key, n in self.seen.items()}
        return json.dumps({"seen": seen}, separators=(",", ":"))

    def _saved(self):
        return dict(self.held), dict(self.seen)

    def _restore(self, saved) -> None:
        self.held, self.seen = saved

    def drop(
        self, series: dict[tuple, np.ndarray], rows: dict[str, np.ndarray], final: bool = False
    ) -> np.ndarray:
        """The rowids of ``rows`` (int64 columns ``rowid``, the record's ``GROUP`` columns and
        ``unix_us``) and of the held rows that the policy lets go; ``series``: group -> the
        ``unix_us`` of the rows its series holds (the committed checkpoint's; a group not in
        it keeps every row).

        A group's rows of its latest ``last_samples`` sample times (held ones included) are
        held back for the next call, unless ``final`` (the run's end: they are its last, and
        stay, and so do those of every held group)."""
        policy = self.policy
        # The groups in hand (those with new rows; at the end, every held one too), numbered.
        keys: list[tuple] = []
        gid = np.zeros(0, dtype=np.int64)
        if len(rows["rowid"]):
            columns = np.stack([rows[c] for c in self.record.GROUP], axis=1)
            distinct, gid = np.unique(columns, axis=0, return_inverse=True)
            gid = gid.reshape(-1).astype(np.int64)
            keys = [tuple(int(v) for v in row) for row in distinct]
        if final:
            keys += sorted(self.held.keys() - set(keys))
        if not keys:
            return np.zeros(0, dtype=np.int64)
        parts = [(gid, rows["rowid"], rows["unix_us"])]
        for g, key in enumerate(keys):
            held = self.held.pop(key, None)
            if held is not None:
                parts.append((np.full(len(held["rowid"]), g), held["rowid"], held["unix_us"]))
        gid, rowid, unix_us = (np.concatenate([p[i] for p in parts]) for i in range(3))
        by = np.lexsort((rowid, unix_us, gid))  # each group's rows in time order, together
        gid, rowid, unix_us = gid[by], rowid[by], unix_us[by]
        # Each row's sample time among its group's rows in hand (tick), and the group's count.
        starts = np.r_[True, gid[1:] != gid[:-1]]
        time_id = np.cumsum(np.r_[True, starts[1:] | (unix_us[1:] != unix_us[:-1])]) - 1
        tick = time_id - np.maximum.accumulate(np.where(starts, time_id, 0))
        ends = np.r_[starts[1:], True]
        times = np.zeros(len(keys), dtype=np.int64)
        times[gid[ends]] = tick[ends] + 1
        seen = np.array([self.seen.get(key, 0) for key in keys], dtype=np.int64)
        last = tick >= times[gid] - policy.last_samples
        keep = (seen[gid] + tick < policy.first_samples) | last
        # The times each group's series holds, as (group, time) pairs packed in an int64 (the
        # group above the time's offset in the span of the rows in hand): one isin, exact.
        lo, hi = int(unix_us.min()), int(unix_us.max())
        shift = (hi - lo).bit_length()
        known = np.zeros(len(keys), dtype=bool)
        pairs = []
        for g, key in enumerate(keys):
            kept = series.get(key)
            if kept is not None:
                known[g] = True
                kept = kept[(kept >= lo) & (kept <= hi)].astype(np.int64)  # others match none
                pairs.append((g << shift) + (kept - lo))
        keep |= ~known[gid]
        if shift + len(keys).bit_length() > 62:  # rows in hand years apart: all kept
            keep[:] = True
        elif pairs:
            keep |= np.isin((gid << shift) + (unix_us - lo), np.concatenate(pairs))
        held_at = np.flatnonzero(last) if not final else np.zeros(0, dtype=np.int64)
        if len(held_at):  # the latest times wait for the group's next rows
            firsts = np.flatnonzero(np.r_[True, gid[held_at][1:] != gid[held_at][:-1]])
            for lo, hi in zip(firsts, [*firsts[1:], len(held_at)], strict=True):
                at = held_at[lo:hi]
                self.held[keys[int(gid[at[0]])]] = {"rowid": rowid[at], "unix_us": unix_us[at]}
        if policy.first_samples:
            decided = times if final else np.maximum(0, times - policy.last_samples)
            for key, n in zip(keys, np.minimum(policy.first_samples, seen + decided), strict=True):
                self.seen[key] = int(n)
        return rowid[~keep]

    async def prune(
        self, writer, upto: int, series: dict[tuple, np.ndarray], final: bool = False
    ) -> int:
        """Delete the rows above :attr:`done_upto` and at or below ``upto`` (the table's mark
        in a committed checkpoint, whose series are ``series``: see :meth:`drop`) that the
        policy lets go, :data:`CHUNK_ROWS` a transaction on ``writer``'s thread; ``final``:
        the run's end (the held rows of the groups' last sample times are decided, and
        stay); returns how many were deleted.

        Raises:
            sqlite3.Error: the store failed (what was deleted stays deleted, and is recorded).
        """
        return await self._sweep(
            writer, upto, lambda rows, last: self.drop(series, rows, final and last)
        )


def _rows(store, table: str, columns: tuple[str, ...], lo: int, hi: int) -> list[tuple]:
    """``(rowid, *columns)`` of ``table``'s rows with ``lo < rowid <= hi`` (on the writer's
    thread: a range of the table's b-tree)."""
    return store.query(
        f"SELECT rowid, {', '.join(columns)} FROM {table} WHERE rowid > ? AND rowid <= ?",
        (lo, hi),
        by_name=False,
    )


def plans(live) -> dict[int, RankPlan]:
    """Each rank's :class:`RankPlan` from the live aggregates (their ``ranks``: rank ->
    RankLive), on the event loop: O(ranks)."""
    out = {}
    for rank, rl in live.ranks.items():
        state = rl.steps
        if state.last is None:
            continue
        median = state.digest.in_step.percentile(50)
        out[rank] = RankPlan(rl.restart, int(state.last["step"]), state.series_level, median)
    return out


class Retention:
    """The store's retention: the steps' :class:`Pruner` and a :class:`SamplePruner` for each
    sample table, pruning up to the marks of the latest committed checkpoint.

    Args:
        store: the run's store (read here once, before the writer starts).
        policy: what to keep.
    """

    def __init__(self, store, policy: Policy) -> None:
        self.steps = Pruner(store, policy)
        self.samples = [SamplePruner(store, record, policy) for record in SAMPLES]

    async def prune(self, checkpointer, live, *, final: bool = False) -> int:
        """Prune every table up to the marks of ``checkpointer``'s latest committed
        checkpoint (:attr:`~traceml_aggregator.checkpoint.Checkpointer.committed_from` and
        :attr:`~traceml_aggregator.checkpoint.Checkpointer.committed_samples`), the steps
        by ``live``'s plans (:func:`plans`); ``final``: the run's end (a clean stop); returns
        the rows deleted.

        Raises:
            sqlite3.Error: the store failed (the tables pruned so far stay pruned).
        """
        writer = checkpointer.writer
        mark = checkpointer.committed_from
        deleted = await self.steps.prune(writer, mark, plans(live), final=final)
        if deleted and self.steps.deleted == deleted:
            _log.info(f"retention: pruned {deleted} step rows up to rowid {mark}")
        for pruner in self.samples:
            upto, series = checkpointer.committed_samples.get(pruner.table, (0, {}))
            gone = await pruner.prune(writer, upto, series, final=final)
            if gone and pruner.deleted == gone:
                _log.info(f"retention: pruned {gone} {pruner.table} rows up to rowid {upto}")
            deleted += gone
        return deleted


async def run(retention: Retention, checkpointer, live, interval_s: float) -> None:
    """Every ``interval_s`` s, after a new checkpoint committed, prune up to its marks
    (:meth:`Retention.prune`); a failed prune is said and taken up again at the next one
    (nothing the summary reads is lost)."""
    pruned_at = 0  # checkpoints written when the last prune succeeded
    while True:
        await asyncio.sleep(interval_s)
        written = checkpointer.written
        if written <= pruned_at:
            continue
        try:
            await retention.prune(checkpointer, live)
            pruned_at = written
        except Exception as exc:
            _log.warning(f"retention: cannot prune the stored rows: {exc}")
