"""Keeping the cyclic garbage collector off the objects a TraceML process starts with, and, in
the aggregator, spacing its collections out.

The aggregator and the ``traceml run`` launcher import their modules (grpc, protobuf, the
analysis) and build their servers before training starts, then live as long as the run: those
objects are never garbage, yet every full collection of Python's cyclic collector walks them
all. Measured on the 2-core test machine: about 38,000 objects in a serving aggregator, 22-24
ms of CPU per full collection (33,000 objects and 14 ms in a launcher), which the collector
runs a few times a minute as batches are folded in (``benchmarks/ddp_overhead.py`` saw one in
the middle of a 300-step window: about 75 µs of the aggregator's CPU per training step).

:func:`freeze_startup_objects` moves them to the collector's permanent generation
(:func:`gc.freeze`): later collections walk only what was allocated since (0.004 ms for a full
collection right after the freeze). Nothing else changes: reference counting frees what the
frozen objects drop, and new objects are collected as before. Never called in a rank: a
training script's heap is its own.

What the aggregator allocates while it serves is mostly short-lived (each batch's messages,
futures and rows, freed by reference counting within a writer transaction or two), but
CPython's default thresholds (a young collection every 700 allocations net of frees) promote
whatever is alive at that instant, and the live state of thousands of ranks is the old
generation that each full collection then walks. Measured at 8,000 ranks through node relays
(``benchmarks/ingest.py --ranks 8000 --records 2 --batches 15 --interval-sec 2 --wire relay
--sessions``, 16 s of its steady state): ~409,000 objects, 815 young, 74 middle and 7 full
collections taking 1.36 s of the 16 (~124 ms a full one): 8.5 % of a core, a fifth of the
aggregator's CPU. With :data:`SERVING_THRESHOLDS` (:func:`serving_heap`) the same 16 s had
2 young collections and 0.05 s. Garbage in reference cycles waits longer to be freed: at most
:data:`SERVING_YOUNG_THRESHOLD` objects' worth between two young collections.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

#: Allocations net of frees between two young collections while the aggregator serves
#: (CPython's default: 700).
SERVING_YOUNG_THRESHOLD = 50_000
#: The collector's thresholds while the aggregator serves (:func:`gc.set_threshold`): a young
#: collection every :data:`SERVING_YOUNG_THRESHOLD` allocations, a middle one every 20 young
#: ones, a full one every 10 middle ones (and, CPython's own rule, only when the objects that
#: survived since the last full one are a quarter of those it walked).
SERVING_THRESHOLDS = (SERVING_YOUNG_THRESHOLD, 20, 10)
#: How the aggregator's stop line of :class:`Collections` begins (``<this>: <the tally>``).
SERVING_TALLY = "cyclic garbage collector while serving"


def freeze_startup_objects() -> int:
    """Exempt every object alive now from future collections (:func:`gc.freeze`), once start-up
    is over; returns how many objects the permanent generation holds."""
    gc.freeze()
    return gc.get_freeze_count()


@dataclass
class Collections:
    """The cyclic collector's work since :func:`serving_heap` began: collections per
    generation (0 young, 1 middle, 2 full) and the seconds they took (wall clock, from each
    one's start to its end, the GIL held throughout)."""

    counts: list[int] = field(default_factory=lambda: [0, 0, 0])
    seconds: float = 0.0
    _started: float = 0.0

    def __call__(self, phase: str, info: dict[str, int]) -> None:  # a gc.callbacks entry
        if phase == "start":
            self._started = time.perf_counter()
        else:
            self.counts[info["generation"]] += 1
            self.seconds += time.perf_counter() - self._started

    def __str__(self) -> str:
        young, middle, full = self.counts
        return f"{young} young, {middle} middle, {full} full collections, {self.seconds:.2f} s"


@contextlib.contextmanager
def serving_heap() -> Iterator[Collections]:
    """While the aggregator serves: start-up objects frozen (:func:`freeze_startup_objects`),
    the collector at :data:`SERVING_THRESHOLDS`, its collections tallied in the yielded
    :class:`Collections`; on exit the thresholds it had are restored and the tally stops (an
    in-process caller's collector is left as it was, but for the objects frozen)."""
    freeze_startup_objects()
    before = gc.get_threshold()
    tally = Collections()
    gc.set_threshold(*SERVING_THRESHOLDS)
    gc.callbacks.append(tally)
    try:
        yield tally
    finally:
        gc.callbacks.remove(tally)
        gc.set_threshold(*before)
