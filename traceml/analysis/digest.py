"""Bounded step statistics of one rank: what the summary reads when its series is a sample.

The aggregator keeps every rank's steps in full resolution only while the rank has stored at
most ``SERIES_STEPS`` of them (:mod:`traceml_aggregator.aggregates`); past that, the series the
analysis sees is a uniform sample of the steps, and the per-rank figures come from a
:class:`RankDigest` folded as batches commit: exact step counts, sums, maxima and measured
counts, and for medians and p95 a logarithmic quantile sketch (:class:`LogHistogram`, the
bucketing of DDSketch: Masson, Rim and Lee, VLDB 2019) whose memory does not grow with the run.

**Error bound.** Every quantile a :class:`LogHistogram` returns is within ``ALPHA`` (0.5 %)
relative error of the exact one: a value v > 0 lands in bucket k = ceil(log_gamma v), gamma =
(1 + ALPHA) / (1 - ALPHA), whose estimate 2 gamma^k / (gamma + 1) is within ALPHA of every value
of the bucket; the two order statistics a percentile interpolates between are each estimated
so, and the interpolation is a convex combination of them. Zero is counted exactly. Counts,
sums, means and maxima are exact.

A digest covers the rank's steps from step index :data:`~traceml.analysis.thresholds.WARMUP_STEPS`
on (the warm-up the window leaves out), not only the steps common to every rank as the window
does; it does not depend on the order in which the steps arrive;
the parts of a step are split exactly as :func:`traceml.analysis.phases.part_columns` splits
them, on both clocks: the CPU clock over every step, the GPU clock over the GPU-timed ones.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Mapping
from typing import Any, TypedDict

import numpy as np

from traceml.analysis import thresholds as th
from traceml.analysis.document import CPU, GPU, PARTS
from traceml.analysis.stats import Description
from traceml.core import phases as table

#: Relative accuracy of every sketched quantile (fraction: 0.005 = 0.5 %).
ALPHA = 0.005
_GAMMA = (1.0 + ALPHA) / (1.0 - ALPHA)
_LOG_GAMMA = math.log(_GAMMA)

#: (part name, CPU-clock field, GPU-clock field or None) of the measured phases that are parts.
_PHASES = tuple((p.name, p.cpu_field, p.gpu_field) for p in table.PHASES if p.part)
_NAN = float("nan")


class DigestFigures(TypedDict):
    """A digest's figures on one clock (:meth:`RankDigest.figures`), as
    :class:`traceml.analysis.phases.Profile` holds them."""

    #: The in-step time (ms), None when no step was counted.
    step_ms: Description | None
    #: Part (and ``dataloader_next``) -> its median, ms; None when never measured.
    median_ms: dict[str, float | None]
    #: Part -> its share of the in-step time, %; None when never measured.
    share_pct: dict[str, float | None]
    #: The median of forward + optimizer per step, ms; None when never measured.
    own_compute_ms: float | None


class LogHistogram:
    """A quantile sketch of non-negative values: DDSketch's logarithmic buckets, dense.

    Memory is one counter per bucket between the smallest and the largest value seen: about
    ``ln(max / min) / ln(gamma)`` counters (about 460 for values spanning a factor of 100),
    whatever the number of values. See the module docstring for the error bound.
    """

    __slots__ = ("zeros", "offset", "counts")

    def __init__(self) -> None:
        self.zeros = 0
        self.offset = 0
        self.counts = np.zeros(0, dtype=np.int64)

    def __len__(self) -> int:
        return self.zeros + int(self.counts.sum())

    def __getstate__(self) -> tuple[int, int, bytes]:
        """``(zeros, offset, the counters' int64 bytes)``: what a checkpoint keeps. Plain
        bytes, not the array: pickling a NumPy array cost ~2 µs, ~20 of them a rank (most
        still empty), which made the digest 80 % of a rank's checkpoint row's pickling."""
        return self.zeros, self.offset, self.counts.tobytes()

    def __setstate__(self, state: tuple[Any, ...]) -> None:
        """Take :meth:`__getstate__`'s state back, or the slots' own of a checkpoint of layout
        4 or before, ``(None, {slot: value})``, which held the array."""
        if len(state) == 2:
            slots = state[1]
            state = (slots["zeros"], slots["offset"], slots["counts"].tobytes())
        self.zeros, self.offset, raw = state
        self.counts = np.frombuffer(raw, dtype=np.int64).copy()

    def copy(self) -> LogHistogram:
        """An independent copy."""
        other = LogHistogram()
        other.zeros, other.offset, other.counts = self.zeros, self.offset, self.counts.copy()
        return other

    def add(self, values: np.ndarray) -> None:
        """Count ``values`` (a float array, every value >= 0 and not NaN)."""
        positive = values[values > 0]
        self.zeros += len(values) - len(positive)
        if not len(positive):
            return
        keys = np.ceil(np.log(positive) / _LOG_GAMMA).astype(np.int64)
        lo, hi = int(keys.min()), int(keys.max())
        if not len(self.counts):
            self.offset, self.counts = lo, np.zeros(hi - lo + 1, dtype=np.int64)
        elif lo < self.offset or hi >= self.offset + len(self.counts):
            start = min(lo, self.offset)
            grown = np.zeros(max(hi, self.offset + len(self.counts) - 1) - start + 1, np.int64)
            grown[self.offset - start : self.offset - start + len(self.counts)] = self.counts
            self.offset, self.counts = start, grown
        self.counts += np.bincount(keys - self.offset, minlength=len(self.counts))

    def _value_at(self, cumulative: np.ndarray, rank: int) -> float:
        """The ``rank``-th smallest value (0-based), estimated."""
        if rank < self.zeros:
            return 0.0
        key = int(np.searchsorted(cumulative, rank - self.zeros, side="right")) + self.offset
        return 2.0 * _GAMMA**key / (_GAMMA + 1.0)

    def percentile(self, q: float) -> float | None:
        """The ``q``-th percentile (0-100), linear interpolation between the closest ranks as
        :func:`traceml.analysis.stats.percentile`; None when empty."""
        n = len(self)
        if not n:
            return None
        cumulative = np.cumsum(self.counts)
        pos = (n - 1) * q / 100.0
        lo = math.floor(pos)
        a = self._value_at(cumulative, lo)
        b = self._value_at(cumulative, min(lo + 1, n - 1))
        return a + (b - a) * (pos - lo)


class _Clock:
    """One clock's part statistics over its steps (µs): a sketch, exact sum and count each."""

    __slots__ = ("steps", "step_us", "outside_us", "hist", "sums", "measured")

    def __init__(self) -> None:
        self.steps = 0
        self.step_us = 0.0
        self.outside_us = 0.0
        names = PARTS + ("dataloader_next", "own_compute")
        self.hist = {name: LogHistogram() for name in names}
        self.sums = dict.fromkeys(names, 0.0)
        self.measured = dict.fromkeys(names, 0)

    def __setstate__(self, state: tuple[object, dict[str, object]]) -> None:
        """Restore a pickled clock (a checkpoint); a part added since it was written starts
        empty, as it would in a replay of steps that never measured it."""
        for name, value in state[1].items():
            setattr(self, name, value)
        for name in PARTS + ("dataloader_next", "own_compute"):
            if name not in self.hist:
                self.hist[name] = LogHistogram()
                self.sums[name] = 0.0
                self.measured[name] = 0

    def copy(self) -> _Clock:
        """An independent copy."""
        other = copy.copy(self)
        other.hist = {name: h.copy() for name, h in self.hist.items()}
        other.sums, other.measured = dict(self.sums), dict(self.measured)
        return other

    def add(self, name: str, values: np.ndarray) -> None:
        present = values[~np.isnan(values)]
        if len(present):
            self.hist[name].add(present)
            self.sums[name] += float(present.sum())
            self.measured[name] += len(present)


def _column(columns: Mapping[str, np.ndarray], name: str | None, n: int) -> np.ndarray:
    if name is None or name not in columns:
        return np.full(n, _NAN)
    return columns[name]


def _zero(values: np.ndarray) -> np.ndarray:
    """NaN (not measured) as 0; the values are durations or sizes, never negative."""
    zeroed: np.ndarray = np.fmax(values, 0.0)  # numpy types the ufunc's result as Any
    return zeroed


def _parts(columns: Mapping[str, np.ndarray], n: int, clock: str) -> dict[str, np.ndarray]:
    """:func:`traceml.analysis.phases.part_columns` on float columns (NaN: not measured)."""
    parts = {
        name: _column(columns, gpu if clock == GPU and gpu else cpu, n)
        for name, cpu, gpu in _PHASES
    }
    gap, loader = parts["input_wait"], _column(columns, "dataloader_next_us", n)
    if np.isnan(loader).all():
        outside = np.full(n, _NAN)
    else:  # traceml.analysis.outside.split_gap
        no_gap = np.isnan(gap)
        parts["input_wait"] = np.where(no_gap, loader, np.minimum(gap, _zero(loader)))
        outside = np.where(no_gap, _NAN, np.maximum(0.0, gap - _zero(loader)))
    phases = np.stack([parts[name] for name, _, _ in _PHASES])
    measured = ~np.isnan(phases).all(axis=0)
    body = columns["step_us"] - _zero(outside) - _zero(phases).sum(axis=0)
    parts["residual"] = np.where(measured, np.maximum(0.0, body), _NAN)
    parts["outside"] = outside
    forward, optimizer = parts["forward"], parts["optimizer"]
    either = ~(np.isnan(forward) & np.isnan(optimizer))
    parts["own_compute"] = np.where(either, _zero(forward) + _zero(optimizer), _NAN)
    parts["dataloader_next"] = loader
    return parts


class RankDigest:
    """One rank's (latest attempt's) step statistics, of a size that does not grow with the
    run (about 20 sketches of a few hundred counters each).

    Attributes:
        stored: steps folded in, warm-up included (the rank's stored steps: exact).
        in_step: sketch of each step's time without its outside-step time (µs).
        in_step_sum, in_step_max: their exact sum and maximum (µs).
        clocks: ``"cpu"`` (every counted step) and ``"gpu"`` (GPU-timed ones) part statistics.
        peak_allocated_bytes, peak_reserved_bytes: exact maxima of the memory readings, None
            before the first.
    """

    def __init__(self) -> None:
        self.stored = 0
        self.in_step = LogHistogram()
        self.in_step_sum = 0.0
        self.in_step_max: float | None = None
        self.clocks = {CPU: _Clock(), GPU: _Clock()}
        self.peak_allocated_bytes: int | None = None
        self.peak_reserved_bytes: int | None = None

    def copy(self) -> RankDigest:
        """An independent copy (O(the digest), not a deep copy of Python objects)."""
        other = copy.copy(self)
        other.in_step = self.in_step.copy()
        other.clocks = {name: c.copy() for name, c in self.clocks.items()}
        return other

    @property
    def counted(self) -> int:
        """Steps the statistics cover (stored minus warm-up: the steps of index below
        WARMUP_STEPS)."""
        return len(self.in_step)

    def fold(self, columns: Mapping[str, np.ndarray]) -> None:
        """Fold one run of steps in: step field -> float array, one value per step in step
        order or not (NaN where not measured; a field not measured at all may be absent). ``step``,
        ``end_us`` and ``step_us`` must be present."""
        n = len(columns["step_us"])
        self.stored += n
        for name in ("peak_allocated_bytes", "peak_reserved_bytes"):
            values = _column(columns, name, n)
            if not np.isnan(values).all():
                peak = int(np.nanmax(values))
                known = getattr(self, name)
                setattr(self, name, peak if known is None else max(known, peak))
        counted = columns["step"] >= th.WARMUP_STEPS
        if not counted.all():
            columns = {k: v[counted] for k, v in columns.items()}
            n = len(columns["step"])
            if not n:
                return
        cpu = _parts(columns, n, CPU)
        in_step = columns["step_us"] - _zero(cpu["outside"])
        self.in_step.add(in_step)
        self.in_step_sum += float(in_step.sum())
        top = float(in_step.max())
        self.in_step_max = top if self.in_step_max is None else max(self.in_step_max, top)
        self._fold_clock(self.clocks[CPU], columns["step_us"], cpu)
        timed = ~np.isnan(_column(columns, table.GPU_STEP_FIELD, n))
        if timed.any():
            gpu_columns = {k: v[timed] for k, v in columns.items()}
            gpu = _parts(gpu_columns, int(timed.sum()), GPU)
            self._fold_clock(self.clocks[GPU], gpu_columns["step_us"], gpu)

    @staticmethod
    def _fold_clock(clock: _Clock, step_us: np.ndarray, parts: dict[str, np.ndarray]) -> None:
        clock.steps += len(step_us)
        clock.step_us += float(step_us.sum())
        clock.outside_us += float(np.nansum(parts["outside"]))
        for name in clock.hist:
            clock.add(name, parts[name])

    def figures(self, clock: str) -> DigestFigures:
        """What :class:`traceml.analysis.phases.Profile` holds, on ``clock`` (ms, %); the step
        time is clock-independent, as in the window analysis."""
        c = self.clocks[clock]
        n = self.counted
        step_ms: Description | None = None
        p50, p95, top = self.in_step.percentile(50), self.in_step.percentile(95), self.in_step_max
        if n and p50 is not None and p95 is not None and top is not None:  # all set once n > 0
            step_ms = {
                "median": p50 / 1000.0,
                "mean": self.in_step_sum / n / 1000.0,
                "p95": p95 / 1000.0,
                "max": top / 1000.0,
                "count": n,
            }
        total_us = c.step_us - c.outside_us
        median_ms: dict[str, float | None] = {}
        share_pct: dict[str, float | None] = {}
        for name in PARTS:
            med = c.hist[name].percentile(50)
            median_ms[name] = None if med is None else med / 1000.0
            share_pct[name] = (
                100.0 * c.sums[name] / total_us if c.measured[name] and total_us else None
            )
        loader = c.hist["dataloader_next"].percentile(50)
        median_ms["dataloader_next"] = None if loader is None else loader / 1000.0
        own = c.hist["own_compute"].percentile(50)
        return {
            "step_ms": step_ms,
            "median_ms": median_ms,
            "share_pct": share_pct,
            "own_compute_ms": None if own is None else own / 1000.0,
        }
