"""The CUDA device a rank trains on, as its training thread sees it.

The device is found lazily, from the training thread, never from a background thread: CUDA's
current device is per thread, so a background thread asking for "the current device" gets
device 0, and touching it would create a context on a GPU the rank may not own. Once found,
the index is passed explicitly to every later CUDA call (allocator statistics, streams).
"""

from __future__ import annotations

import torch

from traceml.sdk import nvml

# Private in torch, but the only way to ask "does this device have a context?" without
# creating one; absent in CPU builds (where CUDA is never used anyway).
_has_primary_context = getattr(torch._C, "_cuda_hasPrimaryContext", None)


class RankDevice:
    """The rank's CUDA device, once the training thread has used one.

    Attributes:
        index: the CUDA device index (as the rank sees it, after ``CUDA_VISIBLE_DEVICES``), or
            None while the rank has not run CUDA work.
    """

    def __init__(self) -> None:
        self.index: int | None = None
        self._uuid: str | None = None

    def poll(self) -> bool:
        """Called on the training thread: True once the rank's current device is in use.

        A device counts as in use when PyTorch's CUDA state is initialised and the current
        device already has a primary context; polling never creates one. A few C calls per step
        until the device is found, one attribute read afterwards. Never raises: a CUDA error
        reads as "not in use yet".
        """
        if self.index is not None:
            return True
        if not torch.cuda.is_initialized():
            return False
        try:
            index = torch.cuda.current_device()
            if _has_primary_context is not None and not _has_primary_context(index):
                return False
        except Exception:
            return False
        self.index = index
        return True

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
