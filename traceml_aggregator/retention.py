"""The store's retention policy: which raw step rows stay once the live aggregates hold them.

What the summary and the live views read is not the ``steps`` table but the live aggregates
(:mod:`traceml_aggregator.aggregates`: per rank its window, its series at the report's
resolution, its :class:`~traceml.analysis.digest.RankDigest` of exact counts, sums and maxima
and quantile sketches), checkpointed in the store (:mod:`traceml_aggregator.checkpoint`). So a
raw row is needed only until a committed checkpoint covers it, and after that only as
evidence a person may want to read back. Past that point the :class:`Pruner` keeps, of each
rank's latest attempt (docs/storage.md; the knobs are in :mod:`traceml.settings`):

* its first ``TRACEML_STORE_FIRST_STEPS`` steps (step index below it: start-up, warm-up);
* its latest ``TRACEML_STORE_LAST_STEPS`` steps (the end, the hung step of a hang);
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

Crash safety: a row is deleted only at or below the ``steps_from`` mark of a checkpoint that
has committed (every rank's state in it covers the rows up to there), and never the table's
highest rowid (SQLite would hand it out again, below a later checkpoint's mark). A replacement
aggregator seeds from that checkpoint and folds only the rows above its mark, which are all
there. The rowid the pruning reached is kept in ``meta`` (:data:`PRUNED_META_KEY`) in the
transaction of each chunk's deletes, so an aggregator killed mid-prune leaves a store whose
rows below the mark are partly pruned, which the next prune finishes. With the mark that ends
a round goes the :meth:`Pruner.state` (:data:`STATE_META_KEY`: each rank's evidence count and
the rowids of the rows held for the next prune), so a restart keeps counting against the
same cap and decides the held rows with its first prune. A clean stop prunes once more after
its last checkpoint, so the bound (:func:`most_rows_kept`) holds at the end of the run too.

Ingest: the rows are read, and deleted, :data:`CHUNK_ROWS` at a time, each in one call on the
writer's thread (its own transaction), so a transaction of batches waits at most one chunk; the
choice of rows runs on a thread of its own.
"""

from __future__ import annotations

import asyncio
import json
import math
from dataclasses import dataclass

import numpy as np

from traceml import settings
from traceml.analysis import thresholds as th
from traceml.analysis.onset import MAX_POINTS, change_point
from traceml.core import log
from traceml_aggregator.aggregates import keep_mask

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

    @classmethod
    def from_settings(cls) -> Policy:
        """The policy of the ``TRACEML_STORE_*`` variables (a bad one: its default, said)."""
        return cls(
            settings.read(settings.STORE_FIRST_STEPS),
            settings.read(settings.STORE_LAST_STEPS),
            settings.read(settings.STORE_SAMPLE_EVERY),
            settings.read(settings.STORE_EVIDENCE_STEPS),
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


class Pruner:
    """Deletes the step rows the :class:`Policy` lets go (see the module docstring).

    Args:
        store: the run's store (read here once, before the writer starts).
        policy: what to keep.
    """

    def __init__(self, store, policy: Policy) -> None:
        self.policy = policy
        meta = store.meta()
        #: The rowid up to which the rows were pruned.
        self.done_upto = int(meta.get(PRUNED_META_KEY) or 0)
        state = json.loads(meta.get(STATE_META_KEY) or "{}")
        #: rank -> rows kept as evidence (bounded by the policy), over every aggregator start
        #: of the run (stored with the prune's mark).
        self.evidence_kept: dict[int, int] = {
            int(rank): n for rank, n in state.get("evidence_kept", {}).items()
        }
        #: Rows deleted by this aggregator.
        self.deleted = 0
        #: rank -> its rows held back for its next prune (see :meth:`drop`): columns
        #: ``rowid``, ``step``, ``step_us`` and the attempt, ``restart`` (their rowids are
        #: stored with the prune's mark, and read back here after a restart).
        self.held: dict[int, dict] = {}
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

    def drop(self, plans: dict[int, RankPlan], rows: dict[str, np.ndarray]) -> np.ndarray:
        """The rowids of ``rows`` (int64 columns ``rowid``, ``rank``, ``restart``, ``step``,
        ``step_us``, one value per row, in rowid order) that the policy lets go; ``plans``:
        the ranks the live aggregates know.

        Each rank's latest :data:`HELD_STEPS` rows that would go are held back (in
        :attr:`held`) and decided with the rank's next rows: an onset is found in the rank's
        rows wherever a prune's range cut them, and its neighbourhood is still there."""
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
            held = self.held.pop(rank, None)
            mine = {name: rows[name][part] for name in ("rowid", "step", "step_us")}
            if held is not None and held["restart"] == plan.restart:
                mine = {name: np.concatenate([held[name], mine[name]]) for name in mine}
            s = mine["step"]
            if not len(s):
                continue
            keep = (
                (s < policy.first_steps)
                | (s > plan.last_step - policy.last_steps)
                | sampled(s, policy.sample_every)
                | keep_mask(s, plan.series_level)
            )
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

    async def prune(self, writer, steps_from: int, plans: dict[int, RankPlan]) -> int:
        """Delete the rows above :attr:`done_upto` and at or below ``steps_from`` (the mark of
        a committed checkpoint) that the policy lets go, :data:`CHUNK_ROWS` a transaction on
        ``writer``'s thread; returns how many were deleted.

        Raises:
            sqlite3.Error: the store failed (what was deleted stays deleted, and is recorded).
        """
        deleted = 0
        top = min(steps_from, await writer.call(writer.store.max_rowid, "steps") - 1)
        backlog = top - self.done_upto > ROUND_ROWS  # a store kept whole so far
        if backlog:
            _log.info(f"retention: pruning a backlog of {top - self.done_upto} step rows")
        while self.done_upto < top:
            hi = min(top, self.done_upto + ROUND_ROWS)
            rows = await self._read(writer, self.done_upto, hi)
            before = dict(self.held), dict(self.evidence_kept)
            try:
                drop = (await asyncio.to_thread(self.drop, plans, rows)).tolist()
                for start in range(0, max(1, len(drop)), CHUNK_ROWS):
                    chunk = drop[start : start + CHUNK_ROWS]
                    meta = {PRUNED_META_KEY: str(self.done_upto)}
                    if start + CHUNK_ROWS >= len(drop):  # the round's mark and state with it
                        meta = {PRUNED_META_KEY: str(hi), STATE_META_KEY: self.state()}
                    await writer.call(writer.store.delete_steps, chunk, meta)
            except BaseException:  # the round is taken up again from the state before it
                self.held, self.evidence_kept = before
                raise
            deleted += len(drop)
            self.done_upto = hi
            if backlog and hi < top:
                _log.info(f"retention: backlog pruned up to rowid {hi} of {top}")
        self.deleted += deleted
        return deleted

    @staticmethod
    async def _read(writer, lo: int, hi: int) -> dict[str, np.ndarray]:
        """The rows of ``steps`` with ``lo < rowid <= hi``, as int64 columns."""
        parts = []
        at = lo
        while at < hi:
            end = min(hi, at + CHUNK_ROWS)
            parts += await writer.call(_rows, writer.store, at, end)
            at = end
        table = np.array(parts, dtype=np.int64).reshape(-1, 5)
        names = ("rowid", "rank", "restart", "step", "step_us")
        return {name: table[:, i] for i, name in enumerate(names)}


def _rows(store, lo: int, hi: int) -> list[tuple]:
    """``(rowid, rank, restart, step, step_us)`` of the ``steps`` rows with ``lo < rowid <=
    hi`` (on the writer's thread: a range of the table's b-tree)."""
    return store.query(
        "SELECT rowid, rank, restart, step, step_us FROM steps WHERE rowid > ? AND rowid <= ?",
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


async def run(pruner: Pruner, checkpointer, live, interval_s: float) -> None:
    """Every ``interval_s`` s, after a new checkpoint committed, prune up to its mark
    (:attr:`~traceml_aggregator.checkpoint.Checkpointer.committed_from`); a failed prune is
    said and taken up again at the next one (nothing the summary reads is lost)."""
    pruned_from = 0
    while True:
        await asyncio.sleep(interval_s)
        mark = checkpointer.committed_from
        if mark <= pruned_from:
            continue
        try:
            deleted = await pruner.prune(checkpointer.writer, mark, plans(live))
            pruned_from = mark
            if deleted and pruner.deleted == deleted:
                _log.info(f"retention: pruned {deleted} step rows up to rowid {mark}")
        except Exception as exc:
            _log.warning(f"retention: cannot prune the step rows: {exc}")
