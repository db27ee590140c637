"""The rank x step grid of a large run: the heatmap, the band over ranks and the slowest ranks
that the dashboard and the HTML report draw above :data:`SCALE_RANKS` ranks.

At 1,000 ranks one line per rank is unreadable and a straggler that the verdict has not named
yet hides among them. A :class:`Grid` holds one figure (step time, or one phase; ms) per rank
and per column of steps: the steps from the first to the last any rank has are cut into at most
:data:`GRID_COLUMNS` columns of equal width (``bin_steps`` steps each), a cell being the mean of
the rank's values in its column (NaN where the rank has none). From it:

* the heatmap: each cell as one of :data:`LEVELS` colour levels (:meth:`Grid.levels`) on a scale
  from the fastest rank's median to the slowest rank's (:meth:`Grid.scale`), so that a slow
  rank is a row of the hottest colour (:data:`COLORS`);
* the band: per column the minimum, median and maximum over the ranks (:meth:`Grid.band`);
* the slowest ranks: the :data:`SLOWEST_RANKS` ranks of the highest median over the columns
  (:meth:`Grid.slowest`), drawn as lines over the band.

Costs O(values) with numpy (1,024 ranks x 512 steps: a few ms).
"""

from __future__ import annotations

import functools
import math
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

#: Ranks above which the dashboard and the HTML report draw the heatmap, the band and the
#: sorted table instead of one line per rank ("a few dozen").
SCALE_RANKS = 32
#: Slowest ranks drawn as lines over the band, and listed first.
SLOWEST_RANKS = 8
#: Most columns of steps in a grid (each the mean of ``bin_steps`` steps).
GRID_COLUMNS = 128
#: Colour levels of a heatmap cell: 1 (fastest) .. LEVELS (slowest); 0 is "no step".
LEVELS = 255
#: The colour scale spans at least this fraction of its top (a balanced run's jitter is not
#: painted as contrast).
MIN_SPREAD = 0.1
#: Colour stops of the heatmap, level 1 to LEVELS, interpolated linearly (ColorBrewer YlOrRd).
COLORS = ("#ffffcc", "#fed976", "#fd8d3c", "#e31a1c", "#800026")
#: Colour of a cell without a step.
NO_DATA_COLOR = "#e8eaed"


@dataclass
class Grid:
    """One figure per rank and per column of steps (see the module docstring).

    Attributes:
        ranks: the rows' ranks, in rank order.
        first_step: the first step of column 0.
        bin_steps: steps per column (column ``c`` holds steps ``first_step + c * bin_steps``
            up to the next column's first).
        cells: ms, shape ``(len(ranks), columns)``, NaN where a rank has no step.
    """

    ranks: list[int]
    first_step: int
    bin_steps: int
    cells: np.ndarray

    @property
    def columns(self) -> int:
        """Columns of steps."""
        return self.cells.shape[1]

    def column_steps(self) -> list[int]:
        """The first step of each column."""
        return [self.first_step + c * self.bin_steps for c in range(self.columns)]

    @functools.cached_property
    def row_medians(self) -> np.ndarray:
        """Each rank's median over its columns, ms (NaN for a rank without steps)."""
        if not self.cells.size:
            return np.full(len(self.ranks), np.nan)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a row without steps: NaN
            return np.nanmedian(self.cells, axis=1)

    def slowest(self, k: int = SLOWEST_RANKS) -> list[int]:
        """The ``k`` ranks of the highest median, slowest first (ties: the lower rank)."""
        medians = self.row_medians
        order = sorted(
            (i for i in range(len(self.ranks)) if not math.isnan(medians[i])),
            key=lambda i: (-medians[i], self.ranks[i]),
        )
        return [self.ranks[i] for i in order[:k]]

    def scale(self) -> tuple[float, float]:
        """``(lo, hi)`` ms of the colour scale: the lowest and highest rank medians, ``lo``
        lowered so that ``hi - lo`` is at least :data:`MIN_SPREAD` of ``hi``; ``(0, 0)``
        without any step."""
        medians = self.row_medians
        medians = medians[~np.isnan(medians)]
        if not medians.size:
            return 0.0, 0.0
        hi = float(medians.max())
        lo = min(float(medians.min()), hi * (1.0 - MIN_SPREAD))
        return lo, hi

    def levels(self) -> bytes:
        """The cells as colour levels, row by row: 0 where no step, else 1 .. :data:`LEVELS`
        by the cell's place on :meth:`scale` (clipped at both ends)."""
        lo, hi = self.scale()
        span = hi - lo if hi > lo else 1.0
        scaled = np.clip((self.cells - lo) / span, 0.0, 1.0)
        out = np.where(np.isnan(self.cells), 0, 1 + np.rint(np.nan_to_num(scaled) * (LEVELS - 1)))
        return out.astype(np.uint8).tobytes()

    def band(self) -> dict[str, list[float | None]]:
        """Per column the ``min``, ``median`` and ``max`` over the ranks, ms (None where no
        rank has a step)."""
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", RuntimeWarning)  # a column without steps: NaN
            figures = {
                "min": np.nanmin(self.cells, axis=0) if self.cells.size else np.array([]),
                "median": np.nanmedian(self.cells, axis=0) if self.cells.size else np.array([]),
                "max": np.nanmax(self.cells, axis=0) if self.cells.size else np.array([]),
            }
        return {name: _plain(values) for name, values in figures.items()}

    def row(self, rank: int) -> list[float | None]:
        """Rank ``rank``'s cells, ms (None where no step)."""
        return _plain(self.cells[self.ranks.index(rank)])


def colour(x: float) -> str:
    """The colour at ``x`` (0: the fastest .. 1: the slowest) of :data:`COLORS`, ``#rrggbb``
    (the dashboard's script interpolates the same stops)."""
    at = min(max(x, 0.0), 1.0) * (len(COLORS) - 1)
    i = min(len(COLORS) - 2, int(at))
    a, b = (tuple(int(c[k : k + 2], 16) for k in (1, 3, 5)) for c in COLORS[i : i + 2])
    return "#" + "".join(f"{round(p + (q - p) * (at - i)):02x}" for p, q in zip(a, b, strict=True))


def _plain(values: np.ndarray) -> list[float | None]:
    return [None if math.isnan(v) else round(float(v), 3) for v in values]


def from_arrays(
    ranks: Sequence[int],
    row: np.ndarray,
    step: np.ndarray,
    value: np.ndarray,
    columns: int = GRID_COLUMNS,
) -> Grid:
    """The grid of values given point by point: point ``i`` is rank ``ranks[row[i]]``'s
    ``value[i]`` ms at step ``step[i]`` (NaN: not measured, left out).

    Args:
        ranks: the rows' ranks, in row order.
        row, step, value: equal-length arrays (row index, step index, ms).
        columns: most columns (fewer when there are fewer steps).
    """
    keep = ~np.isnan(value)
    row, step, value = row[keep], step[keep], value[keep]
    if not value.size:
        return Grid(list(ranks), 0, 1, np.full((len(ranks), 0), np.nan))
    first, last = int(step.min()), int(step.max())
    bin_steps = max(1, math.ceil((last - first + 1) / columns))
    width = (last - first) // bin_steps + 1
    cell = row.astype(np.int64) * width + (step.astype(np.int64) - first) // bin_steps
    size = len(ranks) * width
    sums = np.bincount(cell, weights=value, minlength=size)
    counts = np.bincount(cell, minlength=size)
    with np.errstate(invalid="ignore", divide="ignore"):
        cells = np.where(counts > 0, sums / np.maximum(counts, 1), np.nan)
    return Grid(list(ranks), first, bin_steps, cells.reshape(len(ranks), width))


def from_series(
    series: Mapping[int, tuple[Sequence[int], Sequence[float | None]]],
    columns: int = GRID_COLUMNS,
) -> Grid:
    """The grid of per-rank series: rank -> (steps, values in ms, None where not measured),
    rows in rank order."""
    ranks = sorted(series)
    rows, steps, values = [], [], []
    for i, r in enumerate(ranks):
        xs, ys = series[r]
        rows.append(np.full(len(xs), i, dtype=np.int64))
        steps.append(np.asarray(xs, dtype=np.int64))
        values.append(np.array(ys, dtype=float))
    if not ranks:
        return from_arrays([], np.array([], np.int64), np.array([], np.int64), np.array([]))
    return from_arrays(
        ranks, np.concatenate(rows), np.concatenate(steps), np.concatenate(values), columns
    )
