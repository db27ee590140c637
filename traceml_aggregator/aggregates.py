"""One rank attempt's steps, kept as batches commit, in memory that does not grow with the run.

:class:`StepState` folds each committed step group (the wire's columns) into:

* ``window``: the most recent ``window_steps`` steps, full resolution, as one deque per step
  field (what the live analysis reads);
* ``sample``: the series the final summary analyses: every step while the attempt has stored
  at most ``series_steps`` (:func:`series_steps`: 1,024 up to 128 ranks, fewer for larger
  worlds, so the whole run's series stays near :data:`SERIES_POINTS` steps); past that, a
  uniform sample of at most that many steps,
  chosen by a hash of the step index (step s is kept at level L when the low L bits of
  hash(s) are 0; when the sample outgrows its bound the level goes up and half of it is let
  go). The choice depends on the step index alone, so every rank keeps the same indices and
  the ranks still align step for step; being a hash, it does not alias with periodic work
  (a checkpoint every 100 steps is sampled like any other step). The last stored step is
  always part of the series (the rank's end);
* ``digest``: the exact counts, sums and maxima and the quantile sketches of
  :class:`traceml.analysis.digest.RankDigest`, read instead of the sample for the per-rank
  figures once the sample is one.

The digest and the sample are fed from the window's tail, :data:`FOLD_STEPS` steps at a time,
so they cost no memory of their own beyond their bounded state. A group costs one C-level
``extend`` per field; each chunk of FOLD_STEPS steps about 150 NumPy calls plus O(the steps the
sample keeps) in Python. The final summary reads at most ``series_steps`` steps per rank, whatever
the run's length.
"""

from __future__ import annotations

import copy
import operator
from collections import deque
from collections.abc import Set as AbstractSet
from itertools import islice

import numpy as np

from traceml.analysis.digest import RankDigest
from traceml.analysis.rundata import StepTable
from traceml.core.phases import STEP_FIELDS

#: Most steps a rank's final series holds at full resolution; longer attempts are sampled to
#: at most this many (see the module docstring).
SERIES_STEPS = 1024
#: Fewest steps a rank's final series holds, however large the world.
SERIES_MIN_STEPS = 128
#: Steps of all ranks' series together that the final summary's analysis is sized for (about
#: 1.7 s of analysis on one core of the 2-core test machine; 262,144 took 3.4 s).
SERIES_POINTS = 131_072


def series_steps(world_size: int) -> int:
    """A rank's series bound in a world of ``world_size`` ranks: SERIES_POINTS shared among
    the ranks, between SERIES_MIN_STEPS and SERIES_STEPS (1,024 up to 128 ranks, 128 from
    1,024 ranks on)."""
    return max(SERIES_MIN_STEPS, min(SERIES_STEPS, SERIES_POINTS // max(1, world_size)))


#: Steps folded into the digest and the sample at a time (at most the window's length): each
#: attempt's steps are folded in chunks of exactly this many, in arrival order, so the same
#: steps give the same digest however the batches cut them (the offline summary equals the
#: live one); the NumPy calls of a fold are shared by this many steps. The first chunk of a
#: rank's attempt is shorter by its ``offset`` (:class:`StepState`: the live aggregates give
#: ``rank % FOLD_STEPS``), so that ranks that step together do not all fold at the same step:
#: at 8,000 ranks that was ~4 s of the event loop at once every 512 steps, and the writer's
#: calls waiting behind it were pushed back (docs/scale.md). The digest and the sample do not
#: depend on where the chunks begin.
FOLD_STEPS = 512
_HASH = np.uint64(0x9E3779B97F4A7C15)  # Fibonacci hashing: a bijective mix of the step index
_SHIFT = np.uint64(32)
_NAN = float("nan")


def keep_mask(steps: np.ndarray, level: int) -> np.ndarray:
    """Which of ``steps`` (int64 indices) the sample keeps at ``level`` (one in 2**level; the
    store's retention keeps the same ones: :mod:`traceml_aggregator.retention`)."""
    if level == 0:
        return np.ones(len(steps), dtype=bool)
    mixed = (steps.astype(np.uint64) * _HASH) >> _SHIFT
    return (mixed & np.uint64((1 << level) - 1)) == 0


def _floats(chunk: dict[str, list]) -> dict[str, np.ndarray]:
    """The measured fields of ``chunk`` as float arrays (NaN where not measured); a field
    measured on none of its steps is left out. The common cases (a field on every step, or
    on none) take no Python code per value."""
    out = {}
    for name, values in chunk.items():
        absent = values.count(None)
        if absent == len(values):
            continue
        if absent:
            values = [_NAN if v is None else v for v in values]
        out[name] = np.fromiter(values, dtype=np.float64, count=len(values))
    return out


class _Series:
    """The digest and the sample (see the module docstring), folded a chunk at a time."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.digest = RankDigest()
        self.level = 0
        self.sample: dict[str, list] = {name: [] for name in STEP_FIELDS}

    def copy(self) -> _Series:
        """An independent copy."""
        other = copy.copy(self)
        other.digest = self.digest.copy()
        other.sample = {name: list(kept) for name, kept in self.sample.items()}
        return other

    def fold(self, chunk: dict[str, list]) -> None:
        """Fold ``chunk`` (step field -> its values, None where not measured) in."""
        self.digest.fold(_floats(chunk))
        if self.level == 0:
            for name, kept in self.sample.items():
                kept.extend(chunk[name])
        else:
            keep = keep_mask(np.array(chunk["step"], dtype=np.int64), self.level)
            picked = np.flatnonzero(keep).tolist()
            if picked:
                pick = operator.itemgetter(*picked, picked[0])  # a tuple even for one
                for name, kept in self.sample.items():
                    kept.extend(pick(chunk[name])[:-1])
        while len(self.sample["step"]) > self.bound:
            self.level += 1
            mask = keep_mask(np.array(self.sample["step"], dtype=np.int64), self.level)
            stay = np.flatnonzero(mask).tolist()
            self.sample = {name: [kept[i] for i in stay] for name, kept in self.sample.items()}


class StepState:
    """The steps of one rank attempt (see the module docstring).

    Args:
        window_steps: the live window's length (steps), at least :data:`FOLD_STEPS`.
        series_steps: the final series' bound (:func:`series_steps`).
        offset: the first chunk folded into the series is this many steps (modulo the
            chunk's length) shorter than the others (see :data:`FOLD_STEPS`).
    """

    #: The step fields any group of this attempt carried (a field never carried is None at
    #: every step of the window). A state checkpointed before it was kept reads all of them.
    measured: AbstractSet[str] = frozenset(STEP_FIELDS)

    def __init__(
        self, window_steps: int, series_steps: int = SERIES_STEPS, offset: int = 0
    ) -> None:
        self.window = {name: deque(maxlen=window_steps) for name in STEP_FIELDS}
        self.measured = set()
        self.fold_steps = min(FOLD_STEPS, window_steps)
        self.pending = 0  # steps at the window's end not folded into the series yet
        self.chunk = self.fold_steps - offset % self.fold_steps  # steps the next fold takes
        self.last: dict[str, int | None] | None = None  # the highest step stored
        self._plan: tuple | None = None  # how the latest group was folded: see _plan_of
        self._series = _Series(series_steps)

    def __getstate__(self) -> dict:
        """What a checkpoint keeps: all but the fold's plan (made again at the next fold)."""
        state = dict(self.__dict__)
        state.pop("_plan", None)
        return state

    def __setstate__(self, state: dict) -> None:
        """Restore a checkpointed state; a step field added since it was written (a new phase)
        reads as not measured at every step it holds, as a replay of those steps would."""
        self._plan = None
        self.__dict__.update(state)
        self.__dict__.setdefault("chunk", self.fold_steps)  # checkpointed before it was kept
        steps = self.window["step"]
        for name in STEP_FIELDS:
            if name not in self.window:
                self.window[name] = deque((None,) * len(steps), maxlen=steps.maxlen)
                if self.last is not None:
                    self.last[name] = None
                sample = self._series.sample
                sample[name] = [None] * len(sample["step"])

    def fold(self, names, columns) -> None:
        """Fold one step group in: ``names`` its measured fields, ``columns`` one sequence of
        ints per name (None allowed where not measured), steps in arrival order. Costs
        O(the group): one C-level ``extend`` per field, and every :data:`FOLD_STEPS` steps one
        chunk of NumPy work."""
        n = len(columns[0])
        if not n:
            return
        plan = self._plan
        if plan is None or plan[0] != names:
            plan = self._plan = self._plan_of(names)
        _, given, missing = plan
        steps = columns[given[0][1]]
        highest = max(steps)
        if self.last is None or highest >= self.last["step"]:
            top = n - 1 if steps[n - 1] == highest else list(steps).index(highest)
            last = dict.fromkeys(STEP_FIELDS)
            for name, index, _ in given:
                last[name] = columns[index][top]
            self.last = last
        start = 0
        while start < n:  # pieces that fill the pending chunk at most
            end = min(n, start + self.chunk - self.pending)
            whole = start == 0 and end == n
            for _, index, window in given:
                window.extend(columns[index] if whole else columns[index][start:end])
            nones = (None,) * (end - start)
            for window in missing:
                window.extend(nones)
            self.pending += end - start
            if self.pending == self.chunk:
                self._series.fold(self._tail(self.pending))
                self.pending, self.chunk = 0, self.fold_steps
            start = end

    def _plan_of(self, names) -> tuple:
        """How a group that measured the fields ``names`` is folded, kept in :attr:`_plan`
        while the groups measure the same fields (the common case): ``(names, ((field, its
        column's index in the group, its window) of each step field among names, "step"
        first), (the windows of the step fields not among them))``. Notes the fields in
        :attr:`measured`."""
        if not self.measured.issuperset(names):
            self.measured = {*self.measured, *names}
        index = {name: i for i, name in enumerate(names)}
        given = [(name, index[name], w) for name, w in self.window.items() if name in index]
        given.sort(key=lambda g: g[0] != "step")
        if not given or given[0][0] != "step":
            raise KeyError("step")  # a group without its steps' indices
        missing = [window for name, window in self.window.items() if name not in index]
        return names, given, missing

    def tail(self, count: int) -> dict[str, tuple]:
        """The last ``count`` window steps (all when fewer) of each field in
        :attr:`measured`, oldest first, in :data:`STEP_FIELDS` order: O(count x fields
        measured); the fields left out are None at every step."""
        return {
            name: tuple(islice(reversed(self.window[name]), count))[::-1]
            for name in STEP_FIELDS
            if name in self.measured
        }

    def _tail(self, count: int) -> dict[str, list]:
        """The last ``count`` window steps, as one list per step field."""
        size = len(self.window["step"])
        return {name: list(islice(w, size - count, size)) for name, w in self.window.items()}

    @property
    def series_level(self) -> int:
        """The series' sampling level: it holds only steps :func:`keep_mask` keeps at this
        level (0: every step), and only ever goes up."""
        return self._series.level

    @property
    def digest(self) -> RankDigest:
        """The digest of the steps folded so far (the pending ones excepted)."""
        return self._series.digest

    def final(self) -> tuple[StepTable, RankDigest | None]:
        """The final series and its digest, with the pending steps folded into copies (this
        state goes on as it was): every step and None while the attempt stored at most
        ``series_steps`` steps, else the sample plus the last step, and the digest."""
        series = self._series.copy()
        if self.pending:
            series.fold(self._tail(self.pending))
        columns = series.sample
        if self.last is not None and self.last["step"] not in set(columns["step"]):
            for name, column in columns.items():
                column.append(self.last[name])
        return in_step_order(columns), (series.digest if series.level else None)


def in_step_order(columns: dict) -> StepTable:
    """``columns`` (step field -> sequence, one value per step) sorted by step index."""
    steps = columns["step"]
    if any(a > b for a, b in zip(steps, steps[1:], strict=False)):
        order = sorted(range(len(steps)), key=steps.__getitem__)
        columns = {name: [c[i] for i in order] for name, c in columns.items()}
    return StepTable({name: tuple(c) for name, c in columns.items()})


def last(items: deque, count: int) -> list:
    """The last ``count`` of ``items`` (all of them when fewer), oldest first; O(count)."""
    if count >= len(items):
        return list(items)
    return list(islice(reversed(items), count))[::-1]
