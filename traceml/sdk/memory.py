"""GPU memory of a rank, from PyTorch's CUDA caching allocator (only the process can read it).

Step peaks, cheaply. ``torch.cuda.max_memory_allocated()`` costs about 90-115 µs per call on an
H200 (measured for issue 5): it builds the allocator's whole statistics dictionary and then
flattens it in Python. :class:`StepMemory` instead reads the nested statistics once every N
steps (``TRACEML_MEMORY_EVERY_N_STEPS``, default 10; the steps whose index is a multiple of N)
with ``torch.cuda.memory_stats_as_nested_dict`` (no flattening) and resets the peaks with
``torch.cuda.reset_peak_memory_stats``. The step that carries ``peak_allocated_bytes`` and
``peak_reserved_bytes`` therefore reports the highest allocated and reserved bytes since the
previous read: the window of steps it closes. The peaks are reset once, at the end of the first
step the device is used, so model loading does not count; the first window is that of the
steps after it. A user who resets the peaks too shortens the window, never makes it wrong.

Current figures (``ProcessSample.gpu_allocated_bytes``/``gpu_reserved_bytes``) come from the
same statistics, read by the rank's sampler thread about once per second (:func:`allocator_bytes`).
Both take the device index explicitly: from a background thread the "current device" would be
device 0.
"""

from __future__ import annotations

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
    """The tracer's ``memory_reader``: peaks over the last N steps on the step closing them.

    Args:
        device: the rank's device (peaks are read only once the training thread has used it).
        every_n: read (and reset) the peaks at the end of steps whose index is a multiple of it.
    """

    def __init__(self, device: RankDevice, every_n: int) -> None:
        self.device = device
        self.every_n = every_n
        self._started = False
        self._failed = False

    def __call__(self, measurement) -> None:
        """At the end of a step (training thread): fill the peaks every N steps. An allocator
        error turns step memory off with one warning (raised under ``TRACEML_STRICT=1``)."""
        index = self.device.index
        if index is None or self._failed:
            return
        try:
            self._read(index, measurement)
        except Exception as exc:
            self._failed = True
            fail_open("reading step memory peaks", exc)

    def _read(self, index: int, measurement) -> None:
        if not self._started:
            torch.cuda.reset_peak_memory_stats(index)
            self._started = True
            return
        if measurement.step % self.every_n:
            return
        stats = _stats(index)
        measurement.peak_allocated_bytes = stats["allocated_bytes"]["all"]["peak"]
        measurement.peak_reserved_bytes = stats["reserved_bytes"]["all"]["peak"]
        torch.cuda.reset_peak_memory_stats(index)
