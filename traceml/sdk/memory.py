"""GPU memory of a rank, from PyTorch's CUDA caching allocator (only the process can read it).

Step peaks, cheaply and without touching the user's statistics.
``torch.cuda.max_memory_allocated()``
costs about 90-115 µs per call on an H200 (measured for issue 5): it builds the allocator's whole
statistics dictionary and then flattens it in Python. :class:`StepMemory` instead reads the
nested statistics once every N steps (``TRACEML_MEMORY_EVERY_N_STEPS``, default 10; the steps
whose index is a multiple of N) with ``torch.cuda.memory_stats_as_nested_dict`` (no
flattening). The step that carries ``peak_allocated_bytes`` and ``peak_reserved_bytes`` reports
the allocator's own peaks at that moment: the highest allocated and reserved bytes since the
process started, or since the user last called ``torch.cuda.reset_peak_memory_stats``.

TraceML never resets the peaks: a user who reads ``torch.cuda.max_memory_allocated()`` gets the
figure of their own window, not one of ours (earlier versions reset every N steps). The cost is
that a reading is a running peak, not the peak of the N steps it closes: memory creep shows as
a running peak that keeps rising, a plateau as one that stays flat, and a user's reset as a
drop. Model loading counts towards the first readings when it peaked higher than training.

Current figures (``ProcessSample.gpu_allocated_bytes``/``gpu_reserved_bytes``) come from the
same statistics, read by the rank's sampler thread about once per second (:func:`allocator_bytes`).
Both take the device index explicitly: from a background thread the "current device" would be
device 0.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from traceml.sdk.device import RankDevice
from traceml.sdk.failopen import fail_open


def _stats(index: int) -> dict:
    return torch.cuda.memory_stats_as_nested_dict(index)


def allocator_bytes(index: int) -> tuple[int, int] | None:
    """``(allocated, reserved)`` bytes held by the caching allocator on device ``index`` now,
    or None before PyTorch's CUDA state exists. Safe from any thread."""
    stats = _stats(index)
    if not stats:
        return None
    return stats["allocated_bytes"]["all"]["current"], stats["reserved_bytes"]["all"]["current"]


class StepMemory:
    """The tracer's ``memory_reader``: the allocator's running peaks on every N-th step.

    Args:
        device: the rank's device (peaks are read only once the training thread has used it).
        every_n: read the peaks at the end of steps whose index is a multiple of it.
        stats: ``stats(index)`` -> the allocator's nested statistics of device ``index``
            (``torch.cuda.memory_stats_as_nested_dict``; replaceable to test without CUDA).
    """

    def __init__(
        self, device: RankDevice, every_n: int, stats: Callable[[int], dict] = _stats
    ) -> None:
        self.device = device
        self.every_n = every_n
        self._stats = stats
        self._failed = False

    def __call__(self, measurement) -> None:
        """At the end of a step (training thread): fill the peaks (bytes) every N steps,
        reading the statistics only, never resetting them. An allocator error turns step
        memory off with one warning (raised under ``TRACEML_STRICT=1``)."""
        index = self.device.index
        if index is None or self._failed or measurement.step % self.every_n:
            return
        try:
            stats = self._stats(index)
            if stats:  # empty before PyTorch's CUDA state exists
                measurement.peak_allocated_bytes = stats["allocated_bytes"]["all"]["peak"]
                measurement.peak_reserved_bytes = stats["reserved_bytes"]["all"]["peak"]
        except Exception as exc:
            self._failed = True
            fail_open("reading step memory peaks", exc)
