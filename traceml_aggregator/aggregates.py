"""One rank attempt's steps, kept as batches commit, in memory that does not grow with the run.

:class:`StepState` folds each committed step group (the wire's columns) into:

* ``columns``, the window: the most recent ``window_steps`` steps, full resolution, as one
  packed column of int64 (``array('q')``) per step field the attempt measured (what the live
  analysis reads): 8 bytes a value, so at 8 fields measured ~37 KiB a rank, where one deque
  of Python ints per step field held ~220 KiB (``benchmarks/live_memory.py``);
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
``extend`` per measured field; each chunk of FOLD_STEPS steps about 150 NumPy calls plus O(the
steps the sample keeps) in Python. The final summary reads at most ``series_steps`` steps per
rank, whatever the run's length.
"""

from __future__ import annotations

import copy
import copyreg
import operator
from array import array
from collections import deque
from collections.abc import KeysView
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
#: What a window column holds at a step that did not measure its field (the store takes no
#: value below 0: :data:`traceml_aggregator.store.STORE_INT_MAX` bounds them above).
UNMEASURED = -(2**63)
#: Steps a window's columns hold beyond ``window_steps`` before their oldest are let go, all
#: at once (a move of the window every this many steps, not a shift at every group).
WINDOW_SLACK = 64
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


def _floats(chunk: dict[str, np.ndarray], missing: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The measured fields of ``chunk`` (int64 columns) as float arrays, NaN where
    ``missing`` (each field's mask of :data:`UNMEASURED` values) is set; a field measured on
    none of its steps is left out. NumPy calls only, a few per field."""
    out = {}
    for name, values in chunk.items():
        floats = values.astype(np.float64)
        absent = missing[name]
        if absent.any():
            if absent.all():
                continue
            floats[absent] = _NAN
        out[name] = floats
    return out


def _listed(values: np.ndarray, absent: np.ndarray) -> list:
    """``values`` (int64) as a list of Python ints, None where ``absent`` is set."""
    listed = values.tolist()
    if absent.any():
        for i in np.flatnonzero(absent).tolist():
            listed[i] = None
    return listed


def _pick(values: list, indices: list[int]) -> list:
    """``values`` at ``indices`` (a C-level gather: ``operator.itemgetter``)."""
    if not indices:
        return []
    return list(operator.itemgetter(*indices, indices[0])(values)[:-1])  # a tuple even for one


class _Series:
    """The digest and the sample (see the module docstring), folded a chunk at a time: a
    rank attempt's final series (:attr:`StepState.series`)."""

    def __init__(self, bound: int) -> None:
        self.bound = bound
        self.digest = RankDigest()
        self.level = 0
        self.sample: dict[str, list] = {name: [] for name in STEP_FIELDS}
        #: Chunks folded in so far: the series changes only as one is (a checkpoint writes
        #: it again only then: :mod:`traceml_aggregator.checkpoint`).
        self.folds = 0

    def __setstate__(self, state: dict) -> None:
        """Restore a checkpointed series; a step field added since it was written (a new
        phase) reads as not measured at every step it holds, as a replay would."""
        self.__dict__.update(state)
        for name in STEP_FIELDS:
            self.sample.setdefault(name, [None] * len(self.sample["step"]))

    def copy(self) -> _Series:
        """An independent copy."""
        other = copy.copy(self)
        other.digest = self.digest.copy()
        other.sample = {name: list(kept) for name, kept in self.sample.items()}
        return other

    def fold(self, chunk: dict[str, np.ndarray]) -> None:
        """Fold ``chunk`` in: step field -> int64 column, one value per step in arrival order
        (:data:`UNMEASURED` where not measured; a field absent was measured at none of them).
        NumPy calls per field, and Python objects only for the steps the sample keeps."""
        self.folds += 1
        missing = {name: values == UNMEASURED for name, values in chunk.items()}
        self.digest.fold(_floats(chunk, missing))
        steps = chunk["step"]
        keep = None if self.level == 0 else np.flatnonzero(keep_mask(steps, self.level))
        kept_steps = len(steps) if keep is None else len(keep)
        for name, kept in self.sample.items():
            values = chunk.get(name)
            if values is None:
                kept.extend([None] * kept_steps)
            elif keep is None:
                kept.extend(_listed(values, missing[name]))
            else:
                kept.extend(_listed(values[keep], missing[name][keep]))
        while len(self.sample["step"]) > self.bound:
            self.level += 1
            mask = keep_mask(np.array(self.sample["step"], dtype=np.int64), self.level)
            stay = np.flatnonzero(mask).tolist()
            self.sample = {name: _pick(kept, stay) for name, kept in self.sample.items()}


class StepState:
    """The steps of one rank attempt (see the module docstring).

    Args:
        window_steps: the live window's length (steps), at least :data:`FOLD_STEPS`.
        series_steps: the final series' bound (:func:`series_steps`).
        offset: the first chunk folded into the series is this many steps (modulo the
            chunk's length) shorter than the others (see :data:`FOLD_STEPS`).
    """

    def __init__(
        self, window_steps: int, series_steps: int = SERIES_STEPS, offset: int = 0
    ) -> None:
        self.window_steps = window_steps
        #: The window: one packed column of int64 per step field any group of this attempt
        #: carried (:data:`UNMEASURED` at a step that did not carry it), in arrival order,
        #: the latest ``window_steps`` steps at its end; a field never carried has no column.
        self.columns: dict[str, array] = {}
        self.fold_steps = min(FOLD_STEPS, window_steps)
        self.pending = 0  # steps at the window's end not folded into the series yet
        self.chunk = self.fold_steps - offset % self.fold_steps  # steps the next fold takes
        #: The highest step stored: its measured fields' values (a field it did not measure
        #: is absent, or None), None before the first.
        self.last: dict[str, int | None] | None = None
        self._plan: tuple | None = None  # how the latest group was folded: see _plan_of
        self._series = _Series(series_steps)

    def _state(self) -> dict:
        """A copy of the instance's fields but the fold's plan (made again at the next fold):
        what both pickling paths start from."""
        state = dict(self.__dict__)
        state.pop("_plan", None)
        return state

    def __getstate__(self) -> dict:
        """What a checkpoint keeps: the window's steps (not the columns' slack beyond them:
        :data:`WINDOW_SLACK`) and all the rest but the fold's plan (made again at the next
        fold)."""
        state = self._state()
        size = self.size
        state["columns"] = {name: c[len(c) - size :] for name, c in self.columns.items()}
        return state

    def __setstate__(self, state: dict) -> None:
        """Restore a checkpointed state (a step field added since it was written, a new phase,
        reads as not measured at every step it holds, as a replay of those steps would)."""
        self._plan = None
        self.__dict__.update(state)

    def reduce_to_row(self) -> tuple:
        """This state's pickle reduction for its rank's checkpoint row: its series and its
        window left out (a checkpoint keeps them in rows of their own, written as they change:
        :mod:`traceml_aggregator.checkpoint`), named by ``series.folds`` and by the window's
        fields and size (steps); unpickled, the state waits for :meth:`attach_series` and
        :meth:`attach_window`."""
        state = self._state()
        state["_series"] = self._series.folds
        state["columns"] = (tuple(self.columns), self.size)
        return copyreg.__newobj__, (StepState,), state

    def window_tail(self, count: int) -> dict[str, array]:
        """The window's last ``count`` steps (at most :attr:`size`), each measured field's as
        a packed int64 column (:data:`UNMEASURED` at a step that did not measure it): what a
        checkpoint writes of the window, a span of the steps since its last one at a time."""
        return {name: column[len(column) - count :] for name, column in self.columns.items()}

    def attach_window(self, spans: list[tuple[int, dict[str, array]]]) -> None:
        """Give a state unpickled from :meth:`reduce_to_row` its window back, from ``spans``:
        ``(steps, columns)`` of consecutive spans of the attempt's steps (each as
        :meth:`window_tail` gave it), oldest first, the last ending at its latest step; a
        field absent from a span was not measured at its steps (it was first measured
        later).

        Raises:
            ValueError: the spans hold fewer steps than the window.
        """
        names, size = self.columns
        if sum(steps for steps, _ in spans) < size:
            raise ValueError(f"a rank's window rows hold fewer than its {size} steps")
        columns = {}
        for name in names:
            column = array("q")
            for steps, span in spans:
                values = span.get(name)
                column.extend(array("q", (UNMEASURED,)) * steps if values is None else values)
            columns[name] = column[len(column) - size :]
        self.columns = columns

    def attach_series(self, series: _Series) -> None:
        """Give a state unpickled from :meth:`reduce_to_row` its series back.

        Raises:
            ValueError: ``series`` is not the one the state was pickled with (another count
                of folded chunks).
        """
        if self._series != series.folds:
            raise ValueError(
                f"a rank's steps name a series of {self._series} folded chunks, not {series.folds}"
            )
        self._series = series

    @property
    def measured(self) -> KeysView[str]:
        """The step fields any group of this attempt carried (a field never carried is None at
        every step of the window)."""
        return self.columns.keys()

    @property
    def size(self) -> int:
        """Steps in the window: all those folded so far, at most ``window_steps``."""
        steps = self.columns.get("step")
        return min(len(steps), self.window_steps) if steps is not None else 0

    def fold(self, names, columns) -> None:
        """Fold one step group in: ``names`` its measured fields, ``columns`` one sequence of
        ints per name (None allowed where not measured), steps in arrival order. Costs
        O(the group): one C-level ``extend`` per measured field, every :data:`WINDOW_SLACK`
        steps a move of the window, and every :data:`FOLD_STEPS` steps one chunk of NumPy
        work."""
        n = len(columns[0])
        if not n:
            return
        # Each column copied out at once (a C slice; protobuf repeated fields, as the store
        # decoded them, cost ~0.4-1.3 µs of wrapper calls a pass, and this fold makes three),
        # here and not in the decode: lists held from the store's transaction to this fold
        # were a young collection of the cyclic collector every ~50,000 of them.
        columns = [column[:] for column in columns]
        plan = self._plan
        if plan is None or plan[0] != names:
            plan = self._plan = self._plan_of(names)
        _, given, missing = plan
        steps = columns[given[0][1]]
        highest = max(steps)
        if self.last is None or highest >= self.last["step"]:
            top = n - 1 if steps[n - 1] == highest else steps.index(highest)
            self.last = dict(zip(names, [column[top] for column in columns], strict=True))
        start = 0
        while start < n:  # pieces that fill the pending chunk at most
            end = min(n, start + self.chunk - self.pending)
            whole = start == 0 and end == n
            held = len(given[0][2])  # every column holds as many steps
            for _, index, column in given:
                try:
                    column.extend(columns[index] if whole else columns[index][start:end])
                except TypeError:  # a None among them (stored rows replayed)
                    _extend_marked(column, held, columns[index][start:end])
            if missing:
                holes = array("q", (UNMEASURED,)) * (end - start)
                for column in missing:
                    column.extend(holes)
            self.pending += end - start
            if self.pending == self.chunk:
                self._series.fold(self._arrays(self.pending))
                self.pending, self.chunk = 0, self.fold_steps
            start = end
        excess = len(given[0][2]) - self.window_steps
        if excess >= WINDOW_SLACK:
            for column in self.columns.values():
                del column[:excess]

    def _plan_of(self, names) -> tuple:
        """How a group that measured the fields ``names`` is folded, kept in :attr:`_plan`
        while the groups measure the same fields (the common case): ``(names, ((field, its
        value's index in the group, its window column) of each step field among names,
        "step" first), (the window columns of the fields measured before but not among
        them))``. A field measured for the first time gets a column, :data:`UNMEASURED` at
        the steps the window holds already.

        Raises:
            KeyError: ``names`` lacks ``step`` (the sender's bug; its store refused it).
        """
        if "step" not in names:
            raise KeyError("step")  # a group without its steps' indices
        held = len(self.columns["step"]) if self.columns else 0
        for name in names:
            if name not in self.columns:
                self.columns[name] = array("q", (UNMEASURED,)) * held
        self.columns = {name: self.columns[name] for name in STEP_FIELDS if name in self.columns}
        index = {name: i for i, name in enumerate(names)}
        given = [(name, index[name], c) for name, c in self.columns.items() if name in index]
        given.sort(key=lambda g: g[0] != "step")
        missing = [c for name, c in self.columns.items() if name not in index]
        return names, given, missing

    def tail(self, count: int) -> dict[str, tuple]:
        """The last ``count`` window steps (all when fewer) of each field in
        :attr:`measured`, oldest first, in :data:`STEP_FIELDS` order (None where a step did
        not measure it): O(count x fields measured); the fields left out are None at every
        step."""
        return {name: tuple(values) for name, values in self._values(count).items()}

    def latest(self, count: int) -> dict[str, list]:
        """The last ``count`` window steps (all when fewer), oldest first, as one list per
        step field (None where a step did not measure it): O(count x step fields)."""
        values = self._values(count)
        nones = [None] * min(count, self.size)
        return {name: values.get(name) or list(nones) for name in STEP_FIELDS}

    def _arrays(self, count: int) -> dict[str, np.ndarray]:
        """The last ``count`` window steps (all when fewer) of each measured field, as int64
        arrays (copies; :data:`UNMEASURED` where not measured): what the series folds."""
        count = min(count, self.size)
        return {
            name: np.frombuffer(column[len(column) - count :], dtype=np.int64)
            for name, column in self.columns.items()
        }

    def _values(self, count: int) -> dict[str, list]:
        """The last ``count`` window steps of each measured field, as lists (None where not
        measured)."""
        return {
            name: _listed(values, values == UNMEASURED)
            for name, values in self._arrays(count).items()
        }

    @property
    def series(self) -> _Series:
        """The digest and the sample, as folded so far (the pending steps not yet: see
        :meth:`final`); it changes only as a chunk is folded in (``series.folds``)."""
        return self._series

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
            series.fold(self._arrays(self.pending))
        columns = series.sample
        if self.last is not None and self.last["step"] not in set(columns["step"]):
            for name, column in columns.items():
                column.append(self.last.get(name))
        return in_step_order(columns), (series.digest if series.level else None)


def _extend_marked(column: array, held: int, values) -> None:
    """Append ``values`` (ints, None where not measured) to the window column ``column`` after
    its first ``held`` steps (what a failed ``extend`` appended before its None is let go):
    :data:`UNMEASURED` for each None."""
    del column[held:]
    column.extend([UNMEASURED if v is None else v for v in values])


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
