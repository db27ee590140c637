"""A bounded, uniform series of one group's samples (a rank attempt's process samples, a node's
system or GPU samples), folded as they are stored, so that the final summary reads at most
:data:`SERIES_TICKS` sample times per group however long the run was.

The summary's sample figures (medians, peaks, RAM and memory slopes) are taken over the
samples of the run's analysis span, which for a long run is most of the run: read whole, a
3-day run of 1,024 ranks sampled once a second is ~560 M rows. The series keeps every
``2**level``-th sample time of its group (a *tick*: the distinct ``unix_us`` values in the
order they were stored, so the GPUs of one system sample stay together), and raises the level
(halving what it keeps) whenever more than :data:`SERIES_TICKS` ticks are kept. So a group
with at most :data:`SERIES_TICKS` sample times (~8.5 min at one sample a second) is summarized
from every sample, exactly as a full read of its rows, and a longer one from a uniform sample
of between half and all of :data:`SERIES_TICKS` of its sample times. The summary's figures
of a longer run are then those of the uniform sample: the median and slopes of a uniform
sample of the run's samples, a peak among them.

It is kept in the live aggregates' checkpoint (:mod:`traceml_aggregator.checkpoint`), folded
from the rows stored since the previous one, so a finalization (live, or ``--finalize-only``)
reads only the rows stored after the latest checkpoint.
"""

from __future__ import annotations

import numpy as np

from traceml.analysis.rundata import SampleColumns

#: Sample times kept per group at most (see the module docstring); the checkpoint holds
#: ``SERIES_TICKS x columns x 8`` bytes per group (24 KiB per rank for process samples).
SERIES_TICKS = 512


class SampleSeries:
    """The series of one group (see the module docstring).

    Attributes:
        level: every ``2**level``-th tick is kept.
        ticks: ticks folded in so far (kept or not).
        columns: the kept rows, column -> 1-D array (as :class:`SampleColumns`), in the order
            they were folded.
        tick: each kept row's tick (int64), aligned with ``columns``.
        ints: the integer columns (:attr:`SampleColumns.ints`).
    """

    def __init__(self) -> None:
        self.level = 0
        self.ticks = 0
        self.columns: dict[str, np.ndarray] = {}
        self.tick = np.empty(0, dtype=np.int64)
        self.ints: frozenset[str] = frozenset()

    def fold(self, samples: SampleColumns) -> None:
        """Fold the group's samples stored since the last fold in (``samples`` in time order,
        as :func:`~traceml_aggregator.load.sample_groups` yields them); O(len(samples) +
        the kept rows)."""
        if not samples:
            return
        times, tick_of = np.unique(samples.column("unix_us"), return_inverse=True)
        ticks = self.ticks + tick_of.reshape(-1).astype(np.int64)
        self.ticks += len(times)
        keep = ticks % (1 << self.level) == 0
        self.ints = samples.ints
        new = {name: column[keep] for name, column in samples.columns.items()}
        if self.columns:
            new = {name: np.concatenate([self.columns[name], new[name]]) for name in new}
        self.columns, self.tick = new, np.concatenate([self.tick, ticks[keep]])
        while len(np.unique(self.tick)) > SERIES_TICKS:
            self.level += 1
            stay = self.tick % (1 << self.level) == 0
            self.columns = {name: column[stay] for name, column in self.columns.items()}
            self.tick = self.tick[stay]

    def samples(self, order: tuple[str, ...]) -> SampleColumns:
        """The kept rows as :class:`SampleColumns`, sorted by the columns ``order`` (the
        record's ``ORDER``; ties in the order folded)."""
        if not self.columns:
            return SampleColumns({})
        by = np.lexsort([self.columns[name] for name in reversed(order)])
        return SampleColumns({k: c[by] for k, c in self.columns.items()}, self.ints)


def pack(groups: dict[tuple, SampleSeries]) -> tuple:
    """One sample table's series as a few arrays (what a checkpoint pickles: a handful of
    NumPy arrays per table, not per group, so unpickling it costs O(tables) arrays plus a
    small object per group): ``(keys, levels, ticks, ints, bounds, tick, columns)``, the
    groups' rows concatenated in key order, group ``i``'s at ``bounds[i]:bounds[i + 1]``.
    :func:`unpack` gives the series back."""
    keys = list(groups)
    kept = [groups[k] for k in keys]
    sizes = [len(s.tick) for s in kept]
    names = list(kept[0].columns) if kept else []
    return (
        keys,
        [s.level for s in kept],
        [s.ticks for s in kept],
        kept[0].ints if kept else frozenset(),
        np.cumsum([0, *sizes], dtype=np.int64),
        np.concatenate([s.tick for s in kept]) if kept else np.empty(0, np.int64),
        {name: np.concatenate([s.columns[name] for s in kept]) for name in names},
    )


def unpack(packed: tuple) -> dict[tuple, SampleSeries]:
    """The series :func:`pack` packed (each group's arrays are views of the packed ones)."""
    keys, levels, ticks, ints, bounds, tick, columns = packed
    groups: dict[tuple, SampleSeries] = {}
    for i, key in enumerate(keys):
        lo, hi = int(bounds[i]), int(bounds[i + 1])
        series = groups[key] = SampleSeries()
        series.level, series.ticks, series.ints = levels[i], ticks[i], ints
        series.tick = tick[lo:hi]
        series.columns = {name: column[lo:hi] for name, column in columns.items()}
    return groups
