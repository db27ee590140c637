"""The CUDA device a rank trains on: the one its work uses, never one it does not touch.

The training thread's "current device" is not the rank's device: a DDP or FSDP script that
moves its model with ``.to(f"cuda:{local_rank}")`` or passes ``device_ids=[k]`` and never calls
``torch.cuda.set_device`` leaves the current device at 0 on every rank (PyTorch creates no
context there for such ranks), and a stray op that does create one would make every rank
look like GPU 0. :class:`RankDevice` therefore takes the device from evidence, in this order:

1. the traced model's first parameter (``trace_step(model)``, or the zero-code root model),
   when it is on a CUDA device;
2. the destination of the rank's first host-to-device copy (the H2D hook notes it);
3. ``LOCAL_RANK`` modulo the number of devices the rank sees (after ``CUDA_VISIBLE_DEVICES``:
   a launcher that gives each rank one GPU leaves it device 0), when ``LOCAL_RANK`` is set;
4. the training thread's current device, for a process that no launcher started.

A candidate is taken only once it has a primary context (the rank has used it): polling never
creates a context. The device is looked for on the training thread as steps open, never from
a background thread; once found, its index is passed explicitly to every later CUDA call
(allocator statistics, streams, events).
"""

from __future__ import annotations

import os
import weakref

import torch

from traceml.sdk import nvml

# Private in torch, but the only way to ask "does this device have a context?" without
# creating one; absent in CPU builds (where CUDA is never used anyway).
_has_primary_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)


class TorchProbe:
    """What :class:`RankDevice` asks CUDA. None of these calls creates a context or initialises
    CUDA (they are asked only once PyTorch's CUDA state exists)."""

    @staticmethod
    def initialized() -> bool:
        """True once the process has initialised PyTorch's CUDA state (the user did)."""
        return torch.cuda.is_initialized()

    @staticmethod
    def device_count() -> int:
        """Devices the process sees (after ``CUDA_VISIBLE_DEVICES``)."""
        return torch.cuda.device_count()

    @staticmethod
    def has_context(index: int) -> bool:
        """True when device ``index`` has a primary context (someone used it)."""
        return _has_primary_context is not None and bool(_has_primary_context(index))

    @staticmethod
    def current_device() -> int:
        """The calling thread's current device index."""
        return torch.cuda.current_device()


def _int_env(environ, name: str) -> int | None:
    try:
        return int(environ[name])
    except (KeyError, ValueError):
        return None


def cuda_index_of(model) -> int | None:
    """The CUDA device index of ``model``'s first parameter, None when it has none or it is not
    on a CUDA device (CPU, meta). Reads one parameter's ``device``: no CUDA call."""
    param = next(iter(model.parameters()), None)
    if param is None:
        return None
    device = param.device
    return device.index if device.type == "cuda" and device.index is not None else None


class RankDevice:
    """The rank's CUDA device, once the rank has used one (see the module docstring).

    Args:
        probe: the CUDA questions (:class:`TorchProbe`; replaceable to test without CUDA).
        environ: where ``LOCAL_RANK`` is read (the process environment by default).

    Attributes:
        index: the CUDA device index (as the rank sees it, after ``CUDA_VISIBLE_DEVICES``), or
            None while no used device has been found.
    """

    def __init__(self, probe=TorchProbe, environ=None) -> None:
        self.index: int | None = None
        self._uuid: str | None = None
        self._probe = probe
        self._local_rank = _int_env(os.environ if environ is None else environ, "LOCAL_RANK")
        self._model: weakref.ref | None = None
        self._copied: int | None = None

    def note_model(self, model) -> None:
        """The rank's model (held weakly): its parameters' device is the best evidence."""
        if self.index is None:
            self._model = weakref.ref(model)

    def note_copy(self, index: int) -> None:
        """A host-to-device copy of the rank went to device ``index`` (the first one counts)."""
        if self._copied is None:
            self._copied = index

    def poll(self) -> bool:
        """Called on the training thread: True once the rank's device is found.

        A few attribute reads and C calls per step until then (none creates a context), one
        attribute read afterwards. Never raises: a CUDA error reads as "not found yet".
        """
        if self.index is not None:
            return True
        try:
            if not self._probe.initialized():
                return False
            index = self._candidate()
            if index is None or not self._probe.has_context(index):
                return False
        except Exception:
            return False
        self.index = index
        return True

    def _candidate(self) -> int | None:
        model = self._model() if self._model is not None else None
        if model is not None:
            index = cuda_index_of(model)
            if index is not None:
                return index
        if self._copied is not None:
            return self._copied
        if self._local_rank is not None:
            visible = self._probe.device_count()
            return self._local_rank % visible if visible > 0 else None
        return self._probe.current_device()

    def uuid(self) -> str:
        """The device's UUID as NVML writes it (``GPU-…`` or ``MIG-…``), "" when unknown.

        CUDA gives the UUID without a prefix; NVML is asked which of its GPUs or MIG slices
        carries it, so the rank can be matched to the node sampler's GPU samples whatever
        ``CUDA_VISIBLE_DEVICES`` holds. Without NVML the prefix is ``GPU-``. Opens NVML once
        (tens of ms): call it off the training thread.
        """
        if self._uuid is None:
            if self.index is None:
                return ""
            bare = str(torch.cuda.get_device_properties(self.index).uuid)
            self._uuid = nvml.find_uuid(bare) or f"GPU-{bare}"
        return self._uuid
