"""Keeping the cyclic garbage collector off the objects a TraceML process starts with.

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
"""

from __future__ import annotations

import gc


def freeze_startup_objects() -> int:
    """Exempt every object alive now from future collections (:func:`gc.freeze`), once start-up
    is over; returns how many objects the permanent generation holds."""
    gc.freeze()
    return gc.get_freeze_count()
